"""A store as one self-contained HTML page: ``tokengym inspect STORE --html OUT.html``.

The page holds the run's summary (the rows ``tokengym inspect`` prints), histograms of the
episodes' rewards, lengths in tokens and turns, and a few episodes as coloured token
streams (the views of :mod:`tokengym.recorder.views`: policy tokens, mask 1, in green).
Distributions are easier to see than to read off a mean and a min and a max; a reward
histogram shows at a glance whether a GRPO group can have any signal at all.

Everything is inline: the charts are SVG written here, the colours inline CSS. The page
loads nothing (no scripts, no fonts, no CDN), so it opens offline and can be attached to a
report or an issue as one file.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import views as _views
from .store import StoreError
from .summary import Totals, summarize_with_totals, summary_rows
from .trajectory import Trajectory
from .views import HTML_COLORS, render_trajectory_html

__all__ = [
    "REPORT_EPISODES",
    "Histogram",
    "check_ids",
    "histogram",
    "render_histogram_svg",
    "render_report",
    "render_store_report",
    "report_picks",
    "store_report",
]

MAX_BARS = 24
"""At most this many bars per histogram: distinct values up to it get a bar each, more are binned."""


@dataclass(frozen=True)
class Histogram:
    """Bars of a histogram: bar ``i`` counts the values in ``[edges[i], edges[i+1])`` (the last
    bar includes its right edge), or, for ``labels``, the values equal to ``labels[i]``."""

    counts: list[int]
    edges: list[float] | None
    labels: list[float] | None

    def low(self, i: int, integer: bool) -> float:
        """The smallest value bar ``i`` counts (for whole numbers, the first whole number of its bin)."""
        if self.labels is not None:
            return self.labels[i]
        lo = (self.edges or [])[i]
        return float(math.ceil(lo)) if integer else lo

    def high(self, i: int, integer: bool) -> float:
        """The largest value bar ``i`` counts (an open bound but for the last bar, for other values)."""
        if self.labels is not None:
            return self.labels[i]
        hi = (self.edges or [])[i + 1]
        return float(math.floor(hi)) if integer else hi

    def bar_label(self, i: int, integer: bool) -> str:
        if self.labels is not None:
            return _num(self.labels[i], integer)
        edges = self.edges or []
        lo, hi = edges[i], edges[i + 1]
        if integer and hi - lo <= 1:
            return _edge(lo, True, first=True)
        return f"{_edge(lo, integer, first=True)}–{_edge(hi, integer, first=False)}"


def _num(x: float, integer: bool) -> str:
    return f"{int(round(x)):,}" if integer else f"{x:.4g}"


def _edge(x: float, integer: bool, *, first: bool) -> str:
    """A bin edge as a value: for whole numbers (edges at k - 0.5) the first or last whole number in the bin."""
    if not integer:
        return f"{x:.4g}"
    return f"{math.ceil(x) if first else math.floor(x):,}"


def _tick(x: float, y: float, text: str) -> str:
    return f'<text x="{x:.1f}" y="{y}" text-anchor="middle">{html.escape(text)}</text>'


def histogram(values: Sequence[float] | np.ndarray, *, integer: bool = False, max_bars: int = MAX_BARS) -> Histogram:
    """The bars for ``values``. Whole numbers (``integer``, e.g. lengths): one bar per number of
    the range when it spans at most ``max_bars`` (empty ones included, so the axis stays
    linear), else bins of equal whole-number widths. Other values (rewards): one bar per distinct
    value when there are at most ``max_bars`` of them (rewards of 0 and 1), else ``max_bars``
    equal bins over the range."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return Histogram([], None, None)
    if not np.isfinite(a).all():
        raise ValueError(f"cannot draw a histogram of non-finite values ({int((~np.isfinite(a)).sum())} of {a.size})")
    lo, hi = float(a.min()), float(a.max())
    if integer and hi - lo < max_bars:  # a bar per whole number of the range, empty ones included
        values_, counts_ = np.unique(a, return_counts=True)
        per = dict(zip(values_.tolist(), counts_.tolist()))
        labels = [lo + k for k in range(int(hi - lo) + 1)]
        return Histogram([int(per.get(x, 0)) for x in labels], None, labels)
    distinct, counts = np.unique(a, return_counts=True)
    if not integer and len(distinct) <= max_bars:
        return Histogram(counts.tolist(), None, distinct.tolist())
    if integer:
        width = math.ceil((hi - lo + 1) / max_bars)
        edges = np.arange(lo - 0.5, hi + 0.5 + width, width)[: max_bars + 1]
        edges[-1] = max(edges[-1], hi + 0.5)
    else:
        edges = np.linspace(lo, hi, max_bars + 1)
    binned, _ = np.histogram(a, bins=edges)
    return Histogram(binned.tolist(), edges.tolist(), None)


