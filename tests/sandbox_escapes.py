"""Escape and containment checks that any :class:`~tokengym.envs.sandbox.Sandbox` backend must pass.

Each check is a function ``check_xxx(sb)`` that attacks a running sandbox through its public
interface only (``run``, ``run_python``, ``write_file``, ``read_file``, ``isolation``) and
asserts that the attack was contained: the call came back with a clear result within its
time limit, the sandbox still works afterwards, and the host is unchanged. They are
backend-neutral: a backend's tests run them all::

    from sandbox_escapes import CHECKS

    @pytest.mark.parametrize("check", list(CHECKS.values()), ids=list(CHECKS))
    def test_escape(check, sandbox):
        check(sandbox)

A check that tests a promise the sandbox does not make (network or file-system isolation,
per ``sb.isolation``) skips with the reason, so a sandbox may be weaker than another, but
never weaker than it says. Checks that apply to every sandbox (limits, timeouts, output
caps, leftovers, the host-side file API) never skip.

Traffic stays on this machine: the network check only tries to reach listeners it opens
itself on 127.0.0.1 and on an abstract unix socket.

:data:`LIFECYCLE_CHECKS` take a function that makes a fresh sandbox instead (they close it):
what a sandbox leaves on the host must be gone after ``close()``, whatever it built.
Every check looks only at what it made itself (files and IPC keys named by a random token,
processes by a random marker), never at the rest of the machine, where other sandboxes may run.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tokengym.envs.sandbox import ExecResult, Sandbox, SandboxError
from needs import missing

__all__ = [
    "ALONE",
    "check_params",
    "CHECKS",
    "HostSecret",
    "assert_alive",
    "check_background_leftovers",
    "check_fork_bomb",
    "check_host_file_api",
    "check_infinite_loop",
    "check_memory_bomb",
    "check_network",
    "check_output_flood",
    "check_read_host_files",
    "check_symlink_escape",
    "check_write_outside",
    "check_memory_for_the_whole_sandbox",
    "check_disk_quota",
    "check_long_names",
    "check_nothing_outlives_close",
    "host_pids_with",
    "LIFECYCLE_CHECKS",
]

PROJECT_FILE = Path(__file__).resolve().parent.parent / "pyproject.toml"
"""One of the project's own files: a sandbox with file-system isolation must not read it."""

SLACK_S = 5.0
"""How much longer than its timeout a call may take to come back (kill, drain, clean-up)."""


# ------------------------------------------------------------------ helpers
@dataclass
class HostSecret:
    """A world-readable file outside every workspace, holding a random token."""

    dir: Path
    file: Path
    token: str


@contextmanager
def host_secret() -> Iterator[HostSecret]:
    token = f"tokengym-secret-{secrets.token_hex(12)}"
    d = Path(tempfile.mkdtemp(prefix="tokengym-escape-"))
    try:
        os.chmod(d, 0o755)  # readable by anyone: only isolation (not permissions) may hide it
        f = d / "secret.txt"
        f.write_text(token + "\n")
        os.chmod(f, 0o644)
        yield HostSecret(d, f, token)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def host_pids_with(marker: str, *, live: bool = False) -> list[int]:
    """Host processes whose command line contains ``marker`` (sees containers too: same kernel);
    ``live``: zombies left out (dead, waiting to be reaped)."""
    needle = marker.encode()
    me = os.getpid()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
            if live:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        continue
            out.append(int(name))
        except OSError:
            pass
    return out


def wait_no_host_pids(marker: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        left = host_pids_with(marker)
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(left)} process(es) of the sandbox still run on the host: {left[:10]}")
        time.sleep(0.05)


def assert_alive(sb: Sandbox) -> None:
    """The sandbox still runs commands normally."""
    r = sb.run("echo alive", timeout_s=30)
    assert r.ok and r.stdout.strip() == "alive", f"the sandbox does not work after the attack: {r}"


