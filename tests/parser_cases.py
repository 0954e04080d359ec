"""The model texts that tokengym's tool-call parsers and vLLM's own are both run on.

Each family writes the same eleven turns in its own format: one call, two calls, text before a
call, text after it, no call, empty arguments, arguments of every JSON type, arguments that do
not parse, a call cut off before its end marker (a stop or a length limit), a good call next to a
broken one, and one with non-ASCII text. The texts are built from one list of calls so that a
family's row differs only in how the format writes them; :mod:`test_vllm_parsers` compares what
the two parsers read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "exact": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "filters": {"type": "object"},
                },
                "required": ["query"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {"type": "object", "properties": {}}}},
]

CALC = ("calculate", {"expression": "12 * (3 + 4)"})
TYPED = ("search", {"query": "tides", "limit": 3, "exact": True, "tags": ["sea", "moon"], "filters": {"year": 2024}})
EMPTY = ("now", {})
UNICODE = ("search", {"query": "Zürich café — 東京"})

Call = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Format:
    """How one family writes a turn's calls, and the two ways a call goes wrong in it."""

    ours: str
    """tokengym's parser name."""
    vllm: str
    """vLLM's tool parser name (``"openai"``: its Harmony parser, which reads token ids)."""
    tokenizer: str
    """The pinned tokenizer both read the text with (vLLM's parsers look their markers up in it)."""
    turn: Callable[[list[Call]], str]
    """The text of a turn that makes these calls (and nothing else)."""
    broken: str
    """A turn whose one call's arguments do not parse."""
    unclosed: str
    """A turn whose one call stops before its end marker."""
    added_tokens: tuple[str, ...] = ()
    """Markers added to the tokenizer as special tokens: the family's own tokenizer is not
    packaged, and vLLM's parser refuses a tokenizer without them (the texts are the same)."""
    before: str = "I will work it out with the tool.\n\n"
    after: str = "\n\nThe tool will give the answer."
    sep: str = "\n"
    """What goes between a turn's good call and a broken one written after it."""
    notes: dict[str, str] = field(default_factory=dict)


