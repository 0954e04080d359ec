"""tokengym/ToolAddition-v0: the two-turn calculator task, its per-turn reward and its grade, with
scripted replies in the real Qwen2.5 template's own tool-call format (and SmolLM2's, with
CHATML_TOOLS, when its package is installed); and, marked slow, two GRPO iterations of the
bundled SmolLM2 on it."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest

from tokengym.envs import ToolAdditionEnv
from tokengym.envs.builtin.tool_addition import TOOL_ADDITION_EXAMPLES
from tokengym.envs.templates import CHATML_TOOLS
from tokengym.recorder import RecordEpisodes
from needs import SMOLLM2_MISSING, requires

def question(env) -> tuple[int, int]:
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", env.unwrapped.messages[-1]["content"])[-1]
    return int(a), int(b)


def calc(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}


def say(env, content: str = "", *calls: dict) -> np.ndarray:
    """An assistant turn in the template's own format (tool calls as the template renders them)."""
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = list(calls)
    tools = [t.schema for t in env.unwrapped.tools.values()]
    return np.array(env.unwrapped.renderer.assistant(msg, tools).ids, dtype=np.int64)


def play(env, turns, *, seed: int = 3):
    """Reset, then each ``turns[i](a, b)`` -> (content, calls); returns the trajectory, rewards and last info."""
    obs, _ = env.reset(seed=seed)
    a, b = question(env)
    stream, mask, rewards = list(obs), [0] * len(obs), []
    for make in turns:
        content, calls = make(a, b)
        action = say(env, content, *calls)
        obs, reward, terminated, truncated, info = env.step(action)
        stream += action.tolist() + obs.tolist()
        mask += [1] * len(action) + [0] * len(obs)
        rewards.append(reward)
        if terminated or truncated:
            break
    assert terminated or truncated, "the script ended before the episode"
    traj = info["trajectory"]
    # The token law, over both turns: the stream is reset obs + a1 + o1 + a2, mask 1 exactly on the actions.
    assert traj.token_ids.tolist() == stream and traj.mask.tolist() == mask
    return traj, rewards, info, (a, b)


@pytest.fixture
def env(qwen25):
    return RecordEpisodes(ToolAdditionEnv(qwen25, conformance="strict"))


def test_the_prompt_has_worked_examples_then_the_question(env):
    _, info = env.reset(seed=5)
    roles = [m["role"] for m in info["messages"]]
    assert roles == ["system", *["user", "assistant", "tool", "assistant"] * 2, "user"]
    a, b = question(env)
    assert 100 <= a <= 999 and 100 <= b <= 999
    assert info["task"] == {"id": f"tool-addition-{a}+{b}", "prompt": f"What is {a} + {b}?", "a": a, "b": b, "answer": a + b}
    (q1, e1, r1), (q2, e2, r2) = TOOL_ADDITION_EXAMPLES[:2]
    example_call = info["messages"][2]["tool_calls"][0]["function"]
    assert info["messages"][1]["content"] == q1 and example_call["arguments"] == {"expression": e1}
    assert info["messages"][3]["content"] == str(r1) and info["messages"][4]["content"] == f"<answer>{r1}</answer>"
    assert info["messages"][5]["content"] == q2


def test_few_shot_sets_how_many_examples_and_the_question_follows_the_seed(qwen25):
    env = ToolAdditionEnv(qwen25, few_shot=0)
    _, info = env.reset(seed=1)
    assert [m["role"] for m in info["messages"]] == ["system", "user"]
    first = question(env)
    env.reset(seed=2)
    env.reset(seed=1)
    assert question(env) == first
    assert len({(env.reset(seed=s), question(env))[1] for s in range(10)}) > 5
    _, info = ToolAdditionEnv(qwen25, few_shot=3).reset(seed=1)
    assert len(info["messages"]) == 2 + 4 * 3


