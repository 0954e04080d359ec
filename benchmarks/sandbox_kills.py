"""What 20 SIGKILLs of a sandboxed rollout leave on the host, per backend, before and after the
next run and ``tokengym sandbox gc``.

Why: a SIGKILL runs no ``close()`` and no finalizer, so every sandbox of a killed run stays:
folders, tmpfs mounts (RAM), cgroups, processes (no pid namespace without bubblewrap), containers.
Each local sandbox keeps a lock on an owner record for its life; the next sandbox start in a
process and the command remove those whose lock is free. This script measures that end to end
on the real CLI: ``tokengym rollout tokengym/PythonSandbox-v0`` (scripted policy; the answer's
code sleeps, so the grade's sandbox call is under way) is killed at a random moment 20 times,
then one short rollout runs (the next run), then ``tokengym sandbox gc``. Each killed run's
first sandbox already reclaims what the runs before it left, so what is left after the kills is
the last run's; ``sandboxes_made`` counts them all.

    python benchmarks/sandbox_kills.py                    # local bwrap, local none, docker
    python benchmarks/sandbox_kills.py --backends none --kills 5 --json out.json

Every count is of this script's own sandboxes: its own ``tmp_root`` folder, the mounts under it,
the cgroups its records name, the processes carrying its sandboxes' markers, the containers with
its own label. Docker needs an engine (``bash .ci/docker-up.sh; . .ci-docker/env``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokengym.envs.sandbox.local import TMP_PREFIX, bwrap_status
from tokengym.envs.sandbox.local.reclaim import CGROUPS_FILE
from tokengym.envs.sandbox.local.uids import MARKER_VAR

SLEEPER = "```python\nimport time\ntime.sleep(120)\n```"
QUICK = "```python\nprint(1)\n```"
RUN_LABEL = "org.tokengym.kill-test"


def rollout_argv(backend: str, tmp_root: str, run_id: str, out: str, episodes: int, reply: str = SLEEPER) -> list[str]:
    if backend == "docker":
        kwargs: dict[str, Any] = {"labels": {RUN_LABEL: run_id}}
        sandbox = ["--env-kwarg", "sandbox=docker"]
    else:
        kwargs = {"tmp_root": tmp_root, "isolation": backend}
        sandbox = []
    return [
        sys.executable, "-m", "tokengym.recorder.cli", "rollout", "tokengym/PythonSandbox-v0",
        "--policy", "scripted", "--tokenizer", "qwen3", "--reply", reply, "--quiet",
        "--episodes", str(episodes), "--concurrency", "4", "--out", out,
        "--env-kwarg", "grade_timeout_s=60", *sandbox, "--env-kwarg", f"sandbox_kwargs={json.dumps(kwargs)}",
    ]  # fmt: skip


def local_leftovers(tmp_root: str, tokens: set[str]) -> dict[str, int]:
    roots = [os.path.join(tmp_root, n) for n in os.listdir(tmp_root) if n.startswith(TMP_PREFIX)]
    tokens |= {os.path.basename(r) for r in roots}
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    cgroups: set[str] = set()
    for r in roots:
        try:
            cgroups |= {d for d in Path(r, CGROUPS_FILE).read_text().split() if os.path.isdir(d)}
        except OSError:
            pass
    wanted = {f"{MARKER_VAR}={t}".encode() for t in tokens}
    processes = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            processes += any(item.rsplit(b"-", 1)[0] in wanted for item in env if item.startswith(MARKER_VAR.encode()))
    return {
        "folders": len(roots),
        "mounts": sum(any(p.startswith(r + "/") for r in roots) for p in points),
        "cgroups": len(cgroups),
        "processes": processes,
    }


def docker_leftovers(run_id: str) -> dict[str, int]:
    from tokengym.envs.sandbox.docker.engine import docker_client

    rows = docker_client().api.containers(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
    return {"containers": len(rows)}


def newest_sandbox(backend: str, tmp_root: str, run_id: str) -> float:
    """When this script's newest sandbox was made (0 when none is there)."""
    if backend == "docker":
        from tokengym.envs.sandbox.docker.engine import docker_client

        rows = docker_client().api.containers(all=True, filters={"label": f"{RUN_LABEL}={run_id}"})
        return max((float(r.get("Created", 0)) for r in rows), default=0.0)  # whole seconds
    return max((e.stat().st_ctime for e in os.scandir(tmp_root) if e.name.startswith(TMP_PREFIX)), default=0.0)


