"""The local process sandbox, with bubblewrap and without: limits, clean-up, honesty, and every
escape check of ``sandbox_escapes`` (the same checks the Docker backend runs).

In CI (``CI`` set) bubblewrap must work: its absence fails the bwrap tests instead of
skipping them (``.ci/run`` installs Debian's ``bubblewrap``).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

from tokengym.envs.sandbox import LocalSandbox, SandboxError, bwrap_status, make_sandbox
from tokengym.envs.sandbox.local import TMP_PREFIX, BwrapStatus
from tokengym.envs.sandbox.local import sandbox as local_sandbox

from needs import missing, requires
from sandbox_escapes import CHECKS, LIFECYCLE_CHECKS, check_params, host_pids_with, wait_no_host_pids

# What this test process made: the uids and directories of its own sandboxes. The leak checks
# look only at those (other sandboxes may run on the same machine at the same time).
OUR_UIDS: set[int] = set()
OUR_DIRS: set[str] = set()
fresh_uid = local_sandbox.fresh_uid
_init = LocalSandbox.__init__


def _recording_fresh_uid() -> int:
    uid = fresh_uid()
    OUR_UIDS.add(uid)
    return uid


def _recording_init(self, *args, **kwargs) -> None:
    try:
        _init(self, *args, **kwargs)
    finally:
        if getattr(self, "root", None):
            OUR_DIRS.add(os.path.basename(self.root))


local_sandbox.fresh_uid = _recording_fresh_uid
LocalSandbox.__init__ = _recording_init  # type: ignore[method-assign]

ISOLATIONS = ("bwrap", "none")


def require_bwrap() -> None:
    status = bwrap_status()
    if not status.works:
        missing("BWRAP", f"bubblewrap does not work here (apt-get install -y --no-install-recommends bubblewrap): {status.reason}")


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap":
        require_bwrap()
    return request.param


@pytest.fixture
def sb(isolation: str):
    with LocalSandbox(isolation=isolation) as s:
        yield s


def sandbox_dirs() -> set[str]:
    """The directories of this process's sandboxes that are still on disk."""
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(TMP_PREFIX) and n in OUR_DIRS}


