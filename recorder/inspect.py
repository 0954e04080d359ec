"""Look inside a trajectory store: a summary, and one episode's tokens in colour.

``tokengym inspect PATH`` prints what a store holds (episodes, tokens, reward
statistics, turns, stop reasons, chat-template conformance, env ids, tokenizer) and
then one trajectory as the exact token stream the policy saw, decoded segment by
segment: policy tokens (mask 1) in green, the prompt in grey and observation tokens
(mask 0) in blue, with a badge at the start of every turn. ``--html FILE`` writes the
same view as a self-contained HTML page.

In a notebook::

    from tokengym.recorder.inspect import summarize_store, view
    summarize_store("runs/grpo-0")
    view(traj, tokenizer)          # displays as coloured HTML (``_repr_html_``)

The text view is plain ANSI (no terminal library needed). With the badges left out
(``markers=False``) and the colour codes stripped, it is exactly
``tokenizer.decode(traj.token_ids, skip_special_tokens=False)``: nothing is re-rendered
or hidden, special tokens included.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from .segments import SegmentKind
from .store import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    StoreError,
    _read_manifest,
    _store_batches,
    accept_shards,
    log_paths,
    shard_paths,
)
from .trajectory import Trajectory

__all__ = [
    "ANSI_COLORS",
    "HTML_COLORS",
    "TrajectoryView",
    "add_inspect_parser",
    "cmd_inspect",
    "render_trajectory_html",
    "render_trajectory_text",
    "strip_ansi",
    "summarize_store",
    "view",
]

#: SGR codes of the text view, per segment kind (and for the turn badges).
ANSI_COLORS = {"prompt": "90", "action": "32", "observation": "34", "turn": "30;43"}
#: Text colours of the HTML view, per segment kind (and for the turn badges' background).
HTML_COLORS = {"prompt": "#6b7280", "action": "#15803d", "observation": "#1d4ed8", "turn": "#fde68a"}

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
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


def strip_ansi(text: str) -> str:
    """``text`` without ANSI colour codes."""
    return _ANSI_RE.sub("", text)


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


# -------------------------------------------------------------------- rendering
def _hf_tokenizer(tokenizer: Any) -> Any:
    """An object with ``decode``: a tokenizer, a ChatRenderer's tokenizer, or one loaded by name."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from tokengym.envs import load_tokenizer

        return load_tokenizer(tokenizer)
    inner = getattr(tokenizer, "tokenizer", None)  # a ChatRenderer
    if not hasattr(tokenizer, "decode") and inner is not None:
        return inner
    if not hasattr(tokenizer, "decode"):
        raise TypeError(f"expected a tokenizer with decode(), got {type(tokenizer).__name__}")
    return tokenizer


