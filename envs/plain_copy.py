"""Deep copies of chat messages, several times sooner than ``copy.deepcopy``.

``ChatEnv.step`` copies the new messages, the parsed tool calls and the env's ``info`` every
turn, so that neither the caller nor the environment can change the other's history by
mutating what it was given. Those are JSON-like trees (dicts, lists, strings, numbers), and
``copy.deepcopy``'s generic machinery (a memo of every object, a dispatch per value) was a
tenth of a default step. :func:`plain_copy` walks such trees directly; any other value (a
dataclass, a NumPy array, a user's object) is copied by ``copy.deepcopy``, so the result is
always a deep copy.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

__all__ = ["plain_copy"]

T = TypeVar("T")

_ATOMS = (str, int, float, bool, type(None), bytes)


def plain_copy(value: T) -> T:
    """A deep copy of ``value`` (see the module's docstring). Shared sub-objects become separate
    copies (as JSON would make them); a tree that holds itself is copied by ``copy.deepcopy``."""
    try:
        return _copy(value, 0)
    except RecursionError:
        return copy.deepcopy(value)


def _copy(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind in _ATOMS:
        return value
    if depth > 200:  # deeper than any message: a cycle, most likely
        raise RecursionError("plain_copy: too deep")
    if kind is dict:
        return {k: _copy(v, depth + 1) for k, v in value.items()}
    if kind is list:
        return [_copy(v, depth + 1) for v in value]
    if kind is tuple:
        return tuple(_copy(v, depth + 1) for v in value)
    return copy.deepcopy(value)