def assert_came_back(r: ExecResult, timeout_s: float) -> None:
    assert r.duration_s < timeout_s + SLACK_S, f"the call took {r.duration_s:.1f} s (timeout {timeout_s} s): {r}"
    if not r.ok:
        assert r.message, f"a failed call must say why: {r}"


def _marker() -> str:
    return f"tgmark{secrets.token_hex(6)}"


def _python_argv(code: str, marker: str) -> list[str]:
    """A python3 command whose argv carries ``marker`` (so its processes can be found on the host)."""
    return ["python3", "-c", code, marker]


# ------------------------------------------------------------------- checks
def check_network(sb: Sandbox) -> None:
    """No network: the host's loopback listeners (TCP and abstract unix socket) are unreachable,
    and the sandbox has no interface but loopback."""
    if not sb.isolation.network:
        pytest.skip(f"this sandbox does not claim network isolation ({sb.isolation.describe()})")
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        port = tcp.getsockname()[1]
        abstract = f"tokengym-escape-{secrets.token_hex(6)}"
        unix.bind("\0" + abstract)
        unix.listen(8)
        code = f"""
import socket
try:
    names = [n for _, n in socket.if_nameindex()]
except OSError:
    names = []
print("IFACES", ",".join(names))
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print("TCP-CONNECTED")
except OSError as e:
    print("tcp refused:", e)
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect("\\0{abstract}")
    print("UNIX-CONNECTED")
except OSError as e:
    print("unix refused:", e)
"""
        r = sb.run_python(code, timeout_s=15)
        assert_came_back(r, 15)
        assert "TCP-CONNECTED" not in r.stdout, f"reached the host's 127.0.0.1:{port}: {r}"
        assert "UNIX-CONNECTED" not in r.stdout, f"reached the host's abstract unix socket: {r}"
        for s in (tcp, unix):
            s.setblocking(False)
            try:
                conn, _ = s.accept()
                conn.close()
                raise AssertionError("the host listener got a connection from the sandbox")
            except BlockingIOError:
                pass
        line = next((x for x in r.stdout.splitlines() if x.startswith("IFACES")), "IFACES ")
        ifaces = [n for n in line.split(" ", 1)[1].split(",") if n]
        assert set(ifaces) <= {"lo"}, f"the sandbox has network interfaces {ifaces}"
    finally:
        tcp.close()
        unix.close()
    assert_alive(sb)


def check_read_host_files(sb: Sandbox) -> None:
    """Host files outside the workspace stay unread: /etc/shadow always; with file-system
    isolation also the project's own files and any world-readable host file."""
    try:
        host_shadow = Path("/etc/shadow").read_bytes()
    except OSError:
        host_shadow = None
    r = sb.run("cat /etc/shadow", timeout_s=10)
    assert_came_back(r, 10)
    if host_shadow:
        assert not (r.ok and r.stdout.encode() == host_shadow), "the sandbox read the host's /etc/shadow"
        for line in host_shadow.decode(errors="replace").splitlines():
            fields = line.split(":")
            if len(fields) > 1 and len(fields[1]) > 3:  # a real password hash
                assert fields[1] not in r.stdout, "a host password hash leaked into the sandbox"
    if not sb.isolation.filesystem:
        pytest.skip(f"this sandbox does not claim file-system isolation ({sb.isolation.describe()})")
    with host_secret() as s:
        r = sb.run(f"cat {s.file}; ls -la {s.dir}; find / -name secret.txt -path '*tokengym-escape*' 2>/dev/null", timeout_s=30)
        assert_came_back(r, 30)
        assert s.token not in r.stdout + r.stderr, "the sandbox read a host file outside its workspace"
        assert str(s.dir.name) not in r.stdout, "the sandbox can list the host's temp directory"
    project = PROJECT_FILE.read_text()
    r = sb.run(f"cat {PROJECT_FILE}", timeout_s=10)
    assert project not in r.stdout, "the sandbox read the project's own files"
    r = sb.run_python(f"print(open({str(PROJECT_FILE)!r}).read())", timeout_s=10)
    assert project not in r.stdout, "the sandbox read the project's own files (python)"
    assert_alive(sb)


