"""The trainer's side of a recorded batch: the policy's log-probabilities, recomputed, and the GRPO loss.

A trainer never trusts logprobs it did not compute: importance ratios, KL terms and the
policy-gradient loss all need ``log pi(token | context)`` under the weights being trained,
from one teacher-forced forward pass over the very tokens the rollout recorded. That this
pass gives back the rollout's own logprobs is the end-to-end proof that nothing was
re-tokenized or shifted between rollout and training.

torch is imported inside the function: importing the recorder stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .batches import VerlBatch

if TYPE_CHECKING:
    import torch

__all__ = ["GRPOLoss", "grpo_loss", "policy_logprobs"]

_NEEDED = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


def _head(model: Any) -> tuple[Any, Any]:
    """The decoder (hidden states) and the output layer of a transformers causal LM."""
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = get_head() if callable(get_head) else None
    if decoder is None or head is None:
        raise TypeError(
            f"{type(model).__name__} is not a transformers causal LM with a decoder and an output layer "
            "(get_decoder() and get_output_embeddings()): pass e.g. an AutoModelForCausalLM"
        )
    config = getattr(model, "config", None)
    # Heads that rescale their logits after the output layer: this pass would silently differ.
    for name, neutral in (("logit_scale", None), ("logits_scaling", 1.0)):
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise NotImplementedError(
                f"{type(model).__name__} rescales its logits (config.{name}={value}), which policy_logprobs does not "
                "apply: compute the logprobs from model(...).logits for this model"
            )
    return decoder, head


def policy_logprobs(
    model: Any,
    batch: VerlBatch | Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> torch.Tensor:
    """Log-probability of every policy token of a :func:`~tokengym.recorder.to_verl` batch under ``model``.

    One teacher-forced forward pass over ``input_ids`` with the batch's ``attention_mask`` and
    ``position_ids``; the token at position ``p`` is scored by the logits of position ``p - 1``.
    Only the hidden states of the policy tokens (``response_mask`` 1) go through the output
    layer, ``chunk`` of them at a time: the full-vocabulary logits of every position would
    not fit in memory (150k vocabulary x every token of the batch). Under ``torch.no_grad()``
    the peak is one chunk's logits; with gradients autograd keeps each chunk's for the backward.

    Args:
        model: a transformers causal LM (``get_decoder()``, ``get_output_embeddings()``);
            Gemma's final logit soft-capping is applied as the model's own forward does.
        batch: a ``VerlBatch`` or its ``tensors``.
        temperature: the logits are divided by it before the log-softmax. 1.0 gives the raw
            logprobs that ``HFPolicy`` and vLLM's ``logprobs_mode="raw_logprobs"`` record;
            the sampling temperature gives the logprobs of the distribution actually sampled
            from (what verl computes).
        chunk: policy tokens per output-layer call.

    Returns:
        float32 ``[B, R]`` on the model's device, the layout of ``rollout_log_probs``: the
        logprob at every policy token, 0.0 elsewhere. Gradients flow unless the caller
        disables them.
    """
    import torch

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, not {temperature} (greedy decoding has no logprobs to recompute)")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, not {chunk}")
    tensors = batch.tensors if isinstance(batch, VerlBatch) else batch
    missing = [k for k in _NEEDED if k not in tensors]
    if missing:
        raise KeyError(f"the batch has no {', '.join(missing)}: pass to_verl(trajs) or its .tensors")
    decoder, head = _head(model)
    device = next(head.parameters()).device
    t = {k: tensors[k].to(device) for k in _NEEDED}
    P = int(t["prompts"].shape[1])
    mask = t["response_mask"].bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    rows, cols = mask.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return out
    before = P + cols - 1  # the position whose logits score each policy token
    if bool((before < 0).any()) or not bool(t["attention_mask"][rows, before.clamp(min=0)].all()):
        raise ValueError(
            "a policy token has no real token before it (an empty prompt, or a response_mask 1 on padding): "
            "nothing conditions it, so it has no logprob to recompute"
        )
    hidden = decoder(
        input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
    ).last_hidden_state
    picked = hidden[rows, before]  # [N, H]: only these go through the output layer
    tokens = t["responses"][rows, cols]
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    parts = []
    for a in range(0, picked.shape[0], chunk):
        logits = head(picked[a : a + chunk]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
        parts.append(torch.log_softmax(logits, dim=-1).gather(-1, tokens[a : a + chunk, None])[:, 0])
    return out.index_put((rows, cols), torch.cat(parts))


@dataclass(frozen=True)
class GRPOLoss:
    """The loss to backpropagate and its parts, as plain floats for logging."""

    loss: torch.Tensor
    """The scalar to call ``backward()`` on: ``policy_loss + kl_coef * kl``."""
    policy_loss: float
    kl: float
    """Token-mean KL estimate to the reference policy (0.0 without one)."""
    clip_fraction: float
    """Share of policy tokens whose ratio the clip cut off (their gradient is 0)."""
    tokens: int


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> GRPOLoss:
    """PPO's clipped surrogate averaged over the policy tokens (verl's ``token-mean``), plus an
    optional KL penalty to a reference policy.

    ``-mean(min(r A, clip(r, 1 - eps, 1 + eps) A))`` over the tokens where ``mask`` is 1, with
    ``r = exp(logprobs - old_logprobs)``. The KL term is the non-negative ``k3`` estimator
    ``exp(ref - logprobs) - (ref - logprobs) - 1`` (GRPO's), also a token mean: it pulls the
    policy back towards the reference (the start policy) and guards a run against collapse.

    Args:
        logprobs: ``[B, R]`` under the weights being trained (with gradients), e.g. from
            :func:`policy_logprobs`.
        old_logprobs: ``[B, R]`` of the policy that sampled the tokens (``rollout_log_probs``).
        advantages: ``[B, R]`` per token (``to_verl(..., advantages=...)``'s ``advantages``),
            or ``[B]`` per row.
        mask: ``[B, R]``, 1 on the policy's tokens (``response_mask``).
        ref_logprobs: ``[B, R]`` under the reference policy; needed when ``kl_coef > 0``.
    """
    import torch

    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0, not {clip_eps}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, not {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs: the logprobs of the batch under the reference policy")
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, R] shape"
        )
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages[:, None].expand_as(logprobs)
    if advantages.shape != logprobs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, R] = {tuple(logprobs.shape)}")
    keep = mask.bool()
    n = int(keep.sum())
    if n == 0:
        raise ValueError("the mask selects no policy token: there is nothing to train on")
    old = old_logprobs.to(logprobs.device)
    adv = advantages.to(device=logprobs.device, dtype=logprobs.dtype)[keep]
    lp = logprobs[keep]
    ratio = torch.exp(lp - old[keep])
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    policy_loss = -torch.minimum(ratio * adv, clipped * adv).mean()
    loss = policy_loss
    kl_value = 0.0
    if ref_logprobs is not None:
        delta = ref_logprobs.to(logprobs.device)[keep] - lp
        kl = (torch.exp(delta) - delta - 1).mean()
        kl_value = float(kl.detach())
        if kl_coef > 0:
            loss = loss + kl_coef * kl
    clip_fraction = float(((ratio * adv) > (clipped * adv)).float().mean().detach())
    return GRPOLoss(loss, float(policy_loss.detach()), kl_value, clip_fraction, n)
