"""One episode's logic and a run's accounting, shared by every rollout backend.

The local driver (:mod:`tokengym.recorder.drivers.rollout`) and the Ray backend
(:mod:`tokengym.recorder.drivers.ray_backend`) run the same :class:`EpisodeSlot` (``begin``,
``params``, ``step``, ``advance``) and count finished episodes the same way, so a run gives
the same trajectories, token for token, on either. Living here rather than in either
backend's module keeps the two independent: the driver may start the Ray backend, and the
Ray backend needs nothing of the driver.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from tokengym.envs.step_record import reset_record, step_record
from tokengym.policies import Generation, Policy, SamplingParams

from ..advantages import GroupSignal
from ..segments import SegmentKind
from ..stopping import uninterrupted
from ..trajectory import Trajectory
from ..views import add_tool_stats
from ..wrapper import RecordEpisodes

__all__ = [
    "EpisodeError",
    "EpisodeSlot",
    "EpisodeTask",
    "PolicyFactory",
    "RolloutResult",
    "RolloutStats",
    "build_policy",
    "env_factory",
    "episode_ids",
    "plan_tasks",
    "is_policy",
    "Progress",
    "progress_bar",
    "record_finished",
    "sampling_record",
    "turn_params",
    "turn_seed",
]

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
    where: str | None = None
    """``file:line in function`` where the exception was raised (its innermost frame), when known."""

    @classmethod
    def of(cls, err: BaseException, episode: int | None, turn: int | None, prefix: str = "") -> EpisodeError:
        """The record of an exception raised in ``episode`` at ``turn`` (None: at reset)."""
        frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None
        return cls(episode, turn, type(err).__name__, prefix + (str(err) or repr(err)), where=where)

    def __str__(self) -> str:
        where = "" if self.episode is None else f"episode {self.episode}"
        if self.turn is not None:
            where += f" turn {self.turn}"
        return f"{where}: {self.type}: {self.message}" if where else f"{self.type}: {self.message}"

    def __contains__(self, text: str) -> bool:
        return text in str(self)

    def as_dict(self) -> dict[str, Any]:
        return {"episode": self.episode, "turn": self.turn, "type": self.type, "message": self.message,
                "failed": self.failed, "where": self.where}


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
    finish_reasons: Counter = field(default_factory=Counter)
    """Why each action's generation stopped (``stop``, ``stop_string``, ``length``: cut at the token
    limit, or ``unknown``), over every action of the finished episodes."""
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
    """Time to start the backend's actors before the first episode (Ray backend; not in ``wall_s``), or
    until the first worker process was ready (process pool; in ``wall_s``)."""
    context_resets: int = 0
    """New contexts started mid-episode (``history="deploy"``): each adds a trajectory row."""
    group_rewards: dict[Any, list[float]] = field(default_factory=dict)
    """The returns of each group's finished episodes (runs with ``group_size`` or ``tasks``)."""
    tool_calls: Counter = field(default_factory=Counter)
    """The finished episodes' tool calls (each episode's ``tool_stats``): ``calls``, one count per
    status (``ok``, ``error``, ``timeout``, ``parse_error``, ...), ``invalid`` and ``episodes``
    (episodes with a call). Empty for envs without tools."""
    abandoned_tool_threads: int = 0
    """Timed-out sync tool calls still running in the background when the run ended (Python cannot
    stop a thread: :func:`tokengym.envs.abandoned_threads`)."""
    stuck_envs: int = 0
    """Env copies left inside a step that did not return (past its deadline, or when the run
    stopped): they took no more episodes (see :class:`~tokengym.recorder.drivers.step_pool.Deadlines`)."""

    def group_signal(self) -> GroupSignal:
        """How many of the run's groups have a learning signal (returns that differ: a GRPO advantage
        that is not zero), as :func:`~tokengym.recorder.batches.group_signal` counts them."""
        return GroupSignal.of_rewards(self.group_rewards)

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
            "finish_reasons": dict(self.finish_reasons),
            "conformance": dict(self.conformance),
            "errors": [e.as_dict() for e in self.errors],
            "requested": self.requested,
            "interrupted": self.interrupted,
            "not_run": self.not_run,
            "stuck_envs": self.stuck_envs,
            "abandoned_tool_threads": self.abandoned_tool_threads,
            "lost": list(self.lost),
            "rerun": self.rerun,
            "per_node": dict(self.per_node),
            "engine_restarts": self.engine_restarts,
            "startup_s": self.startup_s,
            "context_resets": self.context_resets,
            "groups": len(self.group_rewards),
            "groups_with_signal": self.group_signal().with_signal,
        }


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]
    stats: RolloutStats
    interrupted: bool = False


