"""Batches: trajectories laid out the way trainers read them.

Every layout here is a pure view of the recorded tokens: it pads, concatenates or
splits, but never reorders, re-tokenizes or drops a token (except the explicit
``overlong="truncate"`` cut at the *end* of a response, which is flagged). The
``from_*`` functions invert each layout back to ``(token_ids, mask, logprobs)`` per
trajectory so that the tests can prove it token for token.

Conventions shared by all layouts:

- mask 1 only on action (policy) tokens; the prompt, observations and padding are 0;
- logprobs are 0.0 where the trajectory has none (masked tokens, or actions recorded
  without logprobs): trainers multiply by the mask, and NaN would poison that product. An
  action without logprobs then reads as probability 1, so a batch that holds one warns
  (:class:`MissingLogprobsWarning`, once per calling line) and marks its rows
  (``logprobs_present``);
- each turn's reward sits on the last token of that turn's action, so the rewards of a
  row sum to the episode's return (the SkyRL convention; verl puts a single outcome
  reward on the last valid token, which is the same thing for one-turn episodes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from .advantages import (  # GRPO's groups and advantages, re-exported where they were first
    GroupSignal,
    GRPOAdvantages,
    NoGroupSignalWarning,
    group_by_task,
    group_key,
    group_signal,
    grpo_advantages,
)
from .segments import SegmentKind
from .trajectory import Trajectory, refuse_images, require_trajectories

if TYPE_CHECKING:  # torch is imported by the layouts that build tensors, not by readers of a store
    import torch

__all__ = [
    "GRPOAdvantages",
    "GroupSignal",
    "MissingLogprobsWarning",
    "NoGroupSignalWarning",
    "PackedBatch",
    "BatchBuffers",
    "TokenView",
    "VerlBatch",
    "from_packed",
    "from_trl",
    "from_verl",
    "group_by_task",
    "group_signal",
    "grpo_advantages",
    "logprobs_present",
    "to_packed",
    "to_trl",
    "to_verl",
]

Overlong = Literal["error", "truncate"]
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


class TokenView(NamedTuple):
    """One trajectory read back from a layout: what a trainer actually sees."""

    token_ids: np.ndarray  # int64
    mask: np.ndarray  # int8, 1 on action tokens
    logprobs: np.ndarray  # float32, 0.0 where none


# ----------------------------------------------------------------- helpers
class MissingLogprobsWarning(UserWarning):
    """A batch holds actions recorded without logprobs: 0.0 (probability 1) stands in for them."""


def logprobs_present(trajs: Sequence[Trajectory]) -> np.ndarray:
    """Per trajectory: every action of it was recorded with its logprobs (bool array)."""
    return np.array([t.has_logprobs or not t.actions for t in trajs], dtype=bool)


def _warn_missing_logprobs(present: np.ndarray, layout: str) -> None:
    missing = int((~present).sum())
    if missing:
        warnings.warn(
            f"{missing} of {len(present)} trajectories in this {layout} batch have actions recorded without "
            "logprobs; they read as 0.0 (probability 1), which an importance ratio or a KL term takes at its word. "
            "Record them (a policy that returns logprobs, or RecordEpisodes.step(..., logprobs=...)) or recompute "
            "them before use; the batch's logprobs_present marks the rows that have them",
            MissingLogprobsWarning,
            stacklevel=3,
        )


def _filled_logprobs(t: Trajectory) -> np.ndarray:
    """The trajectory's logprobs with 0.0 wherever there is none."""
    return np.nan_to_num(t.logprobs, nan=0.0).astype(np.float32)


def _token_rewards(t: Trajectory) -> np.ndarray:
    """Each turn's reward on the last token of that turn's action (float32, full length)."""
    out = np.zeros(len(t), dtype=np.float32)
    for (_, end), a in zip(t.action_spans, t.actions):
        # An empty action has no token of its own: its reward goes on the token before it.
        if len(out):
            out[max(end - 1, 0)] += a.reward
    return out


