"""A twin of a Rust tokenizer that skips its Unicode normalizer, for ASCII text.

Qwen's tokenizers put every text through NFC before splitting it, and that step (with the
per-character alignment bookkeeping the library keeps for it) is about a sixth of an encode;
yet NFC, NFD, NFKC and NFKD leave ASCII text as it is. Every observation and every action check
encodes text, most of it ASCII (tool output, JSON, code), so :func:`ascii_twin` makes a tokenizer
that shares the original's model and pre-tokenizer (nothing of the vocabulary is copied), has the
same added tokens with the same ids, and no normalizer: on ASCII text it gives the same ids as
the original. It is made only when that holds by construction (the normalizer is one of those
forms, or a sequence of them) and the added tokens came out with their ids; otherwise there is
none, and every text goes through the original.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["AsciiTwin", "ascii_twin"]

_UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _identity_on_ascii(spec: Any) -> bool:
    """Whether a normalizer (its JSON form) leaves every ASCII text unchanged."""
    if not isinstance(spec, dict):
        return False
    if spec.get("type") in _UNICODE_FORMS:
        return True
    if spec.get("type") == "Sequence":
        parts = spec.get("normalizers")
        return isinstance(parts, list) and all(_identity_on_ascii(p) for p in parts)
    return False


class AsciiTwin:
    """The original backend and its normalizer-free twin: :meth:`for_text` picks the one to use."""

    def __init__(self, original: Any, twin: Any) -> None:
        self.original = original
        self.twin = twin
        self._size = original.get_vocab_size(with_added_tokens=True)
        self._special_as_text = original.encode_special_tokens

    def for_text(self, text: str) -> Any:
        """The twin for ASCII text while the original is as it was when the twin was made; else the
        original (a token added to it afterwards would be missing from the twin, a changed
        ``encode_special_tokens`` would not be the twin's)."""
        original = self.original
        if (
            text.isascii()
            and original.get_vocab_size(with_added_tokens=True) == self._size
            and original.encode_special_tokens == self._special_as_text
        ):
            return self.twin
        return original


def ascii_twin(backend: Any) -> AsciiTwin | None:
    """An :class:`AsciiTwin` of a ``tokenizers.Tokenizer``, or None when its normalizer is absent
    (nothing to skip) or may change ASCII text, or the twin's added tokens would differ."""
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is None:
        return None
    try:
        spec = json.loads(normalizer.__getstate__())
    except Exception:  # a normalizer without a JSON form (a custom one): not ours to judge
        return None
    if not _identity_on_ascii(spec):
        return None
    try:
        from tokenizers import Tokenizer

        twin = Tokenizer(backend.model)
        twin.pre_tokenizer = backend.pre_tokenizer
        twin.post_processor = backend.post_processor
        twin.decoder = backend.decoder
        added = sorted(backend.get_added_tokens_decoder().items())
        for _, token in added:
            if token.special:
                twin.add_special_tokens([token])
            else:
                twin.add_tokens([token])
        twin.encode_special_tokens = backend.encode_special_tokens
    except Exception:  # an older tokenizers without one of these: no twin
        return None
    same = all(twin.token_to_id(token.content) == i for i, token in added) and twin.get_vocab_size(
        with_added_tokens=True
    ) == backend.get_vocab_size(with_added_tokens=True)
    return AsciiTwin(backend, twin) if same else None
