"""tokengym.envs: gymnasium environments whose observations and actions are chat-template token ids.

Importing this package registers the built-in environments under the ``tokengym/``
namespace, so ``gymnasium.make("tokengym/Replay-v0", tokenizer="qwen3")`` works.
"""

from gymnasium.envs.registration import register, registry

from .chat import AssistantTurn, ChatEnv, EnvResponse, Prompt, token_space
from .conformance import Conformance, ConformanceError, KnownBehaviour
from .render import ChatRenderer, Message, Rendered, TemplateError
from .replay import ReplayEnv, example_transcript, load_transcript
from .tokenizers import PINNED_TOKENIZERS, fetch_tokenizer, load_tokenizer

__all__ = [
    "PINNED_TOKENIZERS",
    "AssistantTurn",
    "ChatEnv",
    "ChatRenderer",
    "Conformance",
    "ConformanceError",
    "EnvResponse",
    "KnownBehaviour",
    "Message",
    "Prompt",
    "Rendered",
    "ReplayEnv",
    "TemplateError",
    "example_transcript",
    "fetch_tokenizer",
    "load_tokenizer",
    "load_transcript",
    "registered_envs",
    "token_space",
]

_ENVS = {
    "tokengym/Replay-v0": "tokengym.envs.replay:ReplayEnv",
}

for _id, _entry in _ENVS.items():
    if _id not in registry:
        register(id=_id, entry_point=_entry)


def registered_envs() -> list[str]:
    """Ids of every environment registered under ``tokengym/``."""
    return sorted(i for i in registry if i.startswith("tokengym/"))
