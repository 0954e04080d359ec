"""grpo_loss against hand-computed values, and train_grpo's loop with a tiny random Qwen3.

The loop's learning itself is shown by notebooks/learn.ipynb and measured by
benchmarks/learning.py (minutes of CPU); here: that it updates on a signal and only then,
that every iteration's rollout is on-policy (the recomputed logprobs match the sampled ones
after updates too), and what it refuses.
"""

from __future__ import annotations

import dataclasses
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tokengym.envs import AdditionEnv
from tokengym.policies import SamplingParams
from tokengym.recorder import NoGroupSignalWarning
from tokengym.recorder.learning import GRPOConfig, grade_metrics, train_grpo
from tokengym.recorder.training import grpo_loss

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_on_policy_the_loss_is_minus_the_mean_advantage_and_its_gradient_is_reinforce():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([2.0, -1.0])  # per row, broadcast to its tokens
    out = grpo_loss(lp, old, adv, MASK)
    assert out.tokens == 3 and out.clip_fraction == 0.0 and out.kl == 0.0
    assert math.isclose(out.policy_loss, -(2 + 2 - 1) / 3, rel_tol=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 / 3, -2 / 3, 0.0], [1 / 3, 0.0, 0.0]]))


def test_the_clip_cuts_the_gradient_only_where_it_binds():
    old = torch.zeros(2, 3)
    lp = torch.full((2, 3), math.log(1.5), requires_grad=True)  # ratio 1.5 everywhere
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    out = grpo_loss(lp, old, adv, MASK, clip_eps=0.2)
    # Row 0 (A > 0): min(1.5, 1.2) = 1.2, clipped; row 1 (A < 0): min(-1.5, -1.2) = -1.5, not clipped.
    assert math.isclose(out.policy_loss, -(1.2 + 1.2 - 1.5) / 3, rel_tol=1e-6)
    assert math.isclose(out.clip_fraction, 2 / 3, rel_tol=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0], [1.5 / 3, 0.0, 0.0]]))


def test_the_kl_term_is_k3_to_the_reference_and_pulls_back_towards_it():
    old = torch.zeros(2, 3)
    lp = torch.zeros(2, 3, requires_grad=True)
    ref = torch.tensor([[0.5, -0.5, 9.0], [0.2, 9.0, 9.0]])  # off-mask values must not count
    adv = torch.zeros(2)
    out = grpo_loss(lp, old, adv, MASK, ref_logprobs=ref, kl_coef=0.1)
    want = np.mean([math.exp(d) - d - 1 for d in (0.5, -0.5, 0.2)])
    assert math.isclose(out.kl, want, rel_tol=1e-5) and out.kl > 0
    assert math.isclose(float(out.loss.detach()), 0.1 * want, rel_tol=1e-5)
    out.loss.backward()
    assert lp.grad[0, 0] < 0 < lp.grad[0, 1]  # descending raises logprobs below the reference, lowers those above
    # Without kl_coef the KL is reported but not in the loss.
    plain = grpo_loss(lp, old, adv, MASK, ref_logprobs=ref)
    assert math.isclose(plain.kl, want, rel_tol=1e-5) and float(plain.loss.detach()) == 0.0


def test_what_grpo_loss_refuses():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        grpo_loss(z, z, torch.zeros(2), MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match="same"):
        grpo_loss(z, torch.zeros(2, 4), torch.zeros(2), MASK)
    with pytest.raises(ValueError, match=r"must be \[B\] or \[B, R\]"):
        grpo_loss(z, z, torch.zeros(3), MASK)
    with pytest.raises(ValueError, match="no policy token"):
        grpo_loss(z, z, torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_loss(z, z, torch.zeros(2), MASK, clip_eps=0.0)


# ------------------------------------------------------------------ the loop
@pytest.fixture
def tiny(qwen3):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(qwen3), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).eval()


class FirstTokenParity(gym.Wrapper):
    """A reward a random model earns half the time: the parity of its first token."""

    def __init__(self, env, constant: float | None = None):
        super().__init__(env)
        self.constant = constant

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        reward = self.constant if self.constant is not None else float(int(np.asarray(action)[0]) % 2)
        return obs, reward, terminated, truncated, info


