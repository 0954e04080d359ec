"""The Kimi K2 call format, registered as ``"kimi_k2"`` (``"kimi"``)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{"arg": 1}<|tool_call_end|><|tool_calls_section_end|>

The call id is the model's own (``functions.NAME:IDX``): Kimi's template prints it again over the
result (``## Return of functions.NAME:0``), so the env answers under the id the model wrote.
"""

from __future__ import annotations

import re
from dataclasses import replace

from .base import ParsedCall, Schemas, ToolCallParser

__all__ = ["KimiK2Parser"]

_ID = re.compile(r"\s*(?:functions\.)?(?P<name>[^\s:<]+)(?::(?P<index>\d+))?\s*")


class KimiK2Parser(ToolCallParser):
    """Kimi K2's ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``
    calls, inside one ``<|tool_calls_section_begin|>`` section (its end tokens may be missing at a stop)."""

    name = "kimi_k2"
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    argument_begin = "<|tool_call_argument_begin|>"
    call_end = "<|tool_call_end|>"
    hint = (
        "Write the calls as <|tool_calls_section_begin|><|tool_call_begin|>functions.TOOL_NAME:0"
        '<|tool_call_argument_begin|>{"arg": "value"}<|tool_call_end|><|tool_calls_section_end|>.'
    )

    def make_call_id(self, turn: int, index: int) -> str:
        return f"functions.call:{index}"

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        return self._sectioned(text, (self.section_begin, self.section_end, self.call_begin, self.call_end), self._one)

    def _one(self, index: int, body: str) -> ParsedCall:
        raw = body.strip()
        head, sep, args = body.partition(self.argument_begin)
        if not sep:
            return self._error(index, raw, f"has no {self.argument_begin} between the call id and the arguments")
        found = _ID.fullmatch(head)
        if found is None:
            return self._error(index, raw, "has no tool name: its id must be functions.TOOL_NAME:INDEX")
        call = self._json_args(index, raw, found.group("name"), args)
        return replace(call, id=head.strip()) if call.ok else call
