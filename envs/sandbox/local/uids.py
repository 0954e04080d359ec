"""Who runs a local sandbox's commands, and how everything a sandbox uid started is found and killed.

On a root host each sandbox gets a fresh, otherwise unused uid: the process limit then counts
exactly that sandbox's processes, and ``kill(-1)`` run as that uid reaps everything it left.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from ..base import SandboxError

MARKER_VAR = "TOKENGYM_SANDBOX"

UID_RANGE = (1_500_000_000, 2_000_000_000)  # fresh uids for sandboxes of a root host: no passwd entry, no files


def is_root() -> bool:
    return os.geteuid() == 0


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


def fresh_uid() -> int:
    """A uid that no process uses and no other sandbox of this process holds."""
    with _UID_LOCK:
        busy = _uids_in_use() | _TAKEN_UIDS
        for _ in range(1000):
            uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
            if uid not in busy:
                _TAKEN_UIDS.add(uid)
                return uid
    raise SandboxError("no free uid for the sandbox")


def release_uid(uid: int) -> None:
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


def count_processes_of(uid: int) -> int:
    return sum(_processes_of(uid))


def kill_marked(match: Callable[[bytes], bool]) -> int:
    """SIGKILL every process (but this one) whose ``MARKER_VAR`` value ``match`` accepts (best effort)."""
    prefix = f"{MARKER_VAR}=".encode()
    killed = 0
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(item.startswith(prefix) and match(item[len(prefix) :]) for item in env):
            try:
                os.kill(int(name), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def kill_by_marker(marker: str) -> int:
    """SIGKILL every process whose environment holds ``MARKER_VAR=marker`` (best effort)."""
    wanted = marker.encode()
    return kill_marked(lambda value: value == wanted)


def kill_uid(uid: int, *, zombies_at_most: int | None = None, within_s: float = 2.0) -> None:
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
