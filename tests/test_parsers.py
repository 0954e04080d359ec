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


# ------------------------------------------------------------ every family
import copy  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402

from tokengym.envs import (  # noqa: E402
    DeepSeekParser,
    DSMLParser,
    MiniMaxM2Parser,
    AtemParser,
    Gemma4Parser,
    GLMParser,
    GraniteParser,
    HarmonyParser,
    KimiK2Parser,
    MistralParser,
    PythonicParser,
    Qwen3CoderParser,
    XLAMParser,
    call_evidence,
    detect_parser_evidence,
    parse_calls,
)
from tokengym.envs.parsers import MAX_ARGUMENT_DEPTH  # noqa: E402

from call_formats import FORMATS, PATHOLOGICAL, VARIANTS, kimi_k2, mistral_id, with_argument  # noqa: E402

TWO = [("add", {"a": 1, "b": 2}), ("lookup", {"query": "tea </tool_call> time", "tags": ["x", "y"], "deep": {"k": None}})]
ONE = TWO[:1]
WRITERS = {**{f: (f, w) for f, w in FORMATS.items()}, **VARIANTS}
SCHEMAS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "tags": {"type": "array"}, "deep": {"type": "object"}}}}},
]


def test_every_family_is_registered_under_its_names():
    expected = {
        "hermes": HermesParser, "qwen": HermesParser, "chatml": HermesParser,
        "llama3_json": Llama3JsonParser, "llama3": Llama3JsonParser,
        "pythonic": PythonicParser, "llama3_pythonic": PythonicParser, "gemma": PythonicParser,
        "qwen3_coder": Qwen3CoderParser,
        "deepseek_v3": DeepSeekParser, "deepseek": DeepSeekParser, "deepseek_r1": DeepSeekParser,
        "mistral": MistralParser, "xlam": XLAMParser, "granite": GraniteParser,
        "kimi_k2": KimiK2Parser, "kimi": KimiK2Parser,
        "glm45": GLMParser, "glm47": GLMParser, "glm": GLMParser, "glm4_moe": GLMParser,
        "harmony": HarmonyParser, "gpt_oss": HarmonyParser, "openai": HarmonyParser, "gemma4": Gemma4Parser,
        "minimax_m2": MiniMaxM2Parser, "minimax": MiniMaxM2Parser, "muse_glimmer": AtemParser, "atem": AtemParser,
        "deepseek_v32": DSMLParser, "deepseek_v4": DSMLParser, "dsml": DSMLParser,
    }
    for name, cls in expected.items():
        parser = get_parser(name)
        assert type(parser) is cls and parser.hint.startswith("Write")
    assert {get_parser(f).name for f in FORMATS} == set(FORMATS)


@pytest.mark.parametrize("form", list(WRITERS))
@pytest.mark.parametrize("calls", [ONE, TWO], ids=["single", "parallel"])
def test_each_format_parses_single_and_parallel_calls(form, calls):
    family, write = WRITERS[form]
    parsed = get_parser(family).parse(write(calls), tools=SCHEMAS)
    assert [(p.name, p.arguments, p.error) for p in parsed] == [(n, a, None) for n, a in calls]
    assert [p.index for p in parsed] == list(range(len(calls)))


# Text around the calls that each format allows (some formats must open the turn).
AROUND = {
    "hermes": ("Let me add.\n", "\nDone."),
    "llama3_json": ("<|python_tag|>", "  and some words after"),
    "pythonic": ("I will call the tools.\n", "\nThat is all."),
    "qwen3_coder": ("Reasoning first.\n", "\n"),
    "deepseek_v3": ("I need the tools.", ""),
    "mistral": ("Calling now. ", ""),
    "xlam": ("", "\nTrailing words."),
    "granite": ("Thinking. ", ""),
    "kimi_k2": ("Let me compute. ", ""),
    "glm45": ("<think>I add.</think>\n", "\n"),
    "gemma4": ("I will add.", "<|tool_response>"),
    "harmony": ("<|channel|>analysis<|message|>I add.<|end|>", ""),
    "minimax_m2": ("<think>\nI add.\n</think>\n\nAdding.", ""),
    "muse_glimmer": ("<|start|>assistant to=self<|message|>I add.<|eom|><|start|>assistant", ""),
    "deepseek_v32": ("</think>I add.", ""),
}


