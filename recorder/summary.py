"""What a store holds, in numbers: episodes, tokens, rewards, turns, stop reasons, conformance.

Read from the shards' columns (and the episode logs not yet compacted), never by decoding
trajectories, so summarizing a large store is fast; the terminal summary, the HTML report and
``tokengym rollout --resume`` all read these numbers.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .store import MANIFEST_NAME, SCHEMA_VERSION, StoreError, log_paths, shard_paths
from .store.manifest import read_manifest
from .store.reader import store_batches
from .views import add_tool_stats, printable, tool_calls_line

__all__ = ["Totals", "format_summary", "summarize_store", "summarize_with_totals", "summary_rows"]

_SUMMARY_COLUMNS = [
    "mask",
    "logprobs",
    "turn_rewards",
    "reward",
    "env_id",
    "stop_reason",
    "conformance_summary",
    "finish_reasons",
    "metadata",
    "versions",
]
_CONF_KEYS = ("turns_checked", "ok", "known", "mismatch", "deferred", "episodes_with_mismatch")


# ---------------------------------------------------------------------- summary
class Totals:
    """Running totals of the summary, folded in one record batch at a time."""

    def __init__(self) -> None:
        self.lengths: list[np.ndarray] = []
        self.rewards: list[np.ndarray] = []
        self.turns: list[np.ndarray] = []
        self.policy = 0
        self.with_logprobs = 0
        self.stops: Counter[str] = Counter()
        self.env_ids: Counter[str] = Counter()
        self.behaviours: Counter[str] = Counter()
        self.conf: Counter[str] = Counter(dict.fromkeys(_CONF_KEYS, 0))
        self.finishes: Counter[str] = Counter()
        self.tools: Counter[str] = Counter()
        self.reencoded = 0
        """Episodes whose actions arrived as text and were encoded again (the SkyRL text adapter)."""
        self.versions: Counter[int] = Counter()
        """Policy tokens per weight version (:mod:`tokengym.policies.versions`)."""
        self.spanning = 0
        """Rows whose policy tokens came from more than one weight version."""

    def add(self, batch: pa.RecordBatch) -> None:
        import pyarrow.compute as pc  # imported by a summary, not by ``tokengym --help``

        mask = batch.column("mask")
        self.lengths.append(pc.fill_null(pc.list_value_length(mask), 0).to_numpy(zero_copy_only=False))
        self.policy += int(pc.sum(pc.list_flatten(mask)).as_py() or 0)
        self.with_logprobs += int(pc.count(pc.list_flatten(batch.column("logprobs"))).as_py())
        self.rewards.append(batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float64))
        n_turns = pc.fill_null(pc.list_value_length(batch.column("turn_rewards")), 0)
        self.turns.append(n_turns.to_numpy(zero_copy_only=False))
        self.stops.update("none" if v is None else v for v in batch.column("stop_reason").to_pylist())
        self.env_ids.update("none" if v is None else v for v in batch.column("env_id").to_pylist())
        for row in batch.column("versions").to_numpy(zero_copy_only=False):
            if row is None:
                continue
            known = np.asarray(row)[np.asarray(row) >= 0]
            if known.size:
                values, counts = np.unique(known, return_counts=True)
                self.versions.update(dict(zip(values.tolist(), counts.tolist())))
                self.spanning += len(values) > 1
        for reasons in batch.column("finish_reasons").to_pylist():
            self.finishes.update("unknown" if r is None else r for r in (reasons or ()))
        for raw in batch.column("metadata").to_pylist():
            try:
                meta = json.loads(raw) if raw else {}
                tools = meta.get("tool_stats")
            except (json.JSONDecodeError, AttributeError) as err:
                raise ValueError(f"unreadable metadata ({err})") from err
            add_tool_stats(self.tools, tools)
            self.reencoded += bool(meta.get("reencoded"))
        for raw in batch.column("conformance_summary").to_pylist():
            try:
                c = json.loads(raw) if raw else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"unreadable conformance_summary ({err})") from err
            for key in _CONF_KEYS[:5]:
                self.conf[key] += int(c.get(key, 0))
            self.conf["episodes_with_mismatch"] += bool(c.get("mismatch", 0))
            self.behaviours.update(set(c.get("behaviours", ())))

    @staticmethod
    def _cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0)

    def per_episode(self) -> dict[str, np.ndarray]:
        """``{"reward", "tokens", "turns"}``: one value per episode, in the store's order."""
        return {"reward": self._cat(self.rewards), "tokens": self._cat(self.lengths), "turns": self._cat(self.turns)}

    def result(self) -> dict[str, Any]:
        n_tok, rew, n_turns = self._cat(self.lengths), self._cat(self.rewards), self._cat(self.turns)
        n = len(n_tok)

        def stats(a: np.ndarray, *keys: str) -> dict[str, float | None]:
            fns = {"mean": np.mean, "std": np.std, "min": np.min, "max": np.max}
            return {k: (float(fns[k](a)) if n else None) for k in keys}

        tokens = int(n_tok.sum())
        return {
            "episodes": n,
            "tokens": tokens,
            "policy_tokens": self.policy,
            "context_tokens": tokens - self.policy,
            "policy_tokens_with_logprobs": self.with_logprobs,
            "tokens_per_episode": stats(n_tok, "mean", "min", "max"),
            "reward": stats(rew, "mean", "std", "min", "max"),
            "turns": {"total": int(n_turns.sum()), **stats(n_turns, "mean", "min", "max")},
            "stop_reasons": dict(self.stops.most_common()),
            "finish_reasons": dict(self.finishes.most_common()),
            "tool_calls": dict(self.tools),
            "reencoded_episodes": self.reencoded,
            "versions": {str(k): v for k, v in sorted(self.versions.items())},
            "rows_spanning_versions": self.spanning,
            "env_ids": dict(self.env_ids.most_common()),
            "conformance": {**dict(self.conf), "behaviours": dict(sorted(self.behaviours.items()))},
        }


