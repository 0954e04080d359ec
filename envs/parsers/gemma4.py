"""Gemma 4's call format, registered as ``"gemma4"``::

    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,flags:[true,false],opts:{k:<|"|>v<|"|>}}<tool_call|>

Arguments are written in Gemma's own notation, not JSON: strings between ``<|"|>`` marks, keys
bare (or between the marks), numbers, ``true``/``false`` and lists and objects as in JSON. The
model then writes ``<|tool_response>`` and stops; the results follow in the same turn.
"""

from __future__ import annotations

import json
from typing import Any

from .base import MAX_ARGUMENT_DEPTH, ParsedCall, Schemas, ToolCallParser

__all__ = ["Gemma4Parser", "read_gemma_value"]

QUOTE = '<|"|>'


class _Bad(ValueError):
    pass


def read_gemma_value(text: str, pos: int = 0, depth: int = 0) -> tuple[Any, int]:
    """The value written at ``text[pos]`` in Gemma's notation, and where it ends."""
    if depth > MAX_ARGUMENT_DEPTH:
        raise _Bad(f"is nested more than {MAX_ARGUMENT_DEPTH} levels deep")
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end < 0:
            raise _Bad(f"has a string without its closing {QUOTE}")
        return text[pos + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", pos):
        return _read_object(text, pos, depth)
    if text.startswith("[", pos):
        items: list[Any] = []
        pos += 1
        if text.startswith("]", pos):
            return items, pos + 1
        while True:
            value, pos = read_gemma_value(text, pos, depth + 1)
            items.append(value)
            if text.startswith(",", pos):
                pos += 1
            elif text.startswith("]", pos):
                return items, pos + 1
            else:
                raise _Bad("has a list without its closing ]")
    end = pos
    while end < len(text) and text[end] not in ",}]" and not text.startswith(QUOTE, end):
        end += 1
    word = text[pos:end].strip()
    if not word:
        raise _Bad(f"has a missing value at character {pos}")
    if word in ("true", "false"):
        return word == "true", end
    if word in ("null", "None"):
        return None, end
    try:
        number = json.loads(word)
    except ValueError:
        return word, end  # a bare word: text
    return (number if isinstance(number, (int, float)) else word), end


def _read_object(text: str, pos: int, depth: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    pos += 1
    if text.startswith("}", pos):
        return out, pos + 1
    while True:
        if text.startswith(QUOTE, pos):
            key, pos = read_gemma_value(text, pos, depth + 1)
        else:
            colon = text.find(":", pos)
            if colon < 0:
                raise _Bad("has a key without its value")
            key, pos = text[pos:colon].strip(), colon
        if not text.startswith(":", pos) or not key:
            raise _Bad("has a key without its value")
        value, pos = read_gemma_value(text, pos + 1, depth + 1)
        if key in out:
            raise _Bad(f'gives "{key}" twice')
        out[str(key)] = value
        if text.startswith(",", pos):
            pos += 1
        elif text.startswith("}", pos):
            return out, pos + 1
        else:
            raise _Bad("has an object without its closing }")


class Gemma4Parser(ToolCallParser):
    """Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` calls, any number per turn."""

    name = "gemma4"
    open_tag = "<|tool_call>"
    close_tag = "<tool_call|>"
    hint = 'Write each call as <|tool_call>call:TOOL_NAME{arg:<|"|>text<|"|>,n:1}<tool_call|>.'

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        return self._tagged(text, self.open_tag, self.close_tag, self._one)

    def _one(self, index: int, body: str) -> ParsedCall:
        raw = body.strip()
        if not raw.startswith("call:"):
            return self._error(index, raw, "must start with call:TOOL_NAME")
        brace = raw.find("{")
        name = raw[len("call:") : brace if brace >= 0 else len(raw)].strip()
        if not name:
            return self._error(index, raw, "has no tool name after call:")
        if brace < 0:
            return self._error(index, raw, "has no {...} arguments after the tool name", name)
        try:
            args, end = _read_object(raw, brace, 0)
        except _Bad as err:
            return self._error(index, raw, f"has arguments that cannot be read: it {err}", name)
        except RecursionError:
            return self._error(index, raw, f"has arguments nested more than {MAX_ARGUMENT_DEPTH} levels deep", name)
        if raw[end:].strip():
            return self._error(index, raw, "has text after its arguments", name)
        return self._with_arguments(index, raw, name, args)