def small(**changes) -> GRPOConfig:
    base = dict(
        iterations=2, tasks_per_iteration=2, group_size=4, lr=1e-3, eval_every=10, eval_episodes=2,
        sampling=SamplingParams(max_tokens=4), eval_sampling=SamplingParams(max_tokens=4, temperature=0.0),
    )
    return GRPOConfig(**{**base, **changes})


def test_the_loop_updates_on_a_signal_and_stays_on_policy(tiny, qwen3):
    before = tiny.get_output_embeddings().weight.detach().clone()
    logs = []
    run = train_grpo(
        tiny, qwen3, lambda: FirstTokenParity(AdditionEnv(qwen3)), small(), metrics=grade_metrics, on_iteration=logs.append
    )
    assert [it.iteration for it in run.iterations] == [0, 1] and logs == run.iterations
    assert [e.iteration for e in run.evals] == [0, 2]  # before training, and at the end
    assert all(it.updated and it.groups_with_signal > 0 for it in run.iterations)
    # The second iteration samples with updated weights: still on-policy.
    assert max(it.logprob_diff for it in run.iterations) < 1e-4
    assert not torch.equal(before, tiny.get_output_embeddings().weight)
    assert set(run.iterations[0].metrics) == {"format_ok", "correct"}
    assert run.series("reward").shape == (2,) and "2 iterations" in run.summary()
    # Held-out questions that training happened to ask are counted, and left out of the unseen means.
    assert run.evals[0].seen == 0 and run.evals[0].unseen_metrics == run.evals[0].metrics


def test_held_out_tasks_that_training_asked_are_counted(tiny, qwen3):
    """One question for every seed: the held-out episodes all ask what training asked."""
    class OneQuestion(AdditionEnv):
        def make_prompt(self, options):
            return super().make_prompt({"a": 2, "b": 3})

    run = train_grpo(tiny, qwen3, lambda: FirstTokenParity(OneQuestion(qwen3)), small(iterations=1, eval_episodes=3))
    assert [e.seen for e in run.evals] == [0, 3]  # nothing trained before the first evaluation
    assert math.isnan(run.evals[1].unseen_reward) and run.evals[1].unseen_metrics == {}
    before, after, n = run.held_out_change()
    assert n == 0 and math.isnan(before) and math.isnan(after)  # no question is left that training never asked


def test_before_and_after_are_compared_on_the_same_held_out_questions(tiny, qwen3):
    """The change is measured on the questions training never asked by its end, in both
    evaluations, never the first evaluation's full set against the last one's remainder."""
    run = train_grpo(tiny, qwen3, lambda: FirstTokenParity(AdditionEnv(qwen3)), small(eval_episodes=6), metrics=grade_metrics)
    first, last = run.evals[0], run.evals[-1]
    assert len(first.episodes) == len(last.episodes) == 6 and first.trained == frozenset()
    assert [e.task_id for e in first.episodes] == [e.task_id for e in last.episodes]
    keep = [i for i, e in enumerate(last.episodes) if e.task_id not in last.trained]
    assert len(keep) == 6 - last.seen
    before, after, n = run.held_out_change("correct")
    assert n == len(keep)
    assert before == pytest.approx(np.mean([first.episodes[i].metrics["correct"] for i in keep]))
    assert after == pytest.approx(np.mean([last.episodes[i].metrics["correct"] for i in keep]))
    assert run.held_out_change()[1] == pytest.approx(last.unseen_reward)
    changed = dataclasses.replace(last, episodes=last.episodes[::-1])
    run.evals[-1] = changed
    if [e.task_id for e in changed.episodes] != [e.task_id for e in first.episodes]:
        with pytest.raises(ValueError, match="asked different questions"):
            run.held_out_change()


def test_no_signal_no_step(tiny, qwen3):
    before = [p.detach().clone() for p in tiny.parameters()]
    with pytest.warns(NoGroupSignalWarning):
        run = train_grpo(tiny, qwen3, lambda: FirstTokenParity(AdditionEnv(qwen3), constant=1.0), small(iterations=1))
    assert not run.iterations[0].updated and run.iterations[0].groups_with_signal == 0
    assert all(torch.equal(a, b) for a, b in zip(before, tiny.parameters()))


