"""The IBM Granite 3.x call format, registered as ``"granite"``:
``<|tool_call|>[{"name": ..., "arguments": {...}}]``.
"""

from __future__ import annotations

from .base import ParsedCall, Schemas, ToolCallParser, skip_space

__all__ = ["GraniteParser"]


class GraniteParser(ToolCallParser):
    """IBM Granite 3.x calls: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``."""

    name = "granite"
    bot = "<|tool_call|>"
    hint = 'Write the calls as <|tool_call|>[{"name": "<tool>", "arguments": {...}}].'

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        at = text.find(self.bot)
        while at >= 0:
            pos = skip_space(text, at + len(self.bot))
            if text.startswith(("[", "{"), pos):
                found, end = self._json_list(len(calls), text, pos)
                calls += found
            else:
                calls.append(self._error(len(calls), text[pos : pos + 200].strip(), f"has no JSON list after {self.bot}"))
                end = pos
            at = text.find(self.bot, end)
        return calls
