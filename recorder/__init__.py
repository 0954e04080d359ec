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
from .segments import Segment, SegmentKind
from .store import TrajectoryWriter, read_table, read_trajectories, tokenizer_fingerprint
from .trajectory import Trajectory, summarize_conformance
from .wrapper import RecordEpisodes

__all__ = [
    "PackedBatch",
    "RecordEpisodes",
    "Segment",
    "SegmentKind",
    "Trajectory",
    "VerlBatch",
    "group_by_task",
    "grpo_advantages",
    "summarize_conformance",
    "to_packed",
    "to_trl",
    "to_verl",
    "TrajectoryWriter",
    "read_table",
    "read_trajectories",
    "tokenizer_fingerprint",
]
