"""A trajectory as one row of the store's schema, and a row back as an exact trajectory.

The writer converts each trajectory once, at ``write``, so a value that cannot be stored is an
error before anything is written; the readers rebuild :class:`~tokengym.recorder.Trajectory`
objects and check each row against its own segments, so a damaged row is an error that names
it, never a wrong trajectory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..segments import Segment, SegmentKind, trusted_segment
from ..trajectory import Trajectory
from .errors import CorruptShardError, SchemaVersionError
from .images import load_image_entry
from .schema import INT32_MAX, READABLE_VERSIONS, SCHEMA, SCHEMA_VERSION, SEGMENT_TYPE


def _json(value: Any, what: str) -> str:
    def default(o: Any) -> Any:
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, (set, frozenset)):
            return sorted(o)
        if isinstance(o, os.PathLike):
            return os.fspath(o)
        raise TypeError(f"{type(o).__name__} is not JSON serializable")

    try:
        text: str | None = json.dumps(value, default=default, ensure_ascii=False)
    except RecursionError:  # nested past Python's own limit: the depth check below says so
        text = None
    except (TypeError, ValueError) as err:
        raise ValueError(f"the trajectory's {what} cannot be stored as JSON: {err}") from err
    # A text with at most MAX_JSON_DEPTH brackets cannot nest deeper: the walk is needed only past that.
    if text is None or text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        if text is None or _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ValueError(
                f"the trajectory's {what} is nested more than {MAX_JSON_DEPTH} levels deep and cannot be stored: "
                "flatten it (a reader could not load it back)"
            )
    return text


MAX_JSON_DEPTH = 100
"""How deep a trajectory's metadata, conformance or sampling settings may nest (lists and dicts)."""