def check_write_outside(sb: Sandbox) -> None:
    """Writes outside the workspace fail and the host is unchanged: system directories always;
    with file-system isolation also the project, the host's /tmp and world-writable host dirs."""
    tag = secrets.token_hex(6)
    always = [f"/etc/tokengym-pwned-{tag}", f"/usr/tokengym-pwned-{tag}", f"/usr/bin/tokengym-pwned-{tag}"]
    with host_secret() as s:
        os.chmod(s.dir, 0o777)  # world-writable: only isolation (not permissions) may protect it
        gated = [
            str(s.dir / f"pwned-{tag}"),
            str(PROJECT_FILE.parent / f"tokengym-pwned-{tag}"),
            f"{tempfile.gettempdir()}/tokengym-pwned-{tag}",
        ]
        before = s.file.read_text()
        targets = always + gated + [str(s.file)]
        script = "; ".join(f"echo pwned > {t} 2>/dev/null" for t in targets) + "; echo done"
        try:
            r = sb.run(script, timeout_s=10)
            assert_came_back(r, 10)
            r = sb.run_python(
                "import os\n"
                f"for t in {targets!r}:\n"
                "    try:\n"
                "        open(t, 'a').write('pwned')\n"
                "    except OSError:\n"
                "        pass\n",
                timeout_s=10,
            )
            assert_came_back(r, 10)
            for t in always:
                assert not os.path.exists(t), f"the sandbox wrote {t} on the host"
            if sb.isolation.filesystem:
                for t in gated:
                    assert not os.path.exists(t), f"the sandbox wrote {t} on the host"
                assert s.file.read_text() == before, "the sandbox changed a host file"
        finally:
            for t in always + gated:
                try:
                    os.unlink(t)
                except OSError:
                    pass
    assert_alive(sb)
    if not sb.isolation.filesystem:
        pytest.skip(f"system dirs checked; the rest needs file-system isolation ({sb.isolation.describe()})")


def check_fork_bomb(sb: Sandbox) -> None:
    """A shell and a Python fork bomb are contained by the process limit and the timeout, and
    nothing of them is left on the host afterwards."""
    marker = _marker()
    # (the marker is in the argv of the shell, so of every process it forks: the host can find them)
    r = sb.run(f"exec /bin/sh -c 'bomb() {{ bomb | bomb & }}; bomb; sleep 3' {marker}", timeout_s=4)
    assert_came_back(r, 4)
    wait_no_host_pids(marker)
    assert_alive(sb)
    marker = _marker()
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = sb.run(_python_argv(code, marker), timeout_s=4)
    assert_came_back(r, 4)
    assert r.status in ("timeout", "killed", "error", "oom"), r
    wait_no_host_pids(marker)
    assert_alive(sb)


def check_memory_bomb(sb: Sandbox) -> None:
    """Allocating without end ends as ``oom`` (or killed), quickly, and the sandbox goes on."""
    r = sb.run_python("a = []\nwhile True:\n    a.append(bytearray(64 * 1024 * 1024))\n", timeout_s=20)
    assert_came_back(r, 20)
    assert r.status in ("oom", "killed"), r
    r = sb.run_python("x = bytearray(64 * 1024 ** 3)", timeout_s=20)  # one huge request
    assert_came_back(r, 20)
    assert r.status in ("oom", "killed"), r
    assert_alive(sb)


def check_infinite_loop(sb: Sandbox) -> None:
    """A busy loop, a sleeping command and a shell loop all end at their timeout."""
    for run in (
        lambda: sb.run_python("while True:\n    pass\n", timeout_s=2),
        lambda: sb.run("sleep 1000", timeout_s=2),
        lambda: sb.run("while :; do :; done", timeout_s=2),
    ):
        r = run()
        assert_came_back(r, 2)
        assert r.status in ("timeout", "killed"), r
        if r.status == "timeout":
            assert "timed out" in r.message, r
    assert_alive(sb)


