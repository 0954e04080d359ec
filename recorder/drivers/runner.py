"""The one episode runner, and the asynchronous driver that runs many at their own pace.

:func:`play` is the turn loop of one episode (reset, then generate → step until the episode
ends), used by every driver: the local driver (:func:`tokengym.recorder.rollout`, both its
schedules), the Ray env workers and TRL's ``rollout_func``. A failure of the env or of the policy ends the episode
with an :class:`~tokengym.recorder.drivers.episodes.EpisodeError`, never the run.

:func:`drive` runs many episodes, each as its own task: an episode submits its next turn as
soon as its env step is done, and the policy batches whatever is in flight (continuous
batching in an async engine; see :class:`~tokengym.policies.batching.RequestBatcher` for the
others). Env steps run in worker threads, so tools overlap with generation. Turn seeds come
from each episode's :class:`~tokengym.recorder.drivers.episodes.EpisodeTask`, so the same seeds give
the same trajectories however the episodes interleave.

The event loop runs in the calling thread; where that thread already runs one (a Jupyter
kernel) it runs in a thread of its own. SIGTERM and SIGINT (in the main thread) stop the run:
no episode is recorded after the stop, the ones in flight are dropped whole.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokengym.policies import Generation, SamplingParams
from tokengym.policies.batching import PolicyInterrupted

from .episodes import EpisodeError, EpisodeSlot, EpisodeTask
from ..stopping import stop_on_signals
from ..trajectory import Trajectory

__all__ = ["EngineLost", "Outcome", "drive", "play"]

Outcome = list[Trajectory] | EpisodeError
"""A finished episode's rows (one per context, usually one), or the record of what failed."""
Generate = Callable[[list[int], SamplingParams], Awaitable[Generation]]
Step = Callable[[EpisodeSlot, Generation], Awaitable[Any]]


class EngineLost(Exception):
    """The policy engine is gone (not a refusal of this request): the driver decides what follows."""


async def _step_inline(slot: EpisodeSlot, gen: Generation) -> Any:
    return slot.step(gen)


async def play(
    slot: EpisodeSlot, task: EpisodeTask, base: SamplingParams, generate: Generate, step: Step = _step_inline
) -> Outcome:
    """Play ``task`` in ``slot`` to the end: its trajectory rows, or the record of what failed.

    ``generate`` samples one turn; ``step`` runs ``slot.step`` (in a worker thread, say) and
    returns its result. :class:`EngineLost` and :class:`~tokengym.policies.batching.PolicyInterrupted`
    propagate: they concern the run, not this episode.
    """
    try:
        slot.begin(task)
    except Exception as err:  # a broken task must not stop the run
        return EpisodeError.of(err, task.episode, None, "reset failed: ")
    while True:
        try:
            gen = await generate(slot.stream, slot.params(base))
        except (EngineLost, PolicyInterrupted):
            raise
        except Exception as err:  # the policy refused this request
            return slot.failure(err)
        result = await step(slot, gen)
        if isinstance(result, Exception):
            return slot.failure(result)
        try:
            rows = slot.advance(gen, result)
        except Exception as err:  # the env returned something the driver cannot take: this episode fails
            return slot.failure(err)
        if rows is not None:
            return rows


class _Stop:
    """The run's stop: set by a signal, Ctrl-C in the waiting thread, or an interrupted policy."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: set[asyncio.Task] = set()

    def set(self, *_: Any) -> None:
        self.event.set()
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._cancel)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _cancel(self) -> None:
        for t in self.tasks:
            t.cancel()

    def __bool__(self) -> bool:
        return self.event.is_set()


class _Rounds:
    """Lock-step rounds over :func:`play`: a turn's request waits until every episode in play has
    asked for its turn, then they all go on together (one batch of the batcher behind
    ``generate``), so each round generates every live episode's turn at once, then steps every env."""

    def __init__(self, generate: Generate) -> None:
        self._generate = generate
        self._playing = 0
        self._waiting: list[asyncio.Future] = []

    def enter(self) -> None:
        self._playing += 1

    def leave(self) -> None:
        self._playing -= 1
        self._release()

    async def generate(self, context: list[int], params: SamplingParams) -> Generation:
        gate = asyncio.get_running_loop().create_future()
        self._waiting.append(gate)
        self._release()
        await gate
        return await self._generate(context, params)

    def _release(self) -> None:
        if self._waiting and len(self._waiting) >= self._playing:
            waiting, self._waiting = self._waiting, []
            for gate in waiting:
                if not gate.done():  # a cancelled episode's
                    gate.set_result(None)


def drive(
    slots: list[EpisodeSlot],
    tasks: Iterable[EpisodeTask],
    base: SamplingParams,
    generate: Generate,
    on_outcome: Callable[[EpisodeTask, Outcome], None],
    *,
    rounds: bool = False,
) -> bool:
    """Play every task, ``len(slots)`` at a time, each at its own pace; ``on_outcome`` gets each result.

    With ``rounds``, in lock-step rounds instead: each turn's request waits until every episode
    in play has asked for its own (the same :func:`play`, gated). ``on_outcome`` runs on the
    loop's thread, one at a time, and never after a stop. Returns True when the run was stopped
    (a signal, Ctrl-C, or the policy interrupted).
    """
    if not slots:
        return False  # nothing to run (no episodes asked for)
    stop = _Stop()
    queue: Iterator[EpisodeTask] = iter(tasks)
    pool = ThreadPoolExecutor(max_workers=max(1, len(slots)), thread_name_prefix="tokengym-env")
    gate = _Rounds(generate) if rounds else None
    turn = gate.generate if gate is not None else generate

    async def in_thread(slot: EpisodeSlot, gen: Generation) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, slot.step, gen)

    async def worker(slot: EpisodeSlot) -> None:
        for task in queue:
            if stop:
                return
            if gate is not None:
                gate.enter()
            try:
                outcome = await play(slot, task, base, turn, in_thread)
            finally:
                if gate is not None:
                    gate.leave()
            if stop:  # finished after the stop: dropped whole, like the others in flight
                return
            on_outcome(task, outcome)

    async def main() -> None:
        stop.loop = asyncio.get_running_loop()
        stop.tasks.update(asyncio.ensure_future(worker(slot)) for slot in slots)
        done, pending = await asyncio.wait(stop.tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
        if errors:
            stop.event.set()  # nothing more is recorded
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            fatal = [e for e in errors if not isinstance(e, PolicyInterrupted)]
            if fatal:
                raise fatal[0]

    try:
        with stop_on_signals(stop.set):
            _run(main(), stop)
    finally:
        pool.shutdown(wait=True)  # a step under way finishes before its env is closed
    return bool(stop)


def _run(coro: Any, stop: _Stop) -> None:
    """Run ``coro`` to the end on a new loop: here, or in a thread of its own when this thread runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(coro)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        return
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coro)
        except BaseException as err:
            failure.append(err)

    thread = threading.Thread(target=target, name="tokengym-rollout", daemon=True)
    thread.start()
    while thread.is_alive():
        try:
            thread.join(timeout=0.2)
        except KeyboardInterrupt:  # Ctrl-C in a notebook: stop, then wait for the run to wind down
            stop.set()
    if failure:
        raise failure[0]
