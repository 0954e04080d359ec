"""tokengym's verl layout against the real verl 0.9.1: DataProto, GRPO advantages, the vanilla loss, a step.

Runs in its own venv (``.ci/integrations.sh`` builds ``.venv-verl``); skipped where verl is
not installed, unless ``TOKENGYM_REQUIRE_INTEGRATIONS=1`` makes a missing verl a failure.

The episodes are real: a tiny random Qwen3 (the real Qwen3 vocabulary) samples through
``HFPolicy`` on two-turn ``ReplayEnv`` episodes, so every response holds policy tokens
(mask 1) and the environment's observation tokens (mask 0). The reward of a turn is the
share of its tokens that decode to ASCII (a random model earns some by chance), and the
episodes fall in two interleaved GRPO groups of three.
"""

from __future__ import annotations

import dataclasses

import os
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

if os.environ.get("TOKENGYM_REQUIRE_INTEGRATIONS") == "1":
    import verl  # noqa: F401 -- CI's verl run: a missing verl is a failure
else:
    pytest.importorskip("verl", reason="verl is not installed (.ci/integrations.sh tests it in .venv-verl)")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.torch_functional import logprobs_from_logits  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from tokengym.envs import ReplayEnv  # noqa: E402
from tokengym.policies import HFPolicy, SamplingParams  # noqa: E402
from tokengym.recorder import grpo_advantages, rollout, to_verl  # noqa: E402
from tokengym.recorder.batches import from_verl  # noqa: E402

pytestmark = pytest.mark.integration

G = 3  # episodes per group (verl's rollout.n)
EPISODES = 2 * G


class GroupedReplay(ReplayEnv):
    """Replay-v0 whose task id puts episode ``seed`` in group ``seed % 2`` (so the two groups
    interleave in the batch); the env's own task, which its reset record carries to the recorder."""

    def make_prompt(self, options):
        prompt = super().make_prompt(options)
        return dataclasses.replace(prompt, task={**prompt.task, "id": f"group-{self.reset_seed % 2}"})


class AsciiReward(gym.Wrapper):
    """A turn's reward is the share of its tokens that decode to ASCII."""

    def __init__(self, env, ascii_token):
        super().__init__(env)
        self.ascii_token = ascii_token

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        return obs, float(self.ascii_token[np.asarray(action)].mean()), terminated, truncated, info


@pytest.fixture(scope="module")
def recorded(qwen3):
    """(model, trajectories): six two-turn episodes sampled by a tiny random Qwen3."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(qwen3), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()  # eval: no dropout, rollout and training compute one function
    ascii_token = np.array([qwen3.decode([i]).isascii() for i in range(len(qwen3))])
    result = rollout(
        lambda: AsciiReward(GroupedReplay(qwen3, max_turns=2), ascii_token),
        HFPolicy(model, qwen3),
        episodes=EPISODES, concurrency=EPISODES, sampling=SamplingParams(max_tokens=8), seed=0, progress=False,
    )
    trajs = result.trajectories
    assert len(trajs) == EPISODES and all(t.num_turns == 2 for t in trajs)
    assert len({t.reward for t in trajs}) > 1, "the toy reward must vary, or every advantage is 0"
    return model, trajs


@pytest.fixture(scope="module")
def data(recorded) -> DataProto:
    _, trajs = recorded
    batch = to_verl(trajs)
    return DataProto.from_dict(tensors=batch.tensors, non_tensors=batch.non_tensors)


def response_logprobs(model, batch) -> torch.Tensor:
    """verl's actor computation: logprob of every response token (mask 0 ones too), [B, R]."""
    R = batch["responses"].shape[1]
    hidden = model.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).last_hidden_state
    logits = model.lm_head(hidden[:, -R - 1 : -1]).float()  # position p - 1 predicts token p
    return logprobs_from_logits(logits, batch["responses"])


def actor_config() -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=G, ppo_micro_batch_size_per_gpu=EPISODES)


# ----------------------------------------------------------------- DataProto
def test_dataproto_from_the_verl_layout(recorded, data):
    _, trajs = recorded
    batch = to_verl(trajs)
    assert len(data) == EPISODES
    for key, tensor in batch.tensors.items():
        assert torch.equal(data.batch[key], tensor), key
    assert list(data.non_tensor_batch["uid"]) == [f"group-{i % 2}" for i in range(EPISODES)]
    assert list(data.non_tensor_batch["num_turns"]) == [2] * EPISODES
    # Observations are inside the response, with mask 0.
    rmask, attn = data.batch["response_mask"], data.batch["attention_mask"][:, batch.prompt_length :]
    assert ((attn == 1) & (rmask == 0)).any(), "the responses hold observation tokens"
    # What verl does with a batch (split it between workers, select, merge back) keeps every token.
    parts = data.chunk(2)
    merged = DataProto.concat(parts)
    views = from_verl(merged.batch)
    for view, traj in zip(views, trajs):
        assert np.array_equal(view.token_ids, traj.token_ids) and np.array_equal(view.mask, traj.mask)
    picked = data.select(batch_keys=["responses", "response_mask"], non_tensor_batch_keys=["uid"])
    assert set(picked.batch.keys()) == {"responses", "response_mask"}


