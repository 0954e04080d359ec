"""tokengym.recorder: segments, trajectories, the wrapper that records episodes, the store and the
batch layouts; the drivers that run episodes (`drivers`), the integrations (`integrations`), the
GRPO loop (`learning`) and the command line (`cli`) sit on top, and the names users call are
re-exported here."""

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time each name loads on first use
    from .advantages import (
        GroupSignal,
        GRPOAdvantages,
        NoGroupSignalWarning,
        group_by_task,
        group_signal,
        grpo_advantages,
    )
    from .drivers.async_rollout import AsyncRollout, AsyncRolloutStats, StalenessStall
    from .batches import BatchBuffers, MissingLogprobsWarning, PackedBatch, VerlBatch, to_packed, to_trl, to_verl
    from .learning import GRPOConfig, TrainingRun, train_grpo
    from .drivers.rollout import EpisodeError, RolloutResult, RolloutStats, rollout, summary_table
    from .segments import Segment, SegmentKind
    from .store import TrajectoryWriter, read_table, read_trajectories, tokenizer_fingerprint
    from .training import GRPOLoss, grpo_loss, policy_logprobs
    from .trajectory import Trajectory, summarize_conformance
    from .wrapper import RecordEpisodes

_EXPORTS: dict[str, str] = {  # name -> the module that defines it (imported on first use)
    "GRPOAdvantages": ".advantages",
    "GroupSignal": ".advantages",
    "NoGroupSignalWarning": ".advantages",
    "group_by_task": ".advantages",
    "group_signal": ".advantages",
    "grpo_advantages": ".advantages",
    "BatchBuffers": ".batches",
    "MissingLogprobsWarning": ".batches",
    "PackedBatch": ".batches",
    "VerlBatch": ".batches",
    "to_packed": ".batches",
    "to_trl": ".batches",
    "to_verl": ".batches",
    "AsyncRollout": ".drivers.async_rollout",
    "AsyncRolloutStats": ".drivers.async_rollout",
    "StalenessStall": ".drivers.async_rollout",
    "Deadlines": ".drivers.step_pool",
    "EpisodeTimeout": ".drivers.step_pool",
    "EpisodeError": ".drivers.rollout",
    "RolloutResult": ".drivers.rollout",
    "RolloutStats": ".drivers.rollout",
    "rollout": ".drivers.rollout",
    "summary_table": ".drivers.rollout",
    "GRPOConfig": ".learning",
    "TrainingRun": ".learning",
    "train_grpo": ".learning",
    "Segment": ".segments",
    "SegmentKind": ".segments",
    "TrajectoryWriter": ".store",
    "read_table": ".store",
    "read_trajectories": ".store",
    "tokenizer_fingerprint": ".store",
    "GRPOLoss": ".training",
    "grpo_loss": ".training",
    "policy_logprobs": ".training",
    "Trajectory": ".trajectory",
    "summarize_conformance": ".trajectory",
    "RecordEpisodes": ".wrapper",
}

__all__ = [
    "AsyncRollout",
    "AsyncRolloutStats",
    "BatchBuffers",
    "Deadlines",
    "EpisodeError",
    "EpisodeTimeout",
    "GRPOAdvantages",
    "GRPOConfig",
    "GRPOLoss",
    "GroupSignal",
    "MissingLogprobsWarning",
    "NoGroupSignalWarning",
    "PackedBatch",
    "RecordEpisodes",
    "RolloutResult",
    "RolloutStats",
    "Segment",
    "SegmentKind",
    "StalenessStall",
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
    """The exported names, each imported from its module when first asked for, so that ``import
    tokengym.recorder.store`` (or the CLI's ``--help``) does not load the drivers, the policies and
    the training loop; and ``__version__``, read from the installed package's metadata (an
    ``importlib.metadata`` scan, which plain imports should not pay)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    if name == "__version__":
        from importlib.metadata import version

        return version("tokengym")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# ``tokengym`` is a namespace over envs/, policies/ and recorder/, with no __init__ of its own:
# each part gives it the same ``__version__``, so ``tokengym.__version__`` works once any is imported.
vars(sys.modules["tokengym"]).setdefault("__getattr__", __getattr__)
