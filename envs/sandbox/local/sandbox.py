"""The :class:`LocalSandbox` itself: its directory, who runs it, which isolation, its lifetime.

See the package docstring for what it enforces.
"""

from __future__ import annotations

import itertools
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..base import ExecResult, Isolation, Launch, Limits, Sandbox, SandboxError, resolve_limits
from .bwrap import BwrapStatus, bwrap_argv, bwrap_version, find_bwrap
from .cgroups import Cgroup, cgroup_support
from .execute import Call, Runner
from .files import WorkspaceFiles
from .leftovers import empty_dir, remove_uid_leftovers
from .quota import MountError, mount_tmpfs, unmount, usage
from .paths import INSIDE_UID, RUNDIR_INSIDE, TMP_PREFIX, WORKDIR_INSIDE, accessible, pick_python
from .reclaim import claim, note_cgroups, reclaim_once
from .resources import cleanup, Resources
from .uids import MARKER_VAR, count_processes_of, fresh_uid, is_root, kill_uid, release_uid

IsolationMode = Literal["auto", "bwrap", "none"]


_COUNTER = itertools.count()


NO_ISOLATION_HELP = (
    "no isolation for the local sandbox: this process runs as uid {uid} (not root) and bubblewrap does not "
    "work here ({reason}), so sandboxed code would run as you, read your files and environment and signal "
    "your processes (the trainer's too). Install bubblewrap (apt-get install bubblewrap; unprivileged user "
    'namespaces must be allowed), or use the Docker backend (make_sandbox("docker")); isolation="none" '
    "runs it as you anyway, with a warning"
)