_W, _H = 380, 210
_LEFT, _RIGHT, _TOP, _BOTTOM = 44, 10, 26, 44


def render_histogram_svg(
    values: Sequence[float] | np.ndarray, title: str, xlabel: str, *, integer: bool = False, color: str = "#15803d"
) -> str:
    """An inline ``<svg>`` histogram of ``values``. Each bar is a ``<rect class="tg-bar">`` with
    ``data-count`` and ``data-label`` (and a ``<title>`` tooltip); the counts add up to ``len(values)``."""
    h = histogram(values, integer=integer)
    n = len(h.counts)
    top = max(h.counts, default=0) or 1
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM
    slot = plot_w / max(n, 1)
    gap = min(4.0, slot * 0.15) if h.labels is not None else 0.5
    out = [
        f'<svg class="tg-hist" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" role="img" aria-label="{html.escape(title)}" '
        'style="font-family: ui-sans-serif, system-ui, sans-serif; font-size: 11px">',
        f'<text x="{_W / 2}" y="15" text-anchor="middle" font-size="13" font-weight="600">{html.escape(title)}</text>',
        f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_W - _RIGHT}" y2="{_TOP + plot_h}" stroke="#9ca3af"/>',
        f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + plot_h}" stroke="#9ca3af"/>',
        f'<text x="{_LEFT - 4}" y="{_TOP + 4}" text-anchor="end">{top:,}</text>',
        f'<text x="{_LEFT - 4}" y="{_TOP + plot_h}" text-anchor="end">0</text>',
        f'<text x="12" y="{_TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 12 {_TOP + plot_h / 2})">episodes</text>',
        f'<text x="{_LEFT + plot_w / 2}" y="{_H - 6}" text-anchor="middle">{html.escape(xlabel)}</text>',
    ]
    every = max(1, math.ceil(n / 8))  # at most about 8 tick labels
    for i, count in enumerate(h.counts):
        label = h.bar_label(i, integer)
        bh = plot_h * count / top
        x = _LEFT + i * slot + gap / 2
        out.append(
            f'<rect class="tg-bar" data-count="{count}" data-label="{html.escape(label)}" '
            f'data-lo="{h.low(i, integer):g}" data-hi="{h.high(i, integer):g}" x="{x:.1f}" '
            f'y="{_TOP + plot_h - bh:.1f}" width="{max(slot - gap, 1):.1f}" height="{bh:.1f}" fill="{color}">'
            f"<title>{html.escape(label)}: {count:,} episode{'s' * (count != 1)}</title></rect>"
        )
        if h.labels is not None and (i % every == 0 or i == n - 1):  # a value under its bar
            out.append(_tick(_LEFT + (i + 0.5) * slot, _TOP + plot_h + 14, label))
        elif h.edges is not None and i % every == 0:  # a bin's first value at its left edge
            out.append(_tick(_LEFT + i * slot, _TOP + plot_h + 14, _edge(h.edges[i], integer, first=True)))
    if h.edges is not None and n and (n - 1) % every:  # the range's end, unless the last bar's label sits there
        out.append(_tick(_LEFT + n * slot, _TOP + plot_h + 14, _edge(h.edges[-1], integer, first=False)))
    out.append("</svg>")
    return "".join(out)


