"""The on-disk trajectory store: an fsynced episode log compacted into Parquet shards.

A store is a directory. Training jobs, notebooks, ``pandas`` and Hugging Face
``datasets`` read its shards without tokengym; tokengym reads it back into exact
:class:`~tokengym.recorder.Trajectory` objects (every token, mask, logprob, reward,
segment and metadata field), the episode log included::

    runs/grpo-0/
        part-00000.parquet    shards: one row per trajectory, written once, never rewritten
        part-00001.parquet
        .part-00002.log       episode log: the trajectories that will become part-00002 (append-only)
        .tokengym.json        manifest: format, schema version, tokenizer, every shard (rows, bytes, sha256)
        .tokengym.lock        held by the one live writer (advisory lock)

The manifest, the log and the lock are hidden files because every common reader skips
those, so they all see the shards only: ``pandas.read_parquet("runs/grpo-0")``,
``pyarrow.parquet.read_table("runs/grpo-0")``, ``datasets.load_dataset("runs/grpo-0")``,
``datasets.load_dataset("parquet", data_dir="runs/grpo-0")`` or
``data_files="runs/grpo-0/*.parquet"``. (A ``_``-prefixed manifest would trip the
``data_dir`` form.) Those readers see a trajectory once its shard is written; tokengym's
readers (:func:`read_trajectories`, :func:`read_table`, ``tokengym inspect``) see it as soon
as :meth:`TrajectoryWriter.write` returned.

Schema (``SCHEMA_VERSION = 2``), one row per trajectory, columns in this order:

===================  ==========================  =================================================
column               type                        meaning
===================  ==========================  =================================================
token_ids            list<int32>                 every token of the episode in the order the
                                                 policy saw them: prompt, a1, o1, a2, ...
mask                 list<int8>                  1 on policy-generated tokens, 0 elsewhere
logprobs             list<float32>               rollout logprob per token; null where the policy
                                                 gave none (prompt, observations, actions
                                                 recorded without logprobs)
segments             list<struct<                the segments in order: ``kind`` is ``prompt``,
                     kind: string,               ``action`` or ``observation``; ``[start, end)``
                     start: int32, end: int32,   indexes ``token_ids``; ``turn`` is the turn
                     turn: int32>>               (0 for the prompt; k for the prompt of a
                                                 later sequence of an episode, history="deploy",
                                                 whose rows share metadata.episode and carry
                                                 metadata.sequence / metadata.sequences)
turn_rewards         list<float64>               reward of each of the row's turns, in order
finish_reasons       list<string>                why each turn's generation stopped, in turn
                                                 order: ``stop`` (a stop token), ``stop_string``,
                                                 ``length`` (cut by the token budget); null where
                                                 unknown (added in version 2)
reward               float64                     the episode return (``Trajectory.reward``)
prompt_len           int32                       tokens in the prompt segment
env_id               string, nullable            gymnasium id, e.g. ``tokengym/Replay-v0``
seed                 int64, nullable             the ``reset`` seed
stop_reason          string, nullable            why the episode ended
terminated           bool                        gymnasium ``terminated``
truncated            bool                        gymnasium ``truncated``
sampling             string, nullable            JSON object: sampling settings of the actions
conformance          string                      JSON list: per-turn chat-template check results
                                                 (status ``ok``, ``known``, ``mismatch``, ``off``, or
                                                 ``deferred``: not compared on its turn, a later
                                                 check covers it)
conformance_summary  string                      JSON object: counts of the above (turns_checked,
                                                 ok, known, mismatch, deferred), mismatches
metadata             string                      JSON object: free-form (task, run ids, ...)
tokenizer_name       string                      display name (a folder's base name, no path)
tokenizer_hash       string                      :func:`tokenizer_fingerprint` (sha256, hex)
schema_version       int32                       ``SCHEMA_VERSION`` of the writer
===================  ==========================  =================================================

``turn_rewards`` is float64 (not float32) so that the reward an env returned comes back
bit for bit. Stores of schema version 1 (no ``finish_reasons`` column) stay readable: their
trajectories have unknown finish reasons, and a writer may append version-2 shards to
them. A logprob that the policy gave as NaN is stored as NaN, not null: null means
"no logprob was given". Each shard's Parquet key-value metadata holds ``tokengym`` = a
JSON object with ``schema_version``, ``tokenizer_name`` and ``tokenizer_hash``; the
manifest holds the same plus ``format``, ``vocab_size``, ``shards`` (one
``{"name", "rows", "bytes", "sha256"}`` per shard, in order) and, when the writer was given
one, ``run`` (the run's settings, e.g. ``tokengym rollout``'s env, sampling and seed). The
episode log's header holds the same three facts as a shard's metadata, and each record one
trajectory in a compact binary form (see ``_encode_row``) with a CRC32.

Guarantees and refusals:

* Durable on return. :meth:`TrajectoryWriter.write` appends the trajectory to the episode
  log (one ``os.write`` of a checksummed record) before it returns. From then on it
  survives the writer being killed (SIGKILL, SIGTERM, a crash): the bytes are in the
  kernel. It survives power loss or an OS crash once the log is fsynced: before ``write``
  returns with ``fsync_interval=0``; at most ``fsync_interval`` seconds later otherwise
  (default 1 s, group commit by a background thread; :meth:`~TrajectoryWriter.flush` and
  :meth:`~TrajectoryWriter.close` fsync at once). A write that fails (disk full) leaves
  nothing behind: the log is cut back to its last whole record, so a retry stores the
  trajectory once.
* Compaction. When the log holds ``shard_size`` trajectories (and on ``flush``/``close``)
  they become one shard: written to a hidden temp file, fsynced, renamed into place
  (``os.replace``), the directory fsynced, the shard listed in the manifest, and only then
  the log removed. A writer that opens a store left by a crashed one recovers: a log
  whose shard was written is dropped (its rows are in the shard, exactly once), any other
  log is taken over (a torn last record, from a kill mid-write, is cut off), temp files
  are removed.
* The store knows its shards: a shard listed in the manifest but missing, a shard on disk
  that the manifest does not list, or one whose row count differs is an error naming the
  file. :func:`accept_shards` (``tokengym inspect DIR --accept-shards``) makes the manifest
  list what is on disk, when a loss is known and accepted. Manifests of older tokengym
  versions list no shards; a writer adds the list.
* A writer on an existing store resumes: it continues the shard numbering and never
  overwrites a shard. It refuses a store of another tokenizer (token ids would mean other
  tokens), of an unknown schema version, with a corrupt shard, or (when given ``run=``)
  recorded with other run settings, and says which.
* Readers refuse the same, naming the file. Shards are written with Parquet page
  checksums, which tokengym's readers verify, so flipped bytes are caught too; log
  records carry a CRC32.

Usage::

    with TrajectoryWriter("runs/grpo-0", tokenizer=tok, shard_size=256) as writer:
        env = RecordEpisodes(env, on_episode=writer.write)
        ...                                   # run episodes
    for traj in read_trajectories("runs/grpo-0"):
        ...
    table = read_table("runs/grpo-0", columns=["reward", "env_id"])
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import struct
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .segments import Segment, SegmentKind
from .stopping import uninterrupted
from .trajectory import Trajectory

try:  # advisory locking is POSIX-only; elsewhere a second writer is simply not detected
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "SCHEMA",
    "SCHEMA_VERSION",
    "CorruptShardError",
    "DiskFullError",
    "RunMismatchError",
    "SchemaVersionError",
    "ShardListError",
    "StoreError",
    "StoreWarning",
    "TokenizerMismatchError",
    "TrajectoryWriter",
    "accept_shards",
    "log_paths",
    "read_table",
    "read_trajectories",
    "run_differences",
    "shard_paths",
    "store_counts",
    "tokenizer_fingerprint",
]

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Schema versions this tokengym reads (version 1 lacks ``finish_reasons``)."""
FORMAT = "tokengym-trajectories"
MANIFEST_NAME = ".tokengym.json"
LOCK_NAME = ".tokengym.lock"
METADATA_KEY = b"tokengym"

