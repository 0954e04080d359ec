"""Tool-call parsers: the real Qwen formats, Llama 3.x JSON, every malformed call, detection."""

from __future__ import annotations

import pytest

from tokengym.envs import (
    PARSERS,
    ChatRenderer,
    HermesParser,
    Llama3JsonParser,
    ToolCallParser,
    detect_parser,
    get_parser,
    register_parser,
)

from llama_style import LLAMA_STYLE_TEMPLATE

HERMES_HINT = 'Write each call as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.'
LLAMA_HINT = 'Write each call as {"name": "<tool>", "parameters": {...}}.'


def test_real_qwen_tool_call_text_parses(tokenizer):
    renderer = ChatRenderer(tokenizer)
    calls = [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": [2, 3]}}},
        {"type": "function", "function": {"name": "neg", "arguments": {}}},
    ]
    ids = renderer.assistant({"role": "assistant", "content": "Let me add.", "tool_calls": calls}).ids
    text = renderer.decode(ids[: -len(renderer.turn_end_ids)])
    parser = get_parser(renderer=renderer)
    assert isinstance(parser, HermesParser)
    parsed = parser.parse(text)
    assert [(p.name, p.arguments, p.ok) for p in parsed] == [("add", {"a": 1, "b": [2, 3]}, True), ("neg", {}, True)]
    assert parsed[1].to_call("c1").id == "c1"


def test_hermes_variants():
    p = HermesParser()
    assert p.parse("no calls here") == []
    assert p.parse("stray </tool_call> only") == []
    (call,) = p.parse('x <tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call> y')
    assert call.arguments == {"a": 1}  # double-encoded arguments are accepted
    (call,) = p.parse('<tool_call>{"name": " f ", "parameters": {"a": 2}}</tool_call>')
    assert call.name == "f" and call.arguments == {"a": 2}
    (call,) = p.parse('<tool_call>{"name": "f"}</tool_call>')
    assert call.ok and call.arguments == {}


@pytest.mark.parametrize(
    "text, error",
    [
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',
            f"Error: tool call 1 is not valid JSON (Expecting ',' delimiter at line 1 column 36). {HERMES_HINT}",
        ),
        ("<tool_call></tool_call>", f"Error: tool call 1 is not valid JSON (Expecting value at line 1 column 1). {HERMES_HINT}"),
        ('<tool_call>["f", {}]</tool_call>', f"Error: tool call 1 must be a JSON object, got array. {HERMES_HINT}"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', f'Error: tool call 1 has no "name" string. {HERMES_HINT}'),
        ('<tool_call>{"name": 3}</tool_call>', f'Error: tool call 1 has no "name" string. {HERMES_HINT}'),
        (
            '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
            f'Error: tool call 1 ("f"): "arguments" must be a JSON object, got array. {HERMES_HINT}',
        ),
        (
            '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>',
            f'Error: tool call 1 ("f"): "arguments" must be a JSON object, got string. {HERMES_HINT}',
        ),
        (
            '<tool_call>{"name": "f", "arguments": {}}',
            f"Error: tool call 1 is not closed: <tool_call> without </tool_call>. {HERMES_HINT}",
        ),
    ],
)
def test_hermes_malformed_calls_have_precise_errors(text, error):
    (call,) = HermesParser().parse(text)
    assert not call.ok and call.error == error
    with pytest.raises(ValueError, match="malformed"):
        call.to_call()


def test_hermes_unterminated_call_before_another_call():
    parsed = HermesParser().parse(
        '<tool_call>{"name": "f", "arguments": {}}\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert [p.ok for p in parsed] == [False, True] and parsed[1].name == "g"
    assert parsed[0].error.startswith("Error: tool call 1 is not closed")
    assert [p.index for p in parsed] == [0, 1]


def test_llama3_json():
    p = Llama3JsonParser()
    assert p.parse("The answer is 4.") == []
    (call,) = p.parse('{"name": "f", "parameters": {"a": 1}}')
    assert call.name == "f" and call.arguments == {"a": 1}
    (call,) = p.parse('<|python_tag|>{"name": "f", "arguments": {"a": 2}}')
    assert call.arguments == {"a": 2}
    calls = p.parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": "y"}} trailing words')
    assert [c.name for c in calls] == ["f", "g"]


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"name": "f", "parameters": {"a": 1}', f"Error: tool call 1 is not valid JSON (Expecting ',' delimiter at line 1 column 37). {LLAMA_HINT}"),
        ('{"parameters": {}}', f'Error: tool call 1 has no "name" string. {LLAMA_HINT}'),
        ('{"name": "f", "parameters": 5}', f'Error: tool call 1 ("f"): "parameters" must be a JSON object, got number. {LLAMA_HINT}'),
    ],
)
def test_llama3_malformed(text, error):
    (call,) = Llama3JsonParser().parse(text)
    assert call.error == error


def test_detection_and_registry(qwen3, qwen25):
    assert detect_parser(qwen3.chat_template) == "hermes"
    assert detect_parser(qwen25.chat_template) == "hermes"
    assert detect_parser(LLAMA_STYLE_TEMPLATE) == "llama3_json"
    assert detect_parser(None) == "hermes"
    assert isinstance(get_parser(renderer=ChatRenderer(qwen25, chat_template=LLAMA_STYLE_TEMPLATE)), Llama3JsonParser)
    assert isinstance(get_parser("llama3_json"), Llama3JsonParser)
    mine = HermesParser()
    assert get_parser(mine) is mine
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'"):
        get_parser("xml")
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes", HermesParser)

    class Shouty(ToolCallParser):
        name = "shouty"

        def parse(self, text):
            return HermesParser().parse(text.lower())

    register_parser("shouty", Shouty)
    try:
        assert get_parser("shouty").parse('<TOOL_CALL>{"NAME": "f"}</TOOL_CALL>')[0].name == "f"
    finally:
        del PARSERS["shouty"]
