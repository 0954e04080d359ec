"""RecordEpisodes: a gymnasium wrapper that turns every episode into a :class:`Trajectory`.

An RL library that drives a tokengym env through plain ``reset``/``step`` gets complete
trajectories without any other glue: the prompt from ``reset``, each action, each
observation, each reward, in order. A caller that has the action's logprobs passes them
to ``step(action, logprobs=...)``, and why the generation stopped as ``finish_reason=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded

from tokengym.envs.conformance import Conformance
from tokengym.envs.step_record import StepRecord, ToolReward, reset_record, step_record

from .segments import Segment, SegmentKind
from .trajectory import Trajectory

__all__ = ["RecordEpisodes"]


def _shareable(ids: Any) -> bool:
    """Whether an env's array may be kept as it is: a read-only 1-D int64 array that owns its data
    (what :func:`tokengym.envs.chat.frozen_ids` makes), which no one can change under the recorder."""
    return (
        isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 1
        and not ids.flags.writeable and ids.base is None
    )


def _kept(obs: Any) -> np.ndarray:
    """The observation's ids to record: the env's own array when it is shareable, else a copy."""
    return obs if _shareable(obs) else np.array(obs, dtype=np.int64)


class RecordEpisodes(gym.Wrapper[np.ndarray, np.ndarray, np.ndarray, np.ndarray]):
    """Records each episode; finished ones are in :attr:`trajectories` and in the final step's ``info["trajectory"]``.

    An episode is one trajectory, unless its env starts a new context mid-episode
    (``info["context_reset"]``, ``history="deploy"``): then it is one trajectory (row) per
    context, each with its own turns' actions, logprobs and rewards, marked
    ``metadata["sequence"]`` / ``metadata["sequences"]``; the final step's
    ``info["sequences"]`` lists them all (``info["trajectory"]`` is the last), and
    ``on_episode`` is called with each.

    Args:
        env: any tokengym env (observations and actions are token ids).
        on_episode: called with each finished trajectory (e.g. to write it to a store).
        keep: keep finished trajectories in :attr:`trajectories` (drain with :meth:`pop_trajectories`).
        sampling: sampling settings to record with every trajectory, when the caller knows them.
    """

    def __init__(
        self,
        env: gym.Env[np.ndarray, np.ndarray],
        *,
        on_episode: Callable[[Trajectory], None] | None = None,
        keep: bool = True,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(env)
        self.on_episode = on_episode
        self.keep = keep
        self.sampling = dict(sampling) if sampling else None
        self.trajectories: list[Trajectory] = []
        self._segments: list[Segment] | None = None
        self._images: list[Any] = []

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._segments = [Segment(SegmentKind.PROMPT, _kept(obs), 0)]
        self._sequences: list[Trajectory] = []
        self._finished: list[Trajectory] = []
        self._seed = seed
        self._conformance: list[Conformance] = []  # as the env gave them; dicts only when a row is made
        record = reset_record(info)
        self._task = record.task
        self._tool_rewards: list[ToolReward] = []
        self._images = list(record.images)
        return obs, info

    def step(
        self, action: Any, logprobs: Sequence[float] | np.ndarray | None = None, finish_reason: str | None = None
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """``env.step(action)``, recording the action (with its ``logprobs`` and ``finish_reason``:
        ``"stop"``, ``"stop_string"`` or ``"length"``, when the caller knows them) and the observation."""
        if self._segments is None:
            raise ResetNeeded("call reset() before step()")
        given = np.asarray(action)
        ids = given if given.dtype.kind in "iu" else None
        if logprobs is not None and (ids is None or np.shape(logprobs) != ids.shape):
            raise ValueError(
                f"logprobs must have one value per action token: {np.shape(logprobs)} for action of shape "
                f"{None if ids is None else ids.shape}"
            )
        obs, reward, terminated, truncated, info = self.env.step(action)
        assert ids is not None  # the env accepted the action, so it was integer ids
        record = step_record(info)
        turn = record.turn
        kept = record.action_ids
        if not (_shareable(kept) and np.array_equal(kept, ids)):  # the env keeps no copy we may share
            kept = np.array(ids, dtype=np.int64, copy=True)
        ids = kept
        self._segments.append(Segment(SegmentKind.ACTION, ids, turn, logprobs=logprobs, reward=float(reward), finish_reason=finish_reason))
        reset = record.context_reset and not (terminated or truncated)
        if record.images:
            if reset:
                raise ValueError("a new context mid-episode (history='deploy') with images is not recorded yet")
            self._images.extend(record.images)
        if reset:  # history="deploy": the next context is not an extension of this one; a new row
            self._sequences.append(self._trajectory(record, False, False, "context_reset"))
            self._segments = [Segment(SegmentKind.PROMPT, _kept(obs), turn + 1)]
            self._conformance = []
        elif len(obs):
            self._segments.append(Segment(SegmentKind.OBSERVATION, _kept(obs), turn))
        self._tool_rewards.extend(record.tool_rewards)
        if reset:
            self._sequences[-1].conformance.append(record.conformance.as_dict())
        else:
            self._conformance.append(record.conformance)
        if terminated or truncated:
            info["trajectory"] = self._finish(record, terminated, truncated)
            if len(self._finished) > 1:
                info["sequences"] = self._finished
        return obs, reward, terminated, truncated, info

    def _finish(self, record: StepRecord, terminated: bool, truncated: bool) -> Trajectory:
        """The episode's last row; every row of it (one per sequence) is in ``self._finished``."""
        last = self._trajectory(record, terminated, truncated, None)
        rows = [*self._sequences, last]
        if len(rows) > 1:
            for k, row in enumerate(rows):
                row.metadata.update({"sequence": k, "sequences": len(rows)})
        self._segments = None
        self._finished = rows
        for row in rows:
            if self.keep:
                self.trajectories.append(row)
            if self.on_episode is not None:
                self.on_episode(row)
        return last

    def _trajectory(self, record: StepRecord, terminated: bool, truncated: bool, stop_reason: str | None) -> Trajectory:
        assert self._segments is not None
        # The unwrapped env's own spec: a wrapper's `spec` property deep-copies it, tokenizer included (~1 s).
        spec = getattr(self.env.unwrapped, "spec", None)
        metadata: dict[str, Any] = {}
        if self._task:
            metadata["task"] = self._task
            if "id" in self._task:
                metadata["task_id"] = self._task["id"]  # the GRPO group key (batches.group_by_task)
        metadata.update(record.episode_facts)  # what the env says of the episode so far, on its step
        if self._tool_rewards and stop_reason != "context_reset":  # episode-level: on the last row
            metadata["tool_rewards"] = [r.as_dict() for r in self._tool_rewards]
        traj = Trajectory(
            segments=self._segments,
            env_id=spec.id if spec is not None else type(self.env.unwrapped).__name__,
            seed=self._seed,
            stop_reason=stop_reason or record.stop_reason or ("terminated" if terminated else "truncated"),
            terminated=bool(terminated),
            truncated=bool(truncated),
            conformance=[c.as_dict() for c in self._conformance],
            sampling=self.sampling,
            metadata=metadata,
            images=list(self._images),
        )
        return traj

    def context_ids(self) -> list[int]:
        """The token ids of the episode's current context, what the policy continues next: the
        recorded segments' ids (shared with the env where it keeps read-only arrays), joined;
        with the images they hold, when there are any (a
        :class:`~tokengym.policies.base.VisionContext`)."""
        if self._segments is None:
            raise ResetNeeded("no episode is under way: call reset() first")
        ids = np.concatenate([s.token_ids for s in self._segments]).tolist()
        if self._images:
            from tokengym.policies.base import VisionContext

            return VisionContext(ids, self._images)
        return ids

    def pop_trajectories(self) -> list[Trajectory]:
        """Finished trajectories since the last call; the list is emptied."""
        out, self.trajectories = self.trajectories, []
        return out