_SHARD_RE = re.compile(r"^part-(\d{5,})\.parquet$")
_TEMP_RE = re.compile(r"^\.(part-\d{5,}\.parquet|\.tokengym\.json)\.\d+\.tmp$")
_LOG_RE = re.compile(r"^\.part-(\d{5,})\.log$")

SEGMENT_TYPE = pa.struct(
    [("kind", pa.string()), ("start", pa.int32()), ("end", pa.int32()), ("turn", pa.int32())]
)

SCHEMA = pa.schema(
    [
        ("token_ids", pa.list_(pa.int32())),
        ("mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("segments", pa.list_(SEGMENT_TYPE)),
        ("turn_rewards", pa.list_(pa.float64())),
        ("finish_reasons", pa.list_(pa.string())),
        ("reward", pa.float64()),
        ("prompt_len", pa.int32()),
        ("env_id", pa.string()),
        ("seed", pa.int64()),
        ("stop_reason", pa.string()),
        ("terminated", pa.bool_()),
        ("truncated", pa.bool_()),
        ("sampling", pa.string()),
        ("conformance", pa.string()),
        ("conformance_summary", pa.string()),
        ("metadata", pa.string()),
        ("tokenizer_name", pa.string()),
        ("tokenizer_hash", pa.string()),
        ("schema_version", pa.int32()),
    ]
)

_INT32_MAX = 2**31 - 1


def _schema_of(version: int) -> pa.Schema:
    """The columns a shard of schema ``version`` has."""
    return SCHEMA if version >= 2 else pa.schema([f for f in SCHEMA if f.name != "finish_reasons"])


def _upgrade(batch: pa.RecordBatch, columns: list[str]) -> pa.RecordBatch:
    """A batch of an older shard with the columns it lacks added as nulls, in ``columns`` order."""
    arrays = [
        batch.column(name) if name in batch.schema.names else pa.nulls(batch.num_rows, SCHEMA.field(name).type)
        for name in columns
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema([SCHEMA.field(c) for c in columns]))


# ---------------------------------------------------------------------- errors
class StoreError(ValueError):
    """A store directory cannot be read or written as asked."""


class SchemaVersionError(StoreError):
    """The store (or one shard) was written with a schema version this tokengym does not know."""


class TokenizerMismatchError(StoreError):
    """The store's token ids belong to another tokenizer (or chat template)."""


class CorruptShardError(StoreError):
    """A shard is not a readable tokengym Parquet file (or an episode log is damaged)."""


class ShardListError(StoreError):
    """The shards on disk are not the ones the manifest lists (one is missing, or one is extra)."""


class DiskFullError(StoreError):
    """The store's file system is full (or a file-size limit was hit); nothing partial was kept."""


class RunMismatchError(StoreError):
    """The store was recorded with other run settings (env, sampling, seed, policy) than asked."""


class StoreWarning(UserWarning):
    """Something about a store needs the user's attention (shown by default, unlike ResourceWarning)."""


# ------------------------------------------------------------------ tokenizers
def tokenizer_fingerprint(tokenizer: Any, chat_template: str | Mapping[str, str] | None = None) -> str:
    """A sha256 hex digest that changes when the meaning of a token id could change.

    It covers the vocabulary (every ``token -> id`` item, added tokens included, sorted
    by token) and the chat template text (``chat_template`` when given, else the
    tokenizer's own). Two tokenizers with the same fingerprint map ids to the same tokens
    and render conversations with the same template, so their trajectories can share a
    store. Precisely::

        sha256( b"tokengym-tokenizer-v1\\n"
              + json([[token, id], ...] sorted by token, ensure_ascii=False, separators=(",", ":"))
              + b"\\n" + template text )            # all text UTF-8; a dict of templates as sorted JSON

    ``tokenizer`` may also be a :class:`~tokengym.envs.ChatRenderer`; its template
    override (if any) then counts.
    """
    tok, template = _unwrap(tokenizer, chat_template)
    if isinstance(template, Mapping):
        template = json.dumps(dict(template), sort_keys=True, ensure_ascii=False)
    key = (len(tok), template)
    try:
        cached = _FINGERPRINTS.get(tok, {}).get(key)
    except TypeError:  # an unhashable or non-weak-referenceable tokenizer: no cache
        cached = None
    if cached is not None:
        return cached
    vocab: dict[str, int] = dict(tok.get_vocab())
    for idx, added in getattr(tok, "added_tokens_decoder", {}).items():
        vocab.setdefault(str(getattr(added, "content", added)), int(idx))
    items = sorted((str(t), int(i)) for t, i in vocab.items())
    h = hashlib.sha256(b"tokengym-tokenizer-v1\n")
    h.update(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    h.update(b"\n")
    h.update((template or "").encode("utf-8"))
    digest = h.hexdigest()
    with contextlib.suppress(TypeError):
        _FINGERPRINTS.setdefault(tok, {})[key] = digest
    return digest


# Hashing a 150k-token vocabulary takes a noticeable fraction of a second; writers and
# readers of one process share the result. Keyed by the tokenizer object, its length
# (adding tokens changes it) and the template.
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, dict[tuple[int, str | None], str]] = weakref.WeakKeyDictionary()


def _unwrap(tokenizer: Any, chat_template: Any) -> tuple[Any, Any]:
    """(HF tokenizer, template text) from a tokenizer or a ChatRenderer."""
    from tokengym.envs.render import ChatRenderer

    if isinstance(tokenizer, ChatRenderer):
        template = chat_template if chat_template is not None else tokenizer.chat_template
        tokenizer = tokenizer.tokenizer
    else:
        template = chat_template
    if not hasattr(tokenizer, "get_vocab"):
        raise TypeError(f"expected a Hugging Face tokenizer or a ChatRenderer, got {type(tokenizer).__name__}")
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    return tokenizer, template


def _display_name(tokenizer: Any) -> str:
    """The tokenizer's name without a local path: a folder's base name, a hub name as is."""
    tok, _ = _unwrap(tokenizer, None)
    name = str(getattr(tok, "name_or_path", "") or type(tok).__name__)
    if os.path.isabs(name) or (os.sep in name.rstrip(os.sep) and os.path.exists(name)):
        name = os.path.basename(os.path.normpath(name))
    return name


# ------------------------------------------------------------------ file helpers
def shard_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """The store's complete shards, in write order (temp files of a crashed writer excluded).

    Handy for ``datasets.load_dataset("parquet", data_files=[str(p) for p in shard_paths(d)])``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no trajectory store at {root}: not a directory")
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _SHARD_RE.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _atomic_write(final: Path, write: Any) -> None:
    """Write via ``write(fileobj)`` to a hidden temp file beside ``final``, fsync, rename into place."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(final.parent)


def _read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: unreadable manifest ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{path}: not a tokengym trajectory store manifest")
    _check_version(manifest.get("schema_version"), path)
    return manifest


def _check_version(version: Any, where: Path) -> None:
    if version not in READABLE_VERSIONS:
        hint = (
            "it was written by a newer tokengym: upgrade to read it"
            if isinstance(version, int) and version > SCHEMA_VERSION
            else "it is not a schema this tokengym knows"
        )
        raise SchemaVersionError(
            f"{where}: schema version {version!r}, but this tokengym reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; {hint}"
        )


@dataclass(frozen=True)
class _ShardInfo:
    path: Path
    schema_version: int
    tokenizer_name: str
    tokenizer_hash: str
    num_rows: int


def _open_shard(path: Path) -> tuple[pq.ParquetFile, _ShardInfo]:
    """Open a shard and check its footer, its tokengym metadata and its schema version."""
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
        kv = pf.schema_arrow.metadata or {}
    except (OSError, pa.ArrowException, ValueError) as err:
        raise CorruptShardError(f"{path}: corrupt or truncated shard, not a readable Parquet file ({err})") from err
    try:
        raw = kv.get(METADATA_KEY)
        try:
            meta = json.loads(raw) if raw is not None else None
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptShardError(f"{path}: unreadable tokengym metadata ({err})") from err
        if not isinstance(meta, dict):
            raise CorruptShardError(f"{path}: a Parquet file without tokengym metadata, not a trajectory shard")
        _check_version(meta.get("schema_version"), path)
        have = pf.schema_arrow
        wrong = [
            f.name for f in _schema_of(meta["schema_version"]) if f.name not in have.names or have.field(f.name).type != f.type
        ]
        if wrong:
            raise CorruptShardError(f"{path}: columns missing or of another type than the schema's: {wrong}")
    except BaseException:
        pf.close()
        raise
    info = _ShardInfo(
        path=path,
        schema_version=int(meta["schema_version"]),
        tokenizer_name=str(meta.get("tokenizer_name")),
        tokenizer_hash=str(meta.get("tokenizer_hash")),
        num_rows=pf.metadata.num_rows,
    )
    return pf, info


def _mismatch(where: Path, have_name: str, have_hash: str, want_name: str, want_hash: str) -> TokenizerMismatchError:
    return TokenizerMismatchError(
        f"{where} holds token ids of tokenizer {have_name!r} (fingerprint {have_hash}), "
        f"not of {want_name!r} (fingerprint {want_hash}); token ids of different tokenizers "
        "or chat templates must not share a store: use another directory"
    )


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
        return json.dumps(value, default=default, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the trajectory's {what} cannot be stored as JSON: {err}") from err


# ----------------------------------------------------------------- episode log
# A log file is a header line pair (magic, then JSON facts) and records. A record is
# ``TGR1`` + payload length (u32) + CRC32 of the payload (u32) + payload; the payload is
# u32 length of a JSON object + the object (the small columns, token count, segment kinds,
# turn count, byte lengths of the JSON-text columns) + those texts (UTF-8) + segment
# (start, end, turn) triples (int32) + turn rewards (float64) + token ids (int32), mask
# (int8), logprob values (float32) and "logprob given" flags (uint8); all little-endian.
_LOG_MAGIC = b"TGLOG1\n"
_REC_MAGIC = b"TGR1"
_REC_HEAD = struct.Struct("<4sII")
_U32 = struct.Struct("<I")
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def log_paths(directory: str | os.PathLike[str]) -> list[Path]:
    """The store's episode logs (hidden ``.part-NNNNN.log`` files), in index order."""
    root = Path(directory)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _LOG_RE.match(p.name)) and p.is_file()]
    return [p for _, p in sorted(found)]


