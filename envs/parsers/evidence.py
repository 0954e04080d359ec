"""Whether a turn that no parser found a call in still looks like a tool call, in any family's format.

A model that writes a call in another family's format (or names one of the episode's tools in
JSON or Python) meant to call a tool; :class:`~tokengym.envs.ToolEnv` answers such a turn with an
error instead of scoring it as an answer, and :func:`call_evidence` says why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["CALL_MARKERS", "call_evidence"]

# Text that starts a tool call in some family's format.
CALL_MARKERS: tuple[str, ...] = (
    "<tool_call>",
    "<function=",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "<|python_start|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<|tool_call|>",
    "```tool_code",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "to=functions.",
    "<|tool_call>",
    "<minimax:tool_call>",
    "<｜DSML｜invoke",
    "<atem:invoke",
)


def call_evidence(text: str, tool_names: Iterable[str] = ()) -> str | None:
    """Why ``text`` looks like a tool call, or ``None``: a call marker of any family
    (:data:`CALL_MARKERS`), a JSON object whose ``"name"`` is one of ``tool_names``, or a
    pythonic call of one (``[name(`` anywhere, or ``name(`` opening the turn)."""
    for marker in CALL_MARKERS:
        if marker in text:
            return f"it contains {marker!r}"
    names = [n for n in tool_names if n]
    if not names:
        return None
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    found = re.search(rf'"name"\s*:\s*"({alternatives})"', text)
    if found:
        return f'it has a JSON object naming the tool "{found.group(1)}"'
    found = re.search(rf"\[\s*({alternatives})\s*\(", text) or re.match(
        rf"\s*({alternatives})\s*\(\s*(?:\)|[A-Za-z_]\w*\s*=)", text
    )
    if found:
        return f'it has a Python-style call of the tool "{found.group(1)}"'
    return None
