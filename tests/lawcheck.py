"""The trainer's side of the law, shared by the adapter tests: recompute rollout logprobs."""

from __future__ import annotations

import torch


def recompute_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logprobs of every response token, as a trainer computes them.

    Returns (recomputed, rollout) over the mask-1 positions of a ``to_verl`` batch. Only the
    hidden states at those positions go through the LM head: the full-vocabulary logits of
    every position would not fit in memory for a 150k vocabulary.
    """
    t = batch.tensors
    with torch.no_grad():
        hidden = model.model(
            input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"]
        ).last_hidden_state
    P = t["prompts"].shape[1]
    mask = t["response_mask"].bool()
    rows, cols = mask.nonzero(as_tuple=True)
    logits = model.lm_head(hidden[rows, P + cols - 1]).float()  # position p-1 predicts token p
    tokens = t["responses"][rows, cols]
    recomputed = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    return recomputed, t["rollout_log_probs"][rows, cols]
