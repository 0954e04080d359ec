"""The tool runner: a turn's calls executed concurrently, each under its own timeout.

Separate from the tools themselves (:mod:`tokengym.envs.function_tools`: schemas, argument
checks, result text) because running is where threads, event loops and deadlines live.

:class:`ToolRunner` executes all calls of a turn concurrently, results in call order, each
under its own timeout:

* sync tools run in daemon worker threads, one call per thread at a time: an idle worker
  takes the call, or a new one starts (a thread start per call cost ~15% of a calculator
  env's step; at most :data:`IDLE_WORKERS` idle workers wait for the next call). The caller
  waits until the call's deadline and no longer. A call that is still running then is
  **abandoned**: Python cannot kill a thread, so it keeps running in the background until
  its function returns (or the process exits, since it is a daemon thread), and whatever it
  returns is discarded; its worker takes no other call until then. The rollout never waits
  for it. :func:`abandoned_threads` says how many are still running. A tool that may hang
  for good should be async (cancellable) or run its work in a subprocess.
* async tools run on the runner's own event loop thread under ``asyncio.wait_for``, so a
  timeout really cancels them. A coroutine that blocks the loop (a sync sleep inside
  ``async def``) is caught by the same deadline from the caller's side, but it stalls the
  runner's other async calls until it returns.
* tools marked ``parallel=False`` (stateful tools whose calls must see each other's effects)
  run one after another in call order, alongside the parallel ones.

Every failure becomes a short text for the model (:class:`ToolOutcome`), never an exception
of the rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .function_tools import (
    ERROR_CHARS,
    Tool,
    ToolCall,
    ToolError,
    ToolOutcome,
    check_arguments,
    clean_text,
    result_content,
)

__all__ = ["ToolRunner", "abandoned_threads", "unknown_tool_text"]


def _error_text(name: str, err: BaseException) -> str:
    msg = clean_text(str(err)).strip()
    if len(msg) > ERROR_CHARS:
        msg = msg[: ERROR_CHARS - 3] + "..."
    if isinstance(err, ToolError):
        return f"Error: {name}: {msg}" if msg else f"Error: {name} failed."
    kind = type(err).__name__
    return f"Error: {name} raised {kind}: {msg}" if msg else f"Error: {name} raised {kind}."


def _seconds(t: float) -> str:
    return f"{t:g} s"

_ABANDONED: set[concurrent.futures.Future] = set()
_ABANDONED_LOCK = threading.Lock()
IDLE_WORKERS = 64
"""The most idle sync-tool worker threads kept for later calls; more exit when their call returns."""
_IDLE: list[queue.SimpleQueue] = []
_IDLE_LOCK = threading.Lock()


def abandoned_threads() -> int:
    """How many timed-out sync tool calls are still running in the background (one thread each)."""
    with _ABANDONED_LOCK:
        _ABANDONED.difference_update([f for f in _ABANDONED if f.done()])
        return len(_ABANDONED)


def _submit_sync(fut: concurrent.futures.Future, fn: Callable[..., Any], args: dict[str, Any]) -> None:
    """Run ``fn(**args)`` into ``fut`` on an idle worker, or on a new one when none is idle."""
    with _IDLE_LOCK:
        inbox = _IDLE.pop() if _IDLE else None
    if inbox is None:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_work, args=(inbox,), name="tokengym-tool", daemon=True).start()
    inbox.put((fut, fn, args))


def _work(inbox: queue.SimpleQueue) -> None:
    while True:
        job = inbox.get()
        _run_sync(*job)
        del job  # the call's arguments and result are not kept alive by an idle worker
        with _IDLE_LOCK:
            if len(_IDLE) >= IDLE_WORKERS:
                return
            _IDLE.append(inbox)


def _run_sync(fut: concurrent.futures.Future, fn: Callable[..., Any], args: dict[str, Any]) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn(**args)
        if inspect.isawaitable(result):  # an async callable this module did not recognise as one
            result = asyncio.run(_awaited(result))
        fut.set_result(result)
    except BaseException as err:  # a tool's SystemExit or KeyboardInterrupt is its failure, not ours
        fut.set_exception(err)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class _LoopThread:
    """An event loop in a daemon thread, for async tools."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="tokengym-tool-loop", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def stop(self) -> None:
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:  # let cancelled tool coroutines unwind before the loop goes away
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=1.0)
        except Exception:  # a coroutine blocking the loop: stop it anyway  # noqa: S110
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=1.0)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class _Pending:
    index: int
    tool: Tool
    future: concurrent.futures.Future
    deadline: float
    timeout: float
    sync: bool = False


