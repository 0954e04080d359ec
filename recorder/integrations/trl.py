"""TRL: a ready ``rollout_func`` for ``trl.GRPOTrainer`` that plays tokengym episodes.

TRL's contract (``GRPOTrainer(..., rollout_func=fn)``, experimental in TRL 1.16, pin it):

- ``fn(prompts, trainer)`` is called once per generation batch with the ``prompt`` values
  of this process's slice of the dataset. TRL's sampler has already repeated each prompt
  ``num_generations`` times in a row; ``fn`` returns exactly one completion per entry, in
  order, and TRL computes the group advantages over each run of ``num_generations``
  consecutive completions. Only the prompts reach ``fn``: the dataset's other columns go
  to the reward functions, so the task must be named by the prompt itself.
- It returns ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one per completion token),
  and optionally ``env_mask`` (1 = the policy's token, trained on; 0 = a token the
  environment added, kept out of the loss). TRL right-pads ``completion_ids`` and multiplies
  its loss mask by ``env_mask``. Every other key is handed to the reward functions as a
  keyword argument, one value per completion.
- Without vLLM, TRL recomputes the logprobs it trains on and keeps the returned ones only
  as ``sampling_per_token_logps`` (the off-policy mask reads them; with ``use_vllm`` the
  importance-sampling correction does). They are 0.0 on observation tokens: a NaN there
  would survive TRL's ``* mask`` products. TRL's recomputed logprobs are those of
  ``logits / temperature``; :class:`~tokengym.policies.HFPolicy` reports the raw
  log-softmax, so the two are the same number at ``temperature=1.0`` (TRL's default).

:func:`trl_rollout_func` builds such a function. Its completions are whole multi-turn
episodes: every action and observation after the prompt, token for token as the policy saw
them (``to_trl`` of the recorded trajectories), so the whole completion stays within
``max_completion_length`` as TRL's own tool loop does. By default it samples with the
trainer's own current model through :class:`~tokengym.policies.HFPolicy`, so training is
on-policy; any other :class:`~tokengym.policies.Policy` can be passed instead (e.g. a vLLM
engine whose weights you keep in sync).

Prompts name their task. :func:`trl_prompts` / :func:`trl_dataset` write each one as a small
JSON object, ``{"seed": 3}`` or ``{"seed": 3, "options": {...}}``: the episode resets with
that seed and those options, so the ``num_generations`` copies of a prompt play the same
task and differ only in their sampling. A prompt that is not such an object is the
conversation itself: a list of messages, or a string (one user message), given to the env
as ``reset(options={"messages": ...})`` (a ``ToolEnv`` then has no task data for a reward).

The episode's return reaches the reward functions as the ``env_reward`` keyword (with
``task_id``, ``num_turns`` and ``stop_reason``); :func:`env_reward` is the reward function
that reads it back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym

from tokengym.policies import Policy, SamplingParams
from tokengym.policies.batching import RequestBatcher

from ..batches import to_trl
from ..drivers.episodes import EpisodeError, EpisodeSlot, EpisodeTask
from ..drivers.runner import Outcome, drive
from ..trajectory import Trajectory
from ..wrapper import RecordEpisodes

__all__ = ["TRLRollout", "env_reward", "parse_prompt", "trl_dataset", "trl_prompts", "trl_rollout_func"]


# ------------------------------------------------------------------ prompts
def trl_prompts(n: int, *, seed: int = 0, options: Mapping[str, Any] | None = None) -> list[str]:
    """``n`` task prompts for a TRL dataset: ``{"seed": seed + i}`` (with ``options`` when given), as JSON."""
    spec: dict[str, Any] = {} if options is None else {"options": dict(options)}
    return [json.dumps({"seed": seed + i, **spec}, sort_keys=True) for i in range(n)]


def trl_dataset(n: int, *, seed: int = 0, options: Mapping[str, Any] | None = None) -> Any:
    """A ``datasets.Dataset`` with one ``prompt`` column of :func:`trl_prompts` (needs ``datasets``, as TRL does)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": trl_prompts(n, seed=seed, options=options)})


def parse_prompt(prompt: Any) -> tuple[int | None, dict[str, Any]]:
    """``(seed, options)`` to reset an env with for one TRL prompt (see the module docstring)."""
    if isinstance(prompt, str):
        text = prompt.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError:
                spec = None
            if isinstance(spec, dict) and set(spec) <= {"seed", "options"} and spec:
                seed = spec.get("seed")
                if seed is not None and not isinstance(seed, int):
                    raise ValueError(f"a task prompt's seed must be an integer, got {seed!r}")
                return seed, dict(spec.get("options") or {})
        return None, {"messages": [{"role": "user", "content": prompt}]}
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        return None, {"messages": [dict(m) for m in prompt]}
    raise TypeError(
        "a TRL prompt must be a task prompt from trl_prompts() (JSON with 'seed' / 'options'), "
        f"a list of chat messages, or a string; got {type(prompt).__name__}"
    )