@pytest.mark.parametrize("family", list(FORMATS))
def test_each_format_allows_its_text_before_and_after(family):
    text = AROUND[family][0] + FORMATS[family](TWO) + AROUND[family][1]
    parsed = get_parser(family).parse(text, tools=SCHEMAS)
    assert [(p.name, p.arguments) for p in parsed] == TWO and all(p.ok for p in parsed)


def test_atem_calls_are_read_in_messages_to_a_tool_only():
    """muse-glimmer's invoke blocks count in a message to a tool, not in its reasoning (to=self)
    or its answer (to=user), as vLLM's muse_glimmer parser reads them."""
    call = '<atem:function_calls>\n<atem:invoke name="add">\n<atem:parameter name="a">1</atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
    parser = get_parser("muse_glimmer")
    assert parser.parse(f" to=self<|message|>I could write {call}<|eom|>") == []
    assert parser.parse(f" to=user<|message|>Like this: {call}<|eot|>") == []
    ((name, args),) = [(p.name, p.arguments) for p in parser.parse(f" to=self<|message|>{call}<|eom|><|start|>assistant to=add<|message|>{call}<|eom|>")]
    assert (name, args) == ("add", {"a": 1})
    assert [p.name for p in parser.parse(call)] == ["add"]  # no headers: the turn is read whole


def test_wrapped_forms_and_fences():
    pythonic = PythonicParser()
    llama4 = "<|python_start|>[add(a=1, b=2), lookup(query='q')]<|python_end|>"
    assert [(p.name, p.arguments) for p in pythonic.parse(llama4)] == [("add", {"a": 1, "b": 2}), ("lookup", {"query": "q"})]
    gemma = 'Sure.\n```tool_code\nadd(a=1, b=-2.5)\nlookup(query="q", deep={"k": [true, null]})\n```\nok'
    assert [(p.name, p.arguments) for p in pythonic.parse(gemma)] == [
        ("add", {"a": 1, "b": -2.5}), ("lookup", {"query": "q", "deep": {"k": [True, None]}})
    ]
    xlam = 'Here:\n```json\n[{"name": "add", "arguments": {"a": 1, "b": 2}}]\n```\nthen I wait.'
    assert [(p.name, p.arguments) for p in XLAMParser().parse(xlam)] == ONE
    for text in ("[1, 2, 3] are the numbers.", "See [the docs](https://x.y).", "[]", "plain answer"):
        assert XLAMParser().parse(text) == [] and pythonic.parse(text) == []


def test_hermes_close_tag_inside_a_string_argument_does_not_split_the_call():
    code = 'print("<tool_call>{\\"name\\": \\"x\\"}</tool_call>")\nassert s.endswith("</tool_call>")'
    text = "<tool_call>\n" + json.dumps({"name": "run", "arguments": {"code": code}}) + "\n</tool_call>"
    (call,) = HermesParser().parse(text + "\n" + text)[:1]
    assert call.ok and call.arguments == {"code": code}
    assert [c.arguments for c in HermesParser().parse(text + "\n" + text)] == [{"code": code}] * 2
    # With the tag in the string and text after the object, the error still reads like before.
    (bad,) = HermesParser().parse('<tool_call>{"name": "f"} extra</tool_call>')
    assert bad.error.startswith("Error: tool call 1 is not valid JSON (Extra data")


