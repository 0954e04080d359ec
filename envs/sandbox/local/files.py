"""The host side of a local sandbox's workspace: reading and writing files without following links out."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from typing import Any

from ..base import SandboxError, workspace_parts
from .paths import WORKDIR_INSIDE

class WorkspaceFiles:
    """The part of :class:`LocalSandbox` that reads and writes workspace files for the host."""

    workdir: str
    uid: int
    gid: int
    _root_host: bool
    _work: str
    _check_open: Any  # LocalSandbox's

    def _parts(self, path: str) -> list[str]:
        return workspace_parts(path, (self.workdir, WORKDIR_INSIDE))

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
            self._write(path, parts, data)
        except OSError as err:  # a full workspace, a name the file system refuses...
            why = err.strerror or str(err)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                why += " (the workspace is full: remove files in it)"
            raise SandboxError(f"cannot write {path!r}: {why}") from None

    def _write(self, path: str, parts: list[str], data: bytes) -> None:
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
            return self._read(path, parts, max_bytes)
        except OSError as err:
            raise SandboxError(f"cannot read {path!r}: {err.strerror or err}") from None

    def _read(self, path: str, parts: list[str], max_bytes: int | None) -> bytes:
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
                if st.st_uid != self.uid:  # a hard link to someone else's file (root's, the host's)
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
