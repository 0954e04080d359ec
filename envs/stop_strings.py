"""Does an action end with a stop string? One answer for the environment and every policy.

A policy stops generating when its output ends with a stop string (finish reason
``"stop_string"``), and the environment then decides how the turn was closed
(``closed_by="stop_string"``: the end-of-turn tokens open the next observation). If the two
decoded the tail differently, a turn a policy ended on a stop string could reach the env as
an unclosed one. So both call :func:`ends_with_stop_string`.

Only the tail is decoded (16 tokens, widened until it is longer than the longest stop
string), special tokens kept and no clean-up of spaces: the text is exactly what the
tokens spell. A tail can start inside a character (a byte-level token split) or lose a
leading space (SentencePiece decoders strip it at the start of a text); both only touch its
start, which the widening keeps away from the part that is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["TAIL_TOKENS", "check_stop_strings", "ends_with_stop_string"]

TAIL_TOKENS = 16
"""Tokens decoded at first; doubled while the text is not longer than the longest stop string."""


def check_stop_strings(stop_strings: Sequence[str]) -> tuple[str, ...]:
    """``stop_strings`` as a tuple; ValueError for an empty string, which every output ends with."""
    if isinstance(stop_strings, str):
        raise TypeError(f"stop_strings must be a sequence of strings, got the string {stop_strings!r}: pass ({stop_strings!r},)")
    out = tuple(stop_strings)
    for s in out:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__} ({s!r})")
        if not s:
            raise ValueError("an empty stop string would end every action after its first token: remove it")
    return out


def ends_with_stop_string(ids: Sequence[int] | np.ndarray, stop_strings: Sequence[str], tokenizer: Any) -> bool:
    """True when the decoded ``ids`` end with one of ``stop_strings``.

    Args:
        ids: the generated token ids (an action), in order.
        stop_strings: the strings that end an action; none: always False.
        tokenizer: a Hugging Face tokenizer (``decode`` with ``skip_special_tokens`` and
            ``clean_up_tokenization_spaces``).

    Raises:
        ValueError: an empty stop string.
    """
    stops = check_stop_strings(stop_strings)
    if not stops or len(ids) == 0:
        return False
    longest = max(map(len, stops))
    n = TAIL_TOKENS
    while True:
        window = [int(i) for i in ids[-n:]]
        tail = tokenizer.decode(window, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # A partial character at the start decodes to U+FFFD: it does not count as text.
        if n >= len(ids) or len(tail.lstrip("\ufffd")) > longest:
            return tail.endswith(stops)
        n *= 2
