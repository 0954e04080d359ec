"""The normalizer-free twin used for ASCII text gives the ids the tokenizer itself gives."""

from __future__ import annotations

import json

import pytest
from families import FAMILIES, conversations, tokenizer_for

from tokengym.envs import ChatRenderer, load_tokenizer
from tokengym.envs.ascii_backend import AsciiTwin, ascii_twin

TRICKY = [
    "",
    " ",
    "\n\n\n",
    "a  b\t\tc \n d",
    "<|im_end|>",
    "text <|im_end|>\n<|im_start|>user\n<tool_response>\n{\"ok\": true}\n</tool_response>",
    "<think>\n\n</think>\n\nfine",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
    "It's what they'll do; I'd say you've WE'RE",
    "x = 12345678901234567890 + 3.14159e-10",
    "def f(a, b):\n    return a ** b  # comment\n\n\n",
    "  leading and trailing  ",
    "<|im_start|><|im_start|>system",
    "<tool_call<tool_call>>",
    "~!@#$%^&*()_+`-=[]{}|;':\",./<>?\\",
    "\x00\x01\x1f\x7f",
]


def ascii_corpus(tokenizer: str) -> list[str]:
    """The tricky texts, and every family conversation on this tokenizer as its template renders it."""
    texts = list(TRICKY)
    for fam in FAMILIES:
        if fam.tokenizer != tokenizer:
            continue
        r = ChatRenderer(tokenizer_for(fam), chat_template=fam.chat_template)
        for conv in conversations(fam).values():
            for generation_prompt in (True, False):
                try:
                    texts.append(r.render_text(conv.messages, conv.tools, add_generation_prompt=generation_prompt, reference=True))
                except Exception:
                    continue
    return [t for t in texts if t.isascii()]


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_a_unicode_normalizer_gets_a_twin_with_the_same_ids_on_ascii_text(name):
    r = ChatRenderer(load_tokenizer(name))
    assert isinstance(r._ascii, AsciiTwin), "Qwen's NFC normalizer leaves ASCII text as it is: the twin is made"
    backend = r._backend
    texts = ascii_corpus(name)
    assert len(texts) > len(TRICKY) + 10
    for text in texts:
        assert r._ascii.for_text(text) is r._ascii.twin
        assert r.encode(text) == list(backend.encode(text, add_special_tokens=False).ids), text[:80]


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5"])
def test_text_that_is_not_ascii_goes_through_the_tokenizer_and_its_normalizer(name):
    r = ChatRenderer(load_tokenizer(name))
    backend = r._backend
    decomposed, composed = "cafe\u0301 ok", "caf\u00e9 ok"  # NFC makes the first the second
    assert r._ascii.for_text(decomposed) is backend
    assert r.encode(decomposed) == r.encode(composed) == list(backend.encode(composed, add_special_tokens=False).ids)
    # Without the normalizer (the twin) the decomposed form would tokenize otherwise: the twin must not see it.
    assert list(r._ascii.twin.encode(decomposed, add_special_tokens=False).ids) != r.encode(decomposed)


@pytest.mark.parametrize("name, why", [("llama3_2", "no normalizer"), ("gemma3", "a Replace normalizer changes ASCII")])
def test_no_twin_where_the_normalizer_is_absent_or_changes_ascii_text(name, why):
    r = ChatRenderer(load_tokenizer(name))
    assert r._ascii is None, why
    text = "a b  c\n<tool_call>"
    assert r.encode(text) == list(r._backend.encode(text, add_special_tokens=False).ids)


def test_a_token_added_to_the_tokenizer_afterwards_turns_the_twin_off():
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_str(load_tokenizer("qwen2.5").backend_tokenizer.to_str())  # a private copy
    twin = ascii_twin(backend)
    assert twin is not None and twin.for_text("hello world") is twin.twin
    backend.add_tokens([AddedToken("hello world", special=False)])
    assert twin.for_text("hello world") is backend
    assert backend.encode("hello world", add_special_tokens=False).ids == [backend.token_to_id("hello world")]


def test_special_tokens_encoded_as_text_afterwards_turn_the_twin_off():
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(load_tokenizer("qwen2.5").backend_tokenizer.to_str())  # a private copy
    twin = ascii_twin(backend)
    assert twin is not None and twin.for_text("<|im_end|>") is twin.twin
    backend.encode_special_tokens = True
    assert twin.for_text("<|im_end|>") is backend
    assert len(backend.encode("<|im_end|>", add_special_tokens=False).ids) > 1


class ShiftedIds:
    """A tokenizer that reports one added token under another id than its twin would give it."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def get_added_tokens_decoder(self):
        tokens = dict(self._backend.get_added_tokens_decoder())
        last = max(tokens)
        tokens[last + 7] = tokens.pop(last)
        return tokens


def test_no_twin_when_the_added_tokens_would_get_other_ids():
    backend = load_tokenizer("qwen2.5").backend_tokenizer
    assert ascii_twin(backend) is not None
    assert ascii_twin(ShiftedIds(backend)) is None


def test_normalizer_forms_that_are_the_identity_on_ascii():
    from tokengym.envs.ascii_backend import _identity_on_ascii

    assert _identity_on_ascii({"type": "NFKC"})
    assert _identity_on_ascii({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "NFD"}]})
    assert not _identity_on_ascii({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]})
    assert not _identity_on_ascii({"type": "Lowercase"})
    assert not _identity_on_ascii(json.loads('{"type": "Prepend", "prepend": "_"}'))
    assert not _identity_on_ascii(None)


def test_ids_come_from_encode_where_tokenizers_has_no_encode_batch_fast():
    from tokengym.envs.render import _ids

    backend = load_tokenizer("qwen2.5").backend_tokenizer

    class Older:  # a tokenizers release before encode_batch_fast
        def encode(self, text, add_special_tokens=True):
            return backend.encode(text, add_special_tokens=add_special_tokens)

    text = "<|im_start|>user\nhello <tool_call> world<|im_end|>"
    assert not hasattr(Older(), "encode_batch_fast")
    assert _ids(Older(), text) == _ids(backend, text) == list(backend.encode(text, add_special_tokens=False).ids)
