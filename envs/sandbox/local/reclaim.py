"""Who owns a local sandbox, and the reclaim of what a killed owner left behind.

``close()`` and the finalizer release a sandbox; a SIGKILL (the OOM killer, a scheduler's
``kill -9``, a node's watchdog) runs neither, and leaves its directory, its tmpfs mounts (RAM), its
cgroups and, without bubblewrap, its processes. So each sandbox's directory holds an owner record
(``owner.json``: pid, process start time, boot id, the sandbox's uid) on which the owner keeps an
``flock`` for the sandbox's whole life. The kernel drops that lock when the owner dies, however it
dies, so "the lock is free" is the test of a dead owner: no pid reuse, no clock, no guess. The
cgroups are noted in ``cgroups`` *before* they are made, so a kill between the two leaks nothing.

The next sandbox a process makes (once per process and temp directory) and ``tokengym sandbox gc``
scan for sandboxes whose lock is free and remove what they hold; a live owner's are never
touched (its lock is held), and a directory too young to have its record yet is left for later.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..base import process_start_time
from .leftovers import remove_tree, remove_uid_leftovers
from .paths import TMP_PREFIX, is_under
from .quota import unmount
from .cgroups import NAME_PREFIX as CGROUP_PREFIX, Cgroup
from .uids import UID_RANGE, kill_marked, kill_uid

__all__ = ["OWNER_FILE", "Owner", "Reclaimed", "claim", "note_cgroups", "reclaim", "reclaim_once", "scan"]

log = logging.getLogger("tokengym.sandbox")

OWNER_FILE = "owner.json"
CGROUPS_FILE = "cgroups"
YOUNG_S = 30.0
"""A directory without a complete record is being made for this long at most (microseconds, in fact)."""
RECORD_VERSION = 1


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def claim(root: str, *, uid: int | None, sweep: bool) -> int:
    """Write ``root``'s owner record and lock it for this process; returns the descriptor that holds
    the lock (closed by the sandbox's release, last). ``uid``: the sandbox's own uid, if any."""
    fd = os.open(os.path.join(root, OWNER_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        pid = os.getpid()
        record = {
            "version": RECORD_VERSION,
            "pid": pid,
            "start": process_start_time(pid) or "",
            "boot_id": _boot_id(),
            "host": socket.gethostname(),
            "uid": uid,
            "sweep": sweep,
            "created": time.time(),
        }
        os.write(fd, json.dumps(record).encode() + b"\n")
    except BaseException:
        os.close(fd)
        raise
    return fd


def note_cgroups(root: str, dirs: Iterable[str]) -> None:
    """Note cgroup directories about to be made (before ``mkdir``: a kill between leaks nothing)."""
    with open(os.path.join(root, CGROUPS_FILE), "a") as f:
        f.write("".join(f"{d}\n" for d in dirs))
        f.flush()


@dataclass(frozen=True)
class Owner:
    """One sandbox directory found by a scan."""

    root: str
    alive: bool
    """The owner's lock is held (or the directory is too young to tell): never reclaimed."""
    pid: int | None = None
    uid: int | None = None
    sweep: bool = False
    note: str = ""


@dataclass
class Reclaimed:
    """What a reclaim removed, and what it could not."""

    sandboxes: list[str] = field(default_factory=list)
    processes: int = 0
    mounts: int = 0
    cgroups: int = 0
    live: int = 0
    """Sandboxes left alone: their owner is alive."""
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.sandboxes and not self.problems and not self.cgroups:
            return f"no sandbox of a dead owner ({self.live} live)"
        line = (
            f"reclaimed {len(self.sandboxes)} sandbox(es) of dead owners: {self.processes} process(es) killed, "
            f"{self.mounts} mount(s), {self.cgroups} cgroup(s) and {len(self.sandboxes)} folder(s) removed; {self.live} live left alone"
        )
        if self.problems:
            line += f"; could not remove: {'; '.join(self.problems[:5])}"
        return line


def _temp_dirs(dirs: Iterable[str] | None) -> list[str]:
    return list(dict.fromkeys(os.path.realpath(d) for d in (dirs or [tempfile.gettempdir()])))


def _read_record(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        record = json.loads(raw)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("version") == RECORD_VERSION else None


def _ours(st: os.stat_result) -> bool:
    """Made by this user and writable by no one else: a record another user could have planted
    (naming a cgroup or a uid to kill) is never read."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _probe(root: str) -> tuple[Owner, int | None]:
    """Whether ``root``'s owner is alive; for a dead one, the record's descriptor with its lock now ours."""
    path = os.path.join(root, OWNER_FILE)
    try:
        if not _ours(os.lstat(root)):
            return Owner(root, True, note="not this user's"), None
    except OSError:
        return Owner(root, True, note="gone"), None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = None
    except OSError as err:
        return Owner(root, True, note=f"cannot open {path}: {err.strerror}"), None
    if fd is not None and not _ours(os.fstat(fd)):
        os.close(fd)
        return Owner(root, True, note="not this user's"), None
    if fd is None:  # killed before it wrote its record, or being made now
        try:
            age = time.time() - os.lstat(root).st_mtime
        except OSError:
            return Owner(root, True, note="gone"), None
        return Owner(root, age < YOUNG_S, note="no owner record"), None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            peek = _peek(root)
            pid, uid = peek.get("pid"), peek.get("uid")
            return Owner(root, True, pid=pid if isinstance(pid, int) else None, uid=uid if isinstance(uid, int) else None), None
        return Owner(root, True, note=f"cannot lock {path}: {err.strerror}"), None
    record = _read_record(fd)
    if record is None:
        age = time.time() - os.fstat(fd).st_mtime
        if age < YOUNG_S:  # locked-then-written: the owner is between the two
            os.close(fd)
            return Owner(root, True, note="record being written"), None
        return Owner(root, False, note="incomplete owner record"), fd
    uid = record.get("uid")
    if not (isinstance(uid, int) and UID_RANGE[0] <= uid < UID_RANGE[1]):
        uid = None  # only a fresh sandbox uid is ever killed or swept
    return Owner(root, False, pid=record.get("pid"), uid=uid, sweep=bool(record.get("sweep"))), fd


def _candidates(dirs: list[str]) -> list[str]:
    out: list[str] = []
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        out += [os.path.join(d, n) for n in sorted(names) if n.startswith(TMP_PREFIX) and os.path.isdir(os.path.join(d, n))]
    return out


def scan(dirs: Iterable[str] | None = None) -> list[Owner]:
    """Every sandbox directory in ``dirs`` (default: the system temp directory), live or dead."""
    out = []
    for root in _candidates(_temp_dirs(dirs)):
        owner, fd = _probe(root)
        if fd is not None:
            os.close(fd)
        out.append(owner)
    return out


def _mounts_under(root: str) -> list[str]:
    """Mount points under ``root`` (this process's mount namespace), deepest first."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    point = fields[4].replace("\\040", " ")
                    if is_under(point, root) and point != root:
                        out.append(point)
    except OSError:
        pass
    return sorted(out, key=len, reverse=True)


def _noted_cgroups(root: str) -> list[str]:
    try:
        with open(os.path.join(root, CGROUPS_FILE)) as f:
            text = f.read()
    except OSError:
        return []
    # a torn last line: its mkdir never ran; only a sandbox cgroup's name is ever touched
    return [line for line in text.split("\n")[:-1] if os.path.basename(line).startswith(CGROUP_PREFIX) and line.startswith("/sys/fs/cgroup/")]


def _remove_cgroups(dirs: list[str], out: Reclaimed) -> list[str]:
    """Kill what is in one sandbox's cgroup(s) ``dirs`` and remove them; those still busy."""
    present = [d for d in dirs if os.path.isdir(d)]
    if not present:
        return []
    cgroup = Cgroup.existing(present)
    out.processes += len(cgroup.pids())
    busy = cgroup.remove()
    out.cgroups += len(present) - len(busy)
    return busy


def _kill_by_markers(tokens: set[str]) -> int:
    """SIGKILL every process whose ``MARKER_VAR`` (``<sandbox>-<call>``) names one of the sandboxes ``tokens``."""
    if not tokens:
        return 0
    wanted = {t.encode() for t in tokens}
    return kill_marked(lambda value: value.rsplit(b"-", 1)[0] in wanted)


def _reclaim_one(owner: Owner, live_uids: set[int], out: Reclaimed) -> None:
    root = owner.root
    problems: list[str] = []
    problems += [f"cgroup {d} is still busy" for d in _remove_cgroups(_noted_cgroups(root), out)]
    if owner.uid is not None and owner.uid not in live_uids:
        kill_uid(owner.uid)
        if owner.sweep:
            problems += remove_uid_leftovers(owner.uid)
    for point in _mounts_under(root):
        try:
            unmount(point)
            out.mounts += 1
        except OSError as err:
            problems.append(str(err))
    if problems:  # the record stays, for the next reclaim
        out.problems += [f"{root}: {p}" for p in problems]
        return
    try:
        remove_tree(root)
    except OSError as err:
        out.problems.append(f"{err.filename or root}: {err.strerror}")
        return
    out.sandboxes.append(root)


def _orphan_cgroups(out: Reclaimed) -> None:
    """Sandbox cgroups under this process's own whose record is gone (a folder someone deleted):
    named ``<prefix><pid>-...`` by their maker, removed once that pid is gone (its processes
    killed); a probe's, once it is older than :data:`YOUNG_S`."""
    from .cgroups import cgroup_support  # noqa: PLC0415 -- (its probe runs once per process)

    by_name: dict[str, list[str]] = {}  # one sandbox's cgroup in each hierarchy (v1: memory and pids)
    for parent in cgroup_support().parents:
        try:
            names = [n for n in os.listdir(parent) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            continue
        for name in names:
            by_name.setdefault(name, []).append(os.path.join(parent, name))
    for name, dirs in by_name.items():
        maker = name[len(CGROUP_PREFIX) :].split("-", 1)[0]
        try:
            if maker.isdigit():
                if os.path.exists(f"/proc/{maker}"):
                    continue  # its maker lives (or the pid was reused: left, never wrongly removed)
            elif maker != "probe" or time.time() - os.stat(dirs[0]).st_mtime < YOUNG_S:
                continue
        except OSError:
            continue
        out.problems += [f"cgroup {d} is still busy" for d in _remove_cgroups(dirs, out)]


def reclaim(dirs: Iterable[str] | None = None) -> Reclaimed:
    """Remove every sandbox in ``dirs`` (default: the system temp directory) whose owner is dead:
    its processes, cgroups, mounts, its uid's files in the host's shared places, its directory."""
    out = Reclaimed()
    dead: list[tuple[Owner, int | None]] = []
    live_uids: set[int] = set()
    for root in _candidates(_temp_dirs(dirs)):
        owner, fd = _probe(root)
        if owner.alive:
            if owner.note != "gone":
                out.live += 1
                if owner.uid is not None:
                    live_uids.add(owner.uid)
            continue
        dead.append((owner, fd))
    try:
        out.processes += _kill_by_markers({os.path.basename(o.root) for o, _ in dead})
        for owner, _ in dead:
            _reclaim_one(owner, live_uids, out)
        _orphan_cgroups(out)
    finally:
        for _, fd in dead:
            if fd is not None:
                os.close(fd)
    return out


def _peek(root: str) -> dict:
    """A live sandbox's record (read without its lock; ``{}`` when unreadable)."""
    try:
        with open(os.path.join(root, OWNER_FILE), "rb") as f:
            record = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


_DONE: set[tuple[int, str]] = set()
_DONE_LOCK = threading.Lock()


def reclaim_once(tmp_dir: str | None) -> Reclaimed | None:
    """:func:`reclaim` of ``tmp_dir`` the first time this process makes a sandbox there (None
    after that); what it did is logged (``tokengym.sandbox``), what it could not do warned about."""
    where = os.path.realpath(tmp_dir or tempfile.gettempdir())
    key = (os.getpid(), where)
    with _DONE_LOCK:
        if key in _DONE:
            return None
        _DONE.add(key)
        try:
            done = reclaim([where])
        except OSError as err:
            log.warning("reclaiming the sandboxes of dead owners in %s failed: %s", where, err)
            return None
    if done.sandboxes or done.cgroups:
        log.warning("%s (in %s)", done.summary(), where)
    if done.problems:
        import warnings

        warnings.warn(f"sandboxes of dead owners in {where}: {done.summary()}", RuntimeWarning, stacklevel=3)
    return done
