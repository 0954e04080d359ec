"""Trajectory: one episode as ordered segments, with the arrays a trainer needs.

It never reorders, re-tokenizes or drops tokens: ``token_ids`` is the concatenation of
the segments, which is exactly the stream the policy saw.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from .segments import Segment, SegmentKind

__all__ = ["Trajectory", "require_trajectories", "summarize_conformance"]


def summarize_conformance(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts per status, the known behaviours seen, and every mismatch's detail.

    ``turns_checked`` counts the turns compared with the template (``ok``, ``known`` and
    ``mismatch``); ``deferred`` counts the turns a schedule left to a later check (the check on
    the episode's last turn covers them), so a deferred turn is never counted as ``ok``.
    """
    statuses = Counter(r.get("status", "off") for r in results)
    return {
        "turns_checked": sum(statuses.get(s, 0) for s in ("ok", "known", "mismatch")),
        "ok": statuses.get("ok", 0),
        "known": statuses.get("known", 0),
        "mismatch": statuses.get("mismatch", 0),
        "deferred": statuses.get("deferred", 0),
        "behaviours": sorted({b for r in results for b in r.get("behaviours", ())}),
        "mismatches": [r["detail"] for r in results if r.get("status") == "mismatch"],
    }


@dataclass(eq=False)
class Trajectory:
    """A recorded episode.

    Attributes:
        segments: prompt first, then per turn an action and (unless the episode ended) an observation.
        conformance: the per-turn template check results, as dicts.
        sampling: the sampling settings that produced the actions, when known.
    """

    segments: list[Segment]
    env_id: str | None = None
    seed: int | None = None
    stop_reason: str | None = None
    terminated: bool = False
    truncated: bool = False
    conformance: list[dict[str, Any]] = field(default_factory=list)
    sampling: dict[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)
    """The images in this row's stream (:class:`tokengym.envs.images.StreamImage`: each one's
    placeholder run is ``token_ids[offset : offset + num_tokens]``)."""

    def __post_init__(self) -> None:
        segs = self.segments
        if not segs or segs[0].kind is not SegmentKind.PROMPT:
            raise ValueError("a trajectory starts with exactly one prompt segment")
        prev = segs[0]
        for s in segs[1:]:
            if s.kind is SegmentKind.PROMPT:
                raise ValueError("a trajectory has only one prompt segment")
            if s.kind is prev.kind:
                raise ValueError(f"two {s.kind.value} segments in a row (turn {s.turn})")
            if s.kind is SegmentKind.OBSERVATION and prev.kind is not SegmentKind.ACTION:
                raise ValueError("an observation must follow an action")
            if s.kind is SegmentKind.OBSERVATION and s.turn != prev.turn:
                raise ValueError(f"observation of turn {s.turn} follows the action of turn {prev.turn}")
            prev = s
        turns = [s.turn for s in self.actions]
        first = turns[0] if turns else 0
        if turns != list(range(first, first + len(turns))) or (first and segs[0].turn != first):
            raise ValueError(
                f"action turns must be 0, 1, 2, ... (or k, k+1, ... in a later sequence of an episode, whose "
                f"prompt segment has turn k); got {turns}"
            )
        if self.images:
            from tokengym.envs.images import check_image_runs

            check_image_runs(self.token_ids, self.images, where=f"a trajectory of {self.env_id or 'an env'}")

    # ------------------------------------------------------------ structure
    @property
    def actions(self) -> list[Segment]:
        """The policy's segments (mask 1), one per turn, in order."""
        return [s for s in self.segments if s.kind is SegmentKind.ACTION]

    @property
    def num_turns(self) -> int:
        """How many assistant turns the episode had."""
        return len(self.actions)

    @property
    def prompt_len(self) -> int:
        """Tokens of the first segment (the prompt), which trainers keep apart from the response."""
        return len(self.segments[0])

    def __len__(self) -> int:
        return int(sum(len(s) for s in self.segments))

    @cached_property
    def offsets(self) -> np.ndarray:
        """Start offset of each segment in ``token_ids`` (and the total length last)."""
        out = np.zeros(len(self.segments) + 1, dtype=np.int64)
        np.cumsum([len(s.token_ids) for s in self.segments], out=out[1:])
        return out

    @property
    def action_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each action in ``token_ids``, in turn order."""
        o = self.offsets
        return [(int(o[i]), int(o[i + 1])) for i, s in enumerate(self.segments) if s.kind is SegmentKind.ACTION]

    # --------------------------------------------------------------- arrays
    @cached_property
    def token_ids(self) -> np.ndarray:
        return np.concatenate([s.token_ids for s in self.segments]).astype(np.int64)

    @cached_property
    def mask(self) -> np.ndarray:
        """1 on policy tokens, 0 elsewhere (int8)."""
        segs = self.segments
        policy = np.fromiter((s.kind is SegmentKind.ACTION for s in segs), np.int8, len(segs))
        return np.repeat(policy, np.diff(self.offsets))

    @cached_property
    def logprobs(self) -> np.ndarray:
        """Rollout logprobs (float32); NaN where no logprob exists (masked tokens, or not given)."""
        parts = [
            s.logprobs if s.logprobs is not None else np.full(len(s), np.nan, dtype=np.float32)
            for s in self.segments
        ]
        return np.concatenate(parts).astype(np.float32)

    @cached_property
    def versions(self) -> np.ndarray:
        """The weight version that sampled each token (int32): -1 on mask-0 tokens and on policy
        tokens whose policy did not say (:attr:`has_versions`)."""
        out = np.full(int(self.offsets[-1]), -1, dtype=np.int32)
        for s, start in zip(self.segments, self.offsets):
            if s.versions is not None:
                out[start : start + len(s)] = s.versions
        return out

    @property
    def has_versions(self) -> bool:
        """Every action says which weight version sampled each of its tokens."""
        return bool(self.actions) and all(a.versions is not None for a in self.actions)

    @property
    def version_span(self) -> tuple[int, int] | None:
        """``(oldest, newest)`` weight version of this row's policy tokens; None when none is known."""
        known = self.versions[self.versions >= 0]
        return (int(known.min()), int(known.max())) if known.size else None

    def version_changes(self) -> list[tuple[int, int, int]]:
        """``(offset, old, new)`` for every policy token whose version differs from the policy token
        before it: where a weight update fell inside this row (empty when one version sampled all)."""
        pos = np.flatnonzero(self.versions >= 0)
        v = self.versions[pos]
        at = np.flatnonzero(v[1:] != v[:-1]) + 1
        return [(int(pos[i]), int(v[i - 1]), int(v[i])) for i in at]

    @property
    def has_logprobs(self) -> bool:
        """Every action carries logprobs."""
        return bool(self.actions) and all(a.logprobs is not None for a in self.actions)

    @property
    def turn_rewards(self) -> np.ndarray:
        """The reward of each turn, in turn order (float32)."""
        return np.array([a.reward for a in self.actions], dtype=np.float32)

    @property
    def finish_reasons(self) -> list[str | None]:
        """Why each turn's generation stopped (``"stop"``, ``"stop_string"``, ``"length"``; None: unknown)."""
        return [a.finish_reason for a in self.actions]

    @property
    def reward(self) -> float:
        """The episode's return: the sum of the turn rewards."""
        return float(self.turn_rewards.sum())

    @property
    def first_turn(self) -> int:
        """The episode turn of this row's first action: 0, or k for a later sequence of an episode
        recorded with ``history="deploy"`` (``metadata["sequence"]`` > 0)."""
        return self.segments[0].turn

    def context(self, turn: int) -> np.ndarray:
        """The exact token ids the policy was prompted with for ``turn`` (an episode turn of this row)."""
        start, _ = self.action_spans[turn - self.first_turn]
        return self.token_ids[:start].copy()

    @property
    def conformance_summary(self) -> dict[str, Any]:
        """Per-episode conformance counts (ok / known / mismatch / deferred) from the steps' ``info``."""
        return summarize_conformance(self.conformance)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (token ids, mask, logprobs with null for missing, segments, finish reasons, metadata)."""
        lp = self.logprobs
        return {
            "token_ids": self.token_ids.tolist(),
            "mask": self.mask.tolist(),
            "logprobs": [None if np.isnan(x) else float(x) for x in lp],
            "versions": self.versions.tolist(),
            "segments": [
                {"kind": s.kind.value, "start": int(self.offsets[i]), "end": int(self.offsets[i + 1]), "turn": s.turn}
                for i, s in enumerate(self.segments)
            ],
            "turn_rewards": self.turn_rewards.tolist(),
            "finish_reasons": self.finish_reasons,
            "reward": self.reward,
            "prompt_len": self.prompt_len,
            "env_id": self.env_id,
            "seed": self.seed,
            "stop_reason": self.stop_reason,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "conformance": self.conformance_summary,
            "sampling": self.sampling,
            "metadata": self.metadata,
        }


def require_trajectories(trajs: Sequence[Trajectory]) -> None:
    """Refuse an empty batch by name: a trainer fed nothing should hear why, not get empty tensors."""
    if len(trajs) == 0:
        raise ValueError("no trajectories to batch: pass a non-empty list (env.trajectories of RecordEpisodes, rollout(...).trajectories or read_trajectories(DIR))")


def refuse_images(trajs: Sequence[Trajectory], what: str) -> None:
    """Refuse trajectories that hold images where ``what`` cannot carry them yet (by name: a
    layout or a store that dropped the pixels would train a VLM on placeholders alone)."""
    with_images = [i for i, t in enumerate(trajs) if t.images]
    if with_images:
        n = sum(len(trajs[i].images) for i in with_images)
        raise ValueError(
            f"{len(with_images)} of the {len(trajs)} trajectories hold images ({n} in all; the first is #{with_images[0]}), "
            f"and {what} does not carry images yet: a teacher-forced pass needs each trajectory's images "
            "(traj.images: pixel values and grids) beside its token ids"
        )
