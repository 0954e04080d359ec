"""The on-disk trajectory store: append-only Parquet shards, crash safe, versioned.

A store is a directory. Training jobs, notebooks, ``pandas`` and Hugging Face
``datasets`` read it without tokengym; tokengym reads it back into exact
:class:`~tokengym.recorder.Trajectory` objects (every token, mask, logprob, reward,
segment and metadata field)::

    runs/grpo-0/
        part-00000.parquet    shards: one row per trajectory, written once, never rewritten
        part-00001.parquet
        .tokengym.json        manifest: format, schema version, tokenizer name and fingerprint
        .tokengym.lock        held by the one live writer (advisory lock)

The manifest and the lock are hidden files because every common reader skips those, so
they all see the shards only: ``pandas.read_parquet("runs/grpo-0")``,
``pyarrow.parquet.read_table("runs/grpo-0")``, ``datasets.load_dataset("runs/grpo-0")``,
``datasets.load_dataset("parquet", data_dir="runs/grpo-0")`` or
``data_files="runs/grpo-0/*.parquet"``. (A ``_``-prefixed manifest would trip the
``data_dir`` form.) Losing the manifest loses nothing: each shard carries the same facts.

Schema (``SCHEMA_VERSION = 1``), one row per trajectory, columns in this order:

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
                     turn: int32>>               (0 for the prompt)
turn_rewards         list<float64>               reward of each turn, in turn order
reward               float64                     the episode return (``Trajectory.reward``)
prompt_len           int32                       tokens in the prompt segment
env_id               string, nullable            gymnasium id, e.g. ``tokengym/Replay-v0``
seed                 int64, nullable             the ``reset`` seed
stop_reason          string, nullable            why the episode ended
terminated           bool                        gymnasium ``terminated``
truncated            bool                        gymnasium ``truncated``
sampling             string, nullable            JSON object: sampling settings of the actions
conformance          string                      JSON list: per-turn chat-template check results
conformance_summary  string                      JSON object: counts of the above, mismatches
metadata             string                      JSON object: free-form (task, run ids, ...)
tokenizer_name       string                      display name (a folder's base name, no path)
tokenizer_hash       string                      :func:`tokenizer_fingerprint` (sha256, hex)
schema_version       int32                       ``SCHEMA_VERSION`` of the writer
===================  ==========================  =================================================

``turn_rewards`` is float64 (not float32) so that the reward an env returned comes back
bit for bit. A logprob that the policy gave as NaN is stored as NaN, not null: null means
"no logprob was given". Each shard's Parquet key-value metadata holds ``tokengym`` = a
JSON object with ``schema_version``, ``tokenizer_name`` and ``tokenizer_hash``; the
manifest holds the same plus ``format`` and ``vocab_size``.

Guarantees and refusals:

* A shard on disk is always complete: it is written to a hidden temp file, fsynced and
  renamed into place (``os.replace``), and the directory is fsynced. A writer killed at
  any moment leaves complete shards plus, at worst, a hidden temp file that readers
  ignore and the next writer removes. Trajectories still buffered in the killed writer
  are lost; :meth:`TrajectoryWriter.flush` bounds that loss.
* A writer on an existing store resumes: it continues the shard numbering and never
  overwrites a shard. It refuses a store of another tokenizer (token ids would mean other
  tokens), of an unknown schema version, or with a corrupt shard, and says which.
* Readers refuse the same, naming the shard. Shards are written with Parquet page
  checksums, which tokengym's readers verify, so flipped bytes are caught too.

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
import hashlib
import json
import os
import re
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .segments import Segment, SegmentKind
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
    "SchemaVersionError",
    "StoreError",
    "TokenizerMismatchError",
    "TrajectoryWriter",
    "read_table",
    "read_trajectories",
    "shard_paths",
    "tokenizer_fingerprint",
]

SCHEMA_VERSION = 1
FORMAT = "tokengym-trajectories"
MANIFEST_NAME = ".tokengym.json"
LOCK_NAME = ".tokengym.lock"
METADATA_KEY = b"tokengym"

_SHARD_RE = re.compile(r"^part-(\d{5,})\.parquet$")
_TEMP_RE = re.compile(r"^\.(part-\d{5,}\.parquet|\.tokengym\.json)\.\d+\.tmp$")

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


# ---------------------------------------------------------------------- errors
class StoreError(ValueError):
    """A store directory cannot be read or written as asked."""


class SchemaVersionError(StoreError):
    """The store (or one shard) was written with a schema version this tokengym does not know."""


class TokenizerMismatchError(StoreError):
    """The store's token ids belong to another tokenizer (or chat template)."""


