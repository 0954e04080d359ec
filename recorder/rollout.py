"""The rollout driver: many episodes at once through one policy, each recorded.

All live episodes' generation requests go to the policy together, as one batch per
round; environments then step in a thread pool, so slow tools of one episode do not
serialize the others. Finished episodes are recorded and replaced until the requested
number is done. Seeds make a run reproducible with a deterministic policy: episode ``i``
resets with ``seed + i`` and each of its turns samples with a seed derived from
``(seed, i, turn)``, whatever else shares its batch.
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

from .trajectory import Trajectory
from .wrapper import RecordEpisodes

__all__ = ["RolloutResult", "RolloutStats", "rollout", "turn_seed"]


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

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.episodes if self.episodes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.policy_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def outside_engine_share(self) -> float:
        """Share of wall time spent outside the policy (env, tools, tokenizing, recording)."""
        return 1.0 - self.engine_s / self.wall_s if self.wall_s else 0.0

    def as_dict(self) -> dict[str, Any]:
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
        }


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]
    stats: RolloutStats
    interrupted: bool = False


@dataclass
class _Slot:
    env: RecordEpisodes
    episode: int = -1
    stream: list[int] = field(default_factory=list)
    turn: int = 0
    remaining: int = 0


def rollout(
    make_env: Callable[[], gym.Env] | str,
    policy: Policy,
    *,
    episodes: int,
    concurrency: int = 8,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
    progress: bool = True,
) -> RolloutResult:
    """Run ``episodes`` episodes, ``concurrency`` at a time, and return their trajectories.

    Args:
        make_env: a factory of tokengym envs, or a registered id (made with ``env_kwargs``).
        policy: any :class:`tokengym.policies.Policy`.
        sampling: the base settings; each env's stop tokens and stop strings are added and
            ``max_tokens`` is clamped to the context the env has left.
        on_episode: called with each finished trajectory as it finishes (e.g. a store's ``write``).

    Ctrl-C stops the run cleanly: every finished episode is returned (and was passed to
    ``on_episode``); the unfinished ones are dropped whole, never half-recorded.
    """
    if episodes < 0 or concurrency < 1:
        raise ValueError(f"need episodes >= 0 and concurrency >= 1, got {episodes} and {concurrency}")
    base = sampling or SamplingParams()
    if isinstance(make_env, str):
        env_id, kwargs = make_env, dict(env_kwargs or {})
        make_env = lambda: gym.make(env_id, **kwargs)  # noqa: E731
    record = {**base.as_dict(), "policy": getattr(policy, "name", type(policy).__name__),
              "logprob_kind": getattr(policy, "logprob_kind", "none"), "seed": seed}
    stats = RolloutStats()
    done: list[Trajectory] = []
    slots = [_Slot(RecordEpisodes(make_env(), keep=False, sampling=record)) for _ in range(min(concurrency, episodes))]
    next_episode = 0
    bar = _progress(episodes, progress)
    start = time.perf_counter()

    def begin(slot: _Slot) -> bool:
        nonlocal next_episode
        while next_episode < episodes:
            slot.episode, next_episode = next_episode, next_episode + 1
            try:
                obs, info = slot.env.reset(seed=seed + slot.episode)
            except Exception as err:  # a broken task must not stop the run
                stats.failed += 1
                stats.errors.append(f"episode {slot.episode}: reset failed: {err!r}")
                bar.update(1)
                continue
            slot.stream, slot.turn = [int(i) for i in obs], 0
            slot.remaining = int(info.get("remaining_context", 1 << 30))
            return True
        slot.episode = -1
        return False

    def step(slot: _Slot, gen: Generation) -> tuple[_Slot, Generation, Any]:
        try:
            return slot, gen, slot.env.step(gen.token_ids, logprobs=gen.logprobs)
        except Exception as err:
            return slot, gen, err

    interrupted = False
    live = [s for s in slots if begin(s)]
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(slots))) as pool:
            while live:
                params = [_params(base, s, seed) for s in live]
                t0 = time.perf_counter()
                gens = policy.generate([s.stream for s in live], params)
                stats.engine_s += time.perf_counter() - t0
                still = []
                for slot, gen, result in pool.map(lambda a: step(*a), zip(live, gens)):
                    if isinstance(result, Exception):
                        stats.failed += 1
                        stats.errors.append(f"episode {slot.episode} turn {slot.turn}: {result!r}")
                        bar.update(1)
                        if begin(slot):
                            still.append(slot)
                        continue
                    obs, _, terminated, truncated, info = result
                    slot.stream += gen.token_ids.tolist() + obs.tolist()
                    slot.turn += 1
                    slot.remaining = int(info.get("remaining_context", slot.remaining))
                    if terminated or truncated:
                        traj = info["trajectory"]
                        traj.metadata["episode"] = slot.episode
                        _account(stats, traj)
                        done.append(traj)
                        if on_episode is not None:
                            on_episode(traj)
                        bar.update(1)
                        bar.set_postfix(
                            tok_s=f"{stats.policy_tokens / max(time.perf_counter() - start, 1e-9):.0f}",
                            reward=f"{stats.mean_reward:.3f}",
                        )
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
    done.sort(key=lambda t: t.metadata["episode"])
    return RolloutResult(done, stats, interrupted)


def _params(base: SamplingParams, slot: _Slot, seed: int) -> SamplingParams:
    env = slot.env.unwrapped
    stop_ids = tuple(dict.fromkeys([*base.stop_token_ids, *getattr(env, "stop_token_ids", ())]))
    stop_strings = tuple(dict.fromkeys([*base.stop_strings, *getattr(env, "stop_strings", ())]))
    return base.replace(
        max_tokens=max(1, min(base.max_tokens, slot.remaining)),
        seed=turn_seed(seed, slot.episode, slot.turn) if base.seed is None else turn_seed(base.seed, slot.episode, slot.turn),
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
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
    rows: Sequence[tuple[str, str]] = [
        ("episodes", f"{stats.episodes} done, {stats.failed} failed"),
        ("tokens", f"{stats.tokens} ({stats.policy_tokens} from the policy)"),
        ("turns", str(stats.turns)),
        ("mean reward", f"{stats.mean_reward:.3f}"),
        ("stop reasons", ", ".join(f"{k} {v}" for k, v in sorted(stats.stop_reasons.items())) or "-"),
        ("conformance", ", ".join(f"{k} {v}" for k, v in sorted(stats.conformance.items())) or "-"),
        ("throughput", f"{stats.tokens_per_s:.1f} policy tokens/s, {100 * stats.outside_engine_share:.0f}% of time outside the policy"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
