"""What a local sandbox holds on the host, and its release: nothing outlives ``close()``, and
``close()`` never raises (what could not be removed is a warning that names it)."""

from __future__ import annotations

import os
import warnings

from .cgroups import Cgroup
from .execute import Call, killpg
from .leftovers import remove_tree, remove_uid_leftovers
from .quota import unmount
from .uids import kill_uid, release_uid


class Resources:
    """What a sandbox holds on the host; released by :meth:`LocalSandbox.close` or its finalizer."""

    def __init__(self, root: str, own_uid: int | None, calls: set[Call]) -> None:
        self.root = root
        self.own_uid = own_uid
        self.calls = calls
        self.cgroup: Cgroup | None = None
        self.mounts: list[str] = []
        self.sweep_uid: int | None = None
        """The uid whose files in the host's /tmp, /var/tmp, /dev/shm and System V IPC are removed."""
        self.owner_fd: int | None = None
        """Holds the lock on the owner record (:mod:`.reclaim`): closed last, once all is released."""


def _release(res: Resources) -> list[str]:
    """Kill and remove everything of a sandbox; what could not be removed (each step is tried)."""
    problems: list[str] = []
    for c in list(res.calls):
        killpg(c.proc)
    if res.own_uid is not None:
        kill_uid(res.own_uid)
    if res.cgroup is not None:
        problems += [f"cgroup {d} is still busy" for d in res.cgroup.remove()]
    if res.sweep_uid is not None:
        problems += remove_uid_leftovers(res.sweep_uid)
    for m in list(res.mounts):
        try:
            unmount(m)
            res.mounts.remove(m)
        except OSError as err:
            problems.append(str(err))
    try:
        remove_tree(res.root)
    except OSError as err:
        problems.append(f"{err.filename or res.root}: {err.strerror}")
    if res.own_uid is not None:
        release_uid(res.own_uid)
    if res.owner_fd is not None:  # a sandbox not fully removed is then a dead owner's: the next reclaim's
        os.close(res.owner_fd)
        res.owner_fd = None
    return problems


def cleanup(res: Resources) -> None:
    """Finalizer (also at interpreter exit): never raises; what could not be removed is a warning."""
    try:
        problems = _release(res)
    except Exception as err:  # noqa: BLE001 -- close() must not raise; reported below
        problems = [f"{type(err).__name__}: {err}"]
    if problems:
        warnings.warn(
            f"the sandbox {res.root} could not remove everything it held: {'; '.join(problems[:5])}",
            RuntimeWarning,
            stacklevel=2,
        )
