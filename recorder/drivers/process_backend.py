"""The local process pool: env steps in worker processes, the policy in this one.

One process drives a turn for about 1.5 ms of CPU on a calculator env (``benchmarks/scale.py``),
and most of it is the env's own step and its recording. An engine serving a small model at short
tool turns asks for more turns a second than one core gives. ``rollout(..., backend="processes")``
(or :class:`ProcessBackend`) moves the envs out of the driver's process, as the Ray env workers
do, without Ray::

    driver (this process)                        env workers (processes forked from a fork server)
    the policy, its request batcher,      <--->  env copies (their tools, sandboxes); each worker
    the episode queue, on_episode                plays its episodes on one event loop with the
                                                 runner's own turn loop (runner.play)

Each turn a worker sends the episode's context and sampling settings, the driver answers with the
policy's generation; a finished episode comes back whole (its trajectory rows), never a part. The
same seeds give the same trajectories, token for token, as the local driver and the Ray backend.

Both ends of a worker's socket are read and written from their own event loop without blocking
(whole pickled messages in ``multiprocessing.Connection``'s framing), so neither side can stall
the other on a full socket, and no thread hands messages over.

Faults: a worker that dies loses only its in-flight episodes; each is started again on another
worker (``max_reruns``) or counted as failed, and a fresh worker takes the dead one's place
(``max_worker_replacements``). A worker that cannot build its env, or that exits before it has
started (a script without an ``if __name__ == "__main__":`` guard), ends the run with a
:class:`~tokengym.recorder.drivers.ray_backend.RolloutError` that says so. Ctrl-C and SIGTERM stop
the run as locally: finished episodes kept, unfinished ones dropped whole.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import pickle
import signal
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from tokengym.policies import Generation, Policy, SamplingParams, StreamsTokens
from tokengym.policies.batching import PolicyInterrupted, RequestBatcher

from ..stopping import stop_on_signals
from ..trajectory import Trajectory
from ..wrapper import RecordEpisodes
from .episodes import (
    EpisodeError,
    EpisodeSlot,
    EpisodeTask,
    PolicyFactory,
    RolloutResult,
    RolloutStats,
    build_policy,
    episode_ids,
    is_policy,
    plan_tasks,
    progress_bar,
    record_finished,
    sampling_record,
)
from .ray_actors import short_error, worker_env_factory
from .ray_backend import RolloutError
from .runner import GcClock, StepPlace, off_running_loop, play, steps_wait
from .step_pool import Deadlines, StepThreads

__all__ = ["ProcessBackend"]

_PRELOAD = ["tokengym.recorder.drivers.process_backend", "transformers.models.auto.tokenization_auto"]
"""What the fork server imports once, so that each worker starts without importing it again."""
_HEADER = struct.Struct("!i")
"""``multiprocessing.Connection``'s frame header: the same frames are read and written with its ``send``/``recv``."""
CLOSE_S = 30.0
"""How long the end of a run waits for a worker to close its envs before it is killed."""