class LocalSandbox(Runner, WorkspaceFiles, Sandbox):
    """A sandbox of child processes on this machine, in a temporary workspace with resource limits.

    Args:
        limits: resource limits (:class:`Limits`); keyword overrides of its fields
            (``timeout_s=5``, ``memory_mb=256``...) may be given directly instead or on top.
        isolation: ``"auto"`` uses bubblewrap when a probe run shows it works here, else (as root)
            plain limits under a uid of its own; on a host that is not root, ``"auto"`` without a
            working bubblewrap refuses (:class:`SandboxError` saying how to get isolation), since
            the code would run as the host user. ``"bwrap"`` requires it (:class:`SandboxError`
            with the reason when it does not work); ``"none"`` never uses it (limits only: no
            network or file-system isolation; as a non-root user, with a ``RuntimeWarning``).
        python: the interpreter for :meth:`run_python` (and ``python``/``python3`` in shell
            commands). Default: this process's base interpreter when the sandbox user can run it,
            else a system ``python3``.
        user: the uid to run as when the host runs as root: ``"auto"`` (a fresh unused uid for
            each sandbox: the process limit and the clean-up then cover exactly this sandbox) or
            a number. Ignored when the host is not root (the sandbox runs as the host's user).
        ro_binds: extra host paths shown read-only inside bubblewrap (e.g. a virtualenv).
        env: extra environment variables for every command.
        tmp_root: where the sandbox's directory is made (default: the system temp directory).
        tmp_mb: the size of the sandbox's own ``/tmp`` (the workspace's is ``disk_mb`` of the limits).

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
        tmp_mb: int = 64,
        bwrap: str | None = None,
        _bwrap_for_probe: str | None = None,
        _per_process_only: bool = False,
        **limit_overrides: Any,
    ) -> None:
        if isolation not in ("auto", "bwrap", "none"):
            raise ValueError(f'isolation must be "auto", "bwrap" or "none", got {isolation!r}')
        self.limits = resolve_limits(limits, limit_overrides, "LocalSandbox")
        self._closed = True  # until fully built
        self._lock = threading.Lock()
        self._calls: set[Call] = set()
        self._starting = 0
        """Calls between their start and their entry in ``_calls`` (their process may already run)."""
        self._serial = itertools.count()

        # who runs the commands
        self._root_host = is_root()
        self._own_uid: int | None = None  # a fresh uid this sandbox owns (released at close)
        if self._root_host:
            if user == "auto":
                self._own_uid = fresh_uid()
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
        probe = _bwrap_for_probe is not None
        if not self._root_host and not self._use_bwrap and not probe:
            help_text = NO_ISOLATION_HELP.format(uid=self.uid, reason=self._bwrap_status.reason)
            if isolation != "none":
                raise SandboxError(help_text)
            warnings.warn(
                f'LocalSandbox(isolation="none") as uid {self.uid}: commands run as you, with your files, environment '
                "and processes within reach; install bubblewrap or use the Docker backend for isolation",
                RuntimeWarning,
                stacklevel=2,
            )

        try:
            self.python = os.path.realpath(python) if python else pick_python(self.uid, self.gid)
        except SandboxError:
            self._release_own_uid()
            raise
        # prlimit (util-linux) sets the limits; it must lie where bubblewrap shows it (/usr).
        # Without it, the sandbox's python sets them and execs the command.
        self._prlimit = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
        self._ro_binds = tuple(os.path.realpath(p) for p in ro_binds)
        self._extra_env = dict(env or {})

        self._tmp_mb = tmp_mb
        self._cgroup: Cgroup | None = None
        self._cgroup_note = "not tried"
        self._quota = "none"  # "tmpfs", "watchdog" or "none" (the probe)
        self._quota_note = ""

        # the directory, and its owner record (what a killed run left is reclaimed here first)
        where = tmp_root or tempfile.gettempdir()
        if self._root_host and not accessible(where, self.uid, self.gid, need=os.X_OK):
            self._release_own_uid()
            raise SandboxError(
                f"tmp_root {where}: the sandbox's uid {self.uid} cannot pass through it or a folder above it (a 0700 "
                "folder, such as pytest's tmp_path); make it reachable (chmod o+x) or pass another tmp_root"
            )
        reclaim_once(tmp_root)
        try:
            self.root = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=tmp_root)
        except OSError as err:
            self._release_own_uid()
            raise SandboxError(
                f"cannot create the sandbox's directory in {where}: {err.strerror}; free space there or pass tmp_root=..."
            ) from None
        self._token = os.path.basename(self.root)
        self._res = Resources(self.root, self._own_uid, self._calls)
        probe = probe or _per_process_only  # (benchmarks/sandbox.py measures the cost of what follows)
        if self._own_uid is not None and not self._use_bwrap and not probe:
            self._res.sweep_uid = self._own_uid
        self._finalizer = weakref.finalize(self, cleanup, self._res)
        try:
            self._res.owner_fd = claim(self.root, uid=self._own_uid, sweep=self._res.sweep_uid is not None)
            self._layout(probe)
            if not probe:
                self._setup_cgroup()
        except OSError as err:
            self._finalizer()
            raise SandboxError(f"cannot set the sandbox up in {self.root}: {err}") from None
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

    def _layout(self, probe: bool) -> None:
        os.chmod(self.root, 0o711 if self._root_host else 0o700)
        for d in (self._work, self._tmp):
            os.mkdir(d, 0o700)
            self._chown(d)
        if not probe:
            self._mount_quota()
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
        os.mkdir(os.path.join(self._run, "snippets"), 0o711)  # each snippet: 0600, the sandbox uid's

    def _mount_quota(self) -> None:
        """A sized tmpfs on the workspace and on /tmp where this process may mount, else the watchdog."""
        L = self.limits
        if not self._root_host:
            self._quota, self._quota_note = "watchdog", "not root: no tmpfs of its own"
            return
        try:
            for d, size in ((self._work, L.disk_mb), (self._tmp, self._tmp_mb)):
                mount_tmpfs(d, size_mb=size, inodes=L.max_files, uid=self.uid, gid=self.gid)
                self._res.mounts.append(d)
            self._quota = "tmpfs"
        except MountError as err:
            for d in list(self._res.mounts):
                unmount(d)
                self._res.mounts.remove(d)
            self._quota, self._quota_note = "watchdog", str(err)

    def _setup_cgroup(self) -> None:
        support = cgroup_support()
        self._cgroup_note = support.reason
        if not support.kind:
            return
        try:
            self._cgroup = self._res.cgroup = Cgroup(
                support,
                memory_mb=self.limits.memory_mb,
                max_processes=self.limits.max_processes,
                uid=self.uid,
                gid=self.gid,
                before_mkdir=lambda dirs: note_cgroups(self.root, dirs),
            )
        except OSError as err:
            self._cgroup_note = f"cannot create the sandbox's cgroup: {err}"

    def _watched(self) -> tuple[list[str], int, int] | None:
        """What the quota watchdog measures (paths, bytes, files), or None where a tmpfs holds it."""
        if self._quota != "watchdog":
            return None
        return [self._work, self._tmp], self.limits.disk_mb << 20, self.limits.max_files

    def _release_own_uid(self) -> None:
        if self._own_uid is not None:
            release_uid(self._own_uid)

    def _describe(self) -> Isolation:
        L = self.limits
        group = self._cgroup is not None
        lim = (
            f"limits: {L.cpu_s} CPU s per process, {L.memory_mb} MB memory "
            f"({'for the whole sandbox' if group else 'address space per process'}), {L.max_processes} processes "
            f"({'for the whole sandbox' if group else 'per uid'}), {L.max_file_mb} MB files, "
            f"{L.max_open_files} open files, {L.timeout_s:g} s wall"
        )
        grouping = (
            self._cgroup.describe()
            if self._cgroup is not None
            else f"memory and max_processes hold per process only, not for the sandbox as a whole ({self._cgroup_note})"
        )
        if self._quota == "none":
            quota = "disk quota: NONE (only each file's size is capped)"
        elif self._quota == "tmpfs":
            quota = (
                f"disk quota: the workspace {L.disk_mb} MB and /tmp {self._tmp_mb} MB, {L.max_files} files each "
                "(a tmpfs each: their pages are memory)"
            )
        else:
            quota = (
                f"disk quota: {L.disk_mb} MB and {L.max_files} files over the workspace and /tmp together, held by a "
                f"watchdog that stops a call past it ({self._quota_note})"
            )
        if self._root_host:
            who = f"runs as uid {self.uid} (not root; a uid of its own)" if self._own_uid else f"runs as uid {self.uid} (not root)"
        else:
            who = f"runs as the host user (uid {self.uid})"
        common = dict(limits=True, group_limits=group, disk_quota=self._quota != "none")
        if self._use_bwrap:
            details = (
                self._bwrap_status.version or "bubblewrap",
                who,
                "new user/pid/net/ipc/uts namespaces: only loopback, no route out",
                f"files: /usr and the interpreter read-only, private /tmp, workspace {WORKDIR_INSIDE} read-write; "
                "the rest of the host is not there",
                "every process of a call dies with it (pid namespace, --die-with-parent)",
                grouping,
                quota,
                lim,
            )
            return Isolation("local", network=True, filesystem=True, details=details, **common)
        why = self._bwrap_status.reason
        nproc = (
            "max_processes counts this sandbox's uid only"
            if self._own_uid
            else ("max_processes counts every process of that uid" if self._root_host else
                  "max_processes is added to the host user's current process count")
        )
        leftovers = (
            "leftover processes: all killed after each call (kill -1 as the sandbox's own uid); at close its files in "
            "/tmp, /var/tmp, /dev/shm and its System V IPC objects are removed too"
            if self._own_uid
            else "leftover processes: the process group is killed, and processes still carrying the "
            f"sandbox's {MARKER_VAR} variable; one that leaves the group and clears its environment can survive; "
            "files it leaves in /tmp, /var/tmp or /dev/shm are NOT removed (the uid is not its own)"
        )
        files = (
            "host files NOT isolated: whatever is world-readable can be read, world-writable written"
            if self._root_host
            else "host files NOT isolated: the host user's files, environment and processes are within reach "
            "(it can read them, write them, signal them)"
        )
        details = (f"no bubblewrap ({why}): plain rlimits only", who, "network NOT isolated", files, nproc, leftovers, grouping, quota, lim)
        return Isolation("local", network=False, filesystem=False, details=details, **common)

    # ------------------------------------------------------------ argv
    def _limit_args(self) -> list[str]:
        L = self.limits
        nproc = L.max_processes
        if not self._use_bwrap and not self._own_uid and not self._root_host:
            nproc += count_processes_of(self.uid)  # RLIMIT_NPROC counts all of the user's processes
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
        return bwrap_argv(
            self._bwrap,
            run_dir=self._run,
            work_dir=self._work,
            tmp_dir=self._tmp,
            python=self.python,
            ro_binds=self._ro_binds,
            limits=self.limits,
        )

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
        """Run ``command``: a string goes to ``/bin/sh`` as a script file (0600, the sandbox uid's),
        never in argv, where other processes on the host could read it in ``/proc/*/cmdline``."""
        self._check_open()
        if isinstance(command, str):
            return self._run_stashed(command, "sh", ["/bin/sh"], timeout_s=timeout_s, stdin=stdin)
        if isinstance(command, (list, tuple)) and command and all(isinstance(c, str) for c in command):
            return self._exec(list(command), timeout_s=timeout_s, stdin=stdin)
        raise SandboxError("command must be a string or a non-empty list of strings")

    def run_python(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        self._check_open()
        if not isinstance(code, str):
            raise SandboxError("code must be a string")
        return self._run_stashed(code, "py", [self.python], timeout_s=timeout_s)

    def _run_stashed(
        self, text: str, ext: str, interpreter: list[str], *, timeout_s: float | None, stdin: str | None = None
    ) -> ExecResult:
        """Run ``text`` as a file given to ``interpreter``; the file is removed afterwards."""
        name = f"snippet_{next(self._serial)}.{ext}"
        host = os.path.join(self._run, "snippets", name)
        try:  # 0600 and the sandbox uid's: no other sandbox on the host may read it
            fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if self._root_host:
                    os.fchown(fd, self.uid, self.gid)
                view = memoryview(text.encode("utf-8", "surrogatepass"))
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError as err:
            try:
                os.unlink(host)
            except OSError:
                pass
            return ExecResult(
                "crashed", None, "", "", 0.0, message=f"the sandbox could not store the snippet on the host ({err.strerror}); it did not run"
            )
        try:
            return self._exec([*interpreter, posixpath.join(self._run_inside, "snippets", name)], timeout_s=timeout_s, stdin=stdin)
        finally:
            try:
                os.unlink(host)
            except OSError:
                pass

    def launch(self, argv: list[str], *, env: Mapping[str, str] | None = None) -> Launch:
        """The host command that runs ``argv`` as :meth:`run` would (bubblewrap, the cgroup, the
        rlimits, the sandbox's uid) but for as long as it lives, with the caller's stdio. A host
        path in ``argv`` must be visible inside: under ``/usr``, the interpreter's prefix or
        ``ro_binds``. Its processes are the sandbox's: :meth:`reset` and :meth:`close` kill them."""
        self._check_open()
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError("argv must be a non-empty list of strings")
        for path in (argv[0], *self._ro_binds) if os.path.isabs(argv[0]) else self._ro_binds:
            if not accessible(path, self.uid, self.gid, need=os.R_OK | os.X_OK):
                raise SandboxError(
                    f"the sandbox's uid {self.uid} cannot reach {path}: a folder above it is closed to other users "
                    "(as /root is); install what it runs where any user can read it (/opt, /usr/local, /tmp) with an "
                    "interpreter any user can run (/usr/bin/python3)"
                )
        marker = f"{self._token}-{next(_COUNTER)}"
        full = self._limited(list(argv))
        if self._use_bwrap:
            full = self._bwrap_argv() + full
        if self._cgroup is not None:
            full = self._cgroup.join_argv(full)
        if self._root_host:  # run() drops to the sandbox's uid in Popen; a launched command does it with setpriv
            setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
            if setpriv is None:
                raise SandboxError("starting a process in the sandbox as its uid needs setpriv (util-linux): apt-get install util-linux")
            full = [setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--", *full]
        inside = self._env(marker)
        inside.update({"LOGNAME": "sandbox", "SHELL": "/bin/sh"})
        inside.update(env or {})
        return Launch(tuple(full), inside, self.root if self._use_bwrap else self._work)

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
        marker = f"{self._token}-{next(_COUNTER)}"  # the sandbox's name first: a reclaim finds its processes
        full = self._limited(argv)
        if self._use_bwrap:
            full = self._bwrap_argv() + full
        cgroup = self._cgroup
        if cgroup is not None:
            full = cgroup.join_argv(full)
        ooms = cgroup.oom_kills() if cgroup is not None else -1
        watched = self._watched()
        baseline = usage(watched[0], max_bytes=watched[1], max_files=watched[2]) if watched else None
        kwargs: dict[str, Any] = {}
        if self._root_host:
            kwargs.update(user=self.uid, group=self.gid, extra_groups=[])
        start = time.monotonic()
        with self._lock:  # a call that ends meanwhile must not sweep the uid: this one is about to run under it
            self._starting += 1
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
            with self._lock:
                self._starting -= 1
            return ExecResult(
                "crashed", None, "", "", time.monotonic() - start, message=f"the sandbox could not start the command: {err}"
            )
        call = Call(proc, marker)
        call.baseline = baseline
        with self._lock:
            self._calls.add(call)
            self._starting -= 1
        try:
            out, err_, dropped, timed_out = self._communicate(call, stdin, start + timeout)
            if watched is not None and not call.over_quota:
                self._check_quota(call)  # what it wrote just before it exited
        finally:
            self._finish(call)
        duration = time.monotonic() - start
        oom = cgroup is not None and ooms >= 0 and cgroup.oom_kills() > ooms
        return self._result(
            proc.returncode, out, err_, dropped, timed_out, duration, timeout, oom=oom, over_quota=call.over_quota
        )


    # ------------------------------------------------------- lifecycle
    def _kill_all(self) -> None:
        with self._lock:
            calls = list(self._calls)
        for c in calls:
            c.killed = True
            self._kill_call(c)
        if self._own_uid is not None:
            kill_uid(self._own_uid)
        if self._cgroup is not None:
            self._cgroup.kill_all()

    def reset(self) -> None:
        self._check_open()
        self._kill_all()
        try:
            if self._res.sweep_uid is not None:
                remove_uid_leftovers(self._res.sweep_uid)
            for d, size in ((self._work, self.limits.disk_mb), (self._tmp, self._tmp_mb)):
                if d in self._res.mounts:  # a fresh tmpfs: instant, whatever the tree was
                    self._res.mounts.remove(d)
                    unmount(d)
                    mount_tmpfs(d, size_mb=size, inodes=self.limits.max_files, uid=self.uid, gid=self.gid)
                    self._res.mounts.append(d)
                else:
                    empty_dir(d)
        except OSError as err:
            raise SandboxError(f"the sandbox could not empty its workspace: {err}") from None
        snippets = os.path.join(self._run, "snippets")
        for name in os.listdir(snippets):
            try:
                os.unlink(os.path.join(snippets, name))
            except OSError:
                pass

    def close(self) -> None:
        """Kill everything and remove everything (see the class docstring); never raises: what could
        not be removed is a ``RuntimeWarning`` naming it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._kill_all()
        except Exception:  # noqa: BLE001 -- the finalizer kills again and reports what stays
            pass
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.root
        return f"<LocalSandbox {state}: {self.isolation.describe()}>"


# --------------------------------------------------------------------- probe
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
    key = (path, is_root())
    with _PROBE_LOCK:
        if key not in _PROBES:
            _PROBES[key] = _probe(path)
        return _PROBES[key]


def _probe(bwrap: str) -> BwrapStatus:
    version = bwrap_version(bwrap)
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