def _index(path: Path) -> int:
    m = _SHARD_RE.match(path.name) or _LOG_RE.match(path.name)
    assert m is not None, path
    return int(m.group(1))


def _shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def _log_name(index: int) -> str:
    return f".part-{index:05d}.log"


def _log_header(meta: dict[str, Any]) -> bytes:
    return _LOG_MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n"


# Columns that hold JSON text already: stored as raw UTF-8, not escaped into the record's JSON again.
_RAW_TEXT = ("sampling", "conformance", "conformance_summary", "metadata")


_KIND_CODE = {"prompt": "p", "action": "a", "observation": "o"}
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}


def _encode_row(row: dict[str, Any]) -> bytes:
    values, given = row["logprobs"]
    segs = row["segments"]
    meta = {k: v for k, v in row.items() if k not in ("token_ids", "mask", "logprobs", "segments", "turn_rewards", *_RAW_TEXT)}
    texts = [None if row[k] is None else row[k].encode("utf-8") for k in _RAW_TEXT]
    meta["n"] = len(row["token_ids"])
    meta["kinds"] = "".join(_KIND_CODE[s["kind"]] for s in segs)
    meta["turns"] = len(row["turn_rewards"])
    meta["text"] = [None if t is None else len(t) for t in texts]
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
        ]
    )
    return _REC_HEAD.pack(_REC_MAGIC, len(payload), zlib.crc32(payload)) + payload


def _decode_payload(payload: bytes) -> dict[str, Any]:
    (hlen,) = _U32.unpack_from(payload, 0)
    row = json.loads(payload[4 : 4 + hlen].decode("utf-8"))
    n, kinds, turns = row.pop("n"), row.pop("kinds"), row.pop("turns")
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
    if at + 10 * n != len(payload):
        raise ValueError("record length does not match its token count")
    row.update(token_ids=ids, mask=mask, logprobs=(values, given))
    return row


