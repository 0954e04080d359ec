"""One dataset row's episode, played inside a trainer with the trainer's own inference engine.

verl's agent loop and SkyRL's generator hand tokengym the same job: a row names an env (and its
reset seed and options), the trainer owns the engine, and tokengym plays the episode through its
one turn loop (:func:`~tokengym.recorder.drivers.runner.play`), token ids in and out. What they
share is here: the row's :class:`~tokengym.recorder.drivers.episodes.EpisodeTask`, the sampling
dict a vLLM-style engine takes, the finish reason of what it returned, and the episode played with
its resets and steps on daemon threads under tokengym's deadlines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from tokengym.policies import Generation, SamplingParams
from tokengym.policies.base import FinishReason, finish_reason

from ..drivers.episodes import EpisodeSlot, EpisodeTask
from ..drivers.runner import Outcome, play, steps_wait
from ..drivers.step_pool import Deadlines, StepThreads
from ..wrapper import RecordEpisodes

__all__ = ["STEP_THREADS", "engine_finish_reason", "engine_sampling", "play_row", "row_sampling", "row_task"]

STEP_THREADS = 256
"""Env steps and resets of one trainer worker process that run at once (the rest queue)."""
_THREADS: StepThreads | None = None


def _step_threads() -> StepThreads:
    global _THREADS
    if _THREADS is None:
        _THREADS = StepThreads(STEP_THREADS, name="tokengym-trainer-env")
    return _THREADS


def row_task(extra: Mapping[str, Any], *, seed: int, completion_budget: int | None) -> EpisodeTask:
    """The episode a row asks for: ``extra["seed"]`` and ``extra["options"]`` reset the env, and
    ``extra["episode"]`` seeds turn ``k`` with ``(seed, episode, k)`` as ``rollout()`` does (without
    it, the turns are sampled unseeded: ``seed_key`` is the run's seed alone)."""
    episode = extra.get("episode")
    return EpisodeTask(
        episode=int(episode) if episode is not None else 0,
        reset_seed=None if extra.get("seed") is None else int(extra["seed"]),
        seed_key=(seed, int(episode)) if episode is not None else (seed,),
        options=dict(extra["options"]) if extra.get("options") else None,
        completion_budget=completion_budget,
    )


def row_sampling(params: Mapping[str, Any], max_tokens: int) -> SamplingParams:
    """tokengym's base sampling from a trainer's (vLLM-style) temperature, top_p and top_k."""
    top_k = int(params.get("top_k", -1) or -1)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=max(top_k, 0),  # vLLM's -1 and tokengym's 0 both mean off
    )


def engine_sampling(base: Mapping[str, Any], params: SamplingParams) -> dict[str, Any]:
    """The sampling dict of one engine call (vLLM's names): the trainer's own (temperature, top_p,
    top_k, logprobs...) with the turn's token budget and the env's stops, tokengym's way: only the
    env's stop tokens and strings end a turn (``ignore_eos``), and a seeded turn keeps its seed."""
    out = {**base, "max_tokens": int(params.max_tokens), "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True}
    if params.stop_strings:
        out.update(stop=list(params.stop_strings), include_stop_str_in_output=True)
    if params.seed is not None:
        out["seed"] = int(params.seed)
    return out


def engine_finish_reason(ids: list[int], params: SamplingParams, tokenizer: Any, engine: str) -> FinishReason:
    """Why the engine stopped: only the env's stops and the turn's budget end a turn (``ignore_eos``)."""
    reason = finish_reason(ids, params, tokenizer)
    if reason is None:
        raise RuntimeError(
            f"{engine} stopped after {len(ids)} of {params.max_tokens} tokens on none of the env's stop tokens or "
            "strings: does it honour ignore_eos and stop_token_ids?"
        )
    return reason


async def play_row(
    env: Any,
    task: EpisodeTask,
    base: SamplingParams,
    generate: Callable[[list[int], SamplingParams], Awaitable[Generation]],
    deadlines: Deadlines,
    timings: dict[str, float] | None = None,
) -> Outcome:
    """Play ``task`` on ``env`` (recorded here) with ``generate``; its reset and steps run on
    daemon threads (a step past its deadline never holds the trainer's exit) unless the env says
    its steps never wait. ``timings["env_s"]`` adds up the time spent in the env."""
    loop = asyncio.get_running_loop()
    threaded = steps_wait(env)

    async def on_thread(fn: Any, arg: Any) -> Any:
        return await asyncio.wrap_future(_step_threads().submit(fn, arg)) if threaded else fn(arg)

    async def step(s: EpisodeSlot, gen: Generation) -> Any:
        start = loop.time()
        try:
            return await on_thread(s.step, gen)
        finally:
            if timings is not None:
                timings["env_s"] = timings.get("env_s", 0.0) + loop.time() - start

    async def begin(s: EpisodeSlot, t: EpisodeTask) -> None:
        await on_thread(s.begin, t)

    return await play(EpisodeSlot(RecordEpisodes(env)), task, base, generate, step, deadlines, begin)
