"""SkyRL: :class:`TokenGymGenerator`, a SkyRL generator that plays tokengym envs token in, token out.

SkyRL's trainer asks its generator for a batch (``await generator.generate(input_batch)``) and
trains on the ``GeneratorOutput`` it returns. This generator plays one tokengym episode per row
of the batch through tokengym's one turn loop (:func:`~tokengym.recorder.drivers.runner.play`),
every turn through SkyRL's own inference engine client
(``client.generate(InferenceEngineInput(prompt_token_ids=[context], session_ids=[episode], ...))``):
the sampled ids and logprobs go straight into the env, never decoded and re-encoded, unlike the
text adapter (:mod:`tokengym.recorder.integrations.skyrl`) that SkyRL's own text generator needs.

A row is configured as the verl agent loop's (:mod:`tokengym.recorder.integrations.verl`): its
``env_extras`` hold ``env_id`` (else the generator's ``env_id``, else the row's ``env_classes``
entry), ``seed`` and ``options`` (the env's reset) and optionally ``episode`` (turn ``k`` samples
with seed ``(seed, episode, k)``, as ``tokengym.recorder.rollout`` does, so the rows are
``rollout()``'s token for token). The row's prompt messages are not used: the env makes its prompt.

The output, per row: ``prompt_token_ids`` (the reset observation), ``response_ids`` (every action
and observation after it), ``loss_masks`` (1 on actions), ``rollout_logprobs`` (0.0 on observation
tokens), ``rewards`` per token (each turn's reward on its action's last token: per-turn credit
survives; their sum is the episode's return), ``stop_reasons`` (the episode's), the batch's
``trajectory_ids``, and in ``env_metrics`` each row's env id, turn rewards, tool rewards,
conformance summary and error. A row that cannot be played (an unknown env, a reset that raises,
an episode of several sequences with ``history="deploy"``) fails alone: one masked token, reward
0.0, ``stop_reasons`` "error" and the error in its ``env_metrics``, logged; the batch goes on.

Needs ``skyrl`` (0.3.0, on Python >= 3.12: its pydantic models refuse Python 3.11), imported when
this module is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

try:
    from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInput, InferenceEngineInterface
    from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"tokengym's SkyRL generator needs SkyRL's generator interface ({err}): on Python >= 3.12, pip install "
        "skyrl==0.3.0 skyrl-gym==0.4.0 loguru aiohttp (docs/integrations.md)"
    ) from err

from tokengym.policies import Generation, SamplingParams
from tokengym.policies.base import agenerate

from ..drivers.episodes import EpisodeError, env_factory
from ..drivers.step_pool import Deadlines
from ..trajectory import Trajectory
from .rows import engine_finish_reason, engine_sampling, play_row, row_sampling, row_task

__all__ = ["PolicyInferenceEngine", "TokenGymGenerator", "generator_row"]

log = logging.getLogger("tokengym.skyrl")


def generator_row(traj: Trajectory) -> dict[str, Any]:
    """One recorded episode as the fields of one ``GeneratorOutput`` row (see the module docstring)."""
    ids, mask, p = traj.token_ids, traj.mask, traj.prompt_len
    rewards = np.zeros(len(ids) - p, dtype=np.float64)
    for (_, end), action in zip(traj.action_spans, traj.actions):
        rewards[max(end - 1 - p, 0)] += action.reward  # an empty action's reward goes on the token before it
    logprobs = None
    if traj.has_logprobs:
        logprobs = np.where(mask[p:] == 1, np.nan_to_num(traj.logprobs[p:], nan=0.0), 0.0).astype(np.float32).tolist()
    return {
        "prompt_token_ids": ids[:p].tolist(),
        "response_ids": ids[p:].tolist(),
        "loss_masks": mask[p:].astype(np.int64).tolist(),
        "rewards": rewards.tolist(),
        "rollout_logprobs": logprobs,
        "stop_reasons": traj.stop_reason,
        "env_metrics": {
            "env_id": traj.env_id,
            "turn_rewards": traj.turn_rewards.tolist(),
            "tool_rewards": list(traj.metadata.get("tool_rewards") or []),
            "conformance": traj.conformance_summary,
            "tokengym_error": None,
            "versions": traj.versions[p:].tolist() if traj.has_versions else None,
            "version_span": traj.version_span,
        },
    }


def _failed_row(error: str, env_id: str | None, filler: int) -> dict[str, Any]:
    return {
        "prompt_token_ids": [filler], "response_ids": [filler], "loss_masks": [0], "rewards": [0.0],
        "rollout_logprobs": [0.0], "stop_reasons": "error",
        "env_metrics": {"env_id": env_id, "turn_rewards": [], "tool_rewards": [], "conformance": {}, "tokengym_error": error,
                        "versions": None, "version_span": None},
    }  # fmt: skip


class TokenGymGenerator(GeneratorInterface):
    """A SkyRL generator that plays one tokengym episode per row, with SkyRL's inference engine client.

    Args:
        inference_engine_client: SkyRL's ``InferenceEngineInterface`` (its client over vLLM
            servers, or :class:`PolicyInferenceEngine` over a tokengym policy).
        tokenizer: the policy's tokenizer; the envs render with it.
        env_id: the env of rows whose ``env_extras`` name none.
        env_kwargs: passed to the env (the tokenizer is the generator's).
        sampling: the engine's sampling settings (vLLM's names: ``temperature``, ``top_p``,
            ``top_k``, ``logprobs``...) for batches that bring none.
        max_tokens: one turn's token budget (every turn is also cut to the env's context budget).
        seed: the run's sampling seed, used for rows whose ``env_extras`` name an ``episode``.
        policy_model_name: the ``model`` of each ``generate`` call (SkyRL's LoRA adapters).
        step_timeout_s, turn_timeout_s: tokengym's :class:`~tokengym.recorder.Deadlines`.
    """

    def __init__(
        self,
        inference_engine_client: InferenceEngineInterface,
        tokenizer: Any,
        *,
        env_id: str | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        max_tokens: int = 1024,
        seed: int = 0,
        policy_model_name: str | None = None,
        step_timeout_s: float | None = 600.0,
        turn_timeout_s: float | None = 3600.0,
    ) -> None:
        if int(max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        self.inference_engine_client = inference_engine_client
        self.tokenizer = tokenizer
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.sampling = dict(sampling or {"temperature": 1.0, "logprobs": 0})
        self.max_tokens = int(max_tokens)
        self.seed = int(seed)
        self.policy_model_name = policy_model_name
        self.deadlines = Deadlines(step_s=step_timeout_s, generate_s=turn_timeout_s)

    async def generate(self, input_batch: GeneratorInput, disable_tqdm: bool = False) -> GeneratorOutput:
        n = len(input_batch["prompts"])
        extras: Sequence[Mapping[str, Any] | None] = input_batch.get("env_extras") or [None] * n
        classes: Sequence[str] = input_batch.get("env_classes") or [""] * n
        sampling = dict(input_batch.get("sampling_params") or self.sampling)
        start = time.perf_counter()
        rows = await asyncio.gather(*(self._row(dict(e or {}), c, sampling) for e, c in zip(extras, classes)))
        took = time.perf_counter() - start
        failed = sum(r["stop_reasons"] == "error" for r in rows)
        with_logprobs = all(r["rollout_logprobs"] is not None for r in rows)
        return GeneratorOutput(
            prompt_token_ids=[r["prompt_token_ids"] for r in rows],
            response_ids=[r["response_ids"] for r in rows],
            rewards=[r["rewards"] for r in rows],
            loss_masks=[r["loss_masks"] for r in rows],
            stop_reasons=[r["stop_reasons"] for r in rows],
            rollout_metrics={
                "tokengym/episodes": n - failed,
                "tokengym/failed": failed,
                "tokengym/mean_return": float(np.mean([sum(r["rewards"]) for r in rows])) if rows else 0.0,
                "tokengym/response_tokens": int(sum(len(r["response_ids"]) for r in rows)),
            },
            rollout_logprobs=[r["rollout_logprobs"] for r in rows] if with_logprobs else None,
            trajectory_ids=input_batch.get("trajectory_ids"),
            trajectory_generation_times=[took] * n,
            rollout_expert_indices=None,
            is_last_step=None,
            env_metrics=[r["env_metrics"] for r in rows],
            pixel_values=None,
            image_grid_thw=None,
        )

    async def _row(self, extra: dict[str, Any], env_class: str, sampling: Mapping[str, Any]) -> dict[str, Any]:
        env_id = extra.get("env_id") or self.env_id or env_class
        filler = int(self.tokenizer.eos_token_id or 0)
        if not env_id:
            return self._fail("no env: give env_id to the generator or env_extras['env_id'] in the row", None, filler)
        try:
            env = env_factory(str(env_id), {**self.env_kwargs, "tokenizer": self.tokenizer})()
        except Exception as err:  # noqa: BLE001 -- this row fails, not the batch
            return self._fail(f"cannot make {env_id!r}: {type(err).__name__}: {err}", env_id, filler)
        try:
            outcome = await self._play(env, extra, sampling)
        finally:
            env.close()
        if isinstance(outcome, EpisodeError):
            return self._fail(str(outcome), env_id, filler)
        if len(outcome) != 1:
            return self._fail(
                f"the episode was recorded as {len(outcome)} sequences (history='deploy'); one SkyRL row is one "
                "sequence: use the env's default history", env_id, filler,
            )  # fmt: skip
        return generator_row(outcome[0])

    def _fail(self, error: str, env_id: str | None, filler: int) -> dict[str, Any]:
        log.error("tokengym SkyRL generator: %s", error)
        return _failed_row(error, env_id, filler)

    async def _play(self, env: Any, extra: dict[str, Any], sampling: Mapping[str, Any]) -> Any:
        task = row_task(extra, seed=self.seed, completion_budget=None)
        base = row_sampling(sampling, self.max_tokens)
        session = f"tokengym-{id(env):x}-{time.monotonic_ns()}"  # one session per episode: one engine keeps its prefix
        seeded = extra.get("episode") is not None

        async def generate(context: list[int], params: SamplingParams) -> Generation:
            if not seeded:
                params = params.replace(seed=None)
            request = InferenceEngineInput(
                prompts=None, prompt_token_ids=[list(map(int, context))], sampling_params=engine_sampling(sampling, params),
                session_ids=[session], mm_features=None, cache_salt=None,
            )  # fmt: skip
            out = await self.inference_engine_client.generate(request, model=self.policy_model_name)
            ids = [int(t) for t in out["response_ids"][0]]
            lps = out.get("response_logprobs")
            lps = lps[0] if lps else None
            versions = out.get("response_versions")  # PolicyInferenceEngine's; a served engine says none
            return Generation(np.array(ids, dtype=np.int64), None if lps is None else np.array(lps, dtype=np.float32),
                              engine_finish_reason(ids, params, self.tokenizer, "SkyRL's inference engine"),
                              versions=None if not versions or versions[0] is None else np.array(versions[0]))

        return await play_row(env, task, base, generate, self.deadlines)


class PolicyInferenceEngine(InferenceEngineInterface):
    """A tokengym policy (``HFPolicy``, ``ScriptedPolicy``, ...) as SkyRL's inference engine: its
    ``generate`` takes token-id prompts and returns the sampled ids, their logprobs and why each
    stopped. For running SkyRL's generators on a CPU, with no vLLM; the other engine methods
    (weight sync, sleep, HTTP endpoints) are for served engines and raise."""

    def __init__(self, policy: Any, tokenizer: Any, name: str = "tokengym-policy") -> None:
        self.policy, self.tokenizer, self._name = policy, tokenizer, name

    @property
    def model_name(self) -> str:
        return self._name

    async def generate(self, input_batch: InferenceEngineInput, model: str | None = None) -> dict[str, Any]:
        contexts = input_batch.get("prompt_token_ids")
        if not contexts:
            raise ValueError("PolicyInferenceEngine takes token-id prompts (prompt_token_ids), not messages")
        gens = await agenerate(self.policy, contexts, _policy_sampling(input_batch.get("sampling_params") or {}))
        return {
            "responses": [self.tokenizer.decode(g.token_ids.tolist(), skip_special_tokens=True) for g in gens],
            "response_ids": [g.token_ids.tolist() for g in gens],
            "stop_reasons": [g.finish_reason for g in gens],
            "response_logprobs": [g.logprobs.tolist() for g in gens] if all(g.logprobs is not None for g in gens) else None,
            "response_versions": [None if g.versions is None else g.versions.tolist() for g in gens],
            "prompt_logprobs": None,
            "rollout_expert_indices": None,
        }

    def _served_only(self, what: str) -> Any:
        raise NotImplementedError(f"PolicyInferenceEngine has no {what}: it serves generate() only (a served engine has the rest)")

    def get_endpoint_url(self) -> str:
        return self._served_only("HTTP endpoint")

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        return self._served_only("chat completions (token-in, token-out only)")

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        return self._served_only("chat rendering")

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        return self._served_only("completions endpoint")

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def init_weight_update_communicator(self, init_info: Any) -> None:
        return self._served_only("weight sync")

    async def update_named_weights(self, request: Any) -> None:
        return self._served_only("weight sync")

    async def teardown(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        return None

    async def pause_generation(self) -> None:
        return self._served_only("pause (SkyRL's fully async trainer pauses served engines)")

    async def resume_generation(self) -> None:
        return self._served_only("resume")

    async def finish_session(self, session_id: str) -> None:
        return None

    async def get_world_size(self) -> tuple[int, int]:
        return 1, 1


def _policy_sampling(d: Mapping[str, Any]) -> SamplingParams:
    """tokengym's :class:`SamplingParams` from the vLLM-style dict :func:`engine_sampling` writes."""
    return row_sampling(d, int(d.get("max_tokens", 1024))).replace(
        seed=None if d.get("seed") is None else int(d["seed"]),
        stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids") or ()),
        stop_strings=tuple(d.get("stop") or ()),
    )
