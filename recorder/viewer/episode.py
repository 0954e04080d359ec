"""One episode for the viewer: its row read from its file alone, and its tokens as pieces of text.

The page shades each policy token by its logprob, so the stream is sent token by token: each
token's piece is the text it adds to the decode of the tokens before it (a character whose bytes
span two tokens belongs to the second), and the pieces of a window join to exactly the decode of
that window. Where they would not (a tokenizer whose decode is not incremental), the window is
sent as one piece per segment and says so: the text stays exact, only the per-token shading goes.
A huge episode is sent a window of tokens at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from ..segments import SegmentKind
from ..store.episode_log import read_log
from ..store.manifest import open_shard
from ..store.reader import log_table
from ..store.rows import decode_batch
from ..store.schema import SCHEMA, upgrade_batch
from ..trajectory import Trajectory
from ..views import episode_notes

__all__ = ["WINDOW", "episode_json", "read_episode", "token_pieces"]

WINDOW = 4096
"""Tokens sent at a time: a longer episode is paged."""

_RESULT_CHARS = 400  # of a tool call's turn's observation, shown beside the call (all of it is in the stream)
_LOOKBACK = 6  # tokens of context each token is decoded after (covers a split UTF-8 character)


def read_episode(store: Path, file_name: str, row: int) -> Trajectory:
    """Row ``row`` of one file of the store (a shard or an episode log), checked as every read is.

    Raises:
        FileNotFoundError: the file is gone (a live writer compacted the log: read the index again).
        CorruptShardError: the file or the row is damaged (named).
    """
    path = store / file_name
    if path.suffix == ".parquet":
        pf, info = open_shard(path)
        with pf:
            at = 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if at + n > row:
                    have = [c for c in SCHEMA.names if c in pf.schema_arrow.names]
                    table = pf.read_row_group(g, columns=have).slice(row - at, 1)
                    batch = table.combine_chunks().to_batches()[0]
                    if have != SCHEMA.names:
                        batch = upgrade_batch(batch, SCHEMA.names)
                    break
                at += n
            else:
                raise IndexError(f"{path}: no row {row} (it holds {info.num_rows})")
    else:
        log = read_log(path)
        if row >= len(log.rows):
            raise IndexError(f"{path}: no row {row} (it holds {len(log.rows)})")
        batch = log_table(log, [log.rows[row]]).to_batches()[0]
    return next(decode_batch(batch, path, row))


def _decode(tok: Any, seqs: list[list[int]]) -> list[str]:
    return [str(t) for t in tok.batch_decode(seqs, skip_special_tokens=False)]


def token_pieces(tok: Any, ids: np.ndarray) -> list[str] | None:
    """Each token's text as it adds to the decode of those before it; ``None`` when the pieces do
    not join to the decode of ``ids`` (the caller then shows whole segments)."""
    seq = [int(x) for x in ids]
    if not seq:
        return []
    whole = _decode(tok, [seq])[0]
    starts = [max(0, k - _LOOKBACK) for k in range(len(seq))]
    texts = _decode(tok, [seq[s : k + 1] for k, s in enumerate(starts)] + [seq[s:k] for k, s in enumerate(starts)])
    after, before = texts[: len(seq)], texts[len(seq) :]
    pieces = []
    for a, b in zip(after, before):
        b = b.rstrip("\ufffd")  # an unfinished character: its text goes to the token that finishes it
        pieces.append("" if a.endswith("\ufffd") or not a.startswith(b) else a[len(b) :])
    if "".join(pieces) == whole:
        return pieces
    return _sequential_pieces(tok, seq, whole)


def _sequential_pieces(tok: Any, seq: list[int], whole: str) -> list[str] | None:
    """The exact form: each token's piece from the decode of every token up to it."""
    pieces, shown = [], ""
    for k in range(len(seq)):
        text = _decode(tok, [seq[: k + 1]])[0]
        if text.endswith("\ufffd") or not text.startswith(shown):
            pieces.append("")
            continue
        pieces.append(text[len(shown) :])
        shown = text
    return pieces if "".join(pieces) == whole else None


def _segment_rows(traj: Trajectory) -> list[dict[str, Any]]:
    offsets = traj.offsets.tolist()
    return [{"kind": s.kind.value, "turn": s.turn, "start": offsets[i], "end": offsets[i + 1]}
            for i, s in enumerate(traj.segments)]


