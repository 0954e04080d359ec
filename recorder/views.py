"""Trajectories as text and HTML: each segment decoded and coloured by its kind.

Policy tokens (mask 1) are green, the prompt grey and observation tokens (mask 0) blue,
with a badge at the start of every turn. The views are what ``tokengym inspect`` prints
and what a notebook shows::

    from tokengym.recorder.views import view
    view(traj, tokenizer)          # displays as coloured HTML (``_repr_html_``)

The text view is plain ANSI (no terminal library needed). With the badges left out
(``markers=False``) and the colour codes stripped, it is exactly
``tokenizer.decode(traj.token_ids, skip_special_tokens=False)``: nothing is re-rendered
or hidden, special tokens included.
"""

from __future__ import annotations

import html
import os
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from .segments import SegmentKind
from .trajectory import Trajectory

__all__ = [
    "ANSI_COLORS",
    "HTML_COLORS",
    "TrajectoryView",
    "add_tool_stats",
    "episode_notes",
    "render_legend_text",
    "render_trajectory_html",
    "render_trajectory_text",
    "render_turn_table",
    "segment_texts",
    "strip_ansi",
    "tool_calls_line",
    "view",
]

#: SGR codes of the text view, per segment kind (and for the turn badges).
ANSI_COLORS = {"prompt": "90", "action": "32", "observation": "34", "turn": "30;43"}
#: Text colours of the HTML view, per segment kind (and for the turn badges' background).
HTML_COLORS = {"prompt": "#6b7280", "action": "#15803d", "observation": "#1d4ed8", "turn": "#fde68a"}

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """``text`` without ANSI colour codes."""
    return _ANSI_RE.sub("", text)


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


def segment_parts(traj: Trajectory, tokenizer: Any) -> list[list[Any]]:
    """Each segment as text with its images in place: a list of strings and
    :class:`~tokengym.envs.images.StreamImage` objects, an image where its placeholder run was.
    Without images, each segment is ``[its text]`` (:func:`segment_texts`)."""
    texts = segment_texts(traj, tokenizer)
    if not traj.images:
        return [[t] for t in texts]
    tok = _hf_tokenizer(tokenizer)
    ids = traj.token_ids
    out: list[list[Any]] = []
    offsets = traj.offsets.tolist()
    for i, text in enumerate(texts):
        a, z = offsets[i], offsets[i + 1]
        inside = sorted((im for im in traj.images if a <= im.offset < z), key=lambda im: im.offset)
        if not inside:
            out.append([text])
            continue
        parts: list[Any] = []
        at = a
        for im in inside:  # placeholder runs are special tokens: decoding around them splits no character
            parts.append(tok.decode(ids[at : im.offset].tolist(), skip_special_tokens=False))
            parts.append(im)
            at = min(im.offset + im.num_tokens, z)
        parts.append(tok.decode(ids[at:z].tolist(), skip_special_tokens=False))
        out.append([p for p in parts if not isinstance(p, str) or p])
    return out


def image_label(im: Any) -> str:
    """``[image #k: WxH, N tokens]``: an image where its placeholder run stands, in text."""
    w, h = getattr(im.image, "size", ("?", "?"))
    return f"[image #{im.index}: {w}x{h}, {im.num_tokens} tokens]"


