"""The corpus of real chat templates (issue: the real templates): the pinned fetch, the pairings,
and ``docs/templates.md``, whose every row is recomputed here from the template it names.

A row is what a new user gets from the template: built or refused (by name) at construction,
the keep-mode law on a plain chat and a tool conversation, and whether a call in the template's
own format reaches the tool. Nothing but a named refusal may come out of the constructor.
"""

from __future__ import annotations

import hashlib
import io
import re
import socket
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from tokengym.envs import load_tokenizer
from tokengym.envs import template_corpus as tc
from tokengym.envs import template_matrix as tm
from tokengym.recorder.cli import main

PAGE = Path(__file__).resolve().parents[1] / "docs" / "templates.md"
pytestmark = pytest.mark.corpus


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    return tc.corpus_templates()


def test_every_corpus_template_is_paired_with_a_tokenizer(templates):
    assert len(templates) == tc.TEMPLATE_CORPUS.count == 70
    assert set(tc.PAIRINGS) == set(templates)


def test_a_base_vocabulary_gets_the_templates_control_tokens_as_special_tokens(templates):
    tok, added = tc.corpus_tokenizer("GLM-4.6")
    assert {"<|user|>", "<|assistant|>", "<|observation|>", "[gMASK]", "<sop>"} <= set(added)
    for marker in added:
        (single,) = tok.encode(marker, add_special_tokens=False)
        assert tok.added_tokens_decoder[single].special
    assert tok.chat_template == templates["GLM-4.6"]
    own, none_added = tc.corpus_tokenizer("Qwen-Qwen3-0.6B")
    assert none_added == [] and len(own) == len(load_tokenizer("qwen3"))  # the family's own, nothing added
    seed, _ = tc.corpus_tokenizer("ByteDance-Seed-OSS")
    assert (seed.bos_token, seed.eos_token) == ("<seed:bos>", "<seed:eos>")


# ---------------------------------------------------------------------------- the fetch
def _archive(tmp_path: Path, files: dict[str, str], name: str = "corpus.tar.gz") -> tuple[Path, tc.PinnedArchive]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in {**files, "pkg/other/x.jinja": "not a template of the folder"}.items():
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / name
    path.write_bytes(buf.getvalue())
    lines = "".join(f"{Path(p).name} {hashlib.sha256(t.encode()).hexdigest()}\n" for p, t in sorted(files.items()))
    pin = tc.PinnedArchive(
        package="pkg",
        version="1",
        url="http://127.0.0.1:9/none.tar.gz",
        sha256=hashlib.sha256(buf.getvalue()).hexdigest(),
        folder="pkg/templates/",
        folder_digest=hashlib.sha256(lines.encode()).hexdigest(),
        count=len(files),
    )
    return path, pin


FILES = {"pkg/templates/a.jinja": "{{ messages }}", "pkg/templates/b.jinja": "{{ tools }}"}


def test_a_local_archive_is_checked_extracted_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path / "cache"))
    path, pin = _archive(tmp_path, FILES)
    folder = tc.fetch_templates(archive=path, pin=pin)
    assert sorted(p.name for p in folder.iterdir()) == ["a.jinja", "b.jinja"]
    path.unlink()  # the verified copy is used without the archive
    assert tc.fetch_templates(pin=pin) == folder
    assert tc.corpus_templates(pin=pin) == {"a": "{{ messages }}", "b": "{{ tools }}"}


def test_a_cached_template_that_changed_is_extracted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path / "cache"))
    path, pin = _archive(tmp_path, FILES)
    folder = tc.fetch_templates(archive=path, pin=pin)
    (folder / "a.jinja").write_text("{{ tampered }}")
    monkeypatch.setenv("TOKENGYM_TEMPLATE_ARCHIVE", str(path))
    assert tc.fetch_templates(pin=pin) == folder
    assert (folder / "a.jinja").read_text() == "{{ messages }}"


