"""The episode log: the append-only, checksummed file that makes a trajectory durable when ``write`` returns.

Records are a compact binary form of a row (the format is below), not Parquet: a record must be
appended with one ``os.write``, and a torn last record (a kill mid-write) must be told apart from
damage and cut off. Readers read the logs after the shards, so nothing written is invisible.
"""

from __future__ import annotations

import json
import secrets
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CorruptShardError
from .schema import check_version

# ----------------------------------------------------------------- episode log
# A log file is a header line pair (magic, then JSON facts) and records. A record is
# ``TGR1`` + payload length (u32) + CRC32 of the payload (u32) + payload; the payload is
# u32 length of a JSON object + the object (the small columns, token count, segment kinds,
# turn count, byte lengths of the JSON-text columns) + those texts (UTF-8) + segment
# (start, end, turn) triples (int32) + turn rewards (float64) + token ids (int32), mask
# (int8), logprob values (float32) and "logprob given" flags (uint8), then, when the JSON object has
# ``"v": 1``, the weight versions (int32, one per token); all little-endian. A record without
# ``"v"`` (an older log's, or a row whose policy gave no versions) has none.
_LOG_MAGIC = b"TGLOG1\n"
_REC_MAGIC = b"TGR1"
_REC_HEAD = struct.Struct("<4sII")
_U32 = struct.Struct("<I")


def log_header(meta: dict[str, Any]) -> bytes:
    return _LOG_MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n"


# Columns that hold JSON text already: stored as raw UTF-8, not escaped into the record's JSON again.
_RAW_TEXT = ("sampling", "conformance", "conformance_summary", "metadata")


_KIND_CODE = {"prompt": "p", "action": "a", "observation": "o"}
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}


def encode_row(row: dict[str, Any]) -> bytes:
    """One record, with a random id of its own (``rid``): what tells a record written twice."""
    values, given = row["logprobs"]
    segs = row["segments"]
    versions = row.get("versions")
    meta = {k: v for k, v in row.items()
            if k not in ("token_ids", "mask", "logprobs", "segments", "turn_rewards", "versions", *_RAW_TEXT)}
    texts = [None if row[k] is None else row[k].encode("utf-8") for k in _RAW_TEXT]
    meta["n"] = len(row["token_ids"])
    meta["kinds"] = "".join(_KIND_CODE[s["kind"]] for s in segs)
    meta["turns"] = len(row["turn_rewards"])
    meta["text"] = [None if t is None else len(t) for t in texts]
    meta["rid"] = secrets.token_hex(8)
    if versions is not None:
        meta["v"] = 1
    head = json.dumps(meta, ensure_ascii=False).encode("utf-8")
    payload = b"".join(
        [
            _U32.pack(len(head)),
            head,
            *(t for t in texts if t is not None),
            np.array([(s["start"], s["end"], s["turn"]) for s in segs], dtype="<i4").tobytes(),
            np.array(row["turn_rewards"], dtype="<f8").tobytes(),
            np.ascontiguousarray(row["token_ids"], dtype="<i4").tobytes(),
            np.ascontiguousarray(row["mask"], dtype="i1").tobytes(),
            np.ascontiguousarray(values, dtype="<f4").tobytes(),
            np.ascontiguousarray(given, dtype="u1").tobytes(),
            b"" if versions is None else np.ascontiguousarray(versions, dtype="<i4").tobytes(),
        ]
    )
    return _REC_HEAD.pack(_REC_MAGIC, len(payload), zlib.crc32(payload)) + payload


def _decode_payload(payload: bytes) -> tuple[dict[str, Any], str | None]:
    (hlen,) = _U32.unpack_from(payload, 0)
    row = json.loads(payload[4 : 4 + hlen].decode("utf-8"))
    n, kinds, turns, rid = row.pop("n"), row.pop("kinds"), row.pop("turns"), row.pop("rid", None)
    stamped = row.pop("v", 0) == 1
    at = 4 + hlen
    for key, size in zip(_RAW_TEXT, row.pop("text")):
        row[key] = None if size is None else payload[at : at + size].decode("utf-8")
        at += size or 0
    spans = np.frombuffer(payload, "<i4", 3 * len(kinds), at).reshape(-1, 3).tolist()
    at += 12 * len(kinds)
    row["segments"] = [
        {"kind": _CODE_KIND[k], "start": a, "end": b, "turn": t} for k, (a, b, t) in zip(kinds, spans)
    ]
    row["turn_rewards"] = np.frombuffer(payload, "<f8", turns, at).tolist()
    row.setdefault("finish_reasons", [None] * turns)
    at += 8 * turns
    ids = np.frombuffer(payload, "<i4", n, at)
    mask = np.frombuffer(payload, "i1", n, at + 4 * n)
    values = np.frombuffer(payload, "<f4", n, at + 5 * n)
    given = np.frombuffer(payload, "u1", n, at + 9 * n).astype(bool)
    versions = np.frombuffer(payload, "<i4", n, at + 10 * n).astype(np.int32) if stamped else None
    if at + (14 if stamped else 10) * n != len(payload):
        raise ValueError("record length does not match its token count")
    row.update(token_ids=ids, mask=mask, logprobs=(values, given), versions=versions)
    return row, rid


