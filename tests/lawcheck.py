"""The trainer's side of the law, shared by the adapter tests: recompute rollout logprobs."""

from __future__ import annotations

import torch

from tokengym.recorder import policy_logprobs


def recompute_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logprobs of every response token, as a trainer computes them.

    Returns (recomputed, rollout) over the mask-1 positions of a ``to_verl`` batch, in
    row-major order. ``policy_logprobs`` itself is checked against the full-vocabulary
    logits of ``model(...)`` in tests/test_training.py.
    """
    with torch.no_grad():
        recomputed = policy_logprobs(model, batch)
    mask = batch.tensors["response_mask"].bool()
    return recomputed.cpu()[mask], batch.tensors["rollout_log_probs"][mask]
