"""How long a mistyped tokenizer name takes to fail where the Hugging Face hub cannot be reached.

Why this benchmark exists
-------------------------
A new user types ``qwen-3`` for ``qwen3``. Without a network, ``AutoTokenizer.from_pretrained``
retries the hub (``huggingface_hub``'s backoff: 1 + 2 + 4 + 8 + 8 s, twice) before its error,
so the first thing the user sees is a minute of silence. :func:`tokengym.envs.load_tokenizer`
asks the hub once per process (at most ``HUB_PROBE_TIMEOUT_S``), then tries only the local
cache and names the closest known tokenizer. The goal: the error in under a second once the
libraries are imported, i.e. more than 10x sooner than the baseline.

What is measured (in one run, side by side)
-------------------------------------------
* ``AutoTokenizer.from_pretrained(name)``: the baseline, what ``load_tokenizer`` called before.
* ``load_tokenizer(name)``: the first call of the process (it includes the hub probe).

Both must raise ``OSError``. The hub's state is printed: where it answers, both fail fast
(a 404) and the ratio says nothing about the offline case.

Run: ``python benchmarks/tokenizer_typo.py [--name qwen-3]``.
"""

from __future__ import annotations

import argparse
import time


def timed(fn) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        fn()
    except OSError as err:
        return time.perf_counter() - start, str(err).splitlines()[0][:160]
    raise SystemExit("expected an OSError: the name loaded")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="qwen-3")
    args = p.parse_args()

    import transformers
    from transformers import AutoTokenizer

    from tokengym.envs import tokenizers

    transformers.logging.set_verbosity_error()
    new_s, new_msg = timed(lambda: tokenizers.load_tokenizer(args.name))
    print(f"hub: {tokenizers.hub_unreachable_reason() or 'reachable'}")
    base_s, base_msg = timed(lambda: AutoTokenizer.from_pretrained(args.name))
    print(f"{'AutoTokenizer.from_pretrained':32s} {base_s:8.2f} s  {base_msg}")
    print(f"{'load_tokenizer':32s} {new_s:8.2f} s  {new_msg}")
    print(f"ratio (baseline / load_tokenizer): {base_s / max(new_s, 1e-9):.0f}x")


if __name__ == "__main__":
    main()
