"""The store against plain Parquet: ``TrajectoryWriter`` vs ``pq.write_table`` and ``read_trajectories`` vs ``pq.read_table``, side by side.

Why: the store adds a durable episode log, checks and exact ``Trajectory`` objects on top of
Parquet; what that costs is measured against pyarrow doing only the Parquet part, on the same
rows, in one run:

* **write**: ``TrajectoryWriter`` (its defaults: zstd, the episode log fsynced by group commit,
  one shard at the end) writing N trajectories and closing, against ``pq.write_table`` of the
  very table that writer stored (read back from its shard, so the same rows, types and metadata)
  with the same compression, plus one ``fsync`` of the file (without it the baseline would not
  be on disk when it returns; the ratio without the fsync is printed too);
* **read**: ``read_trajectories`` (every row checked and decoded into a ``Trajectory``) against
  ``pq.read_table`` of the same shard (columns, no objects), and ``read_table`` (the store's
  columnar read) beside them.

Workload: ``tokengym/Replay-v0`` episodes of 1 to 3 turns on the real Qwen3 tokenizer, every
policy token with a logprob and a weight version (as an asynchronous run records them). The
runs alternate (store, baseline, store, ...) ``--repeats`` times; medians and the ratios of
medians are reported.

Goals (the cost-of-scale issue): write within 1.2x, ``read_trajectories`` within 2x; the
exit status is 1 when one is missed.

    python benchmarks/store_io.py
    python benchmarks/store_io.py --trajectories 4000 --repeats 7 --dir /data/scratch --json out.json

``--dir`` should be on the disk a real run writes to: on tmpfs an fsync costs nothing.
What it leaves out: images, stores of many shards, a writer fed while a rollout runs (the
log's fsync then overlaps the rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tokengym.envs import ReplayEnv, load_tokenizer
from tokengym.recorder import TrajectoryWriter, read_table, read_trajectories

from store_durability import episodes  # the same recorded episodes (benchmarks/ is on the path of a script run)

GOALS = {"write": 1.2, "read_trajectories": 2.0}


class VaryingReplay(ReplayEnv):
    """Episodes of 1, 2 or 3 turns by reset seed."""

    def reset(self, *, seed=None, options=None):
        self.max_turns = 1 + (seed or 0) % 3
        return super().reset(seed=seed, options=options)


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the stores go (default: the system's temp folder)")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(argv)

    tok = load_tokenizer("Qwen/Qwen3-0.6B")
    trajs = episodes(tok, args.trajectories, VaryingReplay(tok), versions=True)
    tokens = sum(len(t) for t in trajs)
    root = Path(tempfile.mkdtemp(prefix="tokengym-store-io-", dir=args.dir))
    times: dict[str, list[float]] = {k: [] for k in ("store_write", "plain_write", "plain_write_no_fsync",
                                                      "read_trajectories", "read_table", "plain_read")}
    try:
        for r in range(args.repeats):
            store = root / f"store-{r}"

            def write_store() -> None:
                with TrajectoryWriter(store, tokenizer=tok, shard_size=args.trajectories) as writer:
                    for t in trajs:
                        writer.write(t)

            times["store_write"].append(timed(write_store))
            (shard,) = sorted(store.glob("*.parquet"))
            table = pq.read_table(shard)
            compression = pq.ParquetFile(shard).metadata.row_group(0).column(0).compression.lower()

            def write_plain(path: Path, sync: bool) -> None:
                pq.write_table(table, path, compression=compression)
                if sync:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)

            times["plain_write"].append(timed(lambda: write_plain(root / f"plain-{r}.parquet", True)))
            times["plain_write_no_fsync"].append(timed(lambda: write_plain(root / f"plain-{r}-b.parquet", False)))
            n = 0

            def read_store() -> None:
                nonlocal n
                n = sum(1 for _ in read_trajectories(store))

            times["read_trajectories"].append(timed(read_store))
            assert n == len(trajs), f"read {n} of {len(trajs)}"
            times["read_table"].append(timed(lambda: read_table(store)))
            times["plain_read"].append(timed(lambda: pq.read_table(shard)))
            shutil.rmtree(store)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "write": med["store_write"] / med["plain_write"],
        "write_vs_no_fsync": med["store_write"] / med["plain_write_no_fsync"],
        "read_trajectories": med["read_trajectories"] / med["plain_read"],
        "read_table": med["read_table"] / med["plain_read"],
    }
    print(f"{len(trajs):,} trajectories, {tokens:,} tokens (Qwen3 tokenizer, logprobs and versions on every policy token); "
          f"{args.repeats} repeats, medians")
    for k, v in med.items():
        print(f"  {k:<22} {v * 1000:8.1f} ms   ({len(trajs) / v:>9,.0f} trajectories/s)")
    goals = []
    for k, v in ratios.items():
        goal = GOALS.get(k)
        met = goal is None or v <= goal
        goals.append({"ratio": k, "value": v, "goal": goal, "met": met})
        print(f"  {k:<22} {v:.2f}x" + ("" if goal is None else f"   (goal <= {goal}x: {'met' if met else 'MISSED'})"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({
                "command": "python benchmarks/store_io.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "trajectories": len(trajs), "tokens": tokens, "repeats": args.repeats, "cpus": os.cpu_count(),
                "seconds": times, "medians": med, "ratios": ratios, "goals": goals,
            }, f, indent=1)
    return 0 if all(g["met"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
