"""Shared fixtures: the real, pinned tokenizers (fetched once, cached); Qwen3 and Qwen2.5 by default."""

from __future__ import annotations

import pytest

from tokengym.envs import ChatRenderer, fetch_tokenizer, load_tokenizer

TEMPLATES = ("qwen3", "qwen2.5")


@pytest.fixture(scope="session", params=TEMPLATES)
def tokenizer_name(request: pytest.FixtureRequest) -> str:
    """Each real template in turn."""
    return request.param


_TOKENIZERS: dict = {}


def real_tokenizer(name: str):
    """The real tokenizer for ``name``, loaded once per test session."""
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(str(fetch_tokenizer(name)))
    return _TOKENIZERS[name]


@pytest.fixture(scope="session")
def tokenizer(tokenizer_name: str):
    return real_tokenizer(tokenizer_name)


@pytest.fixture(scope="session")
def qwen3():
    return real_tokenizer("qwen3")


@pytest.fixture(scope="session")
def qwen25():
    return real_tokenizer("qwen2.5")


@pytest.fixture(scope="session")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer)


# CI runs the property tests with a fixed seed so that a red build always reproduces;
# local runs explore new examples each time.
import os  # noqa: E402

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