def test_an_archive_with_another_checksum_or_content_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path / "cache"))
    path, pin = _archive(tmp_path, FILES)
    with pytest.raises(tc.TemplateFetchError, match="refusing to use it"):
        tc.fetch_templates(archive=path, pin=replace(pin, sha256="0" * 64))
    with pytest.raises(tc.TemplateFetchError, match="holds 2 templates"):
        tc.fetch_templates(archive=path, pin=replace(pin, folder_digest="0" * 64))
    with pytest.raises(tc.TemplateFetchError, match="no such archive"):
        tc.fetch_templates(archive=tmp_path / "missing.tar.gz", pin=pin)
    assert not (tmp_path / "cache" / "templates" / pin.sha256[:16]).exists()


def test_a_failed_download_names_the_way_around_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENGYM_TEMPLATE_ARCHIVE", raising=False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, pin = _archive(tmp_path, FILES)
    with pytest.raises(tc.TemplateFetchError, match="TOKENGYM_TEMPLATE_ARCHIVE"):
        tc.fetch_templates(pin=replace(pin, url=f"http://127.0.0.1:{port}/x.tar.gz"))


def test_cli_fetch_templates_lists_the_corpus(templates, capsys):
    assert main(["fetch-templates"]) == 0
    out = capsys.readouterr().out
    assert f"{tc.TEMPLATE_CORPUS.spec}: 70 chat templates" in out
    assert f"{tc.VLLM_EXAMPLES.spec}: 35 chat templates" in out and "  tool_chat_template_deepseekv3" in out
    assert "  openai-gpt-oss-120b\n" in out and "  GLM-4.6\n" in out


def test_cli_fetch_templates_reports_a_bad_archive(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOKENGYM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "x.tar.gz").write_bytes(b"not the sdist")
    assert main(["fetch-templates", "--archive", str(tmp_path / "x.tar.gz"), "--force"]) == 2
    assert "refusing to use it" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the matrix
def _committed() -> dict[str, list[str]]:
    return tm.table_rows(PAGE.read_text(encoding="utf-8"))


def test_the_page_lists_every_template_and_its_counts_match_its_rows(templates):
    page = PAGE.read_text(encoding="utf-8")
    rows = _committed()
    assert list(rows) == list(templates)
    assert tm.markdown([tm.Row.from_cells(c) for c in rows.values()]) == page


@pytest.mark.parametrize("name", sorted(tc.PAIRINGS))
def test_each_templates_row_is_what_the_template_does_now(name, templates):
    row = tm.matrix_row(name, templates[name])
    assert row.build != "other", f"{name}: refused for a reason the matrix cannot name"
    assert not any(c.startswith("error:") for c in row.cells()), f"{name}: an exception escaped: {row}"
    assert row.cells() == _committed()[name], (
        f"{name}: docs/templates.md is out of date; run python -m tokengym.envs.template_matrix --write docs/templates.md"
    )


GUIDE = PAGE.parent / "guide.md"


def test_the_guide_quotes_the_pages_counts():
    page = PAGE.read_text(encoding="utf-8")
    (counts,) = [line for line in page.splitlines() if line.startswith("**") and " work**" in line]
    guide = GUIDE.read_text(encoding="utf-8")
    assert counts.rstrip(":") + "." in " ".join(guide.split()), "docs/guide.md's template counts differ from docs/templates.md"


def test_the_guides_family_table_is_the_pages():
    rows = [tm.Row.from_cells(c) for c in _committed().values()]
    guide = GUIDE.read_text(encoding="utf-8")
    assert tm.with_family_table(guide, rows) == guide, (
        "docs/guide.md's family table differs from docs/templates.md; "
        "run python -m tokengym.envs.template_matrix --readme docs/guide.md"
    )
    lines = tm.family_table(rows).splitlines()[2:]
    listed = [n for line in lines for n in re.sub(r" \([^)]*\)", "", line.split(" | ")[1]).split(", ")]
    assert sorted(listed) == sorted(r.name for r in rows if r.works)
    assert len(lines) == len({r.parser.removesuffix(" (guessed)") for r in rows if r.works})
    with pytest.raises(ValueError, match="markers"):
        tm.with_family_table("# no markers here\n", rows)


