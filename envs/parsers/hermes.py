"""The Hermes / ChatML call format (Qwen2.5, Qwen3, Hermes and templates that copy them), registered as
``"hermes"`` (``"qwen"``, ``"chatml"``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json

from .base import GUARDED, ParsedCall, Schemas, ToolCallParser, skip_space

__all__ = ["HermesParser"]


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
            first = skip_space(text, body)
            if text.startswith("{", first):
                try:
                    obj, end = decoder.raw_decode(text, first)
                except GUARDED:
                    obj, end = None, -1
                if end >= 0:
                    after = skip_space(text, end)
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
