"""GRPO's groups and advantages: which trajectories are compared with which, and what each learns.

Separate from the layouts (``batches``) because it is a different question: a layout places the
recorded tokens, this decides the numbers a trainer multiplies them by. It is also where silent
zeros are caught: a group of one member, or one whose rewards are all equal, has no signal, and
:func:`grpo_advantages` says so (its result, the run summary, :class:`NoGroupSignalWarning`)
instead of returning zeros that train nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .trajectory import Trajectory, require_trajectories

__all__ = [
    "GRPOAdvantages",
    "GroupKey",
    "GroupSignal",
    "NoGroupSignalWarning",
    "group_by_task",
    "group_key",
    "group_signal",
    "grpo_advantages",
]

GroupKey = Callable[[Trajectory], Hashable]


def group_key(t: Trajectory) -> Hashable:
    """The GRPO group of a trajectory: ``metadata["group"]`` when the rollout ran groups, else its task."""
    group = t.metadata.get("group")
    return group if group is not None else t.metadata.get("task_id")



class NoGroupSignalWarning(UserWarning):
    """A GRPO batch in which every advantage is 0: the loss is 0 and the step learns nothing."""


def _mixed_group_metadata(trajs: Sequence[Trajectory]) -> None:
    """Refuse a batch where only some trajectories carry ``metadata["group"]``.

    The default key falls back to ``task_id`` per trajectory; in a mixed batch a group id and a
    task id could be equal by chance and join unrelated episodes into one group.
    """
    has = [t.metadata.get("group") is not None for t in trajs]
    if any(has) and not all(has):
        without = [i for i, h in enumerate(has) if not h]
        shown = ", ".join(map(str, without[:5])) + (", ..." if len(without) > 5 else "")
        raise ValueError(
            f"{len(without)} of {len(trajs)} trajectories (e.g. {shown}) have no metadata['group'] while the others "
            "have one: batch episodes of one rollout(..., group_size=G) together, or pass key=lambda t: ..."
        )


def _check_one_task_per_group(trajs: Sequence[Trajectory], groups: Mapping[Hashable, list[int]]) -> None:
    """A recorded group holds samples of one task; two task ids in it mean the ids were reused."""
    for g, idx in groups.items():
        tasks = {trajs[i].metadata.get("task_id") for i in idx}
        if len(tasks) > 1:
            raise ValueError(
                f"group {g!r} mixes tasks {sorted(map(repr, tasks))}: its advantages would compare different tasks; "
                "were the trajectories of two rollouts concatenated (their group ids restart)? "
                "pass key=lambda t: (t.metadata['task_id'], t.metadata['group'])"
            )


def group_by_task(trajs: Sequence[Trajectory], key: GroupKey | None = None) -> dict[Hashable, list[int]]:
    """Indices of the trajectories per GRPO group, in first-seen order.

    The default key is ``metadata["group"]`` (the samples of one task that
    ``rollout(..., group_size=G)`` ran together), else ``metadata["task_id"]``. A trajectory
    whose key is None is refused rather than grouped with every other unlabelled one: a silent
    catch-all group would compare unrelated tasks.
    """
    if key is None:
        _mixed_group_metadata(trajs)
    groups: dict[Hashable, list[int]] = {}
    for i, t in enumerate(trajs):
        k = (key or group_key)(t)
        if k is None:
            raise ValueError(
                f"trajectory {i} has no group key (metadata['group'] or metadata['task_id'] by default); "
                "run G samples per task with rollout(..., group_size=G), set metadata['task_id'], or pass key=lambda t: ..."
            )
        groups.setdefault(k, []).append(i)
    if key is None:
        _check_one_task_per_group(trajs, groups)
    return groups


@dataclass(frozen=True)
class GroupSignal:
    """How many GRPO groups can teach the policy anything.

    A group of one has no baseline to compare with, and a group whose members all got the
    same reward has nothing to prefer: both give every member advantage 0, so their tokens add
    nothing to the loss. Every group is counted once: ``with_signal + singletons +
    equal_reward == groups``.
    """

    groups: int
    with_signal: int
    singletons: int  # groups of one member
    equal_reward: int  # groups of two or more members whose rewards are all equal

    @classmethod
    def of_rewards(cls, rewards: Mapping[Any, Sequence[float]]) -> GroupSignal:
        """The counts for each group's list of returns (what a run's statistics keep)."""
        singletons = sum(len(r) == 1 for r in rewards.values())
        equal = sum(len(r) > 1 and max(r) == min(r) for r in rewards.values())
        return cls(len(rewards), len(rewards) - singletons - equal, singletons, equal)

    def summary(self) -> str:
        """One line for a log or a summary table."""
        return (
            f"groups with signal: {self.with_signal} of {self.groups} "
            f"({self.singletons} of one member, {self.equal_reward} with equal rewards)"
        )


@dataclass(frozen=True, eq=False)
class GRPOAdvantages:
    """The advantages of a batch and the groups they were computed in.

    Reads as the float32 array of advantages (``np.asarray``, indexing, ``len``, and the
    ``advantages=`` argument of :func:`to_verl` and :func:`to_packed`), so code written for a
    plain array keeps working; ``.advantages`` is that array itself (for ``torch.from_numpy``).
    """

    advantages: np.ndarray  # float32 [B], one per trajectory
    groups: dict[Hashable, list[int]]  # group key -> trajectory indices, in first-seen order
    singletons: tuple[Hashable, ...]  # keys of the groups of one member
    equal_reward: tuple[Hashable, ...]  # keys of the groups (2+ members) whose rewards are all equal

    @property
    def with_signal(self) -> tuple[Hashable, ...]:
        """Keys of the groups whose members' advantages are not all 0."""
        dead = set(self.singletons) | set(self.equal_reward)
        return tuple(k for k in self.groups if k not in dead)

    @property
    def signal(self) -> GroupSignal:
        """The counts of :attr:`with_signal`, :attr:`singletons` and :attr:`equal_reward`."""
        return GroupSignal(len(self.groups), len(self.with_signal), len(self.singletons), len(self.equal_reward))

    def summary(self) -> str:
        """``groups with signal: k of n (j of one member, m with equal rewards)``."""
        return self.signal.summary()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self.advantages if dtype is None else self.advantages.astype(dtype, copy=False)
        return out.copy() if copy else out

    def __len__(self) -> int:
        return len(self.advantages)

    def __getitem__(self, index: Any) -> Any:
        return self.advantages[index]

    def __iter__(self) -> Iterator[np.float32]:
        return iter(self.advantages)


