"""The runs under a folder and each run's episode index: what the viewer's lists and filters read.

A run is a store (a directory a :class:`~tokengym.recorder.TrajectoryWriter` wrote). Its index
holds a few facts per episode (reward, turns, length, stop and finish reasons, conformance, task,
group, and where its row is), read from the store's small columns only: token ids, masks and
logprobs stay on disk until one episode is opened, so a store of any size lists in pages.
The index is rebuilt when the store's files change (a live writer appended or compacted).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..store import StoreError
from ..store.files import MANIFEST_NAME, log_paths, shard_paths
from ..store.manifest import read_manifest
from ..store.reader import store_batches

__all__ = ["CONFORMANCE_STATES", "EpisodeFilter", "EpisodeIndex", "Run", "find_runs"]

#: What an episode's conformance reads as in the list: the worst of its turns.
CONFORMANCE_STATES = ("ok", "known", "mismatch", "unchecked")

_INDEX_COLUMNS = ["reward", "segments", "stop_reason", "finish_reasons", "conformance_summary", "metadata",
                  "env_id", "seed", "turn_rewards"]
_MAX_DEPTH = 3  # how deep below the folder `tokengym view` looks for stores


def _is_store(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file() or bool(shard_paths(path)) or bool(log_paths(path))


def find_runs(root: str | os.PathLike[str]) -> list[Path]:
    """The stores at ``root`` and below it (``root`` itself when it is one), in name order.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        StoreError: no store is there (the message says what a store is).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory")
    if _is_store(root):
        return [root]
    found: list[Path] = []
    frontier = [root]
    for _ in range(_MAX_DEPTH):
        nxt = []
        for folder in frontier:
            for child in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
                (found if _is_store(child) else nxt).append(child)
        frontier = nxt
    if not found:
        raise StoreError(
            f"{root}: no trajectory store in it or in the {_MAX_DEPTH} levels below (a store is a directory a "
            "TrajectoryWriter or `tokengym rollout --out DIR` wrote)"
        )
    return sorted(found)


def _listing(path: Path) -> tuple[tuple[str, int, int], ...]:
    """The store's files with their sizes and mtimes: when this changes, the index is stale."""
    files = [*shard_paths(path), *log_paths(path), path / MANIFEST_NAME]
    out = []
    for p in files:
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        out.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _conformance_state(summary: str | None) -> str:
    try:
        s = json.loads(summary) if summary else {}
    except json.JSONDecodeError:
        return "unchecked"
    if not isinstance(s, dict) or not s.get("turns_checked"):
        return "unchecked"
    if s.get("mismatch"):
        return "mismatch"
    return "known" if s.get("known") else "ok"


