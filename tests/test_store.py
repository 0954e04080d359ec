"""The Parquet trajectory store on real episodes and real tokenizers.

Round trips must be exact (every token, mask, logprob, reward, segment and metadata
field), the refusals must name what is wrong, and a writer killed with SIGKILL at any
moment must leave a store that reads and resumes.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tokengym.envs  # noqa: F401  (registers the envs)
from tokengym.envs import ChatRenderer, ReplayEnv, fetch_tokenizer
from tokengym.recorder import RecordEpisodes, Trajectory
from tokengym.recorder.store import (
    MANIFEST_NAME,
    SCHEMA,
    SCHEMA_VERSION,
    CorruptShardError,
    SchemaVersionError,
    StoreError,
    TokenizerMismatchError,
    TrajectoryWriter,
    read_table,
    read_trajectories,
    shard_paths,
    tokenizer_fingerprint,
)
from needs import missing
from tokengym.recorder.store import rows as store_rows


def play(env, seed, logprobs="all"):
    """Drive one Replay episode with the transcript's reference actions and random logprobs.

    ``logprobs``: "all" turns, "none", "some" (even turns only) or "odd-values" (NaN and -inf inside).
    """
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    done, turn, info = False, 0, {}
    while not done:
        action = env.unwrapped.reference_action()
        lp = -rng.random(len(action)).astype(np.float32)
        if logprobs == "odd-values":
            lp[0], lp[-1] = np.nan, -np.inf
        give = logprobs in ("all", "odd-values") or (logprobs == "some" and turn % 2 == 0)
        _, _, term, trunc, info = env.step(action, logprobs=lp if give else None)
        done, turn = term or trunc, turn + 1
    return info["trajectory"]


def assert_same(a: Trajectory, b: Trajectory) -> None:
    """Equal in every recorded field; NaN logprobs compare equal."""
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments):
        assert (x.kind, x.turn, x.reward) == (y.kind, y.turn, y.reward)
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert y.logprobs.dtype == np.float32
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
    assert b.token_ids.dtype == np.int64 and a.token_ids.tolist() == b.token_ids.tolist()
    assert a.mask.tolist() == b.mask.tolist()
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert a.turn_rewards.tolist() == b.turn_rewards.tolist() and a.reward == b.reward
    for name in ("env_id", "seed", "stop_reason", "terminated", "truncated", "conformance", "sampling", "metadata"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.conformance_summary == b.conformance_summary
    assert a.to_dict() == b.to_dict()


def varied_episodes(tok) -> list[Trajectory]:
    """Real episodes covering what the format must carry."""
    rewarded = RecordEpisodes(
        gym.wrappers.TransformReward(ReplayEnv(tok), lambda r: r + 0.1), sampling={"temperature": 0.7, "top_p": 0.95}
    )
    out = [play(rewarded, seed, mode) for seed, mode in enumerate(["all", "none", "some", "odd-values"])]
    out.append(play(RecordEpisodes(gym.make("tokengym/Replay-v0", tokenizer=tok)), None))
    out.append(play(RecordEpisodes(ReplayEnv(tok, max_turns=2)), 2**40))  # truncated
    out[0].metadata.update({"task": {"id": "t-1", "tags": ["a"]}, "note": "é 中文 <|im_end|>", "n": np.int64(3)})
    return out


@pytest.fixture(scope="module")
def episodes25(qwen25) -> list[Trajectory]:
    return [play(RecordEpisodes(ReplayEnv(qwen25)), seed) for seed in range(10)]


# ------------------------------------------------------------------ fingerprint
def test_fingerprint_tells_tokenizers_and_templates_apart(qwen3, qwen25):
    f3, f25 = tokenizer_fingerprint(qwen3), tokenizer_fingerprint(qwen25)
    assert len(f3) == 64 and f3 != f25
    assert tokenizer_fingerprint(qwen3) == f3  # deterministic
    assert tokenizer_fingerprint(ChatRenderer(qwen3)) == f3
    assert tokenizer_fingerprint(qwen3, chat_template="{{ messages }}") != f3
    assert tokenizer_fingerprint(ChatRenderer(qwen3, chat_template=qwen25.chat_template)) != f3


# -------------------------------------------------------------------- round trip
def test_round_trip_is_exact_on_real_episodes(tokenizer, tokenizer_name, tmp_path):
    trajs = varied_episodes(tokenizer)
    assert trajs[3].logprobs[trajs[3].mask == 1].size and np.isnan(trajs[3].logprobs).any()
    assert trajs[-1].truncated and trajs[4].seed is None and (r := trajs[0].actions[0].reward) != float(np.float32(r))
    with TrajectoryWriter(tmp_path, tokenizer=tokenizer, shard_size=4) as writer:
        for t in trajs:
            writer.write(t)
    back = list(read_trajectories(tmp_path, tokenizer=tokenizer))
    assert len(back) == len(trajs)
    for a, b in zip(trajs, back):
        assert_same(a, b)
    assert back[0].metadata["n"] == 3 and back[0].metadata["note"] == "é 中文 <|im_end|>"
    assert back[1].actions[0].logprobs is None and back[2].actions[1].logprobs is None
    assert back[2].actions[0].logprobs is not None
    assert back[4].env_id == "tokengym/Replay-v0"

    table = read_table(tmp_path)
    assert table.num_rows == len(trajs) and table.schema.remove_metadata().equals(SCHEMA)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["tokenizer_hash"] == tokenizer_fingerprint(tokenizer) and row["schema_version"] == SCHEMA_VERSION
    assert row["tokenizer_name"] == tokenizer_name
    assert row["logprobs"][0] is None
    assert row["segments"][0] == {"kind": "prompt", "start": 0, "end": trajs[0].prompt_len, "turn": 0}
    assert json.loads(row["conformance_summary"]) == trajs[0].conformance_summary
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["tokenizer_hash"] == row["tokenizer_hash"]
    assert tokenizer.name_or_path not in (tmp_path / MANIFEST_NAME).read_text()  # no local path recorded


def test_writer_is_an_on_episode_callback(qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=ChatRenderer(qwen25), shard_size=2) as writer:
        env = RecordEpisodes(ReplayEnv(qwen25), on_episode=writer.write, keep=False)
        for seed in range(3):
            play(env, seed)
        assert writer.pending == 1 and len(shard_paths(tmp_path)) == 1
    assert [t.seed for t in read_trajectories(tmp_path)] == [0, 1, 2]
    with pytest.raises(StoreError, match="closed"):
        writer.write(play(env, 4))


def test_write_refuses_what_it_cannot_store(qwen3, qwen25, tmp_path):
    traj = play(RecordEpisodes(ReplayEnv(qwen25)), 0)
    traj.metadata["bad"] = object()
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as writer:
        with pytest.raises(ValueError, match="metadata cannot be stored as JSON"):
            writer.write(traj)
        # qwen3's <think> ids are past the end of qwen2.5's vocabulary
        with pytest.raises(ValueError, match="outside .* of tokenizer 'qwen2.5'"):
            writer.write(play(RecordEpisodes(ReplayEnv(qwen3)), 0))
        with pytest.raises(TypeError):
            writer.write(traj.to_dict())
        deep: dict = {}
        node = deep
        for _ in range(5000):  # deeper than the interpreter's recursion limit
            node["x"] = node = {}
        traj.metadata = {"nested": deep}
        with pytest.raises(ValueError, match="metadata is nested more than 100 levels deep"):
            writer.write(traj)
        traj.metadata = {"nested": [[[1]]] * 3}  # shallow: stored
        writer.write(traj)
        assert writer.pending == 1


# ------------------------------------------------------------ shards and resume
def test_shards_roll_over_and_flush(episodes25, qwen25, tmp_path):
    writer = TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=4)
    for t in episodes25[:9]:
        writer.write(t)
    assert [p.name for p in shard_paths(tmp_path)] == ["part-00000.parquet", "part-00001.parquet"]
    assert writer.pending == 1 and writer.flush() == tmp_path / "part-00002.parquet"
    assert writer.flush() is None
    writer.write(episodes25[9])
    writer.close()
    writer.close()  # idempotent
    assert [pq.ParquetFile(p).metadata.num_rows for p in shard_paths(tmp_path)] == [4, 4, 1, 1]
    assert [t.seed for t in read_trajectories(tmp_path)] == list(range(10))
    shards = [f"part-0000{i}.parquet" for i in range(4)]
    assert sorted(os.listdir(tmp_path)) == sorted([".tokengym.lock", MANIFEST_NAME, *shards])


def test_resume_appends_and_never_overwrites(episodes25, qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=3) as w:
        for t in episodes25[:5]:
            w.write(t)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shard_paths(tmp_path)}
    # A crashed writer's temp file: readers ignore it, the next writer removes it.
    leftover = tmp_path / ".part-00002.parquet.4242.tmp"
    leftover.write_bytes(b"PAR1 half a shard")
    assert len(list(read_trajectories(tmp_path))) == 5
    with TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=3) as w:
        assert not leftover.exists()
        for t in episodes25[5:]:
            w.write(t)
        assert [p.name for p in w.shards_written] == ["part-00002.parquet"]
    assert [p.name for p in shard_paths(tmp_path)] == [f"part-0000{i}.parquet" for i in range(4)]
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shard_paths(tmp_path)}
    assert {name: after[name] for name in before} == before  # old shards untouched
    back = list(read_trajectories(tmp_path))
    assert len(back) == 10
    for a, b in zip(episodes25, back):
        assert_same(a, b)


def test_one_writer_per_directory(qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25):
        with pytest.raises(StoreError, match="another TrajectoryWriter"):
            TrajectoryWriter(tmp_path, tokenizer=qwen25)
    TrajectoryWriter(tmp_path, tokenizer=qwen25).close()  # released on close


def test_a_deleted_lock_file_does_not_let_a_second_writer_in(episodes25, qwen25, tmp_path):
    from tokengym.recorder.store.files import LOCK_NAME

    with TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=4) as first:
        first.write(episodes25[0])
        (tmp_path / LOCK_NAME).unlink()  # what a user may do: the lock is not the file
        with pytest.raises(StoreError, match="another TrajectoryWriter"):
            TrajectoryWriter(tmp_path, tokenizer=qwen25)
        first.write(episodes25[1])
    assert len(list(read_trajectories(tmp_path))) == 2  # nothing the first writer returned from is lost


def test_a_writer_whose_store_was_moved_away_stops_instead_of_writing(episodes25, qwen25, tmp_path):
    store, moved = tmp_path / "store", tmp_path / "moved"
    first = TrajectoryWriter(store, tokenizer=qwen25, shard_size=4)
    first.write(episodes25[0])
    store.rename(moved)
    second = TrajectoryWriter(store, tokenizer=qwen25, shard_size=4)  # a new store at the old path
    second.write(episodes25[1])
    with pytest.raises(StoreError, match="the store's directory was replaced after this writer locked it"):
        first.write(episodes25[2])
    second.close()
    with pytest.raises(StoreError, match="replaced"):
        first.close()  # it compacts nothing into the other store either
    assert len(list(read_trajectories(store))) == 1
    assert len(list(read_trajectories(moved))) == 1  # the first writer's one write, where it made it


# ------------------------------------------------------------------- refusals
def test_refuses_another_tokenizer(episodes25, qwen3, qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=2) as w:
        for t in episodes25[:3]:
            w.write(t)
    h3, h25 = tokenizer_fingerprint(qwen3), tokenizer_fingerprint(qwen25)
    with pytest.raises(TokenizerMismatchError) as err:
        TrajectoryWriter(tmp_path, tokenizer=qwen3)
    assert all(s in str(err.value) for s in ("'qwen2.5'", h25, "'qwen3'", h3))
    with pytest.raises(TokenizerMismatchError, match=h3):
        list(read_trajectories(tmp_path, tokenizer=qwen3))
    # Without the manifest the shards' own metadata still says which tokenizer wrote them.
    (tmp_path / MANIFEST_NAME).unlink()
    with pytest.raises(TokenizerMismatchError, match="part-00000.parquet"):
        TrajectoryWriter(tmp_path, tokenizer=qwen3)
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as w:  # the right tokenizer resumes, manifest rewritten
        w.write(episodes25[3])
    assert (tmp_path / MANIFEST_NAME).exists() and len(list(read_trajectories(tmp_path, tokenizer=qwen25))) == 4


def test_refuses_unknown_schema_version(episodes25, qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as w:
        w.write(episodes25[0])
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**manifest, "schema_version": 99}))
    for attempt in (lambda: TrajectoryWriter(tmp_path, tokenizer=qwen25), lambda: list(read_trajectories(tmp_path))):
        with pytest.raises(SchemaVersionError, match=r"\.tokengym\.json: schema version 99.*newer tokengym"):
            attempt()
    # A shard written by a future version, in a store whose manifest says the current one.
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    shard = tmp_path / "part-00000.parquet"
    table = pq.read_table(shard)
    meta = json.loads(table.schema.metadata[b"tokengym"])
    future = SCHEMA_VERSION + 1
    pq.write_table(table.replace_schema_metadata({b"tokengym": json.dumps({**meta, "schema_version": future})}), shard)
    for attempt in (lambda: TrajectoryWriter(tmp_path, tokenizer=qwen25), lambda: read_table(tmp_path)):
        with pytest.raises(SchemaVersionError, match=rf"part-00000.parquet: schema version {future}"):
            attempt()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "flipped"])
def test_refuses_a_corrupt_shard_and_names_it(episodes25, qwen25, tmp_path, damage):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=2) as w:
        for t in episodes25[:6]:
            w.write(t)
    bad = tmp_path / "part-00001.parquet"
    if damage == "garbage":
        bad.write_bytes(np.random.default_rng(0).bytes(bad.stat().st_size))
    elif damage == "truncated":
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    elif damage == "foreign":  # a Parquet file that is not a tokengym shard
        pq.write_table(pa.table({"x": [1, 2]}), bad)
    else:  # bytes of the token ids flipped, footer intact: the page checksums catch it
        data = bytearray(bad.read_bytes())
        for i in range(64, 96):
            data[i] ^= 0xFF
        bad.write_bytes(bytes(data))
    attempts = {
        "read_trajectories": lambda: list(read_trajectories(tmp_path)),
        "read_table": lambda: read_table(tmp_path),
    }
    if damage != "flipped":  # a resuming writer checks footers, not every page
        attempts["writer"] = lambda: TrajectoryWriter(tmp_path, tokenizer=qwen25)
    for name, attempt in attempts.items():
        with pytest.raises(CorruptShardError, match="part-00001.parquet") as err:
            attempt()
        assert str(bad) in str(err.value), name
    # Shards before the bad one still stream out before the error.
    stream = read_trajectories(tmp_path)
    assert [next(stream).seed, next(stream).seed] == [0, 1]
    with pytest.raises(CorruptShardError):
        next(stream)


def test_reader_checks_rows_against_their_segments(episodes25, qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as w:
        w.write(episodes25[0])
    shard = tmp_path / "part-00000.parquet"
    table = pq.read_table(shard)
    mask = table.column("mask").to_pylist()
    mask[0][0] = 1  # a prompt token marked as trained on
    table = table.set_column(table.schema.get_field_index("mask"), "mask", pa.array(mask, pa.list_(pa.int8())))
    pq.write_table(table, shard)
    with pytest.raises(CorruptShardError, match=r"part-00000.parquet: row 0: mask disagrees with the prompt segment"):
        list(read_trajectories(tmp_path))


def _stamped(qwen25, seed: int, versions: bool) -> Trajectory:
    """A two-turn episode with logprobs, and weight versions on its actions when ``versions``."""
    env = RecordEpisodes(ReplayEnv(qwen25, max_turns=2))
    env.reset(seed=seed)
    done, turn, info = False, 0, {}
    while not done:
        action = env.unwrapped.reference_action()
        stamp = np.full(len(action), turn, np.int32) if versions else None
        _, _, term, trunc, info = env.step(action, logprobs=-np.ones(len(action), np.float32), versions=stamp)
        done, turn = term or trunc, turn + 1
    return info["trajectory"]


def test_a_batch_of_rows_with_and_without_versions_reads_back_exactly(qwen25, tmp_path, monkeypatch):
    """Rows with and without versions in one shard (what an older log's rows beside new ones give)
    take the row-by-row path; rows all alike the batch path: both give the trajectories back."""
    mixed = [_stamped(qwen25, s, versions=s % 2 == 0) for s in range(5)] + [play(RecordEpisodes(ReplayEnv(qwen25)), 9, "some")]
    alike = [_stamped(qwen25, s, versions=True) for s in range(5)]
    for name, trajs in (("mixed", mixed), ("alike", alike)):
        with TrajectoryWriter(tmp_path / name, tokenizer=qwen25) as w:
            for t in trajs:
                w.write(t)
        slow = []
        monkeypatch.setattr(store_rows, "_decode_row", lambda *a, _real=store_rows._decode_row: slow.append(1) or _real(*a))
        back = list(read_trajectories(tmp_path / name))
        monkeypatch.undo()
        assert len(back) == len(trajs) and len(slow) == (len(trajs) if name == "mixed" else 0)
        for a, b in zip(trajs, back):
            assert_same(a, b)
            assert a.versions.tolist() == b.versions.tolist() and a.has_versions == b.has_versions
            assert all(not s.token_ids.flags.writeable for s in b.segments)


@pytest.mark.parametrize(
    "column, damage, message",
    [
        ("logprobs", lambda row, first: row.__setitem__(0, -1.0), "prompt segment .* carries logprobs"),
        ("versions", lambda row, first: row.__setitem__(0, 3), "prompt segment .* carries weight versions"),
        ("logprobs", lambda row, first: row.__setitem__(first, None), "has logprobs for some tokens only"),
        ("versions", lambda row, first: row.__setitem__(first, -1), "has weight versions for some tokens only"),
        ("mask", lambda row, first: row.__setitem__(first, 2), "mask disagrees with the action segment"),
        ("segments", lambda row, first: row[1].__setitem__("start", first + 1), r"segment \[\d+, \d+\) does not continue"),
        ("segments", lambda row, first: row[-1].__setitem__("end", row[-1]["end"] - 1), "segments cover"),
        ("segments", lambda row, first: row.pop(), "segments cover"),
        ("segments", lambda row, first: row[1].__setitem__("kind", "tool"), "'tool' is not a valid SegmentKind"),
    ],
    ids=["logprob on a prompt token", "version on a prompt token", "part of an action's logprobs",
         "part of an action's versions", "a mask value of 2", "a segment that skips a token",
         "segments short of the tokens", "a segment dropped", "a kind that is none"],
)
def test_a_damaged_row_among_good_ones_is_named(qwen25, tmp_path, column, damage, message):
    """The batch check sees that something is wrong; the row-by-row check then names the row and what."""
    trajs = [_stamped(qwen25, s, versions=True) for s in range(5)]
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as w:
        for t in trajs:
            w.write(t)
    shard = tmp_path / "part-00000.parquet"
    table = pq.read_table(shard)
    values = table.column(column).to_pylist()
    damage(values[3], trajs[3].action_spans[0][0])
    field = table.schema.field(column)
    table = table.set_column(table.schema.get_field_index(column), field, pa.array(values, field.type))
    pq.write_table(table, shard)
    with pytest.raises(CorruptShardError, match=rf"part-00000.parquet: row 3: .*{message}"):
        list(read_trajectories(tmp_path))


def test_reading_missing_and_empty_stores(qwen25, tmp_path):
    with pytest.raises(FileNotFoundError):
        list(read_trajectories(tmp_path / "nope"))
    TrajectoryWriter(tmp_path, tokenizer=qwen25).close()
    assert list(read_trajectories(tmp_path)) == [] and read_table(tmp_path).num_rows == 0
    assert read_table(tmp_path, columns=["reward"]).column_names == ["reward"]


# ------------------------------------------------------------ other readers
def test_pandas_and_datasets_read_the_shards(episodes25, qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=4) as w:
        for t in episodes25:
            w.write(t)
    try:
        import pandas as pd
    except ImportError:
        missing("PANDAS", "pandas is not installed (it comes with the test extras: pip install -e \".[test]\")")
    df = pd.concat([pd.read_parquet(p) for p in shard_paths(tmp_path)], ignore_index=True)
    assert len(df) == 10 and df["seed"].tolist() == list(range(10))
    assert df["token_ids"][3].tolist() == episodes25[3].token_ids.tolist()
    assert df["mask"][3].tolist() == episodes25[3].mask.tolist()
    assert json.loads(df["metadata"][0]) == episodes25[0].metadata

    assert pd.read_parquet(tmp_path)["seed"].tolist() == list(range(10))  # the directory: shards only

    try:
        import datasets
    except ImportError:
        missing("DATASETS", "datasets is not installed (it comes with the test extras: pip install -e \".[test]\")")
    (tmp_path / ".part-00009.parquet.1.tmp").write_bytes(b"a crashed writer's leftover")
    cache = str(tmp_path.parent / f"{tmp_path.name}-hf")
    for how in (
        {"path": "parquet", "data_files": str(tmp_path / "*.parquet")},
        {"path": "parquet", "data_files": [str(p) for p in shard_paths(tmp_path)]},
        {"path": "parquet", "data_dir": str(tmp_path)},
        {"path": str(tmp_path)},
    ):
        ds = datasets.load_dataset(**how, split="train", cache_dir=cache)
        assert ds.num_rows == 10 and sorted(ds["seed"]) == list(range(10)), how
    row = ds.filter(lambda r: r["seed"] == 7)[0]
    assert row["token_ids"] == episodes25[7].token_ids.tolist()
    lp = episodes25[7].logprobs
    assert row["logprobs"] == [None if np.isnan(x) else float(x) for x in lp]
    assert [s["kind"] for s in row["segments"]] == [s.kind.value for s in episodes25[7].segments]


# ---------------------------------------------------------------- crash safety
CHILD = """
import sys
import numpy as np
from tokengym.envs import ReplayEnv, load_tokenizer
from tokengym.recorder import RecordEpisodes
from tokengym.recorder.store import TrajectoryWriter

{play}

tok_path, store, shard_size, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tok = load_tokenizer(tok_path)
writer = TrajectoryWriter(store, tokenizer=tok, shard_size=shard_size)
env = RecordEpisodes(ReplayEnv(tok), on_episode=writer.write, keep=False)
while True:  # until killed; never flushed or closed by hand
    play(env, seed)
    seed += 1
"""
SHARD = 3


def _run_and_kill(store: Path, start_seed: int, new_shards: int, delay: float | None) -> bool:
    """Start a writer process at ``start_seed`` and SIGKILL it once it wrote ``new_shards`` more shards:
    ``delay`` seconds later, or (``delay=None``) the moment a shard's temp file is seen, i.e. mid-write.

    Returns whether the kill left a temp file behind (the kill landed inside a shard write).
    """
    code = CHILD.format(play=textwrap.dedent(inspect.getsource(play)))
    target = len(shard_paths(store)) + new_shards if store.exists() else new_shards
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(fetch_tokenizer("qwen2.5")), str(store), str(SHARD), str(start_seed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not store.exists() or len(list(store.glob("part-*.parquet"))) < target:
            if proc.poll() is not None:
                pytest.fail(f"the writer process died: {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, "the writer process wrote too slowly"
            time.sleep(0.002)
        if delay is None:
            give_up = time.monotonic() + 5
            while not any(name.endswith(".tmp") for name in os.listdir(store)) and time.monotonic() < give_up:
                pass
        else:
            time.sleep(delay)
    finally:
        proc.kill()  # SIGKILL: no flush, no close, no cleanup
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return any(name.endswith(".tmp") for name in os.listdir(store))


def _check_store(store: Path, reference: Trajectory, tok, *, full_shards: bool = True) -> int:
    """Every shard reads on its own and all rows are whole episodes of seeds 0, 1, ...; returns the count."""
    for shard in shard_paths(store):
        rows = pq.read_table(shard).num_rows
        # A killed writer only ever wrote full shards; a closed one also flushed a partial last one.
        assert (rows == SHARD) if full_shards else (0 < rows <= SHARD), shard.name
    back = list(read_trajectories(store, tokenizer=tok))
    assert [t.seed for t in back] == list(range(len(back)))
    for t in back:
        assert t.token_ids.tolist() == reference.token_ids.tolist() and t.mask.tolist() == reference.mask.tolist()
        assert t.terminated and t.has_logprobs and t.conformance == reference.conformance
        rng = np.random.default_rng(t.seed)
        for a in t.actions:
            np.testing.assert_array_equal(a.logprobs, -rng.random(len(a)).astype(np.float32))
    return len(back)


def _crash_and_resume(store: Path, tok, delays: list[float | None]) -> int:
    """Kill a writer process once per delay, check the store after each kill, resume here; returns the
    number of kills that landed inside a shard write."""
    reference = play(RecordEpisodes(ReplayEnv(tok)), 0)
    count = mid_write = 0
    for delay in delays:  # each run resumes the store the previous run was killed in
        in_shards = len(shard_paths(store)) * SHARD if store.exists() else 0
        mid_write += _run_and_kill(store, count, new_shards=3, delay=delay)
        got = _check_store(store, reference, tok)
        # The killed writer's episode log is read too: more than its shards may hold.
        assert got >= max(count, in_shards + 3 * SHARD)
        count = got
    # A readable store even with a killed writer's temp file still there; the next writer removes it.
    (store / ".part-99999.parquet.1.tmp").write_bytes(b"PAR1 half a shard")
    assert len(list(read_trajectories(store))) == count
    with TrajectoryWriter(store, tokenizer=tok, shard_size=SHARD) as w:
        assert not [p for p in os.listdir(store) if p.endswith(".tmp")]
        env = RecordEpisodes(ReplayEnv(tok), on_episode=w.write, keep=False)
        for seed in range(count, count + 5):
            play(env, seed)
    assert _check_store(store, reference, tok, full_shards=False) == count + 5
    assert_same(list(read_trajectories(store))[-1], play(RecordEpisodes(ReplayEnv(tok)), count + 4))
    return mid_write


def test_sigkilled_writer_leaves_complete_shards_and_resumes(qwen25, tmp_path):
    _crash_and_resume(tmp_path / "store", qwen25, delays=[None])


@pytest.mark.slow
def test_repeated_sigkills_mid_write_and_at_random_moments(qwen25, tmp_path):
    delays: list[float | None] = [None, 0.003, None, 0.011, None, 0.027]
    mid_write = _crash_and_resume(tmp_path / "store", qwen25, delays=delays)
    assert mid_write >= 1, "no kill landed inside a shard write: the test did not exercise what it is for"
