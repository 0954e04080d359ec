"""Whether a writer may continue an existing store, and where: the checks a writer makes when it opens one.

A writer that resumes must not mix tokenizers, schema versions or run settings, must not
overwrite a shard, and must neither lose nor duplicate what a crashed writer left. These checks
decide all of that before the writer writes anything, and name the file (or the setting) that
stops it; :func:`run_differences` says which run settings differ.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .episode_log import Log, read_log
from .errors import CorruptShardError, RunMismatchError, ShardListError, StoreWarning
from .files import TEMP_RE, MANIFEST_NAME, file_index, shard_name, log_paths, shard_paths
from .fingerprint import tokenizer_mismatch
from .log_origin import check_logs, new_id
from .manifest import open_shard, read_manifest, repair_hint, shard_entry
from .schema import FORMAT, SCHEMA_VERSION

__all__ = ["run_differences"]


def _flat_items(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, Mapping):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def run_differences(stored: Mapping[str, Any], asked: Mapping[str, Any]) -> list[str]:
    """``"key: stored X, asked Y"`` for every setting that differs between two run records."""
    a, b = _flat_items(json.loads(json.dumps(stored))), _flat_items(json.loads(json.dumps(asked)))
    return [f"{k}: stored {a.get(k, '(unset)')!r}, asked {b.get(k, '(unset)')!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


@dataclass
class _Resume:
    """Where a writer continues a store."""

    manifest: dict[str, Any]
    """The manifest to write: the shards on disk (checked), this writer's format and run."""
    next_index: int
    """The number of the next shard: after every listed one."""
    pending: list[Log]
    """The episode logs no shard holds yet, in index order: the writer compacts or takes them over."""


def check_resume(
    root: Path, *, tokenizer_name: str, tokenizer_hash: str, vocab_size: int, run: dict[str, Any] | None
) -> _Resume:
    """Check the store at ``root`` for a writer of this tokenizer (and run), and say where it continues.

    The caller holds the store's lock, so what a dead writer left is removed here: temp files, and
    the logs whose shard is listed (their rows are in the shard). Nothing else is written.
    """
    manifest = read_manifest(root)
    if manifest is not None and manifest.get("tokenizer_hash") != tokenizer_hash:
        raise tokenizer_mismatch(
            root / MANIFEST_NAME,
            str(manifest.get("tokenizer_name")),
            str(manifest.get("tokenizer_hash")),
            tokenizer_name,
            tokenizer_hash,
        )
    shards = shard_paths(root)
    for path in shards:
        pf, info = open_shard(path)
        pf.close()
        if info.tokenizer_hash != tokenizer_hash:
            raise tokenizer_mismatch(path, info.tokenizer_name, info.tokenizer_hash, tokenizer_name, tokenizer_hash)
    logs = {file_index(p): p for p in log_paths(root)}
    listed: dict[str, dict[str, Any]] | None = None
    if manifest is not None and isinstance(manifest.get("shards"), list):
        listed = {e["name"]: e for e in manifest["shards"]}
    entries: list[dict[str, Any]] = []
    on_disk = {p.name for p in shards}
    if listed is not None:
        missing = sorted(set(listed) - on_disk)
        if missing:
            raise ShardListError(
                f"{root / missing[0]}: listed in the manifest ({listed[missing[0]]['rows']} trajectories) "
                f"but missing{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; {repair_hint(root)}"
            )
    for path in shards:
        if listed is not None and path.name in listed:
            entry = listed[path.name]
            pf, info = open_shard(path)
            pf.close()
            if info.num_rows != entry["rows"]:
                raise CorruptShardError(
                    f"{path}: {info.num_rows} rows, but the manifest lists {entry['rows']}; {repair_hint(root)}"
                )
            entries.append(entry)
        elif listed is None:  # a store of an older tokengym, or a lost manifest: adopt the shards
            entries.append(shard_entry(path))
        elif file_index(path) in logs:  # killed between the shard's rename and the manifest update
            log = read_log(logs[file_index(path)])
            entry = shard_entry(path)
            if entry["rows"] != len(log.rows):
                raise CorruptShardError(
                    f"{path}: {entry['rows']} rows, but its episode log {log.path.name} holds {len(log.rows)}"
                )
            entries.append(entry)
        else:
            raise ShardListError(
                f"{path}: a shard the manifest does not list (not written by this store's writers); "
                f"move it away, or {repair_hint(root).replace('restore the file, or ', '')}"
            )
    # We hold the lock, so any temp file is a dead writer's unfinished shard or manifest.
    for p in root.iterdir():
        if TEMP_RE.match(p.name):
            p.unlink()
    body = dict(manifest or {})
    body.update(
        format=FORMAT,
        schema_version=SCHEMA_VERSION,
        tokenizer_name=body.get("tokenizer_name", tokenizer_name),
        tokenizer_hash=tokenizer_hash,
        vocab_size=body.get("vocab_size", vocab_size),
        shards=entries,
    )
    stored = sum(e["rows"] for e in entries)
    pending: list[Log] = []
    for index, path in sorted(logs.items()):
        if shard_name(index) in {e["name"] for e in entries}:
            path.unlink()  # its rows are in the shard already
            continue
        log = read_log(path)
        if log.rows and log.meta.get("tokenizer_hash") != tokenizer_hash:
            raise tokenizer_mismatch(
                path, str(log.meta.get("tokenizer_name")), str(log.meta.get("tokenizer_hash")),
                tokenizer_name, tokenizer_hash,
            )
        pending.append(log)
    check_logs(root, manifest, pending)
    body.setdefault("store_id", new_id())
    stored += sum(len(log.rows) for log in pending)
    if run is not None:
        have = body.get("run")
        if have is None and stored:
            raise RunMismatchError(
                f"{root}: holds {stored} trajectories recorded without run settings (by an older tokengym "
                "or a TrajectoryWriter without run=); refusing to mix another run in: use another directory"
            )
        if have is not None and not stored and (diff := run_differences(have, run)):
            # A run that failed before its first episode (a typo in an env argument, say) left only
            # its settings: nothing recorded is mixed, so the corrected run takes the store over.
            warnings.warn(
                f"{root} holds no episode; its run settings ({'; '.join(diff)}) are replaced by this run's",
                StoreWarning, stacklevel=3,
            )
        elif have is not None and (diff := run_differences(have, run)):
            raise RunMismatchError(
                f"{root} was recorded with other run settings: {'; '.join(diff)}. "
                "Use the same settings to continue it, or another directory"
            )
        body["run"] = run
    next_index = max([file_index(root / e["name"]) + 1 for e in entries], default=0)
    return _Resume(body, next_index, pending)
