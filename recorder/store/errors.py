"""The store's errors: one class per way a store can be refused, so a caller catches what it can fix.

Every one is a :class:`StoreError` (a ``ValueError``) whose message names the file and the fix;
:class:`StoreWarning` is for what needs attention but loses nothing.
"""

from __future__ import annotations

__all__ = [
    "CorruptShardError",
    "DiskFullError",
    "ForeignLogError",
    "RunMismatchError",
    "SchemaVersionError",
    "ShardListError",
    "StoreError",
    "StoreWarning",
    "TokenizerMismatchError",
]


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


class ForeignLogError(StoreError):
    """An episode log is not this store's own: copied from another store or run, a copy of another
    log (or of a log already compacted into a shard), or a log holding a record twice."""


class RunMismatchError(StoreError):
    """The store was recorded with other run settings (env, sampling, seed, policy) than asked."""


class StoreWarning(UserWarning):
    """Something about a store needs the user's attention (shown by default, unlike ResourceWarning)."""
