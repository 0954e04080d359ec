"""RecordEpisodes: a gymnasium wrapper that turns every episode into a :class:`Trajectory`.

An RL library that drives a tokengym env through plain ``reset``/``step`` gets complete
trajectories without any other glue: the prompt from ``reset``, each action, each
observation, each reward, in order. A caller that has the action's logprobs passes them
to ``step(action, logprobs=...)``, and why the generation stopped as ``finish_reason=``.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import ResetNeeded

from tokengym.envs.conformance import Conformance, deferred_next, deferred_result
from tokengym.envs.step_record import StepRecord, ToolCall, ToolReward, reset_record, step_record
from tokengym.envs.stream import TokenStream

from .segments import Segment, SegmentKind, trusted_segment
from .trajectory import Trajectory

__all__ = ["RecordEpisodes"]


def _call_dicts(turns: Sequence[int], calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """``metadata["tool_calls"]``: each call's turn, its index in the turn, its tool and status."""
    out: list[dict[str, Any]] = []
    for turn, call in zip(turns, calls):
        index = out[-1]["index"] + 1 if out and out[-1]["turn"] == turn else 0
        out.append({"turn": int(turn), "index": index, "name": call.name, "status": call.status})
    return out


class RecordEpisodes(gym.Wrapper[np.ndarray, np.ndarray, np.ndarray, np.ndarray]):
    """Records each episode; finished ones are in :attr:`trajectories` and in the final step's ``info["trajectory"]``.

    An episode is one trajectory, unless its env starts a new context mid-episode
    (``info["context_reset"]``, ``history="deploy"``): then it is one trajectory (row) per
    context, each with its own turns' actions, logprobs and rewards, marked
    ``metadata["sequence"]`` / ``metadata["sequences"]``; the final step's
    ``info["sequences"]`` lists them all (``info["trajectory"]`` is the last), and
    ``on_episode`` is called with each. An episode with tool calls keeps them in its last row's
    ``metadata["tool_calls"]`` (turn, index, name and status; each call's text is in the
    action's tokens, its result in the observation's) and the rewards its tools gave in ``metadata["tool_rewards"]``.

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
        self._stream: TokenStream | None = None
        self._images: list[Any] = []

    # The current sequence's ids are the env's own token stream when it holds one whose pieces are
    # exactly what the recorder was given (checked every step: a wrapper in between may change
    # actions or observations); otherwise the recorder keeps its own. Beside them it keeps only
    # what the env does not know, one entry per action: logprobs, reward, finish reason.
    def _start(self, obs: Any, prompt_turn: int) -> None:
        """A new sequence whose prompt is ``obs``."""
        found = getattr(self.env.unwrapped, "token_stream", None)
        obs = np.asarray(obs)
        if isinstance(found, TokenStream) and found.num_pieces == 1 and found.piece_equals(0, obs):
            self._stream, self._shared = found, True
        else:
            self._stream, self._shared = TokenStream(_no_text), False
            self._stream.append("prompt", prompt_turn, obs, "")
        self._prompt_turn = prompt_turn
        self._pieces = 1  # pieces of the stream recorded so far
        self._logprobs = array("f")
        self._given = bytearray()  # per action: 1 when its logprobs were given
        self._versions = array("i")  # per token of the actions whose versions were given
        self._stamped = bytearray()  # per action: 1 when its weight versions were given
        self._rewards = array("d")
        self._finish: list[str | None] = []
        self._conf_turns = array("i")  # per result: its turn, and its next check when it is a plain
        self._conf_next = array("i")  # deferred one (-1: the result itself is in _conf_kept)
        self._conf_kept: dict[int, Conformance] = {}

    def _take(self, action: np.ndarray, obs: np.ndarray, turn: int, new_sequence: bool) -> TokenStream | None:
        """Record the step's action and observation ids; the stream of the sequence this step
        ended (when ``new_sequence``), to be made a row."""
        stream, k = self._stream, self._pieces
        assert stream is not None
        now = getattr(self.env.unwrapped, "token_stream", None)
        if self._shared:
            ok = stream.num_pieces > k and stream.kind(k) == "action" and stream.piece_equals(k, action)
            if new_sequence:
                ok = ok and stream.num_pieces == k + 1 and isinstance(now, TokenStream) and now is not stream
                ok = ok and now.num_pieces == 1 and now.piece_equals(0, obs)
            elif len(obs):
                ok = ok and now is stream and stream.num_pieces == k + 2 and stream.piece_equals(k + 1, obs)
            else:
                ok = ok and now is stream and stream.num_pieces == k + 1
            if ok:
                self._pieces = k + 1 if new_sequence else stream.num_pieces
                if new_sequence:
                    self._stream = now
                return stream if new_sequence else None
            own = TokenStream(_no_text)  # the env's stream is not what was given: keep our own from here
            for j in range(k):
                own.append(stream.kind(j), stream.turn(j), stream.ids(*stream.span(j)), "")
            self._stream, self._shared, stream = own, False, own
        stream.append("action", turn, action, "")
        self._pieces = k + 1
        if new_sequence:
            self._stream = TokenStream(_no_text)
            self._stream.append("prompt", turn + 1, obs, "")
            return stream
        if len(obs):
            stream.append("observation", turn, obs, "")
            self._pieces += 1
        return None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._start(obs, 0)
        self._sequences: list[Trajectory] = []
        self._finished: list[Trajectory] = []
        self._seed = seed
        record = reset_record(info)
        self._task = record.task
        self._tool_rewards: list[ToolReward] = []
        self._tool_calls: list[ToolCall] = []  # shared records; their turns beside them
        self._call_turns = array("i")
        self._images = list(record.images)
        return obs, info

    def step(
        self,
        action: Any,
        logprobs: Sequence[float] | np.ndarray | None = None,
        finish_reason: str | None = None,
        versions: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """``env.step(action)``, recording the action (with its ``logprobs``, ``finish_reason``:
        ``"stop"``, ``"stop_string"`` or ``"length"``, and the weight ``versions`` that sampled its
        tokens, when the caller knows them) and the observation."""
        if self._stream is None:
            raise ResetNeeded("call reset() before step()")
        given = np.asarray(action)
        ids = given if given.dtype.kind in "iu" else None
        if logprobs is not None and (ids is None or np.shape(logprobs) != ids.shape):
            raise ValueError(
                f"logprobs must have one value per action token: {np.shape(logprobs)} for action of shape "
                f"{None if ids is None else ids.shape}"
            )
        if versions is not None:
            if ids is None or np.shape(versions) != ids.shape:
                raise ValueError(
                    f"versions must have one value per action token: {np.shape(versions)} for action of shape "
                    f"{None if ids is None else ids.shape}"
                )
            if len(versions) and int(np.min(versions)) < 0:
                raise ValueError(f"weight versions are >= 0, got {int(np.min(versions))}")
        obs, reward, terminated, truncated, info = self.env.step(action)
        assert ids is not None  # the env accepted the action, so it was integer ids
        record = step_record(info)
        turn = record.turn
        reset = record.context_reset and not (terminated or truncated)
        if record.images and reset:
            raise ValueError("a new context mid-episode (history='deploy') with images is not recorded yet")
        ended = self._take(ids.reshape(-1), np.asarray(obs).reshape(-1), turn, reset)
        if logprobs is not None:
            self._logprobs.extend(np.asarray(logprobs, dtype=np.float32).reshape(-1).tolist())
        self._given.append(logprobs is not None)
        if versions is not None:
            self._versions.extend(np.asarray(versions, dtype=np.int32).reshape(-1).tolist())
        self._stamped.append(versions is not None)
        self._rewards.append(float(reward))
        self._finish.append(None if finish_reason is None else str(finish_reason))
        self._images.extend(record.images)
        self._tool_rewards.extend(record.tool_rewards)
        if record.tool_calls:
            self._call_turns.extend([turn] * len(record.tool_calls))
            self._tool_calls.extend(record.tool_calls)
        if ended is not None:  # history="deploy": the next context is not an extension of this one; a new row
            row = self._trajectory(ended, record, False, False, "context_reset")
            row.conformance.append(record.conformance.as_dict())
            self._sequences.append(row)
            self._start_sidecar(turn + 1)
        else:
            self._keep_conformance(record.conformance)
        if terminated or truncated:
            info["trajectory"] = self._finish_episode(record, terminated, truncated)
            if len(self._finished) > 1:
                info["sequences"] = self._finished
        return obs, reward, terminated, truncated, info

    def _start_sidecar(self, prompt_turn: int) -> None:
        """Empty the per-action records for the new sequence (its ids are already taken)."""
        stream, shared = self._stream, self._shared
        assert stream is not None
        self._start(np.zeros(0, dtype=np.int64), prompt_turn)
        self._stream, self._shared = stream, shared

    def _keep_conformance(self, result: Conformance) -> None:
        next_check = deferred_next(result)
        self._conf_turns.append(result.turn)
        self._conf_next.append(-1 if next_check is None else next_check)
        if next_check is None:
            self._conf_kept[len(self._conf_next) - 1] = result

    def _conformance_dicts(self) -> list[dict[str, Any]]:
        return [
            (self._conf_kept[i] if n < 0 else deferred_result(t, n)).as_dict()
            for i, (t, n) in enumerate(zip(self._conf_turns, self._conf_next))
        ]

    @property
    def _segments(self) -> list[Segment] | None:
        """The current sequence's segments so far, materialized (for tests and debugging)."""
        return None if self._stream is None else self._segments_of(self._stream)

    def _segments_of(self, stream: TokenStream) -> list[Segment]:
        """The recorded sequence as segments (new read-only arrays: the trajectory owns them; made
        without the segment constructor's checks, which the recorder's own arrays pass by making)."""
        out: list[Segment] = []
        lp = np.frombuffer(self._logprobs, dtype=np.float32) if self._logprobs else np.zeros(0, np.float32)
        vs = np.frombuffer(self._versions, dtype=np.int32) if self._versions else np.zeros(0, np.int32)
        action, at, vat = 0, 0, 0
        for k in range(self._pieces if stream is self._stream else stream.num_pieces):
            kind, ids = stream.kind(k), stream.piece_ids(k)
            if kind == "action":
                logprobs = None
                if self._given[action]:
                    logprobs, at = _frozen(lp[at : at + len(ids)]), at + len(ids)
                versions = None
                if self._stamped[action]:
                    versions, vat = _frozen(vs[vat : vat + len(ids)]), vat + len(ids)
                out.append(trusted_segment(SegmentKind.ACTION, ids, stream.turn(k), logprobs,
                                           self._rewards[action], self._finish[action], versions))
                action += 1
            elif kind == "prompt":
                out.append(trusted_segment(SegmentKind.PROMPT, ids, self._prompt_turn))
            else:
                out.append(trusted_segment(SegmentKind.OBSERVATION, ids, stream.turn(k)))
        return out

    def _finish_episode(self, record: StepRecord, terminated: bool, truncated: bool) -> Trajectory:
        """The episode's last row; every row of it (one per sequence) is in ``self._finished``."""
        assert self._stream is not None
        last = self._trajectory(self._stream, record, terminated, truncated, None)
        rows = [*self._sequences, last]
        if len(rows) > 1:
            for k, row in enumerate(rows):
                row.metadata.update({"sequence": k, "sequences": len(rows)})
        self._stream = None
        self._finished = rows
        for row in rows:
            if self.keep:
                self.trajectories.append(row)
            if self.on_episode is not None:
                self.on_episode(row)
        return last

    def _trajectory(
        self, stream: TokenStream, record: StepRecord, terminated: bool, truncated: bool, stop_reason: str | None
    ) -> Trajectory:
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
        if self._tool_calls and stop_reason != "context_reset":
            metadata["tool_calls"] = _call_dicts(self._call_turns, self._tool_calls)
        traj = Trajectory(
            segments=self._segments_of(stream),
            env_id=spec.id if spec is not None else type(self.env.unwrapped).__name__,
            seed=self._seed,
            stop_reason=stop_reason or record.stop_reason or ("terminated" if terminated else "truncated"),
            terminated=bool(terminated),
            truncated=bool(truncated),
            conformance=self._conformance_dicts(),
            sampling=self.sampling,
            metadata=metadata,
            images=list(self._images),
        )
        return traj

    def context_ids(self) -> list[int]:
        """The token ids of the episode's current context, what the policy continues next: read
        from the env's own token stream where it keeps one (no copy of them here), with the
        images they hold, when there are any (a :class:`~tokengym.policies.base.VisionContext`)."""
        if self._stream is None:
            raise ResetNeeded("no episode is under way: call reset() first")
        ids = self._stream.tolist()
        if self._images:
            from tokengym.policies.base import VisionContext

            return VisionContext(ids, self._images)
        return ids

    def pop_trajectories(self) -> list[Trajectory]:
        """Finished trajectories since the last call; the list is emptied."""
        out, self.trajectories = self.trajectories, []
        return out


def _frozen(values: np.ndarray) -> np.ndarray:
    """A read-only copy of ``values`` (a segment's own array)."""
    out = values.copy()
    out.setflags(write=False)
    return out


def _no_text(ids: Sequence[int]) -> str:
    """The recorder's own stream keeps no text: every piece's is ``""``."""
    return ""
