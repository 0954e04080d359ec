"""``tokengym inspect``: what a trajectory store holds, and one episode's tokens in colour.

``tokengym inspect PATH`` prints what a store holds (episodes, tokens, reward
statistics, turns, stop reasons, chat-template conformance, env ids, tokenizer) and
then one trajectory as the exact token stream the policy saw, decoded segment by
segment (the views of :mod:`tokengym.recorder.views`). ``--html FILE`` writes the same
view as a self-contained HTML page.

In a notebook::

    from tokengym.recorder.inspect import summarize_store
    from tokengym.recorder.views import view
    summarize_store("runs/grpo-0")
    view(traj, tokenizer)          # displays as coloured HTML (``_repr_html_``)

The views are importable from here too (``from tokengym.recorder.inspect import view``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .store import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    StoreError,
    accept_shards,
    log_paths,
    shard_paths,
)
from .store.manifest import _read_manifest
from .store.reader import _store_batches
from . import views as _views
from .trajectory import Trajectory
from .views import (
    ANSI_COLORS,
    HTML_COLORS,
    TrajectoryView,
    render_legend_text,
    render_trajectory_html,
    render_trajectory_text,
    render_turn_table,
    segment_texts,
    strip_ansi,
    view,
)

__all__ = [
    "add_inspect_parser",
    "cmd_inspect",
    "format_summary",
    "main",
    "summarize_store",
    # and the views (tokengym.recorder.views), importable from here as before
    *_views.__all__,
]

_SUMMARY_COLUMNS = [
    "mask",
    "logprobs",
    "turn_rewards",
    "reward",
    "env_id",
    "stop_reason",
    "conformance_summary",
]
_CONF_KEYS = ("turns_checked", "ok", "known", "mismatch", "deferred", "episodes_with_mismatch")


# ---------------------------------------------------------------------- summary
class _Totals:
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
    root = Path(path)
    shards = shard_paths(root)  # FileNotFoundError when not a directory
    manifest = _read_manifest(root)
    if manifest is None and not shards and not log_paths(root):
        raise StoreError(
            f"{root}: not a trajectory store (no {MANIFEST_NAME} and no part-*.parquet shard); "
            "a store is the directory a TrajectoryWriter wrote"
        )
    name = manifest.get("tokenizer_name") if manifest else None
    fingerprint = manifest.get("tokenizer_hash") if manifest else None
    totals = _Totals()
    in_log = 0
    for batch, file, _ in _store_batches(root, None, None, _SUMMARY_COLUMNS, 1024):
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
    }


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _counts(d: dict[str, int]) -> str:
    return " · ".join(f"{k} ×{v}" for k, v in d.items()) or "-"


def format_summary(s: dict[str, Any]) -> str:
    """The summary as aligned text lines."""
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
    if c["behaviours"]:
        rows.append(("behaviours", _counts(c["behaviours"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


# -------------------------------------------------------------------------- CLI
def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``inspect`` sub-command to ``parser.add_subparsers(...)``; returns its parser."""
    p = subparsers.add_parser(
        "inspect",
        help="summarize a trajectory store and show one episode's tokens",
        description=(
            "Summarize a trajectory store (episodes, tokens, rewards, turns, stop reasons, conformance) and show "
            "one episode: policy tokens (mask 1) in green, prompt in grey, observations (mask 0) in blue."
        ),
    )
    p.add_argument("path", help="the store directory (written by TrajectoryWriter or tokengym rollout)")
    p.add_argument("--episode", type=int, default=0, metavar="N", help="which episode to show (-1 = last)")
    p.add_argument(
        "--tokenizer",
        help="for decoding: local folder, pinned name or hub name (default: the store's tokenizer when pinned)",
    )
    p.add_argument("--no-color", action="store_true", help="no ANSI colours (also: NO_COLOR=1)")
    p.add_argument("--html", metavar="FILE", help="also write the episode as a self-contained HTML page")
    p.add_argument(
        "--accept-shards",
        action="store_true",
        help="make the manifest list the shards on disk: accept a deleted shard as lost, or a shard put there by hand",
    )
    p.set_defaults(func=cmd_inspect)
    return p


def _use_color(args: argparse.Namespace) -> bool:
    if args.no_color or os.environ.get("NO_COLOR"):
        return False
    return bool(os.environ.get("FORCE_COLOR")) or sys.stdout.isatty()


@functools.lru_cache(maxsize=4)
def _load_tokenizer(spec: str) -> Any:
    """``load_tokenizer(spec)``, once per process (loading and fingerprinting take a second or two)."""
    from tokengym.envs import load_tokenizer

    return load_tokenizer(spec)


