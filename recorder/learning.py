"""A small GRPO training loop for a transformers model on a tokengym env, on one machine.

Each iteration rolls out fresh on-policy GRPO groups with :class:`~tokengym.policies.HFPolicy`
(``rollout(..., group_size=G)``), computes group-relative advantages, lays the episodes out
as a verl batch, recomputes the policy tokens' logprobs with the weights being trained,
and takes one optimizer step on :func:`~tokengym.recorder.training.grpo_loss`. Every
``eval_every`` iterations it evaluates on held-out reset seeds that training never uses.

It is the loop of ``notebooks/learn.ipynb`` and ``benchmarks/learning.py``, kept here so the
two cannot drift; it is meant to show learning on small models and to check the recorded
batches end to end, not to replace a trainer (verl, TRL, SkyRL take the same batches).

Every iteration logs the largest ``|recomputed - rollout|`` logprob before its update: the
rollout is on-policy, so it must stay at float noise; a large value means the trainer is not
scoring the tokens the policy sampled, in the context it sampled them in.

Multi-turn episodes (``tokengym/ToolAddition-v0``: a tool call, its result, the answer) train
the same way: a row of the batch is the whole stream, the loss covers the policy's tokens of
every turn (``response_mask``), the env's tokens between them are context only, and the
logprob check covers every turn, each scored in the context that held the earlier turns' results.

torch is imported inside the functions: importing the recorder stays light.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokengym.policies.base import SamplingParams
from tokengym.policies.versions import check_on_update

from .advantages import grpo_advantages
from .batches import to_verl
from .drivers.rollout import rollout
from .trajectory import Trajectory

__all__ = ["EvalEpisode", "EvalLog", "GRPOConfig", "IterationLog", "TrainingRun", "grade_metrics", "train_grpo"]

Metrics = Callable[[Trajectory], Mapping[str, float]]


def grade_metrics(traj: Trajectory) -> dict[str, float]:
    """Every boolean of ``traj.metadata["grade"]`` as 0.0 / 1.0 (``tokengym/Addition-v0``: ``format_ok``, ``correct``)."""
    grade = traj.metadata.get("grade")
    if not isinstance(grade, Mapping):
        raise KeyError(
            f"trajectory of {traj.env_id} has no metadata['grade']: its env must report info['grade'] "
            "(a dict of booleans) on the last step, or pass your own metrics=..."
        )
    return {k: float(v) for k, v in grade.items() if isinstance(v, bool)}


@dataclass(frozen=True)
class GRPOConfig:
    """The settings of :func:`train_grpo`. The defaults are those that learned ``tokengym/Addition-v0``
    with SmolLM2-135M-Instruct on a CPU; at 3e-5 the same run climbed faster, then collapsed after
    about 65 iterations: a fixed budget at a small learning rate, or ``kl_coef``, guards against that."""

    iterations: int = 60
    tasks_per_iteration: int = 4
    group_size: int = 4
    lr: float = 5e-6
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    """> 0 keeps a frozen copy of the start policy and adds ``kl_coef * KL`` to the loss."""
    max_grad_norm: float = 1.0
    sampling: SamplingParams = SamplingParams(max_tokens=24, temperature=1.0)
    seed: int = 0
    """Iteration ``i`` trains on the tasks of reset seeds ``seed + i * tasks_per_iteration + (0 .. tasks - 1)``."""
    eval_every: int = 10
    eval_episodes: int = 32
    eval_seed: int = 1_000_000
    """Held-out reset seeds ``eval_seed .. eval_seed + eval_episodes - 1``, never used for training."""
    eval_sampling: SamplingParams = SamplingParams(max_tokens=24, temperature=0.0)
    max_staleness: int | None = None
    """None: synchronous (each iteration rolls out on the newest weights, then trains). K >= 0:
    asynchronous (:class:`~tokengym.recorder.AsyncRollout`): episodes run on a copy of the model
    while the trainer trains, the copy takes the new weights after every step, and no episode
    starts more than K updates behind (0: a batch at a time, but the next starts while this one trains)."""
    on_update: str = "continue"
    """Asynchronous runs: what the turns in flight at an update do (``continue``, ``restart``, ``finish``)."""

    def __post_init__(self) -> None:
        if self.max_staleness is not None and (
            isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0
        ):
            raise ValueError(f"max_staleness is None (synchronous) or a count of updates >= 0, not {self.max_staleness!r}")
        check_on_update(self.on_update)
        if self.iterations < 1 or self.tasks_per_iteration < 1 or self.eval_every < 1 or self.eval_episodes < 1:
            raise ValueError("iterations, tasks_per_iteration, eval_every and eval_episodes must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a group of one has no baseline), not {self.group_size}")
        if not self.sampling.temperature > 0:
            raise ValueError("training samples need temperature > 0 (greedy samples have no logprobs to train on)")
        if self.sampling.temperature != 1.0 or self.sampling.top_p != 1.0 or self.sampling.top_k != 0:
            raise ValueError(
                "the importance ratio compares HFPolicy's raw logprobs (of the unmodified distribution) with "
                "the trainer's: sample at temperature 1.0 without top_p / top_k"
            )
        last_train_seed = self.seed + self.iterations * self.tasks_per_iteration
        if self.seed < self.eval_seed + self.eval_episodes and last_train_seed > self.eval_seed:
            raise ValueError(
                f"training reset seeds {self.seed}..{last_train_seed - 1} overlap the held-out ones "
                f"{self.eval_seed}..{self.eval_seed + self.eval_episodes - 1}: move eval_seed"
            )


@dataclass(frozen=True)
class IterationLog:
    """One training iteration: its rollout's means, then its update."""

    iteration: int
    reward: float
    metrics: dict[str, float]
    groups_with_signal: int
    groups: int
    updated: bool
    """False when no group had a signal and there is no KL term: the loss has no gradient, no step is taken."""
    loss: float
    kl: float
    clip_fraction: float
    logprob_diff: float
    """Max ``|recomputed - rollout|`` logprob, before the update, over the policy tokens that the
    weights being trained sampled (every token of a synchronous run): float noise, or the trainer
    does not score what the policy sampled. NaN when every row of an asynchronous batch is stale."""
    generate_s: float
    """Synchronous: the rollout. Asynchronous: the time the trainer waited for the batch."""
    train_s: float
    """The update (asynchronous: and putting the new weights in the rollout's copy)."""
    turns: float = 1.0
    """Mean assistant turns per episode (all of them trained on: ``response_mask`` covers every turn's tokens)."""
    staleness: tuple[int, ...] = ()
    """Asynchronous runs: per episode of the batch, the updates made since it started (0: on-policy)."""
    stale_logprob_diff: float = float("nan")
    """Asynchronous runs: max ``|recomputed - rollout|`` over tokens older weights sampled: how
    far off-policy the batch was (the clipped importance ratio corrects for it)."""
    spanning: int = 0
    """Rows whose policy tokens more than one weight version sampled (``on_update="continue"``)."""


