"""The rollout driver: many episodes at once through one policy, each recorded.

By default every episode runs at its own pace (:func:`tokengym.recorder.drivers.runner.drive`): it
submits its next turn as soon as its env step is done, and the policy batches whatever is in
flight, so a long generation or a slow tool holds up only its own episode. ``schedule="lockstep"``
keeps the older rounds (every live episode generates in one batch, then every env steps) for
comparison, through the same turn loop, gated. Finished episodes are recorded as they finish and replaced until the requested
number is done. Seeds make a run reproducible with a deterministic policy: episode ``i``
resets with ``seed + i`` and each of its turns samples with a seed derived from
``(seed, i, turn)``, whatever else shares its batch and however the episodes interleave.

One episode's logic is :class:`~tokengym.recorder.drivers.episodes.EpisodeSlot` and its turn loop
:func:`tokengym.recorder.drivers.runner.play`, shared with the Ray backend
(:mod:`tokengym.recorder.drivers.ray_backend`, ``backend="ray"``: each episode in an env worker actor
against a policy engine actor) and TRL's ``rollout_func``, so a run gives the same
trajectories, token for token, on every driver.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import gymnasium as gym

from tokengym.policies import Generation, Policy, SamplingParams, StreamsTokens
from tokengym.policies.batching import RequestBatcher

from .episodes import (  # the shared names stay importable from here, where they were first
    EpisodeError,
    EpisodeSlot,
    EpisodeTask,
    PolicyFactory,
    plan_tasks,
    RolloutResult,
    RolloutStats,
    build_policy,
    env_factory,
    episode_ids,
    is_policy,
    progress_bar,
    record_finished,
    sampling_record,
    turn_params,
    turn_seed,
)
from .runner import Outcome, drive
from .step_pool import Deadlines
from ..trajectory import Trajectory
from ..views import tool_calls_line
from ..wrapper import RecordEpisodes

__all__ = [
    "EpisodeError",
    "PolicyFactory",
    "RolloutResult",
    "RolloutStats",
    "episode_ids",
    "rollout",
    "summary_table",
    "turn_params",
    "turn_seed",
]


def rollout(
    make_env: Callable[[], gym.Env] | str,
    policy: Policy | PolicyFactory | str,
    *,
    episodes: int | Sequence[int] | None = None,
    concurrency: int = 8,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    env_kwargs: dict[str, Any] | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
    progress: bool = True,
    backend: str | Any = "local",
    address: str | None = None,
    schedule: str = "async",
    group_size: int = 1,
    tasks: Sequence[dict[str, Any]] | None = None,
    deadlines: Deadlines | None = None,
) -> RolloutResult:
    """Run ``episodes`` episodes, ``concurrency`` at a time, and return their trajectories.

    Args:
        episodes: how many (episodes ``0 .. n-1``), or which episode indices to run: episode
            ``i`` always resets with seed ``seed + i``, so running the indices a stopped run
            did not finish continues it with the same seeds.
        make_env: a factory of tokengym envs, or a registered id (made with ``env_kwargs``).
        policy: any :class:`tokengym.policies.Policy`, or a zero-argument factory of one
            (``functools.partial(VLLMPolicy, "model", ...)``): with ``backend="ray"`` each engine
            actor builds its own (a policy instance is pickled into the engine instead). A string
            names a model for :class:`~tokengym.policies.HFPolicy` on the CPU (``"smollm2"``: the
            bundled SmolLM2-135M-Instruct, no hub; or a folder or hub name): an env named by id
            then gets the model's tokenizer unless ``env_kwargs`` has one, and with SmolLM2 a
            tool env gets ``CHATML_TOOLS`` (:func:`tokengym.recorder.drivers.model_setup.model_policy`;
            a line on stderr says which template, unless ``progress=False``).
        sampling: the base settings; each env's stop tokens and stop strings are added and
            ``max_tokens`` is clamped to the context the env has left.
        on_episode: called with each finished trajectory as it finishes (e.g. a store's ``write``);
            an episode that started new contexts (``history="deploy"``) gives one per context.
        group_size: episodes per task, for GRPO: episode ``i`` is in group ``i // group_size``,
            whose episodes reset alike (seed ``seed + group``, the same ``tasks`` entry) and sample
            with their own seeds; ``trajectory.metadata["group"]`` names the group.
        tasks: reset options per group (``tasks[group % len(tasks)]``: cycled); with
            ``episodes=None`` each task runs once (``len(tasks) * group_size`` episodes). Without
            it the env picks each group's task from the group's seed.
        backend: ``"local"`` (the default: this process, no Ray), ``"processes"`` (env steps in
            local worker processes, the policy here:
            :class:`~tokengym.recorder.drivers.process_backend.ProcessBackend` with its defaults), ``"ray"``
            (env workers and policy engines as Ray actors,
            :class:`~tokengym.recorder.drivers.ray_backend.RayBackend` with its defaults), or a
            configured ``ProcessBackend`` or ``RayBackend``.
        address: with ``backend="ray"``: the cluster to connect to (``"auto"``, ``"HOST:PORT"``,
            ``"ray://HOST:10001"``); None starts a local Ray unless one is connected already.
        schedule: with the local backend, ``"async"`` (the default: each episode submits its next
            turn as soon as its env step is done, and the policy batches what is in flight) or
            ``"lockstep"`` (rounds: every live episode generates in one batch, then every env
            steps; kept for comparison). Both give the same trajectories for the same seeds.
        deadlines: how long one env step (or reset) and one policy turn may take
            (:class:`~tokengym.recorder.drivers.step_pool.Deadlines`; default 600 s and 3600 s): an
            episode past one fails with ``EpisodeTimeout`` and the run goes on; an env copy whose
            step hung takes no more episodes (``stats.stuck_envs``; a Ray env worker makes a fresh
            copy in its place).

    Ctrl-C and SIGTERM stop the run cleanly (in the main thread): every finished episode is
    returned (and was passed to ``on_episode``); the unfinished ones are dropped whole, never
    half-recorded; ``result.interrupted`` and ``stats.not_run`` say so. A failed episode (its
    env or the policy raised) does not stop the run: it is counted in ``stats.failed`` and
    described in ``stats.errors``.
    """
    ids = _episodes_of(episodes, group_size, tasks)
    if concurrency < 1:
        raise ValueError(f"need concurrency >= 1, got {concurrency}")
    if isinstance(policy, (str, os.PathLike)):
        from .model_setup import model_policy

        policy, env_kwargs, note = model_policy(policy, make_env, env_kwargs, local=backend == "local")
        if note and progress:
            print(note, file=sys.stderr, flush=True)
    base = sampling or SamplingParams()
    if isinstance(backend, str):
        if backend not in ("local", "processes", "ray"):
            raise ValueError(f'unknown backend {backend!r}: use "local", "processes", "ray", or a ProcessBackend or RayBackend')
        if backend != "ray" and address is not None:
            raise ValueError("address= is for backend='ray'")
        if backend == "processes":
            from .process_backend import ProcessBackend

            backend = ProcessBackend()
        elif backend == "ray":
            from .ray_backend import RayBackend

            backend = RayBackend(address=address)
    elif address is not None:
        raise ValueError("a configured backend brings its own address: RayBackend(address=...)")
    if not isinstance(backend, str):
        if schedule != "async":
            raise ValueError(f"schedule='lockstep' is local only: {type(backend).__name__} runs every episode at its own pace")
        return backend.run(
            make_env, policy, episodes=ids, concurrency=concurrency, sampling=base, seed=seed,
            env_kwargs=env_kwargs, on_episode=on_episode, progress=progress, group_size=group_size, tasks=tasks,
            deadlines=deadlines,
        )
    if schedule not in ("async", "lockstep"):
        raise ValueError(f'unknown schedule {schedule!r}: use "async" (the default) or "lockstep"')
    owned = not is_policy(policy)  # built here from a factory: closed here too
    policy = build_policy(policy)
    make_env = env_factory(make_env, env_kwargs)
    record = sampling_record(base, getattr(policy, "name", type(policy).__name__), getattr(policy, "logprob_kind", "none"), seed)
    stats = RolloutStats(requested=len(ids))
    done: list[Trajectory] = []
    def build() -> RecordEpisodes:
        return RecordEpisodes(make_env(), keep=False, sampling=record)

    # One env now (a factory that cannot build fails the run here, and its kind decides where steps
    # run); the others as their slots take their first episodes.
    n_slots = min(concurrency, len(ids))
    slots = [EpisodeSlot(build()), *(EpisodeSlot.lazy(build) for _ in range(n_slots - 1))] if n_slots else []
    planned = plan_tasks(ids, seed, base, group_size=group_size, tasks=tasks)
    bar = progress_bar(len(ids), progress)
    # A policy sampling here reports each decode step: the bar moves before the first turn is back.
    unlisten = policy.add_token_listener(bar.live) if progress and isinstance(policy, StreamsTokens) else None
    start = time.perf_counter()
    run = partial(_async, rounds=schedule == "lockstep", deadlines=deadlines)
    interrupted = False
    try:
        interrupted = run(slots, planned, base, policy, stats, lambda rows: record_finished(stats, rows, done, on_episode, bar), bar)
    finally:
        if unlisten is not None:
            unlisten()
        bar.close()
        stats.wall_s = time.perf_counter() - start
        stats.stuck_envs = sum(s.retired for s in slots)
        for s in sorted(slots, key=lambda s: s.retired):  # a hung step's env last: closing it may free the step
            if s.env is None:  # never took an episode: never built
                continue
            try:
                s.env.close()
            except Exception:
                if not s.retired:
                    raise
        if owned and hasattr(policy, "close"):
            policy.close()
        from tokengym.envs import abandoned_threads

        stats.abandoned_tool_threads = abandoned_threads()
    stats.interrupted = interrupted
    done.sort(key=lambda t: (t.metadata["episode"], t.metadata.get("sequence", 0)))
    return RolloutResult(done, stats, interrupted)


def _episodes_of(
    episodes: int | Sequence[int] | None, group_size: int, tasks: Sequence[dict[str, Any]] | None
) -> list[int]:
    """The run's episode indices: ``episodes`` (a count, whole groups; or indices), else each task once."""
    if episodes is None:
        if tasks is None:
            raise TypeError("rollout() needs episodes= (a count or indices), or tasks= to run each task once")
        return list(range(len(tasks) * group_size))
    if isinstance(episodes, int) and group_size > 1 and episodes % group_size:
        raise ValueError(
            f"episodes={episodes} is not a multiple of group_size={group_size}: the last group would have "
            f"{episodes % group_size} of its {group_size} members"
        )
    return episode_ids(episodes)


def _failed(stats: RolloutStats, error: EpisodeError, bar: Any) -> None:
    stats.failed += 1
    stats.errors.append(error)
    bar.update(1)


def _async(
    slots: list[EpisodeSlot], tasks: list[EpisodeTask], base: SamplingParams, policy: Policy,
    stats: RolloutStats, finished: Callable[[list[Trajectory]], None], bar: Any, *, rounds: bool = False,
    deadlines: Deadlines | None = None,
) -> bool:
    """Every episode at its own pace (:func:`tokengym.recorder.drivers.runner.drive`), or with
    ``rounds`` in lock-step rounds through the same runner (every live episode's turn in one
    ``policy.generate`` batch, then every env steps); True when stopped."""
    batcher = RequestBatcher(policy, native=not rounds)

    async def generate(context: list[int], params: SamplingParams) -> Generation:
        gen = await batcher.generate(context, params)
        bar.turn_done(len(gen.token_ids))
        return gen

    def on_outcome(task: EpisodeTask, outcome: Outcome) -> None:
        if isinstance(outcome, EpisodeError):
            _failed(stats, outcome, bar)
        else:
            finished(outcome)

    try:
        return drive(slots, tasks, base, generate, on_outcome, rounds=rounds, deadlines=deadlines)
    finally:
        stats.engine_s += batcher.busy_now()
        batcher.close()


def summary_table(stats: RolloutStats) -> str:
    """A short human-readable summary of a run: counts, then why episodes failed, then whether it was stopped."""
    rows: list[tuple[str, str]] = [
        ("episodes", f"{stats.episodes} done, {stats.failed} failed"),
        ("tokens", f"{stats.tokens} ({stats.policy_tokens} from the policy)"),
        ("turns", str(stats.turns)),
        ("mean reward", f"{stats.mean_reward:.3f}"),
        ("stop reasons", ", ".join(f"{k} {v}" for k, v in sorted(stats.stop_reasons.items())) or "-"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(stats.finish_reasons.items())) or "-"),
        ("conformance", ", ".join(f"{k} {v}" for k, v in sorted(stats.conformance.items())) or "-"),
        ("throughput", f"{stats.tokens_per_s:.1f} policy tokens/s, {100 * stats.outside_engine_share:.0f}% of time outside the policy"),
    ]
    if stats.tool_calls.get("calls"):
        rows.append(("tool calls", tool_calls_line(stats.tool_calls)))
    if stats.abandoned_tool_threads:
        rows.append(("tool threads", f"{stats.abandoned_tool_threads} timed-out tool calls still running in the "
                     "background (Python cannot stop a thread; make a tool that may hang async, or run it in a subprocess)"))
    if stats.stuck_envs:
        rows.append(("stuck", f"{stats.stuck_envs} env copies left inside a step that did not return (past its "
                     "deadline, or at the stop); they took no more episodes and were closed"))
    if stats.finish_reasons.get("length"):
        rows.append(("cut", f"{stats.finish_reasons['length']} actions stopped at the token limit (finish reason "
                     "'length'): their answers may be incomplete though the episode counts as done"))
    if stats.context_resets:
        rows.append(("contexts", f"{stats.context_resets} new contexts mid-episode (history='deploy'): "
                     f"{stats.episodes + stats.context_resets} trajectory rows for {stats.episodes} episodes"))
    if stats.group_rewards:
        rows.append(("grpo", stats.group_signal().summary()))
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
        rows.append(("failed" if i == 0 else "", f"{len(errs)} × {kind} (episodes {shown or '-'}); first: {errs[0]}"
                     + (f" (raised at {errs[0].where})" if errs[0].where else "")))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    if stats.interrupted:
        lines.append(
            f"interrupted: {stats.episodes} finished, {stats.not_run} not run"
            f"{f', {stats.failed} failed' if stats.failed else ''} (unfinished episodes were dropped whole)"
        )
    return "\n".join(lines)
