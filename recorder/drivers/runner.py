"""The one episode runner, and the asynchronous driver that runs many at their own pace.

:func:`play` is the turn loop of one episode (reset, then generate → step until the episode
ends), used by every driver: the local driver (:func:`tokengym.recorder.rollout`, both its
schedules), the Ray env workers and TRL's ``rollout_func``. A failure of the env or of the policy ends the episode
with an :class:`~tokengym.recorder.drivers.episodes.EpisodeError`, never the run.

:func:`drive` runs many episodes, each as its own task: an episode submits its next turn as
soon as its env step is done, and the policy batches whatever is in flight (continuous
batching in an async engine; see :class:`~tokengym.policies.batching.RequestBatcher` for the
others). Env steps run in worker threads, so that tools that wait overlap with generation and
with each other; the steps of envs that say they do not wait (:func:`steps_wait`) run on the
loop's thread instead (a hop to a worker thread and back cost more than a calculator env's step),
until they are seen to wait after all (:data:`INLINE_WAIT_S`). Turn seeds come
from each episode's :class:`~tokengym.recorder.drivers.episodes.EpisodeTask`, so the same seeds give
the same trajectories however the episodes interleave.

The event loop runs in the calling thread; where that thread already runs one (a Jupyter
kernel) it runs in a thread of its own. SIGTERM and SIGINT (in the main thread) stop the run:
no episode is recorded after the stop, the ones in flight are dropped whole. A step or a turn
past its deadline fails its episode, never the run (:mod:`~tokengym.recorder.drivers.step_pool`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import gymnasium as gym

from tokengym.policies import Generation, SamplingParams
from tokengym.policies.batching import PolicyInterrupted

from .episodes import EpisodeError, EpisodeSlot, EpisodeTask
from .step_pool import STOP_GRACE_S, Deadlines, EpisodeTimeout, StepThreads
from ..stopping import stop_on_signals
from ..trajectory import Trajectory

__all__ = [
    "INLINE_WAIT_S", "Deadlines", "EngineLost", "EpisodeTimeout", "GcClock", "Outcome", "StepPlace", "drive",
    "off_running_loop", "play", "steps_wait",
]

Outcome = list[Trajectory] | EpisodeError
"""A finished episode's rows (one per context, usually one), or the record of what failed."""
Generate = Callable[[list[int], SamplingParams], Awaitable[Generation]]
Step = Callable[[EpisodeSlot, Generation], Awaitable[Any]]
T = TypeVar("T")


INLINE_WAIT_S = 0.0005
"""The most the steps of envs that say they do not wait may wait, on average, and still run on the
event loop's thread; past it (or once one step waits :data:`INLINE_STALL_S`), every later step of
the run goes to worker threads. Waiting is a step's wall time less its own thread's CPU time and
the garbage collector's (which pauses every thread alike)."""
INLINE_STALL_S = 0.02
INLINE_LEARN_STEPS = 8
"""Steps of a run that are averaged before the mean wait decides (one long stall decides at once)."""


