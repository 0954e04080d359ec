"""A killed run's local sandboxes are reclaimed: at the next sandbox start and by
``tokengym sandbox gc``; a live run's never are.

Each test makes its sandboxes in its own temp folder (``tmp_root``) and counts only what it made:
the folders there, the mounts under them, the cgroups their records name, the processes carrying
the test's own marker.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokengym.envs.sandbox import LocalSandbox
from tokengym.envs.sandbox.local import TMP_PREFIX, bwrap_status
from tokengym.envs.sandbox.local.reclaim import CGROUPS_FILE, OWNER_FILE, reclaim, scan

from needs import missing
from sandbox_escapes import host_pids_with

HOLDER = textwrap.dedent(
    """
    import os, sys, threading, time
    from tokengym.envs.sandbox import LocalSandbox

    def running(marker):
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and marker.encode() in open(f"/proc/{p}/cmdline", "rb").read():
                    return True
            except OSError:
                pass
        return False

    tmp_root, isolation, marker = sys.argv[1], sys.argv[2], os.environ["RECLAIM_MARKER"]  # not in its own argv
    sb = LocalSandbox(isolation=isolation, tmp_root=tmp_root, timeout_s=600)
    sb.write_file("data.txt", "x" * 1000)
    command = f"python3 -c 'import time; time.sleep(600)' {marker} & wait"
    threading.Thread(target=sb.run, args=(command,), daemon=True).start()
    deadline = time.monotonic() + 30
    while not running(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    print(sb.root, flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A folder of this test's own that a sandbox's uid may pass through (pytest's are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="reclaim-test-"))
    path.chmod(0o711)
    yield path
    reclaim([str(path)])
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["bwrap", "none"])
def isolation(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap" and not bwrap_status().works:
        missing("BWRAP", f"bubblewrap does not work here: {bwrap_status().reason}")
    return request.param


def start_holders(tmp_root: Path, isolation: str, n: int, marker: str) -> list[tuple[subprocess.Popen, str]]:
    """``n`` processes that each hold a sandbox with a call under way; (process, sandbox folder)."""
    env = {**os.environ, "RECLAIM_MARKER": marker}
    procs = [
        subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_root), isolation], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(n)
    ]
    return [(p, p.stdout.readline().strip()) for p in procs]  # type: ignore[union-attr]


def leftovers(tmp_root: Path, marker: str, *, but: str = "") -> dict[str, int]:
    """What sandboxes in ``tmp_root`` (``but`` one) hold on the host: folders, mounts, cgroups, marked processes."""
    roots = [str(tmp_root / n) for n in os.listdir(tmp_root) if n.startswith(TMP_PREFIX) and str(tmp_root / n) != but]
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    cgroups = []
    for r in roots:
        try:
            cgroups += [d for d in Path(r, CGROUPS_FILE).read_text().split() if os.path.isdir(d)]
        except OSError:
            pass
    return {
        "folders": len(roots),
        "mounts": sum(any(p.startswith(r + "/") for r in roots) for p in points),
        "cgroups": len(cgroups),
        "processes": len(host_pids_with(marker)),
    }


def kill(holders: list[tuple[subprocess.Popen, str]]) -> None:
    for p, _ in holders:
        p.send_signal(signal.SIGKILL)
    for p, _ in holders:
        p.wait(timeout=30)
        p.stdout.close()  # type: ignore[union-attr]


def test_a_killed_runs_sandboxes_go_at_the_next_start_and_a_live_ones_stay(tmp_path, isolation):
    marker, live_marker = f"tg-dead-{secrets.token_hex(4)}", f"tg-live-{secrets.token_hex(4)}"
    dead = start_holders(tmp_path, isolation, 3, marker)
    live = start_holders(tmp_path, isolation, 1, live_marker)
    try:
        before = leftovers(tmp_path, marker)
        assert before["folders"] == 4 and before["processes"] >= 3, before
        kill(dead)
        time.sleep(0.2)
        after_kill = leftovers(tmp_path, marker)
        assert after_kill["folders"] == 4, after_kill  # what a SIGKILL leaves: close() never ran
        if isolation == "none":
            assert after_kill["processes"] >= 3, after_kill  # no pid namespace: they outlive their owner
        # the next start (a fresh process: the reclaim runs once per process and folder)
        code = f"from tokengym.envs.sandbox import LocalSandbox; LocalSandbox(isolation={isolation!r}, tmp_root={str(tmp_path)!r}).close()"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "reclaimed 3 sandbox(es) of dead owners" in run.stderr, run.stderr
        (_, live_root), = live
        assert leftovers(tmp_path, marker, but=live_root) == {"folders": 0, "mounts": 0, "cgroups": 0, "processes": 0}
        # the live run's sandbox is untouched
        assert os.path.isdir(live_root) and host_pids_with(live_marker), "a live run's sandbox was reclaimed"
        assert [o.root for o in scan([str(tmp_path)])] == [live_root] and scan([str(tmp_path)])[0].alive
    finally:
        kill(live + [h for h in dead if h[0].poll() is None])
    # once its owner is dead too, the command reclaims it
    gc = subprocess.run(
        [sys.executable, "-m", "tokengym.recorder.cli", "sandbox", "gc", "--tmp-dir", str(tmp_path), "--docker", "no"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert gc.returncode == 0, gc.stderr
    assert "reclaimed 1 sandbox(es)" in gc.stdout, gc.stdout
    assert leftovers(tmp_path, live_marker) == {"folders": 0, "mounts": 0, "cgroups": 0, "processes": 0}


def test_a_sandbox_in_use_in_this_process_is_never_reclaimed(tmp_path):
    with LocalSandbox(isolation="none", tmp_root=str(tmp_path)) as sb:
        done = reclaim([str(tmp_path)])
        assert done.sandboxes == [] and done.live == 1
        assert sb.run("echo ok").stdout.strip() == "ok"
    assert os.listdir(tmp_path) == []  # close() removed it, lock and record included


def test_records_another_user_could_plant_are_never_read(tmp_path):
    """A folder named like a sandbox but writable by others (or not this user's) names no cgroup or
    uid to kill: it is left alone. A folder of this user without a record, old enough, is removed."""
    planted = tmp_path / f"{TMP_PREFIX}planted"
    planted.mkdir()
    (planted / OWNER_FILE).write_text(json.dumps({"version": 1, "pid": 1, "uid": 1_600_000_000, "sweep": True}))
    (planted / CGROUPS_FILE).write_text("/sys/fs/cgroup/pids/tokengym-sandbox-1-x\n")
    os.chmod(planted, 0o777)
    torn = tmp_path / f"{TMP_PREFIX}torn"  # killed between its folder and its record
    torn.mkdir()
    young = tmp_path / f"{TMP_PREFIX}young"  # being made right now
    young.mkdir()
    old = time.time() - 3600
    os.utime(torn, (old, old))
    done = reclaim([str(tmp_path)])
    assert done.sandboxes == [str(torn)] and done.problems == []
    assert planted.is_dir() and young.is_dir() and not torn.exists()
    assert {o.root: o.note for o in scan([str(tmp_path)])} == {str(planted): "not this user's", str(young): "no owner record"}


def test_the_command_names_what_it_finds_and_checks_its_input(tmp_path):
    with LocalSandbox(isolation="none", tmp_root=str(tmp_path)) as sb:
        out = subprocess.run(
            [sys.executable, "-m", "tokengym.recorder.cli", "sandbox", "list", "--tmp-dir", str(tmp_path), "--docker", "no"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert f"{sb.root} pid {os.getpid()} (live" in out.stdout, out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tokengym.recorder.cli", "sandbox", "gc", "--tmp-dir", str(tmp_path / "nope"), "--docker", "no"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--tmp-dir" in bad.stderr and "no such folder" in bad.stderr, bad.stderr


def test_cgroups_whose_record_was_deleted_go_once_their_maker_is_gone(tmp_path):
    """A sandbox folder deleted by hand (``rm -rf /tmp/...``) takes its record, not its cgroups:
    those named after a dead maker are removed, a live maker's stay."""
    from tokengym.envs.sandbox.local.cgroups import NAME_PREFIX, cgroup_support

    support = cgroup_support()
    if not support.kind:
        missing("CGROUPS", f"no cgroups for sandboxes here: {support.reason}")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    token = secrets.token_hex(6)
    orphans = [os.path.join(p, f"{NAME_PREFIX}{dead_pid}-{token}") for p in support.parents]
    mine = [os.path.join(p, f"{NAME_PREFIX}{os.getpid()}-{token}") for p in support.parents]
    for d in orphans + mine:
        os.mkdir(d)
    try:
        done = reclaim([str(tmp_path)])
        assert not any(os.path.isdir(d) for d in orphans) and done.cgroups >= len(orphans)
        assert all(os.path.isdir(d) for d in mine)
    finally:
        for d in orphans + mine:
            if os.path.isdir(d):
                os.rmdir(d)


def test_a_tmp_root_the_sandbox_cannot_reach_is_a_named_error():
    if os.geteuid() != 0:
        missing("ROOT", "the sandbox runs under a uid of its own only on a root host")
    from tokengym.envs.sandbox import SandboxError

    private = tempfile.mkdtemp(prefix="reclaim-private-")  # 0700, as pytest's tmp_path
    try:
        with pytest.raises(SandboxError, match=r"cannot pass through it .*chmod o\+x"):
            LocalSandbox(isolation="none", tmp_root=private)
        assert os.listdir(private) == []  # nothing made there
    finally:
        os.rmdir(private)


def test_the_command_fails_when_the_docker_engine_it_must_clean_is_not_there(tmp_path):
    gc = subprocess.run(
        [sys.executable, "-m", "tokengym.recorder.cli", "sandbox", "gc", "--tmp-dir", str(tmp_path),
         "--docker", "yes", "--docker-host", f"unix://{tmp_path}/no-engine.sock"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if "docker SDK" in gc.stdout:
        missing("DOCKER", "the docker SDK is not installed")
    assert gc.returncode == 1, (gc.stdout, gc.stderr)
    assert "docker: no Docker engine answers" in gc.stdout and "local: " in gc.stdout