@dataclass(frozen=True)
class EpisodeTask:
    """What one episode plays: how its env resets and where its sampling seeds come from.

    ``episode`` names it in the run (``trajectory.metadata["episode"]``, error records);
    turn ``k`` samples with seed ``SeedSequence([*seed_key, k])``, so an episode's samples do
    not depend on what else runs beside it. ``completion_budget`` caps everything after the
    reset's observation (actions and observations, as TRL's ``max_completion_length``): the
    env ends the episode truncated (``"context_length"``) rather than exceed it.
    """

    episode: int
    reset_seed: int | None
    seed_key: tuple[int, ...]
    options: dict[str, Any] | None = None
    completion_budget: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    """Merged into the trajectory's metadata when the episode finishes."""


def plan_tasks(
    ids: Sequence[int],
    seed: int,
    base: SamplingParams | None = None,
    *,
    group_size: int = 1,
    tasks: Sequence[dict[str, Any]] | None = None,
) -> list[EpisodeTask]:
    """The task of every episode of a run.

    Episode ``i`` is in group ``g = i // group_size``: the group's episodes reset with the same
    seed ``seed + g`` (so an env that picks its task from the seed gives them the same task) and
    the same reset options ``tasks[g % len(tasks)]`` when a task list is given; each episode
    samples with its own seeds ``(seed, i, turn)``. With groups or tasks, ``metadata["group"]``
    records ``g`` on every trajectory (and so in the store).
    """
    if group_size < 1:
        raise ValueError(f"need group_size >= 1, got {group_size}")
    if tasks is not None:
        tasks = list(tasks)
        if not tasks:
            raise ValueError("tasks=[] has no task to run: give at least one dict of reset options")
        for k, t in enumerate(tasks):
            if not isinstance(t, dict):
                raise TypeError(f"tasks[{k}] must be a dict of reset options, got {type(t).__name__}")
    grouped = group_size > 1 or tasks is not None
    turns = seed if base is None or base.seed is None else base.seed
    out = []
    for i in ids:
        g = i // group_size
        out.append(EpisodeTask(
            i, seed + g, (turns, i),
            options=None if tasks is None else dict(tasks[g % len(tasks)]),
            metadata={"group": g} if grouped else {},
        ))
    return out


