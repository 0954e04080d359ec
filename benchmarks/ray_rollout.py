"""The Ray backend on one machine: its overhead against the local backend, and how it scales with nodes.

Why: the Ray backend exists for rollouts whose env side (tools, sandboxes) needs more
CPUs than one process can use. Two measurements, each against the local backend in the
same run, with a scripted policy (instant, so only the driver and the env side count):

1. **Overhead of the actors**: ``tokengym/Calculator-v0`` episodes (a tool call, then an
   answer) on the local backend and on a local Ray (env workers and one engine as actors).
   Light episodes make the per-request cost of actors (pickling, scheduling, the hop from
   worker to engine) as visible as it can be.
2. **Scaling with CPU-bound tools**: episodes whose tool burns ``--work-ms`` of pure-Python
   CPU per call (it holds the GIL, as most Python tools do), on the local backend (one
   process: threads cannot run such tools in parallel) and on a cluster of 1, 2 and 3
   simulated nodes of one CPU each (``ray.cluster_utils.Cluster``), one env worker per node.

Actor start-up (importing tokengym, loading tokenizers, in every worker and engine) is
reported on its own: a backend used as a context manager pays it once per session. Every
figure is the median of ``--repeats`` timed runs after one warm-up run.

    python benchmarks/ray_rollout.py                 # needs Ray: pip install "tokengym[ray]"
    python benchmarks/ray_rollout.py --episodes 48 --work-ms 40 --nodes 1 2 3 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node on loopback

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tokengym.envs import CalculatorEnv, load_tokenizer  # noqa: E402
from tokengym.policies import scripted_replies  # noqa: E402
from tokengym.recorder.drivers.ray_backend import RayBackend  # noqa: E402
from tokengym.recorder.drivers.rollout import rollout  # noqa: E402

CALC_CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
WORK_CALL = '<tool_call>\n{"name": "work", "arguments": {"n": 21}}\n</tool_call>'


def burn(ms: float) -> None:
    """``ms`` milliseconds of this thread's CPU time in pure Python."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass


class WorkCalculator(CalculatorEnv):
    """tokengym/Calculator-v0 plus a ``work`` tool that burns ``work_ms`` of CPU per call."""

    def __init__(self, tokenizer, work_ms: float, max_turns: int) -> None:
        self.work_ms = work_ms
        super().__init__(tokenizer, tool_factory=self._tools, tool_timeout=600, max_turns=max_turns)

    def _tools(self, task):
        work_ms = self.work_ms

        def work(n: int) -> int:
            """Work on a number.

            Args:
                n: the number to work on
            """
            burn(work_ms)
            return 2 * n

        return [work]


def timed(run, repeats: int) -> dict:
    """One warm-up run (actor start-up included), then the median of ``repeats`` timed runs.

    A run's time is its ``stats.wall_s``: from the first episode started to the last one in,
    without making the envs (local backend) or starting the actors (Ray backend).
    """
    first = run()
    walls, episodes, failed = [], first.stats.episodes, first.stats.failed
    for _ in range(repeats):
        r = run()
        walls.append(r.stats.wall_s)
        failed += r.stats.failed
    wall = statistics.median(walls)
    return {
        "episodes": episodes, "failed": failed, "wall_s": wall, "episodes_per_s": episodes / wall,
        "startup_s": first.stats.startup_s, "walls": walls, "per_node": dict(first.stats.per_node),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--work-ms", type=float, default=40.0, help="CPU per tool call in the scaling runs")
    p.add_argument("--calls", type=int, default=3, help="tool calls per episode in the scaling runs")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    tok = load_tokenizer("qwen2.5")
    kw = dict(episodes=args.episodes, concurrency=args.concurrency, seed=0, progress=False)
    results: dict = {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}

    # 1. overhead: light Calculator-v0 episodes, local backend vs a local Ray
    policy = functools.partial(scripted_replies, (CALC_CALL, "<answer>5</answer>"), "qwen2.5")
    env_kwargs = {"tokenizer": "qwen2.5", "max_turns": 3}  # each env worker loads it once
    local_policy, local_kwargs = policy(), {**env_kwargs, "tokenizer": tok}
    results["overhead"] = {
        "local": timed(lambda: rollout("tokengym/Calculator-v0", local_policy, env_kwargs=local_kwargs, **kw), args.repeats)
    }
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        with RayBackend() as backend:
            results["overhead"]["ray"] = timed(
                lambda: rollout("tokengym/Calculator-v0", policy, env_kwargs=env_kwargs, backend=backend, **kw), args.repeats
            )
    finally:
        ray.shutdown()

    # 2. scaling: CPU-bound tools, local backend vs 1..3 simulated nodes of one CPU
    make_env = functools.partial(WorkCalculator, tok, args.work_ms, args.calls + 1)
    work_policy = functools.partial(scripted_replies, (WORK_CALL,) * args.calls + ("<answer>42</answer>",), "qwen2.5")
    local_work = work_policy()
    results["scaling"] = {"local": timed(lambda: rollout(make_env, local_work, **kw), args.repeats)}
    for n in args.nodes:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            for _ in range(n - 1):
                cluster.add_node(num_cpus=1)
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            with RayBackend(num_workers=n) as backend:
                results["scaling"][f"ray {n} node{'s' if n > 1 else ''}"] = timed(
                    lambda: rollout(make_env, work_policy, backend=backend, **kw), args.repeats
                )
        finally:
            ray.shutdown()
            cluster.shutdown()
    results["load_avg_end"] = os.getloadavg()[0]

    print(f"\n{args.episodes} episodes, {args.concurrency} at a time, scripted policy; {os.cpu_count()} CPUs, "
          f"load average {results['load_avg_start']:.1f} at the start, {results['load_avg_end']:.1f} at the end\n")
    print("1. Overhead: tokengym/Calculator-v0 (a calculate call, then an answer)\n")
    base = results["overhead"]["local"]["episodes_per_s"]
    print("| backend | episodes/s | vs local | wall s | actor start-up s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results["overhead"].items():
        print(f"| {name} | {r['episodes_per_s']:.1f} | {r['episodes_per_s'] / base:.2f}x | {r['wall_s']:.2f} | {r['startup_s']:.1f} |")
    print(f"\n2. Scaling: {args.calls} calls of a {args.work_ms:.0f} ms CPU-bound tool per episode\n")
    base = results["scaling"]["local"]["episodes_per_s"]
    print("| backend | episodes/s | vs local | wall s | actor start-up s | episodes per node |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in results["scaling"].items():
        nodes = ", ".join(str(v) for v in sorted(r["per_node"].values())) or "-"
        print(f"| {name} | {r['episodes_per_s']:.1f} | {r['episodes_per_s'] / base:.2f}x | {r['wall_s']:.2f} | "
              f"{r['startup_s']:.1f} | {nodes} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