def _peak_rss_tracker() -> Callable[[], int] | None:
    """A function returning how far this process's peak RSS grew since the call, or None."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None

    def grown() -> int:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                fields[k] = v
        return int(fields["VmHWM"].split()[0]) * 1024 - base

    with open("/proc/self/status") as f:
        base = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    return grown


def check_output_flood(sb: Sandbox) -> None:
    """100 MB on stdout (and on stderr) comes back cut to the cap, the rest counted, without
    the host ever holding it in memory; an endless stream ends at the timeout, also cut."""
    cap = sb.limits.max_output_bytes
    grown = _peak_rss_tracker()
    total = 100 * 1024 * 1024
    r = sb.run_python(f"import sys\nsys.stdout.write('x' * {total})\nsys.stderr.write('y' * {total})\n", timeout_s=60)
    assert_came_back(r, 60)
    assert len(r.stdout.encode()) <= cap and len(r.stderr.encode()) <= cap, (len(r.stdout), len(r.stderr))
    assert r.stdout_dropped > 0 and r.stderr_dropped > 0, r.message
    if r.ok:
        assert len(r.stdout) + r.stdout_dropped == total, (len(r.stdout), r.stdout_dropped)
    if grown is not None:
        assert grown() < 64 * 1024 * 1024, f"the host's memory grew by {grown() >> 20} MB reading the flood"
    r = sb.run("yes tokengym", timeout_s=2)
    assert_came_back(r, 2)
    assert r.status in ("timeout", "killed"), r
    assert len(r.stdout.encode()) <= cap and r.stdout_dropped > 0
    assert_alive(sb)


def check_background_leftovers(sb: Sandbox) -> None:
    """Whatever a call starts in the background (``&``, ``nohup``, ``setsid``, a double-forked
    daemon, one holding the output pipe open) is gone when the call returns, and the call
    returns without waiting for it."""
    sleeper = "import time; time.sleep(300)"
    daemon = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(300)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    variants = {
        "ampersand": lambda m: f"python3 -c '{sleeper}' {m} &\necho started",
        "holds_pipe": lambda m: f"python3 -c '{sleeper}' {m} & echo started",
        "nohup": lambda m: f"nohup python3 -c '{sleeper}' {m} >/dev/null 2>&1 &\necho started",
        "setsid": lambda m: f"setsid python3 -c '{sleeper}' {m} >/dev/null 2>&1 < /dev/null &\necho started",
    }
    for name, script in variants.items():
        marker = _marker()
        r = sb.run(script(marker), timeout_s=10)
        assert_came_back(r, 10)
        assert r.duration_s < 5, f"{name}: the call waited for its background process ({r.duration_s:.1f} s)"
        wait_no_host_pids(marker)
    marker = _marker()
    r = sb.run(_python_argv(daemon, marker), timeout_s=10)
    assert_came_back(r, 10)
    assert r.duration_s < 5, f"daemon: the call waited for it ({r.duration_s:.1f} s)"
    wait_no_host_pids(marker)
    # a leftover that would write later must not: the next call sees no trace of it
    r = sb.run("(sleep 1; echo late > late.txt) > /dev/null 2>&1 &\necho started", timeout_s=10)
    assert_came_back(r, 10)
    time.sleep(2.0)
    r = sb.run("ls", timeout_s=10)
    assert "late.txt" not in r.stdout, "a background process kept running after its call"
    assert_alive(sb)


def _never_hangs(fn: Callable[[], object], within_s: float = 10.0) -> object:
    box: dict[str, object] = {}

    def go() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 -- handed back to the caller
            box["error"] = err

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"the host-side call hung for more than {within_s} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def check_symlink_escape(sb: Sandbox) -> None:
    """Symlinks (and hard links, fifos) made in the workspace lead nowhere outside it: neither
    for commands in the sandbox nor for the host-side ``read_file``/``write_file``."""
    with host_secret() as s:
        os.chmod(s.dir, 0o777)
        before = s.file.read_text()
        r = sb.run(
            f"ln -s {s.file} leak; ln -s / rootlink; ln -s {s.dir} dirlink; ln -s /etc/shadow shadow; "
            f"ln {s.file} hard 2>/dev/null; mkfifo fifo 2>/dev/null; mkdir -p sub; ln -s ../../.. sub/up; echo made",
            timeout_s=10,
        )
        assert_came_back(r, 10)
        assert "made" in r.stdout, r
        # host-side reads never follow a link out, never hang
        # (a hard link is only out of reach where the sandbox cannot see the host's files at all:
        # without that, a sandbox running as the host's own user may link the user's files)
        paths = ["leak", f"rootlink{s.file}", "dirlink/secret.txt", f"sub/up{s.file}"]
        for path in paths + (["hard"] if sb.isolation.filesystem else []):
            try:
                data = _never_hangs(lambda p=path: sb.read_file(p))
            except SandboxError:
                continue
            assert s.token.encode() not in data, f"read_file({path!r}) read a host file"  # type: ignore[operator]
        try:
            data = _never_hangs(lambda: sb.read_file("shadow"))
            try:
                assert data != Path("/etc/shadow").read_bytes(), "read_file('shadow') read the host's /etc/shadow"
            except OSError:
                pass
        except SandboxError:
            pass
        try:
            _never_hangs(lambda: sb.read_file("fifo"))
        except SandboxError:
            pass
        # host-side writes never write through a link
        for path in ("dirlink/pwned.txt", "leak", f"rootlink{s.dir}/pwned2.txt", "hard"):  # "hard": replaced, not written through
            try:
                _never_hangs(lambda p=path: sb.write_file(p, "pwned"))
            except SandboxError:
                pass
        try:
            _never_hangs(lambda: sb.write_file("fifo", "x"))
        except SandboxError:
            pass
        assert not (s.dir / "pwned.txt").exists() and not (s.dir / "pwned2.txt").exists(), "write_file wrote through a symlink"
        assert s.file.read_text() == before, "write_file changed a host file through a link"
        # paths that name places outside the workspace are refused outright
        for bad in ("../escape.txt", "../../etc/passwd", "a/../../escape.txt", "/etc/passwd", ""):
            with pytest.raises(SandboxError):
                sb.write_file(bad, "x")
            with pytest.raises(SandboxError):
                sb.read_file(bad)
        assert not Path(tempfile.gettempdir(), "escape.txt").exists()
        # inside the sandbox the links resolve in its own view of the file system
        r = sb.run("cat leak dirlink/secret.txt hard sub/up" + str(s.file) + " 2>&1; echo end", timeout_s=10)
        if sb.isolation.filesystem:
            assert s.token not in r.stdout, "a symlink in the workspace led to a host file"
        assert s.file.read_text() == before
    assert_alive(sb)


def check_host_file_api(sb: Sandbox) -> None:
    """``write_file``/``read_file`` round-trip inside the workspace, make parents, and a file
    written by the host is the sandbox's to change."""
    sb.write_file("dir/sub/a.txt", "héllo\n")
    sb.write_file("b.bin", bytes(range(256)))
    assert sb.read_file("dir/sub/a.txt") == "héllo\n".encode()
    assert sb.read_file("b.bin") == bytes(range(256))
    assert sb.read_file("b.bin", max_bytes=10) == bytes(range(10))
    r = sb.run("cat dir/sub/a.txt && echo more >> dir/sub/a.txt && rm b.bin && echo ok", timeout_s=10)
    assert r.ok and "ok" in r.stdout, r
    assert sb.read_file("dir/sub/a.txt") == "héllo\nmore\n".encode()
    with pytest.raises(SandboxError):
        sb.read_file("b.bin")
    with pytest.raises(SandboxError):
        sb.read_file("dir")




