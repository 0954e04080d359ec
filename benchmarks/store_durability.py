"""Store write throughput: durable writes (fsynced episode log) vs buffered writes, in one run.

Why: ``TrajectoryWriter.write`` now makes each trajectory durable before it returns (one
checksummed record appended to the episode log; fsynced by a group commit within
``fsync_interval`` seconds, or in every write with ``fsync_interval=0``). The baseline is the
writer as it was before the log: trajectories buffered in memory and written as a Parquet
shard every ``shard_size`` (a kill lost the buffer). Both write the same real trajectories
(``tokengym/Replay-v0`` episodes on the real Qwen2.5 tokenizer, with logprobs) to the same
file system, interleaved, and the script reports trajectories/s, MB/s of token data and the
ratio durable / buffered (the goal is >= 0.5 for the default group commit).

The buffered writer is that code itself, not a model of it: ``recorder/store.py`` as it was at
commit ``cbd3552`` (the last one before the episode log), read from this repository's git
history with its two modules (segments, trajectories) into a temporary package, fed the same
trajectories converted to its own records (the conversion is not timed). Run from a git
checkout with its history.

    python benchmarks/store_durability.py
    python benchmarks/store_durability.py --writes 4000 --repeats 5 --dir /data/scratch --json out.json

``--dir`` should be on the disk a real run writes to: on tmpfs an fsync costs nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokengym.envs import ReplayEnv, fetch_tokenizer, load_tokenizer
from tokengym.recorder import RecordEpisodes, Trajectory
from tokengym.recorder.store import TrajectoryWriter


BEFORE = "cbd3552"
"""The last commit whose writer buffered trajectories in memory (the episode log came next)."""
BEFORE_FILES = {"store.py": "recorder/store.py", "segments.py": "recorder/segments.py", "trajectory.py": "recorder/trajectory.py"}


def load_writer_before(root: Path) -> Any:
    """The store module of commit BEFORE, as the package ``tokengym_store_before`` under ``root``."""
    repo = Path(__file__).resolve().parents[1]
    package = root / "tokengym_store_before"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, path in BEFORE_FILES.items():
        try:
            text = subprocess.run(["git", "-C", str(repo), "show", f"{BEFORE}:{path}"], check=True, capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError) as err:
            detail = getattr(err, "stderr", "") or err
            raise SystemExit(f"error: the baseline is the writer of commit {BEFORE}, read from git history: {detail}; "
                             "run from a git clone with its history (not a shallow one or an sdist)")
        (package / name).write_text(text)
    sys.path.insert(0, str(root))
    return importlib.import_module("tokengym_store_before.store")


def as_before(before: Any, traj: Trajectory) -> Any:
    """``traj`` as the old module's own Trajectory (same segments, metadata and settings)."""
    seg, kind = before.Segment, before.SegmentKind
    return before.Trajectory(
        segments=[seg(kind(s.kind.value), s.token_ids, s.turn, logprobs=s.logprobs, reward=s.reward) for s in traj.segments],
        env_id=traj.env_id, seed=traj.seed, stop_reason=traj.stop_reason, terminated=traj.terminated,
        truncated=traj.truncated, conformance=traj.conformance, sampling=traj.sampling, metadata=traj.metadata,
    )


def episodes(tok: Any, n: int, env: Any = None, *, versions: bool = False) -> list[Trajectory]:
    """``n`` recorded episodes of ``env`` (default ``ReplayEnv(tok)``), logprobs on every policy
    token; with ``versions``, a weight version too (one more every 64 episodes)."""
    env = RecordEpisodes(env if env is not None else ReplayEnv(tok), keep=False)
    rng = np.random.default_rng(0)
    out = []
    for seed in range(n):
        env.reset(seed=seed)
        done, info = False, {}
        while not done:
            action = env.unwrapped.reference_action()
            stamp = np.full(len(action), seed // 64, dtype=np.int32) if versions else None
            _, _, term, trunc, info = env.step(action, logprobs=-rng.random(len(action)).astype(np.float32), versions=stamp)
            done = term or trunc
        out.append(info["trajectory"])
    return out


def one_run(kind: str, root: Path, tok: Any, trajs: list[Any], writes: int, shard_size: int, before: Any = None) -> float:
    """Seconds to write ``writes`` trajectories and close the writer."""
    store = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=root))
    if kind == "buffered":
        writer: Any = before.TrajectoryWriter(store, tokenizer=tok, shard_size=shard_size)
    else:
        writer = TrajectoryWriter(store, tokenizer=tok, shard_size=shard_size, fsync_interval=1.0 if kind == "durable" else 0.0)
    t0 = time.perf_counter()
    for i in range(writes):
        writer.write(trajs[i % len(trajs)])
    writer.close()
    elapsed = time.perf_counter() - t0
    for p in store.iterdir():
        p.unlink()
    store.rmdir()
    return elapsed


GOAL = 0.5
"""The default durable writer's throughput over the buffered one's, at least."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writes", type=int, default=3000, help="trajectories written per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (interleaved); the median counts")
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--episodes", type=int, default=32, help="distinct real trajectories, written in turn")
    ap.add_argument("--dir", default=".", help="where the stores go (a temp folder inside it)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    tok = load_tokenizer(str(fetch_tokenizer("qwen2.5")))
    trajs = episodes(tok, args.episodes)
    tokens = sum(len(trajs[i % len(trajs)]) for i in range(args.writes))
    kinds = ["buffered", "durable", "durable-fsync-each"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="tokengym-store-bench-", dir=args.dir) as root, \
            tempfile.TemporaryDirectory(prefix="tokengym-writer-before-") as code:
        before = load_writer_before(Path(code))
        old = [as_before(before, t) for t in trajs]
        inputs = {"buffered": old, "durable": trajs, "durable-fsync-each": trajs}
        for kind in kinds:  # warm up
            one_run(kind, Path(root), tok, inputs[kind], min(200, args.writes), args.shard_size, before)
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(one_run(kind, Path(root), tok, inputs[kind], args.writes, args.shard_size, before))
        fs = os.statvfs(root)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = {
        k: {
            "median_s": med[k],
            "runs_s": times[k],
            "trajectories_per_s": args.writes / med[k],
            "token_mb_per_s": tokens * 10 / 1e6 / med[k],  # 4 B id + 1 B mask + 4 B logprob + 1 B flag per token
            "ratio_to_buffered": med["buffered"] / med[k],
        }
        for k in kinds
    }
    print(
        f"{args.writes} writes of real Replay-v0 trajectories (mean {tokens / args.writes:.0f} tokens), "
        f"shard_size {args.shard_size}, {args.repeats} interleaved runs per mode, median; "
        f"stores under {Path(args.dir).resolve()} (block size {fs.f_bsize})"
    )
    print(f"{'mode':22s} {'traj/s':>10s} {'token MB/s':>11s} {'vs buffered':>12s}")
    labels = {
        "buffered": f"buffered ({BEFORE})",
        "durable": "durable, group fsync",
        "durable-fsync-each": "durable, fsync each",
    }
    for k in kinds:
        r = rows[k]
        print(f"{labels[k]:22s} {r['trajectories_per_s']:10.0f} {r['token_mb_per_s']:11.1f} {r['ratio_to_buffered']:12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"writes": args.writes, "tokens": tokens, "modes": rows}, indent=2))
    ratio = rows["durable"]["ratio_to_buffered"]
    print(f"durable / buffered = {ratio:.2f} (goal >= {GOAL:g}): {'met' if ratio >= GOAL else 'MISSED'}")
    return 0 if ratio >= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())
