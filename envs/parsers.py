"""Tool-call parsers: the assistant's generated text -> tool calls, or precise error texts.

Each parser knows one model family's format (registered names, aliases in brackets):

* ``"hermes"`` (``"qwen"``, ``"chatml"``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn (Qwen2.5, Qwen3, Hermes and templates that copy them);
* ``"llama3_json"`` (``"llama3"``): a turn that *starts* with ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;`` or whitespace (Llama 3.1-3.3);
* ``"pythonic"`` (``"llama3_pythonic"``, ``"gemma"``): a Python list of calls with literal
  keyword arguments, ``[f(a=1, b="x"), g()]`` (Llama 3.2/4, Gemma 3), optionally inside
  ``<|python_start|>...<|python_end|>`` or a ```` ```tool_code ```` fence;
* ``"qwen3_coder"``: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
  values are text, converted with the tool's JSON schema when the schemas are passed;
* ``"deepseek_v3"`` (``"deepseek"``, ``"deepseek_r1"``): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  and a fenced JSON block, or V3.1's ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>``;
* ``"mistral"``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}]`` or the
  newer ``[TOOL_CALLS]NAME[ARGS]{json}``; ids are 9 letters or digits;
* ``"xlam"``: the turn is a JSON list ``[{"name": ..., "arguments": {...}}]`` (or holds one in a
  ```` ```json ```` fence);
* ``"granite"``: ``<|tool_call|>[{"name": ..., "arguments": {...}}]``.

:func:`detect_parser` picks a family from a chat template (:func:`detect_parser_evidence` also
says what decided it, or that it guessed), :func:`get_parser` resolves a name, an instance or
``None`` (auto), :func:`register_parser` adds a family. A malformed call is returned as a
:class:`ParsedCall` whose ``error`` is the text the model reads, ending with the family's
:attr:`~ToolCallParser.hint`; nothing is dropped and nothing the model writes makes a parser
raise: deep nesting, huge numbers and other hostile text become errors the model reads.
:func:`call_evidence` says why a turn that no parser call was found in still looks like a
tool call (another family's marker, or a call naming one of the episode's tools), so that
:class:`~tokengym.envs.ToolEnv` can answer with an error instead of scoring it.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

from .tools import ToolCall

__all__ = [
    "CALL_MARKERS",
    "MAX_ARGUMENT_DEPTH",
    "PARSERS",
    "DeepSeekParser",
    "GraniteParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedCall",
    "ParserDetection",
    "PythonicParser",
    "Qwen3CoderParser",
    "ToolCallParser",
    "XLAMParser",
    "call_evidence",
    "detect_parser",
    "detect_parser_evidence",
    "get_parser",
    "parse_calls",
    "register_parser",
]

MAX_ARGUMENT_DEPTH = 64
"""Arguments nested deeper than this are refused: deeper values cannot be copied, stored or
rendered without hitting Python's recursion limit, and no tool needs them."""
_MAX_INT_BITS = 14_000  # about 4,200 decimal digits: below Python's int-to-text limit (4,300 digits)

Schemas = Mapping[str, Mapping[str, Any]]
"""Tool name -> the JSON schema of its arguments."""

# Text that starts a tool call in some family's format.
CALL_MARKERS: tuple[str, ...] = (
    "<tool_call>",
    "<function=",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "<|python_start|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<|tool_call|>",
    "```tool_code",
)


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


