"""The store's one-writer rule, held by the kernel rather than by a file a user can delete.

A writer flocks the store's directory itself (and, as earlier versions did, ``.tokengym.lock``):
deleting the lock file no longer lets a second writer in beside a live one, since the directory
cannot go while it holds the store. What a user can still do is move the directory away and put
another in its place; :meth:`StoreLock.check`, run before every write and every compaction, sees
that the path no longer names the directory it locked and stops the writer with an error,
instead of writing where no one would look.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import StoreError
from .files import LOCK_NAME

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["StoreLock"]


class StoreLock:
    """An exclusive, non-blocking lock on the store at ``root``; ``busy`` is the error's message
    when another process (or another writer in this one) holds it."""

    def __init__(self, root: Path, busy: str) -> None:
        self.root = Path(root)
        self._fds: list[int] = []
        if fcntl is None:  # pragma: no cover
            return
        try:
            for path, flags in ((self.root, os.O_RDONLY | os.O_DIRECTORY), (self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT)):
                fd = os.open(path, flags, 0o644)
                self._fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            self.release()
            raise StoreError(busy) from err

    def check(self) -> None:
        """Raise :class:`StoreError` when ``root`` no longer names the directory this lock holds."""
        if not self._fds:
            return
        held = os.fstat(self._fds[0])
        try:
            now = os.stat(self.root)
        except OSError as err:
            raise StoreError(f"{self.root}: the store's directory is gone; this writer stops (nothing more is written)") from err
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise StoreError(
                f"{self.root}: the store's directory was replaced after this writer locked it; this writer stops "
                "(nothing more is written): one writer per store, and a store is not moved while it is written"
            )

    def release(self) -> None:
        """Let the lock go (closing the descriptors releases their flocks)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
