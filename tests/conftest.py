"""Shared fixtures: the real, pinned tokenizers (fetched once, cached); Qwen3 and Qwen2.5 by default.

Also how the suite runs side by side (``pytest -n auto``) and what a test needs from the machine:
both in :mod:`side_by_side` (its hooks and fixture are imported here, so pytest finds them).
"""

from __future__ import annotations

import os

import pytest
from side_by_side import (  # noqa: F401  (hooks and an autouse fixture, registered by being here)
    _alone_or_side_by_side,
    pytest_configure,
    pytest_runtest_setup,
    pytest_unconfigure,
    pytest_xdist_auto_num_workers,
)

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
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