def test_qwen3_coder_values_follow_the_schema():
    text = (
        "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
        "<parameter=flag>\nTrue\n</parameter>\n<parameter=obj>\n{\"a\": [1]}\n</parameter>\n"
        "<parameter=items>\n[1, 2]\n</parameter>\n<parameter=maybe>\nNone\n</parameter>\n"
        "<parameter=code>\n\nif a </parameter> b:\n    pass\n\n</parameter>\n<parameter=word>\n42\n</parameter>\n"
        "<parameter=bad>\nfive\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    schema = {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"}, "obj": {"type": "object"},
        "items": {"type": "array"}, "maybe": {"type": ["integer", "null"]}, "code": {"type": "string"},
        "word": {"type": "string"}, "bad": {"type": "integer"}}}}
    (call,) = Qwen3CoderParser().parse(text, tools=[schema])
    assert call.arguments == {
        "n": 42, "x": 2.5, "flag": True, "obj": {"a": [1]}, "items": [1, 2], "maybe": None,
        "code": "\nif a </parameter> b:\n    pass\n", "word": "42", "bad": "five", "extra": "7",
    }
    (plain,) = Qwen3CoderParser().parse(text)  # no schemas: every value stays text
    assert plain.arguments["n"] == "42" and plain.arguments["flag"] == "True"


