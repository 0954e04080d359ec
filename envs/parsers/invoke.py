"""The XML ``invoke`` call formats: MiniMax M2's, registered as ``"minimax_m2"`` (``"minimax"``)::

    <minimax:tool_call>
    <invoke name="NAME"><parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

and DeepSeek V3.2's and V4's DSML, registered as ``"deepseek_v32"`` (``"deepseek_v4"``, ``"dsml"``)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

(V4 names the block ``tool_calls``), and muse-glimmer's ATEM calls, registered as ``"muse_glimmer"``
(``"atem"``): ``<atem:function_calls>`` of ``<atem:invoke name="NAME">`` blocks with ``<atem:parameter>``s,
in a message to the tool (`` to=NAME<|message|>``). The templates write a string argument as its text and
anything else as JSON; DSML says which with ``string="true|false"``. A value that is not marked
as a string becomes the tool schema's type when the schemas are passed, else its JSON when it
reads as JSON, else its text (the argument check then says what was expected).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

from .base import ParsedCall, Schemas, ToolCallParser, skip_space
from .glm import text_or_json

__all__ = ["AtemParser", "DSMLParser", "MiniMaxM2Parser"]


class _InvokeParser(ToolCallParser):
    """``<{prefix}invoke name="NAME">`` blocks of ``<{prefix}parameter name="KEY">VALUE</{prefix}parameter>``,
    read wherever they are in the turn (the block that wraps them is layout)."""

    prefix: ClassVar[str] = ""

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        p = self.prefix
        return self._tagged(text, f"<{p}invoke", f"</{p}invoke>", lambda i, body: self._one(i, body, schemas))

    def _one(self, index: int, body: str, schemas: Schemas) -> ParsedCall:
        raw = body.strip()
        p = self.prefix
        head = _attributes(body, 0)
        if head is None or "name" not in head[0]:
            return self._error(index, raw, f'has no tool name: write <{p}invoke name="TOOL_NAME">')
        name, pos = head[0]["name"].strip(), head[1]
        if not name:
            return self._error(index, raw, "has no tool name")
        schema = schemas.get(name)
        params = schema.get("properties") if isinstance(schema, Mapping) else None
        params = params if isinstance(params, Mapping) else {}
        args: dict[str, Any] = {}
        open_param, close_param = f"<{p}parameter", f"</{p}parameter>"
        while True:
            pos = skip_space(body, pos)
            if pos >= len(body):
                return ParsedCall(index, raw, name=name, arguments=args)
            if not body.startswith(open_param, pos):
                return self._error(index, raw, f"has text that is not a {open_param} name=...> block", name)
            found = _attributes(body, pos + len(open_param))
            if found is None or "name" not in found[0]:
                return self._error(index, raw, f'has a {open_param}> without name="ARG_NAME"', name)
            attributes, pos = found
            key = attributes["name"]
            end = body.find(close_param, pos)
            if end < 0:
                return self._error(index, raw, f'has parameter "{key}" without its closing {close_param}', name)
            if key in args:
                return self._error(index, raw, f'gives parameter "{key}" twice', name)
            text = body[pos:end]
            text = text[1:] if text.startswith("\n") else text
            text = text[:-1] if text.endswith("\n") else text
            args[key] = text if attributes.get("string") == "true" else text_or_json(text, params.get(key))
            pos = end + len(close_param)


_ATTRIBUTE = re.compile(r'\s+([A-Za-z_][\w-]*)="([^"]*)"')


def _attributes(text: str, pos: int) -> tuple[dict[str, str], int] | None:
    """The ``key="value"`` attributes of the tag whose attributes start at ``pos``, and where its
    ``>`` ends; ``None`` when the tag is not closed on its line or holds anything else."""
    gt = text.find(">", pos)
    newline = text.find("\n", pos)
    if gt < 0 or 0 <= newline < gt:
        return None
    tag = text[pos:gt]
    found = list(_ATTRIBUTE.finditer(tag))
    if "".join(m.group(0) for m in found) != tag.rstrip():
        return None
    return {m.group(1): m.group(2) for m in found}, gt + 1


class MiniMaxM2Parser(_InvokeParser):
    """MiniMax M2's ``<minimax:tool_call>`` block of ``<invoke>`` calls."""

    name = "minimax_m2"
    prefix = ""
    hint = (
        'Write each call as <minimax:tool_call>\n<invoke name="TOOL_NAME">\n<parameter name="ARG_NAME">value</parameter>\n'
        "</invoke>\n</minimax:tool_call>."
    )


class DSMLParser(_InvokeParser):
    """DeepSeek V3.2's and V4's DSML ``<｜DSML｜invoke>`` calls."""

    name = "deepseek_v32"
    prefix = "｜DSML｜"
    hint = (
        'Write each call as <｜DSML｜function_calls>\n<｜DSML｜invoke name="TOOL_NAME">\n'
        '<｜DSML｜parameter name="ARG_NAME" string="true">text</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '</｜DSML｜function_calls> (string="false" and JSON for numbers, booleans, lists and objects).'
    )


_ATEM_HEADER = re.compile(r"(?:<\|start\|>assistant)?[ \t]*to=([^\s<]+)[ \t]*<\|message\|>")


class AtemParser(_InvokeParser):
    """muse-glimmer's ATEM ``<atem:invoke>`` calls, read in the turn's messages to a tool only: an
    invoke in its reasoning (`` to=self``) or its answer (`` to=user``) is text, as vLLM's
    ``muse_glimmer`` parser reads it. A turn without message headers is read whole."""

    name = "muse_glimmer"
    prefix = "atem:"
    hint = (
        'Write each call as <atem:function_calls>\n<atem:invoke name="TOOL_NAME">\n'
        '<atem:parameter name="ARG_NAME">value</atem:parameter>\n</atem:invoke>\n</atem:function_calls>.'
    )

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        heads = list(_ATEM_HEADER.finditer(text))
        if heads:
            ends = [h.start() for h in heads[1:]] + [len(text)]
            text = "\n".join(text[h.end() : end] for h, end in zip(heads, ends) if h.group(1) not in ("self", "user"))
        return super()._parse(text, schemas)