def _place_rewards(t: Trajectory, i: int, pl: int, n: int, rewards: np.ndarray, response_mask: np.ndarray) -> None:
    """Write row ``i`` of the verl ``token_level_rewards``: each turn's reward on its action's last token.

    The response columns are the trajectory's tokens ``[pl, pl + n)``. A reward whose
    token is outside them (its action was cut, or an empty first action puts it on the
    prompt) lands on the last kept action token, or the last kept token if none is left.
    """
    row = rewards[i]
    spans = t.action_spans
    if all(pl < end <= pl + n for _, end in spans):  # the common case: every reward has its token
        for (_, end), a in zip(spans, t.actions):
            row[end - 1 - pl] += a.reward
        return
    tok_r = _token_rewards(t)
    row[:n] = tok_r[pl : pl + n]
    lost = float(tok_r[:pl].sum() + tok_r[pl + n :].sum())
    if lost != 0.0:
        kept_actions = np.flatnonzero(response_mask[i, :n])
        if kept_actions.size:
            row[kept_actions[-1]] += lost
        elif n > 0:
            row[n - 1] += lost
        else:
            raise ValueError(f"trajectory {i}: response_length={rewards.shape[1]} leaves no token to carry its reward")


def _pad_id(pad_token_id: Any) -> int:
    """The pad id as a Python int that fits the int64 id tensors, or a named error."""
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, (int, np.integer)):
        raise TypeError(
            f"pad_token_id must be an integer token id, not {pad_token_id!r}: pass tokenizer.pad_token_id "
            "(or tokenizer.eos_token_id when the tokenizer has no pad token)"
        )
    pad = int(pad_token_id)
    if not _INT64_MIN <= pad <= _INT64_MAX:
        raise ValueError(f"pad_token_id={pad} does not fit the int64 id tensors")
    return pad


def _per_traj_advantages(advantages: Sequence[float] | np.ndarray | None, n: int) -> np.ndarray | None:
    if advantages is None:
        return None
    adv = np.asarray(advantages, dtype=np.float32).reshape(-1)
    if adv.shape != (n,):
        raise ValueError(f"advantages must have one value per trajectory: {adv.shape[0]} for {n} trajectories")
    return adv


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array, even when every value is a list (np.array would make it 2-D)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


# --------------------------------------------------------------------- verl
@dataclass
class VerlBatch:
    """A verl batch: ``DataProto.from_dict(tensors=batch.tensors, non_tensors=batch.non_tensors)``.

    Tensors (B rows, P prompt columns, R response columns):
        prompts [B, P], responses [B, R], input_ids [B, P+R], attention_mask [B, P+R],
        position_ids [B, P+R], response_mask [B, R] (all int64);
        rollout_log_probs [B, R], token_level_rewards [B, R] (float32);
        rollout_versions [B, R] (int32: the weight version that sampled each response token,
        -1 on mask-0 tokens, padding and tokens of unknown version);
        advantages [B, R] (float32) when asked for.
    Non-tensors (object arrays of length B): num_turns, turn_rewards, tool_rewards,
        stop_reason, env_id, seed, conformance, uid, truncated_to_fit, version_span (each row's
        ``(oldest, newest)`` weight version, None when unknown), and the names verl's own
        agent loops write: ``__num_turns__`` (messages, the prompt included, as
        :class:`~tokengym.recorder.integrations.verl.TokenGymAgentLoop` counts them) and
        ``turn_scores`` (= turn_rewards). ``uid`` is the GRPO group (:func:`group_by_task`'s
        default key), which verl's advantage estimators group by.
    """

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    @property
    def prompt_length(self) -> int:
        """Width of the left-padded prompt block."""
        return int(self.tensors["prompts"].shape[1])

    @property
    def response_length(self) -> int:
        """Width of the right-padded response block."""
        return int(self.tensors["responses"].shape[1])


