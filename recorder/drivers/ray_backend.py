"""The Ray backend of the rollout driver: env workers and policy engines as Ray actors.

``rollout(..., backend="ray")`` (or ``RayBackend(...).run(...)``) runs the same episodes as
the local driver, with the same seeds and the same per-episode logic
(:class:`~tokengym.recorder.drivers.episodes.EpisodeSlot`), on a Ray cluster::

    driver (this process)           env workers (actors, spread      policy engines (actors:
    episode queue, ray.wait   --->  over the nodes): env copies, --> vLLM, transformers, ...):
    store writes as episodes        tools and sandboxes; one         one policy each, concurrent
    arrive                    <---  episode per slot at a time       requests batched together

* An **env worker** owns ``slots`` env copies (and so their tools and sandboxes) and runs
  whole episodes, one per slot at a time, each in its own thread: reset, then per turn a
  request to the episode's engine and an ``env.step``. It returns a finished trajectory,
  never a part of one.
* A **policy engine** builds its policy inside the actor from a picklable factory
  (``functools.partial(VLLMPolicy, "model", ...)``) or from a pickled policy, and batches
  the requests that arrive while it is busy into one ``generate`` call (an engine with
  ``agenerate``, such as ``AsyncVLLMPolicy``, gets each request as it comes). Every
  request of one episode goes to the same engine, so its prefix cache is reused.
* The **driver** hands episodes to workers with a free slot and an engine with room
  (at most ``max_inflight_per_engine`` episodes in flight per engine: backpressure), and
  collects finished trajectories as they arrive (``on_episode`` writes each to the store at
  once). A slow tool holds up only its own episode.

Faults: a worker that dies loses only its in-flight episodes; each is started again on
another worker (``max_reruns``, default 1) or counted as failed, never half-written, and
the run goes on with a replacement worker. The lost episodes are named in
``stats.lost`` / ``stats.errors``. An engine that dies is restarted by Ray
(``engine_restarts``, default 1; its in-flight requests are retried, and since every
request is seeded they give the same tokens); one that stays dead ends the run with a
:class:`RolloutError` carrying what was recorded before.

Ray is imported only when this backend runs: ``pip install "tokengym[ray]"``.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from tokengym.policies import Policy, SamplingParams

from .episodes import (
    EpisodeError,
    PolicyFactory,
    RolloutResult,
    RolloutStats,
    EpisodeTask,
    episode_ids,
    is_policy,
    plan_tasks,
    progress_bar,
    record_finished,
    sampling_record,
)
from .ray_actors import EnvWorker, PolicyEngine, root_cause, short_error
from .step_pool import Deadlines
from ..stopping import stop_on_signals
from ..trajectory import Trajectory

__all__ = ["INSTALL_HINT", "EnvWorker", "PolicyEngine", "RayBackend", "RolloutError", "import_ray"]

INSTALL_HINT = 'pip install "tokengym[ray]"'


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"the Ray backend needs Ray: {INSTALL_HINT}") from err
    return ray


class RolloutError(RuntimeError):
    """The run could not go on (an engine died for good, no env worker is left).

    ``result`` holds every episode finished before (each was already passed to ``on_episode``).
    """

    def __init__(self, message: str, result: RolloutResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class RayBackend:
    """Run a rollout's episodes on Ray: env workers and policy engines as actors.

    Args:
        address: the cluster (``"auto"``, ``"HOST:PORT"``, ``"ray://HOST:10001"``); None connects
            to ``$RAY_ADDRESS`` or starts a local Ray. A Ray already initialized in this
            process is used as it is (and left running).
        num_workers: env worker actors; default: one per free CPU of the cluster (each takes
            ``worker_options["num_cpus"]``, default 1), at most one per concurrent episode.
        slots_per_worker: env copies per worker; default: the concurrency spread over the workers.
        num_engines: policy engine actors; each episode sticks to one.
        max_inflight_per_engine: episodes in flight per engine at most (backpressure);
            default: the concurrency spread over the engines.
        worker_options, engine_options: Ray actor options, e.g. ``{"num_cpus": 2}`` for
            workers with CPU-heavy tools, ``{"num_gpus": 1}`` for vLLM engines on GPUs,
            ``{"runtime_env": {"env_vars": {...}}}``. Engines take no CPU by default.
        max_reruns: how often an episode lost with a dead worker is started again (0: count it
            as failed).
        max_worker_replacements: dead workers replaced by new ones over the run; default: as
            many as there are workers.
        engine_restarts: how often Ray restarts a dead engine (its in-flight requests are retried).
        batch_wait_s: how long an idle engine waits for more requests before a batch.
        start_timeout_s: how long actors may take to start (placement on a busy cluster,
            imports, model loading) before the run ends with a clear error.
        init_kwargs: passed to ``ray.init`` when this backend starts or connects to Ray
            (``runtime_env``, ``namespace``, ...).

    Each :meth:`run` starts the actors and ends them (and a Ray it started) when it returns.
    Used as a context manager, the backend keeps them between runs instead: engines while
    the policy is the same object, workers while the env and the layout are the same::

        with RayBackend(address="auto", num_engines=2, engine_options={"num_gpus": 1}) as ray_backend:
            for step in range(steps):
                result = rollout("tokengym/Calculator-v0", make_policy, episodes=256, backend=ray_backend, ...)

    ``workers`` and ``engines`` hold the actor handles while they live; ``fleet`` is the
    workers' state (which are alive, where each runs).
    """

    address: str | None = None
    num_workers: int | None = None
    slots_per_worker: int | None = None
    num_engines: int = 1
    max_inflight_per_engine: int | None = None
    worker_options: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)
    max_reruns: int = 1
    max_worker_replacements: int | None = None
    engine_restarts: int = 1
    batch_wait_s: float = 0.0
    start_timeout_s: float = 600.0
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    engines: list[Any] = field(default_factory=list, init=False, repr=False)
    fleet: WorkerFleet = field(default_factory=lambda: WorkerFleet(), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {self.num_engines}")
        for name in ("num_workers", "slots_per_worker", "max_inflight_per_engine"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_reruns < 0 or self.engine_restarts < 0:
            raise ValueError("max_reruns and engine_restarts must be >= 0")
        self._keep = False
        self._owns_ray = False
        self._ray: Any = None
        self._policy_key: Any = None
        self._engine_info: dict[str, Any] = {}
        self._worker_key: Any = None

    @property
    def workers(self) -> list[Any]:
        """The env worker actors' handles (a dead one's stays, at its index)."""
        return self.fleet.workers

    # ------------------------------------------------------------ session
    def __enter__(self) -> RayBackend:
        self._keep = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._keep = False
        self.close()

    def close(self) -> None:
        """End every actor (closing the envs first), and a Ray this backend started."""
        ray = self._ray
        if ray is None:
            return
        self._stop_workers()
        self._stop_engines()
        if self._owns_ray:
            ray.shutdown()
        self._ray, self._owns_ray = None, False

    def _await_start(
        self, ray: Any, refs: list[Any], what: str, stop: Callable[[], None], needs: str, free: Callable[[], Any]
    ) -> list[Any]:
        """Wait for actors' first answers; on a timeout or a failed start, stop them and say why."""
        try:
            return ray.get(refs, timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            stop()
            raise RuntimeError(
                f"{what} did not start within {self.start_timeout_s:.0f} s; they need {needs} each "
                f"and the cluster has {free()} free"
            ) from None
        except ray.exceptions.RayError as err:
            stop()
            raise RuntimeError(f"one of {what} failed to start: {short_error(root_cause(err), 2000)}") from None

    # ------------------------------------------------------------------ run
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
        """As :func:`~tokengym.recorder.rollout`: the same episodes, seeds, groups, deadlines and
        result layout; SIGTERM stops it like Ctrl-C (finished episodes kept, unfinished ones
        dropped whole)."""
        ids = episode_ids(episodes)
        planned = {t.episode: t for t in plan_tasks(ids, seed, sampling, group_size=group_size, tasks=tasks)}
        if concurrency < 1:
            raise ValueError(f"need concurrency >= 1, got {concurrency}")
        ray = import_ray()
        base = sampling or SamplingParams()
        if not ids:
            return RolloutResult([], RolloutStats())
        if self._ray is None:
            if not ray.is_initialized():
                ray.init(address=self.address, **{"include_dashboard": False, **self.init_kwargs})
                self._owns_ray = True
            self._ray = ray
        clean = False
        try:
            t0 = time.perf_counter()
            self._ensure_engines(policy)
            record = sampling_record(base, self._engine_info["name"], self._engine_info["logprob_kind"], seed)
            config = (base, seed, record, Deadlines() if deadlines is None else deadlines)
            capacity, per_engine = self._ensure_workers(make_env, env_kwargs, min(concurrency, len(ids)))
            startup = time.perf_counter() - t0
            run = _Run(self, self._ray, capacity, per_engine, config, planned, on_episode, progress)
            result = run.drive()
            result.stats.startup_s = startup
            clean = not result.interrupted
            return result
        finally:
            if not clean:  # episodes may still be in flight: start afresh next time
                self._stop_workers()
                self._stop_engines()
            if not self._keep:
                self.close()

    # ------------------------------------------------------------- engines
    def _ensure_engines(self, policy: Any) -> None:
        if len(self.engines) == self.num_engines and _same(policy, self._policy_key):
            return
        self._stop_engines()
        ray = self._ray
        if is_policy(policy):  # an instance: each engine gets a pickled copy
            try:
                ray.cloudpickle.dumps(policy)
            except Exception as err:
                raise TypeError(
                    f"the policy {type(policy).__name__} cannot be sent to a Ray engine actor ({short_error(err)}); "
                    "pass a zero-argument factory that builds it, e.g. functools.partial(VLLMPolicy, MODEL, ...)"
                ) from err
        elif not callable(policy):
            raise TypeError(f"expected a Policy or a zero-argument factory of one, got {type(policy).__name__}")
        options = {
            "num_cpus": 0,
            "max_restarts": self.engine_restarts,
            "max_task_retries": -1 if self.engine_restarts else 0,
            **self.engine_options,
        }
        actor = ray.remote(PolicyEngine).options(**options)
        self.engines = [actor.remote(policy, self.batch_wait_s) for _ in range(self.num_engines)]
        described = self._await_start(
            ray, [e.describe.remote() for e in self.engines], f"{self.num_engines} policy engine actors",
            self._stop_engines, _needs(options), lambda: _free_resources(ray),
        )
        self._policy_key = policy
        self._engine_info = described[0]
        self._engine_pids = [d["pid"] for d in described]

    def engine_stats(self) -> tuple[int, float]:
        """(engines restarted since the last call, mean busy seconds of the engines)."""
        try:
            stats = self._ray.get([e.stats.remote() for e in self.engines], timeout=30)
        except Exception:
            return 0, 0.0
        restarted = sum(s["pid"] != pid for s, pid in zip(stats, self._engine_pids))
        self._engine_pids = [s["pid"] for s in stats]
        return restarted, sum(s["busy_s"] for s in stats) / len(stats)

    def _stop_engines(self) -> None:
        if self.engines and self._ray is not None:
            closing = [e.close.remote() for e in self.engines]
            self._ray.wait(closing, num_returns=len(closing), timeout=30)
        for engine in self.engines:
            _kill(self._ray, engine)
        self.engines, self._policy_key = [], None

    # ------------------------------------------------------------- workers
    def _ensure_workers(self, make_env: Any, env_kwargs: Any, concurrency: int) -> tuple[int, int]:
        """Workers for this env and layout: the live ones when they fit, else new ones; returns
        (episodes in flight at most, per engine at most)."""
        ray = self._ray
        cpus = float(self.worker_options.get("num_cpus", 1))
        if self.num_workers is not None:
            n = self.num_workers
        else:
            # one per CPU free for this backend (its own live workers' CPUs count as free)
            free = float(ray.available_resources().get("CPU", 0.0)) + cpus * len(self.fleet.alive)
            n = max(1, int(free // cpus)) if cpus > 0 else concurrency
        n = max(1, min(n, concurrency))
        slots = self.slots_per_worker or math.ceil(concurrency / n)
        key = (make_env, env_kwargs, n, slots)
        fleet = self.fleet
        if not (fleet.alive and _same(key, self._worker_key) and len(fleet.alive) == n):
            self._stop_workers()
            options = {
                "num_cpus": 1,
                "scheduling_strategy": "SPREAD",
                "max_restarts": 0,  # the driver replaces a dead worker itself, knowing what it lost
                **self.worker_options,
                "max_concurrency": slots + 1,  # a thread per slot, and one for control calls
            }
            self.fleet = fleet = WorkerFleet(ray, (make_env, env_kwargs), slots, options)
            free = _free_resources(ray)
            for _ in range(n):
                fleet.spawn()
            fleet.nodes = self._await_start(
                ray, fleet.nodes, f"{n} env worker actors", self._stop_workers, _needs(options), lambda: free,
            )
            self._worker_key = key
        capacity = min(concurrency, n * slots)
        return capacity, self.max_inflight_per_engine or math.ceil(capacity / self.num_engines)

    def _stop_workers(self) -> None:
        """Close every env (tools, sandboxes), then end the workers."""
        self.fleet.stop()
        self.fleet, self._worker_key = WorkerFleet(), None


class WorkerFleet:
    """The env worker actors of one backend's layout: their handles, which are alive, and the
    node each runs on. What the driver loop reads and changes of them, in one place."""

    def __init__(self, ray: Any = None, env: tuple[Any, Any] = (None, None), slots: int = 0,
                 options: dict[str, Any] | None = None) -> None:
        self.ray, self.env, self.slots, self.options = ray, env, slots, dict(options or {})
        self.workers: list[Any] = []
        self.alive: list[int] = []
        """Indices into ``workers`` of the live ones."""
        self.nodes: list[Any] = []
        """The node id of each worker (an ObjectRef until it has started and answered)."""

    def spawn(self) -> int:
        """Start a worker; its entry in ``nodes`` is a reference that answers once it has started."""
        worker = self.ray.remote(EnvWorker).options(**self.options).remote(*self.env, self.slots)
        self.workers.append(worker)
        self.nodes.append(worker.node_id.remote())
        self.alive.append(len(self.workers) - 1)
        return len(self.workers) - 1

    def started(self, worker: int, node: str) -> None:
        self.nodes[worker] = node

    def lost(self, worker: int) -> None:
        """``worker`` died (or never started): no longer alive."""
        self.alive.remove(worker)

    def stop(self) -> None:
        """Close every live worker's envs (tools, sandboxes), then end all the workers."""
        ray = self.ray
        if ray is None:
            return
        closing = [self.workers[w].close.remote() for w in self.alive]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=30)
        for worker in self.workers:
            _kill(ray, worker)
        self.workers, self.alive, self.nodes = [], [], []


def _same(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or equal to it (a comparison that fails counts as different)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _needs(options: dict[str, Any]) -> str:
    keys = ("num_cpus", "num_gpus", "resources", "memory")
    return ", ".join(f"{k}={options[k]}" for k in keys if options.get(k)) or "no resources"


def _free_resources(ray: Any) -> str:
    free = ray.available_resources()
    return ", ".join(f"{free[k]:g} {k}" for k in ("CPU", "GPU") if k in free) or "nothing"


def _kill(ray: Any, actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass


class _Abort(Exception):
    """Ends the driver loop; becomes a :class:`RolloutError` with the result so far."""


class _Run:
    """The driver loop of one :meth:`RayBackend.run`."""

    def __init__(
        self,
        backend: RayBackend,
        ray: Any,
        capacity: int,
        per_engine: int,
        config: tuple[SamplingParams, int, dict[str, Any], Deadlines],
        planned: dict[int, EpisodeTask],
        on_episode: Callable[[Trajectory], None] | None,
        progress: bool,
    ) -> None:
        self.b, self.ray, self.fleet = backend, ray, backend.fleet
        self.capacity, self.per_engine = capacity, per_engine
        self.config = self.ray.put(config)
        self.on_episode = on_episode
        self.planned = planned
        self.queue: deque[int] = deque(planned)
        # live workers' free slots; workers still starting wait in `starting` (their node-id reference)
        fleet = self.fleet
        self.free = {w: fleet.slots for w in fleet.alive if isinstance(fleet.nodes[w], str)}
        self.starting = {fleet.nodes[w]: w for w in fleet.alive if w not in self.free}
        self.load = [0] * backend.num_engines
        self.inflight: dict[Any, tuple[int, int, int]] = {}  # ref -> (episode, worker, engine)
        self.attempts: Counter[int] = Counter()
        self.replacements = backend.max_worker_replacements
        if self.replacements is None:
            self.replacements = len(fleet.alive)
        self.stats = RolloutStats(requested=len(planned))
        self.tool_threads: dict[int, int] = {}  # worker -> its timed-out tool calls still running, as last reported
        self.done: list[Trajectory] = []
        self.bar = progress_bar(len(planned), progress)
        self.start = time.perf_counter()

    def drive(self) -> RolloutResult:
        interrupted = False
        try:
            with stop_on_signals():
                self._loop()
        except KeyboardInterrupt:
            interrupted = True
        except _Abort as stop:
            raise RolloutError(f"{stop}; {len(self.done)} finished episodes were kept", self._result()) from None
        finally:
            self.bar.close()
            self.stats.wall_s = time.perf_counter() - self.start
            self.stats.engine_restarts, self.stats.engine_s = self.b.engine_stats()
            self.stats.abandoned_tool_threads = sum(self.tool_threads.values())
        return self._result(interrupted)

    def _loop(self) -> None:
        """Launch episodes and collect results until none is queued or in flight."""
        while self.queue or self.inflight:
            self._launch()
            refs = [*self.inflight, *self.starting]
            if not refs:
                raise _Abort(f"no env worker is left ({len(self.queue)} episodes not run)")
            # Only new workers starting: wait for them as long as a start may take.
            timeout = None if self.inflight else self.b.start_timeout_s
            ready, rest = self.ray.wait(refs, num_returns=1, timeout=timeout)
            if not ready:
                raise _Abort(f"no new env worker started within {self.b.start_timeout_s:.0f} s")
            if rest:
                more, _ = self.ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            for ref in ready:
                if ref in self.starting:
                    self._started(ref)
                else:
                    self._collect(ref)

    def _result(self, interrupted: bool = False) -> RolloutResult:
        self.done.sort(key=lambda t: (t.metadata["episode"], t.metadata.get("sequence", 0)))
        self.stats.interrupted = interrupted
        return RolloutResult(self.done, self.stats, interrupted)

    def _launch(self) -> None:
        engines = self.b.engines
        while self.queue and len(self.inflight) < self.capacity and self.free:
            worker = max(self.free, key=self.free.__getitem__)
            engine = min(range(len(engines)), key=self.load.__getitem__)
            if self.free[worker] == 0 or self.load[engine] >= self.per_engine:
                return
            episode = self.queue.popleft()
            ref = self.fleet.workers[worker].run_episode.remote(self.planned[episode], engines[engine], self.config)
            self.inflight[ref] = (episode, worker, engine)
            self.free[worker] -= 1
            self.load[engine] += 1

    def _collect(self, ref: Any) -> None:
        ray, stats = self.ray, self.stats
        episode, worker, engine = self.inflight.pop(ref)
        self.load[engine] -= 1
        if worker in self.free:
            self.free[worker] += 1
        try:
            out = ray.get(ref)
        except ray.exceptions.RayTaskError as err:  # a bug in the worker, not a lost process
            self._failed(EpisodeError.of(root_cause(err), episode, None))
            return
        except ray.exceptions.RayError as err:  # the worker (or its node) died
            self._lost(episode, worker, err)
            return
        if "tool_threads" in out:
            self.tool_threads[worker] = out["tool_threads"]
        if out.get("stuck"):  # the worker set the env copy aside and made a fresh one
            stats.stuck_envs += 1
        if out.get("slot_lost") and self.free.get(worker, 0) > 0:  # ... or could not: one slot fewer
            self.free[worker] -= 1
        if "trajectories" in out:
            stats.per_node[self.fleet.nodes[worker]] += 1
            record_finished(stats, out["trajectories"], self.done, self.on_episode, self.bar)
        elif "engine_died" in out:
            raise _Abort(
                f"policy engine {engine} died and was not restarted (engine_restarts={self.b.engine_restarts}): "
                f"{out['engine_died']}"
            )
        else:
            self._failed(out["error"])

    def _replace(self) -> None:
        """Start a worker in a dead one's place (it takes episodes once it has started)."""
        if self.replacements:
            self.replacements -= 1
            new = self.fleet.spawn()
            self.starting[self.fleet.nodes[new]] = new

    def _started(self, ref: Any) -> None:
        fleet, worker = self.fleet, self.starting.pop(ref)
        try:
            fleet.started(worker, self.ray.get(ref))
        except self.ray.exceptions.RayError as err:
            fleet.lost(worker)
            self.stats.errors.append(
                EpisodeError(None, None, "WorkerStartFailed", f"a new env worker failed to start: {short_error(root_cause(err))}", failed=False)
            )
            self._replace()
            return
        self.free[worker] = fleet.slots

    def _failed(self, error: EpisodeError) -> None:
        self.stats.failed += 1
        self.stats.errors.append(error)
        self.bar.update(1)

    def _lost(self, episode: int, worker: int, err: BaseException) -> None:
        """``episode`` was in flight on a worker that died: start it again, or count it as failed."""
        stats = self.stats
        if worker in self.free:  # first news of this death
            del self.free[worker]
            self.fleet.lost(worker)
            node = self.fleet.nodes[worker]
            where = f" on node {node[:8]}" if isinstance(node, str) else ""
            stats.errors.append(EpisodeError(None, None, "WorkerDied", f"env worker {worker}{where} died: {short_error(err)}", failed=False))
            self._replace()
        stats.lost.append(episode)
        self.attempts[episode] += 1
        if self.attempts[episode] <= self.b.max_reruns:
            stats.rerun += 1
            stats.errors.append(
                EpisodeError(episode, None, "WorkerLost", f"episode {episode} was lost with env worker {worker}: started again", failed=False)
            )
            self.queue.appendleft(episode)
        else:
            self._failed(EpisodeError(episode, None, "WorkerLost", f"episode {episode} was lost with env worker {worker}: counted as failed"))