@dataclass(frozen=True)
class EvalEpisode:
    """One held-out episode of an evaluation: its task and what it scored."""

    task_id: Any
    reward: float
    metrics: dict[str, float]


@dataclass(frozen=True)
class EvalLog:
    """A held-out evaluation after ``iteration`` updates.

    Its reset seeds are never used for training, but a small task space can still draw the
    same task from a training seed: ``seen`` counts the held-out episodes whose
    ``metadata["task_id"]`` training has already sampled, and ``unseen_reward`` /
    ``unseen_metrics`` are the means over the others (NaN when there are none).
    """

    iteration: int
    reward: float
    metrics: dict[str, float]
    seen: int = 0
    unseen_reward: float = float("nan")
    unseen_metrics: dict[str, float] = field(default_factory=dict)
    episodes: tuple[EvalEpisode, ...] = ()
    """Each held-out episode, in episode order (the same reset seeds, so the same tasks, in every evaluation)."""
    trained: frozenset[Any] = frozenset()
    """The task ids training had sampled when this evaluation ran."""
    seconds: float = 0.0


@dataclass
class TrainingRun:
    """What :func:`train_grpo` did."""

    config: GRPOConfig
    iterations: list[IterationLog] = field(default_factory=list)
    evals: list[EvalLog] = field(default_factory=list)
    seconds: float = 0.0
    """The whole run, evaluations included (:attr:`EvalLog.seconds` says how much of it they took)."""
    rollout_stats: dict[str, Any] = field(default_factory=dict)
    """Asynchronous runs: the :class:`~tokengym.recorder.AsyncRolloutStats` of the run, as a dict."""

    def staleness_histogram(self) -> dict[int, int]:
        """Trained-on episodes by how many updates each missed (a synchronous run: all 0)."""
        counts: dict[int, int] = {}
        for it in self.iterations:
            for k in it.staleness or (0,) * self.config.tasks_per_iteration * self.config.group_size:
                counts[k] = counts.get(k, 0) + 1
        return dict(sorted(counts.items()))

    def series(self, name: str) -> np.ndarray:
        """Per iteration: ``"reward"``, a metric's name, or any :class:`IterationLog` field."""
        if name == "reward" or name in IterationLog.__dataclass_fields__:
            return np.array([getattr(it, name) for it in self.iterations], dtype=float)
        return np.array([it.metrics[name] for it in self.iterations], dtype=float)

    def held_out_change(self, metric: str = "reward") -> tuple[float, float, int]:
        """``metric`` (or ``"reward"``) before and after training, both on the same held-out
        questions: those training never asked by its end. Returns (first evaluation's mean, last
        evaluation's mean, how many questions); NaNs and 0 when training asked every one."""
        if len(self.evals) < 2:
            raise ValueError("held_out_change needs two evaluations (before and after training)")
        first, last = self.evals[0], self.evals[-1]
        if [e.task_id for e in first.episodes] != [e.task_id for e in last.episodes]:
            raise ValueError("the first and the last evaluation asked different questions: no before/after on the same ones")
        keep = [i for i, e in enumerate(last.episodes) if e.task_id is None or e.task_id not in last.trained]
        if not keep:
            return float("nan"), float("nan"), 0

        def mean(log: EvalLog) -> float:
            return float(np.mean([log.episodes[i].reward if metric == "reward" else log.episodes[i].metrics[metric] for i in keep]))

        return mean(first), mean(last), len(keep)

    def summary(self, window: int = 3) -> str:
        """First ``window`` vs last ``window`` iterations (reward and metrics), the held-out evaluations, timings."""
        if not self.iterations:
            return "no iteration ran"
        k = min(window, len(self.iterations))
        names = ["reward", *self.iterations[0].metrics]
        lines = [f"{len(self.iterations)} iterations; mean of the first {k} -> last {k}:"]
        if self.series("turns").max() > 1:
            names.append("turns")
        for name in names:
            s = self.series(name)
            lines.append(f"  {name:<12} {s[:k].mean():.3f} -> {s[-k:].mean():.3f}")
        for e in self.evals:
            shown = "  ".join(f"{n} {v:.3f}" for n, v in e.metrics.items())
            unseen = "  ".join(f"{n} {v:.3f}" for n, v in e.unseen_metrics.items())
            lines.append(
                f"  held-out after {e.iteration:>3} updates: reward {e.reward:.3f}  {shown}"
                f"  (the {self.config.eval_episodes - e.seen} never trained on: reward {e.unseen_reward:.3f}  {unseen})"
            )
        gen, train = self.series("generate_s").mean(), self.series("train_s").mean()
        lines.append(f"  {gen + train:.1f} s per iteration ({gen:.1f} s generation, {train:.1f} s training)")
        lines.append(f"  max |recomputed - rollout| logprob before an update: {self.series('logprob_diff').max():.1e}")
        return "\n".join(lines)


