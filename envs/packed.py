"""Messages kept packed: the rarely read records an episode holds every turn, as bytes.

An env keeps its conversation (the history a conformance check renders and ``respond`` may
read) and, for every assistant turn with tool calls, the turn as a server would hand it to the
chat template (its parsed calls: the second form a check tries when the template refuses the
turn as text). Both are written every turn and read rarely: a check on a sparse schedule, a
deploy render. As dicts they cost about 1.7 kB a turn, more than everything else an episode in
flight held. Packed with :mod:`marshal` (exact for the plain data messages are: dicts, lists,
tuples, strings, numbers, None) a message costs the length of its encoding; a value marshal
cannot encode is kept as a copy of itself.
"""

from __future__ import annotations

import marshal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

from .plain_copy import plain_copy

__all__ = ["PackedList", "PackedMessages"]


class PackedMessages(Mapping[int, dict[str, Any]]):
    """A ``dict[int, message]`` that holds each message as marshal bytes; every read unpacks a new
    copy (no reader can change what is kept)."""

    __slots__ = ("_packed",)

    def __init__(self) -> None:
        self._packed: dict[int, bytes | dict[str, Any]] = {}

    def __setitem__(self, key: int, message: dict[str, Any]) -> None:
        self._packed[key] = _pack(message)

    def __getitem__(self, key: int) -> dict[str, Any]:
        return _unpack(self._packed[key])

    def __iter__(self) -> Iterator[int]:
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)

    def pop(self, key: int, default: Any = None) -> Any:
        """Remove ``key``; its message, or ``default``."""
        if key not in self._packed:
            return default
        message = self[key]
        del self._packed[key]
        return message

    def clear(self) -> None:
        self._packed.clear()


def _pack(message: Any) -> bytes | Any:
    try:
        return marshal.dumps(message)
    except ValueError:  # not plain data (a user's object): kept as a copy
        return plain_copy(message)


def _unpack(kept: bytes | Any) -> Any:
    return marshal.loads(kept) if isinstance(kept, bytes) else plain_copy(kept)


class PackedList(Sequence[dict[str, Any]]):
    """A conversation's messages, each held as marshal bytes (about a third of the dict and its
    strings); appends pack a copy, reads unpack a new one. A conformance check on a sparse
    schedule, the only reader of the whole history, pays one unpack per message."""

    __slots__ = ("_items",)

    def __init__(self, messages: Iterable[dict[str, Any]] = ()) -> None:
        self._items: list[bytes | Any] = [_pack(m) for m in messages]

    def append(self, message: dict[str, Any]) -> None:
        self._items.append(_pack(message))

    def extend(self, messages: Iterable[dict[str, Any]]) -> None:
        self._items.extend(_pack(m) for m in messages)

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [_unpack(kept) for kept in self._items[index]]
        return _unpack(self._items[index])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (_unpack(kept) for kept in self._items)

    def snapshot(self) -> Sequence[dict[str, Any]]:
        """The messages so far, as a read-only sequence that later appends do not change (what an
        env hands ``respond``: unpacked only where it is read)."""
        return _Snapshot(self._items, len(self._items))


class _Snapshot(Sequence[dict[str, Any]]):
    __slots__ = ("_items", "_n")

    def __init__(self, items: list[bytes | Any], n: int) -> None:
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [_unpack(kept) for kept in self._items[: self._n][index]]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError("message index out of range")
        return _unpack(self._items[index])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))