def _decoding_tokenizer(args: argparse.Namespace, summary: dict[str, Any]) -> tuple[Any, str | None]:
    """(tokenizer or None, a note for the user). Only pinned or packaged names are loaded implicitly (no network)."""
    from tokengym.envs.tokenizers import is_offline_name

    from .store import tokenizer_fingerprint

    spec = args.tokenizer
    if spec is None:
        name = summary["tokenizer_name"]
        if not (name and is_offline_name(name)):
            return None, (
                f"the store's tokenizer {name!r} is not a pinned or packaged name; pass --tokenizer to decode the tokens"
            )
        try:
            tok = _load_tokenizer(name)
        except (OSError, RuntimeError, ValueError, ImportError) as err:  # e.g. not cached and no way to fetch it
            return None, f"could not load the tokenizer {name!r} ({err}); pass --tokenizer to decode"
        spec = name
    else:
        tok = _load_tokenizer(spec)
    note = None
    want = summary["tokenizer_hash"]
    if want and tokenizer_fingerprint(tok) != want:
        note = (
            f"warning: tokenizer {spec!r} has another fingerprint than the store's ({want[:12]}…): "
            "another vocabulary or chat template; the text below may not be what the policy saw"
        )
    return tok, note


def _pick(path: str, index: int, total: int) -> Trajectory:
    from .store import read_trajectories

    if not -total <= index < total:
        raise IndexError(f"--episode {index} is out of range: the store holds {total} episodes")
    index %= total
    for i, traj in enumerate(read_trajectories(path)):
        if i == index:
            return traj
    raise StoreError(f"{path}: episode {index} not found")  # pragma: no cover - summary and shards disagree


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``tokengym inspect``. Exit status: 0 shown; 2 not a readable store, bad ``--episode``,
    tokenizer that cannot be loaded, or an ``--html`` file that cannot be written (message on stderr)."""
    try:
        if getattr(args, "accept_shards", False):
            changes = accept_shards(args.path)
            for what, names in (("dropped from", changes["dropped"]), ("added to", changes["added"])):
                for name in names:
                    print(f"accepted: {name} {what} the manifest")
            if not (changes["dropped"] or changes["added"]):
                print("accepted: the manifest already listed exactly the shards on disk")
        summary = summarize_store(args.path)
        print(format_summary(summary))
        if summary["episodes"] == 0:
            print("\nthe store holds no episodes yet")
            if args.html:
                raise StoreError("--html: the store holds no episode to show")
            return 0
        traj = _pick(args.path, args.episode, summary["episodes"])
        index = args.episode % summary["episodes"]
        tok, note = _decoding_tokenizer(args, summary)
        m = traj.mask
        print(
            f"\nepisode {index} of {summary['episodes']}: env {traj.env_id} · seed {traj.seed} · "
            f"{len(traj):,} tokens "
            f"({int(m.sum()):,} policy, {int((m == 0).sum()):,} context) · {traj.num_turns} turns · "
            f"reward {traj.reward:.4g} · stop reason {traj.stop_reason}"
        )
        if note:
            print(note, file=sys.stderr)
        if tok is not None and traj.token_ids.size and int(traj.token_ids.max()) >= len(tok):
            raise ValueError(
                f"episode {index} has token id {int(traj.token_ids.max())}, outside the {len(tok)} ids of the "
                "decoding tokenizer: pass the tokenizer the store was written with (--tokenizer)"
            )
        if tok is None:
            if args.html:
                raise ValueError(f"--html needs a tokenizer to decode the tokens: {note}")
        else:
            color = _use_color(args)
            print(render_legend_text(color) + "\n")
            print(render_trajectory_text(traj, tok, color=color, escape_controls=True))
        print()
        print(render_turn_table(traj))
        if args.html:
            out = Path(args.html)
            out.write_text(render_trajectory_html(traj, tok, document=True), encoding="utf-8")
            print(f"\nwrote {out}")
        return 0
    except BrokenPipeError:  # e.g. `tokengym inspect runs/x | head`
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (StoreError, OSError, IndexError, KeyError, ValueError, RuntimeError) as err:
        # FileNotFoundError is an OSError; TokenizerFetchError a RuntimeError.
        print(f"tokengym inspect: error: {err}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tokengym.recorder.inspect PATH ...`` (the same as ``tokengym inspect``)."""
    parser = argparse.ArgumentParser(prog="tokengym")
    add_inspect_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["inspect", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
