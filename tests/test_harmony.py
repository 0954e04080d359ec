"""gpt-oss's Harmony format, cross-checked against the ``openai-harmony`` package's own renderer.

The package renders with its ``o200k_harmony`` encoding, whose vocabulary file it downloads; here
the file is rebuilt from the pinned gpt-oss tokenizer and must have the published file's sha256,
so both sides tokenize with the same vocabulary. Checked: the prompt gpt-oss's chat template
renders is Harmony's token for token; the stop tokens are Harmony's; a turn the way Harmony writes
it (analysis, then a call to ``functions.calculate`` with ``<|constrain|>json`` ended by
``<|call|>``; an answer ended by ``<|return|>``) is parsed, run and kept as sampled; the history
drops earlier analysis and shows ``<|return|>`` as ``<|end|>``, as Harmony does. The one
difference between the two renderers is named: the chat template writes a tool result as a JSON
string (``"42"``), Harmony as it is (``42``).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import openai_harmony as oh
import pytest
from tokengym.envs import HarmonyParser, get_parser, load_tokenizer
from tokengym.envs import template_corpus as tc
from tokengym.envs.builtin import CalculatorEnv

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""sha256 of the published ``o200k_base.tiktoken`` that ``openai-harmony`` downloads."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (how tokenizer.json spells token bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def write_o200k(folder: Path) -> Path:
    """``o200k_base.tiktoken`` (base64 token bytes and rank per line) from the pinned gpt-oss tokenizer."""
    vocab = json.loads(load_tokenizer("gptoss").backend_tokenizer.to_str())["model"]["vocab"]
    decode = _byte_decoder()
    lines = [
        base64.b64encode(bytes(decode[c] for c in token)) + b" " + str(rank).encode()
        for token, rank in sorted(vocab.items(), key=lambda kv: kv[1])
    ]
    path = folder / "o200k_base.tiktoken"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony-vocab")
    path = write_o200k(folder)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256
    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    try:
        yield oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


@pytest.fixture(scope="module")
def gptoss():
    tok, added = tc.corpus_tokenizer("openai-gpt-oss-120b")
    assert added == []  # gpt-oss's own tokenizer
    return tok


def _harmony_prompt(info: dict) -> list:
    """The episode's opening in Harmony: the system message with today's date (the template's
    ``strftime_now``), the env's system prompt as developer instructions with its tools, the user turn."""
    (system,) = [m["content"] for m in info["messages"] if m["role"] == "system"]
    (user,) = [m["content"] for m in info["messages"] if m["role"] == "user"]
    tools = [
        oh.ToolDescription.new(t["function"]["name"], t["function"]["description"], parameters=t["function"]["parameters"])
        for t in info["tools"]
    ]
    return [
        oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(system).with_function_tools(tools)),
        oh.Message.from_role_and_content(oh.Role.USER, user),
    ]


def _assistant(channel: str, text: str, recipient: str | None = None):
    m = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)
    return m.with_recipient(recipient).with_content_type("<|constrain|>json") if recipient else m


def _sampled(enc, messages, end: str) -> list[int]:
    """The tokens a model writes for ``messages`` after the generation prompt ``<|start|>assistant``,
    its turn ended by ``end`` (Harmony renders a message's own end as ``<|end|>`` or ``<|call|>``)."""
    ids = [t for m in messages for t in enc.render(m)]
    head = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(head)] == head
    ids = ids[len(head) :]
    if end == "<|return|>":
        assert enc.decode(ids[-1:]) == "<|end|>"
        ids[-1:] = enc.encode("<|return|>", allowed_special="all")
    assert enc.decode(ids[-1:]) == end
    return ids


def test_the_templates_prompt_and_stop_tokens_are_harmonys(enc, gptoss):
    env = CalculatorEnv(gptoss)
    assert isinstance(env.parser, HarmonyParser) and env.parser is not get_parser("hermes")
    obs, info = env.reset(seed=0)
    harmony = enc.render_conversation_for_completion(oh.Conversation.from_messages(_harmony_prompt(info)), oh.Role.ASSISTANT)
    assert obs.tolist() == harmony
    assert set(env.stop_token_ids) == set(enc.stop_tokens_for_assistant_actions())  # <|return|>, <|call|>


