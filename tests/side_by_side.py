"""Running the suite side by side (``pytest -n auto``, pytest-xdist), and ``@requires``.

Tests own their world, so most run beside each other on every core. A test marked ``alone``
(timing bounds, cgroup limits, whole-machine scans, memory-heavy runs) runs while no other test
of the run does: every test holds a shared lock across the workers, an ``alone`` test holds it
exclusively. A run without workers runs exactly as before. Each worker gets its share of the
cores for torch's threads (``OMP_NUM_THREADS``).

``tests/conftest.py`` imports these hooks and the fixture; ``tests/test_side_by_side.py`` runs a
small suite with two workers and checks that no ``alone`` test overlapped another.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from needs import missing

MAX_AUTO_WORKERS = 8
"""``-n auto`` uses one worker per core up to this many (each worker loads tokenizers and models)."""


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown (and unused) where it is not installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(os.cpu_count() or 1, MAX_AUTO_WORKERS))


LOCKS_VAR = "TOKENGYM_PYTEST_LOCKS"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Thread counts a worker sets (unless the caller set them) before torch starts its thread pools."""
_LOCKS = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The controller of a run side by side makes the folder of the lock files its workers share
    (they inherit the variable when they start) and removes it at the end. A worker gets its share
    of the cores for torch's threads (and its subprocesses, a notebook's kernel, a CLI run): two
    workers with a thread per core each oversubscribe the machine, and OpenMP's waiting threads
    spin, which made the model tests twice as slow as one by one."""
    if hasattr(config, "workerinput"):
        threads = str(max(1, (os.cpu_count() or 1) // int(config.workerinput["workercount"])))
        for var in THREAD_VARS:
            os.environ.setdefault(var, threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    elif getattr(config.option, "numprocesses", None):
        config.stash[_LOCKS] = os.environ[LOCKS_VAR] = tempfile.mkdtemp(prefix="tokengym-pytest-locks-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LOCKS in config.stash:
        shutil.rmtree(config.stash[_LOCKS], ignore_errors=True)
        os.environ.pop(LOCKS_VAR, None)


def _flock(path: Path, how: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, how)
    return fd


@pytest.fixture(autouse=True)
def _alone_or_side_by_side(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``alone`` holds the room exclusively; every other test holds it shared.

    A writer-preferring lock: an ``alone`` test takes the turnstile, then waits for the tests
    running on other workers to end; meanwhile no new test gets past the turnstile.
    """
    locks = os.environ.get(LOCKS_VAR)
    if not locks or not hasattr(request.config, "workerinput"):
        yield
        return
    turnstile, room = Path(locks, "turnstile"), Path(locks, "room")
    if request.node.get_closest_marker("alone") is not None:
        gate = _flock(turnstile, fcntl.LOCK_EX)
        held = _flock(room, fcntl.LOCK_EX)
        os.close(gate)
    else:
        os.close(_flock(turnstile, fcntl.LOCK_EX))
        held = _flock(room, fcntl.LOCK_SH)
    try:
        yield
    finally:
        os.close(held)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@requires(WHAT, reason)``: skip (or fail, where promised) when ``reason`` is not None."""
    for mark in item.iter_markers("requires"):
        what, reason = mark.args
        if reason is not None:
            missing(what, reason)
