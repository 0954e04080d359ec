"""Tiny random Qwen3 models for the real tokenizers: in memory (transformers tests) or saved where vLLM can load them."""

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


def tiny_qwen3(vocab_size: int, **extra: Any) -> Qwen3ForCausalLM:
    """A tiny random Qwen3 in memory (hidden 64, 2 heads of 32, 2 layers, seed 0), in eval mode;
    ``extra`` goes to the config (``layer_types=...``, ``sliding_window=...``)."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=True, **extra,
    )
    return Qwen3ForCausalLM(config).eval()