class BatchBuffers:
    """Output memory that :func:`to_verl` writes into, kept from one call to the next.

    Why: a fresh batch is new memory, and the first write to each of its pages is a page fault;
    at 1,024 trajectories of 4 M tokens that was 1.69 s of a 1.81 s call, while the same call
    into memory already touched takes a tenth of that. A trainer builds one batch per step, so
    it can hand the same buffers to every call: ``buffers = BatchBuffers()`` once, then
    ``to_verl(trajs, out=buffers)`` (or ``to_packed(trajs, out=buffers)``) each step.

    The batch's tensors are views of these buffers: the next call with the same ``out`` writes
    over them. Keep a batch past the next call only as a copy (``tensor.clone()``). A buffer
    grows when a batch needs more elements than it has (then that call is a fresh one again);
    the tensors are always contiguous, of the batch's exact shape.
    """

    def __init__(self) -> None:
        self._flat: dict[str, np.ndarray] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: Any, fill: int | float | None) -> np.ndarray:
        """The buffer ``name`` as a contiguous array of ``shape``, every element set to ``fill``
        (``None``: left as the last call wrote it, for a caller that writes every element)."""
        n = int(np.prod(shape))
        buf = self._flat.get(name)
        if buf is None or buf.size < n or buf.dtype != np.dtype(dtype):
            buf = self._flat[name] = np.empty(n, dtype=dtype)
        out = buf[:n].reshape(shape)
        if fill is not None:
            out.fill(fill)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.nbytes for b in self._flat.values())