MALFORMED = {
    "pythonic": [
        ("[add(a=x)]", 'tool call 1 ("add"): argument "a" is a variable'),
        ("[add(a=__import__('os').getcwd())]", 'argument "a" is a function call'),
        ("[add(a=1 + 2)]", 'argument "a" is an expression'),
        ("[add(a={1: 2})]", "keys are not all strings"),
        ("[add(a=b'x')]", "is a bytes literal"),
        ("[add(1, 2)]", "has positional arguments"),
        ("[add(**kw)]", "unpacks **arguments"),
        ("[add(a=1)", "is not closed: the list has no closing ]"),
        ("[add(a=1,, b=2)]", "is not valid Python (invalid syntax"),
        ("[add(a=1, a=2)]", 'tool call 1 ("add") gives argument "a" twice'),
        ("[os.system(a=1)]", "must call a tool by its plain name"),
        ("```tool_code\nadd(a=1)\n", "is not closed: ```tool_code without a closing ```"),
        ("```tool_code\nx = add(a=1)\n```", "must be a list of calls, not statements"),
        ("<|python_start|>[]<|python_end|>", "is an empty list"),
        ("<|python_start|>[add(a=1), 3]<|python_end|>", "tool call 2 is not a function call"),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>", 'tool call 1 ("add") is missing </function>'),
        ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>", 'parameter "a" without its closing </parameter>'),
        ("<tool_call>\n<function=add>\n</function>", "is not closed: </function> without </tool_call>"),
        ('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>', "must start with <function=TOOL_NAME> inside <tool_call>"),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "has no function name"),
        ("<tool_call>\n<function=add\n</function>\n</tool_call>", "<function= tag without its closing >"),
        ("<tool_call>\n<function=add>\nstray\n</function>\n</tool_call>", "has text that is not a <parameter=...> block"),
        ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>", 'gives parameter "a" twice'),
        ("<function=add>\n</function>", "must be inside <tool_call> ... </tool_call>"),
    ],
    "deepseek_v3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": 1\n```<｜tool▁call▁end｜>", 'tool call 1 ("add") has arguments that are not valid JSON'),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n[1]\n```<｜tool▁call▁end｜>", '("add"): "arguments" must be a JSON object, got array'),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{}<｜tool▁call▁end｜>", "a ```json block without its closing ```"),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function add {}<｜tool▁call▁end｜>", "has no <｜tool▁sep｜>"),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n{}", "is not closed: <｜tool▁call▁begin｜> without <｜tool▁call▁end｜>"),
        ("<｜tool▁calls▁begin｜>add {}<｜tool▁calls▁end｜>", "has no <｜tool▁call▁begin｜> after <｜tool▁calls▁begin｜>"),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\n{}<｜tool▁call▁end｜>", "has no tool name"),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "add", "arguments": {}, "id": "short"}]', 'has id "short"; an id is 9 letters or digits'),
        ('[TOOL_CALLS][{"name": "add", "arguments": {}, "id": "abc-12345"}]', "an id is 9 letters or digits"),
        ('[TOOL_CALLS][{"name": "add", "arguments": {}, "id": 123456789}]', "an id is 9 letters or digits"),
        ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}]', "is not valid JSON (Expecting ',' delimiter"),
        ('[TOOL_CALLS][{"arguments": {}}]', 'has no "name" string'),
        ("[TOOL_CALLS][]", "is an empty list"),
        ('[TOOL_CALLS]"add"', "has no JSON arguments after the tool name"),
        ('[TOOL_CALLS]add[ARGS]{"a": }', 'tool call 1 ("add") has arguments that are not valid JSON'),
        ('[TOOL_CALLS][ARGS]{"a": 1}', "has no tool name before [ARGS]"),
    ],
    "xlam": [
        ('[{"name": "add", "arguments": {"a": 1}', "is not valid JSON (Expecting ',' delimiter"),
        ('[{"name": "add", "arguments": "a=1"}]', '"arguments" must be a JSON object, got string'),
        ('[{"tool": "add"}]', 'has no "name" string'),
    ],
    "granite": [
        ("<|tool_call|>add(a=1)", "has no JSON list after <|tool_call|>"),
        ('<|tool_call|>[{"name": "add", "arguments": {"a": 1}]', "is not valid JSON"),
        ('<|tool_call|>[{"name": "add", "arguments": [1]}]', '"arguments" must be a JSON object, got array'),
    ],
    "kimi_k2": [
        ("<|tool_calls_section_begin|><|tool_calls_section_end|>", "has no <|tool_call_begin|>"),
        ('<|tool_call_begin|>functions.add:0{"a": 1}<|tool_call_end|>', "has no <|tool_call_argument_begin|>"),
        ('<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{"a": 1}', "is not closed"),
        ('<|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>{"a": }<|tool_call_end|>', "not valid JSON"),
        ('<|tool_call_begin|> <|tool_call_argument_begin|>{}<|tool_call_end|>', "has no tool name"),
    ],
    "glm45": [
        ("<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "has no tool name"),
        ('<tool_call>{"name": "add"}</tool_call>', "has no tool name"),
        ("<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n", "is not closed"),
        ("<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1\n</tool_call>", 'the value of "a" without its closing'),
        ("<tool_call>add\n<arg_key>a</arg_key>\n1\n</tool_call>", 'has no <arg_value> after the key "a"'),
        ("<tool_call>add\n<arg_key>a\n</tool_call>", "<arg_key> without its closing </arg_key>"),
        ("<tool_call>add\nwords\n</tool_call>", "has no tool name"),
        ("<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value>junk</tool_call>", "not an <arg_key>"),
        ("<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value></tool_call>", 'gives argument "a" twice'),
    ],
    "gemma4": [
        ("<|tool_call>add{a:1}<tool_call|>", "must start with call:TOOL_NAME"),
        ("<|tool_call>call:{a:1}<tool_call|>", "has no tool name"),
        ("<|tool_call>call:add<tool_call|>", "has no {...} arguments"),
        ("<|tool_call>call:add{a:1", "is not closed"),
        ('<|tool_call>call:add{a:<|"|>x}<tool_call|>', "a string without its closing"),
        ("<|tool_call>call:add{a:[1,2}<tool_call|>", "a list without its closing ]"),
        ("<|tool_call>call:add{a}<tool_call|>", "a key without its value"),
        ("<|tool_call>call:add{a:1,a:2}<tool_call|>", 'gives "a" twice'),
        ("<|tool_call>call:add{a:}<tool_call|>", "a missing value"),
        ("<|tool_call>call:add{a:1} extra<tool_call|>", "text after its arguments"),
    ],
    "minimax_m2": [
        ('<minimax:tool_call>\n<invoke>\n<parameter name="a">1</parameter>\n</invoke>', "has no tool name"),
        ('<invoke name="">\n</invoke>', "has no tool name"),
        ('<invoke name="add"><parameter name="a">1</parameter>', "is not closed"),
        ('<invoke name="add"><parameter name="a">1</invoke>', 'parameter "a" without its closing'),
        ('<invoke name="add"><parameter>1</parameter></invoke>', 'without name="ARG_NAME"'),
        ('<invoke name="add"><parameter name="a" 1</parameter></invoke>', 'without name="ARG_NAME"'),
        ('<invoke name="add">words</invoke>', "text that is not a <parameter"),
        ('<invoke name="add"><parameter name="a">1</parameter><parameter name="a">2</parameter></invoke>', 'gives parameter "a" twice'),
    ],
    "muse_glimmer": [
        ('<atem:invoke name="add"><atem:parameter name="a">1</atem:parameter>', "is not closed"),
        ('<atem:invoke name="add"><parameter name="a">1</parameter></atem:invoke>', "text that is not a <atem:parameter"),
    ],
    "deepseek_v32": [
        ('<｜DSML｜invoke name="add">\n<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n', "is not closed"),
        ('<｜DSML｜invoke name="add">\n<parameter name="a">1</parameter>\n</｜DSML｜invoke>', "text that is not a <｜DSML｜parameter"),
    ],
    "llama3_json": [
        ('{"name": "add", "parameters": {"a": 1}} {"name": 5}', 'tool call 2 has no "name" string'),
    ],
    "hermes": [
        ('<tool_call>{"name": "f", "arguments": {}} junk</tool_call>', "is not valid JSON (Extra data"),
    ],
}