def _next_whole_record(data: bytes, start: int) -> int | None:
    """The offset of the first whole record (its magic, its length inside the file, its checksum
    right) at or after ``start``, or None: what tells damage from a torn end."""
    at = data.find(_REC_MAGIC, start)
    while at >= 0 and len(data) - at >= _REC_HEAD.size:
        _magic, length, crc = _REC_HEAD.unpack_from(data, at)
        end = at + _REC_HEAD.size + length
        if end <= len(data) and zlib.crc32(data[at + _REC_HEAD.size : end]) == crc:
            return at
        at = data.find(_REC_MAGIC, at + 1)
    return None


@dataclass
class Log:
    path: Path
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    good: int
    """Bytes of the header and the whole records; anything after is a torn last record."""
    size: int
    rids: list[str | None] = field(default_factory=list)
    """Each record's id (``None``: written by an older tokengym)."""
    offsets: list[int] = field(default_factory=list)
    """The byte at which each record starts."""


def read_log(path: Path) -> Log:
    """Parse a log; a torn last record (a kill mid-write) is left out, damage elsewhere is an error."""
    data = path.read_bytes()
    if not data.startswith(_LOG_MAGIC) or b"\n" not in data[len(_LOG_MAGIC) :]:
        if len(data) < 4096 and _LOG_MAGIC.startswith(data[: len(_LOG_MAGIC)]):
            return Log(path, {}, [], 0, len(data))  # killed while writing the header: no record yet
        raise CorruptShardError(f"{path}: not a tokengym episode log")
    end = data.index(b"\n", len(_LOG_MAGIC)) + 1
    try:
        meta = json.loads(data[len(_LOG_MAGIC) : end])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptShardError(f"{path}: unreadable episode log header ({err})") from err
    check_version(meta.get("schema_version"), path)
    rows, rids, offsets, pos = [], [], [], end
    while pos < len(data):
        if len(data) - pos < _REC_HEAD.size:
            break  # torn header of the last record
        magic, length, crc = _REC_HEAD.unpack_from(data, pos)
        body = data[pos + _REC_HEAD.size : pos + _REC_HEAD.size + length]
        if magic != _REC_MAGIC or len(body) != length or zlib.crc32(body) != crc:
            # A torn end is a last record cut short (or a tail of zeros, power loss) with no whole
            # record after it; anything else (a complete record whose checksum fails, a length that
            # points past records that follow) is damage, said, never a silent cut of what follows.
            short = magic == _REC_MAGIC and len(body) < length
            zeros = magic != _REC_MAGIC and not data[pos:].strip(b"\0")
            later = _next_whole_record(data, pos + 1)
            if (short or zeros) and later is None:
                break
            what = (
                f"a whole record follows at byte {later}" if later is not None
                else "the record is whole but its checksum fails" if magic == _REC_MAGIC
                else "no record starts there"
            )
            raise CorruptShardError(
                f"{path}: damaged record at byte {pos} of {len(data)} (not a torn end: {what}); "
                "the records before it are intact: keep a copy of the file, then cut it at that byte "
                f"(truncate -s {pos} {path.name}) to keep them and drop the rest"
            )
        try:
            row, rid = _decode_payload(body)
        except (ValueError, KeyError, UnicodeDecodeError) as err:
            raise CorruptShardError(f"{path}: unreadable record at byte {pos} ({err})") from err
        rows.append(row)
        rids.append(rid)
        offsets.append(pos)
        pos += _REC_HEAD.size + length
    return Log(path, meta, rows, pos, len(data), rids, offsets)
