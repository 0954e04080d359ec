"""tokengym envs behind skyrl-gym 0.4.0's ``BaseTextEnv`` (text in, text out), on the real Qwen2.5 template.

Runs where skyrl-gym is installed (``.ci/integrations.sh`` puts it in ``.venv-trl``); skipped
elsewhere, unless ``TOKENGYM_REQUIRE_INTEGRATIONS=1`` makes a missing skyrl-gym a failure.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from tokengym.envs import ChatRenderer

if os.environ.get("TOKENGYM_REQUIRE_INTEGRATIONS") == "1":
    import skyrl_gym  # noqa: F401 -- CI's SkyRL run: a missing skyrl-gym is a failure
    HAVE_SKYRL = True
else:
    try:
        import skyrl_gym  # noqa: F401
        HAVE_SKYRL = True
    except ImportError:
        HAVE_SKYRL = False

needs_skyrl = pytest.mark.skipif(not HAVE_SKYRL, reason="skyrl-gym is not installed (.ci/integrations.sh tests it in .venv-trl)")
pytestmark = pytest.mark.integration


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def model_text(renderer, message, tools=None) -> str:
    """What a SkyRL generator hands the env: the decoded output, its stop token stripped."""
    text = renderer.assistant(message, tools).text
    return text[: -len(renderer.turn_end_text)] if text.endswith(renderer.turn_end_text) else text


@pytest.fixture(scope="module")
def renderer(qwen25):
    return ChatRenderer(qwen25)


def test_missing_skyrl_gym_says_how_to_install(monkeypatch):
    from tokengym.recorder.integrations import skyrl as adapter

    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    monkeypatch.setitem(sys.modules, "skyrl_gym.envs", None)
    monkeypatch.setitem(sys.modules, "skyrl_gym.envs.base_text_env", None)
    with pytest.raises(ImportError, match="pip install skyrl-gym==0.4.0"):
        adapter.load_base()


@needs_skyrl
def test_calculator_episode_through_skyrl_make(renderer):
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    from tokengym.recorder.integrations.skyrl import register_skyrl_envs

    ids = register_skyrl_envs(["tokengym/Calculator-v0"])
    assert ids == ["tokengym/Calculator-v0"]
    # SkyRL's own call: make(env_class, env_config=..., extras=<the dataset row>).
    env = skyrl_gym.make("tokengym/Calculator-v0", env_config={"tokenizer": renderer}, extras={"extra_info": {"seed": 3}})
    assert isinstance(env, BaseTextEnv)

    messages, meta = env.init([{"role": "user", "content": "ignored: the seed names the task"}])
    reference = gym.make("tokengym/Calculator-v0", tokenizer=renderer)
    obs, info = reference.reset(seed=3)
    assert meta["prompt_ids"] == obs.tolist() and messages == info["messages"]
    assert meta["tools"][0]["function"]["name"] == "calculate"
    task = meta["task"]

    # Turn 1: a tool call, as text without the stop token (the env closes the turn in the observation).
    text = model_text(renderer, {"role": "assistant", "content": "", "tool_calls": [call("calculate", expression="6*7")]}, meta["tools"])
    out = env.step(text)
    assert set(out) >= {"observations", "reward", "done", "metadata"}
    assert out["done"] is False and out["reward"] == 0.0
    assert out["observations"] == [{"role": "tool", "content": "42", "tool_call_id": "call_0_0", "name": "calculate"}]
    assert out["metadata"]["closed_by"] == "none"
    assert out["metadata"]["observation_ids"][: len(renderer.turn_end_ids)] == list(renderer.turn_end_ids)
    assert out["metadata"]["action_ids"] == renderer.encode(text)

    # Turn 2: the answer, with its stop token this time.
    out = env.step(f"<answer>{task['answer']}</answer>{renderer.turn_end_text}")
    assert out["done"] is True and out["reward"] == 1.0 and out["observations"] == []
    traj = out["metadata"]["trajectory"]
    assert traj.num_turns == 2 and traj.reward == 1.0 and out["metadata"]["stop_reason"] == "done"
    assert traj.metadata["task_id"] == task["id"]
    assert env.get_metrics()["turns"] == 2 and env.get_metrics()["tool_ok"] == 1
    # The recorded stream is exactly prompt + action + observation + action, all as tokens.
    assert traj.token_ids.tolist() == meta["prompt_ids"] + renderer.encode(text) + traj.segments[2].token_ids.tolist() + traj.actions[1].token_ids.tolist()
    env.close()


@needs_skyrl
def test_prompt_messages_without_a_seed_are_the_conversation(renderer):
    from tokengym.recorder.integrations.skyrl import TokenGymTextEnv

    env = TokenGymTextEnv(env_id="tokengym/Calculator-v0", tokenizer=renderer)
    messages, meta = env.init([{"role": "user", "content": "What is 2 + 2?"}])
    assert messages[-1] == {"role": "user", "content": "What is 2 + 2?"}
    assert "What is 2 + 2?" in renderer.decode(meta["prompt_ids"])
    out = env.step("")  # an output that was only the stop token: the end-of-turn token alone
    assert out["metadata"]["action_ids"] == list(renderer.turn_end_ids[-1:])
    assert out["done"] and out["reward"] == 0.0  # no tool call: a final answer (the prompt gave no answer to score)
    env.close()


@needs_skyrl
def test_token_ids_skip_the_retokenization_caveat(renderer, tmp_path):
    """Text is re-encoded canonically; a non-canonical sampled split only survives as ids."""
    from tokengym.recorder.integrations.skyrl import TokenGymTextEnv

    word = " strawberry"
    canonical = renderer.encode(word)
    pieces = [t for ch in word for t in renderer.encode(ch)]  # one token per character: same text
    assert renderer.decode(pieces) == word and pieces != canonical
    end = list(renderer.turn_end_ids)

    recorded = []
    for action, expected in ((renderer.decode(pieces + end), canonical + end), (pieces + end, pieces + end)):
        env = TokenGymTextEnv(env_id="tokengym/Calculator-v0", tokenizer=renderer)
        env.init([{"role": "user", "content": "Say strawberry."}])
        out = env.step(action)
        traj = out["metadata"]["trajectory"]
        assert out["done"] and traj.actions[0].token_ids.tolist() == expected
        # every trajectory says whether its actions are re-encoded text (and the metrics count them)
        text = isinstance(action, str)
        assert traj.metadata["reencoded"] is text and traj.metadata["reencoded_turns"] == int(text)
        assert env.get_metrics()["reencoded_turns"] == int(text)
        recorded.append(traj)
        env.close()
    from tokengym.recorder import TrajectoryWriter
    from tokengym.recorder.summary import format_summary, summarize_store

    with TrajectoryWriter(tmp_path / "store", tokenizer=renderer.tokenizer) as writer:
        for traj in recorded:
            writer.write(traj)
    summary = summarize_store(tmp_path / "store")
    assert summary["reencoded_episodes"] == 1
    assert "1 episodes got their actions as text, encoded again" in format_summary(summary)


@needs_skyrl
def test_adapter_wraps_an_env_instance(renderer):
    from tokengym.envs import KeyValueEnv
    from tokengym.recorder.integrations.skyrl import TokenGymTextEnv

    env = TokenGymTextEnv(env=KeyValueEnv(renderer), extras={"seed": 4, "options": {"difficulty": 1}})
    messages, meta = env.init()
    start = meta["task"]["start"]
    out = env.step(model_text(renderer, {"role": "assistant", "content": "", "tool_calls": [call("get", key=start)]}, meta["tools"]))
    assert meta["task"]["answer"] in out["observations"][0]["content"]
    # The observation's token ids carry the tool result the observation message shows.
    ids = np.asarray(out["metadata"]["observation_ids"])
    assert ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)
    assert out["observations"][0]["content"] in renderer.decode(ids)
    env.close()


@needs_skyrl
def test_the_docs_skyrl_example_runs(capsys):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- run: skyrl -->\s*```python\n(.*?)```", doc, flags=re.S).group(1)
    scope: dict = {}
    exec(compile(block, "docs/integrations.md", "exec"), scope)
    assert capsys.readouterr().out.startswith("1.0 True [")
    scope["env"].close()