def check_memory_for_the_whole_sandbox(sb: Sandbox) -> None:
    """Six forked children, each under the memory limit, together far over it: the limit holds
    for the sandbox as a whole (some are killed, the call says ``oom``), not per process."""
    if not sb.isolation.group_limits:
        missing("CGROUPS", f"this sandbox states per-process limits only ({sb.isolation.describe()})")
    each = max(8, sb.limits.memory_mb * 4 // 10)
    code = f"""
import os, time
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = b"x" * ({each} << 20)  # written, so really resident
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
alive = 0
for pid in kids:
    _, status = os.waitpid(pid, 0)
    alive += status == 0
print("held", alive)
"""
    r = sb.run_python(code, timeout_s=30)
    assert_came_back(r, 30)
    held = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("held")]
    assert not held or held[0] * each <= sb.limits.memory_mb, f"{held[0]} children of {each} MB all held their memory: {r}"
    assert r.status == "oom" and "ran out of memory" in r.message, r
    assert_alive(sb)


def _file_count(sb: Sandbox) -> int:
    r = sb.run("find . -mindepth 1 | wc -l", timeout_s=30)
    assert r.ok, r
    return int(r.stdout.split()[0])


def check_disk_quota(sb: Sandbox) -> None:
    """Filling the workspace past its disk quota, or past its file quota, ends in a result that
    says so (never an exception, never the host's disk); the host-side calls answer with a result
    or a SandboxError while it is full; deleting frees it again."""
    if not sb.isolation.disk_quota:
        missing("DISK_QUOTA", f"this sandbox has no disk quota ({sb.isolation.describe()})")
    L = sb.limits
    chunk = max(1, min(32, L.max_file_mb - 1))
    code = f"""
import os
written = 0
for i in range({(2 * L.disk_mb) // chunk + 2}):
    with open("fill%d" % i, "wb") as f:
        f.write(bytes({chunk} << 20))
    written += {chunk}
    print("written", written, flush=True)
"""
    r = sb.run_python(code, timeout_s=60)
    assert_came_back(r, 60)
    assert not r.ok, f"wrote {2 * L.disk_mb} MB into a {L.disk_mb} MB workspace: {r}"
    assert "quota" in r.message, r
    # while it is full: results and SandboxErrors, nothing raw
    assert isinstance(sb.run_python("print('still runs')", timeout_s=30), ExecResult)
    assert isinstance(sb.run("echo more >> fill0", timeout_s=30), ExecResult)
    try:
        sb.write_file("more.bin", bytes(4 << 20))
    except SandboxError as err:
        assert "cannot write" in str(err), err
    r = sb.run("rm -f fill* more.bin; echo freed", timeout_s=30)
    assert r.ok and "freed" in r.stdout, r
    # the file (inode) quota
    r = sb.run_python(f"for i in range({2 * L.max_files}):\n    open('n%d' % i, 'w').close()\n", timeout_s=60)
    assert_came_back(r, 60)
    assert not r.ok and "quota" in r.message, r
    assert _file_count(sb) <= 2 * L.max_files
    r = sb.run("find . -mindepth 1 -delete; echo freed", timeout_s=60)
    assert r.ok and "freed" in r.stdout, r
    sb.write_file("after.txt", "fits again")
    assert sb.read_file("after.txt") == b"fits again"
    assert_alive(sb)


