"""The rollout driver: many episodes at once through one policy, each recorded.

All live episodes' generation requests go to the policy together, as one batch per
round; environments then step in a thread pool, so slow tools of one episode do not
serialize the others. Finished episodes are recorded and replaced until the requested
number is done. Seeds make a run reproducible with a deterministic policy: episode ``i``
resets with ``seed + i`` and each of its turns samples with a seed derived from
``(seed, i, turn)``, whatever else shares its batch.

The episode logic lives in :class:`_Slot` (``begin``, ``params``, ``advance``) and is shared by
the backends: this module's local driver steps all live slots in lock-step rounds; the Ray
backend (:mod:`tokengym.recorder.ray_backend`, ``backend="ray"``) runs each slot's episode in
an env worker actor against a policy engine actor, so episodes on many machines give the
same trajectories, token for token, as here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from tokengym.policies import Generation, Policy, SamplingParams

from .trajectory import Trajectory
from .wrapper import RecordEpisodes

__all__ = ["PolicyFactory", "RolloutResult", "RolloutStats", "rollout", "turn_seed"]

PolicyFactory = Callable[[], Policy]
"""A zero-argument callable that builds a policy (``functools.partial(VLLMPolicy, "model", ...)``)."""


def turn_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of one turn: independent of batch composition and scheduling."""
    return int(np.random.SeedSequence([seed, episode, turn]).generate_state(1, dtype=np.uint32)[0])


@dataclass
class RolloutStats:
    """What a run did, for the summary line and the logs."""

    episodes: int = 0
    failed: int = 0
    tokens: int = 0
    policy_tokens: int = 0
    turns: int = 0
    reward_sum: float = 0.0
    wall_s: float = 0.0
    engine_s: float = 0.0
    stop_reasons: Counter = field(default_factory=Counter)
    conformance: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    """Episodes that were in flight on a worker that died (Ray backend): re-run, or counted in ``failed``."""
    rerun: int = 0
    """How many of the ``lost`` episodes were started again (their trajectories are in the result once)."""
    per_node: Counter = field(default_factory=Counter)
    """Finished episodes per Ray node id (Ray backend)."""
    engine_restarts: int = 0
    """Policy engine actors that Ray restarted during the run (Ray backend)."""
    startup_s: float = 0.0
    """Time to start the backend's actors before the first episode (Ray backend; not in ``wall_s``)."""

    @property
    def mean_reward(self) -> float:
        """Mean return over the finished episodes (0.0 when none finished)."""
        return self.reward_sum / self.episodes if self.episodes else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Policy tokens generated per second of wall time."""
        return self.policy_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def outside_engine_share(self) -> float:
        """Share of wall time spent outside the policy (env, tools, tokenizing, recording)."""
        return 1.0 - self.engine_s / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form, for logs and the CLI summary."""
        return {
            "episodes": self.episodes,
            "failed": self.failed,
            "tokens": self.tokens,
            "policy_tokens": self.policy_tokens,
            "turns": self.turns,
            "mean_reward": self.mean_reward,
            "wall_s": self.wall_s,
            "engine_s": self.engine_s,
            "tokens_per_s": self.tokens_per_s,
            "outside_engine_share": self.outside_engine_share,
            "stop_reasons": dict(self.stop_reasons),
            "conformance": dict(self.conformance),
            "errors": list(self.errors),
            "lost": list(self.lost),
            "rerun": self.rerun,
            "per_node": dict(self.per_node),
            "engine_restarts": self.engine_restarts,
            "startup_s": self.startup_s,
        }


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]
    stats: RolloutStats
    interrupted: bool = False


@dataclass
class _Slot:
    """One env copy and the episode it runs: the per-episode logic every backend shares."""

    env: RecordEpisodes
    episode: int = -1
    stream: list[int] = field(default_factory=list)
    turn: int = 0
    remaining: int = 0

    def begin(self, episode: int, seed: int) -> None:
        """Reset for ``episode`` (with seed ``seed + episode``); raises what the env raises."""
        self.episode = episode
        obs, info = self.env.reset(seed=seed + episode)
        self.stream, self.turn = [int(i) for i in obs], 0
        self.remaining = int(info.get("remaining_context", 1 << 30))

    def params(self, base: SamplingParams, seed: int) -> SamplingParams:
        """The sampling settings of this slot's next turn."""
        return _params(base, self, seed)

    def step(self, gen: Generation) -> Any:
        """``env.step`` with the generation; an exception is returned, not raised."""
        try:
            return self.env.step(gen.token_ids, logprobs=gen.logprobs)
        except Exception as err:
            return err

    def advance(self, gen: Generation, result: tuple) -> Trajectory | None:
        """Take a step's result into the stream; the finished trajectory when the episode ended."""
        obs, _, terminated, truncated, info = result
        self.stream += gen.token_ids.tolist() + obs.tolist()
        self.turn += 1
        self.remaining = int(info.get("remaining_context", self.remaining))
        if not (terminated or truncated):
            return None
        traj = info["trajectory"]
        traj.metadata["episode"] = self.episode
        return traj

    def failure(self, err: BaseException) -> str:
        return f"episode {self.episode} turn {self.turn}: {err!r}"


