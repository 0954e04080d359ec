"""tokengym.envs: gymnasium environments whose observations and actions are chat-template token ids.

Importing this package registers the built-in environments under the ``tokengym/``
namespace, so ``gymnasium.make("tokengym/Replay-v0", tokenizer="qwen3")`` works (without the
import: ``gymnasium.make("tokengym.envs:tokengym/Replay-v0", ...)``). Envs of other packages are
found by :func:`make_env` (``module:id``, modules to import, the ``tokengym.envs`` entry points).
"""

import sys
from typing import Any

from .builtin import AdditionEnv, CalculatorEnv, KeyValueEnv, PythonSandboxEnv, ShellEnv, ToolAdditionEnv
from .chat import AssistantTurn, ChatEnv, EnvResponse, Prompt, token_space
from .conformance import Conformance, ConformanceError, ConformanceSchedule, KnownBehaviour
from .parsers import (
    PARSERS,
    AtemParser,
    DSMLParser,
    DeepSeekParser,
    GraniteParser,
    GLMParser,
    Gemma4Parser,
    HarmonyParser,
    KimiK2Parser,
    HermesParser,
    Llama3JsonParser,
    MiniMaxM2Parser,
    MistralParser,
    ParsedCall,
    ParserDetection,
    PythonicParser,
    Qwen3CoderParser,
    ToolCallParser,
    XLAMParser,
    call_evidence,
    detect_parser,
    detect_parser_evidence,
    get_parser,
    parse_calls,
    register_parser,
)
from .render import ChatRenderer, Message, Rendered, TemplateError
from .registry import (
    ENTRY_POINT_GROUP,
    DeclaredEnv,
    EnvRef,
    declared_envs,
    make_env,
    register_builtin_envs,
    registered_envs,
    resolve_env_id,
)
from .replay import ReplayEnv, example_transcript, load_transcript
from .tokenizers import PINNED_TOKENIZERS, fetch_tokenizer, load_tokenizer
from .tool_runner import ToolRunner, abandoned_threads
from .mcp import MCPServerError, MCPTools
from .tool_env import CallRecord, ToolEnv, answer_reward, extract_answer, strip_reasoning, truncate_middle
from .function_tools import (
    Tool,
    ToolCall,
    ToolError,
    ToolOutcome,
    ToolResult,
    as_tool,
    check_arguments,
    tool,
    tools_of,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PARSERS",
    "PINNED_TOKENIZERS",
    "AdditionEnv",
    "AtemParser",
    "AssistantTurn",
    "CalculatorEnv",
    "CallRecord",
    "ChatEnv",
    "ChatRenderer",
    "Conformance",
    "ConformanceError",
    "ConformanceSchedule",
    "DeclaredEnv",
    "DSMLParser",
    "DeepSeekParser",
    "EnvRef",
    "EnvResponse",
    "GraniteParser",
    "GLMParser",
    "Gemma4Parser",
    "HarmonyParser",
    "KimiK2Parser",
    "HermesParser",
    "KeyValueEnv",
    "KnownBehaviour",
    "Llama3JsonParser",
    "MiniMaxM2Parser",
    "Message",
    "MistralParser",
    "ParsedCall",
    "ParserDetection",
    "Prompt",
    "PythonSandboxEnv",
    "PythonicParser",
    "Qwen3CoderParser",
    "Rendered",
    "ReplayEnv",
    "ShellEnv",
    "TemplateError",
    "MCPServerError",
    "MCPTools",
    "Tool",
    "ToolAdditionEnv",
    "ToolCall",
    "ToolCallParser",
    "ToolEnv",
    "ToolError",
    "ToolOutcome",
    "ToolResult",
    "ToolRunner",
    "XLAMParser",
    "abandoned_threads",
    "answer_reward",
    "as_tool",
    "call_evidence",
    "declared_envs",
    "check_arguments",
    "detect_parser",
    "detect_parser_evidence",
    "example_transcript",
    "extract_answer",
    "fetch_tokenizer",
    "get_parser",
    "load_tokenizer",
    "load_transcript",
    "make_env",
    "parse_calls",
    "register_parser",
    "registered_envs",
    "resolve_env_id",
    "strip_reasoning",
    "token_space",
    "tool",
    "tools_of",
    "truncate_middle",
]

register_builtin_envs()


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
