"""TokenStream: an episode's token stream, held once and compactly.

An episode in flight keeps its whole context: a driver at a thousand episodes of 32k tokens
holds tens of millions of ids. As one int64 array per piece (with a piece object, the piece's
text and the action's text each turn) a context token cost about 20 bytes and a turn about
2 kB more; here the ids are one growable int32 buffer (4 bytes a token), the pieces one table of
ints, and only the observations' text is kept (UTF-8, one buffer): an action's text is what the
tokenizer decodes its ids to, so it is decoded again when a check asks for it.

The env appends to it; the recorder and the driver read it (the recorder keeps only what the
env does not know: logprobs, rewards, finish reasons). Reads return new arrays, so no reader
holds a view that a later append could move.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from .conformance import Piece, PieceKind

__all__ = ["TokenStream"]

_KINDS: tuple[PieceKind, ...] = ("prompt", "action", "observation")
_CODE = {kind: code for code, kind in enumerate(_KINDS)}
_FIELDS = 7  # start, end, turn, kind, has_user, n_messages, text end (text start: the previous text end)
_MAX_ID = 2**31 - 1


class TokenStream:
    """The pieces of one token sequence (prompt, actions, observations), appended in order.

    Args:
        decode: the tokenizer's decode (ids -> text), for an action's text when it is asked for.
    """

    __slots__ = ("_decode", "_ids", "_table", "_text", "_last_action")

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids = array("i")
        self._table = array("i")
        self._text = bytearray()
        self._last_action: tuple[int, str] | None = None  # (piece index, text): this turn's, decoded once

    def __len__(self) -> int:
        """Tokens in the stream."""
        return len(self._ids)

    @property
    def num_pieces(self) -> int:
        return len(self._table) // _FIELDS

    def append(
        self,
        kind: PieceKind,
        turn: int,
        ids: np.ndarray | Sequence[int],
        text: str,
        *,
        has_user: bool = False,
        n_messages: int = 1,
    ) -> None:
        """Add a piece. ``text`` is what the ids were tokenized from (an action's: what they decode to;
        kept only until the next action, then decoded again when asked for)."""
        values = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        start = len(self._ids)
        try:
            if values and min(values) < 0:
                raise OverflowError
            self._ids.extend(values)  # an id past int32 raises OverflowError
        except (OverflowError, TypeError) as err:
            del self._ids[start:]
            bad = next((v for v in values if not (isinstance(v, int) and 0 <= v <= _MAX_ID)), None)
            raise ValueError(f"token ids must be ints in [0, {_MAX_ID}] to be kept as int32; got {bad!r}") from err
        if kind == "action":
            self._last_action = (self.num_pieces, text)
        else:
            self._text += text.encode("utf-8", "surrogatepass")
        self._table.extend((start, len(self._ids), turn, _CODE[kind], int(has_user), n_messages, len(self._text)))

    # ------------------------------------------------------------------ reads
    def tolist(self) -> list[int]:
        """Every id, as a list (a policy's context)."""
        return self._ids.tolist()

    def ids(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Ids ``[start:end]`` as a new int64 array."""
        return np.frombuffer(self._ids, dtype=np.int32)[start:end].astype(np.int64)

    def kind(self, k: int) -> PieceKind:
        return _KINDS[self._table[k * _FIELDS + 3]]

    def span(self, k: int) -> tuple[int, int]:
        """Piece ``k``'s token range ``(start, end)``."""
        at = k * _FIELDS
        return self._table[at], self._table[at + 1]

    def turn(self, k: int) -> int:
        return self._table[k * _FIELDS + 2]

    def piece_ids(self, k: int) -> np.ndarray:
        """Piece ``k``'s ids, a new read-only int64 array."""
        out = self.ids(*self.span(k))
        out.setflags(write=False)
        return out

    def piece_equals(self, k: int, ids: np.ndarray) -> bool:
        """Whether piece ``k`` holds exactly ``ids``."""
        start, end = self.span(k)
        return end - start == len(ids) and self._ids[start:end].tolist() == np.asarray(ids).tolist()

    def text(self, k: int) -> str:
        """Piece ``k``'s text (an action's decoded from its ids)."""
        at = k * _FIELDS
        start, end, kind, text_end = self._table[at], self._table[at + 1], self._table[at + 3], self._table[at + 6]
        if _KINDS[kind] == "action":
            if self._last_action is not None and self._last_action[0] == k:
                return self._last_action[1]
            return self._decode(self._ids[start:end].tolist())
        text_start = self._table[at - 1] if k else 0
        return self._text[text_start:text_end].decode("utf-8", "surrogatepass")

    def piece(self, k: int) -> Piece:
        """Piece ``k`` as a :class:`~tokengym.envs.conformance.Piece` (new arrays and strings)."""
        at = k * _FIELDS
        return Piece(
            self.kind(k), self._table[at + 2], self.piece_ids(k), self.text(k),
            has_user=bool(self._table[at + 4]), n_messages=self._table[at + 5],
        )

    def pieces(self, first: int = 0) -> list[Piece]:
        """Pieces ``first`` on (all by default), materialized: for a check, not for every turn. Their
        ids are read-only slices of one new int64 array."""
        n = self.num_pieces
        if first >= n:
            return []
        table, base = self._table, self._table[first * _FIELDS]
        ids = self.ids(base)
        ids.setflags(write=False)
        out = []
        for k in range(first, n):
            at = k * _FIELDS
            start, end, turn, kind, has_user, n_messages = table[at : at + 6]
            out.append(Piece(_KINDS[kind], turn, ids[start - base : end - base], self.text(k),
                             has_user=bool(has_user), n_messages=n_messages))
        return out

    def last_pieces(self, n: int) -> list[Piece]:
        """The last ``n`` pieces (a turn's own notes read only these)."""
        return self.pieces(max(0, self.num_pieces - n))

    def all_text(self) -> str:
        return "".join(self.text(k) for k in range(self.num_pieces))

    def nbytes(self) -> int:
        """Bytes its buffers hold (ids, table, text)."""
        return self._ids.buffer_info()[1] * self._ids.itemsize + len(self._table) * self._table.itemsize + len(self._text)

    def kinds(self) -> list[Literal["prompt", "action", "observation"]]:
        return [self.kind(k) for k in range(self.num_pieces)]