def _too_deep(value: Any, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
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
    except _GUARDED:
        return ""


def _reason(err: BaseException) -> str:
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


_GUARDED = (RecursionError, ValueError, OverflowError, MemoryError, SyntaxError, TypeError)


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

    def parse(self, text: str, tools: Iterable[Mapping[str, Any]] | Schemas | None = None) -> list[ParsedCall]:
        """Every tool-call attempt in ``text``, in order; malformed ones carry the error the model is shown.

        ``tools`` (the episode's tool schemas) lets formats whose values are text convert them
        to the schema's types; the other formats ignore it.
        """
        try:
            return self._parse(text, _schemas_of(tools))
        except _GUARDED as err:
            return [self._error(0, text[:200], f"could not be read: {_reason(err)}")]

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        raise NotImplementedError

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
        except _GUARDED as err:
            return None, self._error(index, raw, f"is not valid JSON ({_reason(err)})")

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
            except _GUARDED:
                decoded_args = None
            if isinstance(decoded_args, dict):
                args = decoded_args
        if not isinstance(args, dict):
            return self._error(index, raw, f': "{key}" must be a JSON object, got {_json_kind(args)}', name)
        if _too_deep(args):
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
        except _GUARDED as err:
            return self._error(index, raw, f"has arguments that are not valid JSON ({_reason(err)})", name)
        return self._with_arguments(index, raw, name, args)

    def _json_list(self, first: int, text: str, pos: int) -> tuple[list[ParsedCall], int]:
        """The calls of the JSON list (or single object) at ``text[pos]``, numbered from ``first``,
        and where the JSON ends (``len(text)`` when it does not decode)."""
        try:
            value, end = json.JSONDecoder().raw_decode(text, pos)
        except json.JSONDecodeError:
            return [self._call(first, text[pos:])], len(text)  # reports the JSON error
        except _GUARDED as err:
            return [self._error(first, text[pos : pos + 200], f"is not valid JSON ({_reason(err)})")], len(text)
        raw = text[pos:end]
        if isinstance(value, dict):
            return [self._from_object(first, raw, value)], end
        if not value:
            return [self._error(first, raw, "is an empty list")], end
        return [self._from_object(first + i, _dumps(v), v) for i, v in enumerate(value)], end

    def _from_object(self, index: int, raw: str, obj: Any) -> ParsedCall:
        return self._call(index, raw, obj, decoded=True)


# ------------------------------------------------------------------ hermes
class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, anywhere in the turn.

    The JSON is decoded from the opening tag on, and the closing tag is expected after the
    object: a ``</tool_call>`` inside a string argument (code that prints one) stays in the string.
    """

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    hint = 'Write each call as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.'

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                return calls
            body = start + len(self.open_tag)
            first = _skip_space(text, body)
            if text.startswith("{", first):
                try:
                    obj, end = decoder.raw_decode(text, first)
                except _GUARDED:
                    obj, end = None, -1
                if end >= 0:
                    after = _skip_space(text, end)
                    if text.startswith(self.close_tag, after):
                        calls.append(self._call(len(calls), text[first:end], obj, decoded=True))
                        pos = after + len(self.close_tag)
                        continue
            # Not one JSON object followed by the closing tag: read up to the next tag to say why.
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


# ------------------------------------------------------------- llama 3 json
class Llama3JsonParser(ToolCallParser):
    """Llama 3.x JSON calls: the turn starts with ``{"name": ..., "parameters": {...}}``.

    A turn whose text (after an optional ``<|python_tag|>``) starts with ``{`` is a tool call;
    further calls may follow, separated by ``;`` or whitespace; text after the last one is ignored.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    hint = 'Write each call as {"name": "<tool>", "parameters": {...}}.'
    argument_keys = ("parameters", "arguments")

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        s = text.strip()
        if s.startswith(self.python_tag):
            s = s[len(self.python_tag) :].lstrip()
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(s) and s[pos] == "{":
            try:
                obj, end = decoder.raw_decode(s, pos)
            except _GUARDED:
                calls.append(self._call(len(calls), s[pos:]))  # reports the JSON error
                break
            calls.append(self._call(len(calls), s[pos:end], obj, decoded=True))
            pos = end
            while pos < len(s) and (s[pos].isspace() or s[pos] == ";"):
                pos += 1
        return calls


# ---------------------------------------------------------------- pythonic
class _NotLiteral(Exception):
    """An argument that is not a literal: said to the model, never evaluated."""


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST, depth: int = 0) -> Any:
    """The value of a literal expression; :class:`_NotLiteral` for anything else (nothing is evaluated)."""
    if depth > MAX_ARGUMENT_DEPTH:
        raise _NotLiteral(f"is nested more than {MAX_ARGUMENT_DEPTH} levels deep")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
            return value
        if isinstance(value, int):
            if value.bit_length() > _MAX_INT_BITS:
                raise _NotLiteral("is an integer too large to use")
            return value
        raise _NotLiteral(f"is a {type(value).__name__} literal (use a string, number, boolean, None, list or dict)")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
        value = _literal(node.operand, depth + 1)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise _NotLiteral("is a dict whose keys are not all strings")
            out[k.value] = _literal(v, depth + 1)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:  # the JSON spelling some templates print
        return _JSON_NAMES[node.id]
    kind = {ast.Name: "a variable", ast.Call: "a function call", ast.Attribute: "an attribute", ast.BinOp: "an expression"}
    raise _NotLiteral(f"is {kind.get(type(node), 'not a literal')}; only strings, numbers, booleans, None, lists and dicts are accepted")


_PY_LIST_START = re.compile(r"^[ \t]*\[\s*[A-Za-z_][\w.]*\s*\(", re.M)


def _python_end(s: str, start: int) -> int:
    """Index just past the bracket that closes ``s[start]``, skipping Python strings and
    comments; ``-1`` when it is never closed. Iterative: any nesting depth is fine."""
    depth, i, n = 0, start, len(s)
    while i < n:
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == "#":
            nl = s.find("\n", i)
            i = n if nl < 0 else nl
            continue
        elif c in "'\"":
            quote = s[i : i + 3] if s[i : i + 3] in ("'''", '"""') else c
            i += len(quote)
            while i < n and not s.startswith(quote, i):
                i += 2 if s[i] == "\\" else 1
            i += len(quote)
            continue
        i += 1
    return -1


class PythonicParser(ToolCallParser):
    """A Python list of calls, ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2/4, Gemma 3).

    The list may stand alone (from the start of a line; text after it is ignored), or sit in
    ``<|python_start|>...<|python_end|>`` (Llama 4) or a ```` ```tool_code ```` fence (Gemma), where
    bare calls ``f(a=1)`` one per line are accepted too. It is parsed with :mod:`ast` and only
    literals are accepted as arguments (strings, numbers, booleans, None, lists, dicts, and
    JSON's ``true``/``false``/``null``): nothing is evaluated; anything else is an error.
    """

    name = "pythonic"
    hint = 'Write the calls as a Python list of keyword-argument calls: [tool_a(x=1, y="text"), tool_b()].'

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        for open_mark, close_mark in (("<|python_start|>", "<|python_end|>"), ("```tool_code", "```")):
            at = text.find(open_mark)
            if at >= 0:
                body = at + len(open_mark)
                end = text.find(close_mark, body)
                if end < 0 and close_mark == "```":
                    return [self._error(0, text[body:].strip(), "is not closed: ```tool_code without a closing ```")]
                return self._calls(text[body : end if end >= 0 else len(text)].strip(), wrapped=True)
        found = _PY_LIST_START.search(text)
        if found is None:
            return []
        start = text.index("[", found.start())
        end = _python_end(text, start)
        if end < 0:
            return [self._error(0, text[start:].strip(), "is not closed: the list has no closing ]")]
        return self._calls(text[start:end], wrapped=False)

    def _calls(self, source: str, *, wrapped: bool) -> list[ParsedCall]:
        if not source:
            return [self._error(0, source, "is empty")]
        try:
            module = ast.parse(source, mode="exec")
        except _GUARDED as err:
            return [self._error(0, source, f"is not valid Python ({_reason(err)})")]
        exprs = [s.value for s in module.body if isinstance(s, ast.Expr)]
        if len(exprs) != len(module.body) or not exprs:
            return [self._error(0, source, "must be a list of calls, not statements")]
        if len(exprs) == 1 and isinstance(exprs[0], ast.List):
            elements = exprs[0].elts
        elif wrapped:
            elements = exprs
        else:
            return [self._error(0, source, "must be a list of calls")]
        if not elements:
            return [self._error(0, source, "is an empty list")]
        return [self._one(i, source, e) for i, e in enumerate(elements)]

    def _one(self, index: int, source: str, node: ast.expr) -> ParsedCall:
        raw = ast.get_source_segment(source, node) or ""
        if not isinstance(node, ast.Call):
            return self._error(index, raw, "is not a function call")
        if not isinstance(node.func, ast.Name):
            return self._error(index, raw, "must call a tool by its plain name")
        name = node.func.id
        if node.args:
            return self._error(index, raw, "has positional arguments; write every argument as name=value", name)
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return self._error(index, raw, "unpacks **arguments; write every argument as name=value", name)
            if kw.arg in args:
                return self._error(index, raw, f'gives argument "{kw.arg}" twice', name)
            try:
                args[kw.arg] = _literal(kw.value)
            except _NotLiteral as err:
                return self._error(index, raw, f': argument "{kw.arg}" {err}', name)
        return ParsedCall(index, raw, name=name, arguments=args)


# ------------------------------------------------------------ qwen3 coder
def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows, in order (``anyOf``/``oneOf`` flattened)."""
    if not isinstance(schema, Mapping):
        return []
    kinds = schema.get("type")
    types = [kinds] if isinstance(kinds, str) else [k for k in kinds if isinstance(k, str)] if isinstance(kinds, list) else []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types += _schema_types(option)
    if schema.get("nullable"):
        types.append("null")
    return types


def _convert(text: str, schema: Any) -> Any:
    """A parameter's text as the schema's type; the text itself when it does not read as one
    (the argument check then says what was expected)."""
    types = _schema_types(schema)
    if not types:
        return text
    word = text.strip()
    if "null" in types and word in ("null", "None"):
        return None
    for kind in types:
        if kind == "string":
            return text
        try:
            if kind == "integer":
                return int(word)
            if kind == "number":
                try:
                    return int(word)
                except ValueError:
                    value = float(word)
                    if value == value and value not in (float("inf"), float("-inf")):
                        return value
            if kind == "boolean" and word.lower() in ("true", "false"):
                return word.lower() == "true"
            if kind in ("object", "array"):
                value = json.loads(word)
                if isinstance(value, dict if kind == "object" else list) and not _too_deep(value):
                    return value
        except _GUARDED:
            continue
    return text


class Qwen3CoderParser(ToolCallParser):
    """Qwen3-Coder's XML calls::

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    Values are text (one newline after the opening and before the closing tag is layout);
    with the tools' schemas they become integers, numbers, booleans, objects or arrays. A
    ``</parameter>`` counts only where the next thing is another parameter or ``</function>``,
    so values may hold XML or code that mentions the tags.
    """

    name = "qwen3_coder"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    hint = (
        "Write each call as <tool_call>\n<function=TOOL_NAME>\n<parameter=ARG_NAME>\nvalue\n</parameter>\n"
        "</function>\n</tool_call>."
    )

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                bare = text.find("<function=", pos)  # a call without its <tool_call> wrapper
                if bare >= 0 and not calls:
                    calls.append(self._error(0, text[bare:].strip()[:200], f"must be inside {self.open_tag} ... {self.close_tag}"))
                return calls
            call, pos = self._one(len(calls), text, start + len(self.open_tag), schemas)
            calls.append(call)

    def _one(self, index: int, text: str, pos: int, schemas: Schemas) -> tuple[ParsedCall, int]:
        nxt = text.find(self.open_tag, pos)
        limit = nxt if nxt >= 0 else len(text)
        close = text.find(self.close_tag, pos)
        raw = text[pos : close if 0 <= close else limit].strip()
        pos = _skip_space(text, pos)
        if not text.startswith("<function=", pos):
            end = close + len(self.close_tag) if 0 <= close < limit else limit
            return self._error(index, raw, f"must start with <function=TOOL_NAME> inside {self.open_tag}"), end
        gt = text.find(">", pos)
        newline = text.find("\n", pos)
        if gt < 0 or 0 <= newline < gt:
            return self._error(index, raw, "has a <function= tag without its closing >"), limit
        name = text[pos + len("<function=") : gt].strip()
        if not name:
            return self._error(index, raw, "has no function name in <function=...>"), limit
        pos = gt + 1
        args: dict[str, Any] = {}
        params = schemas.get(name, {}).get("properties") if isinstance(schemas.get(name), Mapping) else None
        params = params if isinstance(params, Mapping) else {}
        while True:
            pos = _skip_space(text, pos)
            if text.startswith("</function>", pos):
                pos = _skip_space(text, pos + len("</function>"))
                if not text.startswith(self.close_tag, pos):
                    return self._error(index, raw, f"is not closed: </function> without {self.close_tag}", name), limit
                return ParsedCall(index, raw, name=name, arguments=args), pos + len(self.close_tag)
            if not text.startswith("<parameter=", pos):
                if pos >= len(text) or text.startswith(self.close_tag, pos):
                    what = "is missing </function>"
                else:
                    what = "has text that is not a <parameter=...> block before </function>"
                return self._error(index, raw, what, name), limit
            gt = text.find(">", pos)
            newline = text.find("\n", pos)
            if gt < 0 or 0 <= newline < gt:
                return self._error(index, raw, "has a <parameter= tag without its closing >", name), limit
            key = text[pos + len("<parameter=") : gt].strip()
            value_start = gt + 1
            end = _parameter_end(text, value_start)
            if end < 0:
                return self._error(index, raw, f"has parameter \"{key}\" without its closing </parameter>", name), limit
            if key in args:
                return self._error(index, raw, f'gives parameter "{key}" twice', name), limit
            value = text[value_start:end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _convert(value, params.get(key))
            pos = end + len("</parameter>")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _parameter_end(text: str, pos: int) -> int:
    """Where the ``</parameter>`` that ends the value at ``pos`` starts: the first one followed
    (after whitespace) by another parameter or ``</function>``; else the first one; ``-1`` if none."""
    first = text.find("</parameter>", pos)
    at = first
    while at >= 0:
        after = _skip_space(text, at + len("</parameter>"))
        if text.startswith("<parameter=", after) or text.startswith("</function>", after):
            return at
        at = text.find("</parameter>", at + 1)
    return first


# ---------------------------------------------------------------- deepseek
class DeepSeekParser(ToolCallParser):
    """DeepSeek V3 / R1 calls, and V3.1's shorter form::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
        ```json
        {"arg": 1}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    """

    name = "deepseek_v3"
    calls_begin = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"
    hint = (
        "Write the calls as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>TOOL_NAME\n"
        '```json\n{"arg": "value"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>.'
    )

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        begin = text.find(self.calls_begin)
        first = text.find(self.call_begin)
        if begin < 0 and first < 0:
            return []
        pos = begin + len(self.calls_begin) if begin >= 0 else first
        stop = text.find(self.calls_end, pos)
        stop = len(text) if stop < 0 else stop
        calls: list[ParsedCall] = []
        while True:
            start = text.find(self.call_begin, pos, stop)
            if start < 0:
                if not calls:
                    calls.append(self._error(0, text[pos:stop].strip(), f"has no {self.call_begin} after {self.calls_begin}"))
                return calls
            body = start + len(self.call_begin)
            end = text.find(self.call_end, body, stop)
            nxt = text.find(self.call_begin, body, stop)
            if end < 0 or 0 <= nxt < end:
                raw = text[body : nxt if nxt >= 0 else stop].strip()
                calls.append(self._error(len(calls), raw, f"is not closed: {self.call_begin} without {self.call_end}"))
                if nxt < 0:
                    return calls
                pos = nxt
                continue
            calls.append(self._one(len(calls), text[body:end]))
            pos = end + len(self.call_end)

    def _one(self, index: int, body: str) -> ParsedCall:
        raw = body.strip()
        if self.sep not in body:
            return self._error(index, raw, f"has no {self.sep} between the call type and the tool name")
        head, rest = body.split(self.sep, 1)
        if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>{json}
            name = head.strip()
            return self._json_args(index, raw, "" if name == "function" else name, rest)
        name, _, args = rest.partition("\n")
        args = args.strip()
        if args.startswith("```"):
            args = args.split("\n", 1)[1] if "\n" in args else ""
            if not args.rstrip().endswith("```"):
                return self._error(index, raw, "has a ```json block without its closing ```", name.strip())
            args = args.rstrip()[:-3]
        return self._json_args(index, raw, name.strip(), args)


# ----------------------------------------------------------------- mistral
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class MistralParser(ToolCallParser):
    """Mistral calls: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}, ...]``
    (Mistral 7B v0.3, Nemo), or ``[TOOL_CALLS]NAME[ARGS]{json}`` per call (v11+ tokenizers;
    ``[CALL_ID]ID`` may come before ``[ARGS]``). Mistral's templates refuse ids that are not 9
    letters or digits, so a call with another id is an error, and :meth:`make_call_id` makes such ids.
    """

    name = "mistral"
    bot = "[TOOL_CALLS]"
    hint = 'Write the calls as [TOOL_CALLS][{"name": "<tool>", "arguments": {...}, "id": "<9 letters or digits>"}].'

    def make_call_id(self, turn: int, index: int) -> str:
        n, out = (turn << 16) | index, ""
        while n:
            n, r = divmod(n, 62)
            out = _ALNUM[r] + out
        return out.rjust(9, "0")[-9:]

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        at = text.find(self.bot)
        if at < 0:
            return []
        pos = _skip_space(text, at + len(self.bot))
        if text.startswith(("[", "{"), pos) and not text.startswith(("[ARGS]", "[CALL_ID]"), pos):
            return self._json_list(0, text, pos)[0]
        calls: list[ParsedCall] = []
        for part in text[at:].split(self.bot)[1:]:
            calls.append(self._named(len(calls), part))
        return calls

    def _named(self, index: int, part: str) -> ParsedCall:
        raw = part.strip()
        brace = part.find("{")
        head = part[: brace if brace >= 0 else len(part)]
        if brace < 0:
            return self._error(index, raw[:200], "has no JSON arguments after the tool name")
        call_id = None
        if "[CALL_ID]" in head:
            head, _, call_id = head.partition("[CALL_ID]")
            call_id = call_id.replace("[ARGS]", "").strip()
        name = head.replace("[ARGS]", "").strip()
        try:
            args, end = json.JSONDecoder().raw_decode(part, brace)
        except json.JSONDecodeError as err:
            return self._error(index, raw, f"has arguments that are not valid JSON ({err.msg})", name or None)
        except _GUARDED as err:
            return self._error(index, raw, f"has arguments that are not valid JSON ({_reason(err)})", name or None)
        if not name:
            return self._error(index, raw, "has no tool name before [ARGS]")
        return self._checked_id(self._with_arguments(index, raw, name, args), call_id)

    def _from_object(self, index: int, raw: str, obj: Any) -> ParsedCall:
        call = self._call(index, raw, obj, decoded=True)
        return self._checked_id(call, obj.get("id") if isinstance(obj, dict) else None)

    def _checked_id(self, call: ParsedCall, call_id: Any) -> ParsedCall:
        if call_id is None or not call.ok:
            return call
        if not isinstance(call_id, str) or not _MISTRAL_ID.fullmatch(call_id):
            return self._error(call.index, call.text, f'has id {json.dumps(call_id)[:40]}; an id is 9 letters or digits', call.name)
        return ParsedCall(call.index, call.text, call.name, call.arguments, id=call_id)


# -------------------------------------------------------------------- xlam
class XLAMParser(ToolCallParser):
    """xLAM calls: the turn is a JSON list ``[{"name": ..., "arguments": {...}}, ...]``.

    The list either is the whole turn (text after it is ignored) or sits in a ```` ```json ````
    (or bare ```` ``` ````) fence anywhere in the turn. A list that does not start with an
    object (``[1, 2]``, ``[link](url)``) is text, not a call.
    """

    name = "xlam"
    hint = 'Write the calls as a JSON list and nothing before it: [{"name": "<tool>", "arguments": {...}}].'
    _fence = re.compile(r"```(?:json)?[ \t]*\n?(?=\s*\[\s*\{\s*\"name\")")
    _start = re.compile(r"\[\s*\{")

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        fence = self._fence.search(text)
        if fence is not None:
            pos = _skip_space(text, fence.end())
            return self._json_list(0, text, pos)[0]
        pos = _skip_space(text, 0)
        if self._start.match(text, pos):
            return self._json_list(0, text, pos)[0]
        return []


# ----------------------------------------------------------------- granite
class GraniteParser(ToolCallParser):
    """IBM Granite 3.x calls: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``."""

    name = "granite"
    bot = "<|tool_call|>"
    hint = 'Write the calls as <|tool_call|>[{"name": "<tool>", "arguments": {...}}].'

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        at = text.find(self.bot)
        while at >= 0:
            pos = _skip_space(text, at + len(self.bot))
            if text.startswith(("[", "{"), pos):
                found, end = self._json_list(len(calls), text, pos)
                calls += found
            else:
                calls.append(self._error(len(calls), text[pos : pos + 200].strip(), f"has no JSON list after {self.bot}"))
                end = pos
            at = text.find(self.bot, end)
        return calls


# ---------------------------------------------------------------- registry
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
    ("deepseek_v3", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("granite", ("<|tool_call|>",)),
    ("qwen3_coder", ("<function=",)),
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


def call_evidence(text: str, tool_names: Iterable[str] = ()) -> str | None:
    """Why ``text`` looks like a tool call, or ``None``: a call marker of any family
    (:data:`CALL_MARKERS`), a JSON object whose ``"name"`` is one of ``tool_names``, or a
    pythonic call of one (``[name(`` anywhere, or ``name(`` opening the turn)."""
    for marker in CALL_MARKERS:
        if marker in text:
            return f"it contains {marker!r}"
    names = [n for n in tool_names if n]
    if not names:
        return None
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    found = re.search(rf'"name"\s*:\s*"({alternatives})"', text)
    if found:
        return f'it has a JSON object naming the tool "{found.group(1)}"'
    found = re.search(rf"\[\s*({alternatives})\s*\(", text) or re.match(
        rf"\s*({alternatives})\s*\(\s*(?:\)|[A-Za-z_]\w*\s*=)", text
    )
    if found:
        return f'it has a Python-style call of the tool "{found.group(1)}"'
    return None
