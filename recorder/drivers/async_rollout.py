"""Asynchronous RL: episodes stream to the trainer as they end while it updates the weights.

A synchronous loop generates a batch, trains on it, and generates the next with the new weights:
the engine idles while the trainer trains, and the trainer while the slowest episode finishes.
:class:`AsyncRollout` keeps episodes running in a thread of their own (the one episode runner,
:func:`~tokengym.recorder.drivers.runner.play`, as every driver) and hands finished ones to the
trainer in batches; the trainer puts new weights in whenever it has them
(:meth:`AsyncRollout.update_weights`), and the policy decides, by the run's ``on_update``, what the
turns in flight do (:mod:`tokengym.policies.versions`): every token records the version that
sampled it.

Staleness is bounded the way AReaL bounds it: with batches of ``B`` episodes and
``max_staleness=K``, episode ``n`` (in start order) starts only once ``n < (K + 1 + u) * B``, where
``u`` counts the updates made so far. So an episode consumed in start order was started at most
``K`` updates before the batch that takes it. Episodes end out of order, though: one that ends late
is taken by a later batch, so each taken trajectory says how many updates it missed
(``metadata["staleness"]``) and :attr:`AsyncRolloutStats.staleness` counts them all.

Nothing is lost or taken twice: every episode that ends is in exactly one batch (or, failed, in
``stats.errors``); closing the run drops only the episodes still in flight, whole, and counts them.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from tokengym.policies import Generation, Policy, SamplingParams
from tokengym.policies.batching import RequestBatcher
from tokengym.policies.versions import OnUpdate, check_on_update, version_of

from .episodes import (
    EpisodeError, EpisodeSlot, EpisodeTask, PolicyFactory, RolloutStats, build_policy, env_factory, is_policy,
    plan_tasks, record_finished, sampling_record,
)
from .runner import Outcome, drive
from .step_pool import Deadlines
from ..trajectory import Trajectory
from ..wrapper import RecordEpisodes

__all__ = ["AsyncRollout", "AsyncRolloutStats", "RunClosed", "StalenessStall"]


class RunClosed(RuntimeError):
    """The run was closed: it has no more episodes to hand out."""


class StalenessStall(RuntimeError):
    """:meth:`AsyncRollout.next_batch` would wait forever: every episode the staleness bound lets
    start has ended and been taken, and no update came to let more start."""


@dataclass
class AsyncRolloutStats(RolloutStats):
    """:class:`RolloutStats`, and what asynchrony adds."""

    updates: int = 0
    """Weight updates put in during the run."""
    staleness: collections.Counter = field(default_factory=collections.Counter)
    """How many taken episodes missed how many updates (between their start and the batch that took them)."""
    waits: int = 0
    """Times an episode waited to start because the staleness bound held it back."""
    dropped: int = 0
    """Episodes in flight when the run was closed without waiting: dropped whole, never handed out."""
    batches: int = 0
    """Batches handed to the trainer."""

    def as_dict(self) -> dict[str, Any]:
        return {
            **super().as_dict(), "updates": self.updates, "staleness": dict(self.staleness), "waits": self.waits,
            "dropped": self.dropped, "batches": self.batches,
        }


class AsyncRollout:
    """Runs episodes in the background and hands them to a trainer in batches as they end.

    Args:
        make_env: a factory of tokengym envs, or a registered id (made with ``env_kwargs``).
        policy: a policy with versions (``update_weights`` and ``version``: HFPolicy, VLLMPolicy,
            AsyncVLLMPolicy, ScriptedPolicy), or a zero-argument factory of one.
        batch_size: episodes per batch (:meth:`next_batch`); a multiple of ``group_size``. A
            batch holds whole GRPO groups: a group is handed out once all its episodes ended.
        max_staleness: K; no episode starts more than K updates ahead of the batches taken (see
            the module's docstring). 0 is a synchronous run's bound: one batch of episodes at a
            time, each started on the newest weights.
        on_update: what the policy does to turns in flight at an update (``"continue"``,
            ``"restart"``, ``"finish"``); None: the policy's own default.
        episodes: how many episodes in all (None: until :meth:`close`).
        concurrency, sampling, seed, env_kwargs, group_size, tasks, deadlines, on_episode: as for
            :func:`~tokengym.recorder.rollout` (``on_episode`` sees each episode as it ends, before
            any batch takes it: a store's ``write`` makes it durable then).

    Use it as a context manager (or call :meth:`close`): the background thread stops, the envs
    close, and a policy built here from a factory is closed.
    """

    def __init__(
        self,
        make_env: Callable[[], gym.Env] | str,
        policy: Policy | PolicyFactory,
        *,
        batch_size: int,
        max_staleness: int = 1,
        on_update: OnUpdate | None = None,
        episodes: int | None = None,
        concurrency: int = 8,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        env_kwargs: dict[str, Any] | None = None,
        group_size: int = 1,
        tasks: Sequence[dict[str, Any]] | None = None,
        deadlines: Deadlines | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
        progress: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"need batch_size >= 1, got {batch_size}")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness is a count of weight updates (an int >= 0), got {max_staleness!r}")
        if group_size < 1 or batch_size % group_size:
            raise ValueError(f"batch_size={batch_size} must be a multiple of group_size={group_size}: a batch holds whole groups")
        if episodes is not None and (episodes < 0 or episodes % group_size):
            raise ValueError(f"episodes={episodes} must be >= 0 and a multiple of group_size={group_size}")
        if concurrency < 1:
            raise ValueError(f"need concurrency >= 1, got {concurrency}")
        self.on_update = None if on_update is None else check_on_update(on_update)
        self._owned = not is_policy(policy)
        self.policy = build_policy(policy)
        if not (callable(getattr(self.policy, "update_weights", None)) and version_of(self.policy) is not None):
            if self._owned and hasattr(self.policy, "close"):
                self.policy.close()
            raise TypeError(
                f"{type(self.policy).__name__} has no weight versions (update_weights and version): an asynchronous "
                "run needs one (HFPolicy, VLLMPolicy, AsyncVLLMPolicy, ScriptedPolicy); for a fixed policy use rollout()"
            )
        self.batch_size, self.max_staleness, self.group_size = batch_size, max_staleness, group_size
        self.sampling = sampling or SamplingParams()
        self.stats = AsyncRolloutStats(requested=episodes or 0)
        self._episodes = episodes
        self._seed, self._tasks = seed, None if tasks is None else list(tasks)
        self._cv = threading.Condition()
        self._groups: dict[Any, list[list[Trajectory] | None]] = {}  # group -> its ended episodes' rows
        self._ready: collections.deque[tuple[int, list[list[Trajectory]]]] = collections.deque()  # whole groups
        self._started = 0
        self._start_update: dict[int, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop: Callable[[], None] | None = None
        self._closing = False
        self._ended = False
        self._error: BaseException | None = None
        self._done: list[Trajectory] = []
        self._on_episode = on_episode

        make = env_factory(make_env, env_kwargs)
        record = sampling_record(self.sampling, getattr(self.policy, "name", type(self.policy).__name__),
                                 getattr(self.policy, "logprob_kind", "none"), seed)

        def build() -> RecordEpisodes:
            return RecordEpisodes(make(), keep=False, sampling=record)

        try:
            self._slots = [EpisodeSlot(build()), *(EpisodeSlot.lazy(build) for _ in range(concurrency - 1))]
        except BaseException:
            if self._owned and hasattr(self.policy, "close"):
                self.policy.close()
            raise
        self._bar_enabled = progress
        self._started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="tokengym-async-rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's side
    def next_batch(self, size: int | None = None, *, timeout: float | None = None) -> list[Trajectory]:
        """The next ``size`` (default ``batch_size``) ended episodes' rows, whole groups, in the order
        they ended; blocks until they are there. At the end of a run with ``episodes=`` (or after
        :meth:`close`), what is left, then ``[]``. Each row's ``metadata["staleness"]`` says how many
        updates were made between its episode's start and now."""
        want = self.batch_size if size is None else int(size)
        if want < 1 or want % self.group_size:
            raise ValueError(f"size={want} must be a positive multiple of group_size={self.group_size}")
        deadline = None if timeout is None else time.monotonic() + timeout
        taken: list[list[list[Trajectory]]] = []
        with self._cv:
            while sum(len(g) for g in taken) < want:
                if self._ready:
                    taken.append(self._ready.popleft()[1])
                    continue
                if self._error is not None:
                    raise self._error
                if self._ended:
                    break
                self._check_stall(want - sum(len(g) for g in taken))
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"no batch of {want} within {timeout:g} s: {sum(len(g) for g in taken)} episodes ended, "
                        f"{self._started} started ({self.stats.failed} failed, {self.stats.waits} waits on the staleness bound)"
                    )
                self._cv.wait(left)
            updates = self.stats.updates
            rows: list[Trajectory] = []
            for group in taken:
                for episode in group:
                    behind = updates - self._start_update.pop(episode[0].metadata["episode"], updates)
                    self.stats.staleness[behind] += 1
                    for t in episode:
                        t.metadata["staleness"] = behind
                        rows.append(t)
            if taken:
                self.stats.batches += 1
        return rows

    def _check_stall(self, missing: int) -> None:
        """Raise :class:`StalenessStall` when nothing in flight can end and nothing may start."""
        ended = self.stats.episodes + self.stats.failed + self.stats.dropped
        bound = (self.max_staleness + 1 + self.stats.updates) * self.batch_size
        more = self._episodes is None or self._started < self._episodes
        if self._started == ended and self._started >= bound and more and not self._groups:
            raise StalenessStall(
                f"waiting for {missing} more episodes, but all {self._started} that max_staleness="
                f"{self.max_staleness} lets start ({self.max_staleness + 1} batches of {self.batch_size} + one per "
                f"update, {self.stats.updates} updates so far) have ended and been taken: call update_weights "
                "between batches (a version bump with the same weights is enough), or raise max_staleness"
            )

    def batches(self) -> Iterator[list[Trajectory]]:
        """:meth:`next_batch` until the run has nothing more to hand out."""
        while batch := self.next_batch():
            yield batch

    async def anext_batch(self, size: int | None = None, *, timeout: float | None = None) -> list[Trajectory]:
        """:meth:`next_batch` for a trainer on an event loop (it waits in a worker thread)."""
        return await asyncio.to_thread(self.next_batch, size, timeout=timeout)

    def update_weights(self, weights: Any, version: int | None = None, *, on_update: OnUpdate | None = None) -> int:
        """Put new weights in the policy (its ``update_weights``, with the run's ``on_update`` unless
        given here) while episodes run; returns the version now in place. A refused update raises
        and changes nothing; the run goes on either way. Episodes held back by the staleness bound
        may start once it returns."""
        mode = on_update if on_update is not None else self.on_update
        kwargs = {} if mode is None else {"on_update": check_on_update(mode)}
        new = self.policy.update_weights(weights, version, **kwargs)  # type: ignore[attr-defined]
        with self._cv:
            self.stats.updates += 1
        self._nudge()
        return int(new)

    @property
    def version(self) -> int:
        """The weight version the policy samples with now."""
        v = version_of(self.policy)
        assert v is not None
        return v

    def close(self, *, wait: bool = False, timeout: float | None = None) -> None:
        """Stop starting episodes. ``wait``: let those in flight end (they stay for
        :meth:`next_batch`); otherwise drop them whole (``stats.dropped``). Then the envs close, and
        the policy if it was built here. Ended episodes not yet taken stay for :meth:`next_batch`."""
        with self._cv:
            self._closing = True
        self._nudge()
        if not wait and self._stop is not None:
            self._stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the run's episodes did not end within {timeout:g} s; close(wait=False) drops them")
        self._close_envs()

    def __enter__(self) -> AsyncRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the run's side
    def _nudge(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _task_stream(self) -> Iterator[EpisodeTask]:
        i = 0
        while self._episodes is None or i < self._episodes:
            ids = list(range(i, i + self.group_size))
            yield from plan_tasks(ids, self._seed, self.sampling, group_size=self.group_size, tasks=self._tasks)
            i += self.group_size

    async def _admit(self, task: EpisodeTask) -> bool:
        if self._wake is None:
            self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        waited = False
        while True:
            with self._cv:
                if self._closing:
                    return False
                if self._started < (self.max_staleness + 1 + self.stats.updates) * self.batch_size:
                    self._started += 1
                    self._start_update[task.episode] = self.stats.updates
                    self.stats.requested = max(self.stats.requested, self._started)
                    break
            if not waited:
                waited = True
                self.stats.waits += 1
            self._wake.clear()
            await self._wake.wait()
        task.metadata["start_version"] = version_of(self.policy)
        return True

    def _ended_episode(self, task: EpisodeTask, rows: list[Trajectory] | None) -> None:
        group = task.metadata.get("group", task.episode)
        with self._cv:
            members = self._groups.setdefault(group, [])
            members.append(rows)
            if len(members) == (self.group_size if "group" in task.metadata else 1):
                del self._groups[group]
                kept = [m for m in members if m]
                if kept:
                    self._ready.append((group, kept))
                self._cv.notify_all()

    def _run(self) -> None:
        batcher = RequestBatcher(self.policy, native=True)

        async def generate(context: list[int], params: SamplingParams) -> Generation:
            return await batcher.generate(context, params)

        class _Bar:  # record_finished's progress bar: the trainer's batches are the progress here
            def update(self, n: int = 1) -> None: ...
            def finished(self, stats: Any) -> None: ...

        def on_outcome(task: EpisodeTask, outcome: Outcome) -> None:
            with self._cv:  # one hold: next_batch never sees an episode counted as ended but not handed on
                if isinstance(outcome, EpisodeError):
                    self.stats.failed += 1
                    self.stats.errors.append(outcome)
                    self._start_update.pop(task.episode, None)
                    self._ended_episode(task, None)
                    return
                record_finished(self.stats, outcome, self._done, self._on_episode, _Bar())
                self._done.clear()  # the batches hand them out; nothing is kept twice
                self._ended_episode(task, outcome)

        def started(stop: Callable[[], None]) -> None:
            self._stop = stop

        try:
            stopped = drive(self._slots, self._task_stream(), self.sampling, generate, on_outcome,
                            admit=self._admit, on_start=started)
            with self._cv:
                if stopped:
                    self.stats.interrupted = True
                    self.stats.dropped = self._started - self.stats.episodes - self.stats.failed
        except BaseException as err:  # on_episode raised, or the engine is gone: the trainer hears it
            with self._cv:
                self._error = err
        finally:
            self.stats.engine_s += batcher.busy_now()
            batcher.close()
            self.stats.wall_s = time.perf_counter() - self._started_at
            with self._cv:
                # Groups cut short by the close: their ended episodes are still handed out (never lost).
                for group, members in self._groups.items():
                    kept = [m for m in members if m]
                    if kept:
                        self._ready.append((group, kept))
                self._groups.clear()
                self._ended = True
                self._cv.notify_all()

    def _close_envs(self) -> None:
        if getattr(self, "_envs_closed", False):
            return
        self._envs_closed = True
        self.stats.stuck_envs = sum(s.retired for s in self._slots)
        for s in sorted(self._slots, key=lambda s: s.retired):
            if s.env is not None:
                try:
                    s.env.close()
                except Exception:
                    if not s.retired:
                        raise
        if self._owned and hasattr(self.policy, "close"):
            self.policy.close()