@pytest.mark.parametrize(
    "family, text, fragment", [(f, t, e) for f, cases in MALFORMED.items() for t, e in cases],
    ids=[f"{f}-{i}" for f, cases in MALFORMED.items() for i in range(len(cases))],
)
def test_malformed_calls_of_every_family_teach_its_format(family, text, fragment):
    parser = get_parser(family)
    bad = [p for p in parser.parse(text) if not p.ok]
    assert bad, f"{text!r} parsed as well-formed"
    error = bad[0].error
    assert error.startswith("Error: ") and fragment in error and error.endswith(parser.hint)
    with pytest.raises(ValueError, match="malformed"):
        bad[0].to_call()


@pytest.mark.parametrize("family", list(FORMATS))
@pytest.mark.parametrize("kind", list(PATHOLOGICAL))
def test_pathological_input_never_raises_in_any_parser(family, kind):
    parser = get_parser(family)
    raw = PATHOLOGICAL[kind]
    assert parser.parse(raw, tools=SCHEMAS) == [] or all(not p.ok for p in parser.parse(raw))
    parsed = parser.parse(with_argument(family, raw), tools=SCHEMAS)
    assert len(parsed) == 1
    (call,) = parsed
    if call.ok:  # only where values are text (Qwen3-Coder, GLM): what does not read as the schema's type is kept
        assert family in ("qwen3_coder", "glm45", "gemma4", "minimax_m2", "muse_glimmer", "deepseek_v32") and call.arguments["a"] == raw
    else:
        assert call.error.endswith(parser.hint) and len(call.error) < 600
        assert any(w in call.error for w in ("nested", "digits", "too large", "levels deep")), call.error
    # Whatever came back can be copied and stored.
    json.dumps(copy.deepcopy(call.arguments))