def _image_html(im: Any) -> str:
    import base64
    import io

    buf = io.BytesIO()
    im.image.save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    label = html.escape(image_label(im))
    return (
        f'<img class="tg-image" src="data:image/png;base64,{data}" alt="{label}" title="{label}" '
        f'data-index="{im.index}" data-start="{im.offset}" data-end="{im.offset + im.num_tokens}" '
        'style="max-height:160px;vertical-align:middle;border:1px solid #d1d5db;margin:2px">'
    )


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
    result equals the decode of ``traj.token_ids``, but where an image's placeholder run
    stands: ``[image #k: WxH, N tokens]`` instead.

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
    for seg, parts in zip(traj.segments, segment_parts(traj, tokenizer)):
        if markers and seg.kind is SegmentKind.ACTION:
            out.append(_paint(_badge(traj, seg.turn), ANSI_COLORS["turn"], color))
        text = "".join(p if isinstance(p, str) else image_label(p) for p in parts)
        if escape_controls:
            text = _CONTROL_RE.sub(_control_picture, text)
        out.append(_paint(text, ANSI_COLORS[seg.kind.value], color))
    return "".join(out)


_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(value: object) -> str:
    """``str(value)`` with its control characters (terminal escapes among them, newline and tab
    too) shown as pictures: what a store says of itself (env ids, stop reasons, tokenizer names) is
    printed, never obeyed by the terminal."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", _control_picture, str(value))


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
    An image shows where its placeholder run stands, as an inline ``<img>`` (a ``data:`` URI:
    nothing is fetched).

    Args:
        document: a whole ``<!DOCTYPE html>`` page (for a file) instead of a fragment
            (for a notebook cell).
    """
    pieces = segment_parts(traj, tokenizer)
    offsets = traj.offsets
    parts = []
    for i, (seg, shown) in enumerate(zip(traj.segments, pieces)):
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
            + "".join(html.escape(p) if isinstance(p, str) else _image_html(p) for p in shown)
            + "</span>"
        )
    m = traj.mask
    head = (
        f"{html.escape(str(traj.env_id))} · seed {html.escape(str(traj.seed))} · {len(traj):,} tokens "
        f"({int(m.sum()):,} policy) · {traj.num_turns} turns · reward {traj.reward:.4g} · "
        f"stop reason {html.escape(str(traj.stop_reason))}"
        + "".join(f" · {html.escape(n)}" for n in episode_notes(traj))
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


def render_legend_text(color: bool = True) -> str:
    """The key to the text view's colours, one line."""
    return " · ".join(
        _paint(label, ANSI_COLORS[k], color)
        for k, label in (
            ("action", "policy tokens (mask 1)"),
            ("prompt", "prompt (mask 0)"),
            ("observation", "observations (mask 0)"),
            ("turn", "⟦turn start⟧"),
        )
    )


def render_turn_table(traj: Trajectory) -> str:
    """One line per turn: action and observation token counts, reward, whether logprobs were
    recorded, and why the action's generation stopped (``length``: cut at the token limit)."""
    rows = [["turn", "action tokens", "observation tokens", "reward", "logprobs", "finish"]]
    obs = {s.turn: len(s) for s in traj.segments if s.kind is SegmentKind.OBSERVATION}
    for a in traj.actions:
        lp = "yes" if a.logprobs is not None else "no"
        rows.append([str(a.turn), str(len(a)), str(obs.get(a.turn, 0)), f"{a.reward:.4g}", lp, a.finish_reason or "unknown"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def episode_notes(traj: Trajectory) -> list[str]:
    """What an episode's header adds to its stop reason: actions cut at the token limit (the
    episode reads "done" though an answer may be incomplete), its tool calls by outcome, and where
    the weight version changed inside it."""
    notes = []
    cut = sum(r == "length" for r in traj.finish_reasons)
    if cut:
        notes.append(f"{cut} of {len(traj.actions)} actions cut at the token limit (finish reason 'length')")
    tools = traj.metadata.get("tool_stats")
    if isinstance(tools, dict) and tools.get("calls"):
        notes.append("tool calls " + tool_calls_line({**tools, "episodes": 1}).split(": ", 1)[1])
    changes = traj.version_changes()  # where a weight update fell inside the episode
    if changes:
        spans = traj.action_spans
        where = []
        for offset, old, new in changes:
            turn = next(k for k, (a, z) in enumerate(spans) if a <= offset < z) + traj.first_turn
            where.append(f"v{old} -> v{new} at token {offset} (turn {turn})")
        notes.append("weights " + ", ".join(where))
    return notes


def add_tool_stats(counts: Counter, tool_stats: Any) -> None:
    """Add one episode's ``tool_stats`` (the env's counters) to a run's ``counts``: each counter but
    the running ``consecutive_invalid``, and ``episodes`` (episodes with a call)."""
    if isinstance(tool_stats, Mapping) and (tool_stats.get("calls") or tool_stats.get("server_restarts")):
        counts.update({k: int(v) for k, v in tool_stats.items() if k != "consecutive_invalid" and v})
        counts["episodes"] += bool(tool_stats.get("calls"))


def tool_calls_line(counts: Mapping[str, int]) -> str:
    """``N in E episodes: V valid (ok, error, timed out), I invalid (...)``: every call is counted
    in one of the parts, so a run whose tools time out or fail does not read as a clean one."""
    valid = {"ok": counts.get("ok", 0), "error": counts.get("error", 0), "timed out": counts.get("timeout", 0)}
    invalid = {k: counts.get(k, 0) for k in ("parse_error", "wrong_format", "unknown_tool", "invalid_arguments")}
    over = counts.get("over_limit", 0)
    line = (f"{counts.get('calls', 0)} in {counts.get('episodes', 0)} episodes: {sum(valid.values())} valid ("
            + ", ".join(f"{k} {v}" for k, v in valid.items()) + f"), {sum(invalid.values())} invalid")
    if any(invalid.values()):
        line += " (" + ", ".join(f"{k} {v}" for k, v in invalid.items() if v) + ")"
    if over:
        line += f", {over} over the per-turn call limit"
    if counts.get("truncated"):
        line += f"; {counts['truncated']} results cut to the token budget"
    if counts.get("render_refused"):
        line += f"; {counts['render_refused']} turns whose results the chat template refused to render"
    if counts.get("server_restarts"):
        n = counts["server_restarts"]
        line += f"; {n} restart{'s' if n > 1 else ''} of MCP servers that stopped or hung"
    return line
