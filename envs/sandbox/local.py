"""The local process sandbox: the embedded default, no daemon needed.

Each :class:`LocalSandbox` owns a temporary directory on the host::

    tokengym-sandbox-XXXX/      host-owned, mode 0711
        work/                   the workspace (read-write for the sandbox)
        tmp/                    the sandbox's private /tmp
        run/                    host-owned, read-only for the sandbox: python links, /etc/passwd, snippets

Every call starts a fresh child process in its own session and process group, with a clean
environment and resource limits (``prlimit``: CPU seconds, address space, processes, file
size, open files, no core files), and reads stdout and stderr through pipes with a cap
(the head is kept, the rest is counted and dropped: 100 MB of output never sits in memory).
At the wall-clock limit the whole process group is killed; after every call whatever the
command left running in the background is killed too.

**Isolation.** Where `bubblewrap <https://github.com/containers/bubblewrap>`_ works (checked by
a probe run, not by looking for the binary), each call runs inside new user, pid, network,
ipc, uts and cgroup namespaces: only a loopback interface, a read-only view of ``/usr`` (and
the interpreter's own prefix), a few files of ``/etc``, a private ``/tmp``, and the workspace
bound read-write at ``/workspace``. The rest of the host's files (the project, home
directories, ``/etc/shadow``) do not exist in there. ``--die-with-parent`` and the pid
namespace make every process of a call die with it. Without bubblewrap the same limits
apply, but the network and the host's files are **not** isolated; :attr:`isolation` says so.

**The user.** When the host runs as root, every sandbox runs as a uid of its own (a fresh,
otherwise unused uid per sandbox, or ``user=``): root is exempt from the process limit, so a
fork bomb run as root would not be stopped, and root could read every file. With a uid of
its own, ``RLIMIT_NPROC`` counts exactly that sandbox's processes, ``kill(-1)`` as that uid
reaps everything it left behind, however it daemonized, and host files that are not
world-readable stay unreadable even without bubblewrap.
"""

from __future__ import annotations

import errno
import itertools
import os
import posixpath
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .base import OOM_HINTS, ExecResult, Isolation, Limits, Sandbox, SandboxError, Status, oom_message, resolve_limits, signal_message

__all__ = ["LocalSandbox", "bwrap_status", "find_bwrap"]

IsolationMode = Literal["auto", "bwrap", "none"]

WORKDIR_INSIDE = "/workspace"
RUNDIR_INSIDE = "/sandbox"
INSIDE_UID = 1000
TMP_PREFIX = "tokengym-sandbox-"
MARKER_VAR = "TOKENGYM_SANDBOX"

_UID_RANGE = (1_500_000_000, 2_000_000_000)  # fresh uids for sandboxes of a root host: no passwd entry, no files
_DRAIN_GRACE_S = 0.5  # after the main process ends (or is killed): how long pipes may stay open
_READ_CHUNK = 1 << 16
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/mime.types",
)


# ------------------------------------------------------------------ helpers
def _is_root() -> bool:
    return os.geteuid() == 0


def _accessible(path: str, uid: int, gid: int, *, need: int = os.X_OK | os.R_OK) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) may reach and use ``path`` (by mode bits)."""

    def allowed(st: os.stat_result, bits: int) -> bool:
        mode = st.st_mode
        if uid == 0:
            return True
        if st.st_uid == uid:
            shift = 6
        elif st.st_gid == gid:
            shift = 3
        else:
            shift = 0
        have = (mode >> shift) & 7
        return (have & bits) == bits

    try:
        path = os.path.realpath(path)
        parts = path.split("/")
        for i in range(1, len(parts) - 1):
            d = "/".join(parts[: i + 1]) or "/"
            if not allowed(os.stat(d), 1):  # search permission on every ancestor
                return False
        return allowed(os.stat(path), need)
    except OSError:
        return False


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def find_bwrap() -> str | None:
    """The ``bwrap`` executable on ``PATH`` (or in ``/usr/bin``), or ``None``."""
    return shutil.which("bwrap") or (shutil.which("bwrap", path="/usr/bin:/bin") if os.path.exists("/usr/bin") else None)


def _bwrap_version(bwrap: str) -> str:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() or "bubblewrap"
    except (OSError, subprocess.SubprocessError):
        return "bubblewrap"


def _pick_python(uid: int, gid: int) -> str:
    """An interpreter the sandbox user can run: this one (its base install), else a system python3."""
    candidates = [
        getattr(sys, "_base_executable", None) or sys.executable,
        sys.executable,
        "/usr/bin/python3",
        "/usr/local/bin/python3",
        shutil.which("python3") or "",
    ]
    for c in candidates:
        if not c:
            continue
        real = os.path.realpath(c)
        if os.path.isfile(real) and _accessible(real, uid, gid):
            return real
    raise SandboxError(
        "no Python interpreter that the sandbox user can run (this one lies under a private directory); "
        "install python3 under /usr or pass python=..."
    )


def _python_prefix(python: str) -> str:
    """The installation directory to expose for ``python`` (``<prefix>/bin/python3.X`` -> ``<prefix>``)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(python)))


