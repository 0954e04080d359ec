"""Where a store keeps what: the names of its shards, episode logs, manifest and lock, and the one
way a file is put in place (hidden temp file, fsync, rename, directory fsync).

Every shard and every manifest goes through :func:`atomic_write`, so no reader ever sees one
half written, and a dead writer's leftovers are recognisable by name (``TEMP_RE``).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["LOCK_NAME", "MANIFEST_NAME", "log_paths", "shard_paths"]

MANIFEST_NAME = ".tokengym.json"
LOCK_NAME = ".tokengym.lock"

_SHARD_RE = re.compile(r"^part-(\d{5,})\.parquet$")
TEMP_RE = re.compile(r"^\.(part-\d{5,}\.parquet|\.tokengym\.json)\.\d+\.tmp$")
_LOG_RE = re.compile(r"^\.part-(\d{5,})\.log$")


def shard_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """The store's complete shards, in write order (temp files of a crashed writer excluded).

    Handy for ``datasets.load_dataset("parquet", data_files=[str(p) for p in shard_paths(d)])``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no trajectory store at {root}: not a directory")
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _SHARD_RE.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def atomic_write(final: Path, write: Any) -> None:
    """Write via ``write(fileobj)`` to a hidden temp file beside ``final``, fsync, rename into place."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(final.parent)


def log_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """The store's episode logs (hidden ``.part-NNNNN.log`` files), in index order."""
    root = Path(directory)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _LOG_RE.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def file_index(path: Path) -> int:
    m = _SHARD_RE.match(path.name) or _LOG_RE.match(path.name)
    assert m is not None, path
    return int(m.group(1))


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def log_name(index: int) -> str:
    return f".part-{index:05d}.log"