# ---------------------------------------------------------------------- GRPO
def test_grpo_advantages_match_verl(recorded, data):
    _, trajs = recorded
    adv, returns = core_algos.compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    ours = torch.from_numpy(grpo_advantages(trajs).advantages)
    mask = data.batch["response_mask"].float()
    torch.testing.assert_close(adv, ours[:, None] * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(returns, adv)
    # verl's scores are the row sums of token_level_rewards: the episode returns.
    torch.testing.assert_close(
        data.batch["token_level_rewards"].sum(-1), torch.tensor([t.reward for t in trajs]), rtol=1e-6, atol=1e-6
    )
    # to_verl(advantages=...) writes exactly verl's advantages tensor.
    laid = to_verl(trajs, advantages=grpo_advantages(trajs)).tensors["advantages"]
    torch.testing.assert_close(laid, adv, rtol=1e-5, atol=1e-6)
    # Dr. GRPO (no std scaling) too.
    adv_dr, _ = core_algos.compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=False,
    )
    ours_dr = torch.from_numpy(grpo_advantages(trajs, normalize_std=False).advantages)
    torch.testing.assert_close(adv_dr, ours_dr[:, None] * mask, rtol=1e-5, atol=1e-6)


def test_a_group_of_one_is_where_verl_and_tokengym_differ(recorded):
    """verl gives a lone episode mean 0 and std 1, so its advantage is its raw return;
    tokengym gives it 0 (nothing to compare it with). Groups of two or more agree."""
    _, trajs = recorded
    lone = trajs[:3]  # group-0, group-1, group-0: group-1 has one episode
    data = DataProto.from_dict(**_dict(to_verl(lone)))
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    ours = grpo_advantages(lone)
    row = adv[1][data.batch["response_mask"][1].bool()]
    assert ours[1] == 0.0 and ours.singletons == ("group-1",)  # and tokengym says so
    torch.testing.assert_close(row, torch.full_like(row, lone[1].reward / (1 + 1e-6)))
    torch.testing.assert_close(adv[[0, 2]], torch.from_numpy(ours[[0, 2]])[:, None] * data.batch["response_mask"][[0, 2]])


def _dict(batch):
    return {"tensors": batch.tensors, "non_tensors": batch.non_tensors}


# ---------------------------------------------------------- loss and a step
def test_vanilla_loss_trains_only_on_policy_tokens(recorded, data):
    model, trajs = recorded
    batch = data.batch
    mask = batch["response_mask"]
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        batch["token_level_rewards"], mask, data.non_tensor_batch["uid"]
    )
    old = batch["rollout_log_probs"]
    config = actor_config()
    loss_fn = core_algos.get_policy_loss_fn("vanilla")

    model.train()
    log_prob = response_logprobs(model, batch)
    log_prob.retain_grad()
    # On-policy: the trainer's recomputation gives back the rollout's logprobs on every policy token.
    diff = (log_prob.detach() - old)[mask.bool()].abs().max().item()
    assert diff < 1e-4, f"recomputed logprobs differ from the rollout's by {diff}"

    loss, metrics = loss_fn(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", config=config
    )
    assert abs(metrics["actor/ppo_kl"]) < 1e-5 and metrics["actor/pg_clipfrac"] == 0.0
    # Ratio 1 everywhere: the clipped loss is the plain -A * ratio, aggregated by agg_loss.
    ratio = torch.exp(log_prob - old)
    expected = core_algos.agg_loss(loss_mat=-adv * ratio, loss_mask=mask, loss_agg_mode="token-mean")
    torch.testing.assert_close(loss, expected)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        value = core_algos.agg_loss(loss_mat=-adv * ratio, loss_mask=mask, loss_agg_mode=mode)
        assert torch.isfinite(value)

    # The mask-0 positions carry no loss: their logprobs get exactly zero gradient ...
    loss.backward(retain_graph=True)
    grad = log_prob.grad
    assert torch.count_nonzero(grad[mask == 0]) == 0
    assert torch.count_nonzero(grad[(mask == 1) & (adv != 0)]) == int(((mask == 1) & (adv != 0)).sum())
    # ... and whatever sits at a mask-0 position in old_log_prob (0.0 from tokengym) leaves the loss alone,
    # while one policy token's old logprob moves it.
    junk = torch.where(mask.bool(), old, torch.full_like(old, 7.0))
    same, _ = loss_fn(old_log_prob=junk, log_prob=log_prob, advantages=adv, response_mask=mask, config=config)
    assert torch.equal(same, loss)
    row, col = (mask.bool() & (adv != 0)).nonzero()[0].tolist()
    moved_old = old.clone()
    moved_old[row, col] -= 0.1
    moved, _ = loss_fn(old_log_prob=moved_old, log_prob=log_prob, advantages=adv, response_mask=mask, config=config)
    assert not torch.equal(moved, loss)
    # verl 0.9.1's masked sums even drop NaN outside the mask (tokengym writes 0.0 there all the same:
    # a loss that multiplies by the mask, as TRL's and a plain PyTorch one do, would turn NaN * 0 into NaN).
    nan_old = torch.where(mask.bool(), old, torch.full_like(old, float("nan")))
    guarded, _ = loss_fn(old_log_prob=nan_old, log_prob=log_prob, advantages=adv, response_mask=mask, config=config)
    assert torch.equal(guarded, loss)

    # One optimizer step moves the policy tokens' logprobs the way the advantages say.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()
    model.eval()
    with torch.no_grad():
        after = response_logprobs(model, batch)
    change = (after - log_prob.detach()) * mask
    assert (adv * change).sum().item() > 0, "the step must raise the advantage-weighted logprob"
    _, metrics_after = loss_fn(
        old_log_prob=old, log_prob=after, advantages=adv, response_mask=mask, loss_agg_mode="token-mean", config=config
    )
    assert metrics_after["actor/ppo_kl"] != 0.0  # the policy moved off the rollout's


def test_the_docs_verl_example_runs(recorded, capsys):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- run: verl -->\s*```python\n(.*?)```", doc, flags=re.S).group(1)
    scope = {"trajs": recorded[1]}
    exec(compile(block, "docs/integrations.md", "exec"), scope)
    assert torch.equal(scope["data"].batch["advantages"], scope["advantages"])
    assert capsys.readouterr().out.startswith(f"{EPISODES} (")