@pytest.mark.parametrize("family", list(FORMATS))
def test_hostile_text_is_an_error_not_an_exception(family):
    parser = get_parser(family)
    texts = [
        with_argument(family, "\x00"), with_argument(family, "1e999999"), with_argument(family, "-" * 5000),
        with_argument(family, "{" * 5000), with_argument(family, '"' + "\\" * 3001),
        FORMATS[family]([("add", {"a": 1})])[: len(FORMATS[family]([("add", {"a": 1})])) // 2],
    ]
    for text in texts:
        for p in parser.parse(text, tools=SCHEMAS):
            assert p.ok or p.error.endswith(parser.hint)
            json.dumps(copy.deepcopy(p.arguments))


def test_deep_but_decodable_arguments_are_refused_at_the_limit():
    ok = "[" * (MAX_ARGUMENT_DEPTH - 1) + "]" * (MAX_ARGUMENT_DEPTH - 1)
    too_deep = "[" * (MAX_ARGUMENT_DEPTH + 1) + "]" * (MAX_ARGUMENT_DEPTH + 1)
    assert HermesParser().parse(with_argument("hermes", ok))[0].ok
    error = HermesParser().parse(with_argument("hermes", too_deep))[0].error
    assert f"nested more than {MAX_ARGUMENT_DEPTH} levels deep" in error


def test_pythonic_never_evaluates(tmp_path):
    flag = tmp_path / "ran"
    text = f"[add(a=open({str(flag)!r}, 'w').write('x'))]"
    (call,) = PythonicParser().parse(text)
    assert not call.ok and "is a function call" in call.error and not flag.exists()
    (call,) = PythonicParser().parse("[add(a=0x" + "f" * 5000 + ")]")
    assert not call.ok and "too large" in call.error


def test_kimi_k2_keeps_the_models_call_id_for_the_result():
    text = kimi_k2([("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})])
    parsed = get_parser("kimi_k2").parse(text)
    assert [p.id for p in parsed] == ["functions.add:0", "functions.add:1"]
    assert [p.to_call().id for p in parsed] == ["functions.add:0", "functions.add:1"]
    # A stop before the section's end token still yields the closed calls.
    (only,) = get_parser("kimi_k2").parse(text.split("<|tool_call_begin|>functions.add:1")[0])
    assert (only.name, only.arguments) == ("add", {"a": 1, "b": 2})
    assert detect_parser("{{ '<|tool_calls_section_begin|>' }}") == "kimi_k2"
    assert call_evidence("<|tool_call_begin|>functions.x:0") is not None


def test_mistral_ids():
    parser = MistralParser()
    parsed = parser.parse(FORMATS["mistral"](TWO))
    assert [p.id for p in parsed] == [mistral_id(0), mistral_id(1)]
    assert parsed[0].to_call().id == mistral_id(0) and parsed[0].to_call("other").id == "other"
    v11 = parser.parse('[TOOL_CALLS]add[CALL_ID]abcDEF123[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a": 2}')
    assert [(p.id, p.arguments) for p in v11] == [("abcDEF123", {"a": 1}), (None, {"a": 2})]
    made = {parser.make_call_id(turn, index) for turn in range(40) for index in range(40)}
    assert len(made) == 1600 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in made)
    assert HermesParser().make_call_id(2, 1) == "call_2_1"
    assert all(p.id is None for f in FORMATS if f not in ("mistral", "kimi_k2") for p in get_parser(f).parse(FORMATS[f](TWO)))


# ----------------------------------------------------------------- detection
DEEPSEEK_SNIPPET = (  # the tool-call branch of DeepSeek V3's template
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
)
MISTRAL_SNIPPET = '{{- "[TOOL_CALLS][" }}{%- for tool_call in tool_calls %}{%- set out = tool_call.function|tojson %}'
QWEN3_CODER_SNIPPET = (  # holds <tool_call> too: must still read as Qwen3-Coder
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}{{- '\\n</parameter>\\n' }}{{- '</function>\\n</tool_call>' }}"
)
LLAMA32_PYTHONIC_SNIPPET = (  # also describes the tools as JSON and has an ipython role
    "{{- 'If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\\n' }}"
    '{{- \'Here is a list of functions in JSON format: {"name": ..., "parameters": ...}\' }}'
    "{{- '<|start_header_id|>ipython<|end_header_id|>' }}"
)
LLAMA4_SNIPPET = "{{- '<|python_start|>' }}{{- tool_call.name + '(' }}{{- '<|python_end|>' }}"
GEMMA_SNIPPET = "{{- 'Example Format: [func_name1(params_name1=params_value1), func_name2(params)]' }}<tool_response>"
XLAM_SNIPPET = (
    'You have access to a set of tools. When using tools, make calls in a single JSON array: '
    '\\n\\n[{"name": "tool_call_name", "arguments": {"arg1": "value1"}}]'
)
GRANITE_SNIPPET = "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message.tool_calls | tojson }}"
LLAMA32_JSON_SNIPPET = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
)
PLAIN_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "template, family",
    [
        (DEEPSEEK_SNIPPET, "deepseek_v3"),
        (MISTRAL_SNIPPET, "mistral"),
        (QWEN3_CODER_SNIPPET, "qwen3_coder"),
        (LLAMA32_PYTHONIC_SNIPPET, "pythonic"),
        (LLAMA4_SNIPPET, "pythonic"),
        (GEMMA_SNIPPET, "pythonic"),
        (XLAM_SNIPPET, "xlam"),
        (GRANITE_SNIPPET, "granite"),
        (LLAMA32_JSON_SNIPPET, "llama3_json"),
        (LLAMA_STYLE_TEMPLATE, "llama3_json"),
        ("{{ '<|python_tag|>' + tool_call | tojson }}", "llama3_json"),
    ],
)
def test_detection_from_template_text(template, family):
    found = detect_parser_evidence(template)
    assert (found.name, found.guessed) == (family, False) and "template" in found.evidence
    assert detect_parser(template) == family


