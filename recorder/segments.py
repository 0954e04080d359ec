"""Segments: the unit a trajectory is made of.

A segment is a run of tokens from one source: the prompt, a policy action, or an
environment observation. Only action tokens are trained on (mask 1); everything else is
context (mask 0). Keeping the source explicit is what lets every batch layout be a pure
view of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

__all__ = ["Segment", "SegmentKind"]


class SegmentKind(str, Enum):
    """Where a segment's tokens came from: the first prompt and observations are the env's
    (mask 0), actions are the policy's (mask 1)."""

    PROMPT = "prompt"
    ACTION = "action"
    OBSERVATION = "observation"


@dataclass(frozen=True, eq=False, slots=True)
class Segment:
    """A run of tokens from one source.

    ``logprobs`` exist only for action segments, one per token, when the policy gave them.
    ``reward`` is the turn's reward, carried by the turn's action segment. ``finish_reason``
    (action segments only) says why the policy stopped generating: ``"stop"`` (a stop token),
    ``"stop_string"``, ``"length"`` (the token budget ran out: the action may be cut short),
    or None when unknown. ``versions`` (action segments only) is the weight version that sampled
    each token (int32, >= 0), when the policy said (:mod:`tokengym.policies.versions`).
    """

    kind: SegmentKind
    token_ids: np.ndarray
    turn: int
    logprobs: np.ndarray | None = None
    reward: float = 0.0
    finish_reason: str | None = None
    versions: np.ndarray | None = None

    def __post_init__(self) -> None:
        ids = np.asarray(self.token_ids, dtype=np.int64).reshape(-1)
        object.__setattr__(self, "kind", SegmentKind(self.kind))
        object.__setattr__(self, "token_ids", ids)
        ids.setflags(write=False)
        if self.logprobs is not None:
            if self.kind is not SegmentKind.ACTION:
                raise ValueError(f"only action segments carry logprobs, not {self.kind.value} segments")
            lp = np.asarray(self.logprobs, dtype=np.float32).reshape(-1)
            if lp.shape != ids.shape:
                raise ValueError(f"{len(lp)} logprobs for {len(ids)} action tokens")
            lp.setflags(write=False)
            object.__setattr__(self, "logprobs", lp)
        if self.versions is not None:
            if self.kind is not SegmentKind.ACTION:
                raise ValueError(f"only action segments carry weight versions, not {self.kind.value} segments")
            v = np.asarray(self.versions, dtype=np.int32).reshape(-1)
            if v.shape != ids.shape:
                raise ValueError(f"{len(v)} weight versions for {len(ids)} action tokens")
            if v.size and int(v.min()) < 0:
                raise ValueError(f"weight versions are >= 0, got {int(v.min())}")
            v.setflags(write=False)
            object.__setattr__(self, "versions", v)
        if self.kind is not SegmentKind.ACTION and self.reward != 0.0:
            raise ValueError("rewards belong to action segments")
        if self.finish_reason is not None:
            if self.kind is not SegmentKind.ACTION:
                raise ValueError("finish reasons belong to action segments")
            object.__setattr__(self, "finish_reason", str(self.finish_reason))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def mask(self) -> np.ndarray:
        """1 on policy tokens, 0 on everything else."""
        return np.full(len(self.token_ids), 1 if self.kind is SegmentKind.ACTION else 0, dtype=np.int8)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Segment):
            return NotImplemented
        same_lp = (self.logprobs is None and other.logprobs is None) or (
            self.logprobs is not None and other.logprobs is not None and np.array_equal(self.logprobs, other.logprobs)
        )
        same_v = (self.versions is None and other.versions is None) or (
            self.versions is not None and other.versions is not None and np.array_equal(self.versions, other.versions)
        )
        return (
            same_v
            and self.kind is other.kind
            and self.turn == other.turn
            and self.reward == other.reward
            and self.finish_reason == other.finish_reason
            and np.array_equal(self.token_ids, other.token_ids)
            and same_lp
        )

    __hash__ = None  # type: ignore[assignment]


def trusted_segment(
    kind: SegmentKind, ids: np.ndarray, turn: int, logprobs: np.ndarray | None = None, reward: float = 0.0,
    finish_reason: str | None = None, versions: np.ndarray | None = None,
) -> Segment:
    """A :class:`Segment` of values its maker already holds in the checked form (read-only int64
    ids, float32 logprobs and int32 versions of the ids' length, on an action where it has them),
    without the constructor's checks: a few numpy calls a segment, which were most of the cost of
    turning a recorded stream or a stored row into a trajectory."""
    seg = object.__new__(Segment)
    put = object.__setattr__
    put(seg, "kind", kind)
    put(seg, "token_ids", ids)
    put(seg, "turn", turn)
    put(seg, "logprobs", logprobs)
    put(seg, "reward", float(reward))
    put(seg, "finish_reason", None if finish_reason is None else str(finish_reason))
    put(seg, "versions", versions)
    return seg
