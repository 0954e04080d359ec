"""The Qwen3-Coder XML call format, registered as ``"qwen3_coder"``: ``<tool_call>``, ``<function=NAME>``
and one ``<parameter=KEY>`` block per argument, whose text values become the types of the tool's
JSON schema when the schemas are passed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .base import GUARDED, ParsedCall, Schemas, ToolCallParser, skip_space, too_deep

__all__ = ["Qwen3CoderParser"]


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


def convert(text: str, schema: Any) -> Any:
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
                if isinstance(value, dict if kind == "object" else list) and not too_deep(value):
                    return value
        except GUARDED:
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
        pos = skip_space(text, pos)
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
            pos = skip_space(text, pos)
            if text.startswith("</function>", pos):
                pos = skip_space(text, pos + len("</function>"))
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
            args[key] = convert(value, params.get(key))
            pos = end + len("</parameter>")


def _parameter_end(text: str, pos: int) -> int:
    """Where the ``</parameter>`` that ends the value at ``pos`` starts: the first one followed
    (after whitespace) by another parameter or ``</function>``; else the first one; ``-1`` if none."""
    first = text.find("</parameter>", pos)
    at = first
    while at >= 0:
        after = skip_space(text, at + len("</parameter>"))
        if text.startswith("<parameter=", after) or text.startswith("</function>", after):
            return at
        at = text.find("</parameter>", at + 1)
    return first
