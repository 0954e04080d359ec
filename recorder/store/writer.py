""":class:`TrajectoryWriter`, the one live writer of a store directory.

It holds the store's lock, appends each trajectory to the episode log (fsynced at once or by a
group commit), turns the log into a shard every ``shard_size`` trajectories, and takes over
the log a crashed writer left. What "``write`` returned" guarantees, and how, is in
:mod:`tokengym.recorder.store`'s docstring.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..stopping import uninterrupted
from ..trajectory import Trajectory
from .episode_log import encode_row, log_header
from .errors import DiskFullError, StoreError, StoreWarning
from .files import atomic_write, fsync_dir, file_index, log_name, shard_name
from .fingerprint import display_name, unwrap, tokenizer_fingerprint
from .images import save_image
from .lock import StoreLock
from .log_origin import run_hash
from .manifest import write_manifest
from .resume import check_resume
from .rows import rows_table, trajectory_row
from .schema import METADATA_KEY, SCHEMA_VERSION

__all__ = ["TrajectoryWriter"]

_DISK_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


class TrajectoryWriter:
    """Appends trajectories to a store directory: each one to the episode log at once,
    ``shard_size`` at a time into a Parquet shard.

    Use as a context manager, or call :meth:`close`. Its :meth:`write` fits
    ``RecordEpisodes(env, on_episode=writer.write)`` and ``rollout(..., on_episode=writer.write)``.

    What "``write`` returned" guarantees (:mod:`tokengym.recorder.store`'s docstring says how):

    * ``fsync_interval=0``: the trajectory is on stable storage (fsynced): it survives
      SIGKILL, SIGTERM, a crash of the process and power loss.
    * ``fsync_interval=t > 0`` (default 1.0): it survives SIGKILL, SIGTERM and any crash of
      the process at once, and power loss or an OS crash once the log is fsynced, at most
      ``t`` seconds later (one background fsync covers every write of the window).

    Args:
        directory: the store; created if missing, resumed if it holds shards or a log.
        tokenizer: the tokenizer (or :class:`~tokengym.envs.ChatRenderer`) whose ids the
            trajectories hold; its fingerprint guards the store against mixing tokenizers.
        chat_template: the template in use when it overrides the tokenizer's own.
        tokenizer_name: the name to record (default: the tokenizer's name, without a local path).
        shard_size: trajectories per shard (fewer, larger files with more; a crash loses
            nothing either way).
        compression: Parquet compression codec.
        fsync_interval: seconds between group fsyncs of the log; 0 fsyncs in every ``write``.
        run: the settings of the run that writes (env, sampling, seed, ...), a JSON object.
            Recorded in the manifest of a new store; a store recorded with other settings is
            refused with the differences named (:class:`RunMismatchError`).

    Raises:
        TokenizerMismatchError, SchemaVersionError, CorruptShardError, ShardListError,
            RunMismatchError: the directory cannot be appended to (the message names the file).
        StoreError: another live writer holds the directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        tokenizer: Any,
        chat_template: str | None = None,
        tokenizer_name: str | None = None,
        shard_size: int = 1000,
        compression: str = "zstd",
        fsync_interval: float = 1.0,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"shard_size must be a positive integer, got {shard_size!r}")
        if not fsync_interval >= 0:
            raise ValueError(f"fsync_interval must be >= 0 seconds, got {fsync_interval!r}")
        tok, _ = unwrap(tokenizer, chat_template)
        self.directory = Path(directory)
        self.shard_size = shard_size
        self.compression = compression
        self.fsync_interval = float(fsync_interval)
        self.tokenizer_hash = tokenizer_fingerprint(tokenizer, chat_template)
        self.tokenizer_name = tokenizer_name or display_name(tokenizer)
        self.vocab_size = len(tok)
        self.num_written = 0  # trajectories this writer made durable (in the log, then in shards)
        self.recovered = 0  # trajectories taken over from a crashed writer's log
        self.shards_written: list[Path] = []
        self._rows: list[dict[str, Any]] = []
        self._closed = True
        self._store_lock: StoreLock | None = None
        self._log_fd: int | None = None
        self._log_path: Path | None = None
        self._log_id: str | None = None  # the open log's header id (None: a log of an older tokengym)
        self._log_size = 0
        self._dirty = False
        self._mutex = threading.RLock()
        self._wake = threading.Event()
        self._syncer: threading.Thread | None = None
        self._retry_at = shard_size
        self._file_meta = {
            METADATA_KEY: json.dumps(
                {
                    "schema_version": SCHEMA_VERSION,
                    "tokenizer_name": self.tokenizer_name,
                    "tokenizer_hash": self.tokenizer_hash,
                }
            ).encode()
        }

        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._open(dict(run) if run is not None else None)
        except BaseException:
            self._close_log()
            self._unlock()
            raise
        self._closed = False

    # ---------------------------------------------------------------- opening
    def _lock(self) -> None:
        self._store_lock = StoreLock(
            self.directory,
            f"{self.directory}: another TrajectoryWriter is writing to this store; "
            "one writer per directory (give each worker its own directory)",
        )

    def _unlock(self) -> None:
        if self._store_lock is not None:
            self._store_lock.release()
            self._store_lock = None

    def _open(self, run: dict[str, Any] | None) -> None:
        """Check the store (:func:`check_resume`), write its manifest, and turn into shards (or take
        over) the logs a crashed writer left."""
        root = self.directory
        resume = check_resume(
            root,
            tokenizer_name=self.tokenizer_name,
            tokenizer_hash=self.tokenizer_hash,
            vocab_size=self.vocab_size,
            run=run,
        )
        body, pending = resume.manifest, resume.pending
        self._manifest = body
        self._run_hash = run_hash(body.get("run"))  # what each new log's header says of the run
        self._next_index = resume.next_index
        write_manifest(root, body)
        # Every uncompacted log but the newest becomes a shard now; the newest is taken over.
        for log in pending:
            self._next_index = max(self._next_index, file_index(log.path))
            self._rows = log.rows
            self.recovered += len(log.rows)
            if not log.rows:
                log.path.unlink()
                continue
            self._log_fd, self._log_path = os.open(log.path, os.O_WRONLY | os.O_APPEND), log.path
            self._log_id = log.meta.get("log_id")
            if log.good != log.size:
                os.ftruncate(self._log_fd, log.good)  # cut a torn last record off
                os.fsync(self._log_fd)
            self._log_size = log.good
            if log is not pending[-1] or len(self._rows) >= self.shard_size:
                self._compact()  # killed before (or while) this shard was written

    # ---------------------------------------------------------------- writing
    def write(self, trajectory: Trajectory) -> None:
        """Append one trajectory to the episode log; a full log becomes a shard.

        When this returns, the trajectory is durable as the class docstring says. The
        trajectory is converted at once, so a value that cannot be stored (metadata that
        is not JSON, token ids outside the vocabulary) raises here and nothing is written.

        Raises:
            DiskFullError: no space (or a file-size limit) for the record; nothing of it was
                kept, so writing it again after freeing space stores it once.
            StoreError: the writer is closed, or the log cannot be written.
        """
        if self._closed:
            raise StoreError(f"{self.directory}: the writer is closed")
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"expected a Trajectory, got {type(trajectory).__name__}")
        images = [save_image(self.directory, img) for img in trajectory.images] if trajectory.images else None
        row = trajectory_row(trajectory, self.vocab_size, self.tokenizer_name, images)
        record = encode_row(row)
        with self._mutex, uninterrupted():  # a stop signal waits until the bookkeeping is done
            if self._closed:
                raise StoreError(f"{self.directory}: the writer is closed")
            if self._store_lock is not None:
                self._store_lock.check()
            self._append(record)
            self._rows.append(row)
            self.num_written += 1
            if len(self._rows) >= self._retry_at:
                self._try_compact()

    def _append(self, record: bytes) -> None:
        """One record onto the log, all or nothing; fsynced here when ``fsync_interval`` is 0."""
        new = self._log_fd is None
        try:
            if new:
                path = self.directory / log_name(self._next_index)
                self._log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                self._log_path, self._log_size = path, 0
                self._log_id = secrets.token_hex(8)  # as log_origin.new_id, without a hop on the write path
                meta = {
                    "schema_version": SCHEMA_VERSION,
                    "tokenizer_name": self.tokenizer_name,
                    "tokenizer_hash": self.tokenizer_hash,
                    "store_id": self._manifest.get("store_id"),
                    "run_hash": self._run_hash,
                    "log_id": self._log_id,
                }
                record = log_header(meta) + record
            view = memoryview(record)
            while view:
                view = view[os.write(self._log_fd, view) :]  # type: ignore[arg-type]
            if self.fsync_interval == 0 or new:
                os.fsync(self._log_fd)  # type: ignore[arg-type]
            if new:
                fsync_dir(self.directory)  # the new log's directory entry
        except OSError as err:
            self._cut_back(new)
            raise self._write_error(err, "the trajectory was not stored") from err
        self._log_size += len(record)
        if self.fsync_interval > 0:
            self._dirty = True
            self._start_syncer()

    def _cut_back(self, new: bool) -> None:
        """Undo a failed append: the log ends with its last whole record again."""
        if self._log_fd is None:
            return
        try:
            if new:
                os.close(self._log_fd)
                self._log_fd = None
                if self._log_path is not None:
                    self._log_path.unlink()
            else:
                os.ftruncate(self._log_fd, self._log_size)
        except OSError as err:  # pragma: no cover - shrinking a file needs no space
            self._closed = True
            raise StoreError(
                f"{self.directory}: a failed write could not be undone ({err}); the writer is closed. The log's "
                "whole records are safe: open a new writer, which cuts the partial record off"
            ) from err

    def _write_error(self, err: OSError, what: str) -> StoreError:
        if err.errno in _DISK_FULL:
            return DiskFullError(
                f"{self.directory}: no space left to write the store ({err.strerror}); {what}. "
                f"Every trajectory written before is safe. Free space (or raise the limit), then write again"
            )
        return StoreError(f"{self.directory}: writing the store failed ({err}); {what}")

    def _start_syncer(self) -> None:
        if self._syncer is not None and self._syncer.is_alive():
            return
        ref = weakref.ref(self)  # the thread must not keep a dropped writer alive
        wake, interval = self._wake, self.fsync_interval

        def loop() -> None:
            while not wake.wait(interval):
                writer = ref()
                if writer is None or writer._closed:
                    return
                writer._sync(quiet=True)
                del writer

        self._syncer = threading.Thread(target=loop, name="tokengym-store-fsync", daemon=True)
        self._syncer.start()

    def _sync(self, quiet: bool = False) -> None:
        """fsync the log if anything was appended since the last fsync.

        The fsync runs on a duplicate of the log's descriptor, outside the lock, so writes go on
        meanwhile (and a compaction that closes the log cannot hand its number to another file).
        """
        with self._mutex:
            if not self._dirty or self._log_fd is None:
                return
            fd = os.dup(self._log_fd)
            self._dirty = False
        try:
            os.fsync(fd)
        except OSError as err:
            self._dirty = True
            if not quiet:
                raise self._write_error(err, "the log could not be fsynced") from err
            warnings.warn(f"{self.directory}: fsync of the episode log failed ({err})", StoreWarning, stacklevel=1)
        finally:
            os.close(fd)

    def _table(self, rows: list[dict[str, Any]]) -> pa.Table:
        return rows_table(rows, self.tokenizer_name, self.tokenizer_hash, self._file_meta)

    def _try_compact(self) -> None:
        """Compact inside ``write``: a failure keeps the trajectories in the log and warns; ``write`` succeeded."""
        try:
            self._compact()
        except (OSError, StoreError) as err:
            self._retry_at = len(self._rows) + self.shard_size
            warnings.warn(
                f"{self.directory}: could not write shard {shard_name(self._next_index)} ({err}); its "
                f"{len(self._rows)} trajectories stay safe in the episode log {log_name(self._next_index)} and "
                f"the shard is tried again after {self.shard_size} more writes or at close",
                StoreWarning,
                stacklevel=3,
            )

    def _compact(self) -> Path | None:
        """The log's trajectories as one shard: temp file, fsync, rename, manifest, then the log removed."""
        if self._store_lock is not None:
            self._store_lock.check()
        if not self._rows:
            return None
        table = self._table(self._rows)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression=self.compression, write_page_checksum=True)
        data = sink.getvalue().to_pybytes()
        final = self.directory / shard_name(self._next_index)
        if final.exists():  # another process ignored the lock; never overwrite a shard
            raise StoreError(f"{final} already exists: refusing to overwrite a shard")
        try:
            atomic_write(final, lambda f: f.write(data))
        except OSError as err:
            raise self._write_error(err, f"shard {final.name} was not written") from err
        entry = {"name": final.name, "rows": len(self._rows), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if self._log_id is not None:
            entry["log_id"] = self._log_id  # a copy of the log left behind is then known as one
        self._manifest["shards"] = [*self._manifest["shards"], entry]
        try:
            write_manifest(self.directory, self._manifest)
        except OSError as err:
            # The shard is complete and its log still there: the next writer lists it.
            self._manifest["shards"] = self._manifest["shards"][:-1]
            final.unlink()
            raise self._write_error(err, f"shard {final.name} could not be listed in the manifest") from err
        log = self._log_path
        self._close_log()
        if log is not None:
            log.unlink(missing_ok=True)
        self._next_index += 1
        self.shards_written.append(final)
        self._rows = []
        self._retry_at = self.shard_size
        return final

    def _close_log(self) -> None:
        if self._log_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._log_fd)
            self._log_fd = None
        self._log_path = None
        self._log_id = None
        self._log_size = 0
        self._dirty = False

    def flush(self) -> Path | None:
        """fsync the log and write its trajectories as one complete shard now; return its path
        (None if the log was empty)."""
        with self._mutex:
            if self._closed:
                if self._rows:
                    raise StoreError(f"{self.directory}: the writer is closed")
                return None
            self._sync()
            with uninterrupted():
                return self._compact()

    @property
    def pending(self) -> int:
        """Trajectories in the episode log (durable, readable), not yet in a shard."""
        return len(self._rows)

    @property
    def run(self) -> dict[str, Any] | None:
        """The run settings recorded in the manifest (None when none were given)."""
        return self._manifest.get("run")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed writer accepts nothing more."""
        return self._closed

    def close(self) -> None:
        """Compact the log into a shard and release the directory. Idempotent.

        If the shard cannot be written (disk full), the trajectories stay in the fsynced
        log, readable, and the next writer compacts them; the error says so.
        """
        if self._closed:
            return
        with self._mutex, uninterrupted():
            self._wake.set()
            try:
                self._sync()
                self._compact()
            except (OSError, StoreError) as err:
                n = len(self._rows)
                raise StoreError(
                    f"{err}. The writer is closed; its {n} trajectories since the last shard are safe in the "
                    f"episode log in {self.directory} (readers see them) and the next "
                    "writer on this directory turns them into a shard"
                ) from err
            finally:
                self._closed = True
                self._close_log()
                self._unlock()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The logged trajectories are complete episodes, so they become a shard even when the body raised.
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        n = len(self._rows)
        with contextlib.suppress(Exception):
            self._wake.set()
            if self._log_fd is not None and self._dirty:
                os.fsync(self._log_fd)
        self._closed = True
        self._close_log()
        self._unlock()
        if n:
            warnings.warn(
                f"TrajectoryWriter({str(self.directory)!r}) was dropped without close(): none of its trajectories "
                f"is lost, but {n} of them are still in the episode log {log_name(self._next_index)}, not in a "
                "shard (tokengym readers see them; the next writer on this directory compacts them). Close writers "
                "or use `with`",
                StoreWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return (
            f"TrajectoryWriter({str(self.directory)!r}, tokenizer={self.tokenizer_name!r}, "
            f"shard_size={self.shard_size}, written={self.num_written}, pending={self.pending})"
        )
