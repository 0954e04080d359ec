"""tokengym.policies: policy adapters that generate assistant token ids from token contexts.

Adapters take the exact token context an environment built and return the exact tokens
they sampled, with logprobs and a finish reason. This package knows nothing of the
environments: the rollout driver in ``tokengym.recorder`` connects the two.
"""

from .base import FinishReason, Generation, LogprobKind, Policy, SamplingParams, agenerate
from .hf import HFPolicy
from .scripted import ScriptedPolicy

__all__ = [
    "FinishReason",
    "Generation",
    "HFPolicy",
    "LogprobKind",
    "Policy",
    "SamplingParams",
    "ScriptedPolicy",
    "agenerate",
]