class CorruptShardError(StoreError):
    """A shard is not a readable tokengym Parquet file."""


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
    if version != SCHEMA_VERSION:
        hint = (
            "it was written by a newer tokengym: upgrade to read it"
            if isinstance(version, int) and version > SCHEMA_VERSION
            else "it is not a schema this tokengym knows"
        )
        raise SchemaVersionError(
            f"{where}: schema version {version!r}, but this tokengym reads version {SCHEMA_VERSION}; {hint}"
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
        wrong = [f.name for f in SCHEMA if f.name not in have.names or have.field(f.name).type != f.type]
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


# ---------------------------------------------------------------------- writer
class TrajectoryWriter:
    """Appends trajectories to a store directory, ``shard_size`` trajectories per shard.

    Use as a context manager, or call :meth:`close`; trajectories are buffered in memory
    until a shard is full, :meth:`flush` is called, or the writer closes. Its
    :meth:`write` fits ``RecordEpisodes(env, on_episode=writer.write)``.

    Args:
        directory: the store; created if missing, resumed if it holds shards.
        tokenizer: the tokenizer (or :class:`~tokengym.envs.ChatRenderer`) whose ids the
            trajectories hold; its fingerprint guards the store against mixing tokenizers.
        chat_template: the template in use when it overrides the tokenizer's own.
        tokenizer_name: the name to record (default: the tokenizer's name, without a local path).
        shard_size: trajectories per shard. Smaller means less is lost in a crash and
            more, smaller files.
        compression: Parquet compression codec.

    Raises:
        TokenizerMismatchError, SchemaVersionError, CorruptShardError: the directory
            cannot be appended to (the message names the file).
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
    ) -> None:
        if not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"shard_size must be a positive integer, got {shard_size!r}")
        tok, _ = _unwrap(tokenizer, chat_template)
        self.directory = Path(directory)
        self.shard_size = shard_size
        self.compression = compression
        self.tokenizer_hash = tokenizer_fingerprint(tokenizer, chat_template)
        self.tokenizer_name = tokenizer_name or _display_name(tokenizer)
        self.vocab_size = len(tok)
        self.num_written = 0  # trajectories written to shards by this writer
        self.shards_written: list[Path] = []
        self._rows: list[dict[str, Any]] = []
        self._closed = True
        self._lock_fd: int | None = None

        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._next_index = self._resume()
        except BaseException:
            self._unlock()
            raise
        self._closed = False
        self._file_meta = {
            METADATA_KEY: json.dumps(
                {
                    "schema_version": SCHEMA_VERSION,
                    "tokenizer_name": self.tokenizer_name,
                    "tokenizer_hash": self.tokenizer_hash,
                }
            ).encode()
        }

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

    def _resume(self) -> int:
        """Check the existing store, clean up a crashed writer's temp files, return the next shard index."""
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
                raise _mismatch(
                    path, info.tokenizer_name, info.tokenizer_hash, self.tokenizer_name, self.tokenizer_hash
                )
        # We hold the lock, so any temp file is a dead writer's unfinished shard.
        for p in root.iterdir():
            if _TEMP_RE.match(p.name):
                p.unlink()
        if manifest is None:
            body = {
                "format": FORMAT,
                "schema_version": SCHEMA_VERSION,
                "tokenizer_name": self.tokenizer_name,
                "tokenizer_hash": self.tokenizer_hash,
                "vocab_size": self.vocab_size,
            }
            text = json.dumps(body, indent=2).encode() + b"\n"
            _atomic_write(root / MANIFEST_NAME, lambda f: f.write(text))
        return int(_SHARD_RE.match(shards[-1].name).group(1)) + 1 if shards else 0  # type: ignore[union-attr]

    # ---------------------------------------------------------------- writing
    def write(self, trajectory: Trajectory) -> None:
        """Buffer one trajectory; a full buffer becomes a shard on disk.

        The trajectory is converted at once, so a value that cannot be stored (metadata
        that is not JSON, token ids outside the vocabulary) raises here, not at a later flush.
        """
        if self._closed:
            raise StoreError(f"{self.directory}: the writer is closed")
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"expected a Trajectory, got {type(trajectory).__name__}")
        self._rows.append(self._row(trajectory))
        if len(self._rows) >= self.shard_size:
            self.flush()

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
        def lists(arrays: list[np.ndarray], typ: pa.DataType, mask: np.ndarray | None = None) -> pa.Array:
            offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
            np.cumsum([len(a) for a in arrays], out=offsets[1:])
            flat = np.concatenate(arrays) if arrays else np.zeros(0)
            values = pa.array(flat, type=typ, mask=mask)
            return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)

        n = len(rows)
        col = lambda key: [r[key] for r in rows]  # noqa: E731
        given = np.concatenate([r["logprobs"][1] for r in rows])
        columns = {
            "token_ids": lists(col("token_ids"), pa.int32()),
            "mask": lists(col("mask"), pa.int8()),
            "logprobs": lists([r["logprobs"][0] for r in rows], pa.float32(), mask=~given),
            "segments": pa.array(col("segments"), pa.list_(SEGMENT_TYPE)),
            "turn_rewards": pa.array(col("turn_rewards"), pa.list_(pa.float64())),
            "tokenizer_name": pa.array([self.tokenizer_name] * n, pa.string()),
            "tokenizer_hash": pa.array([self.tokenizer_hash] * n, pa.string()),
            "schema_version": pa.array([SCHEMA_VERSION] * n, pa.int32()),
        }
        for field in SCHEMA:
            if field.name not in columns:
                columns[field.name] = pa.array(col(field.name), field.type)
        schema = SCHEMA.with_metadata(self._file_meta)
        return pa.Table.from_arrays([columns[f.name] for f in SCHEMA], schema=schema)

    def flush(self) -> Path | None:
        """Write the buffered trajectories as one complete shard now; return its path (None if none were buffered)."""
        if not self._rows:
            return None
        if self._closed:
            raise StoreError(f"{self.directory}: the writer is closed")
        table = self._table(self._rows)
        final = self.directory / f"part-{self._next_index:05d}.parquet"
        if final.exists():  # another process ignored the lock; never overwrite a shard
            raise StoreError(f"{final} already exists: refusing to overwrite a shard")
        _atomic_write(
            final, lambda f: pq.write_table(table, f, compression=self.compression, write_page_checksum=True)
        )
        self._next_index += 1
        self.num_written += len(self._rows)
        self.shards_written.append(final)
        self._rows = []
        return final

    @property
    def pending(self) -> int:
        """Trajectories buffered in memory, not yet on disk."""
        return len(self._rows)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed writer accepts nothing more."""
        return self._closed

    def close(self) -> None:
        """Flush what is buffered and release the directory. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._unlock()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Buffered trajectories are complete episodes, so they are written even when the
        # body raised.
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            if self._rows:
                warnings.warn(
                    f"TrajectoryWriter({str(self.directory)!r}) was never closed: {len(self._rows)} "
                    "buffered trajectories were not written",
                    ResourceWarning,
                    stacklevel=2,
                )
            self._unlock()

    def __repr__(self) -> str:
        return (
            f"TrajectoryWriter({str(self.directory)!r}, tokenizer={self.tokenizer_name!r}, "
            f"shard_size={self.shard_size}, written={self.num_written}, pending={self.pending})"
        )


