"""The manifest (``.tokengym.json``) and the shards it lists: reading and writing it, opening one
shard with its checks, and :func:`accept_shards`, which makes the list match the disk.

The manifest is how a store knows its shards, so a missing, extra or replaced shard is an error
that names the file (with the repair in :func:`repair_hint`), never a silent loss or a duplicate.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import CorruptShardError, StoreError
from .files import MANIFEST_NAME, atomic_write, shard_paths
from .lock import StoreLock
from .fingerprint import tokenizer_mismatch
from .schema import FORMAT, METADATA_KEY, check_version, schema_of


__all__ = ["accept_shards"]


def read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: unreadable manifest ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{path}: not a tokengym trajectory store manifest")
    check_version(manifest.get("schema_version"), path)
    return manifest


def shard_entry(path: Path, data: bytes | None = None, rows: int | None = None) -> dict[str, Any]:
    """A manifest entry: name, rows, bytes and sha256 of a shard (read from disk unless given)."""
    if data is None:
        data = path.read_bytes()
    if rows is None:
        pf, info = open_shard(path)
        pf.close()
        rows = info.num_rows
    return {"name": path.name, "rows": rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(root: Path, body: dict[str, Any]) -> None:
    text = json.dumps(body, indent=2).encode() + b"\n"
    atomic_write(root / MANIFEST_NAME, lambda f: f.write(text))


def repair_hint(root: Path) -> str:
    return (
        f"restore the file, or accept the store as it is on disk with `tokengym inspect {root} --accept-shards` "
        "(tokengym.recorder.store.accept_shards)"
    )


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    schema_version: int
    tokenizer_name: str
    tokenizer_hash: str
    num_rows: int


def open_shard(path: Path) -> tuple[pq.ParquetFile, ShardInfo]:
    """Open a shard and check its footer, its tokengym metadata and its schema version."""
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        kv = pf.schema_arrow.metadata or {}
    except (OSError, pa.ArrowException, ValueError) as err:
        raise CorruptShardError(f"{path}: corrupt or truncated shard, not a readable Parquet file ({err})") from err
    try:
        raw = kv.get(METADATA_KEY)
        try:
            meta = json.loads(raw) if raw is not None else None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptShardError(f"{path}: unreadable tokengym metadata ({err})") from err
        if not isinstance(meta, dict):
            raise CorruptShardError(f"{path}: a Parquet file without tokengym metadata, not a trajectory shard")
        check_version(meta.get("schema_version"), path)
        have = pf.schema_arrow
        wrong = [
            f.name for f in schema_of(meta["schema_version"]) if f.name not in have.names or have.field(f.name).type != f.type
        ]
        if wrong:
            raise CorruptShardError(f"{path}: columns missing or of another type than the schema's: {wrong}")
    except BaseException:
        pf.close()
        raise
    info = ShardInfo(
        path=path,
        schema_version=int(meta["schema_version"]),
        tokenizer_name=str(meta.get("tokenizer_name")),
        tokenizer_hash=str(meta.get("tokenizer_hash")),
        num_rows=pf.metadata.num_rows,
    )
    return pf, info


def accept_shards(directory: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Make the manifest list exactly the shards on disk: accept a known loss (a deleted shard)
    or shards put there by hand. Every shard must still be a readable shard of the store's tokenizer.

    Needs the store's lock (no live writer). Returns ``{"dropped": [...], "added": [...]}``:
    ``"NAME (N trajectories)"`` for each listed shard that was missing and each shard that was not listed.
    """
    root = Path(directory)
    manifest = read_manifest(root)
    if manifest is None:
        raise StoreError(f"{root}: no manifest ({MANIFEST_NAME}): not a trajectory store, nothing to accept")
    held = StoreLock(root, f"{root}: a TrajectoryWriter is writing to this store; close it first")
    try:
        listed = {e["name"]: e for e in manifest.get("shards") or []}
        entries, added = [], []
        for path in shard_paths(root):
            pf, info = open_shard(path)
            pf.close()
            if info.tokenizer_hash != manifest.get("tokenizer_hash"):
                raise tokenizer_mismatch(
                    path, info.tokenizer_name, info.tokenizer_hash,
                    str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")),
                )
            if path.name in listed and listed[path.name]["rows"] == info.num_rows:
                entries.append(listed[path.name])
                continue
            entries.append(shard_entry(path, rows=info.num_rows))
            added.append(f"{path.name} ({info.num_rows} trajectories)")
        kept = {e["name"] for e in entries}
        dropped = [f"{n} ({e['rows']} trajectories)" for n, e in listed.items() if n not in kept]
        write_manifest(root, {**manifest, "shards": entries})
        return {"dropped": dropped, "added": added}
    finally:
        held.release()