def _turn_rows(traj: Trajectory) -> list[dict[str, Any]]:
    obs = {s.turn: len(s) for s in traj.segments if s.kind is SegmentKind.OBSERVATION}
    return [{"turn": a.turn, "reward": float(a.reward), "finish_reason": a.finish_reason or "unknown",
             "action_tokens": len(a), "observation_tokens": obs.get(a.turn, 0), "logprobs": a.logprobs is not None}
            for a in traj.actions]


def episode_json(traj: Trajectory, tok: Any, index: int, start: int = 0, limit: int = WINDOW) -> dict[str, Any]:
    """What the episode page shows: the header, the turns, tool calls, conformance, and the tokens
    ``[start, start + limit)`` as pieces (``[text, first token, logprob or None, kind]``), an image's
    run as one ``{"image": k}`` piece."""
    n = len(traj)
    if not 0 <= start <= max(n - 1, 0):
        raise ValueError(f"start={start}: the episode has {n} tokens")
    limit = max(1, min(int(limit), WINDOW))
    end = min(n, start + limit)
    ids, mask = traj.token_ids, traj.mask
    lp = traj.logprobs
    kinds = np.empty(n, dtype=object)  # only the window's (and its image runs') entries are read
    for seg in _segment_rows(traj):
        if seg["end"] > start and seg["start"] < end + WINDOW:
            kinds[seg["start"] : seg["end"]] = seg["kind"]
    images = sorted(traj.images, key=lambda im: im.offset)
    runs = [(im.offset, im.offset + im.num_tokens, im) for im in images]
    # The window's spans of text, the image runs between them; an image run is never cut by the window.
    spans: list[tuple[int, int] | Any] = []
    at = start
    for a, z, im in runs:
        if z <= start or a >= end:
            continue
        if a > at:
            spans.append((at, a))
        spans.append(im)
        at = max(at, z)
    end = max(end, at)
    if at < end:
        spans.append((at, end))
    pieces: list[Any] = []
    per_token = True
    for span in spans:
        if not isinstance(span, tuple):
            w, h = getattr(span.image, "size", (None, None))
            pieces.append({"image": span.index, "start": span.offset, "end": span.offset + span.num_tokens,
                           "width": w, "height": h})
            continue
        a, z = span
        texts = token_pieces(tok, ids[a:z])
        if texts is None:  # one piece per segment part: exact text, no per-token shading
            per_token = False
            cut = a
            while cut < z:
                kind = kinds[cut]
                stop = cut
                while stop < z and kinds[stop] == kind:
                    stop += 1
                text = _decode(tok, [ids[cut:stop].tolist()])[0]
                pieces.append([text, cut, None, kind, stop - cut])
                cut = stop
            continue
        for k, text in enumerate(texts):
            t = a + k
            logprob = float(lp[t]) if mask[t] and not np.isnan(lp[t]) else None
            pieces.append([text, t, logprob, kinds[t], 1])
    meta = dict(traj.metadata)
    results = {seg.turn: seg for seg in traj.segments if seg.kind is SegmentKind.OBSERVATION}
    calls = []
    for call in meta.get("tool_calls") or []:
        seg = results.get(call.get("turn")) if isinstance(call, dict) else None
        text = _decode(tok, [seg.token_ids.tolist()])[0] if seg is not None else ""
        calls.append({**call, "result": text if len(text) <= _RESULT_CHARS else text[: _RESULT_CHARS - 1] + "…"}
                     if isinstance(call, dict) else {"turn": None, "name": str(call), "status": "?", "result": ""})
    return {
        "index": index,
        "env_id": traj.env_id, "seed": traj.seed, "reward": float(traj.reward), "stop_reason": traj.stop_reason,
        "terminated": traj.terminated, "truncated": traj.truncated,
        "tokens": n, "policy_tokens": int(mask.sum()), "notes": episode_notes(traj),
        "turns": _turn_rows(traj), "segments": _segment_rows(traj),
        "tool_calls": calls, "tool_stats": meta.get("tool_stats") or {},
        "conformance": traj.conformance, "conformance_summary": traj.conformance_summary,
        "metadata": meta, "sampling": traj.sampling, "group": None if meta.get("group") is None else str(meta["group"]),
        "window": {"start": start, "end": end, "total": n, "per_token": per_token},
        "pieces": pieces,
    }
