"""The Llama 3.1-3.3 JSON call format, registered as ``"llama3_json"`` (``"llama3"``): a turn that
starts with ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``.
"""

from __future__ import annotations

import json

from .base import GUARDED, ParsedCall, Schemas, ToolCallParser

__all__ = ["Llama3JsonParser"]


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
            except GUARDED:
                calls.append(self._call(len(calls), s[pos:]))  # reports the JSON error
                break
            calls.append(self._call(len(calls), s[pos:end], obj, decoded=True))
            pos = end
            while pos < len(s) and (s[pos].isspace() or s[pos] == ";"):
                pos += 1
        return calls