def test_detection_of_the_real_qwen_templates_and_guesses(qwen3, qwen25):
    for tok in (qwen3, qwen25):
        found = detect_parser_evidence(tok.chat_template)
        assert found == detect_parser_evidence(tok.chat_template) and (found.name, found.guessed) == ("hermes", False)
    for template in (None, "", PLAIN_CHATML):
        found = detect_parser_evidence(template)
        assert found.name == "hermes" and found.guessed and "guessed" in found.evidence
    with pytest.warns(UserWarning, match="guessed 'hermes'.*pass parser="):
        assert isinstance(get_parser(renderer=ChatRenderer(qwen25, chat_template=PLAIN_CHATML)), HermesParser)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_parser(renderer=ChatRenderer(qwen25))  # a known format: no warning
        assert isinstance(get_parser("mistral", renderer=ChatRenderer(qwen25, chat_template=PLAIN_CHATML)), MistralParser)


# ------------------------------------------------------------ call evidence
def test_call_evidence_names_what_looks_like_a_call():
    tools = ["add", "lookup"]
    for family, write in FORMATS.items():
        assert call_evidence(write(ONE), tools) is not None, family
    assert call_evidence("<|tool_call|>oops", ()) == "it contains '<|tool_call|>'"
    assert call_evidence('I would send {"name": "add", "x": 1}', tools) == 'it has a JSON object naming the tool "add"'
    assert call_evidence("Calling [lookup(query='x')] now", tools) == 'it has a Python-style call of the tool "lookup"'
    assert call_evidence("add(a=1, b=2)", tools) == 'it has a Python-style call of the tool "add"'
    for text in ("<answer>5</answer>", "I used add(2, 3) to get 5.", "Use the add tool.", '{"name": "other"}', "[1, 2]"):
        assert call_evidence(text, tools) is None, text
    assert call_evidence('{"name": "add"}', ()) is None  # no tools named: only markers count


def test_parse_calls_passes_tools_only_to_parsers_that_take_them():
    class Old(ToolCallParser):
        name = "old"

        def parse(self, text):
            return HermesParser().parse(text)

    text = FORMATS["qwen3_coder"](ONE)
    assert parse_calls(Old(), FORMATS["hermes"](ONE))[0].arguments == {"a": 1, "b": 2}
    assert parse_calls(Qwen3CoderParser(), text, SCHEMAS)[0].arguments == {"a": 1, "b": 2}
    assert parse_calls(Qwen3CoderParser(), text)[0].arguments == {"a": "1", "b": "2"}


def test_glm_values_are_text_for_strings_and_json_otherwise():
    text = (
        "<tool_call>lookup\n<arg_key>query</arg_key>\n<arg_value>a </tool_call> b</arg_value>\n"
        '<arg_key>tags</arg_key>\n<arg_value>["x"]</arg_value>\n</tool_call>'
    )
    (call,) = GLMParser().parse(text, tools=SCHEMAS)
    assert call.arguments == {"query": "a </tool_call> b", "tags": ["x"]}
    # Without schemas a value that reads as JSON is decoded, any other stays text.
    (bare,) = GLMParser().parse("<tool_call>f<arg_key>n</arg_key><arg_value>7</arg_value><arg_key>s</arg_key><arg_value>hi</arg_value></tool_call>")
    assert bare.arguments == {"n": 7, "s": "hi"}
    assert detect_parser("{{ '<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>") == "glm45"
