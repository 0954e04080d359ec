"""tokengym.recorder: segments, trajectories and the wrapper that records episodes."""

from .batches import (
    PackedBatch,
    VerlBatch,
    group_by_task,
    grpo_advantages,
    to_packed,
    to_trl,
    to_verl,
)
from .rollout import EpisodeError, RolloutResult, RolloutStats, rollout, summary_table
from .segments import Segment, SegmentKind
from .store import TrajectoryWriter, read_table, read_trajectories, tokenizer_fingerprint
from .trajectory import Trajectory, summarize_conformance
from .wrapper import RecordEpisodes

__all__ = [
    "EpisodeError",
    "PackedBatch",
    "RecordEpisodes",
    "RolloutResult",
    "RolloutStats",
    "Segment",
    "SegmentKind",
    "Trajectory",
    "VerlBatch",
    "group_by_task",
    "grpo_advantages",
    "rollout",
    "summarize_conformance",
    "summary_table",
    "to_packed",
    "to_trl",
    "to_verl",
    "TrajectoryWriter",
    "read_table",
    "read_trajectories",
    "tokenizer_fingerprint",
]
