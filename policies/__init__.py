"""tokengym.policies: policy adapters that generate assistant token ids from token contexts.

Adapters take the exact token context an environment built and return the exact tokens
they sampled, with logprobs and a finish reason. This package knows nothing of the
environments: the rollout driver in ``tokengym.recorder`` connects the two.
"""

from .base import FinishReason, Generation, LogprobKind, Policy, SamplingParams, agenerate
from .hf import HFPolicy
from .openai_server import OpenAIServerPolicy
from .scripted import ScriptedPolicy, scripted_replies
from .vllm import AsyncVLLMPolicy, VLLMPolicy  # vllm itself is imported only when one is built

__all__ = [
    "AsyncVLLMPolicy",
    "FinishReason",
    "Generation",
    "HFPolicy",
    "LogprobKind",
    "OpenAIServerPolicy",
    "Policy",
    "SamplingParams",
    "ScriptedPolicy",
    "VLLMPolicy",
    "agenerate",
    "scripted_replies",
]