def env_factory(make_env: Callable[[], gym.Env] | str, env_kwargs: dict[str, Any] | None = None) -> Callable[[], gym.Env]:
    """A factory of envs from a factory or a registered id (made with ``env_kwargs``)."""
    if not isinstance(make_env, str):
        return make_env
    env_id, kwargs = make_env, dict(env_kwargs or {})

    def make() -> gym.Env:
        if env_id.startswith("tokengym/") and env_id not in gym.registry:
            import tokengym.envs  # noqa: F401  (registers the tokengym/ envs; needed in a fresh worker process)
        return gym.make(env_id, **kwargs)

    return make


def sampling_record(base: SamplingParams, name: str, logprob_kind: str, seed: int) -> dict[str, Any]:
    """The sampling settings recorded with every trajectory of a run."""
    return {**base.as_dict(), "policy": name, "logprob_kind": logprob_kind, "seed": seed}


def is_policy(obj: Any) -> bool:
    """A policy instance (it generates), as opposed to a factory of one (a class is a factory)."""
    return hasattr(obj, "generate") and not isinstance(obj, type)


def build_policy(policy: Policy | PolicyFactory) -> Policy:
    """``policy`` itself, or the policy its factory builds."""
    if is_policy(policy):
        return policy  # type: ignore[return-value]
    if callable(policy):
        built = policy()
        if not is_policy(built):
            raise TypeError(f"the policy factory returned {type(built).__name__}, not a Policy")
        return built
    raise TypeError(f"expected a Policy or a zero-argument factory of one, got {type(policy).__name__}")


def rollout(
    make_env: Callable[[], gym.Env] | str,
    policy: Policy | PolicyFactory,
    *,
    episodes: int,
    concurrency: int = 8,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
    progress: bool = True,
    backend: str | Any = "local",
    address: str | None = None,
) -> RolloutResult:
    """Run ``episodes`` episodes, ``concurrency`` at a time, and return their trajectories.

    Args:
        make_env: a factory of tokengym envs, or a registered id (made with ``env_kwargs``).
        policy: any :class:`tokengym.policies.Policy`, or a zero-argument factory of one
            (``functools.partial(VLLMPolicy, "model", ...)``): with ``backend="ray"`` each engine
            actor builds its own (a policy instance is pickled into the engine instead).
        sampling: the base settings; each env's stop tokens and stop strings are added and
            ``max_tokens`` is clamped to the context the env has left.
        on_episode: called with each finished trajectory as it finishes (e.g. a store's ``write``).
        backend: ``"local"`` (the default: this process, no Ray), ``"ray"`` (env workers and
            policy engines as Ray actors, :class:`~tokengym.recorder.ray_backend.RayBackend` with
            its defaults), or a configured ``RayBackend``.
        address: with ``backend="ray"``: the cluster to connect to (``"auto"``, ``"HOST:PORT"``,
            ``"ray://HOST:10001"``); None starts a local Ray unless one is connected already.

    Ctrl-C stops the run cleanly: every finished episode is returned (and was passed to
    ``on_episode``); the unfinished ones are dropped whole, never half-recorded.
    """
    if episodes < 0 or concurrency < 1:
        raise ValueError(f"need episodes >= 0 and concurrency >= 1, got {episodes} and {concurrency}")
    base = sampling or SamplingParams()
    if isinstance(backend, str):
        if backend not in ("local", "ray"):
            raise ValueError(f'unknown backend {backend!r}: use "local", "ray" or a RayBackend')
        if backend == "local" and address is not None:
            raise ValueError("address= is for backend='ray'")
        if backend == "ray":
            from .ray_backend import RayBackend

            backend = RayBackend(address=address)
    elif address is not None:
        raise ValueError("a configured backend brings its own address: RayBackend(address=...)")
    if not isinstance(backend, str):
        return backend.run(
            make_env, policy, episodes=episodes, concurrency=concurrency, sampling=base, seed=seed,
            env_kwargs=env_kwargs, on_episode=on_episode, progress=progress,
        )
    owned = not is_policy(policy)  # built here from a factory: closed here too
    policy = build_policy(policy)
    make_env = env_factory(make_env, env_kwargs)
    record = sampling_record(base, getattr(policy, "name", type(policy).__name__), getattr(policy, "logprob_kind", "none"), seed)
    stats = RolloutStats()
    done: list[Trajectory] = []
    slots = [_Slot(RecordEpisodes(make_env(), keep=False, sampling=record)) for _ in range(min(concurrency, episodes))]
    next_episode = 0
    bar = _progress(episodes, progress)
    start = time.perf_counter()

    def begin(slot: _Slot) -> bool:
        nonlocal next_episode
        while next_episode < episodes:
            episode, next_episode = next_episode, next_episode + 1
            try:
                slot.begin(episode, seed)
            except Exception as err:  # a broken task must not stop the run
                stats.failed += 1
                stats.errors.append(f"episode {episode}: reset failed: {err!r}")
                bar.update(1)
                continue
            return True
        slot.episode = -1
        return False

    interrupted = False
    live = [s for s in slots if begin(s)]
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(slots))) as pool:
            while live:
                params = [s.params(base, seed) for s in live]
                t0 = time.perf_counter()
                gens = policy.generate([s.stream for s in live], params)
                stats.engine_s += time.perf_counter() - t0
                still = []
                for slot, gen, result in pool.map(lambda a: (a[0], a[1], a[0].step(a[1])), zip(live, gens)):
                    if isinstance(result, Exception):
                        stats.failed += 1
                        stats.errors.append(slot.failure(result))
                        bar.update(1)
                        if begin(slot):
                            still.append(slot)
                        continue
                    traj = slot.advance(gen, result)
                    if traj is not None:
                        record_finished(stats, traj, done, on_episode, bar, start)
                        if not begin(slot):
                            continue
                    still.append(slot)
                live = still
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        stats.wall_s = time.perf_counter() - start
        for s in slots:
            s.env.close()
        if owned and hasattr(policy, "close"):
            policy.close()
    done.sort(key=lambda t: t.metadata["episode"])
    return RolloutResult(done, stats, interrupted)