# ------------------------------------------------------------------ rewards
def env_reward(completions: Sequence[Any], env_reward: Sequence[float], **kwargs: Any) -> list[float]:
    """TRL reward function: each episode's return, as recorded by the environment.

    ``GRPOTrainer(reward_funcs=[env_reward], rollout_func=trl_rollout_func(...))``; other
    reward functions can be added beside it (TRL sums them with ``reward_weights``).
    """
    if len(env_reward) != len(completions):
        raise ValueError(f"{len(env_reward)} env rewards for {len(completions)} completions")
    return [float(r) for r in env_reward]


# ------------------------------------------------------------------ rollout
class TRLRollout:
    """The ``rollout_func``: plays one tokengym episode per prompt and returns TRL's dict.

    Build it with :func:`trl_rollout_func`. After each call, :attr:`last_trajectories` holds
    the recorded episodes, in prompt order.
    """

    def __init__(
        self,
        env: str | Callable[[], gym.Env],
        *,
        policy: Policy | None = None,
        max_completion_length: int | None = None,
        max_tokens_per_turn: int | None = None,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        on_episode: Callable[[Trajectory], None] | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.env = env
        self.policy = policy
        self.max_completion_length = max_completion_length
        self.max_tokens_per_turn = max_tokens_per_turn
        self.sampling = sampling
        self.seed = seed
        self.on_episode = on_episode
        self.env_kwargs = dict(env_kwargs or {})
        self.calls = 0
        self.last_trajectories: list[Trajectory] = []
        self._slots: list[EpisodeSlot] = []
        self._renderer: Any = None

    @property
    def envs(self) -> list[RecordEpisodes]:
        """The env copies, reused from call to call (one per prompt of the largest call so far)."""
        return [slot.env for slot in self._slots]

    # ---------------------------------------------------------------- setup
    def _make_env(self, trainer: Any) -> gym.Env:
        if callable(self.env):
            return self.env()
        kwargs = dict(self.env_kwargs)
        if "tokenizer" not in kwargs:
            from tokengym.envs import ChatRenderer

            template = {k: kwargs.pop(k, None) for k in ("chat_template", "template_kwargs")}
            if self._renderer is None:  # one renderer (one template probe) shared by every env
                self._renderer = ChatRenderer(trainer.processing_class, **template)
            kwargs["tokenizer"] = self._renderer
        return gym.make(self.env, **kwargs)

    def _slots_for(self, n: int, trainer: Any) -> list[EpisodeSlot]:
        while len(self._slots) < n:
            self._slots.append(EpisodeSlot(RecordEpisodes(self._make_env(trainer), keep=False)))
        return self._slots[:n]

    def _base_sampling(self, trainer: Any) -> SamplingParams:
        if self.sampling is not None:
            return self.sampling
        args = getattr(trainer, "args", None)
        per_turn = self.max_tokens_per_turn or self._completion_budget(trainer) or 256

        def setting(name: str, default: float) -> Any:
            value = getattr(args, name, None)
            return default if value is None else value

        return SamplingParams(
            max_tokens=per_turn,
            temperature=float(setting("temperature", 1.0)),
            top_p=float(setting("top_p", 1.0)),
            top_k=int(setting("top_k", 0)),
        )

    def _completion_budget(self, trainer: Any) -> int | None:
        if self.max_completion_length is not None:
            return int(self.max_completion_length)
        value = getattr(getattr(trainer, "args", None), "max_completion_length", None)
        return None if value is None else int(value)

    # ----------------------------------------------------------------- call
    def __call__(self, prompts: Sequence[Any], trainer: Any) -> dict[str, list[Any]]:
        specs = [parse_prompt(p) for p in prompts]
        if not specs:
            raise ValueError("rollout_func got no prompts")
        seed = self.seed if self.seed is not None else int(getattr(getattr(trainer, "args", None), "seed", 0) or 0)
        call, self.calls = self.calls, self.calls + 1
        # With several processes TRL may put copies of one prompt on different processes: the
        # process index keeps their sampling seeds apart.
        process = int(getattr(getattr(trainer, "accelerator", None), "process_index", 0) or 0)
        seed = (seed, process)
        if self.policy is not None:
            trajs = self._play(specs, self.policy, trainer, seed, call)
        else:
            trajs = self._play_on_policy(specs, trainer, seed, call)
        self.last_trajectories = trajs
        out: dict[str, list[Any]] = dict(to_trl(trajs))
        out["env_reward"] = [t.reward for t in trajs]
        out["task_id"] = [t.metadata.get("task_id") for t in trajs]
        out["num_turns"] = [t.num_turns for t in trajs]
        out["stop_reason"] = [t.stop_reason for t in trajs]
        return out

    def _play_on_policy(self, specs: list, trainer: Any, seed: tuple[int, int], call: int) -> list[Trajectory]:
        """Sample with the trainer's current model (eval mode while sampling, then restored)."""
        from tokengym.policies import HFPolicy

        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        try:
            slots = self._slots_for(len(specs), trainer)
            tokenizer = getattr(slots[0].env.unwrapped, "tokenizer", None) or trainer.processing_class
            policy = HFPolicy(model, tokenizer, device=trainer.accelerator.device)
            try:
                return self._play(specs, policy, trainer, seed, call)
            finally:
                policy.close()  # its decode loop's thread
        finally:
            model.train(was_training)

    def _play(self, specs: list, policy: Policy, trainer: Any, seed: tuple[int, int], call: int) -> list[Trajectory]:
        """One episode per spec, all at once, each at its own pace (the local driver's runner)."""
        slots = self._slots_for(len(specs), trainer)
        base = self._base_sampling(trainer)
        budget = self._completion_budget(trainer)
        record = {**base.as_dict(), "policy": getattr(policy, "name", type(policy).__name__),
                  "logprob_kind": getattr(policy, "logprob_kind", "none"), "seed": seed[0], "trl_call": call}
        for slot in slots:
            slot.env.sampling = record
        groups = _groups(specs, getattr(getattr(trainer, "args", None), "num_generations", None))
        tasks = [
            EpisodeTask(
                i, reset_seed, (*seed, call, i), options,
                budget if getattr(slot.env.unwrapped, "max_context_tokens", None) is not None else None,
                {"trl": {"call": call, "index": i, "seed": seed[0], "process": seed[1]},
                 "group": f"{seed[1]}:{call}:{groups[i]}"},
            )
            for i, ((reset_seed, options), slot) in enumerate(zip(specs, slots))
        ]
        done: dict[int, Trajectory] = {}
        errors: list[EpisodeError] = []
        batcher = RequestBatcher(policy)

        def on_outcome(task: EpisodeTask, outcome: Outcome) -> None:
            if isinstance(outcome, EpisodeError):
                errors.append(outcome)
                return
            if len(outcome) > 1:
                errors.append(EpisodeError(
                    task.episode, None, "ContextReset",
                    f"the episode started {len(outcome) - 1} new contexts (history='deploy'), so it is "
                    f"{len(outcome)} sequences, and TRL takes one completion per prompt: use history='keep' with "
                    "TRL, or a trainer that takes one row per sequence (to_verl)",
                ))
                return
            done[task.episode] = outcome[0]
            if self.on_episode is not None:
                self.on_episode(outcome[0])

        try:
            stopped = drive(slots, tasks, base, batcher.generate, on_outcome)
        finally:
            batcher.close()
        if stopped:
            raise KeyboardInterrupt(f"the rollout was stopped with {len(done)} of {len(specs)} episodes finished")
        if errors:
            lines = "; ".join(f"{e} (prompt {specs[e.episode]!r})" for e in errors[:5])
            raise RuntimeError(
                f"{len(errors)} of {len(specs)} episodes failed, and TRL needs one completion per prompt: {lines}"
            )
        return [done[i] for i in range(len(specs))]

    def close(self) -> None:
        """Close the environments."""
        for slot in self._slots:
            slot.env.close()
        self._slots = []


def _groups(specs: list, num_generations: Any) -> list[int]:
    """Each completion's group within one call: TRL repeats each prompt ``num_generations`` times in a
    row and computes advantages over those runs; without that setting, copies of one prompt are a group."""
    if isinstance(num_generations, int) and num_generations > 0 and len(specs) % num_generations == 0:
        return [i // num_generations for i in range(len(specs))]
    first: dict[str, int] = {}
    return [first.setdefault(json.dumps(spec, sort_keys=True, default=str), i) for i, spec in enumerate(specs)]


def trl_rollout_func(
    env: str | Callable[[], gym.Env],
    *,
    policy: Policy | None = None,
    max_completion_length: int | None = None,
    max_tokens_per_turn: int | None = None,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    on_episode: Callable[[Trajectory], None] | None = None,
    **env_kwargs: Any,
) -> TRLRollout:
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that plays one tokengym episode per prompt.

    Args:
        env: a registered id (made with ``gym.make(env, **env_kwargs)``; the tokenizer defaults
            to the trainer's ``processing_class``) or a factory of tokengym envs.
        policy: samples the actions; by default the trainer's own model through
            :class:`~tokengym.policies.HFPolicy` (on-policy, single process; a model sharded by
            DeepSpeed ZeRO-3 / FSDP needs a policy of its own, e.g. vLLM).
        max_completion_length: the budget of a whole completion (every action and observation
            after the prompt); the trainer's ``args.max_completion_length`` by default. An episode
            that would exceed it ends truncated (``stop_reason="context_length"``).
        max_tokens_per_turn: the per-action limit (the completion budget by default).
        sampling: the base sampling settings; by default the trainer's ``temperature``,
            ``top_p`` and ``top_k``. The env's stop tokens are always added.
        seed: sampling seeds derive from ``(seed, process, call, index, turn)``; the trainer's
            ``args.seed`` by default.
        on_episode: called with every finished trajectory (e.g. a ``TrajectoryWriter.write``).
        **env_kwargs: passed to ``gym.make`` when ``env`` is an id.
    """
    return TRLRollout(
        env,
        policy=policy,
        max_completion_length=max_completion_length,
        max_tokens_per_turn=max_tokens_per_turn,
        sampling=sampling,
        seed=seed,
        on_episode=on_episode,
        env_kwargs=env_kwargs,
    )
