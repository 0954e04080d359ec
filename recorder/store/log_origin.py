"""Whether an episode log is this store's own: what keeps a copied, foreign or doubled log out.

A log's header names the store it was written for (``store_id``, made with the store's manifest),
the run settings it was written under (``run_hash``) and the log itself (``log_id``, which the shard
made from it keeps in the manifest); each record has an id of its own. A log copied in from another
store or run, a copy of a log (or of one a shard already holds) and a record written twice are
refused by name before a writer compacts them into a shard or a reader returns them: adopted, they
would mix another run's episodes into this one, or count one episode twice, and nothing would say
so. Logs of an older tokengym carry none of these and are read as before.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .episode_log import Log
from .errors import ForeignLogError
from .files import file_index, shard_name

__all__ = ["check_logs", "new_id", "run_hash"]


def new_id() -> str:
    """A random id for a store or a log."""
    return secrets.token_hex(8)


def run_hash(run: Mapping[str, Any] | None) -> str | None:
    """A short hash of a store's run settings (``None`` for none), as log headers carry it."""
    if run is None:
        return None
    return hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_logs(root: Path, manifest: Mapping[str, Any] | None, logs: Sequence[Log]) -> None:
    """Raise :class:`ForeignLogError` for the first log (with records) that is not this store's own.

    ``logs`` are the store's uncompacted logs in index order; ``manifest`` is the store's (its
    ``store_id``, ``run`` and the shards' ``log_id``); a store without a manifest checks only that
    no record is there twice.
    """
    move = "move it out of the store (its records are not read or compacted while it is there)"
    seen: dict[str, tuple[Path, int]] = {}
    compacted: dict[str, str] = {}
    if manifest is not None:
        for entry in manifest.get("shards") or ():
            if isinstance(entry, Mapping) and entry.get("log_id"):
                compacted[str(entry["log_id"])] = str(entry["name"])
    for log in logs:
        if not log.rows:
            continue
        meta = log.meta
        if manifest is not None and meta.get("store_id") and manifest.get("store_id"):
            if meta["store_id"] != manifest["store_id"]:
                raise ForeignLogError(
                    f"{log.path}: an episode log of another store (store {meta['store_id']}; this is store "
                    f"{manifest['store_id']}), copied in: {len(log.rows)} trajectories of another run; {move}"
                )
        if manifest is not None and "run_hash" in meta and meta["run_hash"] != run_hash(manifest.get("run")):
            raise ForeignLogError(
                f"{log.path}: an episode log written under other run settings than this store's "
                f"({len(log.rows)} trajectories); {move}"
            )
        shard = compacted.get(str(meta.get("log_id")))
        if shard is not None and shard != shard_name(file_index(log.path)):
            raise ForeignLogError(
                f"{log.path}: a copy of the log that became {shard}: its {len(log.rows)} trajectories are "
                f"in that shard already; {move}"
            )
        for rid, offset in zip(log.rids, log.offsets):
            if rid is None:
                continue
            if rid in seen:
                first, at = seen[rid]
                where = "earlier in this log" if first == log.path else f"in {first.name}"
                raise ForeignLogError(
                    f"{log.path}: the record at byte {offset} is the record at byte {at} {where} again (a "
                    f"record written twice, or a copied log); one trajectory would be counted twice: "
                    f"move the copy away, or keep a copy of the file and cut it at byte {offset} "
                    f"(truncate -s {offset} {log.path.name}) when the repeats are at its end"
                )
            seen[rid] = (log.path, offset)