def to_verl(
    trajs: Sequence[Trajectory],
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    overlong: Overlong = "error",
    pad_token_id: int = 0,
    advantages: Sequence[float] | np.ndarray | None = None,
    out: BatchBuffers | None = None,
    rope_index: RopeIndex | None = None,
) -> VerlBatch:
    """Lay trajectories out as verl's agent loop does: left-padded prompts, right-padded responses.

    The response is everything after the prompt segment (actions *and* observations), so
    ``input_ids`` of a row is exactly the stream the policy saw, padded on both sides.

    Args:
        trajs: the episodes, one row each.
        prompt_length: P; the longest prompt when omitted (minimal padding).
        response_length: R; the longest response when omitted.
        overlong: a response longer than R raises (``"error"``) or is cut at its end
            (``"truncate"``; the row's ``truncated_to_fit`` is True). A prompt longer than P
            always raises: cutting it would change the context of every token after it.
        pad_token_id: the id written on padding (attention_mask says what is real, not this id);
            verl pads with ``tokenizer.pad_token_id``. Any int64 value; a non-zero id costs
            little more than 0: it is written on the padding only.
        advantages: one value per trajectory (e.g. :func:`grpo_advantages`), broadcast to the
            row's action tokens as the ``advantages`` tensor.
        out: buffers to write the batch into, reused across calls (:class:`BatchBuffers`): a
            trainer's fresh batch each step then costs what a call into warm memory does. The
            tensors are views of them, overwritten by the next call with the same ``out``.
        rope_index: for trajectories with images (a vision-language policy's): the model's own
            multimodal rotary positions, ``tokengym.policies.hf_vision.mrope_positions(model)``.
            The batch then has what verl's post-processing writes for such a model:
            ``position_ids`` [B, 4, P+R] (text positions, then the three M-RoPE rows) and the
            non-tensor ``multi_modal_inputs`` (per row: ``pixel_values``, ``image_grid_thw``,
            ``images_seqlens``, from the features recorded with each image: nothing is
            re-tokenized or re-processed).

    Rewards of turns whose last action token was cut land on the last kept action token
    (or the last kept token if no action token survives), so each row still sums to the
    episode's return.
    """
    import torch

    require_trajectories(trajs)
    vision = any(t.images for t in trajs)
    if vision and rope_index is None:
        raise ValueError(
            "these trajectories hold images: to_verl needs the model's multimodal positions, "
            "rope_index=tokengym.policies.hf_vision.mrope_positions(model)"
        )
    present = logprobs_present(trajs)
    _warn_missing_logprobs(present, "verl")
    if overlong not in ("error", "truncate"):
        raise ValueError(f'overlong must be "error" or "truncate", not {overlong!r}')
    adv = _per_traj_advantages(advantages, len(trajs))
    B = len(trajs)
    p_lens = [t.prompt_len for t in trajs]
    r_lens = [len(t) - t.prompt_len for t in trajs]
    P = max(p_lens) if prompt_length is None else int(prompt_length)
    R = max(r_lens) if response_length is None else int(response_length)
    if P < 0 or R < 0:
        raise ValueError(f"lengths must be non-negative: prompt_length={P}, response_length={R}")

    # Every row is written with a few contiguous slice copies (no per-row temporaries,
    # no whole-batch passes): W = P + R columns, the real tokens of row i are the
    # columns [P - pl, P + n). Each byte is written once: zero-initialised buffers only
    # get their non-zero parts written, and the id buffers of a non-zero pad id are left
    # uninitialised and get the pad id on their padding only (filling them whole first
    # would write every real token twice). `prompts` and `responses` are separate
    # buffers (not views of `input_ids`), so a trainer may modify one without touching
    # the others.
    W = P + R
    pad = _pad_id(pad_token_id)
    fill_pad = pad != 0
    if out is None:
        alloc_ids = np.empty if fill_pad else np.zeros
        prompts = alloc_ids((B, P), dtype=np.int64)
        responses = alloc_ids((B, R), dtype=np.int64)
        input_ids = alloc_ids((B, W), dtype=np.int64)
        attention = np.zeros((B, W), dtype=np.int64)
        position_ids = np.zeros((B, W), dtype=np.int64)
        response_mask = np.zeros((B, R), dtype=np.int64)
        logprobs = np.zeros((B, R), dtype=np.float32)
        rewards = np.zeros((B, R), dtype=np.float32)
        versions = np.full((B, R), -1, dtype=np.int32)
    else:  # warm memory: set whole (the pad id or 0), then the rows are written as below
        prompts = out.take("prompts", (B, P), np.int64, pad)
        responses = out.take("responses", (B, R), np.int64, pad)
        input_ids = out.take("input_ids", (B, W), np.int64, pad)
        attention = out.take("attention_mask", (B, W), np.int64, 0)
        position_ids = out.take("position_ids", (B, W), np.int64, 0)
        response_mask = out.take("response_mask", (B, R), np.int64, 0)
        logprobs = out.take("rollout_log_probs", (B, R), np.float32, 0)
        rewards = out.take("token_level_rewards", (B, R), np.float32, 0)
        versions = out.take("rollout_versions", (B, R), np.int32, -1)
        fill_pad = False  # the padding already holds the pad id
    positions = np.arange(W, dtype=np.int64)
    truncated = [False] * B

    for i, t in enumerate(trajs):
        pl, rl = p_lens[i], r_lens[i]
        if pl > P:
            raise ValueError(
                f"trajectory {i}: prompt has {pl} tokens, prompt_length is {P} "
                "(prompts are never cut: every later token was conditioned on the whole prompt)"
            )
        if rl > R:
            if overlong == "error":
                raise ValueError(
                    f"trajectory {i}: response has {rl} tokens, response_length is {R} "
                    f"(prompt {pl} tokens); pass overlong='truncate' to cut it"
                )
            truncated[i] = True
        n = min(rl, R)
        start, stop = P - pl, P + n
        # Segment by segment into input_ids (no concatenated copy of the trajectory);
        # action segments also set response_mask and logprobs.
        row = input_ids[i]
        if fill_pad:
            row[:start] = pad
            row[stop:] = pad
            prompts[i, :start] = pad
            responses[i, n:] = pad
        # The end of each action and its reward, for the rewards row; `whole` is False when
        # the cut stopped the walk before the last segment.
        ends: list[tuple[int, float]] = []
        whole = True
        for seg, a, z in zip(t.segments, t.offsets[:-1].tolist(), t.offsets[1:].tolist()):
            if a >= pl + n:
                whole = False
                break
            if seg.kind is SegmentKind.ACTION:
                ends.append((z, seg.reward))
            z = min(z, pl + n)
            row[start + a : start + z] = seg.token_ids[: z - a]
            if seg.kind is SegmentKind.ACTION and z > a:
                response_mask[i, a - pl : z - pl] = 1
                if seg.logprobs is not None:
                    logprobs[i, a - pl : z - pl] = seg.logprobs[: z - a]
                if seg.versions is not None:
                    versions[i, a - pl : z - pl] = seg.versions[: z - a]
        # One check per row: a sum is finite only if every logprob is (NaN means "none").
        lp_row = logprobs[i, :n]
        if not np.isfinite(lp_row.sum()):
            np.nan_to_num(lp_row, copy=False, nan=0.0)
        prompts[i, start:] = row[start:P]
        responses[i, :n] = row[P:stop]
        attention[i, start:stop] = 1
        # verl's clip(cumsum(attention_mask) - 1, 0): 0 on the left padding, then 0, 1, ...,
        # and the last position repeated over the right padding.
        position_ids[i, start:stop] = positions[: pl + n]
        if stop < W and pl + n:
            position_ids[i, stop:] = pl + n - 1
        if whole and all(pl < end <= pl + n for end, _ in ends):  # every reward has its token
            reward_row = rewards[i]
            for end, reward in ends:
                reward_row[end - 1 - pl] += reward
        else:
            _place_rewards(t, i, pl, n, rewards, response_mask)

    multi_modal: list[dict[str, Any]] | None = None
    if vision:
        assert rope_index is not None
        position_ids, multi_modal = _vision_rows(trajs, p_lens, r_lens, P, input_ids, attention, rope_index, out)
    tensors = {
        "prompts": torch.from_numpy(prompts),
        "responses": torch.from_numpy(responses),
        "response_mask": torch.from_numpy(response_mask),
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "position_ids": torch.from_numpy(position_ids),
        "rollout_log_probs": torch.from_numpy(logprobs),
        "token_level_rewards": torch.from_numpy(rewards),
        "rollout_versions": torch.from_numpy(versions),
    }
    if adv is not None:
        tensors["advantages"] = torch.from_numpy(response_mask.astype(np.float32) * adv[:, None])
    non_tensors = {
        "num_turns": _object_array([t.num_turns for t in trajs]),
        "turn_rewards": _object_array([t.turn_rewards.tolist() for t in trajs]),
        # the names verl's own agent loops write (``__num_turns__``: messages, the prompt included)
        "__num_turns__": _object_array([len(t.segments) for t in trajs]),
        "turn_scores": _object_array([t.turn_rewards.tolist() for t in trajs]),
        "tool_rewards": _object_array([list(t.metadata.get("tool_rewards") or []) for t in trajs]),
        "stop_reason": _object_array([t.stop_reason for t in trajs]),
        "env_id": _object_array([t.env_id for t in trajs]),
        "seed": _object_array([t.seed for t in trajs]),
        "conformance": _object_array([t.conformance_summary for t in trajs]),
        "uid": _object_array([group_key(t) for t in trajs]),
        "truncated_to_fit": _object_array(truncated),
        "logprobs_present": _object_array(present.tolist()),
        "version_span": _object_array([t.version_span for t in trajs]),
    }
    if multi_modal is not None:
        non_tensors["multi_modal_inputs"] = _object_array(multi_modal)
    return VerlBatch(tensors=tensors, non_tensors=non_tensors)


