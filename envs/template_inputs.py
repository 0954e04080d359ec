"""What goes into a chat template besides the text: tool-call arguments in the form the template
takes, and the error a template that cannot be used raises.

Kept apart from :mod:`~tokengym.envs.render` so that :mod:`~tokengym.envs.whole_render`, which
renders for it, needs nothing of the renderer itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TemplateError"]

Message = dict[str, Any]


class TemplateError(ValueError):
    """The chat template cannot be used the way a token-faithful episode needs."""


def has_object_arguments(messages: Sequence[Message]) -> bool:
    return any(
        not isinstance((c.get("function") if isinstance(c.get("function"), Mapping) else c).get("arguments", ""), str)
        for m in messages
        for c in (m.get("tool_calls") or ())
        if isinstance(c, Mapping)
    )


def string_arguments(messages: Sequence[Message]) -> list[Message]:
    """The messages with tool-call arguments as JSON text (templates such as DeepSeek V3's
    concatenate the arguments as a string and fail on an object)."""
    out: list[Message] = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        new_calls = []
        for c in calls:
            if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping):
                fn = c["function"]
                if not isinstance(fn.get("arguments", ""), str):
                    c = {**c, "function": {**fn, "arguments": json.dumps(fn.get("arguments"), ensure_ascii=False)}}
            elif isinstance(c, Mapping) and not isinstance(c.get("arguments", ""), str):
                c = {**c, "arguments": json.dumps(c.get("arguments"), ensure_ascii=False)}
            new_calls.append(c)
        out.append({**m, "tool_calls": new_calls})
    return out