def test_the_readme_option_names_missing_markers(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "templates.md").write_text(PAGE.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "README.md").write_text("# no table here\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        tm.main(["--readme", str(tmp_path / "README.md")])
    assert exit_.value.code == 2 and "must hold the markers" in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == "# no table here\n"  # left as it was


def test_unknown_names_are_clear_errors(templates, capsys):
    with pytest.raises(KeyError, match="no pairing for corpus template 'GLM-9'"):
        tc.corpus_tokenizer("GLM-9")
    with pytest.raises(SystemExit) as exit_:
        tm.main(["GLM-9"])
    assert exit_.value.code == 2 and "not in the corpus: GLM-9" in capsys.readouterr().err
    # A refusal the matrix has no name for shows as "other", which the row test refuses.
    assert tm.refusal_reason("something new") == "other"
    assert tm.refusal_reason("the chat template failed to render [user] without tools at line 7 of the template: "
                             "TypeError: x") == "the template raises TypeError (line 7)"


def test_a_template_that_mutates_a_list_is_refused_naming_the_sandbox():
    from tokengym.envs.builtin import CalculatorEnv
    from tokengym.envs.template_inputs import TemplateError

    tok, _ = tc.corpus_tokenizer("Kimi-K2-Instruct")
    with pytest.raises(TemplateError, match=r"line 41 of the template: SecurityError.*immutable sandbox.*vLLM"):
        CalculatorEnv(tok)


# ------------------------------------------------------ vLLM's templates that are not prefix-stable
VLLM_NOT_PREFIX_STABLE = {
    # vLLM's example tool templates that its docs pass with --chat-template, and what they do:
    # DeepSeek V3's writes no generation prompt (the user's turn ends with <｜Assistant｜>) and indents
    # each turn, R1's drops earlier reasoning, Mistral's parallel one moves its tool instruction into
    # the last user message.
    "vllm/tool_chat_template_deepseekv3": "named: whitespace_around_control_token",
    "vllm/tool_chat_template_deepseekr1": "ok",
    "vllm/tool_chat_template_mistral_parallel": "named: system_moved",
}


def test_vllms_example_templates_are_fetched_pinned():
    found = tc.vllm_templates()
    assert len(found) == tc.VLLM_EXAMPLES.count == 35
    assert {n.removeprefix("vllm/") for n in tc.VLLM_PAIRINGS} <= set(found)


@pytest.mark.parametrize("name", sorted(VLLM_NOT_PREFIX_STABLE))
def test_vllms_tool_templates_build_run_calls_and_name_every_difference(name):
    row = tm.matrix_row(name)
    assert (row.build, row.call) == ("yes", "yes"), row
    assert row.tool_law == VLLM_NOT_PREFIX_STABLE[name] and row.chat_law in ("ok", row.tool_law), row
    assert row.deploy.startswith("ok"), row


EXAMPLE = Path(__file__).resolve().parents[1] / "envs" / "data" / "example_transcript.json"


@pytest.mark.parametrize(
    ("name", "tokenizer", "conversation", "code", "named"),
    [
        # No generation prompt: the assistant's tag that ends the user's turn opens the assistant's,
        # and the indentation the template writes there in history is named.
        ("vllm/tool_chat_template_deepseekv3", "deepseek_v3", "chat", 1, "whitespace_around_control_token"),
        ("vllm/tool_chat_template_deepseekv3", "deepseek_v3", "example", 1, "whitespace_around_control_token"),
        # Parallel calls and several results: the turns with calls go back as a server hands them.
        ("vllm/tool_chat_template_deepseekr1", "deepseek_v3", "example", 0, None),
        ("vllm/tool_chat_template_mistral_parallel", "mistral_nemo", "tool", 1, "system_moved"),
    ],
)
def test_check_template_on_vllms_tool_templates_names_every_difference(name, tokenizer, conversation, code, named, tmp_path, capsys):
    import json

    template = tmp_path / "t.jinja"
    template.write_text(tc.template_text(name), encoding="utf-8")
    path = EXAMPLE
    if conversation != "example":
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"messages": tm.CHAT if conversation == "chat" else tm.TOOL_CHAT}), encoding="utf-8")
    got = main(["check-template", tokenizer, "--conversation", str(path), "--chat-template", str(template)])
    out = capsys.readouterr().out
    assert got == code and ", 0 mismatch" in out, out
    assert named is None or named in out


