"""The threads env steps run on, and the deadlines that keep one hung episode from hanging a run.

A step that never returns (a tool blocked on a socket, a sandbox that stopped answering) cannot
be stopped: Python cannot kill a thread. What a run can do is stop waiting for it: the episode
fails by name once its step or its policy turn is past its deadline (:class:`Deadlines`), its
env copy is retired (the hung thread still uses it), and the run goes on with the others. The
threads are daemon threads, so a hung one neither holds up the end of the run (which waits
:data:`STOP_GRACE_S` for steps under way, then closes every env, which may free them) nor the
exit of the process; ``concurrent.futures.ThreadPoolExecutor`` joins its threads at exit.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["STOP_GRACE_S", "Deadlines", "EpisodeTimeout", "StepThreads"]

STOP_GRACE_S = 5.0
"""How long the end of a run (or a stop) waits for env steps still under way before it closes
their envs regardless."""


@dataclass(frozen=True)
class Deadlines:
    """How long one episode's env step and one policy turn may take (seconds; ``None``: no limit).

    Generous by default: a deadline is for a step or a request that will never end, not a slow
    one. A policy turn's time includes its wait in the engine's queue. Steps of envs that say
    they never wait run on the event loop's thread, outside ``step_s`` (they compute, they do
    not block); every other step runs on a worker thread under it.
    """

    step_s: float | None = 600.0
    generate_s: float | None = 3600.0

    def __post_init__(self) -> None:
        for name in ("step_s", "generate_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and value < float("inf")):
                raise ValueError(f"{name} must be a positive number of seconds or None (no limit), got {value!r}")


class EpisodeTimeout(Exception):
    """An episode's env step or policy turn ran past its deadline; the episode failed, the run went on."""


class StepThreads(concurrent.futures.Executor):
    """At most ``size`` daemon threads, started as work needs them; ``submit`` returns a future.

    Unlike a ``ThreadPoolExecutor``, a thread that never returns is not joined at exit; the
    driver bounds its own wait for steps under way (:data:`STOP_GRACE_S`).
    """

    def __init__(self, size: int, name: str = "tokengym-env") -> None:
        self._size = max(1, size)
        self._name = name
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work
        self._queued = 0  # calls submitted and not yet taken by a thread
        self._lock = threading.Lock()
        self._closed = False

    def grow(self, n: int = 1) -> None:
        """Allow ``n`` more threads: one for each thread a hung call holds for good."""
        with self._lock:
            self._size += n

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the step threads are shut down")
            self._queued += 1
            # Every queued call gets a thread of its own while there are fewer than `size`: a call
            # never waits behind one that hangs.
            if self._queued > self._idle and len(self._threads) < self._size:
                thread = threading.Thread(target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._work.put((future, fn, args, kwargs))
        return future

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._work.get()
            with self._lock:
                self._idle -= 1
                if item is not None:
                    self._queued -= 1
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as err:  # noqa: BLE001 - handed to the awaiting side
                    future.set_exception(err)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once their work is done (``wait``: wait for that, however long; the
        driver waits for steps under way itself, for at most :data:`STOP_GRACE_S`)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for t in threads:
                t.join()
