"""The row schema of a store (the table in :mod:`tokengym.recorder.store`'s docstring) and its versions.

Writers, readers and the episode log agree on the columns through this one definition: what a
shard of each schema version holds, which versions this tokengym reads, and how a batch of an
older version gets the columns it lacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from .errors import SchemaVersionError

__all__ = ["FORMAT", "IMAGE_TYPE", "METADATA_KEY", "READABLE_VERSIONS", "SCHEMA", "SCHEMA_VERSION", "SEGMENT_TYPE"]

SCHEMA_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
"""Schema versions this tokengym reads (version 1 lacks ``finish_reasons``, 1 and 2 ``images``, 1 to 3
``versions``)."""
FORMAT = "tokengym-trajectories"
METADATA_KEY = b"tokengym"

SEGMENT_TYPE = pa.struct(
    [("kind", pa.string()), ("start", pa.int32()), ("end", pa.int32()), ("turn", pa.int32())]
)

IMAGE_TYPE = pa.struct(
    [("sha256", pa.string()), ("offset", pa.int32()), ("num_tokens", pa.int32()), ("turn", pa.int32()),
     ("index", pa.int32()), ("placeholder_id", pa.int32()), ("source", pa.string())]
)
"""One image of a row: its file (``images/<sha256>.npz``) and its run in the row's token ids."""

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
        ("images", pa.list_(IMAGE_TYPE)),
        ("versions", pa.list_(pa.int32())),
    ]
)

INT32_MAX = 2**31 - 1


def schema_of(version: int) -> pa.Schema:
    """The columns a shard of schema ``version`` has."""
    missing = {"versions"} if version < 4 else set()
    if version < 3:
        missing.add("images")
    if version < 2:
        missing.add("finish_reasons")
    return pa.schema([f for f in SCHEMA if f.name not in missing])


def upgrade_batch(batch: pa.RecordBatch, columns: list[str]) -> pa.RecordBatch:
    """A batch of an older shard with the columns it lacks added as nulls, in ``columns`` order."""
    arrays = [
        batch.column(name) if name in batch.schema.names else pa.nulls(batch.num_rows, SCHEMA.field(name).type)
        for name in columns
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema([SCHEMA.field(c) for c in columns]))


def check_version(version: Any, where: Path) -> None:
    """Refuse a schema version this tokengym cannot read; ``where`` is the file that has it."""
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
