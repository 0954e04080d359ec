"""Reading a store back: every trajectory whose ``write`` returned, from the shards and then the episode logs.

Readers may run while a writer compacts: a listing that disagrees with the manifest for a moment
is looked at again before it is an error. They refuse, naming the file, whatever a writer would
refuse (another tokenizer, an unknown schema version, a corrupt or unlisted shard).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..trajectory import Trajectory
from .episode_log import Log, read_log
from .errors import CorruptShardError, ShardListError, StoreError
from .files import MANIFEST_NAME, file_index, log_paths, shard_paths
from .fingerprint import display_name, tokenizer_mismatch, tokenizer_fingerprint
from .log_origin import check_logs
from .manifest import open_shard, read_manifest, repair_hint, ShardInfo
from .rows import decode_batch, rows_table
from .schema import METADATA_KEY, SCHEMA, SCHEMA_VERSION, schema_of, upgrade_batch

__all__ = ["read_table", "read_trajectories", "store_counts"]


@dataclass
class _Snapshot:
    """What a reader sees: the manifest, the shards to read, and the logs' rows (read in full)."""

    root: Path
    manifest: dict[str, Any] | None
    shards: list[Path]
    logs: list[Log]
    want: tuple[str, str] | None


def _snapshot(directory: str | os.PathLike[str], tokenizer: Any, chat_template: Any) -> _Snapshot:
    """The store's shards and logs, checked against the manifest's shard list.

    A live writer may compact while we look (rename a shard, list it, remove its log): a
    listing that disagrees with the manifest, or a log that vanished, is looked at again
    before it counts as an error. A log is read whole here, so it cannot vanish later.
    """
    root = Path(directory)
    want = None
    if tokenizer is not None:
        want = (display_name(tokenizer), tokenizer_fingerprint(tokenizer, chat_template))
    for attempt in range(5):
        try:
            return _snapshot_once(root, want)
        except (ShardListError, FileNotFoundError):
            if attempt == 4 or not root.is_dir():
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _snapshot_once(root: Path, want: tuple[str, str] | None) -> _Snapshot:
    manifest = read_manifest(root)
    shards = shard_paths(root)  # FileNotFoundError when not a directory
    logs = {file_index(p): p for p in log_paths(root)}
    if want is not None and manifest is not None and manifest.get("tokenizer_hash") != want[1]:
        raise tokenizer_mismatch(
            root / MANIFEST_NAME, str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")), *want
        )
    if manifest is not None and isinstance(manifest.get("shards"), list):
        listed = {e["name"]: e for e in manifest["shards"]}
        on_disk = {p.name for p in shards}
        for name, entry in listed.items():
            if name not in on_disk:
                raise ShardListError(
                    f"{root / name}: listed in the manifest ({entry['rows']} trajectories) but missing; "
                    f"{repair_hint(root)}"
                )
        for p in shards:
            if p.name not in listed and file_index(p) not in logs:
                raise ShardListError(
                    f"{p}: a shard the manifest does not list (not written by this store's writers); move it "
                    f"away, or {repair_hint(root).replace('restore the file, or ', '')}"
                )
    shard_index = {file_index(p) for p in shards}
    read = [read_log(p) for i, p in sorted(logs.items()) if i not in shard_index]  # FileNotFoundError: compacted
    if manifest is not None and want is None:
        want = (str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")))
    check_logs(root, manifest, read)
    return _Snapshot(root, manifest, shards, [log for log in read if log.rows], want)


def _shard_sources(snap: _Snapshot) -> Iterator[tuple[pq.ParquetFile, ShardInfo]]:
    """Open each shard in order, checking schema version, tokenizer and listed row count."""
    listed = None
    if snap.manifest is not None and isinstance(snap.manifest.get("shards"), list):
        listed = {e["name"]: e for e in snap.manifest["shards"]}
    want = snap.want
    for path in snap.shards:
        pf, info = open_shard(path)
        if want is None:
            want = (info.tokenizer_name, info.tokenizer_hash)
        elif info.tokenizer_hash != want[1]:
            pf.close()
            raise tokenizer_mismatch(path, info.tokenizer_name, info.tokenizer_hash, *want)
        entry = (listed or {}).get(path.name)
        if entry is not None and entry["rows"] != info.num_rows:
            pf.close()
            raise CorruptShardError(
                f"{path}: corrupt or replaced: {info.num_rows} rows, but the manifest lists {entry['rows']}; "
                f"{repair_hint(snap.root)}"
            )
        yield pf, info
    snap.want = want


def log_table(log: Log, rows: list[dict[str, Any]] | None = None) -> pa.Table:
    """A log's records (or ``rows`` of them) as a table of the schema, with a shard's metadata."""
    name, fingerprint = str(log.meta.get("tokenizer_name")), str(log.meta.get("tokenizer_hash"))
    meta = {METADATA_KEY: json.dumps({"schema_version": SCHEMA_VERSION, "tokenizer_name": name, "tokenizer_hash": fingerprint}).encode()}
    try:
        return rows_table(log.rows if rows is None else rows, name, fingerprint, meta)
    except (pa.ArrowException, ValueError, KeyError, TypeError) as err:
        raise CorruptShardError(f"{log.path}: a record does not fit the schema ({err})") from err


def _log_tables(snap: _Snapshot) -> Iterator[tuple[pa.Table, Path]]:
    for log in snap.logs:
        name, fingerprint = str(log.meta.get("tokenizer_name")), str(log.meta.get("tokenizer_hash"))
        if snap.want is not None and fingerprint != snap.want[1]:
            raise tokenizer_mismatch(log.path, name, fingerprint, *snap.want)
        yield log_table(log), log.path


def store_batches(
    directory: str | os.PathLike[str],
    tokenizer: Any,
    chat_template: Any,
    columns: list[str] | None,
    batch_size: int,
) -> Iterator[tuple[pa.RecordBatch, Path, int]]:
    """``(batch, file, first row of the batch in that file)`` over the shards, then the episode logs."""
    snap = _snapshot(directory, tokenizer, chat_template)
    for pf, info in _shard_sources(snap):
        with pf:
            try:
                first = 0
                want = columns if columns is not None else SCHEMA.names
                have = [c for c in want if c in schema_of(info.schema_version).names]
                for batch in pf.iter_batches(batch_size=batch_size, columns=have):
                    yield (batch if have == want else upgrade_batch(batch, want)), info.path, first
                    first += batch.num_rows
            except StoreError:
                raise
            except (OSError, pa.ArrowException, ValueError) as err:
                raise CorruptShardError(f"{info.path}: corrupt shard ({err})") from err
    for table, path in _log_tables(snap):
        first = 0
        for batch in table.select(columns if columns is not None else SCHEMA.names).to_batches(max_chunksize=batch_size):
            yield batch, path, first
            first += batch.num_rows


def read_table(
    directory: str | os.PathLike[str],
    *,
    columns: list[str] | None = None,
    tokenizer: Any = None,
    chat_template: str | None = None,
) -> pa.Table:
    """All shards and the episode log as one :class:`pyarrow.Table` (the schema in :mod:`tokengym.recorder.store`'s docstring).

    Args:
        columns: read only these columns (faster for e.g. ``["reward", "env_id"]``).
        tokenizer: when given, refuse a store of another tokenizer.
    """
    batches = [b for b, _, _ in store_batches(directory, tokenizer, chat_template, columns, 1 << 16)]
    schema = SCHEMA if columns is None else pa.schema([SCHEMA.field(c) for c in columns])
    if not batches:
        return schema.empty_table()
    return pa.Table.from_batches([b.cast(schema) if b.schema != schema else b for b in batches], schema=schema)


def read_trajectories(
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    chat_template: str | None = None,
    batch_size: int = 64,
) -> Iterator[Trajectory]:
    """Yield the store's trajectories in write order (shard by shard, then the episode log) as exact
    :class:`Trajectory` objects: every trajectory whose ``write`` returned.

    Streams: at most ``batch_size`` rows are decoded at a time. Each row is checked
    (segments cover the tokens, mask agrees with segment kinds, one reward per turn); a
    shard that fails raises :class:`CorruptShardError` naming it.

    Args:
        tokenizer: when given, refuse a store of another tokenizer.
    """
    for batch, path, first in store_batches(directory, tokenizer, chat_template, SCHEMA.names, batch_size):
        try:
            yield from decode_batch(batch, path, first)
        except StoreError:
            raise
        except (OSError, pa.ArrowException, ValueError) as err:
            raise CorruptShardError(f"{path}: corrupt shard ({err})") from err


def store_counts(directory: str | os.PathLike[str]) -> dict[str, int]:
    """``{"shards", "shard_rows", "log_rows"}``: how much of the store is compacted and how much is in the log."""
    snap = _snapshot(directory, None, None)
    rows = 0
    for pf, info in _shard_sources(snap):
        pf.close()
        rows += info.num_rows
    return {"shards": len(snap.shards), "shard_rows": rows, "log_rows": sum(len(log.rows) for log in snap.logs)}
