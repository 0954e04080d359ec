"""Messages kept packed: the rarely read records an episode holds every turn, as bytes.

An env keeps its conversation (the history a conformance check renders and ``respond`` may
read) and, for every assistant turn with tool calls, the turn as a server would hand it to the
chat template (its parsed calls: the second form a check tries when the template refuses the
turn as text). Both are written every turn and read rarely: a check on a sparse schedule, a
deploy render. As dicts they cost about 1.7 kB a turn, more than everything else an episode in
flight held; as one bytes object per message, about 150 bytes each.

Here a list's messages are one buffer: each is its :mod:`marshal` encoding (exact for the plain
data messages are: dicts, lists, tuples, strings, numbers, None) with a dict's keys replaced by
the number of their tuple in a table the process shares (``role``/``content``/``tool_calls`` are
written once per process, not once per message). An assistant message whose text the env's token
stream already holds is a reference to its piece (five bytes), decoded again when read. A value
marshal cannot encode is kept as a copy of itself.
"""

from __future__ import annotations

import marshal
import struct
import threading
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

from .plain_copy import plain_copy

__all__ = ["PackedList", "PackedMessages"]

Resolve = Callable[[Sequence[int]], list[dict[str, Any]]]
"""Piece numbers -> the messages they are (what references in a :class:`PackedList` read as; a
read of many messages resolves its references in one call)."""

_MAX_KEY_SETS = 4096
"""Key tuples the process table holds; dicts with other keys are written with them."""
_KEY_SETS: dict[tuple[str, ...], int] = {}
_KEYS: list[tuple[str, ...]] = []
_KEYS_LOCK = threading.Lock()
_TUPLE = -1  # a tuple is written as (-1, *items); a dict with a table's keys as (number, *values)
_REF = b"\x00"  # no marshal encoding starts with a zero byte
_ODD = b""  # an entry kept as an object beside the buffer


def _key_set(keys: tuple[Any, ...]) -> int | None:
    found = _KEY_SETS.get(keys)  # type: ignore[arg-type]
    if found is not None or len(_KEYS) >= _MAX_KEY_SETS or not all(type(k) is str for k in keys):
        return found
    with _KEYS_LOCK:
        found = _KEY_SETS.get(keys)
        if found is None and len(_KEYS) < _MAX_KEY_SETS:
            found = _KEY_SETS[keys] = len(_KEYS)
            _KEYS.append(keys)
        return found


_NESTED = frozenset((dict, list, tuple))  # what _encode/_decode walk into; anything else is kept as it is


def _encode(value: Any) -> Any:
    kind = type(value)
    if kind is dict:
        keys = tuple(value)
        number = _KEY_SETS.get(keys)  # type: ignore[arg-type]
        if number is None:
            number = _key_set(keys)
        values = [v if type(v) not in _NESTED else _encode(v) for v in value.values()]
        if number is None:
            return dict(zip(keys, values))
        return (number, *values)
    if kind is list:
        return [v if type(v) not in _NESTED else _encode(v) for v in value]
    if kind is tuple:
        return (_TUPLE, *[v if type(v) not in _NESTED else _encode(v) for v in value])
    return value


def _decode(value: Any) -> Any:
    kind = type(value)
    if kind is tuple:
        head = value[0]
        values = [v if type(v) not in _NESTED else _decode(v) for v in value[1:]]
        return tuple(values) if head == _TUPLE else dict(zip(_KEYS[head], values))
    if kind is list:
        return [v if type(v) not in _NESTED else _decode(v) for v in value]
    if kind is dict:
        return {k: v if type(v) not in _NESTED else _decode(v) for k, v in value.items()}
    return value


