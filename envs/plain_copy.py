"""Deep copies of chat messages, several times sooner than ``copy.deepcopy``.

``ChatEnv.step`` copies the new messages, the parsed tool calls and the env's ``info`` every
turn, so that neither the caller nor the environment can change the other's history by
mutating what it was given. Those are JSON-like trees (dicts, lists, strings, numbers), and
``copy.deepcopy``'s generic machinery (a memo of every object, a dispatch per value) was a
tenth of a default step. :func:`plain_copy` walks such trees directly; any other value (a
dataclass, a NumPy array, a user's object) is copied by ``copy.deepcopy``, so the result is
always a deep copy.

:func:`plain_data` copies only such trees, of exact types, and refuses anything else: for the
chat-template inputs, where a plain tree comes out of transformers' input steps as its own copy
and any other value must go through those steps.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

__all__ = ["NotPlainData", "plain_copy", "plain_data"]

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


class NotPlainData(ValueError):
    """A value :func:`plain_data` does not copy."""


_DATA_SCALARS = frozenset({str, int, float, bool, type(None)})  # no bytes: templates get "<bytes>" for them
_DATA_DEPTH = 100


def plain_data(value: T) -> T:
    """A copy of a tree of plain data: dicts with string keys, lists, tuples, strings, numbers,
    booleans and None, each of exactly that type. A subclass (of ``str``, of ``dict``), any other
    object, a key that is not a string, or nesting past 100 levels raise :class:`NotPlainData`."""
    return _data(value, 0)


def _data(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind in _DATA_SCALARS:
        return value
    if depth >= _DATA_DEPTH:
        raise NotPlainData("nested too deep")
    if kind is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise NotPlainData(f"a {type(key).__name__} key")
            out[key] = _data(item, depth + 1)
        return out
    if kind is list:
        return [_data(item, depth + 1) for item in value]
    if kind is tuple:
        return tuple(_data(item, depth + 1) for item in value)
    raise NotPlainData(f"a {kind.__name__}")
