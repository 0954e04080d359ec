"""tokengym envs driven by plain gymnasium: a loop with a policy, wrappers, Sync/AsyncVectorEnv.

(``SyncVectorEnv`` on Replay, Calculator and KeyValue is in test_chat_env / test_tool_env, and
the README's tool env example in test_readme; this file adds the async vector env, standard
wrappers around the recorder, a policy-driven loop and the docs' gymnasium example.)
"""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import tokengym.envs  # noqa: F401 -- registers tokengym/... envs
from tokengym.envs import ChatRenderer
from tokengym.policies import SamplingParams, ScriptedPolicy
from tokengym.recorder import RecordEpisodes, to_trl

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


@pytest.fixture(scope="module")
def renderer(qwen25):
    return ChatRenderer(qwen25)


def answer_ids(renderer, answer) -> np.ndarray:
    return np.array(renderer.assistant({"role": "assistant", "content": f"<answer>{answer}</answer>"}).ids)


def tool_call_ids(renderer, expression, tools) -> np.ndarray:
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return np.array(renderer.assistant({"role": "assistant", "content": "", "tool_calls": [call]}, tools).ids)


def test_a_plain_loop_with_a_policy_records_the_stream(renderer):
    """reset / policy.generate / step, nothing else: the recorder sees exactly the policy's stream."""
    env = RecordEpisodes(gym.make("tokengym/Calculator-v0", tokenizer=renderer))
    obs, info = env.reset(seed=11)
    task, tools = info["task"], info["tools"]
    replies = iter([tool_call_ids(renderer, task["expression"], tools), answer_ids(renderer, task["answer"])])
    policy = ScriptedPolicy(lambda context: next(replies))
    stream, done = obs.tolist(), False
    while not done:
        sampling = SamplingParams(max_tokens=info.get("remaining_context", 256), stop_token_ids=env.unwrapped.stop_token_ids)
        gen = policy.generate([stream], sampling)[0]
        obs, reward, terminated, truncated, info = env.step(gen.token_ids)
        stream += gen.token_ids.tolist() + obs.tolist()
        done = terminated or truncated
    traj = info["trajectory"]
    assert traj.token_ids.tolist() == stream
    assert traj.num_turns == 2 and traj.reward == 1.0 and traj.metadata["task_id"] == task["id"]
    trl = to_trl([traj])
    assert trl["prompt_ids"][0] + trl["completion_ids"][0] == stream
    assert 0 in trl["env_mask"][0] and trl["env_mask"][0][-1] == 1


def test_standard_wrappers_around_the_recorder(renderer):
    """A TimeLimit from gym.make ends the episode: the recorder outside it records a truncated episode."""
    env = RecordEpisodes(
        gym.wrappers.RecordEpisodeStatistics(gym.make("tokengym/Calculator-v0", tokenizer=renderer, max_episode_steps=1))
    )
    obs, info = env.reset(seed=2)
    obs, reward, terminated, truncated, info = env.step(tool_call_ids(renderer, "1+1", info["tools"]))
    assert truncated and not terminated and len(obs) > 0  # the env itself would have gone on
    traj = info["trajectory"]
    assert traj.truncated and traj.stop_reason == "truncated" and traj.num_turns == 1
    assert info["episode"]["l"] == 1  # RecordEpisodeStatistics saw the same episode end
    obs, info = env.reset(seed=2)  # and the next episode starts cleanly
    *_, terminated, truncated, info = env.step(answer_ids(renderer, info["task"]["answer"]))
    assert terminated and info["trajectory"].reward == 1.0


def test_async_vector_env(renderer):
    envs = gym.vector.AsyncVectorEnv(
        [lambda: gym.make("tokengym/Calculator-v0", tokenizer="qwen2.5") for _ in range(2)], shared_memory=False
    )
    try:
        obs, infos = envs.reset(seed=[5, 6])
        assert len(obs) == 2 and all(o.dtype == np.int64 for o in obs)
        # The same seeds give the same tasks in this process.
        local = gym.make("tokengym/Calculator-v0", tokenizer=renderer)
        assert [local.reset(seed=s)[1]["task"]["id"] for s in (5, 6)] == list(infos["task"]["id"])
        answers = tuple(answer_ids(renderer, a) for a in infos["task"]["answer"])
        obs, rewards, terminated, truncated, infos = envs.step(answers)
        assert rewards.tolist() == [1.0, 1.0] and terminated.all() and [len(o) for o in obs] == [0, 0]
        obs, rewards, terminated, truncated, infos = envs.step(answers)  # next-step autoreset: new prompts
        assert rewards.tolist() == [0.0, 0.0] and not terminated.any() and all(len(o) > 0 for o in obs)
    finally:
        envs.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_make_vec_the_gymnasium_way(renderer, mode):
    """``gym.make_vec`` with no vector kwargs: the async env shares variable-length observations
    through tokengym's shared memory (gymnasium refuses it for a plain Sequence space)."""
    envs = gym.make_vec("tokengym/Calculator-v0", num_envs=2, vectorization_mode=mode, tokenizer="qwen2.5")
    try:
        assert envs.single_observation_space == gym.spaces.Sequence(gym.spaces.Discrete(renderer.vocab_size), stack=True)
        obs, infos = envs.reset(seed=[5, 6])
        assert type(obs) is tuple and all(o.dtype == np.int64 for o in obs)
        local = gym.make("tokengym/Calculator-v0", tokenizer=renderer)
        prompts = [local.reset(seed=s)[0] for s in (5, 6)]
        assert all(np.array_equal(o, p) for o, p in zip(obs, prompts))  # the whole prompt, token for token
        answers = tuple(answer_ids(renderer, a) for a in infos["task"]["answer"])
        for _ in range(3):  # solve, autoreset, solve the new tasks
            obs, rewards, terminated, truncated, infos = envs.step(answers)
            assert rewards.tolist() == [1.0, 1.0] and terminated.all() and [len(o) for o in obs] == [0, 0]
            obs, rewards, terminated, truncated, infos = envs.step(answers)  # next-step autoreset: new prompts
            assert not terminated.any() and all(len(o) > 0 for o in obs)
            assert [renderer.decode(o).count("<|im_start|>user") for o in obs] == [1, 1]
            answers = tuple(answer_ids(renderer, a) for a in infos["task"]["answer"])
    finally:
        envs.close()


def test_shared_memory_too_small_for_an_observation_names_the_fix(renderer):
    from tokengym.envs.spaces import TokenSequence

    def make():
        env = gym.make("tokengym/Calculator-v0", tokenizer="qwen2.5")
        env.unwrapped.observation_space = TokenSequence(renderer.vocab_size, capacity=16)
        return env

    envs = gym.vector.AsyncVectorEnv([make, make])
    try:
        with pytest.raises(ValueError, match=r"an observation of \d+ tokens does not fit the 16 ids.*'shared_memory': False"):
            envs.reset(seed=0)
    finally:
        envs.close(terminate=True)


def test_the_docs_gymnasium_example_runs(capsys):
    block = re.search(r"<!-- run: gym -->\s*```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S).group(1)
    exec(compile(block, "docs/integrations.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "[1. 1. 1. 1.] [ True  True  True  True]"
