"""Memory and process limits for a whole local sandbox: one cgroup per sandbox.

``RLIMIT_AS`` and ``RLIMIT_NPROC`` hold per process (and per uid): six children of 400 MB each
pass a 512 MB address-space limit one by one. A cgroup counts them together. Two layouts are
supported, checked by really creating one (never assumed from what is mounted):

* cgroup v2 with a subtree this process may write (a delegated one, or root's): ``memory.max``,
  ``memory.swap.max``, ``pids.max``; the OOM kills are read from ``memory.events``.
* cgroup v1 with the ``memory`` and ``pids`` controllers mounted and writable (root on most
  virtual machines): ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``, swap
  included, where the kernel accounts swap), ``pids.max``; OOM kills from ``memory.oom_control``.

The cgroup is made under this process's own cgroup of each hierarchy, so a sandbox never gets
more than its host. A command joins it before anything else runs: its first process writes its
own pid into ``cgroup.procs`` (the file is given to the sandbox's uid, as in a delegation), then
execs the rest, so every process it forks is counted from the first one.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Cgroup", "CgroupSupport", "cgroup_support"]

NAME_PREFIX = "tokengym-sandbox-"


def _mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, file-system type, super options) of every cgroup mount of this process."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                    out.append((fields[4].replace("\\040", " "), rfields[0], rfields[2]))
    except OSError:
        pass
    return out


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``{"": v2 path, "memory": ..., "pids": ...}``."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    for ctrl in parts[1].split(",") if parts[1] else [""]:
                        out[ctrl] = parts[2]
    except OSError:
        pass
    return out


@dataclass(frozen=True)
class CgroupSupport:
    """Where sandbox cgroups can be made here, or why not."""

    kind: str
    """``"v2"``, ``"v1"`` or ``""`` (none)."""
    reason: str
    parents: tuple[str, ...] = ()
    """v2: (the parent directory,); v1: (the memory parent, the pids parent)."""


_SUPPORT: CgroupSupport | None = None
_SUPPORT_LOCK = threading.Lock()


def cgroup_support() -> CgroupSupport:
    """Whether this process can give each sandbox a cgroup with a memory and a pids limit (checked
    once per process by making and removing one)."""
    global _SUPPORT
    with _SUPPORT_LOCK:
        if _SUPPORT is None:
            _SUPPORT = _detect()
        return _SUPPORT


def _try_make(parent: str, files: tuple[str, ...]) -> str | None:
    """None when a child cgroup with ``files`` can be made (and removed) under ``parent``, else why not."""
    probe = os.path.join(parent, f"{NAME_PREFIX}probe-{secrets.token_hex(4)}")
    try:
        os.mkdir(probe)
    except OSError as err:
        return f"cannot create a cgroup under {parent}: {err.strerror}"
    try:
        missing = [f for f in files if not os.path.exists(os.path.join(probe, f))]
        if missing:
            return f"a cgroup under {parent} has no {', '.join(missing)} (controller not enabled there)"
        # a process must be able to move itself in, as every call's first process does
        # (cgroup v2 refuses it where its rules on internal processes or domains forbid it)
        join = subprocess.run(
            ["/bin/sh", "-c", 'echo $$ > "$1"', "sandbox-join", os.path.join(probe, "cgroup.procs")],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
        if join.returncode != 0:
            return f"a process cannot join a cgroup under {parent}: {join.stderr.strip()[-200:]}"
        return None
    finally:
        for _ in range(200):  # the joined process has exited; its cgroup empties at once, or nearly
            try:
                os.rmdir(probe)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.005)


def _detect() -> CgroupSupport:
    mounts = _mountinfo()
    own = _own_cgroups()
    reasons = []
    v2 = next((m for m, fs, _ in mounts if fs == "cgroup2"), None)
    if v2 is not None and "" in own:
        parent = os.path.normpath(v2 + own[""])
        why = _try_make(parent, ("memory.max", "pids.max", "cgroup.procs"))
        if why is None:
            return CgroupSupport("v2", "ok", (parent,))
        reasons.append(f"v2: {why}")
    v1 = {}
    for point, fs, opts in mounts:
        if fs == "cgroup":
            for ctrl in ("memory", "pids"):
                if ctrl in opts.split(",") and ctrl not in v1:
                    v1[ctrl] = point
    if "memory" in v1 and "pids" in v1:
        mem = os.path.normpath(v1["memory"] + own.get("memory", "/"))
        pids = os.path.normpath(v1["pids"] + own.get("pids", "/"))
        why = _try_make(mem, ("memory.limit_in_bytes", "cgroup.procs")) or _try_make(pids, ("pids.max", "cgroup.procs"))
        if why is None:
            return CgroupSupport("v1", "ok", (mem, pids))
        reasons.append(f"v1: {why}")
    elif v2 is None:
        reasons.append("no cgroup v2 and no cgroup v1 memory and pids controllers are mounted")
    else:
        reasons.append("no cgroup v1 memory and pids controllers are mounted")
    return CgroupSupport("", "; ".join(reasons))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Cgroup:
    """One sandbox's cgroup(s): made with the limits, joined by every command, emptied and removed."""

    def __init__(
        self,
        support: CgroupSupport,
        *,
        memory_mb: int,
        max_processes: int,
        uid: int,
        gid: int,
        before_mkdir: Callable[[tuple[str, ...]], None] | None = None,
    ) -> None:
        if not support.kind:
            raise OSError(f"no cgroups here: {support.reason}")
        self.kind = support.kind
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs = tuple(os.path.join(p, name) for p in support.parents)
        if before_mkdir is not None:  # the owner record notes them first (see :mod:`.reclaim`)
            before_mkdir(self.dirs)
        made: list[str] = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            mem = str(memory_mb << 20)
            if self.kind == "v2":
                d = self.dirs[0]
                _write(os.path.join(d, "memory.max"), mem)
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_processes))
            else:
                mdir, pdir = self.dirs
                _write(os.path.join(mdir, "memory.limit_in_bytes"), mem)
                memsw = os.path.join(mdir, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):
                    _write(memsw, mem)  # memory + swap: no swap beyond the limit
                _write(os.path.join(pdir, "pids.max"), str(max_processes))
            # The sandbox's first process moves itself in (a delegation: the file is its uid's).
            self.procs_files = tuple(os.path.join(d, "cgroup.procs") for d in self.dirs)
            if (uid, gid) != (os.getuid(), os.getgid()):
                for f in self.procs_files:
                    os.chown(f, uid, gid)
        except BaseException:
            for d in reversed(made):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise

    @classmethod
    def existing(cls, dirs: Sequence[str]) -> Cgroup:
        """The cgroup(s) ``dirs`` another process made (a dead sandbox's): to kill what is in them
        and remove them (:meth:`pids`, :meth:`kill_all`, :meth:`remove`), never to join."""
        self = cls.__new__(cls)
        self.kind = "v2" if len(dirs) == 1 else "v1"
        self.dirs = tuple(dirs)
        self.procs_files = tuple(os.path.join(d, "cgroup.procs") for d in self.dirs)
        return self

    def describe(self) -> str:
        """How the limits hold, for :attr:`Isolation.details`."""
        where = "cgroup v2" if self.kind == "v2" else "cgroup v1 memory and pids controllers"
        return f"memory and max_processes hold for the whole sandbox ({where})"

    def join_argv(self, argv: list[str]) -> list[str]:
        """``argv`` behind a shell that first moves itself into the cgroup(s)."""
        joins = " && ".join(f"echo $$ > '{f}'" for f in self.procs_files)
        return ["/bin/sh", "-c", f'{joins} && exec "$@"', "sandbox-join", *argv]

    def oom_kills(self) -> int:
        """How many processes the kernel killed for memory in this cgroup so far (-1: unknown)."""
        path = os.path.join(self.dirs[0], "memory.events" if self.kind == "v2" else "memory.oom_control")
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return -1

    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        out: set[int] = set()
        for f in self.procs_files:
            try:
                with open(f) as fh:
                    out.update(int(x) for x in fh.read().split())
            except (OSError, ValueError):
                pass
        return sorted(out)

    def kill_all(self, within_s: float = 2.0) -> bool:
        """SIGKILL every process in the cgroup until none is left; False when some stayed."""
        deadline = time.monotonic() + within_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if self.kind == "v2" and os.path.exists(os.path.join(self.dirs[0], "cgroup.kill")):
                try:
                    _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def remove(self, within_s: float = 2.0) -> list[str]:
        """Kill what is left and remove the cgroup(s); the directories that could not be removed."""
        self.kill_all(within_s)
        left = []
        for d in self.dirs:
            deadline = time.monotonic() + within_s
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:  # still busy: zombies waiting for their reaper
                        left.append(d)
                        break
                    time.sleep(0.01)
        return left
