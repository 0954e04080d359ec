"""One tiny random Qwen3 (real tokenizer) shared by the vLLM tests, saved where vLLM can load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def save_tiny_qwen3(tokenizer: Any, path: Path) -> tuple[Path, Qwen3ForCausalLM]:
    """A tiny random Qwen3 (hidden 128, 4 heads of 32, 2 layers, float32) and the tokenizer, saved in ``path``."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=True, dtype="float32",
    )
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model