def test_a_call_then_the_result_scores_one_per_turn(env):
    traj, rewards, info, (a, b) = play(
        env, [lambda a, b: ("I will use the calculator.", [calc(f"{a} + {b}")]), lambda a, b: (f"<answer>{a + b}</answer>", [])]
    )
    assert rewards == [1.0, 1.0] and traj.reward == 2.0 and traj.terminated and traj.num_turns == 2
    assert traj.turn_rewards.tolist() == [1.0, 1.0]
    # The tool result between the turns is the env's: the sum, read back by the second turn.
    assert str(a + b) in env.unwrapped.renderer.decode(traj.segments[2].token_ids)
    assert traj.metadata["grade"] == {
        "called": True, "call_valid": True, "call_right": True, "format_ok": True, "correct": True, "answer": a + b,
    }
    assert traj.metadata["task_id"] == f"tool-addition-{a}+{b}" and traj.metadata["tool_stats"]["ok"] == 1


@pytest.mark.parametrize(
    ("turns", "rewards", "grade"),
    [
        # a valid call, then a wrong answer: the call's point only
        ([("", ["{a} + {b}"]), ("<answer>{wrong}</answer>", [])], [1.0, 0.0],
         dict(called=True, call_valid=True, call_right=True, format_ok=True, correct=False)),
        # a valid call of the wrong sum, then its result: valid, not right
        ([("", ["{a} - {b}"]), ("<answer>{diff}</answer>", [])], [1.0, 0.0],
         dict(called=True, call_valid=True, call_right=False, format_ok=True, correct=False)),
        # the right answer without the tool: one turn, the answer's point only
        ([("<answer>{sum}</answer>", [])], [1.0],
         dict(called=False, call_valid=False, call_right=False, format_ok=True, correct=True)),
        ([("{sum}", [])], [0.0], dict(called=False, call_valid=False, call_right=False, format_ok=False, correct=False)),
        # a call the calculator refuses is not valid; the right answer after it still scores
        ([("", ["{a} plus {b}"]), ("<answer>{sum}</answer>", [])], [0.0, 1.0],
         dict(called=True, call_valid=False, call_right=False, format_ok=True, correct=True)),
        # a second call instead of the answer: max_turns ends the episode unanswered; one call point
        ([("", ["{a} + {b}"]), ("", ["{a} + {b}"])], [1.0, 0.0],
         dict(called=True, call_valid=True, call_right=True, format_ok=False, correct=False)),
    ],
)
def test_reward_is_one_for_a_valid_call_and_one_for_the_right_answer(env, turns, rewards, grade):
    def turn(content, expressions):
        def make(a, b):
            values = dict(a=a, b=b, sum=a + b, wrong=a + b + 1, diff=a - b)
            return content.format(**values), [calc(e.format(**values)) for e in expressions]

        return make

    traj, got, info, _ = play(env, [turn(*t) for t in turns])
    assert got == rewards and traj.reward == sum(rewards)
    assert {k: v for k, v in traj.metadata["grade"].items() if k != "answer"} == grade
    assert traj.terminated == (info["stop_reason"] == "done")
    if not grade["format_ok"] and grade["called"]:
        assert info["stop_reason"] == "max_turns" and traj.metadata["grade"]["answer"] is None


def test_registered_and_what_it_refuses(qwen25):
    made = gym.make("tokengym/ToolAddition-v0", tokenizer=qwen25, low=10, high=20)
    made.reset(seed=0)
    a, b = question(made)
    assert 10 <= a <= 20 and 10 <= b <= 20
    env = ToolAdditionEnv(qwen25)
    _, info = env.reset(seed=0, options={"a": 123, "b": 456})
    assert info["task"]["answer"] == 579
    with pytest.raises(ValueError, match="both 'a' and 'b'"):
        env.reset(seed=0, options={"a": 1})
    with pytest.raises(ValueError, match="few_shot must be between 0 and 3"):
        ToolAdditionEnv(qwen25, few_shot=4)
    with pytest.raises(ValueError, match="low <= high"):
        ToolAdditionEnv(qwen25, low=5, high=4)


def test_a_worked_example_is_never_the_question(qwen25, monkeypatch):
    """Draws that hit an example's numbers are drawn again (from the same seeded stream)."""
    env = ToolAdditionEnv(qwen25)
    (_, expression, _) = TOOL_ADDITION_EXAMPLES[0]
    a, b = (int(x) for x in expression.split(" + "))
    draws = iter([(a, b), (a, b), (111, 222)])
    monkeypatch.setattr(env, "_draw", lambda: next(draws))
    _, info = env.reset(seed=0)
    assert (info["task"]["a"], info["task"]["b"]) == (111, 222)


