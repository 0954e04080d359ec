"""The typed records an env hands its recorder and driver (``tokengym.envs.step_record``).

The recorder and the drivers read only the record: a wrapper that rewrites or strips the user's
``info`` keys changes no trajectory, and an env without a record is refused by name."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import gymnasium as gym
import pytest

from tokengym.envs import ChatEnv, EnvResponse, Prompt, ReplayEnv
from tokengym.envs.step_record import RECORD, ResetRecord, StepRecord, ToolReward, reset_record, step_record
from tokengym.recorder import RecordEpisodes

ROOT = Path(__file__).resolve().parents[1]


class Graded(ChatEnv):
    """Two turns; the first turn's tool gives 0.25, the last reports a grade and tool stats."""

    def make_prompt(self, options):
        return Prompt([{"role": "user", "content": "Say hi twice."}], task={"id": "hi", "n": 2})

    def respond(self, turn):
        if turn.turn == 0:
            return EnvResponse(
                [{"role": "user", "content": "Again."}],
                reward=0.5,
                info={"tool_results": [{"name": "echo", "reward": 0.25}, {"name": "nop", "reward": 0.0}]},
            )
        return EnvResponse(reward=1.0, done=True, info={"grade": {"correct": True}, "tool_stats": {"calls": 1}})


def _hi(env) -> list[int]:
    return env.unwrapped.renderer.encode("hi") + list(env.unwrapped.renderer.turn_end_ids)


class KeepOnlyTheRecord(gym.Wrapper):
    """A user's wrapper that rebuilds ``info``: every user key gone or rewritten, the record kept."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {RECORD: info[RECORD], "task": "rewritten", "remaining_context": -1}

    def step(self, action):
        obs, reward, term, trunc, info = self.env.step(action)
        lies = {"turn": 99, "context_reset": True, "stop_reason": "lie", "conformance": None, "grade": "lie"}
        return obs, reward, term, trunc, {RECORD: info[RECORD], **lies}


class DropInfo(gym.Wrapper):
    def step(self, action):
        obs, reward, term, trunc, _ = self.env.step(action)
        return obs, reward, term, trunc, {}


def _episode(env) -> tuple:
    env.reset(seed=4)
    done = False
    while not done:
        *_, term, trunc, info = env.step(_hi(env))
        done = term or trunc
    return info["trajectory"]


def test_the_env_writes_one_record_per_call_and_fills_info_from_it(qwen25):
    env = Graded(qwen25)
    obs, info = env.reset(seed=1)
    start = reset_record(info)
    assert start == ResetRecord({"id": "hi", "n": 2}, len(obs), env.max_context_tokens - len(obs))
    assert info["task"] == start.task and info["remaining_context"] == start.remaining_context
    _, _, _, _, info = env.step(_hi(env))
    first = step_record(info)
    assert (first.turn, first.closed_by, first.stop_reason, first.done, first.context_reset) == (0, "end_of_turn", None, False, False)
    assert first.tool_rewards == (ToolReward(0, "echo", 0.25),)  # a zero reward is no tool reward
    assert first.episode_facts == {} and first.conformance is info["conformance"]
    assert (info["turn"], info["num_tokens"], info["remaining_context"]) == (0, first.num_tokens, first.remaining_context)
    _, _, term, _, info = env.step(_hi(env))
    last = step_record(info)
    assert term and last.done and last.stop_reason == info["stop_reason"] == "done"
    assert last.episode_facts == {"grade": {"correct": True}, "tool_stats": {"calls": 1}}
    assert last.num_tokens == env.num_tokens and last.num_action_tokens == len(_hi(env))
    back = pickle.loads(pickle.dumps(last))  # Ray workers and async vector envs send it across processes
    assert back == last and isinstance(back, StepRecord)


def test_the_recorder_reads_the_record_not_the_users_keys(qwen25):
    plain = _episode(RecordEpisodes(Graded(qwen25)))
    rebuilt = _episode(RecordEpisodes(KeepOnlyTheRecord(Graded(qwen25))))
    assert rebuilt.token_ids.tolist() == plain.token_ids.tolist() and rebuilt.turn_rewards.tolist() == [0.5, 1.0]
    for traj in (plain, rebuilt):
        assert traj.stop_reason == "done" and traj.terminated and traj.num_turns == 2
        assert traj.metadata["task_id"] == "hi" and traj.metadata["grade"] == {"correct": True}
        assert traj.metadata["tool_rewards"] == [{"turn": 0, "name": "echo", "reward": 0.25}]
        assert [c["turn"] for c in traj.conformance] == [0, 1]


def test_an_env_without_a_record_is_refused_by_name(qwen25):
    env = RecordEpisodes(DropInfo(ReplayEnv(qwen25)))
    env.reset(seed=0)
    with pytest.raises(TypeError, match=r"no info\['record'\].*a wrapper that rebuilds info must keep that key"):
        env.step(env.unwrapped.reference_action())
    with pytest.raises(TypeError, match=r"info\['record'\] is str"):
        step_record({RECORD: "not a record"})
    with pytest.raises(TypeError, match="ResetRecord"):
        reset_record({"task": {}})


READERS = ("recorder/wrapper.py", "recorder/drivers/episodes.py")
"""Where the recorder and the driver take a step's result."""
ALLOWED = {"trajectory", "sequences"}
"""What the recorder itself adds to ``info`` for the driver (the finished rows)."""


def loose_reads(src: str) -> list[str]:
    """``info[KEY]`` and ``info.get(KEY)`` reads in ``src`` of keys the recorder does not add."""
    found = []
    for node in ast.walk(ast.parse(src)):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "info":
            key = node.slice
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "info" and node.args):
            key = node.args[0]
        if key is not None and not (isinstance(key, ast.Constant) and key.value in ALLOWED):
            found.append(f"line {node.lineno}: info[{ast.unparse(key)}]")
    return found


def test_the_recorder_and_the_driver_read_no_loose_info_key():
    read = [f"{rel} {hit}" for rel in READERS for hit in loose_reads((ROOT / rel).read_text())]
    assert read == [], "read the StepRecord (tokengym.envs.step_record) instead:\n" + "\n".join(read)
    src = "x = info.get('turn')\ny = info['trajectory']\nz = info[RECORD]\nw = other['turn']\n"
    assert loose_reads(src) == ["line 1: info['turn']", "line 3: info[RECORD]"]  # the check can fail


def test_a_deploy_reset_is_a_record_field(qwen3):
    env = RecordEpisodes(gym.make("tokengym/Replay-v0", tokenizer=qwen3, history="deploy"))
    env.reset(seed=0)
    resets = []
    done = False
    while not done:
        obs, _, term, trunc, info = env.step(env.unwrapped.reference_action())
        record = step_record(info)
        resets.append(record.context_reset)
        assert record.context_reset == bool(info.get("context_reset"))
        if record.context_reset:
            assert record.num_tokens == len(obs)
        done = term or trunc
    assert any(resets)  # Qwen3's template drops earlier reasoning: the deployed context starts again
    assert len(info.get("sequences") or [info["trajectory"]]) == 1 + sum(resets)