def j(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text_value(value: Any) -> str:
    """A value as the XML-like formats write it: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else j(value)


def _py(value: Any) -> str:
    """A value as a Python literal (the pythonic format)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return j(value)
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{j(k)}: {_py(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _gemma(value: Any) -> str:
    """A value in Gemma 4's argument notation (strings quoted with its ``<|"|>`` token)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, list):
        return "[" + ",".join(_gemma(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma(v)}" for k, v in value.items()) + "}"
    return j(value)


def hermes(calls: list[Call]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {j(a)}}}\n</tool_call>' for n, a in calls)


def llama3_json(calls: list[Call]) -> str:
    return "; ".join(f'{{"name": "{n}", "parameters": {j(a)}}}' for n, a in calls)


def pythonic(calls: list[Call]) -> str:
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={_py(v)}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def mistral(calls: list[Call]) -> str:
    ids = ("a1b2c3d4e", "f5g6h7i8j", "k9l0m1n2o")
    return "[TOOL_CALLS]" + j([{"name": n, "arguments": a, "id": ids[i]} for i, (n, a) in enumerate(calls)])


def mistral_v11(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{j(a)}" for n, a in calls)


def deepseek_v3(calls: list[Call]) -> str:
    one = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>"
    return "<｜tool▁calls▁begin｜>" + "\n".join(one.format(n, j(a)) for n, a in calls) + "<｜tool▁calls▁end｜>"


def deepseek_v31(calls: list[Call]) -> str:
    one = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
    return "<｜tool▁calls▁begin｜>" + "".join(one.format(n, j(a)) for n, a in calls) + "<｜tool▁calls▁end｜>"


def qwen3_coder(calls: list[Call]) -> str:
    def one(n: str, a: dict[str, Any]) -> str:
        params = "".join(f"<parameter={k}>\n{_text_value(v)}\n</parameter>\n" for k, v in a.items())
        return f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>"

    return "\n".join(one(n, a) for n, a in calls)


def glm45(calls: list[Call]) -> str:
    def one(n: str, a: dict[str, Any]) -> str:
        args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_text_value(v)}</arg_value>\n" for k, v in a.items())
        return f"<tool_call>{n}\n{args}</tool_call>"

    return "\n".join(one(n, a) for n, a in calls)


def kimi_k2(calls: list[Call]) -> str:
    one = "<|tool_call_begin|>functions.{}:{}<|tool_call_argument_begin|>{}<|tool_call_end|>"
    body = "".join(one.format(n, i, j(a)) for i, (n, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def harmony(calls: list[Call]) -> str:
    one = "<|start|>assistant to=functions.{}<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"
    text = "".join(one.format(n, j(a)) for n, a in calls)
    return text.removeprefix("<|start|>assistant")  # the generation prompt wrote it


def granite(calls: list[Call]) -> str:
    return "<|tool_call|>" + j([{"name": n, "arguments": a} for n, a in calls])


def xlam(calls: list[Call]) -> str:
    return j([{"name": n, "arguments": a} for n, a in calls])


def minimax_m2(calls: list[Call]) -> str:
    def one(n: str, a: dict[str, Any]) -> str:
        params = "".join(f'<parameter name="{k}">{_text_value(v)}</parameter>\n' for k, v in a.items())
        return f'<invoke name="{n}">\n{params}</invoke>\n'

    return "<minimax:tool_call>\n" + "".join(one(n, a) for n, a in calls) + "</minimax:tool_call>"


def dsml(calls: list[Call]) -> str:
    def one(n: str, a: dict[str, Any]) -> str:
        params = "".join(
            f'<｜DSML｜parameter name="{k}" string="{str(isinstance(v, str)).lower()}">{_text_value(v)}</｜DSML｜parameter>\n'
            for k, v in a.items()
        )
        return f'<｜DSML｜invoke name="{n}">\n{params}</｜DSML｜invoke>\n'

    return "<｜DSML｜function_calls>\n" + "".join(one(n, a) for n, a in calls) + "</｜DSML｜function_calls>"


def muse_glimmer(calls: list[Call]) -> str:
    def one(n: str, a: dict[str, Any]) -> str:
        params = "".join(f'<atem:parameter name="{k}">{_text_value(v)}</atem:parameter>\n' for k, v in a.items())
        return f' to={n}<|message|><atem:function_calls>\n<atem:invoke name="{n}">\n{params}</atem:invoke>\n</atem:function_calls><|eom|>'

    return "<|start|>assistant".join(one(n, a) for n, a in calls)


def gemma4(calls: list[Call]) -> str:
    return "".join(f"<|tool_call>call:{n}{_gemma(a)}<tool_call|>" for n, a in calls)


KIMI_TOKENS = (
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
)  # fmt: skip

FORMATS: dict[str, Format] = {
    "hermes": Format(
        "hermes", "hermes", "qwen3", hermes,
        broken='<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}\n</tool_call>',
        unclosed='<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}',
    ),
    "llama3_json": Format(
        "llama3_json", "llama3_json", "llama3_2", llama3_json,
        broken='{"name": "calculate", "parameters": {"expression": "12 * (3 + 4)"}',
        sep="; ",
        unclosed='{"name": "calculate", "parameters": {"expression": "12 * (3',
    ),
    "pythonic": Format(
        "pythonic", "pythonic", "llama3_2", pythonic,
        broken='[calculate(expression="12 * (3 + 4)"]',
        unclosed='[calculate(expression="12 * (3 + 4)")',
    ),
    "mistral": Format(
        "mistral", "mistral", "mistral_nemo", mistral,
        broken='[TOOL_CALLS][{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}, "id": "a1b2c3d4e"]',
        unclosed='[TOOL_CALLS][{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}, "id": "a1b2c3d4e"}',
    ),
    "mistral_v11": Format(
        "mistral", "mistral", "mistral_nemo", mistral_v11,
        broken='[TOOL_CALLS]calculate[ARGS]{"expression": "12 * (3 + 4)"',
        unclosed='[TOOL_CALLS]calculate[ARGS]{"expression": "12 *',
        added_tokens=("[ARGS]",),  # what makes a tokenizer v11 or later, for vLLM as for Mistral's own
    ),
    "deepseek_v3": Format(
        "deepseek_v3", "deepseek_v3", "deepseek_v3", deepseek_v3,
        broken="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculate\n```json\n"
        '{"expression": "12 * (3 + 4)"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        unclosed="<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculate\n```json\n"
        '{"expression": "12 * (3 + 4)"}\n```',
    ),
    "deepseek_v31": Format(
        "deepseek_v3", "deepseek_v31", "deepseek_v3", deepseek_v31,
        broken='<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculate<｜tool▁sep｜>{"expression": "12 * (3 + 4)"'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        unclosed='<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculate<｜tool▁sep｜>{"expression": "12 * (3 + 4)"}',
    ),
    "qwen3_coder": Format(
        "qwen3_coder", "qwen3_coder", "qwen3", qwen3_coder,
        broken="<tool_call>\n<function=search>\n<parameter=query>\ntides\n</parameter>\n<parameter=limit>\nthree\n"
        "</parameter>\n</function>\n</tool_call>",
        unclosed="<tool_call>\n<function=calculate>\n<parameter=expression>\n12 * (3 + 4)\n</parameter>\n",
    ),
    "glm45": Format(
        "glm45", "glm45", "qwen3", glm45,
        broken="<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>tides</arg_value>\n<arg_key>limit</arg_key>\n"
        "<arg_value>three</arg_value>\n</tool_call>",
        unclosed="<tool_call>calculate\n<arg_key>expression</arg_key>\n<arg_value>12 * (3 + 4)</arg_value>\n",
    ),
    "kimi_k2": Format(
        "kimi_k2", "kimi_k2", "qwen3", kimi_k2,
        broken="<|tool_calls_section_begin|><|tool_call_begin|>functions.calculate:0<|tool_call_argument_begin|>"
        '{"expression": "12 * (3 + 4)"<|tool_call_end|><|tool_calls_section_end|>',
        unclosed="<|tool_calls_section_begin|><|tool_call_begin|>functions.calculate:0<|tool_call_argument_begin|>"
        '{"expression": "12 * (3 + 4)"}',
        added_tokens=KIMI_TOKENS,
    ),
    "harmony": Format(
        "harmony", "openai", "gptoss", harmony,
        broken=' to=functions.calculate<|channel|>commentary <|constrain|>json<|message|>{"expression": "12 * (3 + 4)"<|call|>',
        unclosed=' to=functions.calculate<|channel|>commentary <|constrain|>json<|message|>{"expression": "12 * (3 + 4)"}',
        before="<|channel|>analysis<|message|>I will work it out with the tool.<|end|><|start|>assistant",
        after="<|start|>assistant<|channel|>final<|message|>The tool will give the answer.<|return|>",
        sep="<|start|>assistant",
    ),
    "granite": Format(
        "granite", "granite", "qwen3", granite,
        broken='<|tool_call|>[{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}]',
        unclosed='<|tool_call|>[{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}',
        added_tokens=("<|tool_call|>",),
    ),
    "xlam": Format(
        "xlam", "xlam", "qwen3", xlam,
        broken='[{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}]',
        unclosed='[{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}',
    ),
    "minimax_m2": Format(
        "minimax_m2", "minimax_m2", "qwen3", minimax_m2,
        broken='<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">tides</parameter>\n'
        '<parameter name="limit">three</parameter>\n</invoke>\n</minimax:tool_call>',
        unclosed='<minimax:tool_call>\n<invoke name="calculate">\n<parameter name="expression">12 * (3 + 4)</parameter>\n',
        added_tokens=("<minimax:tool_call>", "</minimax:tool_call>"),
    ),
    "deepseek_v32": Format(
        "deepseek_v32", "deepseek_v32", "deepseek_v3", dsml,
        broken='<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">tides'
        '</｜DSML｜parameter>\n<｜DSML｜parameter name="limit" string="false">three</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>",
        unclosed='<｜DSML｜function_calls>\n<｜DSML｜invoke name="calculate">\n<｜DSML｜parameter name="expression" string="true">'
        "12 * (3 + 4)</｜DSML｜parameter>\n",
    ),
    "muse_glimmer": Format(
        "muse_glimmer", "muse_glimmer", "qwen3", muse_glimmer,
        broken=' to=search<|message|><atem:function_calls>\n<atem:invoke name="search">\n<atem:parameter name="query">tides'
        '</atem:parameter>\n<atem:parameter name="limit">three</atem:parameter>\n</atem:invoke>\n</atem:function_calls><|eom|>',
        unclosed=' to=calculate<|message|><atem:function_calls>\n<atem:invoke name="calculate">\n'
        '<atem:parameter name="expression">12 * (3 + 4)</atem:parameter>\n',
        added_tokens=("<|start|>", "<|message|>", "<|eom|>", "<|eot|>"),
        before=" to=self<|message|>I will work it out with the tool.<|eom|><|start|>assistant",
        after="<|start|>assistant to=user<|message|>The tool will give the answer.<|eot|>",
        sep="<|start|>assistant",
    ),
    "gemma4": Format(
        "gemma4", "gemma4", "gemma3", gemma4,
        broken='<|tool_call>call:calculate{expression:<|"|>12 * (3 + 4)<|"|><tool_call|>',
        unclosed='<|tool_call>call:calculate{expression:<|"|>12 * (3 + 4)<|"|>}',
    ),
}  # fmt: skip


def cases(fmt: Format) -> dict[str, str]:
    """The eleven turns of a family, by case name."""
    turn = fmt.turn
    return {
        "one call": turn([CALC]),
        "two calls": turn([CALC, TYPED]),
        "text before the call": fmt.before + turn([CALC]),
        "text after the call": turn([CALC]) + fmt.after,
        "no call": "The answer is 84.",
        "empty arguments": turn([EMPTY]),
        "every JSON type": turn([TYPED]),
        "arguments that do not parse": fmt.broken,
        "a call cut off before its end": fmt.unclosed,
        "a good call beside a broken one": turn([CALC]) + fmt.sep + fmt.broken,
        "non-ASCII text": turn([UNICODE]),
    }