@dataclass
class _Log:
    path: Path
    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    good: int
    """Bytes of the header and the whole records; anything after is a torn last record."""
    size: int


def _read_log(path: Path) -> _Log:
    """Parse a log; a torn last record (a kill mid-write) is left out, damage elsewhere is an error."""
    data = path.read_bytes()
    if not data.startswith(_LOG_MAGIC) or b"\n" not in data[len(_LOG_MAGIC) :]:
        if len(data) < 4096 and _LOG_MAGIC.startswith(data[: len(_LOG_MAGIC)]):
            return _Log(path, {}, [], 0, len(data))  # killed while writing the header: no record yet
        raise CorruptShardError(f"{path}: not a tokengym episode log")
    end = data.index(b"\n", len(_LOG_MAGIC)) + 1
    try:
        meta = json.loads(data[len(_LOG_MAGIC) : end])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptShardError(f"{path}: unreadable episode log header ({err})") from err
    _check_version(meta.get("schema_version"), path)
    rows, pos = [], end
    while pos < len(data):
        if len(data) - pos < _REC_HEAD.size:
            break  # torn header of the last record
        magic, length, crc = _REC_HEAD.unpack_from(data, pos)
        body = data[pos + _REC_HEAD.size : pos + _REC_HEAD.size + length]
        last = pos + _REC_HEAD.size + length >= len(data)
        if magic != _REC_MAGIC or len(body) != length or zlib.crc32(body) != crc:
            if last or magic != _REC_MAGIC and not data[pos:].strip(b"\0"):
                break  # the last record was cut short, or the file ends in zeros (power loss)
            raise CorruptShardError(
                f"{path}: damaged record at byte {pos} of {len(data)} (checksum mismatch, not a torn end); "
                "the records before it are intact: keep a copy of the file, then cut it at that byte "
                f"(truncate -s {pos} {path.name}) to keep them and drop the rest"
            )
        try:
            rows.append(_decode_payload(body))
        except (ValueError, KeyError, UnicodeDecodeError) as err:
            raise CorruptShardError(f"{path}: unreadable record at byte {pos} ({err})") from err
        pos += _REC_HEAD.size + length
    return _Log(path, meta, rows, pos, len(data))


