"""The Mistral call format, registered as ``"mistral"``: ``[TOOL_CALLS]`` and a JSON list of calls,
or ``[TOOL_CALLS]NAME[ARGS]{json}`` per call; call ids are 9 letters or digits, which Mistral's
templates insist on.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import GUARDED, ParsedCall, Schemas, ToolCallParser, error_reason, skip_space

__all__ = ["MistralParser"]

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
    results_need_ids = True
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
        pos = skip_space(text, at + len(self.bot))
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
        except GUARDED as err:
            return self._error(index, raw, f"has arguments that are not valid JSON ({error_reason(err)})", name or None)
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
