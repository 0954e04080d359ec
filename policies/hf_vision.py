"""A transformers vision-language policy: contexts with images, sampled ids and raw logprobs.

A VLM's forward pass needs, beside the ids, each image's pixel values and patch grid; the
model builds its multimodal rotary positions from them (Qwen2-VL's M-RoPE). Those come with
the context (:class:`~tokengym.policies.base.VisionContext`), made by the env from the
processor, so the policy checks what the model will do with them before it runs: an image
whose placeholder count is not what the model's vision tower makes of its grid (another
``merge_size``, a resize the model does not do) is an error naming the image and its turn.

Requests run one at a time: the continuous decode loop of :class:`~tokengym.policies.HFPolicy`
joins text requests at every step, but a request with images has a prefill of its own
(pixel values through the vision tower, positions from the grids), so here they queue
(``continuous_batching = False``), and a text-only context is served the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import Generation, SamplingParams, context_images
from .hf import HFPolicy

__all__ = ["HFVisionPolicy", "mrope_positions", "vision_inputs"]


def vision_inputs(images: Sequence[Any], *, merge_size: int) -> dict[str, Any]:
    """``pixel_values`` and ``image_grid_thw`` (torch) for a forward pass over a context holding
    ``images`` (:class:`~tokengym.envs.images.StreamImage`, in stream order). Each image's
    placeholder count must be what a vision tower that merges ``merge_size`` x ``merge_size``
    patches makes of its grid: else an ImageTokenMismatch naming the image and its turn."""
    import torch

    from tokengym.envs.images import ImageTokenMismatch

    for img in images:
        t, h, w = img.features.grid_thw
        want = t * h * w // merge_size**2
        if want != img.num_tokens:
            turn = "the prompt" if img.turn < 0 else f"turn {img.turn}"
            raise ImageTokenMismatch(
                f"image #{img.index} ({turn}) stands as {img.num_tokens} placeholder tokens, but the model's vision "
                f"tower makes {want} features of its {t}x{h}x{w} patch grid (spatial merge {merge_size}): the env's "
                "image processor settings are not the model's"
            )
    return {
        "pixel_values": torch.as_tensor(np.concatenate([i.features.pixel_values for i in images])),
        "image_grid_thw": torch.as_tensor([list(i.features.grid_thw) for i in images], dtype=torch.long),
    }


class HFVisionPolicy(HFPolicy):
    """Generates with a transformers vision-language model (Qwen2-VL, Qwen2.5-VL).

    Args:
        model: a ``PreTrainedModel`` with a vision tower (``Qwen2VLForConditionalGeneration``).
        tokenizer: for stop strings, as :class:`~tokengym.policies.HFPolicy`'s.
        device: where to run.
    """

    sees_images = True

    def __init__(self, model: Any, tokenizer: Any = None, *, device: str = "cpu") -> None:
        super().__init__(model, tokenizer, device=device, continuous=False)
        vision = getattr(model.config, "vision_config", None)
        if vision is None:
            raise TypeError(f"{type(model).__name__} has no vision_config: HFVisionPolicy needs a vision-language model")
        self.merge_size = int(getattr(vision, "spatial_merge_size", 2))
        self.image_token_id = int(model.config.image_token_id)
        self._token_types = "mm_token_type_ids" in inspect.signature(self.model.forward).parameters
        self.name = f"hf-vision:{getattr(model, 'name_or_path', '') or type(model).__name__}"

    def model_inputs(self, ids: Sequence[int], images: Sequence[Any]) -> dict[str, Any]:
        """What one forward pass over ``ids`` (with ``images``) takes: the ids as a batch of one,
        and the images' pixel values and grids (checked) when there are any."""
        import torch

        x = torch.as_tensor([list(ids)], dtype=torch.long, device=self.device)
        out: dict[str, Any] = {"input_ids": x}
        if images:
            out.update({k: v.to(self.device) for k, v in vision_inputs(images, merge_size=self.merge_size).items()})
            if self._token_types:  # newer transformers take the image positions from the caller
                out["mm_token_type_ids"] = (x == self.image_token_id).long()
        return out

    def check_contexts(self, contexts: Sequence[Sequence[int]]) -> list[Any]:
        """The contexts as they are (their images with them), each non-empty."""
        if any(not len(c) for c in contexts):
            raise ValueError("every context needs at least one token")
        return list(contexts)

    def _generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        contexts, params = self._requests(contexts, sampling)
        return [self._one(c, p) for c, p in zip(contexts, params, strict=True)]

    def _one(self, context: Sequence[int], p: SamplingParams) -> Generation:
        import torch
        from transformers import DynamicCache

        generator = self.generator(p)
        inputs = self.model_inputs([int(t) for t in context], context_images(context))
        cache = DynamicCache()
        out_ids: list[int] = []
        out_lp: list[float] = []
        finish: str | None = None
        for _ in range(p.max_tokens):
            result = self.model(**inputs, use_cache=True, **{self._cache_arg: cache}, logits_to_keep=1)
            logits = result.logits[:, -1, :].float()
            _, toks, lps = self.sample_rows(logits, [0], [p], [generator])
            out_ids.append(toks[0])
            out_lp.append(lps[0])
            self.sampled(1)
            finish = self.finish_reason(out_ids, p)
            if finish is not None:
                break
            step = torch.tensor([[toks[0]]], dtype=torch.long, device=self.device)
            inputs = {"input_ids": step}
            if self._token_types:
                inputs["mm_token_type_ids"] = torch.zeros_like(step)
        gen = Generation(np.array(out_ids), np.array(out_lp), finish or "length", self.logprob_kind)  # type: ignore[arg-type]
        return gen.with_version(self.version)


def mrope_positions(model: Any) -> Any:
    """The model's own multimodal rotary positions of a padded row, as ``to_verl(...,
    rope_index=...)`` takes them: ``(input_ids [1, W], attention_mask [1, W], image_grid_thw)
    -> [3, 1, W]`` through the model's ``get_rope_index`` (what verl binds to the processor)."""
    inner = getattr(model, "model", model)
    get_rope_index = getattr(inner, "get_rope_index", None)
    if get_rope_index is None:
        raise TypeError(f"{type(model).__name__} has no get_rope_index: not an M-RoPE vision-language model")
    image_token_id = int(model.config.image_token_id)

    def positions(input_ids: Any, attention_mask: Any, image_grid_thw: Any) -> Any:
        types = (input_ids == image_token_id).int()
        out, _ = get_rope_index(
            input_ids=input_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
        )
        return out

    return positions
