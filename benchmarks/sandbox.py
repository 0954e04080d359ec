"""Sandbox latency: the local process sandbox vs the Docker sandbox, and the warm pool vs cold starts.

Why: a tool call that runs code sits on the rollout's critical path, once per turn, and a
sandbox start once per episode. This measures, in one run and on the same machine:

* start: building a sandbox (local: a temp directory and a probe; Docker: create + start +
  inspect of a hardened container) and closing it;
* exec: one Python snippet (``run_python``) and one trivial shell command in a live sandbox;
* one-shot: start + one snippet + close (what a fresh sandbox per call would cost);
* the cost of the local sandbox's whole-sandbox limits (a cgroup for memory and processes, a
  tmpfs with a disk and inode quota for the workspace and ``/tmp``): the same measurements with
  and without them, side by side;
* episode start: ``DockerPool.acquire()`` of a ready container vs a cold ``DockerSandbox()``,
  while episodes run back to back (each: a snippet, a file written and read, close), for both
  recycling modes; with the episodes/s that result and how many acquisitions missed the pool.

p50 / p95 in milliseconds, and the ratios. Needs a Docker engine with the sandbox image for the
Docker rows (``bash .ci/docker-up.sh; . .ci-docker/env``); the local rows run anywhere.

    python benchmarks/sandbox.py
    python benchmarks/sandbox.py --n 50 --episodes 60 --pool-size 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

SNIPPET = "import json, math\nprint(json.dumps({'x': math.factorial(20)}))"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def timed(fn: Callable[[], object], n: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def summary(xs: list[float]) -> dict:
    mean = statistics.fmean(xs) if xs else float("nan")
    return {"n": len(xs), "p50_ms": pct(xs, 0.5), "p95_ms": pct(xs, 0.95), "mean_ms": mean}


def bench_backend(make: Callable[[], object], n: int) -> dict:
    rows = {}
    starts, closes = [], []
    for _ in range(n):
        t = time.perf_counter()
        sb = make()
        starts.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        sb.close()
        closes.append((time.perf_counter() - t) * 1000)
    rows["start"] = summary(starts)
    rows["close"] = summary(closes)
    with make() as sb:
        assert sb.run_python(SNIPPET).ok
        rows["exec python snippet"] = summary(timed(lambda: sb.run_python(SNIPPET), n * 2))
        rows["exec shell `true`"] = summary(timed(lambda: sb.run(["true"]), n * 2))
        rows["exec shell string `true`"] = summary(timed(lambda: sb.run("true"), n * 2))

    def one_shot():
        with make() as sb:
            sb.run_python(SNIPPET)

    rows["one-shot (start + snippet + close)"] = summary(timed(one_shot, n, warmup=1))
    return rows


def episode(sb, i: int) -> None:
    r = sb.run_python(SNIPPET)
    assert r.ok, r
    sb.write_file("answer.txt", str(i))
    assert sb.read_file("answer.txt") == str(i).encode()


def bench_episodes(acquire: Callable[[], object], episodes: int) -> tuple[dict, float]:
    """Episodes back to back: the time to get a sandbox, and episodes per second."""
    waits = []
    t0 = time.perf_counter()
    for i in range(episodes):
        t = time.perf_counter()
        sb = acquire()
        waits.append((time.perf_counter() - t) * 1000)
        try:
            episode(sb, i)
        finally:
            sb.close()
    return summary(waits), episodes / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20, help="samples per measurement (exec: twice as many)")
    p.add_argument("--episodes", type=int, default=40, help="episodes per pool / cold run")
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--local-only", action="store_true", help="skip the Docker rows")
    args = p.parse_args()

    from tokengym.envs.sandbox import Limits

    limits = Limits(timeout_s=10)
    results: dict[str, dict] = {}
    notes = []
    limits_cost: dict[str, dict] | None = None

    try:
        from tokengym.envs.sandbox import LocalSandbox

        local = LocalSandbox(limits)
        notes.append(f"local: {local.isolation.describe()}")
        local.close()
        # the two alternate, so that both see the same machine state
        before: dict[str, list[dict]] = {}
        after: dict[str, list[dict]] = {}
        for _ in range(3):
            for into, kwargs in ((before, {"_per_process_only": True}), (after, {})):
                for row, r in bench_backend(lambda kw=kwargs: LocalSandbox(limits, **kw), max(1, args.n // 3)).items():
                    into.setdefault(row, []).append(r)
        merged = {name: {row: min(rs, key=lambda r: r["p50_ms"]) for row, rs in d.items()} for name, d in (("before", before), ("after", after))}
        results["local"] = merged["after"]
        limits_cost = merged
    except ImportError as e:
        notes.append(f"local: not available ({e})")

    docker_ok = False
    try:
        if args.local_only:
            raise RuntimeError("--local-only")
        from tokengym.envs.sandbox import DockerPool, DockerSandbox
        from tokengym.envs.sandbox.docker import docker_client

        client = docker_client()
        info = client.api.version()
        probe = DockerSandbox(limits)
        notes.append(f"docker: engine {info.get('Version')}, {probe.isolation.describe()}")
        probe.close()
        docker_ok = True
    except Exception as e:  # no engine, no image, no SDK
        notes.append(f"docker: not available ({type(e).__name__}: {e})")

    episodes = {}
    if docker_ok:
        results["docker"] = bench_backend(lambda: DockerSandbox(limits), args.n)
        waits, rate = bench_episodes(lambda: DockerSandbox(limits), args.episodes)
        episodes["cold DockerSandbox()"] = {**waits, "episodes_per_s": rate, "misses": args.episodes}
        for recycle in ("fresh", "wipe"):
            with DockerPool(args.pool_size, limits, recycle=recycle) as pool:
                pool.wait_ready(timeout_s=120)
                waits, rate = bench_episodes(pool.acquire, args.episodes)
                episodes[f"DockerPool({args.pool_size}, recycle={recycle!r}).acquire()"] = {
                    **waits,
                    "episodes_per_s": rate,
                    "misses": pool.stats["misses"],
                }

    print()
    for note in notes:
        print(f"- {note}")
    print()
    backends = list(results)
    if backends:
        ratio_head = " | docker / local (p50) |" if len(backends) == 2 else " |"
        print("| measurement | " + " | ".join(f"{b} p50 ms | {b} p95 ms" for b in backends) + ratio_head)
        print("|---|" + "---:|---:|" * len(backends) + ("---:|" if len(backends) == 2 else ""))
        for row in results[backends[0]]:
            cells = []
            for b in backends:
                r = results[b][row]
                cells.append(f"{r['p50_ms']:.1f} | {r['p95_ms']:.1f}")
            ratio = ""
            if len(backends) == 2:
                ratio = f" {results['docker'][row]['p50_ms'] / results['local'][row]['p50_ms']:.1f}x |"
            print(f"| {row} | " + " | ".join(cells) + " |" + ratio)
        print()
    if limits_cost:
        print("The local sandbox's whole-sandbox limits (cgroup memory + pids, tmpfs disk + inode quota) vs per-process")
        print("rlimits only, as before (the best of 3 alternating rounds each):\n")
        print("| measurement | per process p50 ms | whole sandbox p50 ms | per process p95 ms | whole sandbox p95 ms | ratio (p50) |")
        print("|---|---:|---:|---:|---:|---:|")
        for row, b in limits_cost["before"].items():
            a = limits_cost["after"][row]
            print(f"| {row} | {b['p50_ms']:.1f} | {a['p50_ms']:.1f} | {b['p95_ms']:.1f} | {a['p95_ms']:.1f} | {a['p50_ms'] / b['p50_ms']:.2f}x |")
        print()
    if episodes:
        cold = episodes["cold DockerSandbox()"]
        print(f"{args.episodes} episodes back to back (each: a snippet, a file written and read, close):\n")
        print("| how an episode gets its sandbox | p50 ms | p95 ms | vs cold (p50) | episodes/s | pool misses |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in episodes.items():
            speedup = cold["p50_ms"] / r["p50_ms"] if r["p50_ms"] > 0 else float("inf")
            vs = "baseline" if r is cold else f"{speedup:.0f}x faster"
            print(f"| {name} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | {vs} | {r['episodes_per_s']:.1f} | {r['misses']} |")
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"notes": notes, "backends": results, "episodes": episodes, "local_limits_cost": limits_cost}, f, indent=2)


if __name__ == "__main__":
    main()
