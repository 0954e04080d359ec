"""The Ray backend's actors: an env worker plays whole episodes; a policy engine serves requests.

Separate from the driver (:mod:`tokengym.recorder.drivers.ray_backend`) because each runs in
its own actor process, where it only knows its slots or its policy: the worker plays episodes
with the shared runner (:func:`~tokengym.recorder.drivers.runner.play`) and returns whole
trajectories; the engine batches the requests that arrive while it is busy.

A worker holds its episodes to the run's :class:`~tokengym.recorder.drivers.step_pool.Deadlines`
as the local driver does: resets and steps run on daemon threads, a policy turn is awaited, not
blocked on, so a hung step or a request never answered fails its episode by name and the actor
thread comes back. The env copy a hung step still holds is set aside and a fresh copy takes its
slot (the driver counts it: ``stuck_envs``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from tokengym.policies import Generation, Policy, SamplingParams
from tokengym.policies.batching import RequestBatcher

from ..wrapper import RecordEpisodes
from .episodes import EpisodeError, EpisodeSlot, EpisodeTask, PolicyFactory, build_policy, env_factory
from .runner import EngineLost, play
from .step_pool import Deadlines, StepThreads

__all__ = ["EnvWorker", "PolicyEngine", "root_cause", "short_error", "worker_env_factory"]

log = logging.getLogger("tokengym.ray")


def root_cause(err: BaseException) -> BaseException:
    """The user-code exception inside a Ray task error."""
    return getattr(err, "cause", None) or err


def short_error(err: BaseException, limit: int = 300) -> str:
    """One line for a log or a stats entry: the exception's type and message, cut at ``limit``."""
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def worker_env_factory(make_env: Callable[[], gym.Env] | str, env_kwargs: dict[str, Any] | None) -> Callable[[], gym.Env]:
    """The env factory of a worker process (a Ray env worker, a process-pool worker): an env id
    resolved there as in the caller's process (``module:id``, declared envs), and a tokenizer named
    by a string loaded once for all of the worker's env copies (as the CLI does locally)."""
    from tokengym.envs import load_tokenizer
    from tokengym.envs.registry import EnvRef

    if isinstance(make_env, str):
        make_env, env_kwargs = EnvRef(make_env, (), dict(env_kwargs or {})), None
    if isinstance(make_env, EnvRef) and isinstance(make_env.kwargs.get("tokenizer"), (str, os.PathLike)):
        make_env = make_env.with_kwargs(tokenizer=load_tokenizer(make_env.kwargs["tokenizer"]))
    return env_factory(make_env, env_kwargs)


