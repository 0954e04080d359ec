"""Policy adapters and the rollout driver, with a tiny random Qwen3 model and the real Qwen3 tokenizer.

The end-to-end test of the law lives here: a trainer that recomputes logprobs with one
teacher-forced forward pass over the recorded batch gets the rollout logprobs back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_qwen3 import tiny_qwen3
from tokengym.envs import ReplayEnv
from tokengym.policies import Generation, HFPolicy, SamplingParams, ScriptedPolicy
from tokengym.policies.hf import _filter_logits
from tokengym.recorder import to_verl
from tokengym.recorder.drivers.rollout import rollout, summary_table

from lawcheck import recompute_logprobs


@pytest.fixture(scope="module")
def tiny(qwen3):
    return tiny_qwen3(len(qwen3))


@pytest.fixture(scope="module")
def policy(tiny, qwen3):
    return HFPolicy(tiny, qwen3)


def test_the_law_end_to_end_with_the_transformers_adapter(tiny, policy, qwen3):
    turns = iter([1, 2, 3])  # episodes of different lengths: padding must not shift anything
    result = rollout(
        lambda: ReplayEnv(qwen3, max_turns=next(turns)), policy, episodes=5, concurrency=3,
        sampling=SamplingParams(max_tokens=6, temperature=1.0), seed=11, progress=False,
    )
    trajs = result.trajectories
    assert len(trajs) == 5 and result.stats.failed == 0
    assert len({len(t) for t in trajs}) >= 3 and {t.num_turns for t in trajs} == {1, 2, 3}
    assert all(t.has_logprobs for t in trajs)
    recomputed, rollout_lp = recompute_logprobs(tiny, to_verl(trajs))
    assert recomputed.numel() == sum(int(t.mask.sum()) for t in trajs)
    diff = torch.max(torch.abs(recomputed - rollout_lp)).item()
    print(f"max |recomputed - rollout| logprob = {diff:.2e} over {recomputed.numel()} policy tokens")
    assert diff < 1e-4
    # Each generation was prompted with exactly the recorded prefix.
    for t in trajs:
        for k in range(t.num_turns):
            assert t.context(k).tolist() == t.token_ids[: t.action_spans[k][0]].tolist()
    assert trajs[0].sampling["logprob_kind"] == "raw" and trajs[0].sampling["policy"].startswith("hf:")


def test_runs_are_reproducible_whatever_the_concurrency(policy, qwen3):
    def run(concurrency):
        r = rollout(
            lambda: ReplayEnv(qwen3, max_turns=2), policy, episodes=3, concurrency=concurrency,
            sampling=SamplingParams(max_tokens=5), seed=5, progress=False,
        )
        return [t.token_ids.tolist() for t in r.trajectories]

    assert run(1) == run(3)


def test_seeded_requests_ignore_their_batch_neighbours(policy):
    sp = SamplingParams(max_tokens=6, seed=123)
    alone = policy.generate([[1, 2, 3]], sp)[0]
    batched = policy.generate([[9, 8, 7, 6, 5, 4], [1, 2, 3]], [SamplingParams(max_tokens=3, seed=1), sp])[1]
    assert alone.token_ids.tolist() == batched.token_ids.tolist()
    np.testing.assert_allclose(alone.logprobs, batched.logprobs, atol=1e-5)
    assert alone.finish_reason == "length" and len(alone.token_ids) == 6


def test_stop_tokens_are_kept_and_end_generation(policy):
    greedy = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))[0]
    first = int(greedy.token_ids[0])
    stopped = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,)))[0]
    assert stopped.token_ids.tolist() == [first] and stopped.finish_reason == "stop"


def test_stop_strings_end_generation(policy, qwen3):
    greedy = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))[0]
    text = qwen3.decode(greedy.token_ids[:3].tolist())
    stop = text[-2:] if len(text.strip()) >= 2 else text
    got = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, stop_strings=(stop,)))[0]
    assert got.finish_reason == "stop_string" and len(got.token_ids) <= 3


def test_stop_strings_spelled_by_many_tokens_end_generation(policy, qwen3):
    # The env's check (tokengym.envs.stop_strings): a stop string of 18 tokens, longer than
    # the 16-token tail this adapter once decoded, still ends generation.
    stop = "𓀀𓀁𓀂𓀃𓀄𓀅"
    out = qwen3.encode("Say " + stop, add_special_tokens=False)
    assert len(qwen3.encode(stop, add_special_tokens=False)) > 16
    sp = SamplingParams(max_tokens=100, stop_strings=(stop,))
    assert policy.finish_reason(out, sp) == "stop_string"
    assert policy.finish_reason(out[:-1], sp) is None


def test_filters_keep_the_right_tokens():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert torch.isinf(_filter_logits(logits, SamplingParams(top_k=2))).tolist() == [True, True, False, False]
    # probs ~ [.03, .09, .24, .64]: top_p=0.8 keeps the two largest
    assert torch.isinf(_filter_logits(logits, SamplingParams(top_p=0.8))).tolist() == [True, True, False, False]
    assert not torch.isinf(_filter_logits(logits, SamplingParams(top_p=1.0))).any()


@pytest.mark.parametrize("kwargs, match", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k")])
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_turn_s_sampling_settings_are_the_base_s_with_its_budget_and_seed():
    base = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(2, 3), stop_strings=("x",))
    turn = base.for_turn(10, 1234)
    assert turn == base.replace(max_tokens=10, seed=1234) and turn is not base and base.max_tokens == 64
    assert base.for_turn(1, None).seed is None
    with pytest.raises(ValueError, match="max_tokens"):
        base.for_turn(0, 1)


def test_generation_checks_logprob_length():
    with pytest.raises(ValueError, match="2 logprobs for 3"):
        Generation([1, 2, 3], [0.0, 0.0], "stop")


def test_scripted_policy_drives_episodes_and_failures_are_counted(qwen25):
    calls = []

    def script(context):
        calls.append(len(context))
        return "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>" if len(calls) % 2 else [10**7]

    result = rollout(
        lambda: ReplayEnv(qwen25, max_turns=2), ScriptedPolicy(script, qwen25, end_ids=[151645]),
        episodes=3, concurrency=1, seed=0, progress=False,
    )
    # Every second reply is an out-of-vocabulary id: that episode fails, the run goes on.
    assert result.stats.failed >= 1 and result.stats.episodes + result.stats.failed == 3
    assert "outside the vocabulary" in result.stats.errors[0]
    assert all(not t.has_logprobs for t in result.trajectories)
    assert "episodes" in summary_table(result.stats)


def test_ctrl_c_keeps_every_finished_episode(qwen25):
    n = {"calls": 0}

    def script(context):
        n["calls"] += 1
        if n["calls"] == 4:
            raise KeyboardInterrupt
        return [9707, 151645]

    result = rollout(
        lambda: ReplayEnv(qwen25, max_turns=1), ScriptedPolicy(script), episodes=10, concurrency=1, progress=False
    )
    assert result.interrupted and len(result.trajectories) == 3
    assert [t.metadata["episode"] for t in result.trajectories] == [0, 1, 2]


def test_rollout_cli_writes_a_readable_store(tiny, qwen3, tmp_path, capsys):
    from tokengym.recorder import read_trajectories
    from tokengym.recorder.cli import main

    tiny.save_pretrained(tmp_path / "model")
    qwen3.save_pretrained(tmp_path / "model")
    out = tmp_path / "store"
    code = main([
        "rollout", "tokengym/Replay-v0", "--model", str(tmp_path / "model"), "--episodes", "3",
        "--concurrency", "2", "--max-tokens", "4", "--max-turns", "2", "--out", str(out), "--quiet",
    ])
    assert code == 0
    assert "3 done, 0 failed" in capsys.readouterr().out
    trajs = list(read_trajectories(out))
    assert len(trajs) == 3 and all(t.num_turns == 2 and t.has_logprobs for t in trajs)
    assert main(["rollout", "tokengym/Nope-v0", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "x")]) == 2


def test_demo_with_another_model(tiny, qwen3, tmp_path, capsys):
    from tokengym.recorder import read_trajectories
    from tokengym.recorder.cli import main

    tiny.save_pretrained(tmp_path / "model")
    qwen3.save_pretrained(tmp_path / "model")
    out = tmp_path / "demo"
    code = main(["demo", "--model", str(tmp_path / "model"), "--episodes", "2", "--max-tokens", "4",
                 "--max-turns", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "2 done, 0 failed" in printed and f"tokengym inspect {out}" in printed
    trajs = list(read_trajectories(out))
    assert len(trajs) == 2 and all(t.has_logprobs for t in trajs)
    assert {t.sampling["policy"] for t in trajs} == {f"hf:{tmp_path / 'model'}"}  # the model asked for, not SmolLM2
    assert main(["demo", "--policy", "vllm", "--out", str(tmp_path / "x")]) == 2
    assert "--policy vllm needs --model" in capsys.readouterr().err