def _members(trajs: Sequence[Trajectory], idx: list[int]) -> list[list[int]]:
    """The group's episodes as lists of row indices: the rows of one episode of several sequences
    (``history="deploy"``: ``metadata["sequences"]``, a shared ``metadata["episode"]``) are one member."""
    members: dict[Hashable, list[int]] = {}
    for i in idx:
        meta = trajs[i].metadata
        member = ("episode", meta.get("episode")) if "sequences" in meta and "episode" in meta else ("row", i)
        members.setdefault(member, []).append(i)
    return list(members.values())


def _degenerate(
    returns: Mapping[Hashable, Sequence[float]],
) -> tuple[tuple[Hashable, ...], tuple[Hashable, ...]]:
    """(keys of the groups of one, keys of the larger groups whose returns are all equal)."""
    singletons, equal = [], []
    for k, r in returns.items():
        if len(r) == 1:
            singletons.append(k)
        elif all(x == r[0] for x in r):
            equal.append(k)
    return tuple(singletons), tuple(equal)


def _returns(trajs: Sequence[Trajectory], groups: Mapping[Hashable, list[int]]) -> tuple[dict, dict]:
    """Per group: its members (row indices per episode) and their returns (the sum of their rows' rewards)."""
    members = {k: _members(trajs, idx) for k, idx in groups.items()}
    returns = {k: [float(sum(trajs[i].reward for i in m)) for m in ms] for k, ms in members.items()}
    return members, returns


def group_signal(trajs: Sequence[Trajectory], key: GroupKey | None = None) -> GroupSignal:
    """How many groups of ``trajs`` have a learning signal (grouped as :func:`group_by_task` does)."""
    if len(trajs) == 0:
        return GroupSignal(0, 0, 0, 0)
    groups = group_by_task(trajs, key)
    singletons, equal = _degenerate(_returns(trajs, groups)[1])
    return GroupSignal(len(groups), len(groups) - len(singletons) - len(equal), len(singletons), len(equal))


def _no_signal_message(signal: GroupSignal) -> str:
    causes = []
    if signal.singletons:
        causes.append(
            "a group of one member has no baseline to compare with: run G samples per task: rollout(..., group_size=G)"
        )
    if signal.equal_reward:
        causes.append(
            "a group whose members all got the same reward has nothing to prefer: run more samples per task "
            "(rollout(..., group_size=G) with a larger G) or use a reward that tells episodes apart"
        )
    head = f"no GRPO signal in this batch, every advantage is 0 and so is the loss ({signal.summary()}); "
    return head + "; ".join(causes)


def grpo_advantages(
    trajs: Sequence[Trajectory],
    key: GroupKey | None = None,
    *,
    eps: float = 1e-6,
    normalize_std: bool = True,
    ddof: int = 1,
) -> GRPOAdvantages:
    """Group-relative advantages: ``(R - mean(group)) / (std(group) + eps)`` per trajectory (float32).

    ``R`` is the episode's return (the sum of its turn rewards; an episode recorded as several
    rows, ``history="deploy"``, is one member whose return sums its rows and whose advantage
    goes to each of its rows). Groups are made by
    :func:`group_by_task` (``metadata["group"]``, else ``metadata["task_id"]``, or ``key``).
    The std is the sample std (``ddof=1``), as verl and TRL compute it. A group of one has no
    baseline to compare with, and a group of equal rewards nothing to prefer: the advantages of
    both are exactly 0. They are listed in the result, and a batch in which every group is
    like that warns (:class:`NoGroupSignalWarning`): its loss would be 0.
    ``normalize_std=False`` gives ``R - mean`` (Dr. GRPO).
    """
    require_trajectories(trajs)
    groups = group_by_task(trajs, key)
    members, returns = _returns(trajs, groups)
    singletons, equal = _degenerate(returns)
    dead = set(singletons) | set(equal)
    adv = np.zeros(len(trajs), dtype=np.float64)
    for k in groups:
        if k in dead:  # exactly 0 (the mean of equal floats is not always that float)
            continue
        r = np.array(returns[k], dtype=np.float64)
        centred = r - r.mean()
        if normalize_std and len(r) > ddof:
            denom = r.std(ddof=ddof) + eps
            if denom > 0:
                centred = centred / denom
        for rows, a in zip(members[k], centred):
            adv[rows] = a  # every row of an episode gets the episode's advantage
    result = GRPOAdvantages(adv.astype(np.float32), groups, singletons, equal)
    if not result.with_signal:
        warnings.warn(_no_signal_message(result.signal), NoGroupSignalWarning, stacklevel=2)
    return result