RopeIndex = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor | None"], "torch.Tensor"]
"""``(input_ids [1, W], attention_mask [1, W], image_grid_thw [N, 3] or None) -> positions [3, 1, W]``:
a vision-language model's multimodal rotary positions of one padded row (Qwen2-VL's
``get_rope_index``; :func:`tokengym.policies.hf_vision.mrope_positions` wraps it)."""


def _vision_rows(
    trajs: Sequence[Trajectory], p_lens: list[int], r_lens: list[int], P: int, input_ids: np.ndarray,
    attention: np.ndarray, rope_index: RopeIndex, out: BatchBuffers | None,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The [B, 4, W] position ids and the per-row multimodal inputs of a batch with images, as
    verl's post-processing writes them for an M-RoPE model: row 0 the text positions (1 on
    padding, 0, 1, ... on real tokens), rows 1-3 the model's own multimodal positions. An image
    whose run a truncation cut is an error; one the cut dropped whole leaves the row with it."""
    import torch

    B, W = input_ids.shape
    pos = out.take("position_ids_mrope", (B, 4, W), np.int64, 1) if out is not None else np.ones((B, 4, W), np.int64)
    rows: list[dict[str, Any]] = []
    for i, t in enumerate(trajs):
        start = P - p_lens[i]
        n = int(attention[i].sum())
        kept = []
        for img in t.images:
            if img.offset + img.num_tokens <= n:
                kept.append(img)
            elif img.offset < n:
                raise ValueError(
                    f"trajectory {i}: the cut at response_length leaves {n - img.offset} of the {img.num_tokens} "
                    f"placeholder tokens of image #{img.index}: an image is kept whole or not at all; raise response_length"
                )
        pos[i, 0, start : start + n] = np.arange(n)
        ids = torch.from_numpy(input_ids[i : i + 1])
        mask = torch.from_numpy(attention[i : i + 1])
        if kept:
            inputs = _image_inputs(kept)
            pos[i, 1:] = rope_index(ids, mask, inputs["image_grid_thw"])[:, 0].numpy()
            rows.append(inputs)
        else:  # text alone: the three rows are the text positions
            pos[i, 1:, start : start + n] = np.arange(n)
            rows.append({})
    return pos, rows


def from_verl(batch: VerlBatch | Mapping[str, torch.Tensor]) -> list[TokenView]:
    """Read each row of a verl batch back as its real tokens (padding removed by attention_mask)."""
    tensors = batch.tensors if isinstance(batch, VerlBatch) else batch
    P = int(tensors["prompts"].shape[1])
    ids = tensors["input_ids"].numpy()
    attn = tensors["attention_mask"].numpy().astype(bool)
    rmask = tensors["response_mask"].numpy()
    lp = tensors["rollout_log_probs"].numpy()
    out = []
    for i in range(ids.shape[0]):
        p_real, r_real = attn[i, :P], attn[i, P:]
        pl = int(p_real.sum())
        mask = np.concatenate([np.zeros(pl, dtype=np.int8), rmask[i][r_real].astype(np.int8)])
        logprobs = np.concatenate([np.zeros(pl, dtype=np.float32), lp[i][r_real].astype(np.float32)])
        out.append(TokenView(ids[i][attn[i]].astype(np.int64), mask, logprobs))
    return out


# ---------------------------------------------------------------------- TRL
def to_trl(trajs: Sequence[Trajectory]) -> dict[str, list[list[int]] | list[list[float]]]:
    """The dict a TRL ``GRPOTrainer(rollout_func=...)`` returns.

    ``completion_ids`` is everything after the prompt (actions and observations);
    ``env_mask`` is 1 on action tokens, 0 on tokens the environment added, so TRL trains
    only on what the policy produced; ``logprobs`` is aligned to the completion, 0.0 where none.
    """
    require_trajectories(trajs)
    refuse_images(trajs, "to_trl")
    _warn_missing_logprobs(logprobs_present(trajs), "TRL")
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    for t in trajs:
        pl = t.prompt_len
        out["prompt_ids"].append(t.token_ids[:pl].tolist())
        out["completion_ids"].append(t.token_ids[pl:].tolist())
        out["logprobs"].append(_filled_logprobs(t)[pl:].tolist())
        out["env_mask"].append(t.mask[pl:].astype(np.int64).tolist())
    return out


def from_trl(batch: Mapping[str, Sequence[Sequence[Any]]]) -> list[TokenView]:
    """Read a :func:`to_trl` dict back as one token stream per trajectory."""
    out = []
    for prompt, completion, lp, env_mask in zip(
        batch["prompt_ids"], batch["completion_ids"], batch["logprobs"], batch["env_mask"], strict=True
    ):
        pl = len(prompt)
        out.append(
            TokenView(
                np.asarray(list(prompt) + list(completion), dtype=np.int64),
                np.concatenate([np.zeros(pl, dtype=np.int8), np.asarray(env_mask, dtype=np.int8)]),
                np.concatenate([np.zeros(pl, dtype=np.float32), np.asarray(lp, dtype=np.float32)]),
            )
        )
    return out


# ------------------------------------------------------------------- packed
@dataclass
class PackedBatch:
    """Trajectories concatenated without padding (for varlen attention, e.g. flash-attn).

    ``cu_seqlens`` (int32, [B+1]) are the row boundaries; ``position_ids`` restart at 0 on
    each row, which is how packed attention keeps rows from seeing each other.
    All per-token tensors have shape [T] with T the total number of tokens.
    """

    input_ids: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64
    cu_seqlens: torch.Tensor  # int32
    max_seqlen: int
    loss_mask: torch.Tensor  # int64, 1 on action tokens
    logprobs: torch.Tensor  # float32, 0.0 where none
    token_rewards: torch.Tensor  # float32, each turn's reward on its action's last token
    seq_index: torch.Tensor  # int64, the row each token belongs to
    advantages: torch.Tensor | None = None  # float32, on action tokens, when asked for
    logprobs_present: torch.Tensor | None = None  # bool, [B]: every action of the row has its logprobs
    versions: torch.Tensor | None = None  # int32, [T]: the weight version of each token, -1 on mask-0 / unknown
    multi_modal_inputs: dict[str, torch.Tensor] | None = None
    """With images: ``pixel_values`` and ``image_grid_thw`` of every image, in token order (row by
    row), and ``images_per_row`` [B]; ``position_ids`` is then [4, T] (the text positions, then
    the model's three M-RoPE rows, each restarting with its row)."""

    def __len__(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1


def to_packed(
    trajs: Sequence[Trajectory],
    *,
    advantages: Sequence[float] | np.ndarray | None = None,
    out: BatchBuffers | None = None,
    rope_index: RopeIndex | None = None,
) -> PackedBatch:
    """Concatenate whole trajectories (prompt included) into one row of T tokens.

    Args:
        trajs: the episodes.
        advantages: one value per trajectory, broadcast to its action tokens.
        out: buffers to write the batch into, reused across calls (:class:`BatchBuffers`, as for
            :func:`to_verl`): the tensors are views of them, equal to a fresh batch's, and the
            next call with the same ``out`` writes over them.
        rope_index: for trajectories with images, the model's own M-RoPE positions (as for
            :func:`to_verl`); the batch then has [4, T] ``position_ids`` and ``multi_modal_inputs``.
    """
    import torch

    require_trajectories(trajs)
    vision = any(t.images for t in trajs)
    if vision and rope_index is None:
        raise ValueError(
            "these trajectories hold images: to_packed needs the model's multimodal positions, "
            "rope_index=tokengym.policies.hf_vision.mrope_positions(model)"
        )
    present = logprobs_present(trajs)
    _warn_missing_logprobs(present, "packed")
    adv = _per_traj_advantages(advantages, len(trajs))
    lens = np.array([len(t) for t in trajs], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total, longest = int(cu[-1]), int(lens.max())
    if out is None:
        ids = np.empty(total, dtype=np.int64)
        position_ids = np.empty(total, dtype=np.int64)
        mask = np.empty(total, dtype=np.int64)
        logprobs = np.empty(total, dtype=np.float32)
        rewards = np.empty(total, dtype=np.float32)
        seq_index = np.empty(total, dtype=np.int64)
        versions = np.empty(total, dtype=np.int32)
        advantage = None if adv is None else np.empty(total, dtype=np.float32)
    else:  # every element is written below: no fill needed
        ids = out.take("packed_input_ids", (total,), np.int64, None)
        position_ids = out.take("packed_position_ids", (total,), np.int64, None)
        mask = out.take("packed_loss_mask", (total,), np.int64, None)
        logprobs = out.take("packed_logprobs", (total,), np.float32, None)
        rewards = out.take("packed_token_rewards", (total,), np.float32, None)
        seq_index = out.take("packed_seq_index", (total,), np.int64, None)
        versions = out.take("packed_versions", (total,), np.int32, None)
        advantage = None if adv is None else out.take("packed_advantages", (total,), np.float32, None)
    positions = np.arange(longest, dtype=np.int64)
    for i, (t, a, b) in enumerate(zip(trajs, cu[:-1].tolist(), cu[1:].tolist())):
        ids[a:b] = t.token_ids
        position_ids[a:b] = positions[: b - a]
        mask[a:b] = t.mask
        logprobs[a:b] = t.logprobs
        np.copyto(logprobs[a:b], 0.0, where=np.isnan(logprobs[a:b]))  # no logprob reads as 0.0
        rewards[a:b] = _token_rewards(t)
        seq_index[a:b] = i
        versions[a:b] = t.versions
        if advantage is not None:
            np.multiply(mask[a:b], adv[i], out=advantage[a:b], casting="unsafe")
    multi_modal = None
    if vision:
        assert rope_index is not None
        position_ids, multi_modal = _packed_vision(trajs, cu, ids, position_ids, rope_index)
    return PackedBatch(
        multi_modal_inputs=multi_modal,
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=longest,
        loss_mask=torch.from_numpy(mask),
        logprobs=torch.from_numpy(logprobs),
        token_rewards=torch.from_numpy(rewards),
        seq_index=torch.from_numpy(seq_index),
        advantages=None if advantage is None else torch.from_numpy(advantage),
        logprobs_present=torch.from_numpy(present),
        versions=torch.from_numpy(versions),
    )


def _packed_vision(
    trajs: Sequence[Trajectory], cu: np.ndarray, ids: np.ndarray, text_positions: np.ndarray, rope_index: RopeIndex
) -> tuple[np.ndarray, dict[str, Any]]:
    """[4, T] position ids (the text row, then each row's own M-RoPE rows) and the images' inputs, in token order."""
    import torch

    pos = np.empty((4, len(ids)), dtype=np.int64)
    pos[0] = text_positions
    ordered, per_row = [], []
    for t, a, b in zip(trajs, cu[:-1].tolist(), cu[1:].tolist()):
        images = sorted(t.images, key=lambda im: im.offset)
        per_row.append(len(images))
        if not images:
            pos[1:, a:b] = text_positions[a:b]
            continue
        row = torch.from_numpy(ids[a:b])[None]
        pos[1:, a:b] = rope_index(row, torch.ones_like(row), _image_inputs(images, pixels=False)["image_grid_thw"])[:, 0].numpy()
        ordered += images
    return pos, {**_image_inputs(ordered), "images_per_row": torch.as_tensor(per_row, dtype=torch.long)}


def _image_inputs(images: Sequence[Any], *, pixels: bool = True) -> dict[str, Any]:
    """What a VLM's forward takes for ``images``, in their order, from their recorded features:
    ``pixel_values`` (concatenated), ``image_grid_thw`` and ``images_seqlens`` (verl's names)."""
    import torch

    grid = torch.as_tensor([list(im.features.grid_thw) for im in images], dtype=torch.long)
    if not pixels:
        return {"image_grid_thw": grid}
    return {
        "pixel_values": torch.from_numpy(np.concatenate([im.features.pixel_values for im in images])),
        "image_grid_thw": grid,
        "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]),
    }


def from_packed(batch: PackedBatch) -> list[TokenView]:
    """Split a packed batch back into one token stream per trajectory."""
    cu = batch.cu_seqlens.tolist()
    ids, mask, lp = batch.input_ids.numpy(), batch.loss_mask.numpy(), batch.logprobs.numpy()
    return [
        TokenView(ids[a:b].astype(np.int64), mask[a:b].astype(np.int8), lp[a:b].astype(np.float32))
        for a, b in zip(cu[:-1], cu[1:])
    ]
