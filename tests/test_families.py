"""Every family's template on its real tokenizer: call formats, tool results, generation
prompts, and the prefix-stability claim of each family checked by rendering."""

from __future__ import annotations

import re

import jinja2
import pytest
from families import (
    FAMILIES,
    REAL_FAMILIES,
    REASONING_DROPPED,
    SECOND_CALLS_UNOPENED,
    SYSTEM_MOVED,
    SYSTEM_ONLY_AT_END,
    TEMPLATE_FAMILIES,
    Conversation,
    Family,
    conversations,
    drops_none_keys,
    family,
    render,
    render_stability,
    rendered_turn,
    tokenizer_for,
)

from tokengym.envs import PINNED_TOKENIZERS

PARSER_NAMES = {"hermes", "llama3_json", "pythonic", "qwen3_coder", "deepseek_v3", "mistral", "xlam"}

# Text a broken prefix shows where the shorter render diverges, by cause.
CAUSE_MARKERS = {
    REASONING_DROPPED: ("<think>",),
    SYSTEM_MOVED: ("[AVAILABLE_TOOLS]", "You answer briefly."),
    SYSTEM_ONLY_AT_END: ("[AVAILABLE_TOOLS]", "You answer briefly."),
    SECOND_CALLS_UNOPENED: ("<｜Assistant｜>",),
}

ids = [f.name for f in FAMILIES]
CASES = [(f, c) for f in FAMILIES for c in conversations(f)]
case_ids = [f"{f.name}-{c}" for f, c in CASES]


def _unrenderable_calls(fam: Family, tok) -> bool:
    """The real DeepSeek V3 template prints calls only for ``content: None``, which this transformers drops."""
    return fam.needs_none_content and drops_none_keys(tok)


def _has_calls(conv: Conversation) -> bool:
    return any(m.get("tool_calls") for m in conv.messages)


def test_the_records():
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert len(TEMPLATE_FAMILIES) == 9
    assert {f.tokenizer for f in REAL_FAMILIES} == {"qwen3", "qwen2.5", "llama3_2", "deepseek_v3", "mistral_nemo"}
    assert {f.parser for f in FAMILIES} == PARSER_NAMES
    for f in FAMILIES:
        assert f.tokenizer in PINNED_TOKENIZERS
        assert (f.chat_template is None) == (f in REAL_FAMILIES)
        assert f.prefix_stable or f.non_prefix_stable_cause in CAUSE_MARKERS
    with pytest.raises(ValueError, match="non_prefix_stable_cause"):
        Family("x", "qwen3", None, "hermes", prefix_stable=False)
    with pytest.raises(KeyError, match="known"):
        family("llama-9")


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_conversations_are_valid_openai_messages(fam):
    convs = conversations(fam)
    assert {"single_call", "parallel_calls", "follow_up"} <= set(convs)
    assert ("reasoning" in convs) == fam.reasoning
    assert ("user_after_tool" in convs) == fam.user_after_tool
    for conv in convs.values():
        for m in conv.messages:
            for call in m.get("tool_calls") or []:
                assert call["type"] == "function" and set(call["function"]) == {"name", "arguments"}
                assert isinstance(call["function"]["arguments"], str if fam.arguments_as_text else dict)
                if fam.call_id_length:
                    assert len(call["id"]) == fam.call_id_length and call["id"].isalnum()
            assert len(m.get("tool_calls") or []) <= (2 if fam.parallel_calls else 1)
    parallel = convs["parallel_calls"].messages
    assert max(len(m.get("tool_calls") or []) for m in parallel) == (2 if fam.parallel_calls else 1)


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_control_tokens_are_single_added_tokens(fam):
    tok = tokenizer_for(fam)
    added = tok.get_added_vocab()
    for marker in fam.control_tokens:
        assert marker in added, f"{marker} is not an added token of {fam.tokenizer}"
        assert tok.encode(marker, add_special_tokens=False) == [added[marker]]