def summarize_store(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a store holds, read shard by shard (only the small columns; token ids are not read).

    Returns a JSON-ready dict::

        path, shards, in_log (episodes in the episode log, not yet in a shard), schema_version,
        tokenizer_name, tokenizer_hash, vocab_size (None without a manifest),
        episodes, tokens, policy_tokens, context_tokens, policy_tokens_with_logprobs,
        tokens_per_episode  {mean, min, max}
        reward              {mean, std, min, max}      std over episodes (ddof=0); None values when empty
        turns               {total, mean, min, max}
        stop_reasons        {reason: episodes}          most common first; a missing reason is "none"
        finish_reasons      {reason: actions}           why each action's generation stopped (``length``:
                                                        cut at the token limit); "unknown" where not recorded
        tool_calls          {calls, ok, error, timeout, parse_error, ..., invalid, truncated, episodes}:
                            the episodes' ``tool_stats`` summed ({} for envs without tools)
        env_ids             {env id: episodes}          likewise
        conformance         {turns_checked, ok, known, mismatch, deferred, episodes_with_mismatch,
                             behaviours: {name: episodes showing it}}; turns_checked counts
                             ok + known + mismatch, deferred the turns a schedule left to a
                             later check

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        StoreError: not a trajectory store (no manifest and no shard), or one that
            cannot be read: unknown schema version, corrupt shard, shards of two
            tokenizers (its subclasses name the file).
    """
    return summarize_with_totals(path)[0]


def summarize_with_totals(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Totals]:
    """(:func:`summarize_store`'s dict, the totals it was made of: the per-episode values)."""
    root = Path(path)
    shards = shard_paths(root)  # FileNotFoundError when not a directory
    manifest = read_manifest(root)
    if manifest is None and not shards and not log_paths(root):
        raise StoreError(
            f"{root}: not a trajectory store (no {MANIFEST_NAME} and no part-*.parquet shard); "
            "a store is the directory a TrajectoryWriter wrote"
        )
    name = manifest.get("tokenizer_name") if manifest else None
    fingerprint = manifest.get("tokenizer_hash") if manifest else None
    totals = Totals()
    in_log = 0
    for batch, file, _ in store_batches(root, None, None, _SUMMARY_COLUMNS, 1024):
        if name is None or fingerprint is None:
            meta = json.loads((batch.schema.metadata or {}).get(b"tokengym", b"{}"))
            name, fingerprint = name or meta.get("tokenizer_name"), fingerprint or meta.get("tokenizer_hash")
        if file.suffix == ".log":
            in_log += batch.num_rows
        totals.add(batch)
    return {
        "path": str(root),
        "shards": len(shard_paths(root)),
        "in_log": in_log,
        "schema_version": SCHEMA_VERSION,
        "tokenizer_name": name,
        "tokenizer_hash": fingerprint,
        "vocab_size": manifest.get("vocab_size") if manifest else None,
        **totals.result(),
    }, totals


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _counts(d: dict[str, int]) -> str:
    return " · ".join(f"{k} ×{v}" for k, v in d.items()) or "-"


def format_summary(s: dict[str, Any]) -> str:
    """The summary as aligned text lines."""
    rows = summary_rows(s)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {printable(v)}" for k, v in rows)


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (name, value) rows: the lines of :func:`format_summary`, the table of the HTML report."""
    t, r, tu, c = s["tokens_per_episode"], s["reward"], s["turns"], s["conformance"]
    share = f" ({100 * s['policy_tokens'] / s['tokens']:.1f}%)" if s["tokens"] else ""
    fp = (s["tokenizer_hash"] or "")[:12]
    log = f" + {s['in_log']} episodes in the log" if s.get("in_log") else ""
    rows = [
        ("store", f"{s['path']}  ({s['shards']} shard{'s' * (s['shards'] != 1)}{log}, schema v{s['schema_version']})"),
        ("tokenizer", f"{s['tokenizer_name']}  (fingerprint {fp}…)" if fp else str(s["tokenizer_name"])),
        ("episodes", str(s["episodes"])),
        ("env ids", _counts(s["env_ids"])),
        (
            "tokens",
            f"{s['tokens']:,} total · {s['policy_tokens']:,} policy{share} · {s['context_tokens']:,} context"
            f" · per episode mean {_fmt(t['mean'], '.1f')} min {_fmt(t['min'], '.0f')} max {_fmt(t['max'], '.0f')}",
        ),
        ("logprobs", f"{s['policy_tokens_with_logprobs']:,} of {s['policy_tokens']:,} policy tokens"),
        ("reward", f"mean {_fmt(r['mean'])} · std {_fmt(r['std'])} · min {_fmt(r['min'])} · max {_fmt(r['max'])}"),
        (
            "turns",
            f"{tu['total']:,} total · per episode mean {_fmt(tu['mean'], '.2f')}"
            f" min {_fmt(tu['min'], '.0f')} max {_fmt(tu['max'], '.0f')}",
        ),
        ("stop reasons", _counts(s["stop_reasons"])),
        ("finish reasons", _counts(s.get("finish_reasons", {}))),
        (
            "conformance",
            f"{c['turns_checked']} turns checked: {c['ok']} ok · {c['known']} known template behaviour · "
            f"{c['mismatch']} mismatch ({c['episodes_with_mismatch']} episodes)"
            + (
                f" · {c['deferred']} deferred (covered by a later check, at the latest the episode's last turn)"
                if c.get("deferred")
                else ""
            ),
        ),
    ]
    cut = s.get("finish_reasons", {}).get("length")
    if cut:
        rows.append(("cut", f"{cut} actions stopped at the token limit (finish reason 'length'): "
                     "their answers may be incomplete though the episode counts as done"))
    if s.get("tool_calls", {}).get("calls"):
        rows.append(("tool calls", tool_calls_line(s["tool_calls"])))
    versions = s.get("versions") or {}
    if len(versions) > 1 or s.get("rows_spanning_versions"):
        known = sum(versions.values())
        rows.append(("weight versions", f"{len(versions)}: " + " · ".join(f"v{k} {n:,}" for k, n in versions.items())
                     + f" policy tokens ({s['policy_tokens'] - known:,} of unknown version) · "
                     f"{s.get('rows_spanning_versions', 0)} rows span more than one"))
    if s.get("reencoded_episodes"):
        rows.append(("re-encoded", f"{s['reencoded_episodes']} episodes got their actions as text, encoded again "
                     "(not the sampled ids: a trainer may see tokens the policy never produced)"))
    if c["behaviours"]:
        rows.append(("behaviours", _counts(c["behaviours"])))
    return rows


# ----------------------------------------------------------------------- report