def test_call_ids_a_template_refuses_are_named_with_the_form_it_takes(tmp_path, capsys):
    """Mistral's parallel-call template raises on the example transcript's ids (`call_1`): the
    transcript cannot be used as it is (exit 2), and the error says which ids and what form fixes it."""
    template = tmp_path / "t.jinja"
    template.write_text(tc.template_text("vllm/tool_chat_template_mistral_parallel"), encoding="utf-8")
    got = main(["check-template", "mistral_nemo", "--conversation", str(EXAMPLE), "--chat-template", str(template)])
    err = capsys.readouterr().err
    assert got == 2, err
    assert "message 2 (assistant)" in err and "refuses its call ids (call_1, call_2)" in err, err
    assert "9 letters or digits" in err and "check its keys and values" not in err, err


def test_a_template_that_writes_calls_but_not_the_tools_says_where_they_go():
    """DeepSeek V3.1's own template renders tool calls but never the tool schemas; its model card
    puts them in the system message: the refusal says so, and the opt-out builds the env."""
    from tokengym.envs import CalculatorEnv
    from tokengym.envs.template_inputs import TemplateError

    tok, _ = tc.corpus_tokenizer("deepseek-ai-DeepSeek-V3.1")
    with pytest.raises(TemplateError, match=r"in the system message\), in your own system message, and pass "
                       r"require_tools_in_prompt=False") as err:
        CalculatorEnv(tok).reset(seed=0)
    assert "another format than the model was trained on" in str(err.value)
    env = CalculatorEnv(tok, require_tools_in_prompt=False)
    obs, _ = env.reset(seed=0)
    assert len(obs) > 0


@pytest.mark.parametrize("name", ["upstage-Solar-Open-100B", "meetkai-functionary-medium-v3.2", "muse-glimmer"])
def test_an_opening_the_model_writes_is_compared_once(name):
    """Templates whose assistant turn opens with text the model writes (Solar's `<|content|>`,
    functionary's recipient `all\\n`, muse-glimmer's ` to=user<|message|>`) render it again before a
    message's content: the conversation is compared as a server hands the turn back, without it, and
    so is a turn with calls, which opens otherwise (muse-glimmer's ` to=calculate`, functionary's
    `>>>calculate`) and goes back as its calls."""
    from tokengym.envs import CalculatorEnv, ChatRenderer
    from tokengym.envs.function_tools import expand_tools

    tok, _ = tc.corpus_tokenizer(name)
    opening = ChatRenderer(tok).assistant_opening
    assert opening and opening.strip()
    assert tm._law(tok, tm.CHAT, None, {}) == "ok"
    schemas = [t.schema for t in expand_tools(CalculatorEnv(tok).static_tools)]
    assert tm._law(tok, tm.TOOL_CHAT, schemas, {}) == "ok"


def test_a_tool_results_end_that_history_drops_is_named_and_a_users_is_not():
    """Bielik 11B v3's template drops the `<|im_end|>` after a tool result once a message follows
    (it indexes the whole list with a slice's loop index): named. The same slip after a user's
    message is not that behaviour: it stays a difference tokengym cannot name."""
    from tokengym.envs import CalculatorEnv
    from tokengym.envs.function_tools import expand_tools

    name = "Bielik-11B-v3.0-Instruct"
    tok, _ = tc.corpus_tokenizer(name)
    schemas = [t.schema for t in expand_tools(CalculatorEnv(tok).static_tools)]
    assert tm._law(tok, tm.TOOL_CHAT, schemas, {}) == "named: tool_result_end_dropped, whitespace_around_control_token"
    user_turn = "{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
    text = tc.template_text(name)
    assert text.count(user_turn) == 1
    slip = text.replace(user_turn, "{{- '<|im_start|>user\\n' + message['content'] + ('<|im_end|>\\n' if loop.last else '') }}")
    tok, _ = tc.corpus_tokenizer(name, slip)
    assert tm._law(tok, tm.TOOL_CHAT, schemas, {}).startswith("MISMATCH")


def test_a_dropped_prompt_preamble_and_moved_whitespace_are_named_together():
    """Apriel 1.6's generation prompt ends with a preamble history never shows, and its history puts a
    line break before `<|end|>`: both differences at once, each named."""
    tok, _ = tc.corpus_tokenizer("Apriel-1.6-15b-Thinker-fixed")
    assert tm._law(tok, tm.CHAT, None, {}) == "named: empty_think_dropped, whitespace_around_control_token"
