"""Each action records why its generation stopped, through the store (since schema version 2), and
stores of schema version 1 stay readable and appendable."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokengym.envs import ReplayEnv
from tokengym.policies import SamplingParams, ScriptedPolicy
from tokengym.recorder import Segment, SegmentKind, TrajectoryWriter, read_table, read_trajectories, rollout
from tokengym.recorder.store import MANIFEST_NAME, SCHEMA_VERSION, shard_paths

from test_store import assert_same


def three_ways_policy(tok) -> ScriptedPolicy:
    """Turn 0: a reply longer than the budget (length); turn 1: ends with <|im_end|> (stop);
    turn 2: ends with the stop string "!" (stop_string)."""
    marker = tok.encode("<|im_start|>assistant\n")
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(context):
        ids = context.tolist()
        turn = sum(ids[i : i + len(marker)] == marker for i in range(len(ids))) - 1
        return [tok.encode(" ".join(["word"] * 20)), tok.encode("ok") + [end], tok.encode("hi!")][min(turn, 2)]

    return ScriptedPolicy(script, tok)


@pytest.fixture(scope="module")
def trajs(qwen25):
    result = rollout(
        lambda: ReplayEnv(qwen25, max_turns=3), three_ways_policy(qwen25), episodes=3, progress=False,
        sampling=SamplingParams(max_tokens=6, stop_strings=("!",)),
    )
    return result.trajectories


def test_each_turn_records_its_finish_reason(trajs):
    assert all(t.finish_reasons == ["length", "stop", "stop_string"] for t in trajs)
    assert trajs[0].to_dict()["finish_reasons"] == ["length", "stop", "stop_string"]
    with pytest.raises(ValueError, match="finish reasons belong to action segments"):
        Segment(SegmentKind.OBSERVATION, [1], 0, finish_reason="stop")


def test_finish_reasons_round_trip_through_shard_and_log(trajs, qwen25, tmp_path):
    writer = TrajectoryWriter(tmp_path, tokenizer=qwen25, shard_size=2)
    for t in trajs:
        writer.write(t)
    assert len(shard_paths(tmp_path)) == 1 and writer.pending == 1  # two in a shard, one in the log
    back = list(read_trajectories(tmp_path))
    for a, b in zip(trajs, back):
        assert_same(a, b)
        assert b.finish_reasons == ["length", "stop", "stop_string"]
    assert read_table(tmp_path, columns=["finish_reasons"]).column(0).to_pylist() == [["length", "stop", "stop_string"]] * 3
    writer.close()
    assert pq.read_table(shard_paths(tmp_path)[0]).column("schema_version").to_pylist() == [SCHEMA_VERSION] * 2


def as_version_1(store) -> None:
    """Rewrite a store as tokengym wrote it at schema version 1: no finish_reasons column, version 1 everywhere."""
    for shard in shard_paths(store):
        table = pq.read_table(shard)
        table = table.drop_columns(["finish_reasons"])
        i = table.schema.get_field_index("schema_version")
        table = table.set_column(i, "schema_version", pa.array([1] * table.num_rows, pa.int32()))
        meta = json.loads(table.schema.metadata[b"tokengym"])
        pq.write_table(table.replace_schema_metadata({b"tokengym": json.dumps({**meta, "schema_version": 1})}), shard,
                       write_page_checksum=True)
    manifest = json.loads((store / MANIFEST_NAME).read_text())
    manifest.pop("shards")
    (store / MANIFEST_NAME).write_text(json.dumps({**manifest, "schema_version": 1}))


def test_a_version_1_store_stays_readable_and_appendable(trajs, qwen25, tmp_path):
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as writer:
        for t in trajs[:2]:
            writer.write(t)
    as_version_1(tmp_path)
    old = list(read_trajectories(tmp_path))
    assert [t.finish_reasons for t in old] == [[None, None, None]] * 2
    assert [t.token_ids.tolist() for t in old] == [t.token_ids.tolist() for t in trajs[:2]]
    assert read_table(tmp_path).column("finish_reasons").to_pylist() == [None, None]
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as writer:  # a current shard beside the old one
        writer.write(trajs[2])
    mixed = list(read_trajectories(tmp_path))
    assert [t.finish_reasons for t in mixed] == [[None] * 3, [None] * 3, ["length", "stop", "stop_string"]]
    assert read_table(tmp_path, columns=["schema_version"]).column(0).to_pylist() == [1, 1, SCHEMA_VERSION]
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["schema_version"] == SCHEMA_VERSION == 4
