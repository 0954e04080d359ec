"""tokengym.recorder: segments, trajectories, the wrapper that records episodes, the store and the
batch layouts; the drivers that run episodes (`drivers`), the integrations (`integrations`), the
GRPO loop (`learning`) and the command line (`cli`) sit on top, and the names users call are
re-exported here."""

import sys
from typing import Any

from .advantages import (
    GroupSignal,
    GRPOAdvantages,
    NoGroupSignalWarning,
    group_by_task,
    group_signal,
    grpo_advantages,
)
from .batches import PackedBatch, VerlBatch, to_packed, to_trl, to_verl
from .learning import GRPOConfig, TrainingRun, train_grpo
from .drivers.rollout import EpisodeError, RolloutResult, RolloutStats, rollout, summary_table
from .segments import Segment, SegmentKind
from .store import TrajectoryWriter, read_table, read_trajectories, tokenizer_fingerprint
from .training import GRPOLoss, grpo_loss, policy_logprobs
from .trajectory import Trajectory, summarize_conformance
from .wrapper import RecordEpisodes

__all__ = [
    "EpisodeError",
    "GRPOAdvantages",
    "GRPOConfig",
    "GRPOLoss",
    "GroupSignal",
    "NoGroupSignalWarning",
    "PackedBatch",
    "RecordEpisodes",
    "RolloutResult",
    "RolloutStats",
    "Segment",
    "SegmentKind",
    "TrainingRun",
    "Trajectory",
    "VerlBatch",
    "group_by_task",
    "group_signal",
    "grpo_advantages",
    "grpo_loss",
    "policy_logprobs",
    "rollout",
    "summarize_conformance",
    "summary_table",
    "to_packed",
    "to_trl",
    "to_verl",
    "train_grpo",
    "TrajectoryWriter",
    "read_table",
    "read_trajectories",
    "tokenizer_fingerprint",
]


def __getattr__(name: str) -> Any:
    """``__version__``, read from the installed package's metadata when first asked for (it costs
    an ``importlib.metadata`` scan, which plain imports should not pay)."""
    if name == "__version__":
        from importlib.metadata import version

        return version("tokengym")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ``tokengym`` is a namespace over envs/, policies/ and recorder/, with no __init__ of its own:
# each part gives it the same ``__version__``, so ``tokengym.__version__`` works once any is imported.
vars(sys.modules["tokengym"]).setdefault("__getattr__", __getattr__)