@pytest.mark.parametrize("history", ["keep", "deploy"])
def test_a_harmony_tool_episode_runs_keeps_its_tokens_and_matches_harmonys_history(enc, gptoss, history):
    env = CalculatorEnv(gptoss, history=history, conformance="warn", conformance_schedule="every_turn")
    obs, info = env.reset(seed=0)
    conversation = _harmony_prompt(info)
    stream = obs.tolist()

    think, call = _assistant("analysis", "I use the tool."), _assistant("commentary", '{"expression": "6 * 7"}', "functions.calculate")
    action = _sampled(enc, [think, call], "<|call|>")
    obs, _, terminated, truncated, info = env.step(np.array(action))
    assert info["closed_by"] == "end_of_turn" and not (terminated or truncated)
    assert [(r["status"], r["content"]) for r in info["tool_results"]] == [("ok", "42")]
    conversation += [think, call]
    # Harmony's tool message, with the result as the chat template writes it (a JSON string).
    result = oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.calculate"), json.dumps("42"))
    result = result.with_channel("commentary").with_recipient("assistant")
    raw = oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.calculate"), "42")
    raw = raw.with_channel("commentary").with_recipient("assistant")
    prompt = enc.render_conversation_for_completion(oh.Conversation.from_messages([*conversation, result]), oh.Role.ASSISTANT)
    raw_prompt = enc.render_conversation_for_completion(oh.Conversation.from_messages([*conversation, raw]), oh.Role.ASSISTANT)
    assert prompt != raw_prompt  # the named difference: Harmony writes the result as it is
    stream += action
    if history == "keep":  # the analysis of a call with no answer after it stays in Harmony's history too
        stream += obs.tolist()
        assert stream == prompt
    else:
        assert stream + obs.tolist() == prompt and "context_reset" not in info
        stream += obs.tolist()
    assert info["conformance"].ok

    answer_think, answer = _assistant("analysis", "It is 42."), _assistant("final", "<answer>42</answer>")
    action = _sampled(enc, [answer_think, answer], "<|return|>")
    _, _, terminated, _, info = env.step(np.array(action))
    assert terminated and "final_reward" in info
    # Once an answer follows, the call turn's analysis leaves the history, in Harmony as in the
    # template: the stream keeps it (the model saw it) and the check names the difference.
    conversation += [result, answer_think, answer]
    training = enc.decode(enc.render_conversation_for_training(oh.Conversation.from_messages(conversation)))
    assert "I use the tool." not in training and '"6 * 7"}<|call|>' in training
    assert info["conformance"].status == "known" and info["conformance"].behaviours == ("reasoning_dropped",)


def test_harmony_turns_split_into_the_message_the_template_renders():
    parser = HarmonyParser()
    text = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary to=functions.add "
        '<|constrain|>json<|message|>{"a": 1}'
    )
    (call,) = parser.parse(text)
    assert (call.name, call.arguments) == ("add", {"a": 1})
    assert parser.split_message(text) == {
        "role": "assistant",
        "thinking": "Think.",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}, "content_type": "<|constrain|>json"}}],
    }
    assert parser.split_message("<|channel|>final<|message|>Done.") == {"role": "assistant", "content": "Done."}
    assert parser.split_message("no channels") is None
    (bad,) = parser.parse('<|start|>assistant to=browser.search<|channel|>commentary<|message|>{"q": 1}<|call|>')
    assert not bad.ok and "to=functions.TOOL_NAME" in bad.error
    (bad,) = parser.parse('<|start|>assistant to=functions.add<|channel|>final<|message|>{"a": 1}<|call|>')
    assert not bad.ok and "commentary channel" in bad.error
    (bad,) = parser.parse("<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{a: 1}<|call|>")
    assert not bad.ok and "not valid JSON" in bad.error
    assert parser.parse("<|channel|>final<|message|>No call here.<|return|>") == []