class ToolRunner:
    """Runs the calls of a turn: concurrently, each under its own timeout, results in call order.

    Args:
        timeout: default seconds per call (a tool's own ``timeout`` wins).
        grace: extra seconds the caller waits for an async call beyond its timeout, so that the
            coroutine's own cancellation is what normally ends it.
    """

    def __init__(self, timeout: float = 5.0, *, grace: float = 0.25) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.grace = float(grace)
        self._loop: _LoopThread | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = _LoopThread()
                self._finalizer = weakref.finalize(self, self._loop.stop)
            return self._loop.loop

    def close(self) -> None:
        """Stop the async tools' event loop (sync tool threads are daemons and need nothing)."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._loop = None
            self._finalizer = None

    def _start(self, index: int, tool: Tool, args: dict[str, Any]) -> _Pending:
        timeout = float(tool.timeout or self.timeout)
        start = time.monotonic()
        if tool.is_async:
            loop = self._event_loop()
            try:
                coro = tool.fn(**args)
            except BaseException as err:  # the call itself failed (bad arguments for the function)
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.set_exception(err)
                return _Pending(index, tool, fut, start + timeout, timeout)
            fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(_awaited(coro), timeout), loop)
            return _Pending(index, tool, fut, start + timeout + self.grace, timeout)
        fut = concurrent.futures.Future()
        _submit_sync(fut, tool.fn, args)
        return _Pending(index, tool, fut, start + timeout, timeout, sync=True)

    def _finish(self, p: _Pending) -> ToolOutcome:
        name = p.tool.name
        try:
            value = p.future.result(timeout=max(0.0, p.deadline - time.monotonic()))
        except (concurrent.futures.TimeoutError, TimeoutError):
            p.future.cancel()  # cancels the coroutine on the loop; a running thread is abandoned
            if p.sync and not p.future.done():
                with _ABANDONED_LOCK:
                    _ABANDONED.add(p.future)
            return ToolOutcome("timeout", f"Error: {name} timed out after {_seconds(p.timeout)}; its result is discarded.")
        except concurrent.futures.CancelledError:
            return ToolOutcome("error", f"Error: {name} was cancelled.")
        except BaseException as err:
            f = p.future
            if not (f.done() and not f.cancelled() and f.exception() is err):
                raise  # the wait itself was interrupted (Ctrl-C in the caller): not the tool's failure
            return ToolOutcome("error", _error_text(name, err))
        try:
            text, images, reward = result_content(value)
        except Exception as err:  # a result whose str() fails
            return ToolOutcome("error", f"Error: {name} returned a result that cannot be shown as text ({type(err).__name__}).")
        return ToolOutcome("ok", text, reward, images)

    def run(
        self, calls: Sequence[ToolCall], tools: Mapping[str, Tool] | Sequence[Tool]
    ) -> list[ToolOutcome]:
        """Run ``calls``; one outcome per call, in call order. Never raises for a tool's failure."""
        table = tools if isinstance(tools, Mapping) else {t.name: t for t in tools}
        outcomes: list[ToolOutcome | None] = [None] * len(calls)
        ready: list[tuple[int, Tool, dict[str, Any]]] = []
        for i, call in enumerate(calls):
            t = table.get(call.name)
            if t is None:
                outcomes[i] = ToolOutcome("unknown_tool", unknown_tool_text(call.name, table))
                continue
            args, problems = check_arguments(t.argument_schema, call.arguments)
            if problems:
                outcomes[i] = ToolOutcome("invalid_arguments", f"Error: {t.name}: {'; '.join(problems)}.")
                continue
            ready.append((i, t, args))
        parallel = [self._start(i, t, a) for i, t, a in ready if t.parallel]
        for i, t, a in ready:
            if not t.parallel:
                outcomes[i] = self._finish(self._start(i, t, a))
        for p in parallel:
            outcomes[p.index] = self._finish(p)
        return [o for o in outcomes if o is not None]


def unknown_tool_text(name: str, tools: Mapping[str, Any]) -> str:
    available = ", ".join(tools) if tools else "none"
    return f'Error: unknown tool "{name}". Available tools: {available}.'