# ---------------------------------------------------------------------- readers
def _verified_shards(
    directory: str | os.PathLike[str], tokenizer: Any, chat_template: Any
) -> Iterator[tuple[pq.ParquetFile, _ShardInfo]]:
    """Open each shard in order, checking schema version and that all come from one tokenizer."""
    root = Path(directory)
    shards = shard_paths(root)
    manifest = _read_manifest(root)
    want = None
    if tokenizer is not None:
        want = (_display_name(tokenizer), tokenizer_fingerprint(tokenizer, chat_template))
        if manifest is not None and manifest.get("tokenizer_hash") != want[1]:
            raise _mismatch(
                root / MANIFEST_NAME, str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")), *want
            )
    elif manifest is not None:
        want = (str(manifest.get("tokenizer_name")), str(manifest.get("tokenizer_hash")))
    for path in shards:
        pf, info = _open_shard(path)
        if want is None:
            want = (info.tokenizer_name, info.tokenizer_hash)
        elif info.tokenizer_hash != want[1]:
            pf.close()
            raise _mismatch(path, info.tokenizer_name, info.tokenizer_hash, *want)
        yield pf, info


def read_table(
    directory: str | os.PathLike[str],
    *,
    columns: list[str] | None = None,
    tokenizer: Any = None,
    chat_template: str | None = None,
) -> pa.Table:
    """All shards as one :class:`pyarrow.Table` (the schema in this module's docstring).

    Args:
        columns: read only these columns (faster for e.g. ``["reward", "env_id"]``).
        tokenizer: when given, refuse a store of another tokenizer.
    """
    tables = []
    for pf, info in _verified_shards(directory, tokenizer, chat_template):
        with pf:
            try:
                tables.append(pf.read(columns=columns))
            except (OSError, pa.ArrowException, ValueError) as err:
                raise CorruptShardError(f"{info.path}: corrupt shard ({err})") from err
    if not tables:
        schema = SCHEMA if columns is None else pa.schema([SCHEMA.field(c) for c in columns])
        return schema.empty_table()
    return pa.concat_tables(tables)


