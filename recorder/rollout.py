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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from tokengym.policies import Generation, Policy, SamplingParams

from .stopping import stop_on_signals, uninterrupted
from .trajectory import Trajectory
from .wrapper import RecordEpisodes

__all__ = ["EpisodeError", "PolicyFactory", "RolloutResult", "RolloutStats", "episode_ids", "rollout", "turn_seed"]

PolicyFactory = Callable[[], Policy]
"""A zero-argument callable that builds a policy (``functools.partial(VLLMPolicy, "model", ...)``)."""


def turn_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of one turn: independent of batch composition and scheduling."""
    return int(np.random.SeedSequence([seed, episode, turn]).generate_state(1, dtype=np.uint32)[0])


@dataclass(frozen=True)
class EpisodeError:
    """One thing that went wrong in a run, as data: which episode, which turn, what kind, what it said.

    ``failed`` is False for a note that did not fail an episode (an env worker died and its
    episode was started again). ``str()`` gives the one-line form of the logs.
    """

    episode: int | None
    turn: int | None
    type: str
    message: str
    failed: bool = True

    @classmethod
    def of(cls, err: BaseException, episode: int | None, turn: int | None, prefix: str = "") -> EpisodeError:
        """The record of an exception raised in ``episode`` at ``turn`` (None: at reset)."""
        return cls(episode, turn, type(err).__name__, prefix + (str(err) or repr(err)))

    def __str__(self) -> str:
        where = "" if self.episode is None else f"episode {self.episode}"
        if self.turn is not None:
            where += f" turn {self.turn}"
        return f"{where}: {self.type}: {self.message}" if where else f"{self.type}: {self.message}"

    def __contains__(self, text: str) -> bool:
        return text in str(self)

    def as_dict(self) -> dict[str, Any]:
        return {"episode": self.episode, "turn": self.turn, "type": self.type, "message": self.message, "failed": self.failed}


def episode_ids(episodes: int | Sequence[int]) -> list[int]:
    """The episode indices a run is asked for: ``range(n)`` for a count, else the given indices (unique, >= 0)."""
    if isinstance(episodes, int):
        if episodes < 0:
            raise ValueError(f"need episodes >= 0, got {episodes}")
        return list(range(episodes))
    ids = [int(i) for i in episodes]
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"episode indices must be unique and >= 0, got {ids[:20]}")
    return ids


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
    errors: list[EpisodeError] = field(default_factory=list)
    """What went wrong, one record per failed episode (and notes with ``failed=False``)."""
    requested: int = 0
    """Episodes the run was asked for."""
    interrupted: bool = False
    """Stopped by Ctrl-C or SIGTERM: ``not_run`` episodes were never finished."""
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
    def not_run(self) -> int:
        """Asked-for episodes that neither finished nor failed (a stopped run drops them whole)."""
        return max(0, self.requested - self.episodes - self.failed)

    def failures_by_type(self) -> dict[str, list[EpisodeError]]:
        """The failed episodes' errors grouped by exception type, most frequent type first."""
        groups: dict[str, list[EpisodeError]] = {}
        for e in self.errors:
            if e.failed:
                groups.setdefault(e.type, []).append(e)
        return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))

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
            "errors": [e.as_dict() for e in self.errors],
            "requested": self.requested,
            "interrupted": self.interrupted,
            "not_run": self.not_run,
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
            return self.env.step(gen.token_ids, logprobs=gen.logprobs, finish_reason=gen.finish_reason)
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

    def failure(self, err: BaseException) -> EpisodeError:
        """The record of ``err``, raised during this slot's current turn."""
        return EpisodeError.of(err, self.episode, self.turn)


def env_factory(make_env: Callable[[], gym.Env] | str, env_kwargs: dict[str, Any] | None = None) -> Callable[[], gym.Env]:
    """A factory of envs from a factory or an env id (made with ``env_kwargs``): a registered id,
    gymnasium's ``module:id`` form or an env an installed package declares, resolved as the CLI does."""
    if not isinstance(make_env, str):
        return make_env
    from tokengym.envs import EnvRef

    return EnvRef(make_env, (), dict(env_kwargs or {}))


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
    episodes: int | Sequence[int],
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
        episodes: how many (episodes ``0 .. n-1``), or which episode indices to run: episode
            ``i`` always resets with seed ``seed + i``, so running the indices a stopped run
            did not finish continues it with the same seeds.
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

    Ctrl-C and SIGTERM stop the run cleanly (in the main thread): every finished episode is
    returned (and was passed to ``on_episode``); the unfinished ones are dropped whole, never
    half-recorded; ``result.interrupted`` and ``stats.not_run`` say so. A failed episode (its
    env or the policy raised) does not stop the run: it is counted in ``stats.failed`` and
    described in ``stats.errors``.
    """
    ids = episode_ids(episodes)
    if concurrency < 1:
        raise ValueError(f"need concurrency >= 1, got {concurrency}")
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
    stats = RolloutStats(requested=len(ids))
    done: list[Trajectory] = []
    slots = [_Slot(RecordEpisodes(make_env(), keep=False, sampling=record)) for _ in range(min(concurrency, len(ids)))]
    queue = iter(ids)
    bar = _progress(len(ids), progress)
    start = time.perf_counter()

    def begin(slot: _Slot) -> bool:
        for episode in queue:
            try:
                slot.begin(episode, seed)
            except Exception as err:  # a broken task must not stop the run
                stats.failed += 1
                stats.errors.append(EpisodeError.of(err, episode, None, "reset failed: "))
                bar.update(1)
                continue
            return True
        slot.episode = -1
        return False

    interrupted = False
    try:
        with stop_on_signals(), ThreadPoolExecutor(max_workers=max(1, len(slots))) as pool:
            live = [s for s in slots if begin(s)]
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
    stats.interrupted = interrupted
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
    """Hand a finished trajectory to ``on_episode``, count it, keep it, and move the progress bar.

    A stop signal waits until all of it is done, so a trajectory is stored and counted, or neither.
    If ``on_episode`` raises (a full disk), the trajectory is neither counted nor kept.
    """
    with uninterrupted():
        if on_episode is not None:
            on_episode(traj)
        _account(stats, traj)
        done.append(traj)
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
    """A short human-readable summary of a run: counts, then why episodes failed, then whether it was stopped."""
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
    for i, (kind, errs) in enumerate(stats.failures_by_type().items()):
        episodes = sorted({e.episode for e in errs if e.episode is not None})
        shown = ", ".join(map(str, episodes[:10])) + (f" and {len(episodes) - 10} more" if len(episodes) > 10 else "")
        rows.append(("failed" if i == 0 else "", f"{len(errs)} × {kind} (episodes {shown or '-'}); first: {errs[0]}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if stats.interrupted:
        lines.append(
            f"interrupted: {stats.episodes} finished, {stats.not_run} not run"
            f"{f', {stats.failed} failed' if stats.failed else ''} (unfinished episodes were dropped whole)"
        )
    return "\n".join(lines)