class EnvWorker:
    """``slots`` env copies in one process; runs whole episodes, one per slot at a time.

    Made a Ray actor by :class:`RayBackend` (threaded: ``max_concurrency=slots + 1``, so a
    slow tool in one slot does not hold up the others, and control calls always get a thread).
    """

    def __init__(self, make_env: Callable[[], gym.Env] | str, env_kwargs: dict[str, Any] | None, slots: int) -> None:
        self._factory = worker_env_factory(make_env, env_kwargs)
        self._envs = [RecordEpisodes(self._factory(), keep=False) for _ in range(slots)]
        self._stuck: list[RecordEpisodes] = []  # copies a hung step or reset still holds
        self._lock = threading.Lock()
        self._steps = StepThreads(slots)
        self._free: queue.SimpleQueue[RecordEpisodes] = queue.SimpleQueue()
        for env in self._envs:
            self._free.put(env)

    def node_id(self) -> str:
        """The Ray node this worker runs on (episodes per node are reported)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def run_episode(
        self, task: EpisodeTask, engine: Any, config: tuple[SamplingParams, int, dict[str, Any], Deadlines]
    ) -> dict[str, Any]:
        """One whole episode against ``engine``: ``{"episode", "trajectories"}`` (its rows) or ``{"episode", "error"}``.

        ``config`` is the run's ``(base sampling, seed, sampling record, deadlines)``. The turn loop
        is the local driver's (:func:`tokengym.recorder.drivers.runner.play`), on this thread's own
        event loop, with the env's reset and steps on this worker's step threads.
        """
        from tokengym.envs import abandoned_threads

        base, _, record, deadlines = config
        episode = task.episode
        env = self._free.get()  # the driver never sends more episodes than slots
        slot = EpisodeSlot(env)
        out: dict[str, Any] = {"episode": episode}
        try:
            env.sampling = record
            generate = _engine_generate(engine)
            try:
                step, begin = _on_threads(self._steps)
                outcome = asyncio.run(play(slot, task, base, generate, step, deadlines, begin))
            except EngineLost as err:
                out["engine_died"] = str(err)
                return out
            # This process's timed-out tool calls still running: the run's summary adds up the workers'.
            out.update(tool_threads=abandoned_threads(), stuck=slot.retired)
            out["error" if isinstance(outcome, EpisodeError) else "trajectories"] = outcome
            return out
        finally:
            if not slot.retired:
                self._free.put(env)
            else:
                fresh = self._replace(env)
                if fresh is None:
                    out["slot_lost"] = True  # the driver sends this worker one episode fewer from now on
                else:
                    self._free.put(fresh)

    def _replace(self, stuck: RecordEpisodes) -> RecordEpisodes | None:
        """A fresh env copy in the place of one a hung step still holds (closed with the worker), or
        None when the env cannot be made again (the slot is gone: logged, and said to the driver)."""
        with self._lock:
            self._stuck.append(stuck)
            self._steps.grow()  # the hung thread keeps its place: the slot gets a thread of its own
        try:
            fresh = RecordEpisodes(self._factory(), keep=False)
        except Exception:  # noqa: BLE001 -- the episode's own outcome is already decided
            log.exception("an env copy to replace a stuck one could not be made; this worker has one slot fewer")
            return None
        with self._lock:
            self._envs.append(fresh)
        return fresh

    def close(self) -> None:
        """Close every env (and so its tools' and sandboxes' resources), the stuck copies last."""
        with self._lock:
            stuck = {id(e) for e in self._stuck}
            envs = sorted(self._envs, key=lambda e: id(e) in stuck) + self._stuck
        for env in envs:
            try:
                env.close()
            except Exception:
                if id(env) not in stuck:
                    raise
        self._steps.shutdown(wait=False, cancel_futures=True)


def _on_threads(steps: StepThreads) -> tuple[Any, Any]:
    """The runner's ``step`` and ``begin`` on ``steps`` (module functions: an actor class with a
    coroutine method would be made an async actor by Ray, and its episodes' own loops refused)."""

    async def step(slot: EpisodeSlot, gen: Generation) -> Any:
        return await asyncio.wrap_future(steps.submit(slot.step, gen))

    async def begin(slot: EpisodeSlot, task: EpisodeTask) -> None:
        await asyncio.wrap_future(steps.submit(slot.begin, task))

    return step, begin


def _engine_generate(engine: Any) -> Any:
    """The runner's ``generate`` over a policy engine actor: a refusal fails the request, a dead actor is :class:`EngineLost`."""
    import ray

    async def generate(context: list[int], params: SamplingParams) -> Generation:
        try:
            # awaited, not ray.get: the turn's deadline can end the wait
            return await asyncio.wrap_future(engine.generate.remote(context, params).future())
        except ray.exceptions.RayTaskError as err:  # the policy refused this request
            raise root_cause(err) from None
        except ray.exceptions.RayError as err:  # the engine actor is gone (Ray retries while it restarts)
            raise EngineLost(short_error(err)) from None

    return generate


class PolicyEngine:
    """One policy in an actor; requests that arrive while it is busy are batched together.

    Made an async Ray actor by :class:`RayBackend`. The policy is built, and always called,
    on one thread of its own (:class:`~tokengym.policies.batching.RequestBatcher`, as the local
    driver does).
    """

    def __init__(self, policy: Policy | PolicyFactory, batch_wait_s: float = 0.0) -> None:
        self._batcher = RequestBatcher(lambda: build_policy(policy), batch_wait_s=batch_wait_s)
        self.policy = self._batcher.policy

    def describe(self) -> dict[str, Any]:
        """The engine's policy name, logprob kind and process id (a new pid means Ray restarted it)."""
        import ray

        return {
            "name": getattr(self.policy, "name", type(self.policy).__name__),
            "logprob_kind": getattr(self.policy, "logprob_kind", "none"),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def stats(self) -> dict[str, Any]:
        """Busy time and process id, for the run's report."""
        b = self._batcher
        return {
            "busy_s": b.busy_now(), "requests": b.requests, "batches": b.batches, "max_batch": b.max_batch,
            "peak": b.peak, "pid": os.getpid(),
        }

    def close(self) -> None:
        """Close the policy (an engine's processes, its memory) before the actor ends."""
        self._batcher.close(close_policy=True)

    async def generate(self, context: list[int], params: SamplingParams) -> Generation:
        """One request; requests that arrive while the policy is busy are batched into one ``generate`` call."""
        return await self._batcher.generate(context, params)
