"""The cost of scale: the local driver's CPU and memory per turn at 10 to 4,000 episodes in flight.

Why: one GPU serving a small model at short tool turns asks for well over a thousand turns a
second. Everything around the engine (the env's step, recording, the driver's bookkeeping)
runs in one Python process on one core; if a turn costs milliseconds there, the driver, not
the engine, sets the pace. This measures that share with no engine at all: a scripted policy
whose reply is ready at once, so every CPU second is the driver's and the env's.

Workload: ``tokengym/Calculator-v0`` with the real Qwen3 tokenizer and chat template, every
turn one ``calculate`` call (the same tokens each turn), ``max_turns=8``, no store. At each
size N, max(N, 400) episodes run with ``concurrency=N`` (N in flight at once), each in its own
subprocess so that the resident memory of one size does not carry into the next.

Side by side, in the same subprocess and on the same episodes:

* **bare step**: N envs, each episode ``reset`` then ``env.step(action)`` with the same action ids for 8
  turns, no wrapper, no driver: the floor, what the env itself costs;
* **rollout**: ``tokengym.recorder.rollout(...)`` at ``concurrency=N`` with its default
  settings (the progress bar on, drawn to this subprocess's stderr): the env plus the
  recorder (``RecordEpisodes``), the driver's slots, the request batcher and the event loop;
* **pool**: the same rollout with ``backend=ProcessBackend()`` (its defaults: one worker process
  per CPU but the driver's): the driver's own CPU per turn (the policy's core), the workers' CPU
  per turn, its start (until the first worker is ready) and its turns per second of wall time
  after it, against rollout's; its trajectories must be
  rollout's, token for token (the script fails otherwise).

The two run in alternating rounds (3 up to 1,000 in flight, 1 above: a VM's speed moves by 15%
from one run to the next) and each figure is the median of the rounds.

Reported per size: CPU per turn of each (process time, envs built before the timer for the
bare loop; inside it for rollout, as a user pays it), CPU per turn of rollout excluding the
builds, the ratio of rollout to the bare step, the growth of rollout's per-turn CPU from the
smallest size, resident memory per in-flight episode (the first round's: the growth of the
process's RSS from before the run to the moment the first episode ends, over N) and that over
its context tokens (the whole episode: env, renderer, recorder, driver), and, from one long episode of 128
turns under tracemalloc (logprobs recorded, as a sampling policy gives them), the bytes the
driver keeps per context token; a second episode with ~15x longer turns splits that into what
one more context token costs and what one more turn costs whatever its length.

Goals (the cost-of-scale issue), checked; the script exits 1 when one is missed:

* CPU per turn of driver + env at 1,000 in flight <= 0.5 ms on the driver's core (in one process,
  or with the env steps in the pool's workers), and rollout <= 1.5x the bare step;
* flat from the smallest to the largest size (ratio <= 1.2);
* <= 16 B per context token per in-flight episode: what the recorder and the driver keep (the
  long episode's), and the whole episode's resident memory at 1,000 in flight over its context
  (an env's own objects weigh on it at these short contexts).

    python benchmarks/scale.py                      # 10, 100, 1000, 4000 in flight
    python benchmarks/scale.py --sizes 10 100 --json out.json

The pool's crossover, where it passes rollout in turns per second, is reported as measured on
this machine, and the worker cores it needs from the measured costs (a worker's CPU per turn over
rollout's): on a machine with fewer cores the driver and the workers share them.

What it leaves out: a model (generation time and its variance), tool latency, the store, and
the Ray backend.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
from typing import Any

TURNS = 8
LONG_TURNS = 128
GOAL_MS = 0.5
GOAL_RATIO = 1.5
GOAL_FLAT = 1.2
GOAL_BYTES_PER_TOKEN = 16.0
CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>'


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _setup(max_turns: int = TURNS, **env_kwargs: Any) -> tuple[Any, list[int], Any]:
    import gymnasium as gym

    from tokengym.envs import load_tokenizer
    from tokengym.policies import ScriptedPolicy

    tok = load_tokenizer("qwen3")
    # a partial, not a closure: the pool sends it to its workers (the tokenizer goes with it, once a worker)
    make_env = functools.partial(gym.make, "tokengym/Calculator-v0", tokenizer=tok, max_turns=max_turns,
                                 disable_env_checker=True, **env_kwargs)

    env = make_env().unwrapped
    action = env.renderer.encode_action_text(CALL) + list(env.renderer.turn_end_ids)
    env.close()
    policy = ScriptedPolicy(lambda ctx: action, name="scripted-call")
    return make_env, action, policy


MIN_EPISODES = 400
"""Episodes run at every size (at ``concurrency=N``), so a small N is timed over enough turns too."""


def _bare(make_env: Any, act: Any, n: int, episodes: int) -> tuple[float, float, int]:
    """The bare loop: (CPU seconds of the episodes, CPU seconds building the n envs first, turns)."""
    t0 = time.process_time()
    envs = [make_env() for _ in range(n)]
    build_s = time.process_time() - t0
    turns = 0
    t0 = time.process_time()
    for i in range(episodes):
        env = envs[i % n]
        env.reset(seed=i)
        for _ in range(TURNS):
            _obs, _r, term, trunc, _info = env.step(act)
            turns += 1
            if term or trunc:
                break
    bare_s = time.process_time() - t0
    for env in envs:
        env.close()
    del envs
    gc.collect()
    return bare_s, build_s, turns


def rounds_at(n: int) -> int:
    """Rounds of each side at ``n`` in flight: a VM's speed moves by 15% from one run to the next,
    so the ratio is the median of paired rounds; the largest size (a minute a round) runs once."""
    return ROUNDS if n <= 1000 else 1


ROUNDS = 3


def measure(n: int) -> dict[str, Any]:
    """One size, in this process: the bare step loop, then rollout, on the same episodes, in
    :func:`rounds_at` alternating rounds."""
    import statistics

    import numpy as np

    from tokengym.recorder import rollout

    make_env, action, policy = _setup()
    act = np.array(action, dtype=np.int64)
    make_env()  # warm: imports, the first template compile
    rollout(make_env, policy, episodes=2, concurrency=2, progress=False)

    episodes = max(n, MIN_EPISODES)
    bare, builds, runs, ratios, rss = [], [], [], [], []
    for _round in range(rounds_at(n)):
        bare_s, build_s, turns = _bare(make_env, act, n, episodes)
        rss0 = _rss_bytes()
        peak = [rss0]
        finished = [0]

        def on_episode(_traj: Any) -> None:  # sampled as the first episode finishes: N are in flight then
            finished[0] += 1
            if finished[0] == 1:
                peak[0] = _rss_bytes()

        t0, w0 = time.process_time(), time.perf_counter()
        # the default progress bar (a user's run has it), onto this subprocess's stderr pipe
        res = rollout(make_env, policy, episodes=episodes, concurrency=n, on_episode=on_episode)
        run_s, wall_s = time.process_time() - t0, time.perf_counter() - w0
        assert res.stats.failed == 0, res.stats.errors[:3]
        assert res.stats.turns == turns, (res.stats.turns, turns)
        bare.append(bare_s / turns)
        builds.append(build_s / n)
        runs.append(run_s / turns)
        ratios.append(run_s / bare_s)
        rss.append((peak[0] - rss0) / n)
        if _round < rounds_at(n) - 1:
            del res
            gc.collect()
    context = int(np.mean([len(t.token_ids) for t in res.trajectories]))
    median = statistics.median
    return {**_pool(make_env, policy, episodes, n, res, wall_s), **{
        "in_flight": n,
        "turns": turns,
        "rounds": len(ratios),
        "bare_ms_per_turn": 1e3 * median(bare),
        "build_ms_per_env": 1e3 * median(builds),
        "rollout_ms_per_turn": 1e3 * median(runs),
        "rollout_ms_per_turn_without_builds": 1e3 * (median(runs) - median(builds) * n / turns),
        "ratio_to_bare": median(ratios),
        "ratios_to_bare": ratios,
        # the first round's: a later one reuses memory the one before freed to the allocator
        "rss_per_episode_kb": rss[0] / 1024,
        "context_tokens": context,
        "rss_bytes_per_context_token": rss[0] / context,
    }}


def _pool(make_env: Any, policy: Any, episodes: int, n: int, local: Any, local_wall_s: float) -> dict[str, Any]:
    """The same episodes through the process pool: the driver's CPU, the workers', the wall time."""
    from tokengym.recorder import rollout
    from tokengym.recorder.drivers.process_backend import ProcessBackend

    pool = ProcessBackend()
    t0, w0 = time.process_time(), time.perf_counter()
    res = rollout(make_env, policy, episodes=episodes, concurrency=n, progress=False, backend=pool)
    driver_s, wall_s = time.process_time() - t0, time.perf_counter() - w0
    assert res.stats.failed == 0, res.stats.errors[:3]
    for a, b in zip(local.trajectories, res.trajectories, strict=True):
        if a.metadata["episode"] != b.metadata["episode"] or a.token_ids.tolist() != b.token_ids.tolist():
            raise AssertionError(f"the pool changed a token: episode {a.metadata['episode']} / {b.metadata['episode']}")
    turns = res.stats.turns
    return {
        "pool_workers": len(pool.worker_pids),
        "pool_driver_ms_per_turn": 1e3 * driver_s / turns,
        "pool_worker_ms_per_turn": 1e3 * pool.worker_cpu_s / turns,
        "pool_start_s": res.stats.startup_s,
        "pool_turns_per_s": turns / (wall_s - res.stats.startup_s),  # once its first worker is ready
        "rollout_turns_per_s": turns / local_wall_s,
    }


PAD = "Let me think about it. "
"""Text before the call in the long-turn episode (x100: ~640 tokens a turn)."""


def _kept(words: int) -> tuple[int, int, int]:
    """(bytes, tokens, context tokens) the second half of one long episode adds, tracemalloc'd;
    each action is the call after ``words`` times :data:`PAD`, with logprobs, as a sampler gives them."""
    import numpy as np

    from tokengym.policies import Generation, SamplingParams
    from tokengym.recorder import RecordEpisodes
    from tokengym.recorder.drivers.episodes import EpisodeSlot, plan_tasks

    make_env, action, _policy = _setup(max_turns=LONG_TURNS + 1, max_context_tokens=10**7)
    env = make_env()
    r = env.unwrapped.renderer
    ids = r.encode_action_text(PAD * words + CALL) + list(r.turn_end_ids) if words else action
    slot = EpisodeSlot(RecordEpisodes(env, keep=False))
    slot.begin(plan_tasks([0], 0, SamplingParams(max_tokens=64))[0])
    gc.collect()
    tracemalloc.start()
    marks: dict[int, tuple[int, int]] = {}
    for turn in range(1, LONG_TURNS + 1):
        gen = Generation(np.array(ids), np.full(len(ids), -0.25, np.float32), "stop")
        assert slot.advance(gen, slot.step(gen)) is None
        if turn in (LONG_TURNS // 2, LONG_TURNS):
            gc.collect()
            marks[turn] = (tracemalloc.get_traced_memory()[0], env.unwrapped.num_tokens)
    tracemalloc.stop()
    (m1, t1), (m2, t2) = marks[LONG_TURNS // 2], marks[LONG_TURNS]
    return m2 - m1, t2 - t1, t2


def bytes_per_token() -> dict[str, Any]:
    """Memory one in-flight episode keeps per context token (the issue's workload: 42-token turns),
    and that split into what a context token costs and what a turn costs whatever its length
    (from a second episode whose turns are ~15x longer)."""
    short_b, short_t, tokens = _kept(0)
    long_b, long_t, _ = _kept(100)
    turns = LONG_TURNS - LONG_TURNS // 2
    per_token = (long_b - short_b) / (long_t - short_t)
    return {
        "turns": LONG_TURNS, "tokens": tokens, "bytes_per_token": short_b / short_t,
        "marginal_bytes_per_token": per_token, "bytes_per_turn": (short_b - per_token * short_t) / turns,
        "long_turn_tokens": long_t / turns,
    }


def _crossover(at: dict[str, Any]) -> dict[str, Any]:
    """Where the pool passes rollout: measured here (turns/s, and the run length past which its start
    is paid back), and the worker cores it needs, from the measured costs per turn."""
    cores = int(at["pool_worker_ms_per_turn"] // at["rollout_ms_per_turn"]) + 1
    faster = at["pool_turns_per_s"] > at["rollout_turns_per_s"]
    out: dict[str, Any] = {"in_flight": at["in_flight"], "workers": at["pool_workers"], "cpus": os.cpu_count(),
                           "worker_cores_to_pass_rollout": cores, "pool_faster_here": faster}
    if faster:
        gain_s = 1 / at["rollout_turns_per_s"] - 1 / at["pool_turns_per_s"]
        out["turns_to_pay_back_start"] = int(at["pool_start_s"] / gain_s)
        here = (f"here ({os.cpu_count()} CPUs, {at['pool_workers']} workers) the pool passes rollout "
                f"after {out['turns_to_pay_back_start']:,} turns (its start paid back)")
    else:
        here = (f"here ({os.cpu_count()} CPUs, {at['pool_workers']} worker(s)) the pool does not pass rollout "
                f"({at['pool_turns_per_s']:.0f} against {at['rollout_turns_per_s']:.0f} turns/s)")
    out["line"] = (f"crossover at {at['in_flight']} in flight: {here}; from the measured costs it needs {cores} worker "
                   f"cores of its own ({at['pool_worker_ms_per_turn']:.3f} ms a worker's turn against "
                   f"{at['rollout_ms_per_turn']:.3f} ms a turn in one process), while the driver's core "
                   f"takes {1e3 / at['pool_driver_ms_per_turn']:,.0f} turns/s")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 4000], help="episodes in flight")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a subprocess's single size
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one)))
        return 0
    if args.memory:
        print(json.dumps(bytes_per_token()))
        return 0

    def sub(*flags: str) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{' '.join(flags)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    rows = []
    for n in args.sizes:
        rows.append(sub("--one", str(n)))
        r = rows[-1]
        print(f"  {n:>5} in flight: rollout {r['rollout_ms_per_turn']:.3f} ms/turn, bare {r['bare_ms_per_turn']:.3f}", file=sys.stderr)
    mem = sub("--memory")
    print(f"{'in flight':>9} | {'bare step':>9} | {'rollout':>8} | {'no builds':>9} | {'ratio':>5} | {'build/env':>9} | {'RSS/episode':>11} | tokens")
    print(f"{'':>9} | {'ms/turn':>9} | {'ms/turn':>8} | {'ms/turn':>9} | {'':>5} | {'ms':>9} | {'kB':>11} |")
    for r in rows:
        print(
            f"{r['in_flight']:>9} | {r['bare_ms_per_turn']:>9.3f} | {r['rollout_ms_per_turn']:>8.3f} | "
            f"{r['rollout_ms_per_turn_without_builds']:>9.3f} | {r['ratio_to_bare']:>5.2f} | {r['build_ms_per_env']:>9.2f} | "
            f"{r['rss_per_episode_kb']:>11.1f} | {r['context_tokens']}"
        )
    print(f"{'in flight':>9} | {'workers':>7} | {'driver':>8} | {'worker':>8} | {'pool':>7} | {'rollout':>7} | start")
    print(f"{'':>9} | {'':>7} | {'ms/turn':>8} | {'ms/turn':>8} | {'turns/s':>7} | {'turns/s':>7} | s (pool turns/s after it)")
    for r in rows:
        print(
            f"{r['in_flight']:>9} | {r['pool_workers']:>7} | {r['pool_driver_ms_per_turn']:>8.3f} | "
            f"{r['pool_worker_ms_per_turn']:>8.3f} | {r['pool_turns_per_s']:>7.0f} | {r['rollout_turns_per_s']:>7.0f} | "
            f"{r['pool_start_s']:.1f}"
        )
    per_turn = [r["rollout_ms_per_turn"] for r in rows]
    flat = max(per_turn) / min(per_turn)
    print(f"rollout's CPU per turn from {rows[0]['in_flight']} to {rows[-1]['in_flight']} in flight: highest / lowest {flat:.2f}x")
    print(f"memory kept per context token (one episode of {mem['turns']} turns, {mem['tokens']} tokens): {mem['bytes_per_token']:.1f} B")
    print(f"  of which: {mem['marginal_bytes_per_token']:.1f} B per context token and {mem['bytes_per_turn']:.0f} B per turn "
          f"(with turns of {mem['long_turn_tokens']:.0f} tokens: "
          f"{mem['marginal_bytes_per_token'] + mem['bytes_per_turn'] / mem['long_turn_tokens']:.1f} B per context token)")

    at = next((r for r in rows if r["in_flight"] == 1000), rows[-1])
    crossover = _crossover(at)
    print(crossover["line"])
    driver_ms = min(at["rollout_ms_per_turn"], at["pool_driver_ms_per_turn"])
    goals = [
        (f"CPU per turn on the driver's core at {at['in_flight']} in flight <= {GOAL_MS} ms", driver_ms <= GOAL_MS,
         f"{at['rollout_ms_per_turn']:.3f} ms in one process, {at['pool_driver_ms_per_turn']:.3f} ms with the pool"),
        (f"rollout <= {GOAL_RATIO}x the bare step at {at['in_flight']}", at["ratio_to_bare"] <= GOAL_RATIO,
         f"{at['ratio_to_bare']:.2f}x"),
        (f"flat from {rows[0]['in_flight']} to {rows[-1]['in_flight']} (<= {GOAL_FLAT}x)", flat <= GOAL_FLAT, f"{flat:.2f}x"),
        (f"<= {GOAL_BYTES_PER_TOKEN:.0f} B per context token kept by the recorder and the driver",
         mem["bytes_per_token"] <= GOAL_BYTES_PER_TOKEN, f"{mem['bytes_per_token']:.1f} B"),
        (f"<= {GOAL_BYTES_PER_TOKEN:.0f} B per context token of a whole episode in flight (its env included) at "
         f"{at['in_flight']}", at["rss_bytes_per_context_token"] <= GOAL_BYTES_PER_TOKEN,
         f"{at['rss_bytes_per_context_token']:.1f} B ({at['rss_per_episode_kb']:.1f} kB an episode of "
         f"{at['context_tokens']} tokens)"),
    ]
    missed = 0
    for name, ok, got in goals:
        print(f"goal: {name}: {'met' if ok else 'NOT met'} ({got})")
        missed += not ok
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"sizes": rows, "memory": mem, "flat": flat, "crossover": crossover, "goals": [
                {"goal": g, "met": ok, "got": got} for g, ok, got in goals]}, fh, indent=2)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
