"""A trajectory as one row of the store's schema, and a row back as an exact trajectory.

The writer converts each trajectory once, at ``write``, so a value that cannot be stored is an
error before anything is written; the readers rebuild :class:`~tokengym.recorder.Trajectory`
objects and check each row against its own segments, so a damaged row is an error that names
it, never a wrong trajectory.
"""

from __future__ import annotations

import json
import os
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
    rows = batch.drop_columns(["token_ids", "mask", "logprobs", "versions"]).to_pylist()
    if _batch_agrees(rows, ids_off, mask_off, lp_off, v_off, mask_all, lp_given, v_all, v_null):
        yield from _decode_agreed(rows, path, first, ids_all, ids_off, lp_all, lp_given, v_all, v_null)
        return
    # Something disagrees: row by row, segment by segment, to name the row and what is wrong.
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


def _all_or_none(flags: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Per segment: its tokens' flags are all set or none (an empty segment: both)."""
    counts = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    n = counts[starts + lens] - counts[starts]
    return (n == 0) | (n == lens)


def _batch_agrees(
    rows: list[dict[str, Any]], ids_off: np.ndarray, mask_off: np.ndarray, lp_off: np.ndarray, v_off: np.ndarray,
    mask_all: np.ndarray, lp_given: np.ndarray, v_all: np.ndarray, v_null: np.ndarray,
) -> bool:
    """Whether every row of the batch agrees with its segments, checked for the whole batch at once
    (the segments cover the tokens, the mask is 1 exactly on actions, logprobs and weight versions
    on whole actions only). False: the row-by-row check runs and names what is wrong."""
    if not (np.array_equal(ids_off, mask_off) and np.array_equal(ids_off, lp_off)):
        return False
    starts: list[int] = []
    lens: list[int] = []
    action: list[bool] = []
    for r, row in enumerate(rows):
        base, n, pos = int(ids_off[r]), int(ids_off[r + 1] - ids_off[r]), 0
        for s in row["segments"] or ():
            start, end, kind = s["start"], s["end"], s["kind"]
            if start != pos or end < start or end > n or kind not in _KINDS:
                return False
            starts.append(base + start)
            lens.append(end - start)
            action.append(kind == "action")
            pos = end
        if pos != n:
            return False
    seg_start, seg_len, is_action = np.array(starts, np.int64), np.array(lens, np.int64), np.array(action, bool)
    on_action = np.repeat(is_action, seg_len)
    if not np.array_equal(mask_all, on_action.astype(mask_all.dtype)) or (lp_given & ~on_action).any():
        return False
    if not _all_or_none(lp_given, seg_start, seg_len)[is_action].all():
        return False
    if v_null.all():
        return True
    if v_null.any() or not np.array_equal(v_off, ids_off):
        return False  # some rows without versions (an older log's): row by row
    stamped = v_all >= 0
    if (v_all < -1).any() or (stamped & ~on_action).any():
        return False
    return bool(_all_or_none(stamped, seg_start, seg_len)[is_action].all())


def _decode_agreed(
    rows: list[dict[str, Any]], path: Path, first: int, ids_all: np.ndarray, ids_off: np.ndarray, lp_all: np.ndarray,
    lp_given: np.ndarray, v_all: np.ndarray, v_null: np.ndarray,
) -> Iterator[Trajectory]:
    """The rows of a batch :func:`_batch_agrees` passed, as trajectories; what it does not check
    (schema versions, turn rewards, finish reasons, the order of segments) is checked here."""
    for r, row in enumerate(rows):
        where = f"{path}: row {first + r}"
        if row["schema_version"] not in READABLE_VERSIONS:
            raise SchemaVersionError(
                f"{where}: schema version {row['schema_version']!r}, expected one of {READABLE_VERSIONS}"
            )
        a, b = int(ids_off[r]), int(ids_off[r + 1])
        ids = ids_all[a:b].astype(np.int64)  # a copy of its own: a kept trajectory does not keep its batch alive
        lp = lp_all[a:b].copy()
        versions = None if v_null[r] else v_all[a:b].copy()
        for arr in (ids, lp, versions):
            if arr is not None:
                arr.setflags(write=False)
        rewards = row["turn_rewards"] or []
        finish = row.get("finish_reasons")
        try:
            if finish is not None and len(finish) != len(rewards):
                raise CorruptShardError(f"{len(finish)} finish reasons for {len(rewards)} turn rewards")
            segs = row["segments"] or []
            turn0 = segs[0]["turn"] if segs else 0
            segments = []
            for s in segs:
                kind, start, end, turn = _KINDS[s["kind"]], s["start"], s["end"], s["turn"]
                if kind is SegmentKind.ACTION:
                    if not 0 <= turn - turn0 < len(rewards):
                        raise CorruptShardError(f"no turn reward for turn {turn}")
                    whole = end > start
                    segments.append(trusted_segment(
                        kind, ids[start:end], turn, lp[start:end] if whole and lp_given[a + start] else None,
                        rewards[turn - turn0], None if finish is None else finish[turn - turn0],
                        versions[start:end] if whole and versions is not None and versions[start] >= 0 else None,
                    ))
                else:
                    segments.append(trusted_segment(kind, ids[start:end], turn, None, 0.0, None, None))
            images = [load_image_entry(path.parent, e) for e in row.get("images") or ()]
            yield _trajectory(row, segments, images, len(rewards))
        except CorruptShardError as err:
            raise CorruptShardError(f"{where}: {err}") from None
        except ValueError as err:  # the Trajectory checks
            raise CorruptShardError(f"{where}: not a valid trajectory ({err})") from err


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
