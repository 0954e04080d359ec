"""tokengym/Addition-v0: the question from the reset seed, the reward for the format and the sum,
and the grade carried into the recorded trajectory, with scripted replies on the real Qwen2.5 template."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest

from tokengym.envs import AdditionEnv
from tokengym.envs.builtin import grade_addition
from tokengym.policies import ScriptedPolicy
from tokengym.recorder import grpo_advantages, rollout


def question(env: AdditionEnv) -> tuple[int, int]:
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", env.messages[-1]["content"])[-1]
    return int(a), int(b)


def reply(env: AdditionEnv, text: str) -> tuple[float, bool, dict]:
    action = env.renderer.assistant({"role": "assistant", "content": text}).ids
    _, reward, terminated, truncated, info = env.step(action)
    assert terminated and not truncated  # one turn, always
    return reward, terminated, info


@pytest.fixture
def env(qwen25):
    return AdditionEnv(qwen25, conformance="strict")


def test_the_prompt_has_a_system_prompt_a_worked_example_and_the_question(env):
    _, info = env.reset(seed=5)
    roles = [m["role"] for m in info["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert "<answer>N</answer>" in info["messages"][0]["content"]
    assert info["messages"][2]["content"] == "<answer>7</answer>"
    a, b = question(env)
    assert 0 <= a <= 20 and 0 <= b <= 20
    assert info["task"] == {"id": f"addition-{a}+{b}", "a": a, "b": b, "answer": a + b}


def test_the_question_follows_the_reset_seed(env):
    asked = []
    for seed in (1, 2, 1):
        env.reset(seed=seed)
        asked.append(question(env))
    assert asked[0] == asked[2]
    seen = set()
    for s in range(20):
        env.reset(seed=s)
        seen.add(question(env))
    assert len(seen) > 5  # seeds give different questions


@pytest.mark.parametrize(
    ("text", "reward", "format_ok", "correct"),
    [
        ("<answer>{sum}</answer>", 2.0, True, True),
        ("The sum is <answer> {sum} </answer>", 2.0, True, True),
        ("<answer>{wrong}</answer>", 1.0, True, False),
        ("<answer>0</answer> no, <answer>{sum}</answer>", 2.0, True, True),  # the last tag counts
        ("{sum}", 0.0, False, False),
        ("<answer>{sum}", 0.0, False, False),
        ("<answer>about {sum}</answer>", 0.0, False, False),
        ("<answer>{sum}.5</answer>", 0.0, False, False),
    ],
)
def test_reward_is_one_for_the_format_and_one_more_for_the_sum(env, text, reward, format_ok, correct):
    env.reset(seed=3)
    a, b = question(env)
    got, _, info = reply(env, text.format(sum=a + b, wrong=a + b + 1))
    assert got == reward
    assert info["grade"]["format_ok"] is format_ok and info["grade"]["correct"] is correct
    assert info["stop_reason"] == "done"


def test_reset_options_ask_a_given_question(env):
    _, info = env.reset(seed=0, options={"a": 123, "b": 456})
    assert question(env) == (123, 456) and info["task"]["answer"] == 579
    with pytest.raises(ValueError, match="both 'a' and 'b'"):
        env.reset(seed=0, options={"a": 1})


def test_bad_arguments_are_refused(qwen25):
    with pytest.raises(ValueError, match="low <= high"):
        AdditionEnv(qwen25, low=5, high=2)
    with pytest.raises(ValueError, match="one-turn"):
        AdditionEnv(qwen25, max_turns=3)


def test_grade_reads_the_last_answer_tag():
    assert grade_addition("<answer>-3</answer>", -3) == {"format_ok": True, "correct": True, "answer": -3}
    assert grade_addition("nothing here", 4) == {"format_ok": False, "correct": False, "answer": None}


def test_registered_and_recorded_with_the_grade_in_the_metadata(qwen25):
    """Through gym.make and the rollout driver: right, wrong and malformed replies, in GRPO groups."""
    end = [qwen25.convert_tokens_to_ids("<|im_end|>")]
    kinds = iter(["right", "wrong", "malformed"] * 4)

    def script(context: np.ndarray) -> str:
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", qwen25.decode(context))[-1]
        kind = next(kinds)
        s = int(a) + int(b)
        return {"right": f"<answer>{s}</answer>", "wrong": f"<answer>{s + 2}</answer>", "malformed": f"{s}"}[kind]

    result = rollout(
        lambda: gym.make("tokengym/Addition-v0", tokenizer=qwen25), ScriptedPolicy(script, qwen25, end_ids=end),
        episodes=6, group_size=3, concurrency=1, seed=11, progress=False,
    )
    trajs = result.trajectories
    assert result.stats.failed == 0 and len(trajs) == 6
    assert [t.reward for t in trajs] == [2.0, 1.0, 0.0] * 2
    assert [t.metadata["grade"]["format_ok"] for t in trajs] == [True, True, False] * 2
    assert [t.metadata["grade"]["correct"] for t in trajs] == [True, False, False] * 2
    for g in (0, 1):  # a group shares its question
        assert len({t.metadata["task_id"] for t in trajs[3 * g : 3 * g + 3]}) == 1
    advantages = np.asarray(grpo_advantages(trajs).advantages)
    assert advantages[0] > 0 > advantages[2]
