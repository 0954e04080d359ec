"""verl: :class:`TokenGymAgentLoop`, an agent loop that plays any tokengym env inside verl's trainer.

verl's trainer rolls out by itself: its ``AgentLoopWorker`` instantiates one agent loop per
dataset row (``hydra.utils.instantiate`` of the row's ``agent_name`` entry, with verl's own
``trainer_config``, ``server_manager``, ``tokenizer``... beside the entry's keys) and awaits its
``run(sampling_params, **row)``. This loop plays one episode of a tokengym env there, through
tokengym's one turn loop (:func:`~tokengym.recorder.drivers.runner.play`):

* every turn is ``server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``, verl's
  own call, with one request id per episode (verl's load balancer keeps it on one server); its
  token ids and logprobs go straight into the env, never decoded and re-encoded. Only the env's
  stop tokens and strings end a turn (``ignore_eos``, as tokengym's policies do);
* the env renders with the tokenizer verl passes to the loop, so the stream is verl's model's;
* the result is an ``AgentLoopOutput``: ``prompt_ids`` (the reset observation), ``response_ids``
  (every action and observation after it), ``response_mask`` (1 on actions), ``response_logprobs``
  (0.0 on observation tokens, as verl's tool loop writes), ``reward_score`` (the episode's return),
  ``num_turns`` (messages: the prompt, each action, each observation), and in ``extra_fields``
  ``turn_scores`` (each turn's reward, the key verl's tool loop fills), ``tool_rewards``,
  ``stop_reason``, ``conformance``, ``env_id``, ``response_truncated``, ``tokengym_error``, and
  ``versions`` (the weight version of each response token, -1 on observation tokens; None when the
  server did not say) and ``min_global_steps`` / ``max_global_steps`` (verl's names for the oldest
  and newest weights of the row): a turn's version is the ``global_steps`` verl's server manager
  reports for it; a turn whose call spanned a weight update (a partial rollout: its min and max
  differ) has no per-token version, and the row's range still covers it.

Configure it as verl users configure loops, one entry in the ``agent_loop_config_path`` YAML::

    - name: tokengym
      _target_: tokengym.recorder.integrations.verl.TokenGymAgentLoop
      env_id: tokengym/Calculator-v0
      env_kwargs: {max_turns: 3}

and rows that choose it (``agent_name: tokengym``). A row's ``extra_info`` resets the env as the
SkyRL adapter reads it: ``seed``, ``options`` (reset options) and optionally ``env_id`` (overrides
the YAML's) and ``episode`` (turn ``k`` then samples with seed ``(seed, episode, k)``, as
``tokengym.recorder.rollout`` does; without it sampling is unseeded, verl's default, so the
``rollout.n`` copies of a row differ).

The response never exceeds verl's ``response_length``: an env with a context budget gets it as its
completion budget (the episode ends truncated, ``stop_reason="context_length"``, before it would
overflow); an env without one is cut at ``response_length`` and the row says so
(``extra_fields["response_truncated"]``, and a warning). A row that cannot be played (an unknown env
id, bad env kwargs, a reset that raises, a prompt longer than ``prompt_length``, an episode recorded
as several sequences with ``history="deploy"``) fails alone: an empty row with ``reward_score`` 0.0
and the error in ``extra_fields["tokengym_error"]``, logged as an error; the batch goes on.

verl trains on one scalar per row by default (``reward_score`` lands on the row's last token, as
verl's ``rm_scores``); per-turn credit needs an advantage estimator that reads ``turn_scores``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"tokengym's verl agent loop needs verl's agent loop ({err}): pip install --no-deps verl==0.9.1 and the "
        "packages docs/integrations.md lists (hydra-core, omegaconf, ray, tensordict, ...)"
    ) from err

from tokengym.policies import Generation, SamplingParams

from ..drivers.episodes import EpisodeError, env_factory
from ..drivers.step_pool import Deadlines
from ..trajectory import Trajectory
from .rows import engine_finish_reason, engine_sampling, play_row, row_sampling, row_task

__all__ = ["TokenGymAgentLoop", "verl_sampling", "agent_loop_output"]

log = logging.getLogger("tokengym.verl")

verl_sampling = engine_sampling
"""The ``sampling_params`` of one ``server_manager.generate`` call: verl's (temperature, top_p,
top_k, logprobs...) with the turn's token budget and the env's stops, tokengym's way."""


