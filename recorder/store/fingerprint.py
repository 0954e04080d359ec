"""The tokenizer fingerprint: what makes the token ids of a store and of a writer or reader mean the same tokens.

A token id means something only with the vocabulary and chat template that produced it. Every
shard, episode log and manifest records the fingerprint, and a store of another tokenizer is
refused with :class:`~tokengym.recorder.store.TokenizerMismatchError` (built by :func:`mismatch`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import TokenizerMismatchError

__all__ = ["tokenizer_fingerprint"]


def tokenizer_fingerprint(tokenizer: Any, chat_template: str | Mapping[str, str] | None = None) -> str:
    """A sha256 hex digest that changes when the meaning of a token id could change.

    It covers the vocabulary (every ``token -> id`` item, added tokens included, sorted
    by token) and the chat template text (``chat_template`` when given, else the
    tokenizer's own). Two tokenizers with the same fingerprint map ids to the same tokens
    and render conversations with the same template, so their trajectories can share a
    store. Precisely::

        sha256( b"tokengym-tokenizer-v1\\n"
              + json([[token, id], ...] sorted by token, ensure_ascii=False, separators=(",", ":"))
              + b"\\n" + template text )            # all text UTF-8; a dict of templates as sorted JSON

    ``tokenizer`` may also be a :class:`~tokengym.envs.ChatRenderer`; its template
    override (if any) then counts.
    """
    tok, template = unwrap(tokenizer, chat_template)
    if isinstance(template, Mapping):
        template = json.dumps(dict(template), sort_keys=True, ensure_ascii=False)
    key = (len(tok), template)
    try:
        cached = _FINGERPRINTS.get(tok, {}).get(key)
    except TypeError:  # an unhashable or non-weak-referenceable tokenizer: no cache
        cached = None
    if cached is not None:
        return cached
    vocab: dict[str, int] = dict(tok.get_vocab())
    for idx, added in getattr(tok, "added_tokens_decoder", {}).items():
        vocab.setdefault(str(getattr(added, "content", added)), int(idx))
    items = sorted((str(t), int(i)) for t, i in vocab.items())
    h = hashlib.sha256(b"tokengym-tokenizer-v1\n")
    h.update(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    h.update(b"\n")
    h.update((template or "").encode("utf-8"))
    digest = h.hexdigest()
    with contextlib.suppress(TypeError):
        _FINGERPRINTS.setdefault(tok, {})[key] = digest
    return digest


# Hashing a 150k-token vocabulary takes a noticeable fraction of a second; writers and
# readers of one process share the result. Keyed by the tokenizer object, its length
# (adding tokens changes it) and the template.
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, dict[tuple[int, str | None], str]] = weakref.WeakKeyDictionary()


def unwrap(tokenizer: Any, chat_template: Any) -> tuple[Any, Any]:
    """(HF tokenizer, template text) from a tokenizer or a ChatRenderer."""
    from tokengym.envs.render import ChatRenderer

    if isinstance(tokenizer, ChatRenderer):
        template = chat_template if chat_template is not None else tokenizer.chat_template
        tokenizer = tokenizer.tokenizer
    else:
        template = chat_template
    if not hasattr(tokenizer, "get_vocab"):
        raise TypeError(f"expected a Hugging Face tokenizer or a ChatRenderer, got {type(tokenizer).__name__}")
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    return tokenizer, template


def display_name(tokenizer: Any) -> str:
    """The tokenizer's name without a local path: a folder's base name, a hub name as is."""
    tok, _ = unwrap(tokenizer, None)
    name = str(getattr(tok, "name_or_path", "") or type(tok).__name__)
    if os.path.isabs(name) or (os.sep in name.rstrip(os.sep) and os.path.exists(name)):
        name = os.path.basename(os.path.normpath(name))
    return name


def tokenizer_mismatch(where: Path, have_name: str, have_hash: str, want_name: str, want_hash: str) -> TokenizerMismatchError:
    return TokenizerMismatchError(
        f"{where} holds token ids of tokenizer {have_name!r} (fingerprint {have_hash}), "
        f"not of {want_name!r} (fingerprint {want_hash}); token ids of different tokenizers "
        "or chat templates must not share a store: use another directory"
    )
