"""``tokengym inspect``: what a trajectory store holds, and one episode's tokens in colour.

``tokengym inspect PATH`` prints what a store holds (episodes, tokens, reward
statistics, turns, stop reasons, chat-template conformance, env ids, tokenizer) and
then one trajectory as the exact token stream the policy saw, decoded segment by
segment (the views of :mod:`tokengym.recorder.views`). ``--html FILE`` writes a report
as one self-contained page (:mod:`tokengym.recorder.report`): the summary, histograms of
rewards and of episode lengths, and a few episodes in colour.

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
    "REPORT_EPISODES",
    "add_inspect_parser",
    "cmd_inspect",
    "format_summary",
    "main",
    "report_picks",
    "store_report",
    "summarize_store",
    "summary_rows",
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
    return _summarize(path)[0]


def _summarize(path: str | os.PathLike[str]) -> tuple[dict[str, Any], _Totals]:
    """(:func:`summarize_store`'s dict, the totals it was made of: the per-episode values)."""
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
    }, totals


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _counts(d: dict[str, int]) -> str:
    return " · ".join(f"{k} ×{v}" for k, v in d.items()) or "-"


def format_summary(s: dict[str, Any]) -> str:
    """The summary as aligned text lines."""
    rows = summary_rows(s)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


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
    return rows


# ----------------------------------------------------------------------- report
REPORT_EPISODES = 3
"""Episodes the HTML report shows in full by default: the one asked for, the highest and the lowest reward."""


def report_picks(per_episode: dict[str, np.ndarray], episode: int = 0, show: int = REPORT_EPISODES) -> list[tuple[int, str]]:
    """Which episodes the report shows, and why: ``episode`` (negative counts from the end), then
    the highest and the lowest reward, the longest and the shortest, then the store's order;
    ``show`` distinct episodes in all (fewer when the store has fewer). An episode picked for two
    reasons is shown once, with both."""
    rewards, tokens = per_episode["reward"], per_episode["tokens"]
    n = len(rewards)
    if not -n <= episode < n:
        raise IndexError(f"--episode {episode} is out of range: the store holds {n} episodes")
    if show < 1:
        raise ValueError(f"the report shows at least one episode, not {show}")
    candidates = [
        (episode % n, "the one asked for" if episode else "the first in the store"),
        (int(np.argmax(rewards)), f"highest reward ({rewards.max():.4g})"),
        (int(np.argmin(rewards)), f"lowest reward ({rewards.min():.4g})"),
        (int(np.argmax(tokens)), f"longest ({int(tokens.max()):,} tokens)"),
        (int(np.argmin(tokens)), f"shortest ({int(tokens.min()):,} tokens)"),
        *((i, "next in the store") for i in range(n)),
    ]
    picks: dict[int, list[str]] = {}
    for index, why in candidates:
        if index in picks:
            if why != "next in the store":
                picks[index].append(why)
        elif len(picks) < show:
            picks[index] = [why]
    return [(index, "; ".join(whys)) for index, whys in picks.items()]


def _read_episodes(path: str | os.PathLike[str], indices: set[int]) -> dict[int, Trajectory]:
    """The store's episodes at ``indices`` (one pass, stopping after the last one wanted)."""
    from .store import read_trajectories

    found: dict[int, Trajectory] = {}
    for i, traj in enumerate(read_trajectories(path)):
        if i in indices:
            found[i] = traj
            if len(found) == len(indices):
                break
    missing = sorted(indices - found.keys())
    if missing:  # pragma: no cover - the summary and the shards disagree
        raise StoreError(f"{path}: episodes {missing} not found")
    return found


def _check_ids(traj: Trajectory, index: int, tok: Any) -> None:
    if traj.token_ids.size and int(traj.token_ids.max()) >= len(tok):
        raise ValueError(
            f"episode {index} has token id {int(traj.token_ids.max())}, outside the {len(tok)} ids of the "
            "decoding tokenizer: pass the tokenizer the store was written with (--tokenizer)"
        )


def _report(
    summary: dict[str, Any], totals: _Totals, tok: Any, *, episode: int, show: int, document: bool
) -> str:
    from .report import render_store_report

    if summary["episodes"] == 0:
        raise StoreError(f"{summary['path']}: the store holds no episode to show in a report")
    per = totals.per_episode()
    picks = report_picks(per, episode, show)
    trajs = _read_episodes(summary["path"], {i for i, _ in picks})
    for i, _ in picks:
        _check_ids(trajs[i], i, tok)
    return render_store_report(
        summary_rows(summary), per["reward"], per["tokens"], per["turns"],
        [(i, why, trajs[i]) for i, why in picks], tok,
        title=f"tokengym store {summary['path']}", document=document,
    )


def store_report(
    path: str | os.PathLike[str],
    tokenizer: Any,
    *,
    episode: int = 0,
    show: int = REPORT_EPISODES,
    document: bool = True,
) -> str:
    """The store as one self-contained HTML page (what ``tokengym inspect PATH --html FILE`` writes):
    the summary, histograms of rewards and of lengths in tokens and turns (inline SVG), and
    ``show`` episodes in colour (see :func:`report_picks`). ``document=False`` gives a fragment
    for a notebook cell (``IPython.display.HTML(...)``).

    Args:
        tokenizer: decodes the shown episodes (a tokenizer, a ChatRenderer or a name for ``load_tokenizer``).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
        StoreError: not a readable store, or one with no episode yet.
        IndexError: ``episode`` out of range.
        ValueError: an episode has ids outside the tokenizer's vocabulary.
    """
    summary, totals = _summarize(path)
    return _report(summary, totals, _views._hf_tokenizer(tokenizer), episode=episode, show=show, document=document)


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
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write a report as one self-contained HTML page (inline SVG and CSS, no scripts): the summary, "
        "histograms of rewards and of episode lengths in tokens and turns, and a few episodes in colour",
    )
    p.add_argument(
        "--html-episodes",
        type=int,
        default=REPORT_EPISODES,
        metavar="K",
        help=f"episodes the report shows in full (default {REPORT_EPISODES}): the one --episode names, the highest and "
        "lowest reward, the longest and shortest, then the store's order",
    )
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
        summary, totals = _summarize(args.path)
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
        if tok is not None:
            _check_ids(traj, index, tok)
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
            page = _report(summary, totals, tok, episode=args.episode, show=args.html_episodes, document=True)
            out.write_text(page, encoding="utf-8")
            shown = min(args.html_episodes, summary["episodes"])
            print(f"\nwrote {out}: the summary, histograms of rewards and lengths, {shown} episodes in colour")
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
