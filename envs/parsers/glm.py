"""The GLM-4.5/4.6/4.7 call format, registered as ``"glm45"`` (``"glm"``, ``"glm4_moe"``)::

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

GLM-4.7 writes the same without the line breaks. A value is the argument's text when it is a
string and its JSON otherwise (the template writes ``v | tojson`` for anything but a string), so
with the tools' schemas a value becomes the schema's type, and without them a value that reads
as JSON is decoded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .base import GUARDED, ParsedCall, Schemas, ToolCallParser, skip_space, too_deep
from .qwen3_coder import convert

__all__ = ["GLMParser"]


def text_or_json(text: str, schema: Any) -> Any:
    if isinstance(schema, Mapping) and schema:
        return convert(text, schema)
    try:
        value = json.loads(text)
    except GUARDED:
        return text
    return text if too_deep(value) else value


class GLMParser(ToolCallParser):
    """GLM's ``<tool_call>NAME`` calls with one ``<arg_key>``/``<arg_value>`` pair per argument."""

    name = "glm45"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    hint = (
        "Write each call as <tool_call>TOOL_NAME\n<arg_key>ARG_NAME</arg_key>\n<arg_value>value</arg_value>\n"
        "</tool_call>."
    )

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        pos = 0
        while (start := text.find(self.open_tag, pos)) >= 0:
            call, pos = self._one(len(calls), text, start + len(self.open_tag), schemas)
            calls.append(call)
        return calls

    def _one(self, index: int, text: str, pos: int, schemas: Schemas) -> tuple[ParsedCall, int]:
        """The call whose body starts at ``pos``, and where reading goes on. Read in order, so a
        value may hold ``</tool_call>``: only a ``</arg_value>`` ends it."""
        nxt = text.find(self.open_tag, pos)
        limit = nxt if nxt >= 0 else len(text)
        close = text.find(self.close_tag, pos)
        raw = text[pos : close if 0 <= close < limit else limit].strip()
        name_end = min((at for at in (text.find("<arg_key>", pos), close) if at >= 0), default=limit)
        name = text[pos:name_end].strip()
        if not name or any(c in name for c in "<>{}\n"):
            return self._error(index, raw, "has no tool name: the name follows <tool_call> directly"), limit
        schema = schemas.get(name)
        params = schema.get("properties") if isinstance(schema, Mapping) else None
        params = params if isinstance(params, Mapping) else {}
        args: dict[str, Any] = {}
        pos = name_end
        while True:
            pos = skip_space(text, pos)
            if text.startswith(self.close_tag, pos):
                return ParsedCall(index, raw, name=name, arguments=args), pos + len(self.close_tag)
            if pos >= len(text) or text.startswith(self.open_tag, pos):
                return self._error(index, raw, f"is not closed: {self.open_tag} without {self.close_tag}", name), pos
            if not text.startswith("<arg_key>", pos):
                return self._error(index, raw, "has text that is not an <arg_key>...</arg_key> pair", name), limit
            key_end = text.find("</arg_key>", pos)
            if key_end < 0:
                return self._error(index, raw, "has an <arg_key> without its closing </arg_key>", name), limit
            key = text[pos + len("<arg_key>") : key_end].strip()
            pos = skip_space(text, key_end + len("</arg_key>"))
            if not text.startswith("<arg_value>", pos):
                return self._error(index, raw, f'has no <arg_value> after the key "{key}"', name), limit
            value_end = text.find("</arg_value>", pos)
            if value_end < 0:
                return self._error(index, raw, f'has the value of "{key}" without its closing </arg_value>', name), limit
            if key in args:
                return self._error(index, raw, f'gives argument "{key}" twice', name), limit
            args[key] = text_or_json(text[pos + len("<arg_value>") : value_end], params.get(key))
            pos = value_end + len("</arg_value>")