def read_trajectories(
    directory: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    chat_template: str | None = None,
    batch_size: int = 64,
) -> Iterator[Trajectory]:
    """Yield the store's trajectories in write order, shard by shard, as exact :class:`Trajectory` objects.

    Streams: at most ``batch_size`` rows are decoded at a time. Each row is checked
    (segments cover the tokens, mask agrees with segment kinds, one reward per turn); a
    shard that fails raises :class:`CorruptShardError` naming it.

    Args:
        tokenizer: when given, refuse a store of another tokenizer.
    """
    for pf, info in _verified_shards(directory, tokenizer, chat_template):
        with pf:
            try:
                first = 0
                for batch in pf.iter_batches(batch_size=batch_size, columns=SCHEMA.names):
                    yield from _decode_batch(batch, info.path, first)
                    first += batch.num_rows
            except StoreError:
                raise
            except (OSError, pa.ArrowException, ValueError) as err:
                raise CorruptShardError(f"{info.path}: corrupt shard ({err})") from err


def _flat(batch: pa.RecordBatch, name: str) -> tuple[pa.Array, np.ndarray]:
    """A list column's flattened values and its row offsets (relative to the values)."""
    arr = batch.column(name)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return arr.flatten(), offsets


def _decode_batch(batch: pa.RecordBatch, path: Path, first: int) -> Iterator[Trajectory]:
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
        if row["schema_version"] != SCHEMA_VERSION:
            raise SchemaVersionError(f"{where}: schema version {row['schema_version']!r}, expected {SCHEMA_VERSION}")
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
    segments: list[Segment] = []
    pos = 0
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
            if not 0 <= turn < len(rewards):
                raise CorruptShardError(f"no turn reward for turn {turn}")
            reward = rewards[turn]
        elif given[start:end].any():
            raise CorruptShardError(f"{kind.value} segment [{start}, {end}) carries logprobs")
        segments.append(Segment(kind, ids[start:end], turn, logprobs=logprobs, reward=reward))
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
