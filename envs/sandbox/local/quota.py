"""A disk and inode quota on a local sandbox's workspace and ``/tmp``.

Where this process may mount (root), each of the two directories is a tmpfs of its own, sized
(``size=``, ``nr_inodes=``): a write past the quota fails with ``ENOSPC`` in the sandbox, the
host's disk never fills, and removing it is one unmount, however deep or odd the tree inside.
Its pages are memory (as in the Docker backend's tmpfs workspace): they count against the
sandbox's memory cgroup while the sandbox writes them.

Elsewhere a watchdog measures the two directories while a call runs and stops the call when they
go past the quota (:func:`usage` stops counting as soon as the quota is passed, so a flood of
files costs the watchdog no more than the quota itself).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
import threading

__all__ = ["MountError", "mount_tmpfs", "unmount", "usage"]

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2

_LIBC: ctypes.CDLL | None = None
_LIBC_LOCK = threading.Lock()


class MountError(OSError):
    """The tmpfs could not be mounted (no privilege, no tmpfs): the watchdog takes over."""


def load_libc() -> ctypes.CDLL:
    global _LIBC
    with _LIBC_LOCK:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return _LIBC


def mount_tmpfs(path: str, *, size_mb: int, inodes: int, uid: int, gid: int, mode: int = 0o700) -> None:
    """Mount a tmpfs of ``size_mb`` MB and ``inodes`` inodes on ``path`` (owned by ``uid``/``gid``)."""
    opts = f"size={int(size_mb)}m,nr_inodes={int(inodes)},mode={mode:o},uid={int(uid)},gid={int(gid)}"
    libc = load_libc()
    rc = libc.mount(b"tokengym-sandbox", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode())
    if rc != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"cannot mount a tmpfs on {path}: {os.strerror(err)}")


def is_mount(path: str) -> bool:
    """Whether ``path`` is a mount point (its device differs from its parent's)."""
    try:
        return os.lstat(path).st_dev != os.lstat(os.path.dirname(path.rstrip("/")) or "/").st_dev
    except OSError:
        return False


def unmount(path: str) -> None:
    """Detach the mount on ``path`` (lazily: nothing of the sandbox runs any more, nothing holds it)."""
    libc = load_libc()
    if libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
            raise OSError(err, f"cannot unmount {path}: {os.strerror(err)}")


def usage(paths: list[str], *, max_bytes: int, max_files: int) -> tuple[int, int]:
    """(bytes, files and directories) under ``paths``, counted without recursion and without
    following links; the count stops once past either limit."""
    total = files = 0
    stack: list[str] = list(paths)
    seen: set[tuple[int, int]] = set()
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                files += 1
                if (st.st_dev, st.st_ino) not in seen:  # hard links count once
                    if st.st_nlink > 1:
                        seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                if total > max_bytes or files > max_files:
                    return total, files
    return total, files
