"""policy_logprobs: a trainer's recompute of the policy tokens' logprobs, with a tiny random Qwen3.

The reference is the plain way: the full-vocabulary logits of ``model(...)`` at every position,
log-softmaxed, read at the position before each policy token. The function under test must
agree with it, and with the logprobs ``HFPolicy`` recorded while sampling.
"""

from __future__ import annotations

import pytest
import torch

from tiny_qwen3 import tiny_qwen3
from tokengym.envs import ReplayEnv
from tokengym.policies import HFPolicy, SamplingParams
from tokengym.recorder import policy_logprobs, rollout, to_verl


@pytest.fixture(scope="module")
def tiny(qwen3):
    return tiny_qwen3(len(qwen3))


def record(tiny, qwen3, temperature: float):
    turns = iter([1, 3, 2, 1])  # different lengths: left and right padding in the batch
    result = rollout(
        lambda: ReplayEnv(qwen3, max_turns=next(turns)), HFPolicy(tiny, qwen3), episodes=4, concurrency=4,
        sampling=SamplingParams(max_tokens=5, temperature=temperature), seed=3, progress=False,
    )
    assert result.stats.failed == 0 and all(t.has_logprobs for t in result.trajectories)
    return result.trajectories


@pytest.fixture(scope="module")
def batch(tiny, qwen3):
    return to_verl(record(tiny, qwen3, temperature=1.0))


def reference(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """[B, R] from the full logits of every position (fine for a tiny batch)."""
    t = batch.tensors
    with torch.no_grad():
        logits = model(
            input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
        ).logits.float()
    P = batch.prompt_length
    logp = torch.log_softmax(logits[:, P - 1 : -1] / temperature, dim=-1)  # column j scores response token j
    return logp.gather(-1, t["responses"][..., None])[..., 0] * t["response_mask"]


def test_the_rollout_logprobs_come_back_in_the_batch_layout(tiny, batch):
    t = batch.tensors
    with torch.no_grad():
        lp = policy_logprobs(tiny, batch)
    assert lp.shape == t["rollout_log_probs"].shape and lp.dtype == torch.float32
    mask = t["response_mask"].bool()
    assert len({int(m.sum()) for m in t["attention_mask"]}) >= 3  # rows of different lengths, padded
    assert not lp[~mask].any()  # 0.0 off the policy tokens, as in rollout_log_probs
    assert (lp[mask] < 0).all()
    diff = (lp[mask] - t["rollout_log_probs"][mask]).abs().max().item()
    print(f"max |policy_logprobs - rollout| = {diff:.2e} over {int(mask.sum())} policy tokens")
    assert diff < 1e-4
    torch.testing.assert_close(lp, reference(tiny, batch), rtol=0, atol=1e-5)
    # Chunking the output layer changes nothing; the tensors dict works as the batch does.
    torch.testing.assert_close(policy_logprobs(tiny, t, chunk=1).detach(), lp, rtol=0, atol=1e-6)


def test_a_temperature_divides_the_logits(tiny, qwen3):
    """Sampled at 0.7: the recorded raw logprobs are recomputed at temperature 1, the
    sampling distribution's at 0.7."""
    batch = to_verl(record(tiny, qwen3, temperature=0.7))
    mask = batch.tensors["response_mask"].bool()
    with torch.no_grad():
        raw = policy_logprobs(tiny, batch)
        tempered = policy_logprobs(tiny, batch, temperature=0.7, chunk=3)
    assert (raw[mask] - batch.tensors["rollout_log_probs"][mask]).abs().max().item() < 1e-4
    torch.testing.assert_close(tempered, reference(tiny, batch, temperature=0.7), rtol=0, atol=1e-5)
    assert (tempered[mask] - raw[mask]).abs().mean().item() > 1e-2  # a different distribution (50x the tolerance)


def test_gradients_flow_to_the_weights(tiny, batch):
    tiny.zero_grad()
    lp = policy_logprobs(tiny, batch, chunk=7)
    assert lp.requires_grad
    lp.sum().backward()
    head = tiny.get_output_embeddings().weight
    layer = tiny.model.layers[0].self_attn.q_proj.weight
    assert head.grad is not None and head.grad.abs().sum() > 0 and layer.grad.abs().sum() > 0
    tiny.zero_grad()


def test_what_it_refuses(tiny, batch):
    t = batch.tensors
    with pytest.raises(ValueError, match="temperature must be > 0"):
        policy_logprobs(tiny, batch, temperature=0.0)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        policy_logprobs(tiny, batch, chunk=0)
    with pytest.raises(KeyError, match="the batch has no position_ids"):
        policy_logprobs(tiny, {k: v for k, v in t.items() if k != "position_ids"})
    with pytest.raises(TypeError, match="not a transformers causal LM"):
        policy_logprobs(torch.nn.Linear(2, 2), batch)
    # A policy token right after padding has no context: a broken batch, not a logprob.
    broken = dict(t)
    row = int(torch.argmax((t["attention_mask"][:, : batch.prompt_length] == 0).sum(1)))  # the most left-padded row
    broken["attention_mask"] = t["attention_mask"].clone()
    broken["attention_mask"][row, : batch.prompt_length] = 0
    with pytest.raises(ValueError, match="no real token before it"):
        policy_logprobs(tiny, broken)
    # A head that rescales its logits would silently differ: refused by name.
    tiny.config.logits_scaling = 4.0
    try:
        with pytest.raises(NotImplementedError, match=r"config.logits_scaling=4.0"):
            policy_logprobs(tiny, batch)
    finally:
        del tiny.config.logits_scaling


def test_no_policy_token_gives_zeros(tiny, batch):
    t = dict(batch.tensors)
    t["response_mask"] = torch.zeros_like(t["response_mask"])
    lp = policy_logprobs(tiny, t)
    assert lp.shape == t["rollout_log_probs"].shape and not lp.any()