class _Buffer:
    """Entries appended to one bytearray, found by their ends."""

    __slots__ = ("_data", "_ends", "_odd")

    def __init__(self) -> None:
        self._data = bytearray()
        self._ends = array("I")
        self._odd: dict[int, Any] | None = None  # entry -> a copy of what marshal could not encode

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, message: Any) -> None:
        try:
            self._data += marshal.dumps(_encode(message))
        except ValueError:  # not plain data (a user's object): kept as a copy
            if self._odd is None:
                self._odd = {}
            self._odd[len(self._ends)] = plain_copy(message)
        self._ends.append(len(self._data))

    def add_ref(self, piece: int) -> None:
        self._data += _REF + struct.pack("<I", piece)
        self._ends.append(len(self._data))

    def raw(self, i: int) -> bytes:
        return bytes(self._data[self._ends[i - 1] if i else 0 : self._ends[i]])

    def get(self, i: int, resolve: Resolve | None) -> Any:
        return self.get_many([i], resolve)[0]

    def get_many(self, indices: Iterable[int], resolve: Resolve | None) -> list[Any]:
        out: list[Any] = []
        refs: list[tuple[int, int]] = []  # (position in out, piece)
        for i in indices:
            raw = self.raw(i)
            if raw == _ODD:
                assert self._odd is not None
                out.append(plain_copy(self._odd[i]))
            elif raw[:1] == _REF:
                refs.append((len(out), struct.unpack("<I", raw[1:])[0]))
                out.append(None)
            else:
                out.append(_decode(marshal.loads(raw)))
        if refs:
            assert resolve is not None, "a reference needs the stream it points into"
            for (at, _), message in zip(refs, resolve([piece for _, piece in refs]), strict=True):
                out[at] = message
        return out

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` entries."""
        del self._data[self._ends[n - 1] if n else 0 :]
        del self._ends[n:]
        if self._odd:
            self._odd = {i: v for i, v in self._odd.items() if i < n} or None


class PackedList(Sequence[dict[str, Any]]):
    """A conversation's messages in one buffer; appends pack a copy, reads unpack a new one. A
    conformance check on a sparse schedule, the only reader of the whole history, pays one unpack
    per message.

    Args:
        messages: the first messages.
        resolve: what a reference (:meth:`append_ref`) reads as: a piece number -> its message.
    """

    __slots__ = ("_buffer", "_resolve")

    def __init__(self, messages: Iterable[dict[str, Any]] = (), resolve: Resolve | None = None) -> None:
        self._buffer = _Buffer()
        self._resolve = resolve
        self.extend(messages)

    def append(self, message: dict[str, Any]) -> None:
        self._buffer.add(message)

    @property
    def holds_refs(self) -> bool:
        """Whether it was made with ``resolve=`` (so :meth:`append_ref` works)."""
        return self._resolve is not None

    def append_ref(self, piece: int) -> None:
        """Append the message ``resolve(piece)`` gives (kept as the number: the stream holds the text)."""
        if self._resolve is None:
            raise ValueError("this PackedList was made without resolve=: it cannot hold references")
        self._buffer.add_ref(piece)

    def extend(self, messages: Iterable[dict[str, Any]]) -> None:
        for m in messages:
            self._buffer.add(m)

    def __len__(self) -> int:
        return len(self._buffer)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._buffer.get_many(range(len(self))[index], self._resolve)
        return self._buffer.get(range(len(self))[index], self._resolve)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # one unpack of the whole list, its references resolved together (a check reads them all)
        return iter(self._buffer.get_many(range(len(self)), self._resolve))

    def snapshot(self) -> Sequence[dict[str, Any]]:
        """The messages so far, as a read-only sequence that later appends do not change (what an
        env hands ``respond``: unpacked only where it is read)."""
        return _Snapshot(self, len(self))

    def __reduce__(self) -> tuple[Any, ...]:
        # Key numbers and references mean something only in this process, beside this stream.
        return (PackedList, (list(self),))


class _Snapshot(Sequence[dict[str, Any]]):
    __slots__ = ("_of", "_n")

    def __init__(self, of: PackedList, n: int) -> None:
        self._of, self._n = of, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._of[: self._n][index]
        return self._of[range(self._n)[index]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._of[: self._n])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))


class PackedMessages(Mapping[int, dict[str, Any]]):
    """A ``dict[int, message]`` (keys appended in increasing order, as an env's message numbers are)
    in one buffer; every read unpacks a new copy, so no reader can change what is kept."""

    __slots__ = ("_keys", "_buffer")

    def __init__(self) -> None:
        self._keys = array("i")
        self._buffer = _Buffer()

    def _at(self, key: int) -> int | None:
        keys = self._keys
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] < key:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < len(keys) and keys[lo] == key else None

    def __setitem__(self, key: int, message: dict[str, Any]) -> None:
        if self._keys and key <= self._keys[-1]:
            kept = {k: self[k] for k in self._keys if k != key}
            kept[key] = message
            self._keys, self._buffer = array("i"), _Buffer()
            for k in sorted(kept):
                self._keys.append(k)
                self._buffer.add(kept[k])
            return
        self._keys.append(key)
        self._buffer.add(message)

    def __getitem__(self, key: int) -> dict[str, Any]:
        at = self._at(key)
        if at is None:
            raise KeyError(key)
        return self._buffer.get(at, None)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self._at(key) is not None

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys.tolist())

    def __len__(self) -> int:
        return len(self._keys)

    def pop(self, key: int, default: Any = None) -> Any:
        """Remove ``key``; its message, or ``default``."""
        at = self._at(key)
        if at is None:
            return default
        message = self._buffer.get(at, None)
        rest = [(k, self._buffer.get(i, None)) for i, k in enumerate(self._keys) if i > at]
        del self._keys[at:]
        self._buffer.truncate(at)
        for k, m in rest:
            self._keys.append(k)
            self._buffer.add(m)
        return message

    def clear(self) -> None:
        self._keys, self._buffer = array("i"), _Buffer()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_messages_of, (dict(self.items()),))


def _messages_of(items: dict[int, dict[str, Any]]) -> PackedMessages:
    out = PackedMessages()
    for k in sorted(items):
        out[k] = items[k]
    return out
