"""What every tool-call parser shares: the :class:`ToolCallParser` base, :class:`ParsedCall`, and the
helpers that turn hostile model text into errors the model reads.

A family's module (``hermes``, ``mistral``, ...) only says where its calls are in the text; how
a call's JSON is decoded, checked (an object, a name, arguments no deeper than
:data:`MAX_ARGUMENT_DEPTH`) and reported when malformed is written once, here, so every family
says the same things the same way.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

from ..function_tools import ToolCall

__all__ = ["MAX_ARGUMENT_DEPTH", "ParsedCall", "Schemas", "ToolCallParser", "parse_calls"]

MAX_ARGUMENT_DEPTH = 64
"""Arguments nested deeper than this are refused: deeper values cannot be copied, stored or
rendered without hitting Python's recursion limit, and no tool needs them."""

Schemas = Mapping[str, Mapping[str, Any]]
"""Tool name -> the JSON schema of its arguments."""


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
    id: str | None = None
    """The call id the model wrote (Mistral writes them); ``None`` when the format has none."""

    @property
    def ok(self) -> bool:
        """True when the call parsed; otherwise :attr:`error` says what the model is told."""
        return self.error is None

    def to_call(self, id: str | None = None) -> ToolCall:
        """The :class:`ToolCall` to run (only for a call that parsed); ``id`` defaults to the model's."""
        if self.error is not None or self.name is None or self.arguments is None:
            raise ValueError(f"tool call {self.index + 1} is malformed: {self.error}")
        return ToolCall(self.name, dict(self.arguments), id if id is not None else self.id)


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def too_deep(value: Any, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Whether ``value`` nests lists/dicts more than ``limit`` levels (checked without recursion)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        if depth >= limit:
            return True
        stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return False


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except GUARDED:
        return ""


def error_reason(err: BaseException) -> str:
    """What went wrong reading model text, said for the model (no traceback, no internals)."""
    if isinstance(err, RecursionError):
        return "it is nested too deeply"
    if isinstance(err, MemoryError):
        return "it is too large"
    if isinstance(err, SyntaxError):
        where = f" at line {err.lineno} column {err.offset}" if err.lineno else ""
        return f"{str(err.msg).split(';')[0].strip()}{where}"
    text = str(err).split(";")[0].strip() or type(err).__name__
    return text[:200]


GUARDED = (RecursionError, ValueError, OverflowError, MemoryError, SyntaxError, TypeError)


def _schemas_of(tools: Iterable[Mapping[str, Any]] | Schemas | None) -> dict[str, Mapping[str, Any]]:
    """Tool schemas (OpenAI style, inner ``{"name", "parameters"}``, or a name -> parameters map)
    as name -> parameters schema."""
    if not tools:
        return {}
    if isinstance(tools, Mapping):
        return {str(k): v for k, v in tools.items() if isinstance(v, Mapping)}
    out: dict[str, Mapping[str, Any]] = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, Mapping) else {}
    return out