def test_with_a_kl_term_the_reference_is_the_start_policy(tiny, qwen3):
    run = train_grpo(tiny, qwen3, lambda: FirstTokenParity(AdditionEnv(qwen3)), small(kl_coef=0.1))
    assert run.iterations[0].kl == pytest.approx(0.0, abs=1e-6)  # nothing moved yet
    assert run.iterations[1].kl > 0  # the second batch is scored by moved weights


def test_what_the_config_refuses():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="temperature 1.0"):
        GRPOConfig(sampling=SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="overlap the held-out"):
        GRPOConfig(seed=999_990, iterations=10)


def test_grade_metrics_names_the_fix_for_an_env_without_a_grade(tiny, qwen3):
    from tokengym.envs import ReplayEnv
    from tokengym.policies import HFPolicy
    from tokengym.recorder import rollout

    traj = rollout(lambda: ReplayEnv(qwen3, max_turns=1), HFPolicy(tiny, qwen3), episodes=1,
                   sampling=SamplingParams(max_tokens=2), progress=False).trajectories[0]
    with pytest.raises(KeyError, match=r"info\['grade'\]"):
        grade_metrics(traj)


def test_multi_turn_episodes_train_on_every_turn_and_stay_on_policy(tiny, qwen3):
    """Two assistant turns with a tool result between them (a replayed tool conversation): every
    turn's tokens are scored in their own context, the logprobs match the sampled ones across turns."""
    from tokengym.envs import ReplayEnv

    run = train_grpo(tiny, qwen3, lambda: FirstTokenParity(ReplayEnv(qwen3, max_turns=2)), small())
    assert [it.turns for it in run.iterations] == [2.0, 2.0]
    assert all(it.updated for it in run.iterations)
    assert max(it.logprob_diff for it in run.iterations) < 1e-4
    assert "turns" in run.summary()


# ------------------------------------------------------------------ the asynchronous loop
@pytest.mark.parametrize("on_update", ["continue", "finish"])
def test_the_async_loop_trains_on_stale_rows_and_is_exact_on_fresh_ones(tiny, qwen3, on_update):
    """Generation runs on a copy while the model trains: the copy takes every step's weights, the
    batches' rows say how stale they are, and the tokens the trained weights sampled are scored
    back to float noise (the law per version, in the loop)."""
    before = tiny.get_output_embeddings().weight.detach().clone()
    c = small(iterations=4, max_staleness=1, on_update=on_update)
    run = train_grpo(tiny, qwen3, lambda: FirstTokenParity(AdditionEnv(qwen3)), c, metrics=grade_metrics)
    assert [it.iteration for it in run.iterations] == [0, 1, 2, 3]
    assert all(len(it.staleness) == 8 for it in run.iterations)
    assert all(max(it.staleness) <= 1 + 1 for it in run.iterations)  # K, plus an episode that ended a batch late
    stats = run.rollout_stats
    assert stats["updates"] == 4 and stats["episodes"] == 4 * 8 and stats["batches"] == 4
    hist = run.staleness_histogram()
    assert sum(hist.values()) == 32 and hist == {int(k): v for k, v in sorted(stats["staleness"].items())}
    assert hist.get(1, 0) + hist.get(2, 0) > 0, "the second batch started before the first update: it is stale"
    fresh = [it.logprob_diff for it in run.iterations if not math.isnan(it.logprob_diff)]
    assert fresh and max(fresh) < 1e-4
    assert any(it.stale_logprob_diff > 1e-3 for it in run.iterations)  # lr 1e-3 moved the weights
    assert not torch.equal(before, tiny.get_output_embeddings().weight)
    assert run.seconds > sum(e.seconds for e in run.evals) > 0


def test_a_synchronous_run_has_no_staleness(tiny, qwen3):
    run = train_grpo(tiny, qwen3, lambda: FirstTokenParity(AdditionEnv(qwen3)), small(iterations=1))
    assert run.iterations[0].staleness == () and math.isnan(run.iterations[0].stale_logprob_diff)
    assert run.staleness_histogram() == {0: 8} and run.rollout_stats == {}


def test_what_the_async_config_refuses():
    with pytest.raises(ValueError, match="max_staleness"):
        GRPOConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="max_staleness"):
        GRPOConfig(max_staleness=True)
    with pytest.raises(ValueError, match="on_update"):
        GRPOConfig(max_staleness=1, on_update="later")
