"""Removing what a local sandbox leaves behind: any directory tree, and whatever its uid put in the
host's shared places (``/tmp``, ``/var/tmp``, ``/dev/shm``, POSIX message queues, System V IPC).

Both must work on trees the sandbox built to resist: 3,000 levels deep (``shutil.rmtree``
recurses and raises ``RecursionError``; a path that long exceeds ``PATH_MAX``), read-only
directories, names with newlines or bytes that are not UTF-8. :func:`remove_tree` therefore never
recurses and never builds a long path: it empties one directory at a time and moves that
directory's subdirectories up to the top (a rename within the same file system), so every path
it uses is two components long.
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Iterable

from .quota import load_libc

__all__ = ["remove_tree", "remove_uid_leftovers"]

SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")
"""World-writable places on the host where a sandbox without bubblewrap can leave files."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _empty_one(top_fd: int, name: str, serial: list[int]) -> None:
    """Empty the directory ``name`` under ``top_fd`` (its subdirectories are moved up into
    ``top_fd``, to be emptied in turn) and remove it."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=top_fd)
    try:
        try:
            os.fchmod(fd, 0o700)
        except OSError:
            pass
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for child, is_dir in entries:
            if is_dir:
                serial[0] += 1
                os.rename(child, f".tokengym-rm-{serial[0]}", src_dir_fd=fd, dst_dir_fd=top_fd)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=top_fd)


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything under it, whatever its depth, modes or names (never follows
    a symlink out). Raises ``OSError`` only when something really could not be removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    serial = [0]
    top = os.open(path, _DIR_FLAGS)
    try:
        try:
            os.fchmod(top, 0o700)
        except OSError:
            pass
        while True:
            with os.scandir(top) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            if not entries:
                break
            for name, is_dir in entries:
                if is_dir:
                    _empty_one(top, name, serial)
                else:
                    os.unlink(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def empty_dir(path: str) -> None:
    """Remove everything inside ``path`` (kept itself)."""
    fd = os.open(path, _DIR_FLAGS)
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
    finally:
        os.close(fd)
    for name in names:
        remove_tree(os.path.join(path, name))


def _owned_entries(root: str, uid: int, depth: int) -> Iterable[str]:
    """Entries owned by ``uid`` under ``root``, looking into world-writable directories of others
    (where the uid may also have put things) ``depth`` levels down."""
    try:
        it = os.scandir(root)
    except OSError:
        return
    with it:
        entries = list(it)
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid:
            yield e.path
        elif depth > 0 and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH:
            yield from _owned_entries(e.path, uid, depth - 1)


def _sysv_ids(kind: str, uid: int) -> list[int]:
    """Ids of the System V IPC objects (``shm``, ``sem``, ``msg``) owned or created by ``uid``."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            header = f.readline().split()
            rows = [line.split() for line in f]
    except OSError:
        return []
    try:
        col_id, col_uid, col_cuid = header.index({"shm": "shmid", "sem": "semid", "msg": "msqid"}[kind]), header.index("uid"), header.index("cuid")
    except ValueError:
        return []
    return [int(r[col_id]) for r in rows if len(r) > col_cuid and uid in (int(r[col_uid]), int(r[col_cuid]))]


def remove_uid_leftovers(uid: int, *, dirs: Iterable[str] = SHARED_DIRS) -> list[str]:
    """Remove every file ``uid`` left in the host's shared directories and every System V IPC
    object it owns; returns what could not be removed (empty when all went)."""
    failed: list[str] = []
    for d in dirs:
        for path in list(_owned_entries(d, uid, depth=2)):
            try:
                remove_tree(path)
            except OSError as err:
                failed.append(f"{path}: {err.strerror}")
    libc = load_libc()
    ipc_rmid = 0
    for kind in ("shm", "sem", "msg"):
        for ident in _sysv_ids(kind, uid):
            if kind == "shm":
                rc = libc.shmctl(ctypes.c_int(ident), ctypes.c_int(ipc_rmid), None)
            elif kind == "sem":
                rc = libc.semctl(ctypes.c_int(ident), ctypes.c_int(0), ctypes.c_int(ipc_rmid))
            else:
                rc = libc.msgctl(ctypes.c_int(ident), ctypes.c_int(ipc_rmid), None)
            if rc != 0:
                err = ctypes.get_errno()
                failed.append(f"System V {kind} {ident}: {os.strerror(err)}")
    return failed