_PAGE_CSS = """
body.tokengym-report { font-family: ui-sans-serif, system-ui, sans-serif; margin: 24px; color: #111827;
  max-width: 1200px; }
.tokengym-report h1 { font-size: 20px; margin: 0 0 12px 0; }
.tokengym-report h2 { font-size: 16px; margin: 24px 0 8px 0; }
.tokengym-report table.tg-summary { border-collapse: collapse; font-size: 13px; }
.tokengym-report table.tg-summary th { text-align: left; padding: 2px 16px 2px 0; color: #374151;
  font-weight: 600; vertical-align: top; white-space: nowrap; }
.tokengym-report table.tg-summary td { padding: 2px 0; }
.tokengym-report .tg-charts { display: flex; flex-wrap: wrap; gap: 16px; }
.tokengym-report .tg-why { font-size: 13px; color: #374151; margin: 16px 0 4px 0; font-weight: 600; }
"""


def render_store_report(
    rows: Sequence[tuple[str, str]],
    rewards: np.ndarray,
    tokens: np.ndarray,
    turns: np.ndarray,
    shown: Sequence[tuple[int, str, Trajectory]],
    tokenizer: object,
    *,
    title: str,
    document: bool = True,
) -> str:
    """The report page (a ``<!DOCTYPE html>`` document, or a fragment for a notebook).

    Args:
        rows: the summary, as (name, value) rows.
        rewards, tokens, turns: one value per episode of the store.
        shown: the episodes to show in full, as (index in the store, why it is shown, trajectory).
        tokenizer: decodes the shown episodes.
        title: the page's heading.
    """
    summary = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows
    )
    charts = "".join(
        (
            render_histogram_svg(rewards, "reward per episode", "episode reward", color=HTML_COLORS["action"]),
            render_histogram_svg(
                tokens, "length in tokens", "tokens per episode (prompt, actions, observations)", integer=True,
                color=HTML_COLORS["observation"],
            ),
            render_histogram_svg(turns, "length in turns", "turns per episode", integer=True, color="#b45309"),
        )
    )
    episodes = "".join(
        f'<div class="tg-episode" data-index="{index}"><div class="tg-why">episode {index} of {len(rewards)}: '
        f"{html.escape(why)}</div>{render_trajectory_html(traj, tokenizer)}</div>"
        for index, why, traj in shown
    )
    body = (
        f"<h1>{html.escape(title)}</h1>"
        f'<table class="tg-summary">{summary}</table>'
        f"<h2>Distributions over {len(rewards):,} episodes</h2>"
        f'<div class="tg-charts">{charts}</div>'
        f"<h2>Episodes</h2>{episodes}"
    )
    if not document:
        return f'<div class="tokengym-report"><style>{_PAGE_CSS}</style>{body}</div>'
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_PAGE_CSS}</style></head>"
        f'<body class="tokengym-report">{body}</body></html>\n'
    )


# ------------------------------------------------------------- a store's report
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


def check_ids(traj: Trajectory, index: int, tok: Any) -> None:
    if traj.token_ids.size and int(traj.token_ids.max()) >= len(tok):
        raise ValueError(
            f"episode {index} has token id {int(traj.token_ids.max())}, outside the {len(tok)} ids of the "
            "decoding tokenizer: pass the tokenizer the store was written with (--tokenizer)"
        )


def render_report(
    summary: dict[str, Any], totals: Totals, tok: Any, *, episode: int, show: int, document: bool
) -> str:
    if summary["episodes"] == 0:
        raise StoreError(f"{summary['path']}: the store holds no episode to show in a report")
    per = totals.per_episode()
    picks = report_picks(per, episode, show)
    trajs = _read_episodes(summary["path"], {i for i, _ in picks})
    for i, _ in picks:
        check_ids(trajs[i], i, tok)
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
    summary, totals = summarize_with_totals(path)
    return render_report(summary, totals, _views._hf_tokenizer(tokenizer), episode=episode, show=show, document=document)