def sandbox_processes() -> list[str]:
    """Live processes run by one of this process's sandboxes (a uid it handed out) or still
    children of this process. (Zombies are left out: dead, they wait for the host's init.)"""
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            st = os.stat(f"/proc/{name}")
            with open(f"/proc/{name}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
            state, ppid = rest.split()[0], int(rest.split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if state not in ("Z", "X") and (st.st_uid in OUR_UIDS or ppid == me):
            out.append(f"{name} {comm.split('(', 1)[1]} uid={st.st_uid} state={state}")
    return out


def fd_targets() -> dict[int, str]:
    """This process's open fds and what each points at."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own fd, gone already
            pass
    return out


def assert_no_more_fds_than(before: dict[int, str], within_s: float = 5.0) -> None:
    """No more fds are open than ``before``: one that a finishing thread still holds (another
    test's, in the same process) gets ``within_s`` to close; one that stays is named."""
    deadline = time.monotonic() + within_s
    while True:
        now = fd_targets()
        if len(now) <= len(before):
            return
        if time.monotonic() > deadline:
            new = {fd: target for fd, target in now.items() if before.get(fd) != target}
            raise AssertionError(f"{len(now) - len(before)} more fd(s) open than before: {new}")
        time.sleep(0.05)


# ------------------------------------------------------------------ escapes
@pytest.mark.parametrize("check", check_params(CHECKS))
def test_escape_check(check, sb):
    check(sb)


@pytest.mark.parametrize("check", list(LIFECYCLE_CHECKS.values()), ids=list(LIFECYCLE_CHECKS))
def test_lifecycle_check(check, isolation):
    made = []

    def make():
        made.append(LocalSandbox(isolation=isolation, timeout_s=30))
        return made[-1]

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        check(make)
    stayed = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert not stayed, f"close() could not remove everything: {stayed}"
    assert all(not os.path.exists(sb.root) for sb in made), "the sandbox's directory outlived close()"


# --------------------------------------------------------------------- runs
def test_run_returns_exit_code_stdout_stderr(sb):
    r = sb.run("echo out; echo err >&2; exit 3")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("error", 3, "out\n", "err\n")
    assert r.message == "exited with code 3"
    r = sb.run(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "c"])
    assert r.ok and r.stdout == "['a b', 'c']\n"
    r = sb.run("cat; echo", stdin="from stdin")
    assert r.stdout == "from stdin\n"
    r = sb.run(["python3", "-c", "import sys; print(len(sys.stdin.read()))"], stdin="x" * 1_000_000)
    assert r.stdout == "1000000\n"  # more than a pipe holds: written while the output is read
    with pytest.raises(SandboxError):
        sb.run([])


def test_run_python_sees_the_workspace_and_keeps_files(sb):
    sb.write_file("helper.py", "def twice(x):\n    return 2 * x\n")
    r = sb.run_python("import helper\nprint(helper.twice(21))\nopen('made.txt', 'w').write('kept')")
    assert r.ok and r.stdout == "42\n", r
    assert sb.read_file("made.txt") == b"kept"
    r = sb.run("cat made.txt && echo && pwd")
    assert r.stdout.splitlines() == ["kept", sb.workdir]
    r = sb.run_python("raise ValueError('boom')")
    assert r.status == "error" and r.exit_code == 1 and "ValueError: boom" in r.stderr
    assert 'line 1, in <module>' in r.stderr  # a traceback with the source line


def test_environment_is_clean(isolation, monkeypatch):
    monkeypatch.setenv("TOKENGYM_HOST_SECRET", "leaked")
    with LocalSandbox(isolation=isolation, env={"FOO": "bar"}) as sb:
        r = sb.run("env")
        assert r.ok and "leaked" not in r.stdout
        env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        assert env["HOME"] == sb.workdir and env["LANG"] == "C.UTF-8" and env["FOO"] == "bar"
        assert sb.run("id -u").stdout.strip() != "0"  # never root, not even inside


def test_time_cpu_file_and_fd_limits(isolation):
    with LocalSandbox(isolation=isolation, cpu_s=1, max_file_mb=1, max_open_files=64) as sb:
        r = sb.run_python("while True:\n    pass\n", timeout_s=20)
        assert r.status == "killed" and r.message == "killed: CPU time limit of 1 s reached", r
        assert r.duration_s < 10
        r = sb.run("head -c 2000000 /dev/zero > big")
        assert r.status == "killed" and "file size limit of 1 MB" in r.message, r
        assert len(sb.read_file("big")) <= 1024 * 1024
        r = sb.run_python("fs = [open('f%d' % i, 'w') for i in range(100)]")
        assert r.status == "error" and "Too many open files" in r.stderr
        r = sb.run("sleep 5", timeout_s=0.5)
        assert r.status == "timeout" and r.exit_code is None and r.duration_s < 3
        assert r.message == "timed out after 0.5 s; the process and its children were killed"


def test_memory_limit_reports_oom(isolation):
    with LocalSandbox(isolation=isolation, memory_mb=128) as sb:
        r = sb.run_python("x = bytearray(200 * 1024 * 1024)")
        assert r.status == "oom" and r.message == "ran out of memory (limit 128 MB)", r
        assert sb.run_python("x = bytearray(50 * 1024 * 1024); print('fits')").stdout == "fits\n"


def test_limits_hold_without_prlimit(isolation):
    """Where util-linux's prlimit is missing, the sandbox's python sets the limits, then execs."""
    with LocalSandbox(isolation=isolation, memory_mb=128, max_processes=8, cpu_s=1) as sb:
        sb._prlimit = None
        r = sb.run_python("import resource as r\nprint(r.getrlimit(r.RLIMIT_AS)[0] >> 20, r.getrlimit(r.RLIMIT_NPROC)[0])")
        assert r.stdout == "128 8\n", r
        assert sb.run_python("x = bytearray(200 << 20)").status == "oom"
        assert sb.run_python("while True:\n    pass").status == "killed"
        assert sb.run("echo hi").stdout == "hi\n"


def test_output_cap_keeps_the_head_and_counts_the_rest(isolation):
    with LocalSandbox(isolation=isolation, max_output_bytes=1000) as sb:
        r = sb.run_python("print('a' * 5000, end='')\nimport sys\nsys.stderr.write('b' * 10)")
        assert r.ok and r.stdout == "a" * 1000 and r.stdout_dropped == 4000
        assert r.stderr == "b" * 10 and r.stderr_dropped == 0


def test_process_limit(isolation):
    with LocalSandbox(isolation=isolation, max_processes=8) as sb:
        r = sb.run_python(
            "import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n    n += 1\n"
            "print(n)",
            timeout_s=20,
        )
        assert r.ok and int(r.stdout) < 8, r


def test_concurrent_calls_on_one_sandbox(sb):
    results = [None] * 6

    def go(i):
        results[i] = sb.run(f"sleep 0.3; echo {i}")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(6)]


@requires("ROOT", None if os.geteuid() == 0 else "the sweep after a call is of the sandbox's own uid: root hosts")
def test_a_call_that_ends_while_another_starts_does_not_sweep_the_starting_one(monkeypatch):
    """Without bubblewrap, the last call to end kills whatever still runs under the sandbox's uid.
    A call whose process is already running but not yet registered (its Popen has not returned)
    is not "nothing": here the second call's Popen returns only after the first call has ended."""
    first_done = threading.Event()
    real = subprocess.Popen

    class SlowToReturn(real):  # the second call's fork returns late, as on a loaded machine
        def __init__(self, argv, *a, **k):
            super().__init__(argv, *a, **k)
            script = str(argv[-1])  # a command runs as a script the sandbox writes
            if script.endswith(".sh") and "second" in Path(script).read_text():
                first_done.wait(10)

    monkeypatch.setattr(local_sandbox.subprocess, "Popen", SlowToReturn)
    with LocalSandbox(isolation="none") as box:
        out = {}
        second = threading.Thread(target=lambda: out.setdefault("second", box.run("sleep 0.5; echo second")))
        second.start()
        time.sleep(0.2)
        out["first"] = box.run("echo first")
        first_done.set()
        second.join(20)
    assert out["first"].stdout.strip() == "first"
    assert out["second"].ok and out["second"].stdout.strip() == "second", out["second"]


def test_reset_empties_the_workspace_and_kills_everything(sb):
    sb.write_file("a/b.txt", "x")
    sb.run('echo t > "$TMPDIR/t.txt"')
    marker = "tgreset" + os.urandom(4).hex()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", sb.run(["python3", "-c", "import time; time.sleep(60)", marker])))
    t.start()
    deadline = time.monotonic() + 10
    while not host_pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    sb.reset()
    t.join(10)
    assert not t.is_alive() and box["r"].status != "ok"
    wait_no_host_pids(marker)
    assert sb.run('ls -A; ls -A "$TMPDIR" | grep -c t.txt').stdout.split() == ["0"]
    with pytest.raises(SandboxError):
        sb.read_file("a/b.txt")


def test_close_is_idempotent_and_removes_everything(isolation):
    before = sandbox_dirs()
    sb = LocalSandbox(isolation=isolation)
    root = sb.root
    sb.write_file("x.txt", "x")
    assert os.path.isdir(root) and sb.run("true").ok
    sb.close()
    sb.close()
    assert sb.closed and not os.path.exists(root)
    for op in (lambda: sb.run("true"), lambda: sb.run_python("1"), lambda: sb.write_file("a", "b"), lambda: sb.read_file("x.txt"), sb.reset):
        with pytest.raises(SandboxError):
            op()
    assert sandbox_dirs() == before


def test_a_forgotten_sandbox_is_cleaned_up_by_the_garbage_collector():
    gc.collect()  # sandboxes another test forgot are collected first, not counted as this one's
    before = sandbox_dirs()
    sb = LocalSandbox(isolation="none")
    root = sb.root
    del sb
    gc.collect()
    assert not os.path.exists(root) and sandbox_dirs() == before


def test_ctrl_c_during_a_call_kills_its_processes(sb):
    marker = "tgsigint" + os.urandom(4).hex()

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            sb.run(f"exec sh -c 'sleep 30 & sleep 30' {marker}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    wait_no_host_pids(marker)
    assert sb.run("echo still").stdout == "still\n"


# ------------------------------------------------------------------ honesty
def test_bwrap_isolation_is_described():
    require_bwrap()
    with LocalSandbox(isolation="bwrap") as sb:
        iso = sb.isolation
        assert (iso.backend, iso.network, iso.filesystem, iso.limits) == ("local", True, True, True)
        assert sb.workdir == "/workspace"
        text = iso.describe()
        assert "network: none" in text and "files: isolated" in text and "bubblewrap" in text
        assert "NOT" not in text
    with LocalSandbox(isolation="auto") as sb:
        assert sb.isolation.network and sb.isolation.filesystem


def test_without_bwrap_the_description_says_what_is_missing():
    with LocalSandbox(isolation="none") as sb:
        iso = sb.isolation
        assert (iso.network, iso.filesystem, iso.limits) == (False, False, True)
        text = iso.describe()
        assert "network: NOT isolated" in text and "files: NOT isolated" in text and "plain rlimits only" in text
        assert repr(sb).startswith("<LocalSandbox ")


def test_a_bwrap_that_does_not_run_is_detected_by_a_probe():
    d = tempfile.mkdtemp(prefix="tokengym-fake-bwrap-")
    try:
        os.chmod(d, 0o755)  # the sandbox's own uid must be able to run it
        fake = Path(d, "bwrap")
        fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
        fake.chmod(0o755)
        status = bwrap_status(str(fake))
        assert isinstance(status, BwrapStatus) and not status.works
        assert "does not run here" in status.reason and "Operation not permitted" in status.reason, status
        with pytest.raises(SandboxError, match="does not run here"):
            LocalSandbox(isolation="bwrap", bwrap=str(fake))
        with LocalSandbox(isolation="auto", bwrap=str(fake)) as sb:  # auto falls back, and says so
            assert not sb.isolation.network and "does not run here" in sb.isolation.describe()
            assert sb.run("echo fallback").stdout == "fallback\n"
        assert not bwrap_status(str(Path(d, "nope"))).works
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_make_sandbox_and_arguments():
    with make_sandbox("local", isolation="none", timeout_s=3, memory_mb=256) as sb:
        assert isinstance(sb, LocalSandbox) and sb.limits.timeout_s == 3 and sb.limits.memory_mb == 256
    with pytest.raises(TypeError, match="unknown LocalSandbox argument"):
        LocalSandbox(isolation="none", memroy_mb=1)
    with pytest.raises(ValueError):
        LocalSandbox(isolation="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        make_sandbox("vm")


@requires("ROOT", None if os.geteuid() == 0 else "the uid of its own is for root hosts")
def test_as_root_every_sandbox_gets_a_uid_of_its_own():
    with LocalSandbox(isolation="none") as a, LocalSandbox(isolation="none") as b:
        ua, ub = a.run("id -u").stdout.strip(), b.run("id -u").stdout.strip()
        assert ua != ub and "0" not in (ua, ub)
        assert Path(a.root, "work").stat().st_uid == int(ua)


@pytest.mark.alone
def test_calls_are_fast(sb):
    sb.run("true")
    times = []
    for _ in range(10):
        t = time.perf_counter()
        assert sb.run_python("print(1)").ok
        times.append(time.perf_counter() - t)
    assert statistics.median(times) < 0.5, times  # ~20-30 ms on CI's machine


# ---------------------------------------------------------------- no leaks
@pytest.mark.slow
def test_no_process_directory_or_fd_left_after_100_sandboxes(isolation):
    for _ in range(3):  # warm up: the probe, lazy imports
        with LocalSandbox(isolation=isolation) as sb:
            sb.run("true")
    procs, dirs, fds = sandbox_processes(), sandbox_dirs(), fd_targets()
    for i in range(100):  # 200 cost CI a minute more and found nothing 100 does not (every case is in each 50)
        sb = LocalSandbox(isolation=isolation, timeout_s=2)
        try:
            sb.write_file("in.txt", str(i))
            r = sb.run("sleep 300 & nohup sleep 300 >/dev/null 2>&1 & cat in.txt")
            assert r.stdout == str(i)
            if i % 20 == 0:
                assert sb.run("sleep 300", timeout_s=0.2).status == "timeout"
            if i % 50 == 1:
                raise RuntimeError("an episode fails")
        except RuntimeError:
            pass
        finally:
            sb.close()
    time.sleep(0.2)
    assert sandbox_processes() == procs
    assert sandbox_dirs() == dirs
    assert_no_more_fds_than(fds)


# ------------------------------------------------------ the host's limits
def _mount_small_tmpfs(path: str, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tokengym-test", path], check=True)


def _fill(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError:
        pass
    finally:
        os.close(fd)


@requires("ROOT", None if os.geteuid() == 0 and shutil.which("mount") else "mounts a small tmpfs as the full disk: needs root and mount")
def test_a_full_host_disk_is_a_sandbox_error_or_a_result():
    d = tempfile.mkdtemp(prefix="tokengym-full-disk-")
    try:
        _mount_small_tmpfs(d, "2m")
        try:
            sb = LocalSandbox(isolation="none", tmp_root=d)
            _fill(os.path.join(d, "filler"))  # the host's disk fills up meanwhile
            r = sb.run_python("print('hi')")
            assert r.status == "crashed" and "could not store the snippet" in r.message, r
            r = sb.run("echo hi")
            assert r.status == "crashed" and "could not store the snippet" in r.message, r
            assert sb.run(["echo", "an argv still runs"]).stdout == "an argv still runs\n"
            sb.close()
            _fill(os.path.join(d, "filler2"))
            with pytest.raises(SandboxError, match="No space left on device"):
                LocalSandbox(isolation="none", tmp_root=d)
        finally:
            subprocess.run(["umount", "-l", d], check=False)
    finally:
        os.rmdir(d)


def test_read_file_refuses_files_of_another_owner(sb):
    if os.geteuid() != 0:
        missing("ROOT", "only root can make a file of another owner in the workspace")
    sb.write_file("mine.txt", "ok")
    host_side = Path(sb._work, "rootfile")  # as if hard-linked from a root-owned file
    host_side.write_text("secret of root")
    with pytest.raises(SandboxError, match="belongs to another user"):
        sb.read_file("rootfile")
    assert sb.read_file("mine.txt") == b"ok"


def test_limits_hold_for_the_whole_sandbox_where_the_host_allows_a_cgroup(isolation):
    with LocalSandbox(isolation=isolation) as sb:
        text = sb.isolation.describe()
        if sb.isolation.group_limits:
            assert "for the whole sandbox" in text and "cgroup" in text
            r = sb.run("cat /proc/self/cgroup")
            if isolation == "none":  # (bubblewrap gives the call a cgroup namespace of its own)
                assert "tokengym-sandbox-" in r.stdout, r
        else:
            assert "per process only" in text, text
        if os.geteuid() == 0:
            assert sb.isolation.disk_quota and "tmpfs" in text
            r = sb.run("df -k . | tail -1")
            assert str(sb.limits.disk_mb * 1024) in r.stdout, r  # the workspace is a tmpfs of that size


NONROOT_SCRIPT = """
import os, sys, warnings
from tokengym.envs.sandbox import LocalSandbox, SandboxError, bwrap_status
try:
    LocalSandbox(isolation="auto", bwrap="/nonexistent/bwrap")
    print("AUTO-RAN-UNISOLATED")
except SandboxError as err:
    print("REFUSED", err)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    sb = LocalSandbox(isolation="none", bwrap="/nonexistent/bwrap")
    print("WARNED", [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)])
    print("WHO", sb.run("id -u").stdout.strip(), sb.isolation.describe())
    sb.close()
if bwrap_status().works:
    with LocalSandbox(isolation="auto", disk_mb=16, max_files=500, timeout_s=30) as sb:
        print("ISOLATED", sb.isolation.network, sb.isolation.group_limits, sb.isolation.disk_quota)
        r = sb.run("i=0; while [ $i -lt 40 ]; do head -c 1000000 /dev/zero > f$i; i=$((i+1)); sleep 0.02; done; echo wrote")
        print("DISK", r.status, r.message)
        r = sb.run("rm -f f*; echo freed")
        print("FREED", r.status)
else:
    print("NO-BWRAP", bwrap_status().reason)
"""


@requires("ROOT", None if os.geteuid() == 0 and shutil.which("setpriv") else "runs a child as an unprivileged uid: needs root and setpriv")
def test_a_non_root_host_without_bubblewrap_is_refused_unless_asked_for():
    """As an ordinary user, "auto" without a working bubblewrap refuses (and says how to get
    isolation); "none" works when asked for, with a warning; with bubblewrap the quota is a
    watchdog and the limits say they are per process."""
    nobody = 65534
    probe = subprocess.run(
        ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups", sys.executable, "-c", "import tokengym.envs.sandbox"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    if probe.returncode != 0:
        missing("ROOT", f"uid {nobody} cannot import this checkout (make its folders world-readable): {probe.stderr.strip()[-200:]}")
    r = subprocess.run(
        ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups", sys.executable, "-c", textwrap.dedent(NONROOT_SCRIPT)],
        capture_output=True, text=True, timeout=120, cwd="/", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/"},
    )  # fmt: skip
    out = r.stdout
    assert r.returncode == 0, r.stderr[-2000:]
    assert "AUTO-RAN-UNISOLATED" not in out
    refused = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert "install bubblewrap" in refused.lower() and "docker" in refused.lower(), refused
    warned = next(line for line in out.splitlines() if line.startswith("WARNED"))
    assert "commands run as you" in warned, warned
    who = next(line for line in out.splitlines() if line.startswith("WHO"))
    assert who.split()[1] == str(nobody) and "processes are within reach" in who, who
    if "NO-BWRAP" not in out:
        assert "ISOLATED True False True" in out, out  # isolated; limits per process; quota by watchdog
        disk = next(line for line in out.splitlines() if line.startswith("DISK"))
        assert disk.startswith("DISK killed") and "quota" in disk, disk
        assert "FREED ok" in out


def test_remove_tree_takes_any_tree(tmp_path):
    """Where the workspace is no tmpfs (no root), close() removes the tree itself: 3,000 levels
    deep (shutil.rmtree would raise RecursionError), read-only directories, odd names."""
    from tokengym.envs.sandbox.local.leftovers import remove_tree

    top = tmp_path / "tree"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        for name in (b"odd\nname", b"bad\xffbytes", b"-rf"):
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o400, dir_fd=fd))
        os.fchmod(fd, 0o500)
    finally:
        os.close(fd)
    (top / "ro").mkdir()
    (top / "ro" / "f").write_text("x")
    (top / "ro").chmod(0o500)
    (top / "link").symlink_to(tmp_path)  # removed, never followed
    remove_tree(str(top))
    assert not top.exists() and tmp_path.exists()