def _depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests (1 for a flat list or dict), counted without recursion and
    stopping once past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def trajectory_row(
    t: Trajectory, vocab_size: int, tokenizer_name: str, images: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``t`` as a row: the columns of :data:`SCHEMA` but the tokenizer's three, logprobs as
    ``(values, given)``, ``images`` the entries of its stored images
    (:func:`~tokengym.recorder.store.images.save_image`); a ValueError for what cannot be stored
    (ids outside the vocabulary)."""
    if t.images and images is None:
        raise ValueError("a trajectory with images is stored through TrajectoryWriter, which stores its images")
    ids = t.token_ids
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"the trajectory has token ids outside [0, {vocab_size}) of tokenizer "
            f"{tokenizer_name!r}: was it recorded with another tokenizer?"
        )
    if len(ids) > INT32_MAX:
        raise ValueError(f"a trajectory of {len(ids)} tokens does not fit int32 offsets")
    values = np.full(len(ids), np.nan, dtype=np.float32)
    given = np.zeros(len(ids), dtype=bool)
    versions = t.versions if any(s.versions is not None for s in t.segments) else None
    offsets = t.offsets
    segments = []
    for i, s in enumerate(t.segments):
        start, end = int(offsets[i]), int(offsets[i + 1])
        if s.logprobs is not None:
            values[start:end] = s.logprobs
            given[start:end] = True
        segments.append({"kind": s.kind.value, "start": start, "end": end, "turn": int(s.turn)})
    if t.seed is not None and not -(2**63) <= int(t.seed) < 2**63:
        raise ValueError(f"seed {t.seed} does not fit int64")
    return {
        "token_ids": ids.astype(np.int32),
        "mask": t.mask.astype(np.int8),
        "logprobs": (values, given),
        "segments": segments,
        "turn_rewards": [float(a.reward) for a in t.actions],
        "finish_reasons": [a.finish_reason for a in t.actions],
        "reward": float(t.reward),
        "prompt_len": int(t.prompt_len),
        "env_id": t.env_id,
        "seed": None if t.seed is None else int(t.seed),
        "stop_reason": t.stop_reason,
        "terminated": bool(t.terminated),
        "truncated": bool(t.truncated),
        "sampling": None if t.sampling is None else _json(t.sampling, "sampling"),
        "conformance": _json(list(t.conformance), "conformance"),
        "conformance_summary": _json(t.conformance_summary, "conformance summary"),
        "metadata": _json(t.metadata or {}, "metadata"),
        "images": images or None,
        "versions": None if versions is None else versions.astype(np.int32),
    }


def rows_table(rows: list[dict[str, Any]], name: str, fingerprint: str, file_meta: dict[bytes, bytes]) -> pa.Table:
    """Converted rows (:func:`trajectory_row`) as a table of :data:`SCHEMA`."""

    def lists(arrays: list[np.ndarray], typ: pa.DataType, mask: np.ndarray | None = None) -> pa.Array:
        offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays) if arrays else np.zeros(0)
        values = pa.array(flat, type=typ, mask=mask)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)

    n = len(rows)
    col = lambda key: [r[key] for r in rows]  # noqa: E731
    given = np.concatenate([r["logprobs"][1] for r in rows]) if rows else np.zeros(0, dtype=bool)
    columns = {
        "token_ids": lists(col("token_ids"), pa.int32()),
        "mask": lists(col("mask"), pa.int8()),
        "logprobs": lists([r["logprobs"][0] for r in rows], pa.float32(), mask=~given),
        "segments": pa.array(col("segments"), pa.list_(SEGMENT_TYPE)),
        "turn_rewards": pa.array(col("turn_rewards"), pa.list_(pa.float64())),
        "tokenizer_name": pa.array([name] * n, pa.string()),
        "tokenizer_hash": pa.array([fingerprint] * n, pa.string()),
        "schema_version": pa.array([SCHEMA_VERSION] * n, pa.int32()),
    }
    columns["images"] = pa.array([r.get("images") for r in rows], SCHEMA.field("images").type)  # none in older logs
    stamped = [r.get("versions") for r in rows]  # none in older logs, or from policies that cannot say
    versions = lists([np.zeros(0, np.int32) if v is None else v for v in stamped], pa.int32())
    if any(v is None for v in stamped):
        versions = pa.ListArray.from_arrays(versions.offsets, versions.values, mask=pa.array([v is None for v in stamped]))
    columns["versions"] = versions
    for field in SCHEMA:
        if field.name not in columns:
            columns[field.name] = pa.array(col(field.name), field.type)
    return pa.Table.from_arrays([columns[f.name] for f in SCHEMA], schema=SCHEMA.with_metadata(file_meta))


def _flat(batch: pa.RecordBatch, name: str) -> tuple[pa.Array, np.ndarray]:
    """A list column's flattened values and its row offsets (relative to the values)."""
    import pyarrow.compute as pc  # ~0.1 s to import: paid by readers, not by every import of the store

    arr = batch.column(name)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return arr.flatten(), offsets


def decode_batch(batch: pa.RecordBatch, path: Path, first: int) -> Iterator[Trajectory]:
    import pyarrow.compute as pc

    ids_arr, ids_off = _flat(batch, "token_ids")
    ids_all = ids_arr.to_numpy(zero_copy_only=False)
    mask_arr, mask_off = _flat(batch, "mask")
    mask_all = mask_arr.to_numpy(zero_copy_only=False)
    lp_arr, lp_off = _flat(batch, "logprobs")
    lp_all = lp_arr.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    lp_given = pc.is_valid(lp_arr).to_numpy(zero_copy_only=False)
    v_arr, v_off = _flat(batch, "versions")
    v_all = v_arr.to_numpy(zero_copy_only=False)
    v_null = batch.column("versions").is_null().to_numpy(zero_copy_only=False)
    rows = _pylist_rows(batch.drop_columns(["token_ids", "mask", "logprobs", "versions", "segments"]))
    segs = _FlatSegments.of(batch)
    agreed = _batch_agrees(segs, ids_off, mask_off, lp_off, v_off, mask_all, lp_given, v_all, v_null)
    if agreed is not None:
        yield from _decode_agreed(rows, segs, path, first, ids_all, ids_off, lp_all, v_all, v_null, *agreed)
        return
    # Something disagrees: row by row, segment by segment, to name the row and what is wrong.
    for row, row_segs in zip(rows, batch.column("segments").to_pylist()):
        row["segments"] = row_segs
    for r, row in enumerate(rows):
        where = f"{path}: row {first + r}"
        if row["schema_version"] not in READABLE_VERSIONS:
            raise SchemaVersionError(
                f"{where}: schema version {row['schema_version']!r}, expected one of {READABLE_VERSIONS}"
            )
        ids = ids_all[ids_off[r] : ids_off[r + 1]].astype(np.int64)
        mask = mask_all[mask_off[r] : mask_off[r + 1]]
        lp = lp_all[lp_off[r] : lp_off[r + 1]]
        given = lp_given[lp_off[r] : lp_off[r + 1]]
        if not (len(ids) == len(mask) == len(lp)):
            raise CorruptShardError(f"{where}: token_ids, mask and logprobs differ in length")
        versions = None if v_null[r] else v_all[v_off[r] : v_off[r + 1]]
        if versions is not None and len(versions) != len(ids):
            raise CorruptShardError(f"{where}: {len(versions)} weight versions for {len(ids)} tokens")
        try:
            images = [load_image_entry(path.parent, e) for e in row.get("images") or ()]
            yield _decode_row(row, ids, mask, lp, given, images, versions)
        except CorruptShardError as err:
            raise CorruptShardError(f"{where}: {err}") from None
        except ValueError as err:  # the Trajectory / Segment checks
            raise CorruptShardError(f"{where}: not a valid trajectory ({err})") from err


_KINDS = {k.value: k for k in SegmentKind}


def _pylist_rows(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """The batch's rows as dicts, built column by column (pyarrow's row-wise ``to_pylist`` builds
    every value through a per-row path: a fifth of a read's time went there)."""
    names = batch.schema.names
    return [dict(zip(names, values)) for values in zip(*(column.to_pylist() for column in batch.columns))]


def _all_or_none(flags: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Per segment: its tokens' flags are all set or none (an empty segment: both)."""
    counts = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    n = counts[starts + lens] - counts[starts]
    return (n == 0) | (n == lens)


@dataclass
class _FlatSegments:
    """A batch's segments as flat columns (Python lists of ints and kind names) and each row's
    range in them: no dict per segment, which pyarrow's ``to_pylist`` would build."""

    kinds: list[Any]
    starts: list[Any]
    ends: list[Any]
    turns: list[Any]
    row_off: np.ndarray
    is_action: np.ndarray

    @classmethod
    def of(cls, batch: pa.RecordBatch) -> _FlatSegments:
        import pyarrow.compute as pc

        flat, row_off = _flat(batch, "segments")
        field = flat.field  # a StructArray of SEGMENT_TYPE
        is_action = pc.fill_null(pc.equal(field("kind"), "action"), False).to_numpy(zero_copy_only=False)
        return cls(
            field("kind").to_pylist(), field("start").to_pylist(), field("end").to_pylist(), field("turn").to_pylist(),
            row_off, is_action.astype(bool),
        )


def _batch_agrees(
    segs: _FlatSegments, ids_off: np.ndarray, mask_off: np.ndarray, lp_off: np.ndarray, v_off: np.ndarray,
    mask_all: np.ndarray, lp_given: np.ndarray, v_all: np.ndarray, v_null: np.ndarray,
) -> tuple[list[bool], list[bool]] | None:
    """Whether every row of the batch agrees with its segments, checked for the whole batch at once
    (the segments cover the tokens, the mask is 1 exactly on actions, logprobs and weight versions
    on whole actions only): per segment of the batch, in order, whether it has logprobs and whether
    it has weight versions. None: the row-by-row check runs and names what is wrong."""
    if not (np.array_equal(ids_off, mask_off) and np.array_equal(ids_off, lp_off)):
        return None
    if not set(segs.kinds) <= _KINDS.keys() or None in segs.starts or None in segs.ends or None in segs.turns:
        return None
    starts, ends = np.array(segs.starts, np.int64), np.array(segs.ends, np.int64)
    counts = np.diff(segs.row_off)
    lengths = np.diff(ids_off)
    has = counts > 0
    # Each row's segments continue one another from 0 and end at its length; a row without any has no tokens.
    prev = np.concatenate(([0], ends[:-1]))
    prev[segs.row_off[:-1][has]] = 0
    if not ((starts == prev).all() and (ends >= starts).all() and (lengths[~has] == 0).all()):
        return None
    if not np.array_equal(ends[segs.row_off[1:][has] - 1], lengths[has]):
        return None
    seg_len = ends - starts
    seg_start = np.repeat(ids_off[:-1].astype(np.int64), counts) + starts
    is_action = segs.is_action
    on_action = np.repeat(is_action, seg_len)
    if not np.array_equal(mask_all, on_action.astype(mask_all.dtype)) or (lp_given & ~on_action).any():
        return None
    if not _all_or_none(lp_given, seg_start, seg_len)[is_action].all():
        return None
    whole = is_action & (seg_len > 0)
    first = np.minimum(seg_start, max(len(lp_given) - 1, 0))  # an empty last segment points past the end
    with_logprobs = (whole & lp_given[first] if len(lp_given) else whole & False).tolist()
    if v_null.all():
        return with_logprobs, [False] * len(starts)
    if v_null.any() or not np.array_equal(v_off, ids_off):
        return None  # some rows without versions (an older log's): row by row
    stamped = v_all >= 0
    if (v_all < -1).any() or (stamped & ~on_action).any():
        return None
    if not _all_or_none(stamped, seg_start, seg_len)[is_action].all():
        return None
    return with_logprobs, (whole & stamped[first] if len(stamped) else whole & False).tolist()


def _decode_agreed(
    rows: list[dict[str, Any]], segs: _FlatSegments, path: Path, first: int, ids_all: np.ndarray,
    ids_off: np.ndarray, lp_all: np.ndarray, v_all: np.ndarray, v_null: np.ndarray, with_logprobs: list[bool],
    with_versions: list[bool],
) -> Iterator[Trajectory]:
    """The rows of a batch :func:`_batch_agrees` passed, as trajectories; what it does not check
    (schema versions, turn rewards, finish reasons, the order of segments) is checked here."""
    action = SegmentKind.ACTION
    kinds, starts, ends, turns = segs.kinds, segs.starts, segs.ends, segs.turns
    row_off = segs.row_off.tolist()
    for r, row in enumerate(rows):
        if row["schema_version"] not in READABLE_VERSIONS:
            raise SchemaVersionError(
                f"{path}: row {first + r}: schema version {row['schema_version']!r}, expected one of {READABLE_VERSIONS}"
            )
        a, b = int(ids_off[r]), int(ids_off[r + 1])
        ids = ids_all[a:b].astype(np.int64)  # a copy of its own: a kept trajectory does not keep its batch alive
        lp = lp_all[a:b].copy()
        versions = None if v_null[r] else v_all[a:b].copy()
        ids.setflags(write=False)
        lp.setflags(write=False)
        if versions is not None:
            versions.setflags(write=False)
        rewards = row["turn_rewards"] or []
        finish = row.get("finish_reasons")
        try:
            if finish is not None and len(finish) != len(rewards):
                raise CorruptShardError(f"{len(finish)} finish reasons for {len(rewards)} turn rewards")
            lo, hi = row_off[r], row_off[r + 1]
            turn0 = turns[lo] if hi > lo else 0
            segments = []
            for k in range(lo, hi):
                kind, start, end, turn = _KINDS[kinds[k]], starts[k], ends[k], turns[k]
                if kind is action:
                    if not 0 <= turn - turn0 < len(rewards):
                        raise CorruptShardError(f"no turn reward for turn {turn}")
                    segments.append(trusted_segment(
                        kind, ids[start:end], turn, lp[start:end] if with_logprobs[k] else None, rewards[turn - turn0],
                        None if finish is None else finish[turn - turn0],
                        versions[start:end] if with_versions[k] else None,
                    ))
                else:
                    segments.append(trusted_segment(kind, ids[start:end], turn))
            images = [load_image_entry(path.parent, e) for e in row.get("images") or ()]
            yield _trajectory(row, segments, images, len(rewards))
        except CorruptShardError as err:
            raise CorruptShardError(f"{path}: row {first + r}: {err}") from None
        except ValueError as err:  # the Trajectory checks
            raise CorruptShardError(f"{path}: row {first + r}: not a valid trajectory ({err})") from err


def _decode_row(
    row: dict[str, Any], ids: np.ndarray, mask: np.ndarray, lp: np.ndarray, given: np.ndarray, images: list[Any],
    versions: np.ndarray | None = None,
) -> Trajectory:
    """One row back into a Trajectory, checking it against its own segments."""
    rewards = row["turn_rewards"] or []
    finish = row.get("finish_reasons")
    if finish is not None and len(finish) != len(rewards):
        raise CorruptShardError(f"{len(finish)} finish reasons for {len(rewards)} turn rewards")
    segments: list[Segment] = []
    pos = 0
    # turn_rewards / finish_reasons hold this row's turns in order: a later sequence of an episode
    # (history="deploy") starts at the turn of its prompt segment.
    first = (row["segments"] or [{"turn": 0}])[0]["turn"]
    for s in row["segments"] or []:
        kind = SegmentKind(s["kind"])
        start, end, turn = s["start"], s["end"], s["turn"]
        if start != pos or end < start or end > len(ids):
            raise CorruptShardError(f"segment [{start}, {end}) does not continue at {pos}")
        pos = end
        want_mask = 1 if kind is SegmentKind.ACTION else 0
        if not (mask[start:end] == want_mask).all():
            raise CorruptShardError(f"mask disagrees with the {kind.value} segment [{start}, {end})")
        logprobs = None
        reward = 0.0
        if kind is SegmentKind.ACTION:
            span = given[start:end]
            if span.size and span.all():
                logprobs = lp[start:end].copy()
            elif span.any():
                raise CorruptShardError(f"action segment [{start}, {end}) has logprobs for some tokens only")
            if not 0 <= turn - first < len(rewards):
                raise CorruptShardError(f"no turn reward for turn {turn}")
            reward = rewards[turn - first]
        elif given[start:end].any():
            raise CorruptShardError(f"{kind.value} segment [{start}, {end}) carries logprobs")
        reason = finish[turn - first] if finish is not None and kind is SegmentKind.ACTION else None
        stamped = None
        if versions is not None:
            span_v = versions[start:end]
            if kind is not SegmentKind.ACTION and (span_v != -1).any():
                raise CorruptShardError(f"{kind.value} segment [{start}, {end}) carries weight versions")
            if kind is SegmentKind.ACTION and span_v.size and (span_v >= 0).all():
                stamped = span_v.astype(np.int32)
            elif kind is SegmentKind.ACTION and (span_v != -1).any():
                raise CorruptShardError(f"action segment [{start}, {end}) has weight versions for some tokens only")
        segments.append(Segment(kind, ids[start:end], turn, logprobs=logprobs, reward=reward, finish_reason=reason,
                                versions=stamped))
    if pos != len(ids):
        raise CorruptShardError(f"segments cover {pos} of {len(ids)} tokens")
    return _trajectory(row, segments, images, len(rewards))


def _trajectory(row: dict[str, Any], segments: list[Segment], images: list[Any], turn_rewards: int) -> Trajectory:
    traj = Trajectory(
        segments=segments,
        env_id=row["env_id"],
        seed=row["seed"],
        stop_reason=row["stop_reason"],
        terminated=bool(row["terminated"]),
        truncated=bool(row["truncated"]),
        conformance=json.loads(row["conformance"]) if row["conformance"] is not None else [],
        sampling=json.loads(row["sampling"]) if row["sampling"] is not None else None,
        metadata=json.loads(row["metadata"]) if row["metadata"] is not None else {},
        images=images,
    )
    if traj.num_turns != turn_rewards:
        raise CorruptShardError(f"{turn_rewards} turn rewards for {traj.num_turns} turns")
    return traj
