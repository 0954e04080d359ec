"""One request at a time, for any policy: the engine batches what is in flight.

An episode that runs at its own pace asks for one generation at a time. Engines with an
async API (:class:`~tokengym.policies.AsyncVLLMPolicy`, the OpenAI-compatible server) batch
concurrent requests themselves (continuous batching). A policy with only a batched
``generate`` (:class:`~tokengym.policies.HFPolicy`, offline vLLM, a script) gets a queue here:
the requests that arrive while the policy is busy form its next ``generate`` call, so no
request waits for a fixed round of others, and the policy is always called from one thread
of its own (engines such as vLLM's offline ``LLM`` keep per-thread state).

The busy time (some request inside the policy) is measured, so a driver can say how much of
its wall time was spent outside the engine. A request queued here, waiting for the policy's
current ``generate`` call to return, is not inside the policy: only the calls are counted (for an
engine that batches itself, a request is inside it from submission to its result).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .base import Generation, Policy, SamplingParams

if TYPE_CHECKING:
    import asyncio

__all__ = ["PolicyInterrupted", "RequestBatcher"]


class PolicyInterrupted(Exception):
    """The policy raised ``KeyboardInterrupt`` or ``SystemExit`` inside ``generate``: the run should stop.

    Carried as an ordinary exception so that an event loop does not end half-way; the original
    is its ``__cause__``.
    """


class RequestBatcher:
    """Per-request async generation over ``policy``, batching the requests that wait.

    Args:
        policy: a built policy, or a zero-argument factory (built on the batcher's own thread).
        batch_wait_s: how long to let requests gather before each batched call (0: none; the
            requests that arrived during the previous call still go together).
        native: use the policy's own ``agenerate`` when it has one and batches concurrent calls
            itself (``policy.continuous_batching``, True unless the policy says otherwise): vLLM's
            async engine, a server, ``HFPolicy``'s continuous decode loop.
    """

    def __init__(
        self, policy: Policy | Callable[[], Policy], *, batch_wait_s: float = 0.0, native: bool = True
    ) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokengym-policy")
        if hasattr(policy, "generate") and not isinstance(policy, type):
            self.policy: Any = policy
        else:
            self.policy = self._executor.submit(policy).result()  # type: ignore[arg-type]
        self.batch_wait_s = batch_wait_s
        batches = getattr(self.policy, "continuous_batching", True)
        self._native = getattr(self.policy, "agenerate", None) if native and batches else None
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._drainer: asyncio.Future | None = None
        self._active = 0
        """Requests (or batched calls) inside the policy now."""
        self._waiting = 0
        """Requests asked for and not yet answered (queued or inside)."""
        self._since = 0.0
        self.busy_s = 0.0
        """Seconds during which at least one request was inside the policy (queued ones are not)."""
        self.requests = 0
        self.batches = 0
        self.max_batch = 0
        self.peak = 0
        """The most requests inside the policy (or waiting for it) at once."""

    def busy_now(self) -> float:
        """:attr:`busy_s`, including the interval under way."""
        return self.busy_s + (time.perf_counter() - self._since if self._active else 0.0)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)`` on the policy's own thread and wait (to build or close an engine)."""
        return self._executor.submit(fn, *args).result()

    async def generate(self, context: list[int], params: SamplingParams) -> Generation:
        """One request's generation. Requests that arrive while the policy is busy go together."""
        import asyncio

        images = getattr(context, "images", ())
        if images and not getattr(self.policy, "sees_images", False):
            name = getattr(self.policy, "name", type(self.policy).__name__)
            raise ValueError(
                f"the context holds {len(images)} image(s), but the policy {name} reads text only: use a "
                "vision-language policy (tokengym.policies.HFVisionPolicy), or an env without image parts"
            )

        self.requests += 1
        self._waiting += 1
        self.peak = max(self.peak, self._waiting)
        try:
            if self._native is not None:
                self._enter()
                try:
                    return (await self._native([context], [params]))[0]
                finally:
                    self._leave()
            future = asyncio.get_running_loop().create_future()
            self._pending.append((context, params, future))
            if self._drainer is None or self._drainer.done():
                self._drainer = asyncio.ensure_future(self._drain())
            return await future
        finally:
            self._waiting -= 1

    def _enter(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.busy_s += time.perf_counter() - self._since

    async def _call(self, contexts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
        import asyncio

        def call() -> list[Generation]:
            try:
                return self.policy.generate(contexts, params)
            except (KeyboardInterrupt, SystemExit) as err:
                raise PolicyInterrupted(f"the policy was interrupted ({type(err).__name__})") from err

        self._enter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        finally:
            self._leave()

    async def _drain(self) -> None:
        """Serve what is pending as one batch, again and again while requests keep coming."""
        import asyncio

        while self._pending:
            if self.batch_wait_s:
                await asyncio.sleep(self.batch_wait_s)
            batch, self._pending = self._pending, []
            self.batches += 1
            self.max_batch = max(self.max_batch, len(batch))
            results: list[Any]
            try:
                results = await self._call([c for c, _, _ in batch], [p for _, p, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"the policy returned {len(results)} generations for {len(batch)} contexts")
            except PolicyInterrupted as err:
                results = [err] * len(batch)
            except Exception as err:
                # A failed batch again, request by request: a bad request fails alone.
                results = [err] if len(batch) == 1 else [await self._one(c, p) for c, p, _ in batch]
            for (_, _, future), result in zip(batch, results):
                if future.done():  # cancelled
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def _one(self, context: list[int], params: SamplingParams) -> Any:
        try:
            return (await self._call([context], [params]))[0]
        except Exception as err:
            return err

    def close(self, close_policy: bool = False) -> None:
        """Stop the batcher's thread (after closing the policy on it, with ``close_policy``)."""
        try:
            if close_policy and hasattr(self.policy, "close"):
                self.run(self.policy.close)
        finally:
            self._executor.shutdown(wait=True)