def _uids_in_use() -> set[int]:
    out: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                out.add(os.stat(f"/proc/{name}").st_uid)
            except OSError:
                pass
    return out


_UID_LOCK = threading.Lock()
_TAKEN_UIDS: set[int] = set()


def _fresh_uid() -> int:
    """A uid that no process uses and no other sandbox of this process holds."""
    with _UID_LOCK:
        busy = _uids_in_use() | _TAKEN_UIDS
        for _ in range(1000):
            uid = _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])
            if uid not in busy:
                _TAKEN_UIDS.add(uid)
                return uid
    raise SandboxError("no free uid for the sandbox")


def _release_uid(uid: int) -> None:
    with _UID_LOCK:
        _TAKEN_UIDS.discard(uid)


def _processes_of(uid: int) -> tuple[int, int]:
    """How many processes of ``uid`` are alive, and how many are zombies (dead, not yet reaped)."""
    alive = zombies = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state in (b"Z", b"X"):
                zombies += 1
            else:
                alive += 1
    return alive, zombies


def _count_processes_of(uid: int) -> int:
    return sum(_processes_of(uid))


def _kill_by_marker(marker: str) -> int:
    """SIGKILL every process whose environment holds ``MARKER_VAR=marker`` (best effort)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    killed = 0
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            try:
                os.kill(int(name), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def _kill_uid(uid: int, *, zombies_at_most: int | None = None, within_s: float = 2.0) -> None:
    """SIGKILL every process of ``uid``: ``kill(-1)`` run *as* that uid (atomic against forks).

    Killed orphans stay zombies until the host's init reaps them, and zombies still count
    against ``RLIMIT_NPROC``: with ``zombies_at_most``, wait (``within_s`` at most) until no more
    than that many are left, so that the next call is not refused processes by the dead.
    """
    deadline = time.monotonic() + within_s
    while True:
        alive, zombies = _processes_of(uid)
        if alive:
            try:
                subprocess.run(
                    ["/bin/sh", "-c", "kill -9 -1 2>/dev/null; exit 0"],
                    user=uid,
                    group=uid,
                    extra_groups=[],
                    env={"PATH": "/usr/bin:/bin"},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=5,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError):
                pass
        elif zombies_at_most is None or zombies <= zombies_at_most:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _rmtree(path: str) -> None:
    def retry(func: Any, p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        try:
            func(p)
        except OSError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)  # fd-based on Linux: never follows a symlink out


# --------------------------------------------------------------------- probe
@dataclass(frozen=True)
class BwrapStatus:
    """What a probe run of bubblewrap showed on this machine."""

    works: bool
    reason: str
    version: str = ""
    network: bool = False
    filesystem: bool = False


_PROBES: dict[tuple[str, bool], BwrapStatus] = {}
_PROBE_LOCK = threading.Lock()


def bwrap_status(bwrap: str | None = None) -> BwrapStatus:
    """Whether bubblewrap really works here (a probe run, cached per process): isolated network,
    host files hidden, ``/usr`` read-only. ``works`` is False with the reason when anything fails."""
    path = bwrap or find_bwrap()
    if path is None:
        return BwrapStatus(False, "bubblewrap (bwrap) is not installed")
    if not os.path.isfile(path):
        return BwrapStatus(False, f"no bubblewrap at {path}")
    key = (path, _is_root())
    with _PROBE_LOCK:
        if key not in _PROBES:
            _PROBES[key] = _probe(path)
        return _PROBES[key]


def _probe(bwrap: str) -> BwrapStatus:
    version = _bwrap_version(bwrap)
    try:
        sb = LocalSandbox(Limits(timeout_s=20), isolation="none", _bwrap_for_probe=bwrap)
    except SandboxError as err:
        return BwrapStatus(False, f"probe could not start: {err}", version)
    try:
        secret = os.path.join(sb.root, "run", "probe-secret")
        with open(secret, "w") as f:
            f.write("x")
        script = (
            f"cat /proc/net/dev; "
            f"if [ -e {secret} ]; then echo HOST-VISIBLE; fi; "
            f"if touch /usr/.tokengym-probe 2>/dev/null; then echo USR-WRITABLE; fi; "
            f"echo ok > probe.txt && echo PROBE-OK"
        )
        res = sb._exec_bwrap_probe(["/bin/sh", "-c", script])
    finally:
        sb.close()
    if res.status != "ok" or "PROBE-OK" not in res.stdout:
        why = (res.stderr or res.message or res.stdout).strip().splitlines()
        return BwrapStatus(False, f"bubblewrap is installed but does not run here: {why[-1] if why else res.status}", version)
    ifaces = [line.split(":")[0].strip() for line in res.stdout.splitlines() if ":" in line and "|" not in line]
    network = ifaces == ["lo"] or ifaces == []
    filesystem = "HOST-VISIBLE" not in res.stdout and "USR-WRITABLE" not in res.stdout
    if not (network and filesystem):
        return BwrapStatus(False, f"bubblewrap ran but did not isolate (interfaces {ifaces}, output {res.stdout[-200:]!r})", version)
    return BwrapStatus(True, "ok", version, network, filesystem)


# ------------------------------------------------------------------- sandbox
_COUNTER = itertools.count()


class _Call:
    """One running command: its process, and whether it was killed for the time limit."""

    def __init__(self, proc: subprocess.Popen[bytes], marker: str) -> None:
        self.proc = proc
        self.marker = marker
        self.killed = False


def _cleanup(root: str, uid: int | None, calls: set[_Call]) -> None:
    """Finalizer: kill what still runs and delete the directory (also at interpreter exit)."""
    for c in list(calls):
        _killpg(c.proc)
    if uid is not None:
        _kill_uid(uid)
        _release_uid(uid)
    _rmtree(root)


def _killpg(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass


class LocalSandbox(Sandbox):
    """A sandbox of child processes on this machine, in a temporary workspace with resource limits.

    Args:
        limits: resource limits (:class:`Limits`); keyword overrides of its fields
            (``timeout_s=5``, ``memory_mb=256``...) may be given directly instead or on top.
        isolation: ``"auto"`` uses bubblewrap when a probe run shows it works here, else plain
            limits; ``"bwrap"`` requires it (:class:`SandboxError` with the reason when it does not
            work); ``"none"`` never uses it (limits only: no network or file-system isolation).
        python: the interpreter for :meth:`run_python` (and ``python``/``python3`` in shell
            commands). Default: this process's base interpreter when the sandbox user can run it,
            else a system ``python3``.
        user: the uid to run as when the host runs as root: ``"auto"`` (a fresh unused uid for
            each sandbox: the process limit and the clean-up then cover exactly this sandbox) or
            a number. Ignored when the host is not root (the sandbox runs as the host's user).
        ro_binds: extra host paths shown read-only inside bubblewrap (e.g. a virtualenv).
        env: extra environment variables for every command.
        tmp_root: where the sandbox's directory is made (default: the system temp directory).

    :attr:`workdir` is the workspace as the commands see it (``/workspace`` under bubblewrap,
    the host path without). Paths given to :meth:`write_file` and :meth:`read_file` are relative
    to it (or absolute under it).
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        isolation: IsolationMode = "auto",
        python: str | None = None,
        user: int | Literal["auto"] = "auto",
        ro_binds: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        tmp_root: str | None = None,
        bwrap: str | None = None,
        _bwrap_for_probe: str | None = None,
        **limit_overrides: Any,
    ) -> None:
        if isolation not in ("auto", "bwrap", "none"):
            raise ValueError(f'isolation must be "auto", "bwrap" or "none", got {isolation!r}')
        self.limits = resolve_limits(limits, limit_overrides, "LocalSandbox")
        self._closed = True  # until fully built
        self._lock = threading.Lock()
        self._calls: set[_Call] = set()
        self._serial = itertools.count()

        # who runs the commands
        self._root_host = _is_root()
        self._own_uid: int | None = None  # a fresh uid this sandbox owns (released at close)
        if self._root_host:
            if user == "auto":
                self._own_uid = _fresh_uid()
                self.uid = self.gid = self._own_uid
            elif isinstance(user, int) and user > 0:
                self.uid = self.gid = int(user)
            else:
                raise ValueError('user must be "auto" or a positive uid (a sandbox never runs as root)')
        else:
            self.uid, self.gid = os.getuid(), os.getgid()

        # which isolation
        if _bwrap_for_probe is not None:  # the probe itself: build for bwrap, trust nothing
            self._bwrap: str | None = _bwrap_for_probe
            self._bwrap_status = BwrapStatus(False, "probe")
        elif isolation == "none":
            self._bwrap = None
            self._bwrap_status = BwrapStatus(False, 'isolation="none" was asked for')
        else:
            status = bwrap_status(bwrap)
            if not status.works:
                if isolation == "bwrap":
                    self._release_own_uid()
                    raise SandboxError(f'isolation="bwrap": {status.reason}')
                self._bwrap = None
            else:
                self._bwrap = bwrap or find_bwrap()
            self._bwrap_status = status
        self._use_bwrap = self._bwrap is not None and _bwrap_for_probe is None

        try:
            self.python = os.path.realpath(python) if python else _pick_python(self.uid, self.gid)
        except SandboxError:
            self._release_own_uid()
            raise
        # prlimit (util-linux) sets the limits; it must lie where bubblewrap shows it (/usr).
        # Without it, the sandbox's python sets them and execs the command.
        self._prlimit = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
        self._ro_binds = tuple(os.path.realpath(p) for p in ro_binds)
        self._extra_env = dict(env or {})

        # the directory
        self.root = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=tmp_root)
        self._finalizer = weakref.finalize(self, _cleanup, self.root, self._own_uid, self._calls)
        try:
            self._layout()
        except BaseException:
            self._finalizer()
            raise
        self._closed = False
        self.workdir = WORKDIR_INSIDE if (self._use_bwrap or _bwrap_for_probe) else self._work
        self._tmp_inside = "/tmp" if (self._use_bwrap or _bwrap_for_probe) else self._tmp
        self._run_inside = RUNDIR_INSIDE if (self._use_bwrap or _bwrap_for_probe) else self._run
        self.isolation = self._describe()

    # ----------------------------------------------------------- layout
    @property
    def _work(self) -> str:
        return os.path.join(self.root, "work")

    @property
    def _tmp(self) -> str:
        return os.path.join(self.root, "tmp")

    @property
    def _run(self) -> str:
        return os.path.join(self.root, "run")

    def _chown(self, path: str) -> None:
        if self._root_host:
            os.chown(path, self.uid, self.gid, follow_symlinks=False)

    def _layout(self) -> None:
        os.chmod(self.root, 0o711 if self._root_host else 0o700)
        for d in (self._work, self._tmp):
            os.mkdir(d, 0o700)
            self._chown(d)
        os.mkdir(self._run, 0o755)
        bindir = os.path.join(self._run, "bin")
        os.mkdir(bindir, 0o755)
        for name in ("python", "python3"):
            os.symlink(self.python, os.path.join(bindir, name))
        etc = os.path.join(self._run, "etc")
        os.mkdir(etc, 0o755)
        with open(os.path.join(etc, "passwd"), "w") as f:
            f.write(f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{INSIDE_UID}:{INSIDE_UID}:sandbox:{WORKDIR_INSIDE}:/bin/sh\n")
        with open(os.path.join(etc, "group"), "w") as f:
            f.write(f"root:x:0:\nsandbox:x:{INSIDE_UID}:\n")
        os.mkdir(os.path.join(self._run, "snippets"), 0o755)

    def _release_own_uid(self) -> None:
        if self._own_uid is not None:
            _release_uid(self._own_uid)

    def _describe(self) -> Isolation:
        limits = self.limits
        lim = (
            f"limits: {limits.cpu_s} CPU s, {limits.memory_mb} MB address space, {limits.max_processes} processes, "
            f"{limits.max_file_mb} MB files, {limits.max_open_files} open files, {limits.timeout_s:g} s wall"
        )
        if self._root_host:
            who = f"runs as uid {self.uid} (not root; a uid of its own)" if self._own_uid else f"runs as uid {self.uid} (not root)"
        else:
            who = f"runs as the host user (uid {self.uid})"
        if self._use_bwrap:
            details = (
                self._bwrap_status.version or "bubblewrap",
                who,
                "new user/pid/net/ipc/uts namespaces: only loopback, no route out",
                f"files: /usr and the interpreter read-only, private /tmp, workspace {WORKDIR_INSIDE} read-write; "
                "the rest of the host is not there",
                "every process of a call dies with it (pid namespace, --die-with-parent)",
                lim,
            )
            return Isolation("local", network=True, filesystem=True, limits=True, details=details)
        why = self._bwrap_status.reason
        nproc = (
            "max_processes counts this sandbox's uid only"
            if self._own_uid
            else ("max_processes counts every process of that uid" if self._root_host else
                  "max_processes is added to the host user's current process count")
        )
        leftovers = (
            "leftover processes: all killed after each call (kill -1 as the sandbox's own uid)"
            if self._own_uid
            else "leftover processes: the process group is killed, and processes still carrying the "
            f"sandbox's {MARKER_VAR} variable; one that leaves the group and clears its environment can survive"
        )
        files = (
            "host files NOT isolated: whatever is world-readable can be read, world-writable written"
            if self._root_host
            else "host files NOT isolated: the host user's files can be read and written"
        )
        details = (f"no bubblewrap ({why}): plain rlimits only", who, "network NOT isolated", files, nproc, leftovers, lim)
        return Isolation("local", network=False, filesystem=False, limits=True, details=details)

    # ------------------------------------------------------------ argv
    def _limit_args(self) -> list[str]:
        L = self.limits
        nproc = L.max_processes
        if not self._use_bwrap and not self._own_uid and not self._root_host:
            nproc += _count_processes_of(self.uid)  # RLIMIT_NPROC counts all of the user's processes
        mem = L.memory_mb * 1024 * 1024
        fsize = L.max_file_mb * 1024 * 1024
        return [
            f"--cpu={L.cpu_s}:{L.cpu_s + 1}",
            f"--as={mem}:{mem}",
            f"--nproc={nproc}:{nproc}",
            f"--fsize={fsize}:{fsize}",
            f"--nofile={L.max_open_files}:{L.max_open_files}",
            "--core=0:0",
        ]

    def _limited(self, argv: list[str]) -> list[str]:
        if self._prlimit:
            return [self._prlimit, *self._limit_args(), "--", *argv]
        # no prlimit: the sandbox's python sets the limits and execs the command
        L = self.limits
        spec = {
            "CPU": (L.cpu_s, L.cpu_s + 1),
            "AS": (L.memory_mb << 20,) * 2,
            "NPROC": (L.max_processes,) * 2,
            "FSIZE": (L.max_file_mb << 20,) * 2,
            "NOFILE": (L.max_open_files,) * 2,
            "CORE": (0, 0),
        }
        boot = (
            "import os,resource,sys\n"
            f"for k,v in {spec!r}.items(): resource.setrlimit(getattr(resource,'RLIMIT_'+k),v)\n"
            "os.execvp(sys.argv[1],sys.argv[1:])"
        )
        return [self.python, "-S", "-c", boot, *argv]

    def _bwrap_argv(self) -> list[str]:
        assert self._bwrap is not None
        a = [
            self._bwrap,
            "--die-with-parent",
            "--new-session",
            "--unshare-all",
            "--unshare-user",
            "--uid", str(INSIDE_UID),
            "--gid", str(INSIDE_UID),
            "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        for p in _SYSTEM_LINKS:
            if os.path.islink(p):
                a += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                a += ["--ro-bind", p, p]
        for p in _ETC_FILES:
            if os.path.exists(p):
                a += ["--ro-bind", p, p]
        a += ["--ro-bind", os.path.join(self._run, "etc", "passwd"), "/etc/passwd"]
        a += ["--ro-bind", os.path.join(self._run, "etc", "group"), "/etc/group"]
        shown = ["/usr"]
        prefix = _python_prefix(self.python)
        if not any(_under(prefix, s) for s in shown):
            a += ["--ro-bind", prefix, prefix]
            shown.append(prefix)
        for p in self._ro_binds:
            if os.path.exists(p) and not any(_under(p, s) for s in shown):
                a += ["--ro-bind", p, p]
        a += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--size", str(self.limits.max_file_mb << 20), "--tmpfs", "/dev/shm",
            "--bind", self._work, WORKDIR_INSIDE,
            "--bind", self._tmp, "/tmp",
            "--ro-bind", self._run, RUNDIR_INSIDE,
            "--remount-ro", "/dev",
            "--remount-ro", "/",  # bwrap's own root (a tmpfs in memory): nothing may be written there
            "--chdir", WORKDIR_INSIDE,
            "--",
        ]  # fmt: skip
        return a

    def _env(self, marker: str) -> dict[str, str]:
        bindir = posixpath.join(self._run_inside, "bin")
        pydir = os.path.dirname(self.python)
        path = ":".join(dict.fromkeys([bindir, pydir, "/usr/local/bin", "/usr/bin", "/bin"]))
        env = {
            "PATH": path,
            "HOME": self.workdir,
            "TMPDIR": self._tmp_inside,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "TERM": "dumb",
            "USER": "sandbox",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONPATH": self.workdir,
            MARKER_VAR: marker,
        }
        env.update(self._extra_env)
        return env

    # ------------------------------------------------------------- run
    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed sandbox refuses every call."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    def run(self, command: str | list[str], *, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        self._check_open()
        if isinstance(command, str):
            argv = ["/bin/sh", "-c", command]
        elif isinstance(command, (list, tuple)) and command and all(isinstance(c, str) for c in command):
            argv = list(command)
        else:
            raise SandboxError("command must be a string or a non-empty list of strings")
        return self._exec(argv, timeout_s=timeout_s, stdin=stdin)

    def run_python(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        self._check_open()
        if not isinstance(code, str):
            raise SandboxError("code must be a string")
        name = f"snippet_{next(self._serial)}.py"
        host = os.path.join(self._run, "snippets", name)
        with open(host, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        try:
            return self._exec([self.python, posixpath.join(self._run_inside, "snippets", name)], timeout_s=timeout_s)
        finally:
            try:
                os.unlink(host)
            except OSError:
                pass

    def _exec_bwrap_probe(self, argv: list[str]) -> ExecResult:
        self._use_bwrap = True
        try:
            return self._exec(argv, timeout_s=20)
        finally:
            self._use_bwrap = False

    def _exec(self, argv: list[str], *, timeout_s: float | None, stdin: str | None = None) -> ExecResult:
        timeout = float(self.limits.timeout_s if timeout_s is None else timeout_s)
        if not timeout > 0:
            raise SandboxError(f"timeout_s must be positive, got {timeout_s!r}")
        marker = f"{os.getpid()}-{id(self):x}-{next(_COUNTER)}"
        full = self._limited(argv)
        if self._use_bwrap:
            full = self._bwrap_argv() + full
        kwargs: dict[str, Any] = {}
        if self._root_host:
            kwargs.update(user=self.uid, group=self.gid, extra_groups=[])
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                full,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env(marker),
                cwd=self._work if not self._use_bwrap else self.root,
                start_new_session=True,
                close_fds=True,
                **kwargs,
            )
        except OSError as err:
            return ExecResult(
                "crashed", None, "", "", time.monotonic() - start, message=f"the sandbox could not start the command: {err}"
            )
        call = _Call(proc, marker)
        with self._lock:
            self._calls.add(call)
        try:
            out, err_, dropped, timed_out = self._communicate(call, stdin, start + timeout)
        finally:
            self._finish(call)
        duration = time.monotonic() - start
        return self._result(proc.returncode, out, err_, dropped, timed_out, duration, timeout)

    def _communicate(
        self, call: _Call, stdin: str | None, deadline: float
    ) -> tuple[bytes, bytes, tuple[int, int], bool]:
        proc = call.proc
        cap = self.limits.max_output_bytes
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
        drop = dict.fromkeys(bufs, 0)
        sel = selectors.DefaultSelector()
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        pending = b""
        stdin_fd = None
        if proc.stdin is not None:
            pending = (stdin or "").encode("utf-8", "surrogateescape")
            stdin_fd = proc.stdin.fileno()
            if pending:
                os.set_blocking(stdin_fd, False)
                sel.register(stdin_fd, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
                stdin_fd = None
        pidfd = None
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            pidfd = None
        exited = False
        timed_out = False
        drain_until: float | None = None
        try:
            while True:
                open_pipes = sum(1 for fd in bufs if fd in sel.get_map())
                if not open_pipes and (exited or pidfd is None):
                    break
                now = time.monotonic()
                if not exited and not timed_out and now >= deadline:
                    timed_out = True
                    call.killed = True
                    self._kill_call(call)
                    drain_until = time.monotonic() + _DRAIN_GRACE_S
                if drain_until is not None and now >= drain_until:
                    break
                limit = (drain_until if drain_until is not None else deadline) - now
                if pidfd is None and not exited:
                    limit = min(limit, 0.01)
                for key, _ in sel.select(timeout=max(0.0, limit)):
                    fd = key.fd
                    if fd == pidfd:
                        sel.unregister(pidfd)
                        exited = True
                        self._after_exit(call)
                        drain_until = time.monotonic() + _DRAIN_GRACE_S
                    elif fd == stdin_fd:
                        try:
                            n = os.write(fd, pending[:_READ_CHUNK])
                            pending = pending[n:]
                        except (BrokenPipeError, OSError):
                            pending = b""
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()  # type: ignore[union-attr]
                            stdin_fd = None
                    else:
                        try:
                            chunk = os.read(fd, _READ_CHUNK)
                        except BlockingIOError:
                            continue
                        except OSError:
                            chunk = b""
                        if not chunk:
                            sel.unregister(fd)
                            continue
                        buf = bufs[fd]
                        room = cap - len(buf)
                        if room > 0:
                            buf += chunk[:room]
                        drop[fd] += max(0, len(chunk) - max(room, 0))
                if pidfd is None and not exited and proc.poll() is not None:
                    exited = True
                    drain_until = time.monotonic() + _DRAIN_GRACE_S
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            if not exited or timed_out:
                self._kill_call(call)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _killpg(proc)
                proc.wait()
            for f in (proc.stdout, proc.stderr, proc.stdin):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        fds = list(bufs)
        return bytes(bufs[fds[0]]), bytes(bufs[fds[1]]), (drop[fds[0]], drop[fds[1]]), timed_out

    def _kill_call(self, call: _Call) -> None:
        """Kill one call's processes: its process group (and, without bwrap, its leftovers)."""
        _killpg(call.proc)
        if not self._use_bwrap and not self._own_uid:
            _kill_by_marker(call.marker)

    def _after_exit(self, call: _Call) -> None:
        """The main process has exited (not yet reaped): kill what it left in the background,
        so that nothing keeps the output pipes open."""
        _killpg(call.proc)  # under bwrap: the outer bwrap; the pid namespace takes the rest with it
        if self._use_bwrap:
            return
        if self._own_uid is None:
            _kill_by_marker(call.marker)
            return
        with self._lock:
            alone = self._calls == {call}
        if alone:  # (with other calls running, the last one to finish sweeps)
            _kill_uid(self._own_uid)

    def _finish(self, call: _Call) -> None:
        with self._lock:
            self._calls.discard(call)
            last = not self._calls
        if last and self._own_uid is not None and not self._use_bwrap:
            # nothing of this sandbox may outlive its last running call (nor, as zombies, hold
            # its process limit against the next call)
            _kill_uid(self._own_uid, zombies_at_most=self.limits.max_processes // 4)

    def _result(
        self, rc: int | None, out: bytes, err: bytes, dropped: tuple[int, int], timed_out: bool, duration: float, timeout: float
    ) -> ExecResult:
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        status: Status
        sig: int | None = None
        if rc is not None and rc < 0:
            sig = -rc
        elif rc is not None and 128 < rc <= 128 + 64 and (rc - 128) in _SIGNAL_NUMBERS:
            sig = rc - 128  # bubblewrap and shells report a child killed by signal N as 128 + N
        if timed_out:
            status, code = "timeout", None
            message = f"timed out after {timeout:g} s; the process and its children were killed"
        elif self._use_bwrap and rc == 1 and stderr.startswith("bwrap:"):
            status, code = "crashed", rc
            message = f"the sandbox failed to start: {stderr.strip().splitlines()[0]}"
        elif rc == 0:
            status, code, message = "ok", 0, ""
        elif any(h in stderr[-2048:] for h in OOM_HINTS) and sig in (None, signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV):
            status, code = "oom", rc
            message = oom_message(self.limits)
        elif sig is not None:
            status, code = "killed", rc
            message = signal_message(sig, self.limits)
        else:
            status, code = "error", rc
            message = f"exited with code {rc}"
        return ExecResult(
            status, code, stdout, stderr, duration, stdout_dropped=dropped[0], stderr_dropped=dropped[1], message=message
        )

    # ----------------------------------------------------------- files
    def _parts(self, path: str) -> list[str]:
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError(f"bad path {path!r}")
        p = path
        for prefix in {self.workdir, WORKDIR_INSIDE}:
            if p == prefix:
                p = "."
            elif p.startswith(prefix.rstrip("/") + "/"):
                p = p[len(prefix.rstrip("/")) + 1 :]
        if p.startswith("/"):
            raise SandboxError(f"path {path!r} is outside the workspace; use a path relative to it")
        norm = posixpath.normpath(p)
        if norm == ".." or norm.startswith("../"):
            raise SandboxError(f"path {path!r} is outside the workspace")
        if norm == ".":
            raise SandboxError(f"path {path!r} names the workspace itself, not a file")
        return norm.split("/")

    def _open_dir(self, parts: Sequence[str], *, create: bool) -> int:
        """An fd of the directory ``parts`` under the workspace, never following a symlink."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self._work, flags)
        try:
            for name in parts:
                try:
                    nxt = os.open(name, flags, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(name, 0o755, dir_fd=fd)
                    nxt = os.open(name, flags, dir_fd=fd)
                    if self._root_host:
                        os.fchown(nxt, self.uid, self.gid)
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise SandboxError(f"{name!r} is a symlink or not a directory; it is not followed") from None
                    raise
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def write_file(self, path: str, content: str | bytes) -> None:
        self._check_open()
        data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        parts = self._parts(path)
        try:
            dfd = self._open_dir(parts[:-1], create=True)
        except SandboxError:
            raise
        except OSError as err:
            raise SandboxError(f"cannot write {path!r}: {err.strerror}") from None
        try:
            name = parts[-1]
            try:  # never write through what the sandbox left there (a symlink, a hard link, a fifo)
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    raise SandboxError(f"{path!r} is a directory")
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            try:
                fd = os.open(
                    name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
                )
            except OSError as err:
                raise SandboxError(f"cannot write {path!r}: {err.strerror}") from None
            try:
                if self._root_host:
                    os.fchown(fd, self.uid, self.gid)
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        self._check_open()
        parts = self._parts(path)
        try:
            dfd = self._open_dir(parts[:-1], create=False)
        except FileNotFoundError:
            raise SandboxError(f"no file {path!r} in the workspace") from None
        except OSError as err:
            raise SandboxError(f"cannot read {path!r}: {err.strerror}") from None
        try:
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                raise SandboxError(f"no file {path!r} in the workspace") from None
            except OSError as err:
                if err.errno == errno.ELOOP:
                    raise SandboxError(f"{path!r} is a symlink; it is not followed") from None
                raise SandboxError(f"cannot read {path!r}: {err.strerror}") from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise SandboxError(f"{path!r} is not a regular file")
                if self._root_host and st.st_uid not in (self.uid, os.getuid()):
                    raise SandboxError(f"{path!r} belongs to another user (uid {st.st_uid}); it is not read")
                limit = st.st_size if max_bytes is None else min(max_bytes, st.st_size)
                chunks = []
                left = limit
                while left > 0:
                    chunk = os.read(fd, min(left, 1 << 20))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left -= len(chunk)
                return b"".join(chunks)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    # ------------------------------------------------------- lifecycle
    def _kill_all(self) -> None:
        with self._lock:
            calls = list(self._calls)
        for c in calls:
            c.killed = True
            self._kill_call(c)
        if self._own_uid is not None:
            _kill_uid(self._own_uid)

    def reset(self) -> None:
        self._check_open()
        self._kill_all()
        for d in (self._work, self._tmp):
            _rmtree(d)
            os.mkdir(d, 0o700)
            self._chown(d)
        snippets = os.path.join(self._run, "snippets")
        for name in os.listdir(snippets):
            try:
                os.unlink(os.path.join(snippets, name))
            except OSError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kill_all()
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.root
        return f"<LocalSandbox {state}: {self.isolation.describe()}>"


_SIGNAL_NUMBERS = {int(s) for s in signal.Signals}