@dataclass
class EpisodeSlot:
    """One env copy and the episode it runs: the per-episode logic every driver shares.

    The turn loop itself is :func:`tokengym.recorder.drivers.runner.play`; this holds its state
    (``begin``, ``params``, ``step``, ``advance``) for every driver that plays it.
    """

    env: RecordEpisodes | None
    """Its env; None until the first :meth:`begin` of a slot made with ``build`` (see :meth:`lazy`)."""
    episode: int = -1
    turn: int = 0
    remaining: int = 0
    task: EpisodeTask | None = None
    retired: bool = False
    """Its env is still inside a step that passed its deadline: no episode runs on it again."""
    build: Callable[[], RecordEpisodes] | None = field(default=None, repr=False)
    """Makes :attr:`env` at the first :meth:`begin`, when the slot was made without one."""
    _merged: tuple[SamplingParams, SamplingParams] | None = field(default=None, init=False, repr=False, compare=False)
    """(base, base with the env's stops): :meth:`params` merges them once an episode."""

    @classmethod
    def lazy(cls, build: Callable[[], RecordEpisodes]) -> EpisodeSlot:
        """A slot whose env is built when its first episode begins: a run of N in flight starts
        its first turns without building N envs first, and builds no env it never uses."""
        return cls(None, build=build)

    @property
    def recorder(self) -> RecordEpisodes:
        """:attr:`env`, built (``begin`` builds it)."""
        if self.env is None:
            raise RuntimeError("this slot's env is built by its first begin()")
        return self.env

    def begin(self, task: EpisodeTask) -> None:
        """Reset for ``task`` (its completion budget passed to the env as a reset option); raises
        what the env raises."""
        from tokengym.envs.chat import COMPLETION_BUDGET

        self.task, self.episode = task, task.episode
        self._merged = None
        if self.env is None:
            assert self.build is not None, "a slot needs an env or a build"
            self.env = self.build()  # a factory's failure fails this episode; the next one tries again
        env = self.env
        options = task.options
        if task.completion_budget is not None:
            if getattr(env.unwrapped, "max_context_tokens", None) is None:
                raise ValueError(
                    f"a completion budget needs an env with max_context_tokens; {type(env.unwrapped).__name__} has none"
                )
            options = {**(options or {}), COMPLETION_BUDGET: task.completion_budget}
        _obs, info = env.reset(seed=task.reset_seed, options=options)
        self.turn = 0
        self.remaining = reset_record(info).remaining_context

    @property
    def stream(self) -> list[int]:
        """The context the policy continues next, read from the env's token stream through the
        recorder (the stream is held once, as int32 there, not again here)."""
        return self.recorder.context_ids()

    def params(self, base: SamplingParams) -> SamplingParams:
        """The sampling settings of this slot's next turn (:func:`turn_params`; the env's stop
        tokens and strings are merged into ``base`` once an episode, not every turn)."""
        assert self.task is not None, "begin() first"
        seed = int(np.random.SeedSequence([*self.task.seed_key, self.turn]).generate_state(1, dtype=np.uint32)[0])
        merged = self._merged
        if merged is None or merged[0] is not base:
            merged = self._merged = (base, with_env_stops(base, self.recorder.unwrapped))
        return merged[1].for_turn(max(1, min(base.max_tokens, self.remaining)), seed)

    def step(self, gen: Generation) -> Any:
        """``env.step`` with the generation; an exception is returned, not raised."""
        try:
            return self.recorder.step(
                gen.token_ids, logprobs=gen.logprobs, finish_reason=gen.finish_reason, versions=gen.versions
            )
        except Exception as err:
            return err

    def advance(self, gen: Generation, result: tuple) -> list[Trajectory] | None:
        """Take a step's result into the stream; the episode's rows when it ended (one, or one per
        context with ``history="deploy"``)."""
        obs, _, terminated, truncated, info = checked_step(result)
        record = step_record(info)
        self.turn += 1
        self.remaining = record.remaining_context
        if not (terminated or truncated):
            return None
        rows = list(info.get("sequences") or [info["trajectory"]])
        for traj in rows:
            traj.metadata["episode"] = self.episode
            if self.task is not None:
                traj.metadata.update(self.task.metadata)
        return rows

    def failure(self, err: BaseException) -> EpisodeError:
        """The record of ``err``, raised during this slot's current turn."""
        return EpisodeError.of(err, self.episode, self.turn)