def until_a_sandbox(proc: subprocess.Popen, newest: Any, slack_s: float, within_s: float = 120.0) -> None:
    """Wait until the run has made a sandbox of its own (newer than its start, less ``slack_s``)."""
    start = time.time() - slack_s
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        if newest() >= start:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the rollout made no sandbox within {within_s:g} s (exit {proc.poll()})")


def one_backend(backend: str, kills: int, rng: random.Random) -> dict[str, Any]:
    tmp_root = tempfile.mkdtemp(prefix="tokengym-kills-")
    os.chmod(tmp_root, 0o711)  # the sandbox's uid passes through it
    run_id = secrets.token_hex(4)
    tokens: set[str] = set()

    def count() -> dict[str, int]:
        return docker_leftovers(run_id) if backend == "docker" else local_leftovers(tmp_root, tokens)

    out = tempfile.mkdtemp(prefix="tokengym-kills-out-")
    made = 0
    try:
        for i in range(kills):
            proc = subprocess.Popen(
                rollout_argv(backend, tmp_root, run_id, os.path.join(out, f"r{i}"), 8),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            until_a_sandbox(proc, lambda: newest_sandbox(backend, tmp_root, run_id), 1.0 if backend == "docker" else 0.0)
            time.sleep(rng.uniform(0.0, 2.0))  # episodes, grades under way: a moment at random
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            made += count().get("containers", 0)  # locally: notes the folders seen so far
        time.sleep(0.5)
        after_kills = count()
        nxt = subprocess.run(
            rollout_argv(backend, tmp_root, run_id, os.path.join(out, "next"), 1, reply=QUICK),
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        after_next = count()
        gc = subprocess.run(
            [sys.executable, "-m", "tokengym.recorder.cli", "sandbox", "gc", "--tmp-dir", tmp_root,
             "--docker", "yes" if backend == "docker" else "no"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        after_gc = count()
        return {
            "backend": backend,
            "kills": kills,
            "sandboxes_made": len(tokens) if backend != "docker" else made,
            "after_kills": after_kills,
            "after_next_run": after_next,
            "next_run_exit": nxt.returncode,
            "next_run_said": [_anonymous(line, tmp_root) for line in nxt.stderr.splitlines() if "dead owners" in line][-1:],
            "after_gc": after_gc,
            "gc_exit": gc.returncode,
            "gc_said": [_anonymous(line, tmp_root) for line in gc.stdout.strip().splitlines()],
        }
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(tmp_root, ignore_errors=True)


def _anonymous(line: str, tmp_root: str) -> str:
    """A line without this machine's paths (the stored results are committed)."""
    line = line.replace(tmp_root, "<tmp_root>")
    host = os.environ.get("DOCKER_HOST")
    return line.replace(host, "<DOCKER_HOST>") if host else line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["bwrap", "none", "docker"], choices=["bwrap", "none", "docker"])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    rng = random.Random(args.seed)
    results = []
    for backend in args.backends:
        if backend == "bwrap" and not bwrap_status().works:
            print(f"{backend}: skipped ({bwrap_status().reason})")
            continue
        r = one_backend(backend, args.kills, rng)
        results.append(r)
        print(
            f"{backend:6s} {r['sandboxes_made']} sandboxes in {r['kills']} runs, each SIGKILLed; left after the last kill: {r['after_kills']}; after the next run: {r['after_next_run']} "
            f"(exit {r['next_run_exit']}; {' '.join(r['next_run_said']) or 'said nothing'}); after `tokengym sandbox gc`: "
            f"{r['after_gc']} (exit {r['gc_exit']})",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    left = [r["backend"] for r in results if any(r["after_next_run"].values())]
    sys.exit(1 if left else 0)


if __name__ == "__main__":
    main()
