"""TokenStream: an episode's token stream, held once and compactly.

An episode in flight keeps its whole context: a driver at a thousand episodes of 32k tokens
holds tens of millions of ids. As one int64 array per piece (with a piece object, the piece's
text and the action's text each turn) a context token cost about 20 bytes and a turn about
2 kB more; here the ids are one growable int32 buffer (4 bytes a token), the pieces one table of
four ints each, and a piece's text is kept (UTF-8, one buffer) only where the tokenizer does not
decode its ids back to it: an action's text is what its ids decode to, and so, almost always, is
an observation's, so it is decoded again when a check asks for it.

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
_FIELDS = 4  # end, turn, flags, text end (a piece starts where the one before ends; so does its kept text)
_MAX_ID = 2**31 - 1
# flags: kind (2 bits) | has_user << 2 | text kept << 3 | n_messages << 4 (an action's: its closing
# tokens' characters + 1, 0 where its content is not a prefix of its text; its n_messages is 1)
_HAS_USER, _KEPT, _N_SHIFT = 4, 8, 4


class TokenStream:
    """The pieces of one token sequence (prompt, actions, observations), appended in order.

    Args:
        decode: the tokenizer's decode (ids -> text), for a piece's text when it is asked for.
        decode_many: the same for a list of id lists at once (one call where many pieces'
            texts are asked for: a whole-conversation check); default: ``decode`` of each.
    """

    __slots__ = ("_decode", "_decode_many", "_ids", "_table", "_text", "_recent")

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        decode_many: Callable[[list[list[int]]], list[str]] | None = None,
    ) -> None:
        self._decode = decode
        self._decode_many = decode_many
        self._ids = array("i")
        self._table = array("i")
        self._text = bytearray()
        self._recent: tuple[str, ...] = ()  # the last two pieces' texts (a turn's own notes read them)

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
        closing_chars: int | None = None,
    ) -> None:
        """Add a piece. ``text`` is what the ids were tokenized from (an action's: what they decode
        to). It is kept only when the ids do not decode to it, and for the last two pieces (this
        turn's action and observation, which the turn's own notes read); otherwise it is decoded
        again when asked for. ``closing_chars``: an action's, how many characters at the end of its
        text its closing tokens wrote (its content is the rest; see :meth:`content`), or None
        where its content's ids do not decode to a prefix of its text."""
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
            n_messages = 0 if closing_chars is None else closing_chars + 1
        flags = _CODE[kind] | (_HAS_USER if has_user else 0) | n_messages << _N_SHIFT
        self._recent = (*self._recent[-1:], text)
        if kind != "action" and text != self._decode(values):
            self._text += text.encode("utf-8", "surrogatepass")
            flags |= _KEPT
        self._table.extend((len(self._ids), turn, flags, len(self._text)))

    # ------------------------------------------------------------------ reads
    def tolist(self) -> list[int]:
        """Every id, as a list (a policy's context)."""
        return self._ids.tolist()

    def ids(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Ids ``[start:end]`` as a new int64 array."""
        return np.frombuffer(self._ids, dtype=np.int32)[start:end].astype(np.int64)

    def kind(self, k: int) -> PieceKind:
        return _KINDS[self._table[k * _FIELDS + 2] & 3]

    def span(self, k: int) -> tuple[int, int]:
        """Piece ``k``'s token range ``(start, end)``."""
        at = k * _FIELDS
        return (self._table[at - _FIELDS] if k else 0), self._table[at]

    def turn(self, k: int) -> int:
        return self._table[k * _FIELDS + 1]

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
        """Piece ``k``'s text (decoded from its ids unless it was kept)."""
        return self.texts(k, k + 1)[0]

    def texts(self, first: int = 0, end: int | None = None) -> list[str]:
        """The texts of pieces ``first`` to ``end`` (the kept ones read, the others decoded)."""
        table, n, data = self._table, self.num_pieces, self._ids
        end = n if end is None else end
        out: list[str] = []
        todo: list[int] = []  # where in out a decoded text goes
        for k in range(first, end):
            at = k * _FIELDS
            if table[at + 2] & _KEPT:
                out.append(self._text[(table[at - 1] if k else 0) : table[at + 3]].decode("utf-8", "surrogatepass"))
            elif n - k <= len(self._recent):
                out.append(self._recent[k - n])
            else:
                todo.append(len(out))
                out.append("")
        if todo:
            spans = [data[table[(first + i) * _FIELDS - _FIELDS] if first + i else 0 : table[(first + i) * _FIELDS]].tolist()
                     for i in todo]
            texts = (self._decode_many(spans) if self._decode_many is not None and len(spans) > 1
                     else [self._decode(ids) for ids in spans])
            for i, text in zip(todo, texts, strict=True):
                out[i] = text
        return out

    def content(self, k: int, text: str | None = None) -> str | None:
        """Action piece ``k``'s content: its text (``text`` where the caller has it at hand) less
        what its closing tokens wrote; None where that was not recorded (decode the content's ids)."""
        flags = self._table[k * _FIELDS + 2]
        closing = (flags >> _N_SHIFT) - 1
        if flags & 3 != _CODE["action"] or closing < 0:
            return None
        text = self.text(k) if text is None else text
        return text[: len(text) - closing]

    def piece(self, k: int) -> Piece:
        """Piece ``k`` as a :class:`~tokengym.envs.conformance.Piece` (new arrays and strings)."""
        flags = self._table[k * _FIELDS + 2]
        return Piece(
            self.kind(k), self.turn(k), self.piece_ids(k), self.text(k),
            has_user=bool(flags & _HAS_USER), n_messages=_n_messages(flags),
        )

    def pieces(self, first: int = 0) -> list[Piece]:
        """Pieces ``first`` on (all by default), materialized: for a check, not for every turn. Their
        ids are read-only slices of one new int64 array."""
        n = self.num_pieces
        if first >= n:
            return []
        table, base = self._table, self.span(first)[0]
        ids = self.ids(base)
        ids.setflags(write=False)
        texts = self.texts(first, n)
        out = []
        start = base
        for k in range(first, n):
            end, turn, flags = table[k * _FIELDS : k * _FIELDS + 3]
            out.append(Piece(_KINDS[flags & 3], turn, ids[start - base : end - base], texts[k - first],
                             has_user=bool(flags & _HAS_USER), n_messages=_n_messages(flags)))
            start = end
        return out

    def last_pieces(self, n: int) -> list[Piece]:
        """The last ``n`` pieces (a turn's own notes read only these)."""
        return self.pieces(max(0, self.num_pieces - n))

    def all_text(self) -> str:
        return "".join(self.texts())

    def nbytes(self) -> int:
        """Bytes its buffers hold (ids, table, text)."""
        return self._ids.buffer_info()[1] * self._ids.itemsize + len(self._table) * self._table.itemsize + len(self._text)

    def kinds(self) -> list[Literal["prompt", "action", "observation"]]:
        return [self.kind(k) for k in range(self.num_pieces)]


def _n_messages(flags: int) -> int:
    return 1 if flags & 3 == _CODE["action"] else flags >> _N_SHIFT