def agent_loop_output(
    traj: Trajectory, *, response_length: int, cut: bool, metrics: dict[str, Any] | None = None
) -> AgentLoopOutput:
    """One recorded episode as verl's ``AgentLoopOutput`` (see the module docstring); ``cut``: a
    response longer than ``response_length`` is cut at its end and flagged (else it is an error)."""
    ids, mask, lps = traj.token_ids, traj.mask, traj.logprobs
    p = traj.prompt_len
    response = ids[p:]
    truncated = len(response) > response_length
    if truncated and not cut:
        raise ValueError(f"the episode's response has {len(response)} tokens, over verl's response_length {response_length}")
    end = p + min(len(response), response_length)
    logprobs = None
    if traj.has_logprobs:
        logprobs = np.where(mask[p:end] == 1, np.nan_to_num(lps[p:end], nan=0.0), 0.0).astype(np.float32).tolist()
    return AgentLoopOutput(
        prompt_ids=ids[:p].tolist(),
        response_ids=ids[p:end].tolist(),
        response_mask=mask[p:end].astype(np.int64).tolist(),
        response_logprobs=logprobs,
        reward_score=float(traj.reward),
        num_turns=len(traj.segments),
        metrics=AgentLoopMetrics(**(metrics or {})),
        extra_fields={
            "turn_scores": traj.turn_rewards.tolist(),
            "tool_rewards": list(traj.metadata.get("tool_rewards") or []),
            "stop_reason": traj.stop_reason,
            "conformance": traj.conformance_summary,
            "env_id": traj.env_id,
            "response_truncated": truncated,
            "tokengym_error": None,
            "versions": traj.versions[p:end].tolist() if traj.has_versions else None,
            "version_span": traj.version_span,
            **_global_steps(traj),
        },
    )


def _global_steps(traj: Trajectory) -> dict[str, int | None]:
    """verl's ``min_global_steps`` / ``max_global_steps`` of a row: its tokens' versions, widened by
    what the server reported for turns it could not stamp (``metadata["global_steps"]``)."""
    span = traj.version_span
    reported = traj.metadata.get("global_steps") or []
    lows = [lo for lo, _ in reported if lo is not None] + ([span[0]] if span else [])
    highs = [hi for _, hi in reported if hi is not None] + ([span[1]] if span else [])
    return {"min_global_steps": min(lows) if lows else None, "max_global_steps": max(highs) if highs else None}


def _failed_output(error: str, env_id: str | None, logprobs: bool) -> AgentLoopOutput:
    return AgentLoopOutput(
        prompt_ids=[],
        response_ids=[],
        response_mask=[],
        response_logprobs=[] if logprobs else None,  # verl batches a field only when every row has it
        reward_score=0.0,
        num_turns=0,
        metrics=AgentLoopMetrics(),
        extra_fields={
            "turn_scores": [], "tool_rewards": [], "stop_reason": "error", "conformance": {}, "env_id": env_id,
            "response_truncated": False, "tokengym_error": error, "versions": None, "version_span": None,
            "min_global_steps": None, "max_global_steps": None,
        },
    )  # fmt: skip