def _task_label(meta: dict[str, Any]) -> str | None:
    """A short name for the episode's task: its id, else its options as compact JSON."""
    if meta.get("task_id") is not None:
        return str(meta["task_id"])
    task = meta.get("task")
    if task is None:
        return None
    text = json.dumps(task, sort_keys=True, separators=(",", ":"), default=str)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class EpisodeFilter:
    """What the episode list shows: every field left ``None`` lets all episodes through."""

    reward_min: float | None = None
    reward_max: float | None = None
    finish: str | None = None
    """A finish reason one of the episode's actions has (``stop``, ``length``, ..., ``unknown``)."""
    stop: str | None = None
    conformance: str | None = None
    """One of :data:`CONFORMANCE_STATES`."""
    task: str | None = None
    group: str | None = None

    @classmethod
    def from_query(cls, query: dict[str, str]) -> EpisodeFilter:
        """From the page's query string; a bad number or an unknown state is a ``ValueError`` naming it."""

        def number(key: str) -> float | None:
            raw = query.get(key, "").strip()
            if not raw:
                return None
            try:
                return float(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not a number") from None

        conf = query.get("conformance") or None
        if conf is not None and conf not in CONFORMANCE_STATES:
            raise ValueError(f"conformance={conf!r}: one of {', '.join(CONFORMANCE_STATES)}")
        return cls(
            reward_min=number("reward_min"), reward_max=number("reward_max"), finish=query.get("finish") or None,
            stop=query.get("stop") or None, conformance=conf, task=query.get("task") or None,
            group=query.get("group") or None,
        )


@dataclass
class EpisodeIndex:
    """One run's episodes, a row each, in the store's order (shards, then the episode logs)."""

    path: Path
    files: list[str] = field(default_factory=list)
    file_of: list[int] = field(default_factory=list)
    row_in_file: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    finish: list[tuple[str, ...]] = field(default_factory=list)
    conformance: list[str] = field(default_factory=list)
    task: list[str | None] = field(default_factory=list)
    group: list[str | None] = field(default_factory=list)
    env_id: list[str | None] = field(default_factory=list)
    seed: list[int | None] = field(default_factory=list)
    _facets: dict[str, dict[str, int]] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, path: Path) -> EpisodeIndex:
        index = cls(path)
        file_number: dict[str, int] = {}
        for batch, file, first in store_batches(path, None, None, _INDEX_COLUMNS, 4096):
            k = file_number.setdefault(file.name, len(index.files))
            if k == len(index.files):
                index.files.append(file.name)
            cols = {name: batch.column(name).to_pylist() for name in _INDEX_COLUMNS}
            for r in range(batch.num_rows):
                segs = cols["segments"][r] or []
                meta = _metadata(cols["metadata"][r])
                index.file_of.append(k)
                index.row_in_file.append(first + r)
                index.reward.append(float(cols["reward"][r]))
                index.tokens.append(int(segs[-1]["end"]) if segs else 0)
                index.turns.append(len(cols["turn_rewards"][r] or []))
                index.stop.append(str(cols["stop_reason"][r] or "none"))
                index.finish.append(tuple(sorted({f or "unknown" for f in (cols["finish_reasons"][r] or [])})))
                index.conformance.append(_conformance_state(cols["conformance_summary"][r]))
                index.task.append(_task_label(meta))
                g = meta.get("group")
                index.group.append(None if g is None else str(g))
                index.env_id.append(cols["env_id"][r])
                index.seed.append(cols["seed"][r])
        return index

    def __len__(self) -> int:
        return len(self.reward)

    def select(self, f: EpisodeFilter) -> np.ndarray:
        """The episodes ``f`` lets through, in store order."""
        keep = np.ones(len(self), dtype=bool)
        reward = np.asarray(self.reward, dtype=np.float64)
        if f.reward_min is not None:
            keep &= reward >= f.reward_min
        if f.reward_max is not None:
            keep &= reward <= f.reward_max
        for want, values in ((f.stop, self.stop), (f.conformance, self.conformance), (f.task, self.task),
                             (f.group, self.group)):
            if want is not None:
                keep &= np.fromiter((v == want for v in values), dtype=bool, count=len(self))
        if f.finish is not None:
            keep &= np.fromiter((f.finish in v for v in self.finish), dtype=bool, count=len(self))
        return np.flatnonzero(keep)

    def row(self, i: int) -> dict[str, Any]:
        """Episode ``i`` as a list row."""
        return {
            "index": i, "reward": self.reward[i], "tokens": self.tokens[i], "turns": self.turns[i],
            "stop_reason": self.stop[i], "finish_reasons": list(self.finish[i]), "conformance": self.conformance[i],
            "task": self.task[i], "group": self.group[i], "env_id": self.env_id[i], "seed": self.seed[i],
        }

    def facets(self) -> dict[str, dict[str, int]]:
        """The values each filter can take, with their episode counts (most common first); counted once."""
        if self._facets is not None:
            return self._facets

        def count(values: Any) -> dict[str, int]:
            c: dict[str, int] = {}
            for v in values:
                if v is not None:
                    c[v] = c.get(v, 0) + 1
            return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))

        self._facets = {
            "stop_reason": count(self.stop), "finish_reason": count(f for fs in self.finish for f in fs),
            "conformance": count(self.conformance), "task": count(self.task), "group": count(self.group),
        }
        return self._facets

    def members(self, group: str) -> list[int]:
        """The episodes of a GRPO group, in store order."""
        return [i for i, g in enumerate(self.group) if g == group]


def _metadata(raw: str | None) -> dict[str, Any]:
    try:
        meta = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {}
    return meta if isinstance(meta, dict) else {}


class Run:
    """A store the viewer shows, with its index (built when first asked for, rebuilt when the store changed)."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self._lock = threading.Lock()
        self._index: EpisodeIndex | None = None
        self._listing: tuple[tuple[str, int, int], ...] | None = None

    def index(self) -> EpisodeIndex:
        with self._lock:
            listing = _listing(self.path)
            if self._index is None or listing != self._listing:
                self._index = EpisodeIndex.build(self.path)
                self._listing = listing
            return self._index

    def refresh(self) -> EpisodeIndex:
        """The index built again (after a file it points to went away: a live writer compacted a log)."""
        with self._lock:
            self._index = None
        return self.index()

    def describe(self) -> dict[str, Any]:
        """Name, folder, tokenizer, the run's settings (when its writer was given them) and episode count."""
        manifest = read_manifest(self.path) or {}
        return {
            "name": self.name, "path": str(self.path), "episodes": len(self.index()),
            "tokenizer": manifest.get("tokenizer_name"), "settings": manifest.get("run"),
        }
