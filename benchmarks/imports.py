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

With ``--before PYTHON`` (an interpreter where an earlier tokengym is installed, e.g. the venv of
a checkout of an older commit), the same tokengym commands also run under it, interleaved in the
same rounds, so a change's before and after are measured under the same load; only the current
install is held to the goal.

Run: ``python benchmarks/imports.py [--repeat 7] [--before OTHER/.venv/bin/python]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 0.3


def tokengym_commands(py: str, goal: bool, suffix: str = "") -> dict[str, tuple[list[str], bool]]:
    """Label -> (argv, whether it is held to the goal) for the tokengym installed under ``py``."""
    cli = Path(py).parent / "tokengym"
    if not cli.exists():
        raise SystemExit(f"no tokengym script beside {py}: install the package (pip install -e .)")
    return {
        f"tokengym --help{suffix}": ([str(cli), "--help"], goal),
        f"import tokengym.recorder.store{suffix}": ([py, "-c", "import tokengym.recorder.store"], goal),
        f"import tokengym.envs{suffix}": ([py, "-c", "import tokengym.envs"], False),
        f"import tokengym.policies{suffix}": ([py, "-c", "import tokengym.policies"], False),
        f"import tokengym.recorder{suffix}": ([py, "-c", "import tokengym.recorder"], False),
    }


def commands(before: str | None = None) -> dict[str, tuple[list[str], bool]]:
    """Label -> (argv, whether it is held to the goal): the baseline, this install, and ``before``'s."""
    py = sys.executable
    cmds = {"import gymnasium (baseline)": ([py, "-c", "import gymnasium"], False)}
    cmds.update(tokengym_commands(py, goal=True))
    if before:
        cmds.update(tokengym_commands(before, goal=False, suffix=" (before)"))
    return cmds


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run; CPU time is the steadier on a shared machine."""
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ)
    elapsed = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    return elapsed, (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7, help="rounds; each runs every command once")
    p.add_argument("--before", metavar="PYTHON", help="also time an earlier install, run by this interpreter")
    args = p.parse_args()

    cmds = commands(args.before)
    for argv, _ in cmds.values():  # warm the file cache and the bytecode once
        timed(argv)
    times: dict[str, list[float]] = {label: [] for label in cmds}
    cpu: dict[str, list[float]] = {label: [] for label in cmds}
    for _ in range(args.repeat):
        for label, (argv, _) in cmds.items():
            wall, used = timed(argv)
            times[label].append(wall)
            cpu[label].append(used)

    medians = {label: statistics.median(ts) for label, ts in times.items()}
    cpu_medians = {label: statistics.median(ts) for label, ts in cpu.items()}
    base = medians["import gymnasium (baseline)"]
    cpu_base = cpu_medians["import gymnasium (baseline)"]
    missed = []
    print(
        f"{'command':43s} {'median s':>9s} {'- baseline':>11s} {'min s':>7s} {'max s':>7s} "
        f"{'CPU s':>6s} {'- baseline':>11s}"
    )
    for label, (_, goal) in cmds.items():
        diff = medians[label] - base
        mark = ""
        if goal:
            mark = "ok" if diff <= GOAL_S else f"MISSED (goal: +{GOAL_S} s)"
            if diff > GOAL_S:
                missed.append(label)
        print(
            f"{label:43s} {medians[label]:9.3f} {diff:+11.3f} {min(times[label]):7.3f} "
            f"{max(times[label]):7.3f} {cpu_medians[label]:6.3f} {cpu_medians[label] - cpu_base:+11.3f}  {mark}"
        )
    print(f"{args.repeat} rounds, each command in a fresh interpreter; the goal is judged on the wall-time median")
    if missed:
        print(f"goal missed by: {', '.join(missed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
