"""SIGTERM and SIGINT as one clean stop, and short sections that a stop must not cut in half.

Schedulers (SLURM, Kubernetes, ``timeout``) stop a job with SIGTERM, people with Ctrl-C
(SIGINT). Inside :func:`stop_on_signals` both raise :class:`KeyboardInterrupt` in the main
thread, so a driver handles them the same way: finished episodes kept, unfinished ones
dropped whole. A signal that arrives inside :func:`uninterrupted` (a store write, the
bookkeeping of a finished episode) takes effect when the section ends, so a trajectory is
never half-recorded: it is either stored and counted, or neither.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["stop_on_signals", "uninterrupted"]

_local = threading.local()


def _depth() -> int:
    return getattr(_local, "depth", 0)


def _handler(signum: int, frame: FrameType | None) -> None:
    # Python runs signal handlers in the main thread, so this sees the main thread's depth.
    if _depth():
        _local.pending = signum
        return
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def stop_on_signals(on_stop: Callable[..., None] | None = None) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT raise ``KeyboardInterrupt`` (deferred past :func:`uninterrupted`
    sections), or call ``on_stop(signum, frame)`` instead when given (a driver whose event loop must
    not be cut: it sets a stop flag). The previous handlers come back on exit. Outside the main
    thread it does nothing (Python delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, on_stop or _handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A section that a stop signal (under :func:`stop_on_signals`) does not cut: the stop is raised
    as ``KeyboardInterrupt`` when the outermost section ends normally."""
    _local.depth = _depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1
    if _local.depth == 0 and getattr(_local, "pending", None) is not None:
        signum, _local.pending = _local.pending, None
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")