@pytest.mark.parametrize(("fam", "name"), CASES, ids=case_ids)
def test_each_conversation_renders_in_the_family_format(fam, name):
    tok = tokenizer_for(fam)
    conv = conversations(fam)[name]
    if _unrenderable_calls(fam, tok) and _has_calls(conv):
        with pytest.raises(jinja2.exceptions.UndefinedError, match="content"):
            render(fam, tok, conv.messages, conv.tools)
        return
    text = render(fam, tok, conv.messages, conv.tools)
    ids = tok.encode(text, add_special_tokens=False)
    added = tok.get_added_vocab()
    for marker in fam.control_tokens:
        if marker in text:
            assert added[marker] in ids, f"{marker} was split into text tokens"
    for m in conv.messages:
        if m["role"] == "tool":
            assert m["content"] in text
        if m["role"] in ("user", "assistant") and m.get("content") and not m.get("tool_calls"):
            assert m["content"] in text
        for call in m.get("tool_calls") or []:
            for marker in fam.call_markers:
                assert marker in text, f"{fam.name}: no {marker!r} in\n{text}"
            assert call["function"]["name"] in text
            args = call["function"]["arguments"]
            for value in (args.values() if isinstance(args, dict) else []):
                assert str(value) in text
        if m.get("tool_calls") and m.get("content"):
            assert (m["content"] in text) == fam.prints_call_content, (
                f"{fam.name}: content of an assistant with calls {'missing' if fam.prints_call_content else 'printed'}"
            )


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_rendered_turn_of_a_call_message(fam):
    """The text of one assistant turn with calls, as the family's model writes it."""
    tok = tokenizer_for(fam)
    conv = conversations(fam)["parallel_calls"]
    index = next(i for i, m in enumerate(conv.messages) if m.get("tool_calls"))
    message = conv.messages[index]
    if _unrenderable_calls(fam, tok):
        return
    # R1's prompt opens <think>, which history drops; Mistral Nemo's prompt has the system text, which the
    # render with the answer drops.
    if fam.name in ("deepseek-r1", "mistral_nemo"):
        with pytest.raises(ValueError, match="not a prefix"):
            rendered_turn(fam, tok, conv.messages, index, conv.tools)
        return
    turn = rendered_turn(fam, tok, conv.messages, index, conv.tools)
    for marker in fam.call_markers:
        assert marker in turn
    for call in message["tool_calls"]:
        assert call["function"]["name"] in turn
    if message.get("content"):
        assert (message["content"] in turn) == fam.prints_call_content
    assert "What is the weather" not in turn and "rain" not in turn
    with pytest.raises(ValueError, match="not an assistant"):
        rendered_turn(fam, tok, conv.messages, index - 1, conv.tools)


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_generation_prompts(fam):
    """After the user and after tool results: a generation prompt, or an empty one where the family says so."""
    tok = tokenizer_for(fam)
    conv = conversations(fam)["single_call"]
    roles = {2: "user", 4: "tool"}
    for cut, role in roles.items():
        assert conv.messages[cut - 1]["role"] == role
        if _unrenderable_calls(fam, tok) and cut > 2:
            continue
        without = render(fam, tok, conv.messages[:cut], conv.tools)
        with_prompt = render(fam, tok, conv.messages[:cut], conv.tools, add_generation_prompt=True)
        assert with_prompt.startswith(without)
        prompt = with_prompt[len(without) :]
        assert (prompt == "") == (role in fam.empty_generation_prompt_after), f"{fam.name} after {role}: {prompt!r}"


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_prefix_stability_claim(fam):
    tok = tokenizer_for(fam)
    convs = conversations(fam)
    if _unrenderable_calls(fam, tok):
        convs = {k: c for k, c in convs.items() if not _has_calls(c)}
    results = [render_stability(fam, tok, c) for c in convs.values()]
    if not results:
        assert fam.needs_none_content
        return
    breaks = [b for r in results for b in r.breaks]
    assert (not breaks) == fam.prefix_stable, "\n".join(str(b) for b in breaks)
    for b in breaks:
        assert any(b.shows(m) for m in CAUSE_MARKERS[fam.non_prefix_stable_cause]), f"{fam.name}: {b}"
    single = render_stability(fam, tok, convs["single_call"])
    if fam.non_prefix_stable_cause == SYSTEM_MOVED:
        assert single.prefix_stable, "the system prompt moves only when a later user message comes"
    if fam.non_prefix_stable_cause == SYSTEM_ONLY_AT_END:
        assert not single.prefix_stable, "the system prompt disappears once the assistant answers"


@pytest.mark.parametrize("fam", FAMILIES, ids=ids)
def test_grouped_tool_results_break_between_results(fam):
    """A cut between two tool results of one round is a prefix only where each result is its own block."""
    tok = tokenizer_for(fam)
    conv = conversations(fam)["parallel_calls"]
    if _unrenderable_calls(fam, tok):
        return
    between = [
        i for i in range(1, len(conv.messages)) if conv.messages[i - 1]["role"] == conv.messages[i]["role"] == "tool"
    ]
    assert bool(between) == fam.parallel_calls
    stability = render_stability(fam, tok, conv, every_message=True)
    broken = {b.cut for b in stability.breaks}
    assert all((cut in broken) == fam.groups_tool_results for cut in between), stability.breaks