class ToolCallParser:
    """Base class: ``parse(text, tools=None)`` returns every tool-call attempt in ``text``, in order.

    Subclasses implement :meth:`_parse`; :meth:`parse` turns anything the standard library
    raises on hostile text (deep nesting, huge numbers) into an error attempt the model reads.
    """

    name: ClassVar[str] = ""
    hint: ClassVar[str] = ""
    """How a call is written, appended to every format error."""
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    results_need_ids: ClassVar[bool] = False
    """The family's templates refuse a tool message without a call id (Mistral's): the error
    message of a call that did not run gets one from :meth:`make_call_id` too."""

    def parse(self, text: str, tools: Iterable[Mapping[str, Any]] | Schemas | None = None) -> list[ParsedCall]:
        """Every tool-call attempt in ``text``, in order; malformed ones carry the error the model is shown.

        ``tools`` (the episode's tool schemas) lets formats whose values are text convert them
        to the schema's types; the other formats ignore it.
        """
        try:
            return self._parse(text, _schemas_of(tools))
        except GUARDED as err:
            return [self._error(0, text[:200], f"could not be read: {error_reason(err)}")]

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        raise NotImplementedError

    def split_message(self, text: str) -> dict[str, Any] | None:
        """The assistant turn as the message a server hands the template, its reasoning, answer
        and calls apart, for a format whose template refuses the turn's raw text (Harmony's
        channels); ``None`` (the default): the raw text is the message's content."""
        return None

    def make_call_id(self, turn: int, index: int) -> str:
        """The id of call ``index`` of assistant turn ``turn`` when the model wrote none, in the
        form this family's template accepts."""
        return f"call_{turn}_{index}"

    # ----------------------------------------------------------- helpers
    def _error(self, index: int, raw: str, what: str, name: str | None = None) -> ParsedCall:
        """An error attempt; ``what`` follows "tool call N" (or "tool call N ("name")"), after a
        space, or directly when it starts with ":"."""
        label = f'tool call {index + 1} ("{name}")' if name else f"tool call {index + 1}"
        gap = "" if what.startswith(":") else " "
        return ParsedCall(index, raw, name=name, error=f"Error: {label}{gap}{what}. {self.hint}")

    def _decode(self, index: int, raw: str) -> tuple[Any, ParsedCall | None]:
        """``raw`` as JSON, or the error attempt that says why it is not."""
        try:
            return json.loads(raw), None
        except json.JSONDecodeError as err:
            return None, self._error(index, raw, f"is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})")
        except GUARDED as err:
            return None, self._error(index, raw, f"is not valid JSON ({error_reason(err)})")

    def _call(self, index: int, raw: str, obj: Any = None, *, decoded: bool = False) -> ParsedCall:
        """A call from a JSON object ``{"name": ..., "<argument key>": {...}}`` (``raw`` decoded unless ``decoded``)."""
        n = index + 1
        if not decoded:
            obj, bad = self._decode(index, raw)
            if bad is not None:
                return bad
        if not isinstance(obj, dict):
            return ParsedCall(index, raw, error=f"Error: tool call {n} must be a JSON object, got {_json_kind(obj)}. {self.hint}")
        name = obj.get("name")
        if not isinstance(name, str) or not name.strip():
            return ParsedCall(index, raw, error=f'Error: tool call {n} has no "name" string. {self.hint}')
        key = next((k for k in self.argument_keys if k in obj), self.argument_keys[0])
        return self._with_arguments(index, raw, name.strip(), obj.get(key, {}), key)

    def _with_arguments(self, index: int, raw: str, name: str, args: Any, key: str = "arguments") -> ParsedCall:
        if isinstance(args, str):  # double-encoded arguments (the OpenAI wire form) are accepted
            try:
                decoded_args = json.loads(args)
            except GUARDED:
                decoded_args = None
            if isinstance(decoded_args, dict):
                args = decoded_args
        if not isinstance(args, dict):
            return self._error(index, raw, f': "{key}" must be a JSON object, got {_json_kind(args)}', name)
        if too_deep(args):
            return self._error(index, raw, f"has arguments nested more than {MAX_ARGUMENT_DEPTH} levels deep", name)
        return ParsedCall(index, raw, name=name, arguments=args)

    def _json_args(self, index: int, raw: str, name: str, args_text: str) -> ParsedCall:
        """A call whose name the format gives apart from its JSON arguments text."""
        if not name:
            return self._error(index, raw, "has no tool name")
        try:
            args = json.loads(args_text.strip())
        except json.JSONDecodeError as err:
            why = f"{err.msg} at line {err.lineno} column {err.colno}"
            return self._error(index, raw, f"has arguments that are not valid JSON ({why})", name)
        except GUARDED as err:
            return self._error(index, raw, f"has arguments that are not valid JSON ({error_reason(err)})", name)
        return self._with_arguments(index, raw, name, args)

    def _json_list(self, first: int, text: str, pos: int) -> tuple[list[ParsedCall], int]:
        """The calls of the JSON list (or single object) at ``text[pos]``, numbered from ``first``,
        and where the JSON ends (``len(text)`` when it does not decode)."""
        try:
            value, end = json.JSONDecoder().raw_decode(text, pos)
        except json.JSONDecodeError:
            return [self._call(first, text[pos:])], len(text)  # reports the JSON error
        except GUARDED as err:
            return [self._error(first, text[pos : pos + 200], f"is not valid JSON ({error_reason(err)})")], len(text)
        raw = text[pos:end]
        if isinstance(value, dict):
            return [self._from_object(first, raw, value)], end
        if not value:
            return [self._error(first, raw, "is an empty list")], end
        return [self._from_object(first + i, _dumps(v), v) for i, v in enumerate(value)], end

    def _sectioned(
        self,
        text: str,
        markers: tuple[str, str, str, str],
        one: Callable[[int, str], ParsedCall],
    ) -> list[ParsedCall]:
        """The calls of a format that wraps them in a section of begin/end-marked calls
        (``markers``: section begin, section end, call begin, call end; DeepSeek's, Kimi K2's):
        ``one(index, body)`` reads a call's body. A missing section end (a stop before it) ends
        the section at the text's end; an unclosed call is an error attempt, and reading goes
        on at the next call."""
        section_begin, section_end, call_begin, call_end = markers
        begin = text.find(section_begin)
        first = text.find(call_begin)
        if begin < 0 and first < 0:
            return []
        pos = begin + len(section_begin) if begin >= 0 else first
        stop = text.find(section_end, pos)
        stop = len(text) if stop < 0 else stop
        section = text[pos:stop]
        calls = self._tagged(section, call_begin, call_end, one)
        return calls or [self._error(0, section.strip(), f"has no {call_begin} after {section_begin}")]

    def _tagged(self, text: str, open_tag: str, close_tag: str, one: Callable[[int, str], ParsedCall]) -> list[ParsedCall]:
        """The calls of a format that wraps each in ``open_tag`` ... ``close_tag`` (Gemma 4's):
        ``one(index, body)`` reads a call's body; an unclosed call is an error attempt, and reading
        goes on at the next call."""
        calls: list[ParsedCall] = []
        pos = 0
        while (start := text.find(open_tag, pos)) >= 0:
            body = start + len(open_tag)
            end = text.find(close_tag, body)
            nxt = text.find(open_tag, body)
            if end < 0 or 0 <= nxt < end:
                raw = text[body : nxt if nxt >= 0 else len(text)].strip()
                calls.append(self._error(len(calls), raw, f"is not closed: {open_tag} without {close_tag}"))
                if nxt < 0:
                    return calls
                pos = nxt
                continue
            calls.append(one(len(calls), text[body:end]))
            pos = end + len(close_tag)
        return calls

    def _from_object(self, index: int, raw: str, obj: Any) -> ParsedCall:
        return self._call(index, raw, obj, decoded=True)


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


@lru_cache(maxsize=64)
def _takes_tools(parse: Callable[..., Any]) -> bool:
    try:
        return "tools" in inspect.signature(parse).parameters
    except (TypeError, ValueError):
        return False


def parse_calls(parser: ToolCallParser, text: str, tools: Iterable[Mapping[str, Any]] | Schemas | None = None) -> list[ParsedCall]:
    """``parser.parse(text, tools=tools)``, or ``parser.parse(text)`` for a parser whose
    ``parse`` takes no tools (parsers written before tools were passed)."""
    if _takes_tools(type(parser).parse):
        return parser.parse(text, tools=tools)
    return parser.parse(text)