class GcClock:
    """Seconds the garbage collector has run since :meth:`start`, in any thread."""

    def __init__(self) -> None:
        self.total = 0.0
        self._since = 0.0

    def __call__(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._since

    def start(self) -> None:
        gc.callbacks.append(self)

    def stop(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def _quiet_wrappers() -> frozenset[type]:
    from gymnasium.wrappers import OrderEnforcing, PassiveEnvChecker, RecordEpisodeStatistics, TimeLimit

    from ..wrapper import RecordEpisodes

    return frozenset({OrderEnforcing, PassiveEnvChecker, RecordEpisodeStatistics, TimeLimit, RecordEpisodes})


def steps_wait(env: Any) -> bool:
    """Whether ``env``'s step may wait: unless the unwrapped env says ``step_waits = False``
    (:attr:`tokengym.envs.ChatEnv.step_waits`) and every wrapper around it is one known to add no
    waiting (gymnasium's bookkeeping wrappers, the recorder) or says so in its own class body."""
    quiet = _quiet_wrappers()
    layer = env
    while isinstance(layer, gym.Wrapper):
        if type(layer) not in quiet and vars(type(layer)).get("step_waits", True) is not False:
            return True
        layer = layer.env
    return getattr(layer, "step_waits", True) is not False


class StepPlace:
    """Where a run's env steps run: on the loop's thread when they do not wait, else in ``pool``.

    A hop to a worker thread and back cost more than a calculator env's whole step (0.45 ms a
    turn at 1,000 in flight); a step that waits on a tool or a sandbox, run inline, would hold
    every other episode up for as long. So steps run inline only when every env of the run says
    its steps do not wait (:func:`steps_wait`), and even then the first sign of waiting (one step
    waiting :data:`INLINE_STALL_S`, or a mean over :data:`INLINE_LEARN_STEPS` steps above
    :data:`INLINE_WAIT_S`) sends the run's steps to worker threads for good.
    """

    def __init__(self, pool: StepThreads, gc_clock: GcClock, inline: bool) -> None:
        self.pool = pool
        self.gc = gc_clock
        self.inline = inline
        self.steps = 0
        self.waited = 0.0
        self.under_way: dict[int, tuple[EpisodeSlot, Any]] = {}  # id(slot) -> (slot, its step's future)

    async def _threaded(self, slot: EpisodeSlot, fn: Callable[..., Any], arg: Any) -> Any:
        future = self.pool.submit(fn, arg)
        self.under_way[id(slot)] = (slot, future)
        try:
            return await asyncio.wrap_future(future)
        finally:
            if future.done():
                self.under_way.pop(id(slot), None)

    async def begin(self, slot: EpisodeSlot, task: EpisodeTask) -> None:
        """``slot.begin`` (the env's reset, and its build for a lazy slot) where the steps run: a
        reset may wait as a step may. An env built here that says its steps wait sends the run's
        steps to worker threads."""
        fresh = slot.env is None
        try:
            if self.inline:
                slot.begin(task)
            else:
                await self._threaded(slot, slot.begin, task)
        finally:
            if fresh and slot.env is not None and self.inline and steps_wait(slot.env):
                self.inline = False

    async def __call__(self, slot: EpisodeSlot, gen: Generation) -> Any:
        if not self.inline:
            return await self._threaded(slot, slot.step, gen)
        gc0, cpu0, start = self.gc.total, time.thread_time(), time.perf_counter()
        result = slot.step(gen)
        wait = (time.perf_counter() - start) - (time.thread_time() - cpu0) - (self.gc.total - gc0)
        self.steps += 1
        self.waited += max(0.0, wait)
        if wait > INLINE_STALL_S or (self.steps >= INLINE_LEARN_STEPS and self.waited > INLINE_WAIT_S * self.steps):
            self.inline = False
        return result


class EngineLost(Exception):
    """The policy engine is gone (not a refusal of this request): the driver decides what follows."""


async def _step_inline(slot: EpisodeSlot, gen: Generation) -> Any:
    return slot.step(gen)


async def play(
    slot: EpisodeSlot,
    task: EpisodeTask,
    base: SamplingParams,
    generate: Generate,
    step: Step = _step_inline,
    deadlines: Deadlines | None = None,
    begin: Callable[[EpisodeSlot, EpisodeTask], Awaitable[None]] | None = None,
) -> Outcome:
    """Play ``task`` in ``slot`` to the end: its trajectory rows, or the record of what failed.

    ``generate`` samples one turn; ``step`` runs ``slot.step`` (in a worker thread, say) and
    returns its result; ``begin`` (default: on this thread) runs ``slot.begin``, the env's reset,
    under the step deadline. :class:`EngineLost` and :class:`~tokengym.policies.batching.PolicyInterrupted`
    propagate: they concern the run, not this episode. A turn or a step past its ``deadlines``
    fails the episode with :class:`EpisodeTimeout`; a step past it also retires the slot
    (``slot.retired``: the hung step still holds its env).
    """
    turn_s = deadlines.generate_s if deadlines is not None else None
    step_s = deadlines.step_s if deadlines is not None else None
    try:
        async with asyncio.timeout(step_s) as late:
            if begin is None:
                slot.begin(task)
            else:
                await begin(slot, task)
    except Exception as err:  # a broken task must not stop the run
        if isinstance(err, TimeoutError) and late.expired():
            slot.retired = True
            err = EpisodeTimeout(
                f"the env's reset did not return within {step_s:g} s (Deadlines.step_s); its env copy is retired "
                "(the reset's thread cannot be stopped), the run goes on without it"
            )
        return EpisodeError.of(err, task.episode, None, "reset failed: ")
    while True:
        try:
            async with asyncio.timeout(turn_s) as late:
                gen = await generate(slot.stream, slot.params(base))
        except (EngineLost, PolicyInterrupted):
            raise
        except Exception as err:  # the policy refused this request, or never answered
            if isinstance(err, TimeoutError) and late.expired():
                err = EpisodeTimeout(
                    f"the policy did not answer turn {slot.turn} within {turn_s:g} s (Deadlines.generate_s)"
                )
            return slot.failure(err)
        if step_s is None or step is _step_inline or getattr(step, "inline", False):
            result = await step(slot, gen)  # on the loop's thread: no deadline could interrupt it
        else:
            result = await _bounded_step(slot, gen, step, step_s)
        if isinstance(result, Exception):
            return slot.failure(result)
        try:
            rows = slot.advance(gen, result)
        except Exception as err:  # the env returned something the driver cannot take: this episode fails
            return slot.failure(err)
        if rows is not None:
            return rows


async def _bounded_step(slot: EpisodeSlot, gen: Generation, step: Step, step_s: float) -> Any:
    """``step`` under its deadline: its result, or the episode's failure when it passed it."""
    try:
        async with asyncio.timeout(step_s) as late:
            return await step(slot, gen)
    except TimeoutError:
        if not late.expired():
            raise
        slot.retired = True
        return EpisodeTimeout(
            f"the env's step of turn {slot.turn} did not return within {step_s:g} s (Deadlines.step_s); "
            "its env copy is retired (the step's thread cannot be stopped), the run goes on without it"
        )


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
    deadlines: Deadlines | None = None,
    admit: Callable[[EpisodeTask], Awaitable[bool]] | None = None,
    on_start: Callable[[Callable[[], None]], None] | None = None,
) -> bool:
    """Play every task, ``len(slots)`` at a time, each at its own pace; ``on_outcome`` gets each result.

    With ``rounds``, in lock-step rounds instead: each turn's request waits until every episode
    in play has asked for its own (the same :func:`play`, gated). ``on_outcome`` runs on the
    loop's thread, one at a time, and never after a stop. Returns True when the run was stopped
    (a signal, Ctrl-C, or the policy interrupted). ``deadlines`` (default :class:`Deadlines`) bound
    each turn and step; a slot whose step passed its deadline takes no more episodes, and at the
    end a step still under way after :data:`STOP_GRACE_S` leaves its slot ``retired`` too.

    ``admit`` (on the loop's thread) is awaited before each task starts: it may wait (an
    asynchronous run bounding staleness), and False ends that slot's worker. ``on_start`` is called
    once the loop runs with the run's stop function (thread-safe: in-flight episodes are dropped whole).
    """
    if not slots:
        return False  # nothing to run (no episodes asked for)
    deadlines = Deadlines() if deadlines is None else deadlines
    stop = _Stop()
    queue: Iterator[EpisodeTask] = iter(tasks)
    pool = StepThreads(len(slots))
    gate = _Rounds(generate) if rounds else None
    turn = gate.generate if gate is not None else generate

    gc_clock = GcClock()
    in_place = StepPlace(pool, gc_clock, inline=not any(steps_wait(slot.env) for slot in slots if slot.env is not None))

    async def worker(slot: EpisodeSlot) -> None:
        for task in queue:
            if stop:
                return
            if admit is not None and not await admit(task):
                return
            if gate is not None:
                gate.enter()
            try:
                outcome = await play(slot, task, base, turn, in_place, deadlines, in_place.begin)
            finally:
                if gate is not None:
                    gate.leave()
            if stop:  # finished after the stop: dropped whole, like the others in flight
                return
            on_outcome(task, outcome)
            if slot.retired:  # its env is still inside the hung step
                return

    async def main() -> None:
        stop.loop = asyncio.get_running_loop()
        stop.tasks.update(asyncio.ensure_future(worker(slot)) for slot in slots)
        if on_start is not None:
            on_start(stop.set)
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

    gc_clock.start()
    try:
        with stop_on_signals(stop.set):
            _run(main(), stop)
    finally:
        gc_clock.stop()
        # A step under way finishes before its env is closed, if it finishes within the grace
        # (one already past its deadline is not waited for again).
        under_way = [f for slot, f in in_place.under_way.values() if not slot.retired and not f.done()]
        if under_way:
            concurrent.futures.wait(under_way, timeout=STOP_GRACE_S)
        pool.shutdown(wait=False, cancel_futures=True)
        for slot, future in in_place.under_way.values():
            if not future.done():
                slot.retired = True
    return bool(stop)


def _run(coro: Any, stop: _Stop) -> None:
    """Run ``coro`` to the end on a new loop: here, or in a thread of its own when this thread runs a loop."""

    def on_a_new_loop() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(coro)
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    off_running_loop(on_a_new_loop, stop.set)


def off_running_loop(fn: Callable[[], T], on_ctrl_c: Callable[[], None]) -> T:
    """``fn()`` here, or in a thread of its own when this thread already runs an event loop (a
    Jupyter kernel's), where a driver's own loop could not run; Ctrl-C while it waits there calls
    ``on_ctrl_c`` (the run winds down, then this returns or raises what ``fn`` did)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as err:  # noqa: BLE001 -- raised again in the caller's thread
            outcome.append((False, err))

    thread = threading.Thread(target=target, name="tokengym-rollout", daemon=True)
    thread.start()
    while thread.is_alive():
        try:
            thread.join(timeout=0.2)
        except KeyboardInterrupt:  # Ctrl-C in a notebook: stop, then wait for the run to wind down
            on_ctrl_c()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