def segment_texts(traj: Trajectory, tokenizer: Any) -> list[str]:
    """The decoded text of each segment; their concatenation is the decode of the whole stream.

    Segments are decoded one by one; if a character's bytes straddle a segment boundary
    (a byte-level token split), the boundary moves to the character's end instead of
    showing two replacement characters, so the joined text is exact.
    """
    tok = _hf_tokenizer(tokenizer)

    def dec(ids: np.ndarray) -> str:
        return tok.decode(ids.tolist(), skip_special_tokens=False)

    texts = [dec(s.token_ids) for s in traj.segments]
    full = dec(traj.token_ids)
    if "".join(texts) == full:
        return texts
    cuts = [0]
    for b in traj.offsets[1:-1]:
        prefix = dec(traj.token_ids[: int(b)])
        while prefix and not full.startswith(prefix):
            prefix = prefix[:-1]  # a trailing replacement character of a split character
        cuts.append(max(len(prefix), cuts[-1]))
    cuts.append(len(full))
    return [full[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _badge(traj: Trajectory, turn: int) -> str:
    a = traj.actions[turn]
    lp = "" if a.logprobs is not None else " · no logprobs"
    return f"⟦turn {turn} · reward {a.reward:.4g}{lp}⟧"


def render_trajectory_text(
    traj: Trajectory, tokenizer: Any, color: bool = True, *, markers: bool = True, escape_controls: bool = False
) -> str:
    """The episode's token stream as text, coloured by segment with ANSI codes.

    Policy tokens (mask 1) are green, the prompt grey, observations (mask 0) blue. With
    ``markers``, a badge ``⟦turn N · reward R⟧`` (black on yellow) precedes each turn's
    action. Every segment is decoded with ``skip_special_tokens=False``, so template
    tokens such as ``<|im_end|>`` show; with ``markers=False``, ``strip_ansi`` of the
    result equals the decode of ``traj.token_ids``.

    Args:
        traj: the trajectory.
        tokenizer: a Hugging Face tokenizer, a ChatRenderer, or a name for ``load_tokenizer``.
        color: emit ANSI colour codes.
        markers: emit the turn badges.
        escape_controls: show control characters other than newline and tab (a model can
            generate an escape sequence) as visible symbols (``␛`` for ESC, ``\x9b`` as
            ``<0x9b>``) instead of sending them to the terminal. The text is then no
            longer the exact decode.
    """
    out = []
    for seg, text in zip(traj.segments, segment_texts(traj, tokenizer)):
        if markers and seg.kind is SegmentKind.ACTION:
            out.append(_paint(_badge(traj, seg.turn), ANSI_COLORS["turn"], color))
        if escape_controls:
            text = _CONTROL_RE.sub(_control_picture, text)
        out.append(_paint(text, ANSI_COLORS[seg.kind.value], color))
    return "".join(out)


_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _control_picture(m: re.Match[str]) -> str:
    c = ord(m.group())
    if c < 0x20:
        return chr(0x2400 + c)  # the Unicode "control pictures" block: ␀ ... ␟
    return "␡" if c == 0x7F else f"<0x{c:02x}>"


def _paint(text: str, code: str, color: bool) -> str:
    if not color:
        return text
    # Colour each line on its own so that pagers (less -R) and grep keep it per line.
    return "\n".join(f"\x1b[{code}m{line}\x1b[0m" if line else "" for line in text.split("\n"))


_CSS = """
.tokengym-trajectory { font-family: ui-sans-serif, system-ui, sans-serif; font-size: 13px; }
.tokengym-trajectory .tg-head { margin: 0 0 6px 0; }
.tokengym-trajectory .tg-legend span { margin-right: 12px; }
.tokengym-trajectory pre.tg-stream { white-space: pre-wrap; word-break: break-word; line-height: 1.45;
  font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px;
  background: #f9fafb; color: #111827; border: 1px solid #e5e7eb; border-radius: 6px; padding: 8px; }
.tokengym-trajectory .tg-prompt { color: %(prompt)s; }
.tokengym-trajectory .tg-action { color: %(action)s; background: #f0fdf4; }
.tokengym-trajectory .tg-observation { color: %(observation)s; }
.tokengym-trajectory .tg-turn { background: %(turn)s; color: #111827; border-radius: 3px; padding: 0 4px;
  margin-right: 2px; font-size: 11px; }
""" % HTML_COLORS


def render_trajectory_html(traj: Trajectory, tokenizer: Any, *, document: bool = False) -> str:
    """The episode as self-contained HTML (inline CSS, no scripts or external resources).

    Each segment is one ``<span class="tg-{kind}">`` (``tg-prompt``, ``tg-action``,
    ``tg-observation``) with an inline ``style="color:..."`` (so it stays coloured where
    ``<style>`` is stripped) and ``data-kind``, ``data-turn``, ``data-start``,
    ``data-end`` (token offsets) and ``data-mask``. Each action is preceded by a
    ``<span class="tg-turn">`` badge. All text is HTML-escaped (``<|im_end|>`` shows as text).

    Args:
        document: a whole ``<!DOCTYPE html>`` page (for a file) instead of a fragment
            (for a notebook cell).
    """
    texts = segment_texts(traj, tokenizer)
    offsets = traj.offsets
    parts = []
    for i, (seg, text) in enumerate(zip(traj.segments, texts)):
        kind = seg.kind.value
        if seg.kind is SegmentKind.ACTION:
            parts.append(
                f'<span class="tg-turn" data-turn="{seg.turn}" style="background:{HTML_COLORS["turn"]}">'
                f"{html.escape(_badge(traj, seg.turn))}</span>"
            )
        mask = 1 if seg.kind is SegmentKind.ACTION else 0
        parts.append(
            f'<span class="tg-{kind}" data-kind="{kind}" data-turn="{seg.turn}" data-start="{int(offsets[i])}" '
            f'data-end="{int(offsets[i + 1])}" data-mask="{mask}" style="color:{HTML_COLORS[kind]}">'
            f"{html.escape(text)}</span>"
        )
    m = traj.mask
    head = (
        f"{html.escape(str(traj.env_id))} · seed {html.escape(str(traj.seed))} · {len(traj):,} tokens "
        f"({int(m.sum()):,} policy) · {traj.num_turns} turns · reward {traj.reward:.4g} · "
        f"stop reason {html.escape(str(traj.stop_reason))}"
    )
    legend = "".join(
        f'<span style="color:{HTML_COLORS[k]}">■ {label}</span>'
        for k, label in (
            ("action", "policy (mask 1)"),
            ("prompt", "prompt (mask 0)"),
            ("observation", "observation (mask 0)"),
        )
    )
    fragment = (
        f'<div class="tokengym-trajectory"><style>{_CSS}</style>'
        f'<div class="tg-head">{head}</div><div class="tg-legend">{legend}</div>'
        f'<pre class="tg-stream">{"".join(parts)}</pre></div>'
    )
    if not document:
        return fragment
    title = html.escape(f"tokengym trajectory: {traj.env_id} seed {traj.seed}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
        f"<body>{fragment}</body></html>\n"
    )


class TrajectoryView:
    """A trajectory with its tokenizer, shown coloured by a notebook (``_repr_html_``) or ``print``."""

    def __init__(self, traj: Trajectory, tokenizer: Any) -> None:
        self.trajectory = traj
        self.tokenizer = _hf_tokenizer(tokenizer)

    def _repr_html_(self) -> str:
        return render_trajectory_html(self.trajectory, self.tokenizer)

    def __str__(self) -> str:
        return render_trajectory_text(self.trajectory, self.tokenizer, color=False)

    def __repr__(self) -> str:
        t = self.trajectory
        return f"TrajectoryView(env_id={t.env_id!r}, seed={t.seed!r}, tokens={len(t)}, turns={t.num_turns})"


def view(traj: Trajectory, tokenizer: Any) -> TrajectoryView:
    """``view(traj, tok)`` as a notebook cell's last line shows the coloured episode."""
    return TrajectoryView(traj, tokenizer)


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


def _turn_table(traj: Trajectory) -> str:
    rows = [["turn", "action tokens", "observation tokens", "reward", "logprobs"]]
    obs = {s.turn: len(s) for s in traj.segments if s.kind is SegmentKind.OBSERVATION}
    for a in traj.actions:
        lp = "yes" if a.logprobs is not None else "no"
        rows.append([str(a.turn), str(len(a)), str(obs.get(a.turn, 0)), f"{a.reward:.4g}", lp])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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
            legend = " · ".join(
                _paint(label, ANSI_COLORS[k], color)
                for k, label in (
                    ("action", "policy tokens (mask 1)"),
                    ("prompt", "prompt (mask 0)"),
                    ("observation", "observations (mask 0)"),
                    ("turn", "⟦turn start⟧"),
                )
            )
            print(legend + "\n")
            print(render_trajectory_text(traj, tok, color=color, escape_controls=True))
        print()
        print(_turn_table(traj))
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
