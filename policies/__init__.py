"""tokengym.policies: policy adapters that generate assistant token ids from token contexts.

Adapters take the exact token context an environment built and return the exact tokens
they sampled, with logprobs and a finish reason. Policies do not drive environments: the
rollout driver in ``tokengym.recorder`` connects the two. ``tokengym.envs`` is the layer below
(tokenizers and the chat renderer, which :func:`scripted_replies` uses), never the other way.
"""

import sys
from typing import Any

from .base import FinishReason, Generation, LogprobKind, Policy, SamplingParams, StreamsTokens, TokenListener, agenerate
from .hf import HFPolicy
from .hf_vision import HFVisionPolicy
from .openai_server import OpenAIServerPolicy
from .scripted import ScriptedPolicy, scripted_replies
from .versions import OnUpdate, PolicyClosed, Versioned, VersionWentBackwards, WeightsMismatch, WeightUpdateError
from .vllm import AsyncVLLMPolicy, VLLMPolicy  # vllm itself is imported only when one is built

__all__ = [
    "AsyncVLLMPolicy",
    "FinishReason",
    "Generation",
    "HFPolicy",
    "HFVisionPolicy",
    "LogprobKind",
    "OnUpdate",
    "OpenAIServerPolicy",
    "Policy",
    "PolicyClosed",
    "SamplingParams",
    "ScriptedPolicy",
    "StreamsTokens",
    "TokenListener",
    "VLLMPolicy",
    "VersionWentBackwards",
    "Versioned",
    "WeightUpdateError",
    "WeightsMismatch",
    "agenerate",
    "scripted_replies",
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