def test_without_the_schema_the_prompt_is_shorter_and_calls_still_run(qwen25):
    full = ToolAdditionEnv(qwen25)
    lean = RecordEpisodes(ToolAdditionEnv(qwen25, schema_in_prompt=False, conformance="strict"))
    obs_full, _ = full.reset(seed=4)
    obs_lean, _ = lean.reset(seed=4)
    text = lean.unwrapped.renderer.decode(obs_lean)
    assert '"parameters"' in full.renderer.decode(obs_full) and '"parameters"' not in text
    assert len(obs_lean) < len(obs_full) and text.count('"expression": "') == 2  # the examples' calls stay
    traj, rewards, _, _ = play(
        lean, [lambda a, b: ("", [calc(f"{a} + {b}")]), lambda a, b: (f"<answer>{a + b}</answer>", [])], seed=4
    )
    assert rewards == [1.0, 1.0] and traj.metadata["grade"]["call_right"]


@requires("SMOLLM2", SMOLLM2_MISSING)
def test_smollm2_template_with_chatml_tools():
    from tokengym.envs import load_tokenizer

    env = RecordEpisodes(ToolAdditionEnv(load_tokenizer("SmolLM2-135M-Instruct"), chat_template=CHATML_TOOLS, conformance="strict"))
    traj, rewards, _, (a, b) = play(
        env, [lambda a, b: ("I will use the calculator.", [calc(f"{a} + {b}")]), lambda a, b: (f"<answer>{a + b}</answer>", [])]
    )
    assert rewards == [1.0, 1.0] and traj.metadata["grade"]["correct"] and traj.num_turns == 2


@requires("SMOLLM2", SMOLLM2_MISSING)
def test_smollm2_own_template_is_refused_though_the_system_prompt_names_the_tool():
    """SmolLM2's own template drops the tool schemas; the Calculator's system prompt says
    "calculate", so a guard that looked for the name passed it. The schema is what is judged."""
    import gymnasium as gym

    from tokengym.envs.render import TemplateError

    with pytest.raises(TemplateError, match="schema of 'calculate' is missing from the prompt.*CHATML_TOOLS"):
        gym.make("tokengym/Calculator-v0", tokenizer="smollm2").reset(seed=0)
    env = gym.make("tokengym/Calculator-v0", tokenizer="smollm2", chat_template=CHATML_TOOLS)
    obs, _ = env.reset(seed=0)
    assert '"expression"' in env.unwrapped.renderer.decode(obs)


@pytest.mark.slow
@requires("SMOLLM2", SMOLLM2_MISSING)
def test_two_grpo_iterations_of_smollm2_stay_on_policy_across_turns():
    """The short mode of ``benchmarks/learning.py --env tool-addition``: the bundled model, two iterations."""
    import torch

    from tokengym.policies import SamplingParams
    from tokengym.policies.model_loading import load_smollm2
    from tokengym.recorder.learning import GRPOConfig, grade_metrics, train_grpo

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(progress=False)
    config = GRPOConfig(
        iterations=2, tasks_per_iteration=1, group_size=4, eval_episodes=1,  # one group: half the backward pass memory of two (12 GB RSS)
        sampling=SamplingParams(max_tokens=48), eval_sampling=SamplingParams(max_tokens=48, temperature=0.0),
    )
    run = train_grpo(
        model, tokenizer, lambda: ToolAdditionEnv(tokenizer, chat_template=CHATML_TOOLS, schema_in_prompt=False), config,
        metrics=grade_metrics,
    )
    assert len(run.iterations) == 2 and len(run.evals) == 2
    assert set(run.iterations[0].metrics) == {"called", "call_valid", "call_right", "format_ok", "correct"}
    # The few-shot examples get the model to call the tool: some episodes have two turns, and the
    # logprobs of both turns' tokens, recomputed by the trainer, are the sampled ones.
    assert max(it.turns for it in run.iterations) > 1 and max(it.metrics["called"] for it in run.iterations) > 0
    assert max(it.logprob_diff for it in run.iterations) < 1e-3
    assert all(it.updated or it.groups_with_signal == 0 for it in run.iterations)
