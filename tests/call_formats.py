"""Tool calls written the way each model family writes them, for parser and env tests.

``FORMATS[family](calls)`` is the text a model of that family generates for ``calls``, a list
of ``(name, arguments)`` pairs; ``PATHOLOGICAL`` holds argument texts that break naive parsers.
"""

from __future__ import annotations

import json

Calls = list[tuple[str, dict]]


def hermes(calls: Calls) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def llama3_json(calls: Calls) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def pythonic(calls: Calls) -> str:
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"


def qwen3_coder(calls: Calls) -> str:
    def value(v):
        return json.dumps(v) if isinstance(v, (dict, list)) else str(v)

    return "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    )


def deepseek_v3(calls: Calls) -> str:
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseek_v31(calls: Calls) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def mistral_id(index: int) -> str:
    return f"mdl{index:06d}"


def mistral(calls: Calls) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a, "id": mistral_id(i)} for i, (n, a) in enumerate(calls)])


def mistral_v11(calls: Calls) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def xlam(calls: Calls) -> str:
    return json.dumps([{"name": n, "arguments": a} for n, a in calls])


def granite(calls: Calls) -> str:
    return "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def kimi_k2(calls: Calls) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def glm45(calls: Calls) -> str:
    def value(v):
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    return "".join(
        f"<tool_call>{n}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{value(v)}</arg_value>\n" for k, v in a.items()) + "</tool_call>"
        for n, a in calls
    )


def glm47(calls: Calls) -> str:
    return glm45(calls).replace("\n", "")


def gemma4(calls: Calls) -> str:
    def value(v):
        if isinstance(v, str):
            return f'<|"|>{v}<|"|>'
        if isinstance(v, bool):
            return "true" if v else "false"
        if v is None:
            return "null"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{value(x)}" for k, x in sorted(v.items())) + "}"
        if isinstance(v, list):
            return "[" + ",".join(value(x) for x in v) + "]"
        return json.dumps(v)

    return "".join(f"<|tool_call>call:{n}{value(a)}<tool_call|>" for n, a in calls)


def harmony(calls: Calls) -> str:
    return "".join(
        f"<|start|>assistant to=functions.{n}<|channel|>commentary <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
        for n, a in calls
    )


def minimax_m2(calls: Calls) -> str:
    def value(v):
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    body = "".join(
        f'<invoke name="{n}">' + "".join(f'<parameter name="{k}">{value(v)}</parameter>\n' for k, v in a.items()) + "</invoke>\n"
        for n, a in calls
    )
    return f"\n<minimax:tool_call>\n{body}</minimax:tool_call>"


def muse_glimmer(calls: Calls) -> str:
    def value(v):
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

    body = "".join(
        f'<atem:function_calls>\n<atem:invoke name="{n}">\n'
        + "".join(f'<atem:parameter name="{k}">{value(v)}</atem:parameter>\n' for k, v in a.items())
        + "</atem:invoke>\n</atem:function_calls>"
        for n, a in calls
    )
    return f" to={calls[0][0]}<|message|>{body}"


def deepseek_v32(calls: Calls, block: str = "function_calls") -> str:
    def parameter(k, v):
        text, kind = (v, "true") if isinstance(v, str) else (json.dumps(v, ensure_ascii=False), "false")
        return f'<｜DSML｜parameter name="{k}" string="{kind}">{text}</｜DSML｜parameter>\n'

    body = "".join(f'<｜DSML｜invoke name="{n}">\n' + "".join(parameter(k, v) for k, v in a.items()) + "</｜DSML｜invoke>\n" for n, a in calls)
    return f"\n\n<｜DSML｜{block}>\n{body}</｜DSML｜{block}>"


def deepseek_v4(calls: Calls) -> str:
    return deepseek_v32(calls, "tool_calls")


FORMATS = {
    "hermes": hermes,
    "llama3_json": llama3_json,
    "pythonic": pythonic,
    "qwen3_coder": qwen3_coder,
    "deepseek_v3": deepseek_v3,
    "mistral": mistral,
    "xlam": xlam,
    "granite": granite,
    "kimi_k2": kimi_k2,
    "glm45": glm45,
    "gemma4": gemma4,
    "harmony": harmony,
    "minimax_m2": minimax_m2,
    "muse_glimmer": muse_glimmer,
    "deepseek_v32": deepseek_v32,
}
"""One writer per registered family (the name its parser is registered under)."""

VARIANTS = {
    "deepseek_v31": ("deepseek_v3", deepseek_v31),
    "mistral_v11": ("mistral", mistral_v11),
    "glm47": ("glm45", glm47),
    "deepseek_v4": ("deepseek_v32", deepseek_v4),
}
"""Other forms a family's parser reads: name -> (family, writer)."""

PATHOLOGICAL = {
    "10k_nested_brackets": "[" * 10_000 + "]" * 10_000,
    "5000_digit_integer": "7" * 5_000,
    "600_deep_list": "[" * 600 + "1" + "]" * 600,
}
"""Argument texts: deeper than any recursion limit, an integer past Python's 4,300-digit text
limit, and a list deeper than the argument limit but shallow enough to decode."""


def with_argument(family: str, text: str) -> str:
    """A call of ``add`` in ``family``'s format whose argument ``a`` is the raw ``text``."""
    marker = "424242"
    return FORMATS[family]([("add", {"a": int(marker), "b": 1})]).replace(marker, text, 1)