class TokenGymAgentLoop(AgentLoopBase):
    """A verl agent loop that plays one episode of a tokengym env per dataset row.

    Args (the YAML entry's keys; verl's own arguments come beside them):
        env_id: the env (a registered id, ``MODULE:ID`` or an installed package's); a row's
            ``extra_info["env_id"]`` overrides it.
        env_kwargs: passed to the env (the tokenizer is verl's).
        max_tokens: the token budget of one turn (default: verl's ``response_length``, the whole
            response's; every turn is also cut to what is left of it).
        seed: the run's sampling seed, used only for rows whose ``extra_info`` names an ``episode``.
        step_timeout_s, turn_timeout_s: tokengym's :class:`~tokengym.recorder.Deadlines` for one
            env step (or reset) and one generate call; past them the row fails alone.
    """

    def __init__(
        self,
        *args: Any,
        env_id: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
        seed: int = 0,
        step_timeout_s: float | None = 600.0,
        turn_timeout_s: float | None = 3600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.seed = int(seed)
        self.deadlines = Deadlines(step_s=step_timeout_s, generate_s=turn_timeout_s)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        if max_tokens is not None and int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        self.max_tokens = self.response_length if max_tokens is None else min(int(max_tokens), self.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        extra = dict(kwargs.get("extra_info") or {})
        env_id = extra.get("env_id") or self.env_id
        if not env_id:
            return self._fail("no env: give env_id in the agent loop's YAML entry or extra_info['env_id'] in the row", None, sampling_params)
        try:
            env = env_factory(str(env_id), {**self.env_kwargs, "tokenizer": self.tokenizer})()
        except Exception as err:  # noqa: BLE001 -- this row fails, not the batch
            return self._fail(f"cannot make {env_id!r}: {type(err).__name__}: {err}", env_id, sampling_params)
        try:
            return await self._play(env, str(env_id), extra, sampling_params)
        finally:
            env.close()

    def _fail(self, error: str, env_id: str | None, verl_params: Mapping[str, Any]) -> AgentLoopOutput:
        log.error("tokengym agent loop: %s", error)
        return _failed_output(error, env_id, bool(verl_params.get("logprobs")))

    async def _play(self, env: Any, env_id: str, extra: dict[str, Any], verl_params: dict[str, Any]) -> AgentLoopOutput:
        budgeted = getattr(env.unwrapped, "max_context_tokens", None) is not None
        task = row_task(extra, seed=self.seed, completion_budget=self.response_length if budgeted else None)
        base = row_sampling(verl_params, self.max_tokens)
        request_id = uuid.uuid4().hex
        seeded = extra.get("episode") is not None
        timings = {"generate_s": 0.0, "env_s": 0.0}
        loop = asyncio.get_running_loop()
        reported: list[tuple[Any, Any]] = []  # (min, max) global steps of turns that spanned an update

        async def generate(context: list[int], params: SamplingParams) -> Generation:
            if not seeded:
                params = params.replace(seed=None)
            start = loop.time()
            out = await self.server_manager.generate(
                request_id=request_id, prompt_ids=list(map(int, context)), sampling_params=verl_sampling(verl_params, params)
            )
            timings["generate_s"] += loop.time() - start
            if getattr(out, "stop_reason", None) == "aborted":
                raise RuntimeError("verl's server aborted the request")
            ids = [int(t) for t in out.token_ids]
            lps = out.log_probs if out.log_probs else None
            steps = getattr(out, "extra_fields", None) or {}
            lo = steps.get("min_global_steps", steps.get("global_steps"))
            hi = steps.get("max_global_steps", steps.get("global_steps"))
            one = lo is not None and lo == hi and int(lo) >= 0  # one version sampled the whole turn
            if lo is not None and not one:
                reported.append((lo, hi))
            return Generation(np.array(ids, dtype=np.int64), None if lps is None else np.array(lps, dtype=np.float32),
                              engine_finish_reason(ids, params, self.tokenizer, "verl's server"),
                              versions=np.full(len(ids), int(lo), dtype=np.int32) if one else None)

        outcome = await play_row(env, task, base, generate, self.deadlines, timings)
        metrics = {"generate_sequences": timings["generate_s"], "tool_calls": timings["env_s"]}
        if isinstance(outcome, EpisodeError):
            return self._fail(str(outcome), env_id, verl_params)
        if len(outcome) != 1:
            return self._fail(
                f"the episode was recorded as {len(outcome)} sequences (history='deploy'); one verl row is one "
                "sequence: use the env's default history", env_id, verl_params,
            )  # fmt: skip
        traj = outcome[0]
        if reported:
            traj.metadata["global_steps"] = reported
        if traj.prompt_len > self.prompt_length:
            return self._fail(f"the env's prompt has {traj.prompt_len} tokens, over verl's prompt_length {self.prompt_length}", env_id, verl_params)
        out = agent_loop_output(traj, response_length=self.response_length, cut=True, metrics=metrics)
        if out.extra_fields["response_truncated"]:
            log.warning(
                "tokengym agent loop: %s's response (%d tokens) was cut at verl's response_length %d (the env has no "
                "max_context_tokens to end it in time)", env_id, len(traj) - traj.prompt_len, self.response_length,
            )  # fmt: skip
        if not math.isfinite(out.reward_score or 0.0):
            return self._fail(f"the episode's return is {out.reward_score}", env_id, verl_params)
        return out
