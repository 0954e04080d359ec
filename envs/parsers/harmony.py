"""gpt-oss's Harmony format, registered as ``"harmony"`` (``"gpt_oss"``, ``"openai"``).

An assistant turn is a run of messages after the generation prompt ``<|start|>assistant``, each
with a header and a channel::

    <|channel|>analysis<|message|>reasoning<|end|>
    <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{"arg": 1}<|call|>

or, for an answer, ``<|start|>assistant<|channel|>final<|message|>text<|return|>``. A call is a
message whose header names a recipient ``to=functions.NAME`` (before or after the channel); its
body is the JSON arguments. Its content type (``<|constrain|>json``, or the template's ``json``) is
kept with the call, so that the template renders the header as the model wrote it.

gpt-oss's chat template refuses a turn's raw text (channel tags in ``content``), so the parser also
splits a turn into the message a server hands the template (:meth:`HarmonyParser.split_message`):
the analysis as ``thinking``, the final answer as ``content``, the call as ``tool_calls``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import GUARDED, ParsedCall, Schemas, ToolCallParser, too_deep

__all__ = ["HarmonyParser", "harmony_messages"]

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")


def harmony_messages(text: str) -> list[dict[str, str]]:
    """The messages of an assistant turn's text, in order: ``{"header", "channel", "recipient",
    "content_type", "body", "end"}`` (a missing end, as at a stop, is ``""``)."""
    out: list[dict[str, str]] = []
    pos = 0
    while True:
        at = text.find(MESSAGE, pos)
        if at < 0:
            return out
        header = text[pos:at]
        if header.startswith(START):
            header = header[len(START) :]
        body_start = at + len(MESSAGE)
        stops = [(i, e) for e in ENDS if (i := text.find(e, body_start)) >= 0]
        stop, end = min(stops) if stops else (len(text), "")
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        after_channel = header[channel.end() :] if channel else ""
        content_type = _RECIPIENT.sub("", after_channel).strip()
        out.append(
            {
                "header": header,
                "channel": channel.group(1) if channel else "",
                "recipient": recipient.group(1) if recipient else "",
                "content_type": content_type,
                "body": text[body_start:stop],
                "end": end,
            }
        )
        pos = stop + len(end)
        if not end:
            return out


class HarmonyParser(ToolCallParser):
    """Calls are Harmony messages to ``functions.NAME`` with JSON bodies; the rest of a turn
    (analysis, commentary to the user, the final answer) is text."""

    name = "harmony"
    hint = (
        "Write a call as <|start|>assistant to=functions.TOOL_NAME<|channel|>commentary <|constrain|>json"
        '<|message|>{"arg": "value"}<|call|>.'
    )

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for m in harmony_messages(text):
            recipient = m["recipient"]
            if not recipient or recipient == "assistant":
                continue
            index = len(calls)
            raw = m["body"].strip()
            if not recipient.startswith("functions.") or not recipient[len("functions.") :]:
                calls.append(self._error(index, raw, f"goes to {recipient!r}; tools are called as to=functions.TOOL_NAME"))
                continue
            name = recipient[len("functions.") :]
            if m["channel"] not in ("commentary", ""):
                calls.append(self._error(index, raw, f"is on the {m['channel']!r} channel; calls go to the commentary channel", name))
                continue
            call = self._json_args(index, raw, name, m["body"])
            calls.append(call)
        return calls

    def split_message(self, text: str) -> dict[str, Any] | None:
        """The turn as the message gpt-oss's template renders: ``thinking`` (the analysis),
        ``content`` (the final answer, or ``""``), ``tool_calls`` (the first call, with the content
        type the model wrote: the template renders one call per message)."""
        messages = harmony_messages(text)
        if not messages:
            return None
        thinking = "".join(m["body"] for m in messages if m["channel"] == "analysis" and not m["recipient"])
        final = "".join(m["body"] for m in messages if m["channel"] == "final")
        message: dict[str, Any] = {"role": "assistant", "content": final}
        if thinking:
            message["thinking"] = thinking
        call = next((m for m in messages if m["recipient"].startswith("functions.")), None)
        if call is not None:
            try:
                arguments: Any = json.loads(call["body"])
            except GUARDED:  # hostile text (deep nesting, huge numbers) stays text, as the call's error says
                arguments = call["body"]
            if too_deep(arguments):
                arguments = call["body"]
            function = {"name": call["recipient"][len("functions.") :], "arguments": arguments}
            if call["content_type"]:
                function["content_type"] = call["content_type"]
            message["tool_calls"] = [{"type": "function", "function": function}]
            if not final:
                message.pop("content")
        return message
