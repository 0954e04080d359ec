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
        .tokengym.lock        flocked by the one live writer, as the directory itself is (store/lock.py)

The manifest, the log and the lock are hidden files because every common reader skips
those, so they all see the shards only: ``pandas.read_parquet("runs/grpo-0")``,
``pyarrow.parquet.read_table("runs/grpo-0")``, ``datasets.load_dataset("runs/grpo-0")``,
``datasets.load_dataset("parquet", data_dir="runs/grpo-0")`` or
``data_files="runs/grpo-0/*.parquet"``. (A ``_``-prefixed manifest would trip the
``data_dir`` form.) Those readers see a trajectory once its shard is written; tokengym's
readers (:func:`read_trajectories`, :func:`read_table`, ``tokengym inspect``) see it as soon
as :meth:`TrajectoryWriter.write` returned.

Schema (``SCHEMA_VERSION = 4``), one row per trajectory, columns in this order:

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
images               list<struct<                the images in the row's stream (added in version
                     sha256: string,             3; null for none): each one's file
                     offset: int32,              ``images/<sha256>.npz`` and its placeholder run
                     num_tokens: int32,          ``token_ids[offset : offset + num_tokens]``, its
                     turn: int32, index: int32,  turn (-1: the prompt), index in the episode,
                     placeholder_id: int32,      placeholder id and source (``prompt`` or
                     source: string>>            ``observation``)
versions             list<int32>                 the weight version that sampled each token
                                                 (added in version 4; null in older rows): -1 on
                                                 mask-0 tokens and on actions whose policy did
                                                 not say (:mod:`tokengym.policies.versions`)
===================  ==========================  =================================================

``turn_rewards`` is float64 (not float32) so that the reward an env returned comes back
bit for bit. Stores of schema version 1 (no ``finish_reasons`` column), 2 (no ``images``) and 3 (no
``versions``) stay readable: their trajectories have unknown finish reasons, no images or
unknown weight versions, and a writer may append version-4 shards to them. Images are held once each, content-addressed, in the store's
``images/`` folder (:mod:`~tokengym.recorder.store.images`: the PNG and the features the model
was given, named by their SHA-256); a file is written and fsynced before the row that names
it, and a reader refuses a missing or damaged one by name. A logprob that the policy gave as NaN is stored as NaN, not null: null means
"no logprob was given". Each shard's Parquet key-value metadata holds ``tokengym`` = a
JSON object with ``schema_version``, ``tokenizer_name`` and ``tokenizer_hash``; the
manifest holds the same plus ``format``, ``vocab_size``, ``shards`` (one
``{"name", "rows", "bytes", "sha256"}`` per shard, in order) and, when the writer was given
one, ``run`` (the run's settings, e.g. ``tokengym rollout``'s env, sampling and seed). The
episode log's header holds the same three facts as a shard's metadata plus the store's id (the
manifest's ``store_id``), a hash of the run settings and the log's own id (which the shard made from
it keeps as ``log_id``), and each record one trajectory in a compact binary form (see
:mod:`~tokengym.recorder.store.episode_log`) with a record id and a CRC32.

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
  are removed. Damage that is not a torn end (a length pointing past whole records, a whole
  record whose checksum fails) is an error naming the byte, never a silent cut.
* Only the store's own logs are read: a log copied in from another store or written under
  other run settings, a copy of a log (or of one a shard holds already) and a record written
  twice are refused by readers and writers alike (:class:`ForeignLogError`, naming the file
  and the byte), before anything is compacted (:mod:`~tokengym.recorder.store.log_origin`).
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

Modules, one concept each (this package re-exports their public names):

===============  ================================================================================
``schema``       the columns above, the schema versions read, the upgrade of older shards
``files``        the names of shards, logs, manifest and lock; the atomic write of a file
``fingerprint``  :func:`tokenizer_fingerprint`: when two stores' token ids mean the same tokens
``manifest``     the shard list: reading, writing, opening a shard, :func:`accept_shards`
``episode_log``  the log's record format: encoding, decoding, cutting a torn last record
``log_origin``   whether a log is the store's own: store, run and log ids, records written twice
``rows``         a trajectory as a row of the schema, and a row back as an exact trajectory
``resume``       what a writer checks before it continues a store; :func:`run_differences`
``writer``       :class:`TrajectoryWriter`: lock, log, group fsync, compaction, crash recovery
``reader``       :func:`read_trajectories`, :func:`read_table`, :func:`store_counts`
``errors``       :class:`StoreError` and its kinds, :class:`StoreWarning`
===============  ================================================================================
"""

from .errors import (
    CorruptShardError,
    DiskFullError,
    ForeignLogError,
    RunMismatchError,
    SchemaVersionError,
    ShardListError,
    StoreError,
    StoreWarning,
    TokenizerMismatchError,
)
from .files import LOCK_NAME, MANIFEST_NAME, log_paths, shard_paths
from .fingerprint import tokenizer_fingerprint
from .manifest import accept_shards
from .reader import read_table, read_trajectories, store_counts
from .resume import run_differences
from .schema import FORMAT, METADATA_KEY, READABLE_VERSIONS, SCHEMA, SCHEMA_VERSION, SEGMENT_TYPE
from .writer import TrajectoryWriter

# Attributes of the package too, but outside ``__all__``: LOCK_NAME, METADATA_KEY, READABLE_VERSIONS, SEGMENT_TYPE.

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "SCHEMA",
    "SCHEMA_VERSION",
    "CorruptShardError",
    "DiskFullError",
    "ForeignLogError",
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
