"""The parser families by name, and which one a chat template's tool format belongs to.

A small registry keeps the families independent: each module defines its parser, and this one
maps names and aliases to them (:data:`PARSERS`, :func:`register_parser` for families defined
elsewhere), reads a chat template for the markers that identify a family (``_DETECTION``), and
resolves what a user passes as ``parser=`` (:func:`get_parser`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import ToolCallParser
from .deepseek import DeepSeekParser
from .gemma4 import Gemma4Parser
from .glm import GLMParser
from .granite import GraniteParser
from .harmony import HarmonyParser
from .hermes import HermesParser
from .invoke import AtemParser, DSMLParser, MiniMaxM2Parser
from .kimi_k2 import KimiK2Parser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .pythonic import PythonicParser
from .qwen3_coder import Qwen3CoderParser
from .xlam import XLAMParser

__all__ = ["PARSERS", "ParserDetection", "detect_parser", "detect_parser_evidence", "get_parser", "register_parser"]


PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "chatml": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama3": Llama3JsonParser,
    "pythonic": PythonicParser,
    "llama3_pythonic": PythonicParser,
    "gemma": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
    "deepseek_v3": DeepSeekParser,
    "deepseek": DeepSeekParser,
    "deepseek_r1": DeepSeekParser,
    "mistral": MistralParser,
    "xlam": XLAMParser,
    "granite": GraniteParser,
    "kimi_k2": KimiK2Parser,
    "kimi": KimiK2Parser,
    "glm45": GLMParser,
    "glm47": GLMParser,
    "glm": GLMParser,
    "glm4_moe": GLMParser,
    "harmony": HarmonyParser,
    "gemma4": Gemma4Parser,
    "gpt_oss": HarmonyParser,
    "openai": HarmonyParser,
    "minimax_m2": MiniMaxM2Parser,
    "minimax": MiniMaxM2Parser,
    "muse_glimmer": AtemParser,
    "atem": AtemParser,
    "deepseek_v32": DSMLParser,
    "deepseek_v4": DSMLParser,
    "dsml": DSMLParser,
}


def register_parser(name: str, factory: Callable[[], ToolCallParser], *, overwrite: bool = False) -> None:
    """Add a parser family under ``name`` (a class or any factory returning a :class:`ToolCallParser`)."""
    if name in PARSERS and not overwrite:
        raise ValueError(f"a parser named {name!r} is already registered (pass overwrite=True to replace it)")
    PARSERS[name] = factory


@dataclass(frozen=True)
class ParserDetection:
    """Which parser family a chat template's tool format belongs to, and why."""

    name: str
    evidence: str
    """What in the template decided it, or why the name is a guess."""
    guessed: bool
    """True when nothing in the template named a format (the default ``"hermes"`` was taken)."""


# In order: the first rule whose text the template holds wins. Qwen3-Coder's template also
# holds <tool_call>, pythonic ones may describe JSON tools, and Llama's JSON templates are
# recognised by their ipython role last.
_DETECTION: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>commentary", "<|constrain|>")),
    ("gemma4", ("<|tool_call>call:",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("deepseek_v32", ("｜DSML｜",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("muse_glimmer", ("<atem:function_calls>",)),
    ("deepseek_v3", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("granite", ("<|tool_call|>",)),
    ("qwen3_coder", ("<function=",)),
    ("glm45", ("<arg_key>",)),
    ("pythonic", ("<|python_start|>", "[func_name1(", "[func_name(", "```tool_code")),
    ("xlam", ('[{"name": "tool_call_name"', "in a single JSON array")),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>",)),
)


def detect_parser_evidence(chat_template: str | None) -> ParserDetection:
    """The parser family of a chat template, with the text that decided it (or that it is a guess)."""
    template = chat_template or ""
    for name, needles in _DETECTION:
        for needle in needles:
            if needle in template:
                return ParserDetection(name, f"the template contains {needle!r}", False)
    if '"parameters"' in template and "ipython" in template:
        return ParserDetection("llama3_json", "the template has an ipython role and \"parameters\" JSON", False)
    why = "no chat template" if not template else "the template shows no known tool-call format"
    return ParserDetection("hermes", f"{why}; guessed 'hermes'", True)


def detect_parser(chat_template: str | None) -> str:
    """The parser family a chat template's tool format belongs to (``"hermes"`` when unsure;
    :func:`detect_parser_evidence` says whether it was a guess)."""
    return detect_parser_evidence(chat_template).name


def get_parser(spec: str | ToolCallParser | None = None, *, renderer: Any = None) -> ToolCallParser:
    """A parser from a registered name, an instance (returned as is) or ``None``: detected from
    ``renderer``'s chat template (its override, else its tokenizer's). When detection has to
    guess for a renderer, a warning says so and how to choose."""
    if isinstance(spec, ToolCallParser):
        return spec
    if spec is None:
        template = None
        if renderer is not None:
            template = getattr(renderer, "chat_template", None) or getattr(
                getattr(renderer, "tokenizer", None), "chat_template", None
            )
        found = detect_parser_evidence(template if isinstance(template, str) else None)
        if found.guessed and renderer is not None:
            warnings.warn(
                f"tool-call format: {found.evidence}; pass parser=... (one of {', '.join(sorted(PARSERS))}) "
                "to choose the model's own format",
                UserWarning,
                stacklevel=2,
            )
        spec = found.name
    try:
        return PARSERS[spec]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {spec!r}; registered: {', '.join(sorted(PARSERS))}") from None
