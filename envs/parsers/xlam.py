"""The xLAM call format, registered as ``"xlam"``: the turn is a JSON list of calls
``[{"name": ..., "arguments": {...}}]``, or holds one in a ```` ```json ```` fence.
"""

from __future__ import annotations

import re

from .base import ParsedCall, Schemas, ToolCallParser, skip_space

__all__ = ["XLAMParser"]


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
            pos = skip_space(text, fence.end())
            return self._json_list(0, text, pos)[0]
        pos = skip_space(text, 0)
        if self._start.match(text, pos):
            return self._json_list(0, text, pos)[0]
        return []