@dataclass
class ProcessBackend:
    """Run a rollout's env steps in local worker processes; the policy stays in this process.

    Args:
        num_workers: worker processes; default: one per CPU but the driver's, at least one, at
            most one per episode in flight.
        slots_per_worker: env copies per worker; default: the concurrency spread over the workers.
        max_reruns: how often an episode lost with a dead worker is started again (0: count it
            as failed).
        max_worker_replacements: dead workers replaced by fresh ones over a run; default: as
            many as there are workers.
        start_timeout_s: how long the workers may take to start (imports, the first env built).

    ``env`` factories and ``env_kwargs`` go to the workers by pickle: pass an env id, a
    module-level function or a ``functools.partial``, not a lambda. A script that runs this must
    do so under ``if __name__ == "__main__":`` (each worker imports the script's module).
    After a run, ``worker_pids`` names its workers and ``worker_cpu_s`` is the CPU time they spent
    from their start to their end (the driver's own is this process's).
    """

    num_workers: int | None = None
    slots_per_worker: int | None = None
    max_reruns: int = 1
    max_worker_replacements: int | None = None
    start_timeout_s: float = 300.0
    worker_pids: list[int] = field(default_factory=list, init=False)
    worker_cpu_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        for name in ("num_workers", "slots_per_worker"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_reruns < 0:
            raise ValueError(f"max_reruns must be >= 0, got {self.max_reruns}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")

    def run(
        self,
        make_env: Callable[[], gym.Env] | str,
        policy: Policy | PolicyFactory,
        *,
        episodes: int | Sequence[int],
        concurrency: int = 8,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        env_kwargs: dict[str, Any] | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
        progress: bool = True,
        group_size: int = 1,
        tasks: Sequence[dict[str, Any]] | None = None,
        deadlines: Deadlines | None = None,
    ) -> RolloutResult:
        """As :func:`~tokengym.recorder.rollout`: the same episodes, seeds, groups, deadlines and result."""
        if concurrency < 1:
            raise ValueError(f"need concurrency >= 1, got {concurrency}")
        ids = episode_ids(episodes)
        base = sampling or SamplingParams()
        planned = plan_tasks(ids, seed, base, group_size=group_size, tasks=tasks)
        spec = (make_env, env_kwargs)
        try:
            pickle.dumps(spec)
        except Exception as err:
            raise TypeError(
                f"the env factory cannot be sent to a worker process ({short_error(err)}); pass an env id, a "
                "module-level function or a functools.partial of one (not a lambda or a local function)"
            ) from None
        self.worker_pids, self.worker_cpu_s = [], 0.0
        if not ids:
            return RolloutResult([], RolloutStats())
        owned = not is_policy(policy)
        policy = build_policy(policy)
        try:
            record = sampling_record(base, getattr(policy, "name", type(policy).__name__),
                                     getattr(policy, "logprob_kind", "none"), seed)
            config = (base, record, Deadlines() if deadlines is None else deadlines)
            n = min(concurrency, len(ids))
            workers = max(1, min(self.num_workers or (os.cpu_count() or 2) - 1, n))
            slots = self.slots_per_worker or math.ceil(n / workers)
            run = _Run(self, policy, spec, config, planned, workers, slots, min(n, workers * slots), on_episode, progress)
            return run.drive()
        finally:
            if owned and hasattr(policy, "close"):
                policy.close()


class _Channel:
    """One end of a worker's socket on an event loop: whole pickled messages, in and out, never blocking.

    Frames are ``multiprocessing.Connection``'s (a 4-byte big-endian length, then the pickle), so the
    other end may use ``conn.send``/``conn.recv`` before its loop runs.
    """

    def __init__(self, conn: Any, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None],
                 on_closed: Callable[[], None]) -> None:
        self.conn, self.loop = conn, loop
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self.on_message, self.on_closed = on_message, on_closed
        self.open = True
        self._in = bytearray()
        self._out = bytearray()
        loop.add_reader(self.fd, self._readable)

    def send(self, message: Any) -> None:
        """Queue ``message`` (pickled now: an unpicklable one raises here, in the caller)."""
        self.send_pickled(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_pickled(self, data: bytes) -> None:
        if not self.open:
            return
        frame = _HEADER.pack(len(data)) + data
        if self._out:
            self._out += frame
            return
        try:
            sent = os.write(self.fd, frame)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close()
            return
        if sent < len(frame):
            self._out += memoryview(frame)[sent:]
            self.loop.add_writer(self.fd, self._writable)

    def _writable(self) -> None:
        try:
            sent = os.write(self.fd, self._out)
        except BlockingIOError:
            return
        except OSError:
            self._close()
            return
        del self._out[:sent]
        if not self._out:
            self.loop.remove_writer(self.fd)

    def _readable(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close()
            return
        buf = self._in
        buf += chunk
        at = 0
        while len(buf) - at >= 4:
            (size,) = _HEADER.unpack_from(buf, at)
            if len(buf) - at - 4 < size:
                break
            message = pickle.loads(bytes(buf[at + 4:at + 4 + size]))
            at += 4 + size
            if not self.open:
                return
            self.on_message(message)
        del buf[:at]

    def _close(self) -> None:
        if not self.open:
            return
        self.open = False
        self.loop.remove_reader(self.fd)
        if self._out:
            self.loop.remove_writer(self.fd)
        self._out.clear()
        self.on_closed()

    def close(self) -> None:
        """Stop reading and writing (the connection itself is closed by its owner)."""
        if self.open:
            self.open = False
            self.loop.remove_reader(self.fd)
            if self._out:
                self.loop.remove_writer(self.fd)


# ----------------------------------------------------------------------------------------- worker
def _worker_main(conn: Any, spec: tuple[Any, Any], slots: int, config: tuple[SamplingParams, dict[str, Any], Deadlines]) -> None:
    """A worker process: build one env (a failure is said to the driver), then serve episodes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the driver decides
    cpu0 = time.process_time()
    _base, record, _deadlines = config
    try:
        factory = worker_env_factory(*spec)

        def build() -> RecordEpisodes:
            return RecordEpisodes(factory(), keep=False, sampling=record)

        first = EpisodeSlot(build())
    except BaseException as err:  # noqa: BLE001 -- said to the driver, which ends the run with it
        conn.send(("start_failed", short_error(err, 2000)))
        return
    conn.send(("ready", os.getpid()))
    asyncio.run(_serve(conn, build, first, slots, config, cpu0))


async def _serve(conn: Any, build: Callable[[], RecordEpisodes], first: EpisodeSlot, slots: int,
                 config: tuple[SamplingParams, dict[str, Any], Deadlines], cpu0: float) -> None:
    """Play the episodes the driver sends, each turn's generation asked of the driver, until it says stop."""
    from tokengym.envs import abandoned_threads

    base, _record, deadlines = config
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    pending: dict[int, asyncio.Future] = {}
    free = [first, *(EpisodeSlot.lazy(build) for _ in range(slots - 1))]
    every = list(free)
    playing: set[asyncio.Task] = set()
    threads = StepThreads(slots)
    gc_clock = GcClock()
    place = StepPlace(threads, gc_clock, inline=not steps_wait(first.env))
    requests = iter(range(1 << 62))

    async def generate(context: list[int], params: SamplingParams) -> Generation:
        rid = next(requests)
        reply = pending[rid] = loop.create_future()
        channel.send(("generate", rid, context, params))
        try:
            return await reply
        finally:
            pending.pop(rid, None)

    async def one(slot: EpisodeSlot, task: EpisodeTask) -> None:
        outcome = await play(slot, task, base, generate, place, deadlines, place.begin)
        info = {"stuck": slot.retired, "tool_threads": abandoned_threads()}
        if slot.retired:  # its env is still inside the hung step: a fresh one takes the slot, and a thread of its own
            slot = EpisodeSlot.lazy(build)
            every.append(slot)
            threads.grow()
        free.append(slot)
        try:
            data = pickle.dumps(("done", task.episode, outcome, info), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 -- the episode fails by name, the run goes on
            failed = EpisodeError(task.episode, None, "UnpicklableTrajectory",
                                  f"the episode's trajectory cannot be sent to the driver: {short_error(err)}")
            data = pickle.dumps(("done", task.episode, failed, info), protocol=pickle.HIGHEST_PROTOCOL)
        channel.send_pickled(data)

    def on_message(message: tuple) -> None:
        kind = message[0]
        if kind == "reply":
            reply = pending.get(message[1])
            if reply is not None and not reply.done():
                if message[3] is None:
                    reply.set_result(message[2])
                else:
                    reply.set_exception(message[3])
        elif kind == "episode":
            task = loop.create_task(one(free.pop(), message[1]))
            playing.add(task)
            task.add_done_callback(playing.discard)
        elif kind == "stop":
            stopped.set()

    channel = _Channel(conn, loop, on_message, stopped.set)
    gc_clock.start()
    try:
        await stopped.wait()
        for task in playing:
            task.cancel()
        await asyncio.gather(*playing, return_exceptions=True)
    finally:
        gc_clock.stop()
        for slot in sorted(every, key=lambda s: s.retired):  # a hung step's env last
            if slot.env is not None:
                try:
                    slot.env.close()
                except Exception:  # noqa: BLE001 -- closing the others matters more
                    pass
        threads.shutdown(wait=False, cancel_futures=True)
        if channel.open:
            channel.close()
            os.set_blocking(channel.fd, True)
            try:
                conn.send(("closed", time.process_time() - cpu0, abandoned_threads()))
            except OSError:
                pass


# ----------------------------------------------------------------------------------------- driver
class _Worker:
    """The driver's view of one worker process."""

    def __init__(self, index: int, process: Any, conn: Any) -> None:
        self.index, self.process, self.conn = index, process, conn
        self.channel: _Channel | None = None
        self.ready = False
        self.free = 0
        self.inflight: dict[int, EpisodeTask] = {}
        self.closed: tuple[float, int] | None = None
        self.said_why = False
        """It sent why it could not start (``start_failed``) before it exited."""
        self.started = time.perf_counter()


class _Run:
    """The driver loop of one :meth:`ProcessBackend.run`."""

    def __init__(self, backend: ProcessBackend, policy: Policy, spec: tuple[Any, Any], config: Any,
                 planned: list[EpisodeTask], workers: int, slots: int, capacity: int,
                 on_episode: Callable[[Trajectory], None] | None, progress: bool) -> None:
        self.b, self.policy, self.spec, self.config = backend, policy, spec, config
        self.n_workers, self.slots, self.capacity = workers, slots, capacity
        self.on_episode = on_episode
        self.queue: deque[EpisodeTask] = deque(planned)
        self.attempts: dict[int, int] = {}
        self.replacements = workers if backend.max_worker_replacements is None else backend.max_worker_replacements
        self.workers: list[_Worker] = []
        self.stats = RolloutStats(requested=len(planned))
        self.done: list[Trajectory] = []
        self.bar = progress_bar(len(planned), progress)
        self.tool_threads: dict[int, int] = {}
        self.fatal: BaseException | None = None
        self.interrupted = False
        self.ending = False
        self.bar_on = progress
        self.loop = asyncio.new_event_loop()
        self.wake = asyncio.Event()
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(_PRELOAD)

    # -------------------------------------------------------------------- run
    def drive(self) -> RolloutResult:
        """Run it here, or in a thread of its own where this thread already runs a loop (a notebook)."""
        return off_running_loop(self._drive, self._on_signal)

    def _drive(self) -> RolloutResult:
        start = self.start = time.perf_counter()
        self.batcher = RequestBatcher(self.policy, native=True)
        policy = self.policy
        # A policy sampling here reports each decode step: the bar moves before the first turn is back.
        unlisten = policy.add_token_listener(self.bar.live) if self.bar_on and isinstance(policy, StreamsTokens) else None
        try:
            with stop_on_signals(self._on_signal):
                self.loop.run_until_complete(self._main())
        finally:
            self.ending = True
            if unlisten is not None:
                unlisten()
            self.stats.engine_s += self.batcher.busy_now()
            self.batcher.close()
            self._end_workers()
            self.loop.close()
            self.bar.close()
            self.stats.wall_s = time.perf_counter() - start
            self.stats.abandoned_tool_threads = sum(self.tool_threads.values())
            self.stats.interrupted = self.interrupted
        self.done.sort(key=lambda t: (t.metadata["episode"], t.metadata.get("sequence", 0)))
        result = RolloutResult(self.done, self.stats, self.interrupted)
        if isinstance(self.fatal, _Abort):
            raise RolloutError(f"{self.fatal}; {len(self.done)} finished episodes were kept", result)
        if self.fatal is not None:
            raise self.fatal
        return result

    def _on_signal(self, *_: Any) -> None:
        self.interrupted = True
        self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.wake.set()

    async def _main(self) -> None:
        try:
            for _ in range(self.n_workers):
                self._spawn()
            await self._serve()
        except _Abort as err:
            self.fatal = err

    async def _serve(self) -> None:
        while not (self.interrupted or self.fatal):
            self._launch()
            if not self.queue and not any(w.inflight for w in self.workers):
                return
            if not any(w.process is not None for w in self.workers):
                raise _Abort(f"no env worker is left ({len(self.queue)} episodes not run)")
            starting = [w for w in self.workers if w.process is not None and not w.ready]
            timeout = None
            if starting and not any(w.ready for w in self.workers):
                timeout = max(0.0, min(w.started for w in starting) + self.b.start_timeout_s - time.perf_counter())
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)
            except TimeoutError:
                if any(w.process is not None and not w.ready for w in self.workers) and not any(w.ready for w in self.workers):
                    raise _Abort(f"no env worker started within {self.b.start_timeout_s:.0f} s") from None

    # ---------------------------------------------------------------- workers
    def _spawn(self) -> None:
        parent, child = self.context.Pipe(duplex=True)
        process = self.context.Process(
            target=_worker_main, args=(child, self.spec, self.slots, self.config), daemon=True,
            name=f"tokengym-env-worker-{len(self.workers)}",
        )
        process.start()
        child.close()
        worker = _Worker(len(self.workers), process, parent)
        self.workers.append(worker)
        self.b.worker_pids.append(process.pid)
        worker.channel = _Channel(parent, self.loop, lambda m: self._on_message(worker, m), lambda: self._on_exit(worker))

    def _on_message(self, worker: _Worker, message: tuple) -> None:
        try:
            kind = message[0]
            if kind == "generate":  # nothing for the scheduling loop to do: it is not woken
                self.loop.create_task(self._generate(worker, message[1], message[2], message[3]))
                return
            if kind == "done":
                self._done(worker, message[1], message[2], message[3])
            elif kind == "ready":
                worker.ready, worker.free = True, self.slots
                if not self.stats.startup_s:
                    self.stats.startup_s = time.perf_counter() - self.start
            elif kind == "start_failed":
                worker.said_why = True
                if not any(w.ready for w in self.workers):
                    raise _Abort(f"an env worker could not build its env: {message[1]}")
                self.stats.errors.append(EpisodeError(None, None, "WorkerStartFailed",
                                                      f"a new env worker failed to start: {message[1]}", failed=False))
            elif kind == "closed":
                worker.closed = (message[1], message[2])
        except BaseException as err:  # on_episode raised, or the run cannot go on: the run ends with it
            if self.fatal is None:
                self.fatal = err
        self._wake()

    async def _generate(self, worker: _Worker, rid: int, context: list[int], params: SamplingParams) -> None:
        try:
            gen = await self.batcher.generate(context, params)
        except PolicyInterrupted:
            self.interrupted = True
            self._wake()
            return
        except Exception as err:  # the policy refused this request: that episode fails by name
            if worker.channel is not None:
                worker.channel.send(("reply", rid, None, _sendable(err)))
            return
        self.bar.turn_done(len(gen.token_ids))
        if worker.channel is not None:
            worker.channel.send(("reply", rid, gen, None))

    def _done(self, worker: _Worker, episode: int, outcome: Any, info: dict[str, Any]) -> None:
        if self.interrupted or self.fatal is not None or self.ending:  # after the stop: dropped whole
            return
        worker.inflight.pop(episode, None)
        worker.free += 1
        self.tool_threads[worker.index] = info["tool_threads"]
        if info["stuck"]:
            self.stats.stuck_envs += 1
        if isinstance(outcome, EpisodeError):
            self._failed(outcome)
        else:
            record_finished(self.stats, outcome, self.done, self.on_episode, self.bar)

    def _launch(self) -> None:
        """Hand queued episodes to the workers with free slots (the freest first)."""
        inflight = sum(len(w.inflight) for w in self.workers)
        while self.queue and inflight < self.capacity:
            ready = [w for w in self.workers if w.ready and w.process is not None and w.free > 0]
            if not ready:
                return
            worker = max(ready, key=lambda w: w.free)
            task = self.queue.popleft()
            worker.free -= 1
            worker.inflight[task.episode] = task
            assert worker.channel is not None
            worker.channel.send(("episode", task))
            inflight += 1

    def _on_exit(self, worker: _Worker) -> None:
        """``worker``'s socket closed: at the end of the run, expected; otherwise the worker died."""
        process, worker.process = worker.process, None
        if process is None:
            return
        process.join(timeout=5)
        if self.ending or self.interrupted:  # the end of the run, or a stop: nothing is lost that counts
            return
        code = process.exitcode
        if not worker.ready:
            if self.fatal is None and not any(w.ready for w in self.workers):
                hint = (" A script that runs backend='processes' must call it under `if __name__ == \"__main__\":` "
                        "(each worker imports the script's module)") if code == 1 else ""
                self.fatal = _Abort(f"an env worker exited before it started (exit code {code}).{hint}")
            elif not worker.said_why:
                self.stats.errors.append(EpisodeError(
                    None, None, "WorkerStartFailed", f"a new env worker exited before it started (exit code {code})",
                    failed=False,
                ))
            self._replace()
            self._wake()
            return
        stats = self.stats
        stats.errors.append(EpisodeError(None, None, "WorkerDied", f"env worker {worker.index} (pid {process.pid}) "
                                         f"died (exit code {code})", failed=False))
        for episode, task in sorted(worker.inflight.items()):
            stats.lost.append(episode)
            self.attempts[episode] = self.attempts.get(episode, 0) + 1
            if self.attempts[episode] <= self.b.max_reruns:
                stats.rerun += 1
                stats.errors.append(EpisodeError(episode, None, "WorkerLost", f"episode {episode} was lost with env "
                                                 f"worker {worker.index}: started again", failed=False))
                self.queue.appendleft(task)
            else:
                self._failed(EpisodeError(episode, None, "WorkerLost", f"episode {episode} was lost with env worker "
                                          f"{worker.index}: counted as failed"))
        worker.inflight.clear()
        worker.free = 0
        self._replace()
        self._wake()

    def _replace(self) -> None:
        if self.replacements > 0 and not self.interrupted and self.fatal is None:
            self.replacements -= 1
            self._spawn()

    def _failed(self, error: EpisodeError) -> None:
        self.stats.failed += 1
        self.stats.errors.append(error)
        self.bar.update(1)

    def _end_workers(self) -> None:
        """Ask every live worker to close its envs and say what its CPU cost; kill those that do not."""
        live = [w for w in self.workers if w.process is not None and w.channel is not None and w.channel.open]
        for w in live:
            w.channel.send(("stop",))
        deadline = time.perf_counter() + CLOSE_S
        while any(w.closed is None and w.process is not None for w in live) and time.perf_counter() < deadline:
            self.loop.run_until_complete(asyncio.sleep(0.01))
        for w in self.workers:
            if w.channel is not None:
                w.channel.close()
            if w.process is not None:
                w.process.join(timeout=max(0.0, deadline - time.perf_counter()))
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(timeout=5)
            w.conn.close()
            if w.closed is not None:
                self.b.worker_cpu_s += w.closed[0]
                self.tool_threads[w.index] = w.closed[1]


class _Abort(Exception):
    """Ends the driver loop; becomes a :class:`RolloutError` with the result so far."""


def _sendable(err: Exception) -> Exception:
    """``err`` if it pickles (the episode's error names its own type), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(short_error(err))