def _params(base: SamplingParams, slot: _Slot, seed: int) -> SamplingParams:
    seed = seed if base.seed is None else base.seed
    return turn_params(base, slot.env.unwrapped, slot.remaining, turn_seed(seed, slot.episode, slot.turn))


def turn_params(base: SamplingParams, env: Any, remaining: int, seed: int) -> SamplingParams:
    """One turn's sampling settings: ``base`` with the env's stop tokens and strings added, the
    token budget cut to the context left, and the turn's own seed."""
    return base.replace(
        max_tokens=max(1, min(base.max_tokens, remaining)),
        seed=seed,
        stop_token_ids=tuple(dict.fromkeys([*base.stop_token_ids, *getattr(env, "stop_token_ids", ())])),
        stop_strings=tuple(dict.fromkeys([*base.stop_strings, *getattr(env, "stop_strings", ())])),
    )


def record_finished(
    stats: RolloutStats,
    traj: Trajectory,
    done: list[Trajectory],
    on_episode: Callable[[Trajectory], None] | None,
    bar: Any,
    start: float,
) -> None:
    """Count a finished trajectory, keep it, hand it to ``on_episode`` and move the progress bar."""
    _account(stats, traj)
    done.append(traj)
    if on_episode is not None:
        on_episode(traj)
    bar.update(1)
    bar.set_postfix(
        tok_s=f"{stats.policy_tokens / max(time.perf_counter() - start, 1e-9):.0f}",
        reward=f"{stats.mean_reward:.3f}",
    )


def _account(stats: RolloutStats, traj: Trajectory) -> None:
    stats.episodes += 1
    stats.tokens += len(traj)
    stats.policy_tokens += int(traj.mask.sum())
    stats.turns += traj.num_turns
    stats.reward_sum += traj.reward
    stats.stop_reasons[traj.stop_reason or "?"] += 1
    summary = traj.conformance_summary
    for status in ("ok", "known", "mismatch"):
        stats.conformance[status] += summary[status]


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="episodes", unit="ep", disable=not enabled, dynamic_ncols=True)


def summary_table(stats: RolloutStats) -> str:
    """A short human-readable summary of a run."""
    rows: list[tuple[str, str]] = [
        ("episodes", f"{stats.episodes} done, {stats.failed} failed"),
        ("tokens", f"{stats.tokens} ({stats.policy_tokens} from the policy)"),
        ("turns", str(stats.turns)),
        ("mean reward", f"{stats.mean_reward:.3f}"),
        ("stop reasons", ", ".join(f"{k} {v}" for k, v in sorted(stats.stop_reasons.items())) or "-"),
        ("conformance", ", ".join(f"{k} {v}" for k, v in sorted(stats.conformance.items())) or "-"),
        ("throughput", f"{stats.tokens_per_s:.1f} policy tokens/s, {100 * stats.outside_engine_share:.0f}% of time outside the policy"),
    ]
    if stats.per_node:
        nodes = ", ".join(f"{node[:8]} {n}" for node, n in sorted(stats.per_node.items()))
        rows.append(("nodes", f"{len(stats.per_node)} ({nodes} episodes)"))
    if stats.lost:
        fate = f"{stats.rerun} re-run" if stats.rerun else "counted as failed"
        rows.append(("lost", f"{len(stats.lost)} in flight on a dead worker: episodes "
                     f"{', '.join(map(str, sorted(stats.lost)))} ({fate})"))
    if stats.engine_restarts:
        rows.append(("engine restarts", str(stats.engine_restarts)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
