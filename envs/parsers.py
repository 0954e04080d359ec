"""Tool-call parsers: the assistant's generated text -> tool calls, or precise error texts.

Each parser knows one model family's format:

* ``"hermes"`` (aliases ``"qwen"``, ``"chatml"``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn (Qwen2.5, Qwen3 and templates that copy the Hermes/ChatML tool format);
* ``"llama3_json"``: a turn that *starts* with a JSON object ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;`` or whitespace (Llama 3.1-3.3).

:func:`detect_parser` picks one from a chat template, :func:`get_parser` resolves a name, an
instance or ``None`` (auto), and :func:`register_parser` adds a family. A malformed call
(bad JSON, not an object, no ``name``, ``arguments`` not an object, an unterminated tag) is
returned as a :class:`ParsedCall` whose ``error`` is the text the model reads; nothing is
dropped and nothing raises.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .tools import ToolCall

__all__ = [
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "ParsedCall",
    "ToolCallParser",
    "detect_parser",
    "get_parser",
    "register_parser",
]


@dataclass(frozen=True)
class ParsedCall:
    """One tool-call attempt found in the text: a call, or the reason it is malformed."""

    index: int
    """Position among the turn's attempts (0-based)."""
    text: str
    """The attempt's raw text (what was inside the tags, or the JSON)."""
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None
    """Why the attempt is not a call, as the model will read it; ``None`` for a well-formed call."""

    @property
    def ok(self) -> bool:
        """True when the call parsed; otherwise :attr:`error` says what the model is told."""
        return self.error is None

    def to_call(self, id: str | None = None) -> ToolCall:
        """The :class:`ToolCall` to run (only for a call that parsed)."""
        if self.error is not None or self.name is None or self.arguments is None:
            raise ValueError(f"tool call {self.index + 1} is malformed: {self.error}")
        return ToolCall(self.name, dict(self.arguments), id)


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


class ToolCallParser:
    """Base class: ``parse(text)`` returns every tool-call attempt in ``text``, in order."""

    name: ClassVar[str] = ""
    hint: ClassVar[str] = ""
    """How a call is written, appended to every format error."""
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def parse(self, text: str) -> list[ParsedCall]:
        """Every tool-call attempt in ``text``, in order; malformed ones carry the error the model is shown."""
        raise NotImplementedError

    def _call(self, index: int, raw: str, obj: Any = None, *, decoded: bool = False) -> ParsedCall:
        n = index + 1
        if not decoded:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as err:
                return ParsedCall(
                    index, raw, error=f"Error: tool call {n} is not valid JSON ({err.msg} at line {err.lineno} "
                    f"column {err.colno}). {self.hint}"
                )
        if not isinstance(obj, dict):
            return ParsedCall(index, raw, error=f"Error: tool call {n} must be a JSON object, got {_json_kind(obj)}. {self.hint}")
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return ParsedCall(index, raw, error=f'Error: tool call {n} has no "name" string. {self.hint}')
        name = name.strip()
        key = next((k for k in self.argument_keys if k in obj), self.argument_keys[0])
        args = obj.get(key, {})
        if isinstance(args, str):  # double-encoded arguments (the OpenAI wire form) are accepted
            try:
                decoded_args = json.loads(args)
            except json.JSONDecodeError:
                decoded_args = None
            if isinstance(decoded_args, dict):
                args = decoded_args
        if not isinstance(args, dict):
            return ParsedCall(
                index, raw, name=name,
                error=f'Error: tool call {n} ("{name}"): "{key}" must be a JSON object, got {_json_kind(args)}. {self.hint}',
            )
        return ParsedCall(index, raw, name=name, arguments=args)


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, anywhere in the turn."""

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    hint = 'Write each call as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.'

    def parse(self, text: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                return calls
            body = start + len(self.open_tag)
            end = text.find(self.close_tag, body)
            nxt = text.find(self.open_tag, body)
            if end < 0 or 0 <= nxt < end:
                stop = nxt if nxt >= 0 else len(text)
                calls.append(
                    ParsedCall(
                        len(calls), text[body:stop].strip(),
                        error=f"Error: tool call {len(calls) + 1} is not closed: {self.open_tag} without "
                        f"{self.close_tag}. {self.hint}",
                    )
                )
                pos = stop
                continue
            calls.append(self._call(len(calls), text[body:end].strip()))
            pos = end + len(self.close_tag)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON calls: the turn starts with ``{"name": ..., "parameters": {...}}``.

    A turn whose text (after an optional ``<|python_tag|>``) starts with ``{`` is a tool call;
    further calls may follow, separated by ``;`` or whitespace; text after the last one is ignored.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    hint = 'Write each call as {"name": "<tool>", "parameters": {...}}.'
    argument_keys = ("parameters", "arguments")

    def parse(self, text: str) -> list[ParsedCall]:
        s = text.strip()
        if s.startswith(self.python_tag):
            s = s[len(self.python_tag) :].lstrip()
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(s) and s[pos] == "{":
            try:
                obj, end = decoder.raw_decode(s, pos)
            except json.JSONDecodeError as err:
                calls.append(self._call(len(calls), s[pos:]))  # reports the JSON error
                break
            calls.append(self._call(len(calls), s[pos:end], obj, decoded=True))
            pos = end
            while pos < len(s) and (s[pos].isspace() or s[pos] == ";"):
                pos += 1
        return calls


PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "chatml": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama3": Llama3JsonParser,
}


def register_parser(name: str, factory: Callable[[], ToolCallParser], *, overwrite: bool = False) -> None:
    """Add a parser family under ``name`` (a class or any factory returning a :class:`ToolCallParser`)."""
    if name in PARSERS and not overwrite:
        raise ValueError(f"a parser named {name!r} is already registered (pass overwrite=True to replace it)")
    PARSERS[name] = factory


def detect_parser(chat_template: str | None) -> str:
    """The parser family a chat template's tool format belongs to (``"hermes"`` when unsure)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return "hermes"


def get_parser(spec: str | ToolCallParser | None = None, *, renderer: Any = None) -> ToolCallParser:
    """A parser from a registered name, an instance (returned as is) or ``None``: detected from
    ``renderer``'s chat template (its override, else its tokenizer's)."""
    if isinstance(spec, ToolCallParser):
        return spec
    if spec is None:
        template = None
        if renderer is not None:
            template = getattr(renderer, "chat_template", None) or getattr(
                getattr(renderer, "tokenizer", None), "chat_template", None
            )
        spec = detect_parser(template if isinstance(template, str) else None)
    try:
        return PARSERS[spec]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {spec!r}; registered: {', '.join(sorted(PARSERS))}") from None
