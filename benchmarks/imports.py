"""How long ``tokengym --help`` and the light imports take, next to ``import gymnasium``.

Why this benchmark exists
-------------------------
Reading a store, listing environments or asking the CLI for help needs neither torch nor
transformers, yet importing them cost seconds and hundreds of MB before any work began.
The heavy libraries (torch, transformers, Ray, docker, vLLM) are now imported where they
are used. The goal: ``tokengym --help`` and ``import tokengym.recorder.store`` cost at
most ``GOAL_S`` seconds more than ``import gymnasium``, the library every tokengym import
builds on, so the floor no change here can go below.

What is measured (in one run, side by side)
-------------------------------------------
Each command runs in a fresh interpreter (``python -X importtime`` is not used: it slows
every import by a different amount). The commands are interleaved, ``--repeat`` rounds,
and the median wall time of each is compared with the baseline's median:

* ``python -c "import gymnasium"``: the baseline.
* ``tokengym --help`` and ``python -c "import tokengym.recorder.store"``: the goal.
* ``import tokengym.envs``, ``tokengym.policies``, ``tokengym.recorder``: shown for reference.

The exit code is 1 when a goal command is more than ``GOAL_S`` slower than the baseline.

Run: ``python benchmarks/imports.py [--repeat 7]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 0.3


def commands() -> dict[str, tuple[list[str], bool]]:
    """Label -> (argv, whether it is held to the goal)."""
    py = sys.executable
    cli = Path(py).parent / "tokengym"
    if not cli.exists():
        raise SystemExit(f"no tokengym script beside {py}: install the package (pip install -e .)")
    return {
        "import gymnasium (baseline)": ([py, "-c", "import gymnasium"], False),
        "tokengym --help": ([str(cli), "--help"], True),
        "import tokengym.recorder.store": ([py, "-c", "import tokengym.recorder.store"], True),
        "import tokengym.envs": ([py, "-c", "import tokengym.envs"], False),
        "import tokengym.policies": ([py, "-c", "import tokengym.policies"], False),
        "import tokengym.recorder": ([py, "-c", "import tokengym.recorder"], False),
    }


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7, help="rounds; each runs every command once")
    args = p.parse_args()

    cmds = commands()
    for argv, _ in cmds.values():  # warm the file cache and the bytecode once
        timed(argv)
    times: dict[str, list[float]] = {label: [] for label in cmds}
    for _ in range(args.repeat):
        for label, (argv, _) in cmds.items():
            times[label].append(timed(argv))

    medians = {label: statistics.median(ts) for label, ts in times.items()}
    base = medians["import gymnasium (baseline)"]
    missed = []
    print(f"{'command':34s} {'median s':>9s} {'- baseline':>11s} {'min s':>7s} {'max s':>7s}")
    for label, (_, goal) in cmds.items():
        diff = medians[label] - base
        mark = ""
        if goal:
            mark = "ok" if diff <= GOAL_S else f"MISSED (goal: +{GOAL_S} s)"
            if diff > GOAL_S:
                missed.append(label)
        print(
            f"{label:34s} {medians[label]:9.3f} {diff:+11.3f} {min(times[label]):7.3f} "
            f"{max(times[label]):7.3f}  {mark}"
        )
    print(f"{args.repeat} rounds, each command in a fresh interpreter")
    if missed:
        print(f"goal missed by: {', '.join(missed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
