"""The TRL rollout function without TRL: the prompt format, the returned dict, the completion budget.

A stand-in trainer (``args`` and ``processing_class``) and a scripted policy are enough for
everything but the trainer's own model; tests/integrations/test_trl.py runs it in real
``GRPOTrainer`` training steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tokengym.envs import ChatRenderer, ReplayEnv
from tokengym.policies import ScriptedPolicy
from tokengym.recorder.integrations.trl import env_reward, parse_prompt, trl_prompts, trl_rollout_func


def trainer(tokenizer, max_completion_length=256):
    args = SimpleNamespace(max_completion_length=max_completion_length, seed=0, temperature=1.0, top_p=1.0, top_k=0)
    return SimpleNamespace(args=args, processing_class=tokenizer)


def test_groups_follow_the_trainers_num_generations(qwen25):
    from tokengym.recorder.integrations.trl import _groups

    specs = [parse_prompt(p) for p in trl_prompts(3, seed=0) for _ in range(2)]
    assert _groups(specs, 2) == [0, 0, 1, 1, 2, 2]
    assert _groups(specs, 3) == [0, 0, 0, 1, 1, 1]  # TRL's runs of num_generations, even over equal prompts
    assert _groups(specs, None) == [0, 0, 2, 2, 4, 4]  # copies of one prompt


def test_prompt_formats():
    assert parse_prompt('{"seed": 3}') == (3, {})
    assert parse_prompt(trl_prompts(1, seed=4, options={"difficulty": 2})[0]) == (4, {"difficulty": 2})
    assert parse_prompt("What is 2 + 2?") == (None, {"messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    assert parse_prompt('{"question": 1}') == (None, {"messages": [{"role": "user", "content": '{"question": 1}'}]})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert parse_prompt(messages) == (None, {"messages": messages})
    with pytest.raises(ValueError, match="integer"):
        parse_prompt('{"seed": "three"}')
    with pytest.raises(TypeError, match="trl_prompts"):
        parse_prompt(42)


def test_one_episode_per_prompt_in_order(qwen25):
    renderer = ChatRenderer(qwen25)
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "6*7"}}}
    work = renderer.assistant({"role": "assistant", "content": "", "tool_calls": [call]}).ids
    answer = renderer.assistant({"role": "assistant", "content": "<answer>42</answer>"}).ids

    def script(context):
        return answer if "<tool_response>" in renderer.decode(context[-64:]) else work

    rollout = trl_rollout_func("tokengym/Calculator-v0", policy=ScriptedPolicy(script))
    prompts = [p for p in trl_prompts(2, seed=10) for _ in range(2)]  # as TRL passes them: G=2 copies in a row
    out = rollout(prompts, trainer(qwen25))
    trajs = rollout.last_trajectories
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "task_id", "num_turns", "stop_reason"}
    assert all(len(v) == 4 for v in out.values())
    assert out["task_id"][0] == out["task_id"][1] != out["task_id"][2] == out["task_id"][3]
    assert out["prompt_ids"][0] == out["prompt_ids"][1] and [t.seed for t in trajs] == [10, 10, 11, 11]
    for i, t in enumerate(trajs):
        assert out["prompt_ids"][i] + out["completion_ids"][i] == t.token_ids.tolist()
        assert out["env_mask"][i] == t.mask[t.prompt_len :].tolist()
        first, obs, second = (len(s) for s in t.segments[1:])
        assert out["env_mask"][i] == [1] * first + [0] * obs + [1] * second
        assert out["logprobs"][i] == [0.0] * len(out["completion_ids"][i])  # a scripted policy has none
        assert t.sampling["policy"] == "scripted" and t.metadata["trl"]["index"] == i
    # The copies of a prompt are a group (here found as equal prompts: the trainer has no num_generations).
    assert [t.metadata["group"] for t in trajs] == ["0:0:0", "0:0:0", "0:0:2", "0:0:2"]
    assert out["num_turns"] == [2] * 4 and out["stop_reason"] == ["done"] * 4
    assert env_reward(out["completion_ids"], out["env_reward"]) == [t.reward for t in trajs]
    # Text prompts are the conversation; the envs are reused from call to call.
    envs = list(rollout.envs)
    out = rollout(["What is 6 times 7?"] * 2, trainer(qwen25))
    assert rollout.envs[:2] == envs[:2] and out["env_reward"] == [0.0, 0.0]  # no task answer to score
    assert "What is 6 times 7?" in renderer.decode(out["prompt_ids"][0])
    rollout.close()


def test_the_whole_completion_stays_within_max_completion_length(qwen25):
    renderer = ChatRenderer(qwen25)
    env_limit = ReplayEnv(renderer, max_turns=3).max_context_tokens
    five = ScriptedPolicy(lambda context: [9707] * 5)  # five tokens, never closing the turn
    rollout = trl_rollout_func(lambda: ReplayEnv(renderer, max_turns=3), policy=five)

    short = rollout(trl_prompts(2), trainer(qwen25, max_completion_length=40))
    for completion, reason in zip(short["completion_ids"], short["stop_reason"]):
        assert len(completion) <= 40
    # The transcript's first tool results do not fit in 40 tokens: the episode ends there, truncated.
    assert short["stop_reason"] == ["context_length"] * 2 and short["completion_ids"][0] == [9707] * 5
    assert all(env.unwrapped.max_context_tokens == env_limit for env in rollout.envs)  # the cap is undone

    roomy = rollout(trl_prompts(2), trainer(qwen25, max_completion_length=4000))
    assert roomy["num_turns"] == [3, 3] and roomy["stop_reason"] == ["max_turns"] * 2
    assert max(len(c) for c in roomy["completion_ids"]) > 40
    # A per-turn limit below the budget.
    rollout.max_tokens_per_turn = 3
    out = rollout(trl_prompts(1), trainer(qwen25, max_completion_length=4000))
    assert [len(a) for a in rollout.last_trajectories[0].actions] == [3, 3, 3]
    assert np.array_equal(rollout.last_trajectories[0].actions[0].token_ids, [9707] * 3)
    rollout.close()