def check_long_names(sb: Sandbox) -> None:
    """A 300-character file name is a SandboxError for the host-side calls, a plain error inside."""
    long = "n" * 300
    for call in (lambda: sb.write_file(long, "x"), lambda: sb.read_file(long), lambda: sb.write_file(f"d/{long}/x", "x")):
        with pytest.raises(SandboxError, match="longer than"):
            call()
    r = sb.run(f"touch {long}", timeout_s=10)
    assert r.status == "error" and r.message, r
    assert_alive(sb)


_DEEP_TREE = """
import os
os.makedirs("ro/inner", exist_ok=True)
open("ro/inner/f", "w").write("x")
for name in (b"odd\\nname", b"bad\\xffbytes", b"-rf", b" space "):
    open(name, "wb").write(b"x")
os.chmod("ro/inner", 0o500)
os.chmod("ro", 0o500)
os.mkdir("deep")
os.chdir("deep")
for _ in range({depth}):
    os.mkdir("d")
    os.chdir("d")
open("bottom.txt", "w").write("bottom")
os.chmod(".", 0o500)
print("built")
"""

_IPC = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
key = int(sys.argv[1])
print("shm", libc.shmget(key, 4096, 0o1600), "sem", libc.semget(key + 1, 1, 0o1600), "msg", libc.msgget(key + 2, 0o1600))
"""


def _sysv_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                next(f)
                keys.update(int(line.split()[0]) for line in f)
        except (OSError, StopIteration):
            pass
    return keys


def check_nothing_outlives_close(make: Callable[[], Sandbox]) -> None:
    """Files in /tmp, /var/tmp and /dev/shm, System V IPC objects, background processes, and a
    workspace tree 3,000 levels deep with read-only directories and odd names: ``close()`` takes
    them all, never raises, and the host keeps no trace of them."""
    token = f"tgleft{secrets.token_hex(6)}"
    key = 0x7467_0000 + secrets.randbelow(0xFFFF)
    marker = _marker()
    sb = make()
    try:
        r = sb.run(
            f"for d in /tmp /var/tmp /dev/shm; do echo x > $d/{token} 2>/dev/null; mkdir -p $d/{token}-dir/sub 2>/dev/null; done; "
            f"python3 -c '{_IPC}' {key}; setsid python3 -c 'import time; time.sleep(300)' {marker} >/dev/null 2>&1 & echo made",
            timeout_s=30,
        )
        assert_came_back(r, 30)
        assert "made" in r.stdout, r
        r = sb.run_python(_DEEP_TREE.format(depth=3000), timeout_s=60)
        assert_came_back(r, 60)
        assert r.ok and "built" in r.stdout, r
    finally:
        took = time.monotonic()
        sb.close()  # must not raise
        took = time.monotonic() - took
    sb.close()
    assert sb.closed
    assert took < 30, f"close() took {took:.1f} s"
    left = [f"{d}/{n}" for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d) for n in os.listdir(d) if token in n]
    assert not left, f"files of the sandbox outlived close(): {left}"
    ipc = {key, key + 1, key + 2} & _sysv_keys()
    assert not ipc, f"System V IPC objects of the sandbox outlived close(): keys {sorted(ipc)}"
    wait_no_host_pids(marker)


LIFECYCLE_CHECKS: dict[str, Callable[[Callable[[], Sandbox]], None]] = {
    "nothing_outlives_close": check_nothing_outlives_close,
}
"""Checks that take a sandbox factory (they close what they make)."""

ALONE = {"fork_bomb", "memory_bomb", "memory_for_the_whole_sandbox", "disk_quota", "infinite_loop", "output_flood"}
"""Checks that push a limit to its end (processes, memory, tmpfs pages, CPU, a pipe's rate) run
``alone`` in a side-by-side run: their bounds are the machine's as much as the sandbox's."""


def check_params(checks: dict[str, Callable]) -> list:
    """``checks`` as ``pytest.param``s with their names as ids, the :data:`ALONE` ones marked."""
    return [pytest.param(fn, id=name, marks=[pytest.mark.alone] if name in ALONE else []) for name, fn in checks.items()]


CHECKS: dict[str, Callable[[Sandbox], None]] = {
    "network": check_network,
    "read_host_files": check_read_host_files,
    "write_outside": check_write_outside,
    "fork_bomb": check_fork_bomb,
    "memory_bomb": check_memory_bomb,
    "infinite_loop": check_infinite_loop,
    "output_flood": check_output_flood,
    "background_leftovers": check_background_leftovers,
    "symlink_escape": check_symlink_escape,
    "host_file_api": check_host_file_api,
    "memory_for_the_whole_sandbox": check_memory_for_the_whole_sandbox,
    "disk_quota": check_disk_quota,
    "long_names": check_long_names,
}
"""Every check by name: parametrize a backend's test over it."""