@pytest.mark.parametrize("fam", [f for f in FAMILIES if not f.user_after_tool], ids=lambda f: f.name)
def test_user_right_after_tool_results_breaks_alternation(fam):
    tok = tokenizer_for(fam)
    messages = conversations(fam)["single_call"].messages[:4] + [{"role": "user", "content": "Hm?"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="alternate"):
        render(fam, tok, messages, add_generation_prompt=True)


@pytest.mark.parametrize("fam", [f for f in FAMILIES if f.call_id_length], ids=lambda f: f.name)
def test_call_ids_must_have_the_family_length(fam):
    tok = tokenizer_for(fam)
    messages = conversations(fam)["single_call"].messages[:3]
    bad = dict(messages[2], tool_calls=[dict(messages[2]["tool_calls"][0], id="call_1")])
    with pytest.raises(jinja2.exceptions.TemplateError, match="9"):
        render(fam, tok, messages[:2] + [bad])


def test_one_call_per_message_families_refuse_two():
    for fam in (f for f in FAMILIES if not f.parallel_calls):
        msgs = conversations(family("qwen2.5"))["parallel_calls"].messages
        with pytest.raises(jinja2.exceptions.TemplateError, match="(?i)one tool call|single tool-call"):
            render(fam, tokenizer_for(fam), msgs[:3])


@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
def test_reasoning_is_dropped_from_history(name):
    fam = family(name)
    tok = tokenizer_for(fam)
    msgs = conversations(fam)["reasoning"].messages
    first_thought = msgs[2]["reasoning_content"]
    # Qwen3 keeps reasoning after the last user message; R1 drops it from every turn.
    before_follow_up = render(fam, tok, msgs[:5])
    assert (first_thought in before_follow_up) == (name == "qwen3")
    assert first_thought not in render(fam, tok, msgs)
    prompt = render(fam, tok, msgs[:2], add_generation_prompt=True)
    assert prompt.endswith("<think>\n") == (name == "deepseek-r1")


# --- Facts of the tokenizers' own templates ----------------------------------------------------


def test_llama3_2_real_template():
    fam = family("llama3.2")
    tok = tokenizer_for(fam)
    msgs = conversations(fam)["single_call"].messages
    text = render(fam, tok, msgs, conversations(fam)["single_call"].tools)
    # JSON calls with "parameters", not pythonic; the tool list goes into the first user turn.
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    user_turn = text.split("<|start_header_id|>user<|end_header_id|>")[1]
    assert "Current weather in a city." in user_turn.split("<|eot_id|>")[0]
    # Today's date comes from strftime_now unless date_string is passed (the family passes one).
    assert "Today Date: 26 Jul 2024\n" in text
    undated = tok.apply_chat_template(msgs[:2], tokenize=False)
    assert re.search(r"Today Date: \d\d \w{3} \d{4}\n", undated)


def test_mistral_nemo_real_template():
    fam = family("mistral_nemo")
    tok = tokenizer_for(fam)
    conv = conversations(fam)["single_call"]
    whole = render(fam, tok, conv.messages, conv.tools)
    assert "You answer briefly." not in whole
    assert "You answer briefly.\n\nWhat is the weather" in render(fam, tok, conv.messages[:2], conv.tools)
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>' in whole
    assert '[TOOL_RESULTS]{"content": sunny, 21 C, "call_id": "call00001"}[/TOOL_RESULTS]' in whole


def test_deepseek_v3_real_template():
    fam = family("deepseek_v3")
    tok = tokenizer_for(fam)
    conv = conversations(fam)["follow_up"]
    first_call = conv.messages[2]
    # The tool list is never rendered; a calls message with text content renders without its calls.
    with_text = dict(first_call, content="")
    text = render(fam, tok, conv.messages[:2] + [with_text], conv.tools)
    assert "Current weather" not in text and "<｜tool▁calls▁begin｜>" not in text
    assert text.endswith("<｜Assistant｜><｜end▁of▁sentence｜>")
    if drops_none_keys(tok):
        with pytest.raises(jinja2.exceptions.UndefinedError):
            render(fam, tok, conv.messages[:3], conv.tools)
        return
    whole = render(fam, tok, conv.messages, conv.tools)
    # A single call is not closed with <｜tool▁calls▁end｜><｜end▁of▁sentence｜>, which the model generates.
    assert "```<｜tool▁call▁end｜><｜tool▁outputs▁begin｜>" in whole
    # The second calls message loses its opening.
    assert "<｜User｜>And in Rome?\n<｜tool▁call▁begin｜>" in whole


def test_qwen2_5_real_template_adds_a_default_system_prompt():
    fam = family("qwen2.5")
    text = render(fam, tokenizer_for(fam), [{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are Qwen")


@pytest.mark.parametrize("name", ["llama3_1", "gemma3"])
def test_tokenizers_whose_own_template_has_no_tools(name):
    """Why llama3_1 and gemma3 appear only with templates written for the tests."""
    from conftest import real_tokenizer

    template = real_tokenizer(name).chat_template
    assert template and "tool" not in template