# -------------------------------------------------------------------- manifest
def _shard_entry(path: Path, data: bytes | None = None, rows: int | None = None) -> dict[str, Any]:
    """A manifest entry: name, rows, bytes and sha256 of a shard (read from disk unless given)."""
    if data is None:
        data = path.read_bytes()
    if rows is None:
        pf, info = _open_shard(path)
        pf.close()
        rows = info.num_rows
    return {"name": path.name, "rows": rows, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _write_manifest(root: Path, body: dict[str, Any]) -> None:
    text = json.dumps(body, indent=2).encode() + b"\n"
    _atomic_write(root / MANIFEST_NAME, lambda f: f.write(text))


def _repair_hint(root: Path) -> str:
    return (
        f"restore the file, or accept the store as it is on disk with `tokengym inspect {root} --accept-shards` "
        "(tokengym.recorder.store.accept_shards)"
    )


def _flat_items(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, Mapping):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def run_differences(stored: Mapping[str, Any], asked: Mapping[str, Any]) -> list[str]:
    """``"key: stored X, asked Y"`` for every setting that differs between two run records."""
    a, b = _flat_items(json.loads(json.dumps(stored))), _flat_items(json.loads(json.dumps(asked)))
    return [f"{k}: stored {a.get(k, '(unset)')!r}, asked {b.get(k, '(unset)')!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


# ---------------------------------------------------------------------- writer
class TrajectoryWriter:
    """Appends trajectories to a store directory: each one to the episode log at once,
    ``shard_size`` at a time into a Parquet shard.

    Use as a context manager, or call :meth:`close`. Its :meth:`write` fits
    ``RecordEpisodes(env, on_episode=writer.write)`` and ``rollout(..., on_episode=writer.write)``.

    What "``write`` returned" guarantees (see the module docstring for the mechanism):

    * ``fsync_interval=0``: the trajectory is on stable storage (fsynced): it survives
      SIGKILL, SIGTERM, a crash of the process and power loss.
    * ``fsync_interval=t > 0`` (default 1.0): it survives SIGKILL, SIGTERM and any crash of
      the process at once, and power loss or an OS crash once the log is fsynced, at most
      ``t`` seconds later (one background fsync covers every write of the window).

    Args:
        directory: the store; created if missing, resumed if it holds shards or a log.
        tokenizer: the tokenizer (or :class:`~tokengym.envs.ChatRenderer`) whose ids the
            trajectories hold; its fingerprint guards the store against mixing tokenizers.
        chat_template: the template in use when it overrides the tokenizer's own.
        tokenizer_name: the name to record (default: the tokenizer's name, without a local path).
        shard_size: trajectories per shard (fewer, larger files with more; a crash loses
            nothing either way).
        compression: Parquet compression codec.
        fsync_interval: seconds between group fsyncs of the log; 0 fsyncs in every ``write``.
        run: the settings of the run that writes (env, sampling, seed, ...), a JSON object.
            Recorded in the manifest of a new store; a store recorded with other settings is
            refused with the differences named (:class:`RunMismatchError`).

    Raises:
        TokenizerMismatchError, SchemaVersionError, CorruptShardError, ShardListError,
            RunMismatchError: the directory cannot be appended to (the message names the file).
        StoreError: another live writer holds the directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        tokenizer: Any,
        chat_template: str | None = None,
        tokenizer_name: str | None = None,
        shard_size: int = 1000,
        compression: str = "zstd",
        fsync_interval: float = 1.0,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"shard_size must be a positive integer, got {shard_size!r}")
        if not fsync_interval >= 0:
            raise ValueError(f"fsync_interval must be >= 0 seconds, got {fsync_interval!r}")
        tok, _ = _unwrap(tokenizer, chat_template)
        self.directory = Path(directory)
        self.shard_size = shard_size
        self.compression = compression
        self.fsync_interval = float(fsync_interval)
        self.tokenizer_hash = tokenizer_fingerprint(tokenizer, chat_template)
        self.tokenizer_name = tokenizer_name or _display_name(tokenizer)
        self.vocab_size = len(tok)
        self.num_written = 0  # trajectories this writer made durable (in the log, then in shards)
        self.recovered = 0  # trajectories taken over from a crashed writer's log
        self.shards_written: list[Path] = []
        self._rows: list[dict[str, Any]] = []
        self._closed = True
        self._lock_fd: int | None = None
        self._log_fd: int | None = None
        self._log_path: Path | None = None
        self._log_size = 0
        self._dirty = False
        self._mutex = threading.RLock()
        self._wake = threading.Event()
        self._syncer: threading.Thread | None = None
        self._retry_at = shard_size
        self._file_meta = {
            METADATA_KEY: json.dumps(
                {
                    "schema_version": SCHEMA_VERSION,
                    "tokenizer_name": self.tokenizer_name,
                    "tokenizer_hash": self.tokenizer_hash,
                }
            ).encode()
        }

        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._open(dict(run) if run is not None else None)
        except BaseException:
            self._close_log()
            self._unlock()
            raise
        self._closed = False

    # ---------------------------------------------------------------- opening
    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            raise StoreError(
                f"{self.directory}: another TrajectoryWriter is writing to this store; "
                "one writer per directory (give each worker its own directory)"
            ) from err
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _open(self, run: dict[str, Any] | None) -> None:
        """Check the store, recover a crashed writer's log and temp files, find the next shard index."""
        root = self.directory
        manifest = _read_manifest(root)
        if manifest is not None and manifest.get("tokenizer_hash") != self.tokenizer_hash:
            raise _mismatch(
                root / MANIFEST_NAME,
                str(manifest.get("tokenizer_name")),
                str(manifest.get("tokenizer_hash")),
                self.tokenizer_name,
                self.tokenizer_hash,
            )
        shards = shard_paths(root)
        for path in shards:
            pf, info = _open_shard(path)
            pf.close()
            if info.tokenizer_hash != self.tokenizer_hash:
                raise _mismatch(path, info.tokenizer_name, info.tokenizer_hash, self.tokenizer_name, self.tokenizer_hash)
        logs = {_index(p): p for p in log_paths(root)}
        listed: dict[str, dict[str, Any]] | None = None
        if manifest is not None and isinstance(manifest.get("shards"), list):
            listed = {e["name"]: e for e in manifest["shards"]}
        entries: list[dict[str, Any]] = []
        on_disk = {p.name for p in shards}
        if listed is not None:
            missing = sorted(set(listed) - on_disk)
            if missing:
                raise ShardListError(
                    f"{root / missing[0]}: listed in the manifest ({listed[missing[0]]['rows']} trajectories) "
                    f"but missing{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; {_repair_hint(root)}"
                )
        for path in shards:
            if listed is not None and path.name in listed:
                entry = listed[path.name]
                pf, info = _open_shard(path)
                pf.close()
                if info.num_rows != entry["rows"]:
                    raise CorruptShardError(
                        f"{path}: {info.num_rows} rows, but the manifest lists {entry['rows']}; {_repair_hint(root)}"
                    )
                entries.append(entry)
            elif listed is None:  # a store of an older tokengym, or a lost manifest: adopt the shards
                entries.append(_shard_entry(path))
            elif _index(path) in logs:  # killed between the shard's rename and the manifest update
                log = _read_log(logs[_index(path)])
                entry = _shard_entry(path)
                if entry["rows"] != len(log.rows):
                    raise CorruptShardError(
                        f"{path}: {entry['rows']} rows, but its episode log {log.path.name} holds {len(log.rows)}"
                    )
                entries.append(entry)
            else:
                raise ShardListError(
                    f"{path}: a shard the manifest does not list (not written by this store's writers); "
                    f"move it away, or {_repair_hint(root).replace('restore the file, or ', '')}"
                )
        # We hold the lock, so any temp file is a dead writer's unfinished shard or manifest.
        for p in root.iterdir():
            if _TEMP_RE.match(p.name):
                p.unlink()
        body = dict(manifest or {})
        body.update(
            format=FORMAT,
            schema_version=SCHEMA_VERSION,
            tokenizer_name=body.get("tokenizer_name", self.tokenizer_name),
            tokenizer_hash=self.tokenizer_hash,
            vocab_size=body.get("vocab_size", self.vocab_size),
            shards=entries,
        )
        stored = sum(e["rows"] for e in entries)
        pending: list[_Log] = []
        for index, path in sorted(logs.items()):
            if _shard_name(index) in {e["name"] for e in entries}:
                path.unlink()  # its rows are in the shard already
                continue
            log = _read_log(path)
            if log.rows and log.meta.get("tokenizer_hash") != self.tokenizer_hash:
                raise _mismatch(
                    path, str(log.meta.get("tokenizer_name")), str(log.meta.get("tokenizer_hash")),
                    self.tokenizer_name, self.tokenizer_hash,
                )
            pending.append(log)
        stored += sum(len(log.rows) for log in pending)
        if run is not None:
            have = body.get("run")
            if have is None and stored:
                raise RunMismatchError(
                    f"{root}: holds {stored} trajectories recorded without run settings (by an older tokengym "
                    "or a TrajectoryWriter without run=); refusing to mix another run in: use another directory"
                )
            if have is not None and (diff := run_differences(have, run)):
                raise RunMismatchError(
                    f"{root} was recorded with other run settings: {'; '.join(diff)}. "
                    "Use the same settings to continue it, or another directory"
                )
            body["run"] = run
        self._manifest = body
        self._next_index = max([_index(root / e["name"]) + 1 for e in entries], default=0)
        _write_manifest(root, body)
        # Every uncompacted log but the newest becomes a shard now; the newest is taken over.
        for log in pending:
            self._next_index = max(self._next_index, _index(log.path))
            self._rows = log.rows
            self.recovered += len(log.rows)
            if not log.rows:
                log.path.unlink()
                continue
            self._log_fd, self._log_path = os.open(log.path, os.O_WRONLY | os.O_APPEND), log.path
            if log.good != log.size:
                os.ftruncate(self._log_fd, log.good)  # cut a torn last record off
                os.fsync(self._log_fd)
            self._log_size = log.good
            if log is not pending[-1] or len(self._rows) >= self.shard_size:
                self._compact()  # killed before (or while) this shard was written

    # ---------------------------------------------------------------- writing
    def write(self, trajectory: Trajectory) -> None:
        """Append one trajectory to the episode log; a full log becomes a shard.

        When this returns, the trajectory is durable as the class docstring says. The
        trajectory is converted at once, so a value that cannot be stored (metadata that
        is not JSON, token ids outside the vocabulary) raises here and nothing is written.

        Raises:
            DiskFullError: no space (or a file-size limit) for the record; nothing of it was
                kept, so writing it again after freeing space stores it once.
            StoreError: the writer is closed, or the log cannot be written.
        """
        if self._closed:
            raise StoreError(f"{self.directory}: the writer is closed")
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"expected a Trajectory, got {type(trajectory).__name__}")
        row = self._row(trajectory)
        record = _encode_row(row)
        with self._mutex, uninterrupted():  # a stop signal waits until the bookkeeping is done
            if self._closed:
                raise StoreError(f"{self.directory}: the writer is closed")
            self._append(record)
            self._rows.append(row)
            self.num_written += 1
            if len(self._rows) >= self._retry_at:
                self._try_compact()

    def _append(self, record: bytes) -> None:
        """One record onto the log, all or nothing; fsynced here when ``fsync_interval`` is 0."""
        new = self._log_fd is None
        try:
            if new:
                path = self.directory / _log_name(self._next_index)
                self._log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
                self._log_path, self._log_size = path, 0
                meta = {
                    "schema_version": SCHEMA_VERSION,
                    "tokenizer_name": self.tokenizer_name,
                    "tokenizer_hash": self.tokenizer_hash,
                }
                record = _log_header(meta) + record
            view = memoryview(record)
            while view:
                view = view[os.write(self._log_fd, view) :]  # type: ignore[arg-type]
            if self.fsync_interval == 0 or new:
                os.fsync(self._log_fd)  # type: ignore[arg-type]
            if new:
                _fsync_dir(self.directory)  # the new log's directory entry
        except OSError as err:
            self._cut_back(new)
            raise self._write_error(err, "the trajectory was not stored") from err
        self._log_size += len(record)
        if self.fsync_interval > 0:
            self._dirty = True
            self._start_syncer()

    def _cut_back(self, new: bool) -> None:
        """Undo a failed append: the log ends with its last whole record again."""
        if self._log_fd is None:
            return
        try:
            if new:
                os.close(self._log_fd)
                self._log_fd = None
                if self._log_path is not None:
                    self._log_path.unlink()
            else:
                os.ftruncate(self._log_fd, self._log_size)
        except OSError as err:  # pragma: no cover - shrinking a file needs no space
            self._closed = True
            raise StoreError(
                f"{self.directory}: a failed write could not be undone ({err}); the writer is closed. The log's "
                "whole records are safe: open a new writer, which cuts the partial record off"
            ) from err

    def _write_error(self, err: OSError, what: str) -> StoreError:
        if err.errno in _DISK_FULL:
            return DiskFullError(
                f"{self.directory}: no space left to write the store ({err.strerror}); {what}. "
                f"Every trajectory written before is safe. Free space (or raise the limit), then write again"
            )
        return StoreError(f"{self.directory}: writing the store failed ({err}); {what}")

    def _start_syncer(self) -> None:
        if self._syncer is not None and self._syncer.is_alive():
            return
        ref = weakref.ref(self)  # the thread must not keep a dropped writer alive
        wake, interval = self._wake, self.fsync_interval

        def loop() -> None:
            while not wake.wait(interval):
                writer = ref()
                if writer is None or writer._closed:
                    return
                writer._sync(quiet=True)
                del writer

        self._syncer = threading.Thread(target=loop, name="tokengym-store-fsync", daemon=True)
        self._syncer.start()

    def _sync(self, quiet: bool = False) -> None:
        """fsync the log if anything was appended since the last fsync.

        The fsync runs on a duplicate of the log's descriptor, outside the lock, so writes go on
        meanwhile (and a compaction that closes the log cannot hand its number to another file).
        """
        with self._mutex:
            if not self._dirty or self._log_fd is None:
                return
            fd = os.dup(self._log_fd)
            self._dirty = False
        try:
            os.fsync(fd)
        except OSError as err:
            self._dirty = True
            if not quiet:
                raise self._write_error(err, "the log could not be fsynced") from err
            warnings.warn(f"{self.directory}: fsync of the episode log failed ({err})", StoreWarning, stacklevel=1)
        finally:
            os.close(fd)

    def _row(self, t: Trajectory) -> dict[str, Any]:
        ids = t.token_ids
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(
                f"the trajectory has token ids outside [0, {self.vocab_size}) of tokenizer "
                f"{self.tokenizer_name!r}: was it recorded with another tokenizer?"
            )
        if len(ids) > _INT32_MAX:
            raise ValueError(f"a trajectory of {len(ids)} tokens does not fit int32 offsets")
        values = np.full(len(ids), np.nan, dtype=np.float32)
        given = np.zeros(len(ids), dtype=bool)
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
        }

    def _table(self, rows: list[dict[str, Any]]) -> pa.Table:
        return _rows_table(rows, self.tokenizer_name, self.tokenizer_hash, self._file_meta)

    def _try_compact(self) -> None:
        """Compact inside ``write``: a failure keeps the trajectories in the log and warns; ``write`` succeeded."""
        try:
            self._compact()
        except (OSError, StoreError) as err:
            self._retry_at = len(self._rows) + self.shard_size
            warnings.warn(
                f"{self.directory}: could not write shard {_shard_name(self._next_index)} ({err}); its "
                f"{len(self._rows)} trajectories stay safe in the episode log {_log_name(self._next_index)} and "
                f"the shard is tried again after {self.shard_size} more writes or at close",
                StoreWarning,
                stacklevel=3,
            )

    def _compact(self) -> Path | None:
        """The log's trajectories as one shard: temp file, fsync, rename, manifest, then the log removed."""
        if not self._rows:
            return None
        table = self._table(self._rows)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression=self.compression, write_page_checksum=True)
        data = sink.getvalue().to_pybytes()
        final = self.directory / _shard_name(self._next_index)
        if final.exists():  # another process ignored the lock; never overwrite a shard
            raise StoreError(f"{final} already exists: refusing to overwrite a shard")
        try:
            _atomic_write(final, lambda f: f.write(data))
        except OSError as err:
            raise self._write_error(err, f"shard {final.name} was not written") from err
        entry = {"name": final.name, "rows": len(self._rows), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self._manifest["shards"] = [*self._manifest["shards"], entry]
        try:
            _write_manifest(self.directory, self._manifest)
        except OSError as err:
            # The shard is complete and its log still there: the next writer lists it.
            self._manifest["shards"] = self._manifest["shards"][:-1]
            final.unlink()
            raise self._write_error(err, f"shard {final.name} could not be listed in the manifest") from err
        log = self._log_path
        self._close_log()
        if log is not None:
            log.unlink(missing_ok=True)
        self._next_index += 1
        self.shards_written.append(final)
        self._rows = []
        self._retry_at = self.shard_size
        return final

    def _close_log(self) -> None:
        if self._log_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._log_fd)
            self._log_fd = None
        self._log_path = None
        self._log_size = 0
        self._dirty = False

    def flush(self) -> Path | None:
        """fsync the log and write its trajectories as one complete shard now; return its path
        (None if the log was empty)."""
        with self._mutex:
            if self._closed:
                if self._rows:
                    raise StoreError(f"{self.directory}: the writer is closed")
                return None
            self._sync()
            with uninterrupted():
                return self._compact()

    @property
    def pending(self) -> int:
        """Trajectories in the episode log (durable, readable), not yet in a shard."""
        return len(self._rows)

    @property
    def run(self) -> dict[str, Any] | None:
        """The run settings recorded in the manifest (None when none were given)."""
        return self._manifest.get("run")

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed writer accepts nothing more."""
        return self._closed

    def close(self) -> None:
        """Compact the log into a shard and release the directory. Idempotent.

        If the shard cannot be written (disk full), the trajectories stay in the fsynced
        log, readable, and the next writer compacts them; the error says so.
        """
        if self._closed:
            return
        with self._mutex, uninterrupted():
            self._wake.set()
            try:
                self._sync()
                self._compact()
            except (OSError, StoreError) as err:
                n = len(self._rows)
                raise StoreError(
                    f"{err}. The writer is closed; its {n} trajectories since the last shard are safe in the "
                    f"episode log in {self.directory} (readers see them) and the next "
                    "writer on this directory turns them into a shard"
                ) from err
            finally:
                self._closed = True
                self._close_log()
                self._unlock()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The logged trajectories are complete episodes, so they become a shard even when the body raised.
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        n = len(self._rows)
        with contextlib.suppress(Exception):
            self._wake.set()
            if self._log_fd is not None and self._dirty:
                os.fsync(self._log_fd)
        self._closed = True
        self._close_log()
        self._unlock()
        if n:
            warnings.warn(
                f"TrajectoryWriter({str(self.directory)!r}) was dropped without close(): none of its trajectories "
                f"is lost, but {n} of them are still in the episode log {_log_name(self._next_index)}, not in a "
                "shard (tokengym readers see them; the next writer on this directory compacts them). Close writers "
                "or use `with`",
                StoreWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        return (
            f"TrajectoryWriter({str(self.directory)!r}, tokenizer={self.tokenizer_name!r}, "
            f"shard_size={self.shard_size}, written={self.num_written}, pending={self.pending})"
        )


def _rows_table(rows: list[dict[str, Any]], name: str, fingerprint: str, file_meta: dict[bytes, bytes]) -> pa.Table:
    """Converted rows (``TrajectoryWriter._row``) as a table of :data:`SCHEMA`."""

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
    for field in SCHEMA:
        if field.name not in columns:
            columns[field.name] = pa.array(col(field.name), field.type)
    return pa.Table.from_arrays([columns[f.name] for f in SCHEMA], schema=SCHEMA.with_metadata(file_meta))


# ---------------------------------------------------------------------- readers
@dataclass
class _Snapshot:
    """What a reader sees: the manifest, the shards to read, and the logs' rows (read in full)."""

    root: Path
    manifest: dict[str, Any] | None
    shards: list[Path]
    logs: list[_Log]
    want: tuple[str, str] | None