def checked_step(result: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
    """A step's result as the driver takes it, or a TypeError that names what the env returned
    instead (the episode fails by name; the run goes on)."""
    if not (isinstance(result, tuple) and len(result) == 5):
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise TypeError(f"the env's step returned {got}, not (observation, reward, terminated, truncated, info)")
    obs, reward, terminated, truncated, info = result
    if not (isinstance(obs, np.ndarray) and obs.ndim == 1 and (obs.dtype.kind in "iu" or obs.size == 0)):
        shape = f"{obs.dtype} array of shape {obs.shape}" if isinstance(obs, np.ndarray) else type(obs).__name__
        raise TypeError(f"the env's step returned a {shape} as its observation; a tokengym env returns a 1-D "
                        "integer numpy array of token ids")
    if not isinstance(info, dict):
        raise TypeError(f"the env's step returned a {type(info).__name__} as its info, not a dict")
    return obs, reward, bool(terminated), bool(truncated), info


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


def turn_params(base: SamplingParams, env: Any, remaining: int, seed: int) -> SamplingParams:
    """One turn's sampling settings: ``base`` with the env's stop tokens and strings added, the
    token budget cut to the context left, and the turn's own seed."""
    return with_env_stops(base, env).for_turn(max(1, min(base.max_tokens, remaining)), seed)


def with_env_stops(base: SamplingParams, env: Any) -> SamplingParams:
    """``base`` with ``env``'s stop tokens and strings added (each once, in order)."""
    return base.replace(
        stop_token_ids=tuple(dict.fromkeys([*base.stop_token_ids, *getattr(env, "stop_token_ids", ())])),
        stop_strings=tuple(dict.fromkeys([*base.stop_strings, *getattr(env, "stop_strings", ())])),
    )


def record_finished(
    stats: RolloutStats,
    rows: list[Trajectory],
    done: list[Trajectory],
    on_episode: Callable[[Trajectory], None] | None,
    bar: Any,
) -> None:
    """Hand a finished episode's rows (one per context; usually one) to ``on_episode``, count the
    episode once, keep its rows, and move the progress bar.

    A stop signal waits until all of it is done, so an episode is stored and counted, or neither.
    If ``on_episode`` raises (a full disk), the episode is neither counted nor kept.
    """
    with uninterrupted():
        if on_episode is not None:
            for traj in rows:
                on_episode(traj)
        _account(stats, rows)
        done.extend(rows)
    bar.update(1)
    bar.finished(stats)


def _account(stats: RolloutStats, rows: list[Trajectory]) -> None:
    # One pass over each row's segments and conformance records: the trajectory's own views (its
    # mask, its action list, its conformance summary) would build arrays and lists for a count.
    stats.episodes += 1
    episode_return = 0.0
    finish, conformance = stats.finish_reasons, stats.conformance
    for traj in rows:
        for seg in traj.segments:
            n = len(seg.token_ids)
            stats.tokens += n
            if seg.kind is SegmentKind.ACTION:
                stats.policy_tokens += n
                stats.turns += 1
                episode_return += seg.reward
                finish[seg.finish_reason or "unknown"] += 1
        for result in traj.conformance:
            status = result.get("status", "off")
            if status in _COUNTED:
                conformance[status] += 1
    stats.reward_sum += episode_return
    stats.stop_reasons[rows[-1].stop_reason or "?"] += 1
    if len(rows) > 1:
        stats.context_resets += len(rows) - 1
    if "group" in rows[-1].metadata:
        stats.group_rewards.setdefault(rows[-1].metadata["group"], []).append(episode_return)
    add_tool_stats(stats.tool_calls, rows[-1].metadata.get("tool_stats"))


_COUNTED = frozenset({"ok", "known", "mismatch", "deferred"})
"""The conformance statuses a run counts (:attr:`RolloutStats.conformance`)."""


class Progress:
    """The run's progress bar: one step per finished (or failed) episode, with the policy tokens
    and turns so far and the live policy tokens/s.

    A policy that samples in this process (:class:`~tokengym.policies.StreamsTokens`, e.g.
    HFPolicy) reports its tokens step by step (:meth:`live`), so the count moves while the first
    turns are still generating: with a slow model on a CPU a turn takes minutes. Other engines
    are counted when a turn comes back (:meth:`turn_done`). The bar is redrawn at most twice a
    second for either.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        import threading

        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="episodes", unit="ep", disable=not enabled, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.generated = 0
        """Policy tokens of the turns that came back."""
        self.sampled = 0
        """Policy tokens sampled so far, as a streaming policy reported them (turns still running included)."""
        self.turns = 0
        """Turns whose generation came back."""
        self.reward: str | None = None
        self._shown = 0.0
        self._lock = threading.Lock()  # a streaming policy reports from its own decode thread

    @property
    def tokens_so_far(self) -> int:
        """The policy tokens the bar shows: sampled so far, or (for engines that do not stream) those of finished turns."""
        return max(self.generated, self.sampled)

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def live(self, n: int) -> None:
        """A streaming policy sampled ``n`` more tokens (a :data:`~tokengym.policies.TokenListener`)."""
        with self._lock:
            self.sampled += n
        self._maybe_show()

    def turn_done(self, n: int) -> None:
        """A turn's generation came back with ``n`` policy tokens."""
        with self._lock:
            self.generated += n
            self.turns += 1
        self._maybe_show()

    def tokens(self, n: int) -> None:
        """``n`` more policy tokens were generated in a turn that came back (:meth:`turn_done`)."""
        self.turn_done(n)

    def finished(self, stats: RolloutStats) -> None:
        """An episode was recorded: show the mean reward so far."""
        with self._lock:
            self.reward = f"{stats.mean_reward:.3f}"
            self.generated = max(self.generated, stats.policy_tokens)  # drivers that do not count live
            self.turns = max(self.turns, stats.turns)
        self._maybe_show()  # a redraw each episode cost 3 ms (at 1,000 in flight, a third of a turn's driver)

    def _maybe_show(self) -> None:
        now = time.perf_counter()
        if now - self._shown >= 0.5:
            self._show(now)

    def _show(self, now: float) -> None:
        with self._lock:
            self._shown = now
            tokens = self.tokens_so_far
            fields = {"tok": str(tokens), "tok_s": f"{tokens / max(now - self.start, 1e-9):.0f}", "turns": str(self.turns)}
            if self.reward is not None:
                fields["reward"] = self.reward
            self.bar.set_postfix(fields)

    def close(self) -> None:
        self._show(time.perf_counter())  # the last numbers, whenever the last redraw was
        self.bar.close()


def progress_bar(total: int, enabled: bool) -> Progress:
    """The progress bar of a run of ``total`` episodes (silent unless ``enabled``)."""
    return Progress(total, enabled)