def _means(trajs: list[Trajectory], metrics: Metrics | None) -> tuple[float, dict[str, float]]:
    reward = float(np.mean([t.reward for t in trajs]))
    if metrics is None:
        return reward, {}
    rows = [dict(metrics(t)) for t in trajs]
    return reward, {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _episode_means(episodes: Sequence[EvalEpisode]) -> tuple[float, dict[str, float]]:
    """The mean reward and metrics of evaluated episodes (each episode's metrics computed once)."""
    reward = float(np.mean([e.reward for e in episodes]))
    return reward, {k: float(np.mean([e.metrics[k] for e in episodes])) for k in episodes[0].metrics}


def _run(make_env: Any, policy: Any, *, episodes: int, group_size: int, sampling: SamplingParams, seed: int) -> list[Trajectory]:
    result = rollout(
        make_env, policy, episodes=episodes, group_size=group_size, concurrency=episodes,
        sampling=sampling, seed=seed, progress=False,
    )
    if result.stats.failed:
        raise RuntimeError(f"{result.stats.failed} of {episodes} episodes failed; the first: {result.stats.errors[0]}")
    return result.trajectories


def train_grpo(
    model: Any,
    tokenizer: Any,
    make_env: Callable[[], Any] | str,
    config: GRPOConfig = GRPOConfig(),
    *,
    metrics: Metrics | None = None,
    on_iteration: Callable[[IterationLog], None] | None = None,
    on_eval: Callable[[EvalLog], None] | None = None,
) -> TrainingRun:
    """Train ``model`` in place with GRPO on ``make_env``'s tasks; returns the logs.

    With ``config.max_staleness`` set, generation and training overlap: episodes run on a copy of
    ``model`` in :class:`~tokengym.recorder.AsyncRollout`'s thread, the trainer takes each batch
    as its groups end, trains, and puts the new weights in the copy (version = updates made); the
    batch's stale rows are trained on with their own logprobs as the behaviour policy's (the
    clipped ratio), and only its fresh tokens enter ``logprob_diff``. Iteration ``i`` trains on
    the ``i``-th batch to end, so the tasks are the synchronous run's, in another order.

    Args:
        model: a transformers causal LM (float32 for logprobs that match to float noise).
        tokenizer: its tokenizer (for the policy's stop strings).
        make_env: an env factory or a registered id, as for :func:`~tokengym.recorder.rollout`.
        metrics: per-trajectory numbers to average per iteration and evaluation (e.g.
            :func:`grade_metrics`).
        on_iteration, on_eval: called with each log as it is made (progress printing).
    """
    import torch

    from tokengym.policies import HFPolicy

    from .training import grpo_loss, policy_logprobs

    c = config
    began = time.perf_counter()
    device = next(model.parameters()).device
    policy = HFPolicy(model, tokenizer, device=device)  # the trained weights: evaluations, and a synchronous run's samples
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if c.kl_coef > 0 else None
    run = TrainingRun(c)
    n = c.tasks_per_iteration * c.group_size

    trained: set[Any] = set()  # the task ids training has sampled

    def evaluate(after: int) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            trajs = _run(make_env, policy, episodes=c.eval_episodes, group_size=1, sampling=c.eval_sampling, seed=c.eval_seed)
        episodes = tuple(
            EvalEpisode(t.metadata.get("task_id"), float(t.reward), dict(metrics(t)) if metrics is not None else {})
            for t in trajs
        )
        unseen = [e for e in episodes if e.task_id is None or e.task_id not in trained]
        unseen_reward, unseen_metrics = _episode_means(unseen) if unseen else (float("nan"), {})
        log = EvalLog(
            after, *_episode_means(episodes), len(episodes) - len(unseen), unseen_reward, unseen_metrics,
            episodes, frozenset(trained), time.perf_counter() - start,
        )
        run.evals.append(log)
        if on_eval is not None:
            on_eval(log)

    def train(it: int, trajs: list[Trajectory], waited: float, version: int) -> bool:
        """One update on ``trajs`` (sampled with weights of versions <= ``version``, the trained ones)."""
        start = time.perf_counter()
        trained.update(t.metadata["task_id"] for t in trajs if t.metadata.get("task_id") is not None)
        groups = grpo_advantages(trajs)  # warns (NoGroupSignalWarning) when no group has a signal
        batch = to_verl(trajs, advantages=groups.advantages)
        t = batch.tensors
        mask = t["response_mask"].bool()
        logprobs = policy_logprobs(model, batch)
        gap = (logprobs.detach().cpu() - t["rollout_log_probs"]).abs()
        if c.max_staleness is None:
            fresh = mask
        else:  # the tokens the trained weights sampled (batch.tensors["rollout_versions"]: -1 off the policy's)
            fresh = mask & (t["rollout_versions"] == version)
        diff = float(gap[fresh].max()) if bool(fresh.any()) else float("nan")
        stale = mask & ~fresh
        stale_diff = float(gap[stale].max()) if bool(stale.any()) else float("nan")
        if not math.isfinite(float(gap[mask].max())):
            raise FloatingPointError(f"iteration {it}: the recomputed logprobs are not finite: the weights diverged")
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref = policy_logprobs(reference, batch)
        parts = grpo_loss(
            logprobs, t["rollout_log_probs"], t["advantages"], t["response_mask"],
            clip_eps=c.clip_eps, ref_logprobs=ref, kl_coef=c.kl_coef,
        )
        updated = bool(groups.with_signal) or c.kl_coef > 0
        optimizer.zero_grad(set_to_none=True)
        if updated:
            parts.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
            optimizer.step()
        log = IterationLog(
            it, *_means(trajs, metrics), len(groups.with_signal), len(groups.groups), updated,
            float(parts.loss.detach()), parts.kl, parts.clip_fraction, diff,
            waited, time.perf_counter() - start, float(np.mean([t.num_turns for t in trajs])),
            tuple(int(t.metadata.get("staleness", 0)) for t in trajs) if c.max_staleness is not None else (),
            stale_diff, sum(1 for t in trajs if t.has_versions and t.version_changes()),
        )
        run.iterations.append(log)
        if on_iteration is not None:
            on_iteration(log)
        return updated

    if c.max_staleness is None:
        for it in range(c.iterations):
            if it % c.eval_every == 0:
                evaluate(it)
            start = time.perf_counter()
            trajs = _run(make_env, policy, episodes=n, group_size=c.group_size, sampling=c.sampling, seed=c.seed + it * c.tasks_per_iteration)
            train(it, trajs, time.perf_counter() - start, policy.version)
    else:
        _train_async(c, model, tokenizer, device, make_env, evaluate, train, run)
    evaluate(c.iterations)
    run.seconds = time.perf_counter() - began
    return run


def _train_async(
    c: GRPOConfig, model: Any, tokenizer: Any, device: Any, make_env: Any,
    evaluate: Callable[[int], None], train: Callable[[int, list[Trajectory], float, int], bool], run: TrainingRun,
) -> None:
    """The asynchronous loop of :func:`train_grpo`: a copy of the model samples while the model trains."""
    import torch

    from tokengym.policies import HFPolicy

    from .drivers.async_rollout import AsyncRollout

    n = c.tasks_per_iteration * c.group_size
    evaluate(0)  # before the stream starts: no episode of the first batch is sampled during it
    sampler = HFPolicy(copy.deepcopy(model).requires_grad_(False), tokenizer, device=device, on_update=c.on_update)
    with AsyncRollout(
        make_env, sampler, batch_size=n, max_staleness=c.max_staleness, on_update=c.on_update,
        episodes=c.iterations * n, concurrency=n * (c.max_staleness + 1), sampling=c.sampling, seed=c.seed,
        group_size=c.group_size,
    ) as stream:
        try:
            for it in range(c.iterations):
                if it and it % c.eval_every == 0:  # the stream samples on meanwhile
                    evaluate(it)
                start = time.perf_counter()
                trajs = stream.next_batch()
                if len(trajs) != n:
                    failed = stream.stats.errors[0] if stream.stats.errors else "none"
                    raise RuntimeError(f"iteration {it}: a batch of {len(trajs)} episodes, not {n}; the first failure: {failed}")
                train(it, trajs, time.perf_counter() - start, stream.version)
                with torch.no_grad():  # every step is a version (an unchanged one too): the staleness bound counts them
                    stream.update_weights({k: v.detach() for k, v in model.state_dict().items()}, it + 1)
        finally:
            stream.close()
            run.rollout_stats = stream.stats.as_dict()
            sampler.close()