def _snapshot(directory: str | os.PathLike[str], tokenizer: Any, chat_template: Any) -> _Snapshot:
    """The store's shards and logs, checked against the manifest's shard list.

    A live writer may compact while we look (rename a shard, list it, remove its log): a
    listing that disagrees with the manifest, or a log that vanished, is looked at again
    before it counts as an error. A log is read whole here, so it cannot vanish later.
    """
    root = Path(directory)
    want = None
    if tokenizer is not None:
        want = (_display_name(tokenizer), tokenizer_fingerprint(tokenizer, chat_template))
    for attempt in range(5):
        try:
            return _snapshot_once(root, want)
        except (ShardListError, FileNotFoundError):
            if attempt == 4 or not root.is_dir():
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _snapshot_once(root: Path, want: tuple[str, str] | None) -> _Snapshot:
    manifest = _read_manifest(root)
    shards = shard_paths(root)  # FileNotFoundError when not a directory
    logs = {_index(p): p for p in log_paths(root)}
    if want is not None and manifest is not None and manifest.get("tokenizer_hash") != want[1]:
        raise _mismatch(
            root / MANIFEST_NAME, str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")), *want
        )
    if manifest is not None and isinstance(manifest.get("shards"), list):
        listed = {e["name"]: e for e in manifest["shards"]}
        on_disk = {p.name for p in shards}
        for name, entry in listed.items():
            if name not in on_disk:
                raise ShardListError(
                    f"{root / name}: listed in the manifest ({entry['rows']} trajectories) but missing; "
                    f"{_repair_hint(root)}"
                )
        for p in shards:
            if p.name not in listed and _index(p) not in logs:
                raise ShardListError(
                    f"{p}: a shard the manifest does not list (not written by this store's writers); move it "
                    f"away, or {_repair_hint(root).replace('restore the file, or ', '')}"
                )
    shard_index = {_index(p) for p in shards}
    read = [_read_log(p) for i, p in sorted(logs.items()) if i not in shard_index]  # FileNotFoundError: compacted
    if manifest is not None and want is None:
        want = (str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")))
    return _Snapshot(root, manifest, shards, [log for log in read if log.rows], want)


def _shard_sources(snap: _Snapshot) -> Iterator[tuple[pq.ParquetFile, _ShardInfo]]:
    """Open each shard in order, checking schema version, tokenizer and listed row count."""
    listed = None
    if snap.manifest is not None and isinstance(snap.manifest.get("shards"), list):
        listed = {e["name"]: e for e in snap.manifest["shards"]}
    want = snap.want
    for path in snap.shards:
        pf, info = _open_shard(path)
        if want is None:
            want = (info.tokenizer_name, info.tokenizer_hash)
        elif info.tokenizer_hash != want[1]:
            pf.close()
            raise _mismatch(path, info.tokenizer_name, info.tokenizer_hash, *want)
        entry = (listed or {}).get(path.name)
        if entry is not None and entry["rows"] != info.num_rows:
            pf.close()
            raise CorruptShardError(
                f"{path}: corrupt or replaced: {info.num_rows} rows, but the manifest lists {entry['rows']}; "
                f"{_repair_hint(snap.root)}"
            )
        yield pf, info
    snap.want = want


def _log_tables(snap: _Snapshot) -> Iterator[tuple[pa.Table, Path]]:
    for log in snap.logs:
        name, fingerprint = str(log.meta.get("tokenizer_name")), str(log.meta.get("tokenizer_hash"))
        if snap.want is not None and fingerprint != snap.want[1]:
            raise _mismatch(log.path, name, fingerprint, *snap.want)
        meta = {METADATA_KEY: json.dumps({"schema_version": SCHEMA_VERSION, "tokenizer_name": name, "tokenizer_hash": fingerprint}).encode()}
        try:
            table = _rows_table(log.rows, name, fingerprint, meta)
        except (pa.ArrowException, ValueError, KeyError, TypeError) as err:
            raise CorruptShardError(f"{log.path}: a record does not fit the schema ({err})") from err
        yield table, log.path


def _store_batches(
    directory: str | os.PathLike[str],
    tokenizer: Any,
    chat_template: Any,
    columns: list[str] | None,
    batch_size: int,
) -> Iterator[tuple[pa.RecordBatch, Path, int]]:
    """``(batch, file, first row of the batch in that file)`` over the shards, then the episode logs."""
    snap = _snapshot(directory, tokenizer, chat_template)
    for pf, info in _shard_sources(snap):
        with pf:
            try:
                first = 0
                want = columns if columns is not None else SCHEMA.names
                have = [c for c in want if c in _schema_of(info.schema_version).names]
                for batch in pf.iter_batches(batch_size=batch_size, columns=have):
                    yield (batch if have == want else _upgrade(batch, want)), info.path, first
                    first += batch.num_rows
            except StoreError:
                raise
            except (OSError, pa.ArrowException, ValueError) as err:
                raise CorruptShardError(f"{info.path}: corrupt shard ({err})") from err
    for table, path in _log_tables(snap):
        first = 0
        for batch in table.select(columns if columns is not None else SCHEMA.names).to_batches(max_chunksize=batch_size):
            yield batch, path, first
            first += batch.num_rows


def read_table(
    directory: str | os.PathLike[str],
    *,
    columns: list[str] | None = None,
    tokenizer: Any = None,
    chat_template: str | None = None,
) -> pa.Table:
    """All shards and the episode log as one :class:`pyarrow.Table` (the schema in this module's docstring).

    Args:
        columns: read only these columns (faster for e.g. ``["reward", "env_id"]``).
        tokenizer: when given, refuse a store of another tokenizer.
    """
    batches = [b for b, _, _ in _store_batches(directory, tokenizer, chat_template, columns, 1 << 16)]
    schema = SCHEMA if columns is None else pa.schema([SCHEMA.field(c) for c in columns])
    if not batches:
        return schema.empty_table()
    return pa.Table.from_batches([b.cast(schema) if b.schema != schema else b for b in batches], schema=schema)


def read_trajectories(
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    chat_template: str | None = None,
    batch_size: int = 64,
) -> Iterator[Trajectory]:
    """Yield the store's trajectories in write order (shard by shard, then the episode log) as exact
    :class:`Trajectory` objects: every trajectory whose ``write`` returned.

    Streams: at most ``batch_size`` rows are decoded at a time. Each row is checked
    (segments cover the tokens, mask agrees with segment kinds, one reward per turn); a
    shard that fails raises :class:`CorruptShardError` naming it.

    Args:
        tokenizer: when given, refuse a store of another tokenizer.
    """
    for batch, path, first in _store_batches(directory, tokenizer, chat_template, SCHEMA.names, batch_size):
        try:
            yield from _decode_batch(batch, path, first)
        except StoreError:
            raise
        except (OSError, pa.ArrowException, ValueError) as err:
            raise CorruptShardError(f"{path}: corrupt shard ({err})") from err


def store_counts(directory: str | os.PathLike[str]) -> dict[str, int]:
    """``{"shards", "shard_rows", "log_rows"}``: how much of the store is compacted and how much is in the log."""
    snap = _snapshot(directory, None, None)
    rows = 0
    for pf, info in _shard_sources(snap):
        pf.close()
        rows += info.num_rows
    return {"shards": len(snap.shards), "shard_rows": rows, "log_rows": sum(len(log.rows) for log in snap.logs)}


def accept_shards(directory: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Make the manifest list exactly the shards on disk: accept a known loss (a deleted shard)
    or shards put there by hand. Every shard must still be a readable shard of the store's tokenizer.

    Needs the store's lock (no live writer). Returns ``{"dropped": [...], "added": [...]}``:
    ``"NAME (N trajectories)"`` for each listed shard that was missing and each shard that was not listed.
    """
    root = Path(directory)
    manifest = _read_manifest(root)
    if manifest is None:
        raise StoreError(f"{root}: no manifest ({MANIFEST_NAME}): not a trajectory store, nothing to accept")
    fd = None
    if fcntl is not None:
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            raise StoreError(f"{root}: a TrajectoryWriter is writing to this store; close it first") from err
    try:
        listed = {e["name"]: e for e in manifest.get("shards") or []}
        entries, added = [], []
        for path in shard_paths(root):
            pf, info = _open_shard(path)
            pf.close()
            if info.tokenizer_hash != manifest.get("tokenizer_hash"):
                raise _mismatch(
                    path, info.tokenizer_name, info.tokenizer_hash,
                    str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")),
                )
            if path.name in listed and listed[path.name]["rows"] == info.num_rows:
                entries.append(listed[path.name])
                continue
            entries.append(_shard_entry(path, rows=info.num_rows))
            added.append(f"{path.name} ({info.num_rows} trajectories)")
        kept = {e["name"] for e in entries}
        dropped = [f"{n} ({e['rows']} trajectories)" for n, e in listed.items() if n not in kept]
        _write_manifest(root, {**manifest, "shards": entries})
        return {"dropped": dropped, "added": added}
    finally:
        if fd is not None:
            os.close(fd)
def _flat(batch: pa.RecordBatch, name: str) -> tuple[pa.Array, np.ndarray]:
    """A list column's flattened values and its row offsets (relative to the values)."""
    import pyarrow.compute as pc  # ~0.1 s to import: paid by readers, not by every import of the store

    arr = batch.column(name)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return arr.flatten(), offsets


def _decode_batch(batch: pa.RecordBatch, path: Path, first: int) -> Iterator[Trajectory]:
    import pyarrow.compute as pc

    ids_arr, ids_off = _flat(batch, "token_ids")
    ids_all = ids_arr.to_numpy(zero_copy_only=False)
    mask_arr, mask_off = _flat(batch, "mask")
    mask_all = mask_arr.to_numpy(zero_copy_only=False)
    lp_arr, lp_off = _flat(batch, "logprobs")
    lp_all = lp_arr.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    lp_given = pc.is_valid(lp_arr).to_numpy(zero_copy_only=False)
    rows = batch.drop_columns(["token_ids", "mask", "logprobs"]).to_pylist()
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
        try:
            yield _decode_row(row, ids, mask, lp, given)
        except CorruptShardError as err:
            raise CorruptShardError(f"{where}: {err}") from None
        except ValueError as err:  # the Trajectory / Segment checks
            raise CorruptShardError(f"{where}: not a valid trajectory ({err})") from err


def _decode_row(
    row: dict[str, Any], ids: np.ndarray, mask: np.ndarray, lp: np.ndarray, given: np.ndarray
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
        segments.append(Segment(kind, ids[start:end], turn, logprobs=logprobs, reward=reward, finish_reason=reason))
    if pos != len(ids):
        raise CorruptShardError(f"segments cover {pos} of {len(ids)} tokens")
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
    )
    if traj.num_turns != len(rewards):
        raise CorruptShardError(f"{len(rewards)} turn rewards for {traj.num_turns} turns")
    return traj
