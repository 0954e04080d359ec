"""A tiny random Qwen2-VL for a real Qwen tokenizer: its vision tower and M-RoPE as the real model's, in memory."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration


def tiny_qwen2_vl(tokenizer: Any, *, merge_size: int = 2) -> Qwen2VLForConditionalGeneration:
    """Hidden 64, 2 text layers, a 2-block vision tower of width 32 (patches of 14, merged
    ``merge_size`` x ``merge_size``), float32, seed 0, in eval mode; the image and vision tokens
    are the tokenizer's own."""
    torch.manual_seed(0)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    )}
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
            "spatial_merge_size": merge_size, "temporal_patch_size": 2, "in_channels": 3,
        },
        **ids,
    )
    return Qwen2VLForConditionalGeneration(config).eval()
