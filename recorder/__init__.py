"""tokengym.recorder: segments, trajectories and the wrapper that records episodes."""

from .segments import Segment, SegmentKind
from .trajectory import Trajectory, summarize_conformance
from .wrapper import RecordEpisodes

__all__ = ["RecordEpisodes", "Segment", "SegmentKind", "Trajectory", "summarize_conformance"]
