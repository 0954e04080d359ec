"""Templates that are not prefix-stable are named, not errors; a template that raises during the
check never breaks ``step`` in ``warn`` mode. Each template here is written in the style of a
real family (on the real Qwen2.5 tokenizer, whose ChatML tokens they use)."""

from __future__ import annotations

import numpy as np
import pytest

from tokengym.envs import ReplayEnv
from tokengym.envs.conformance import CAUSES, ConformanceError, KnownBehaviour
from tokengym.recorder.cli import main

from test_render import MOVING_TOOLS

CHATML = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ CONTENT }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIMMING = CHATML.replace("{{ CONTENT }}", "{{ m.content | trim }}")  # Llama 3 / Gemma style
ONE_ANSWER = (  # a template with a rule of its own that a longer conversation breaks
    "{%- if messages | selectattr('role', 'equalto', 'assistant') | list | length > 1 %}"
    "{{ raise_exception('this template renders one assistant turn') }}{% endif %}"
) + CHATML.replace("{{ CONTENT }}", "{{ m.content }}")
DROPS_REASONING = CHATML.replace(  # DeepSeek R1 style: every assistant turn loses its reasoning
    "{{ CONTENT }}",
    "{% if m.role == 'assistant' and '</think>' in m.content %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}",
)


def two_turns(system: bool = False) -> dict:
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "second"}, {"role": "assistant", "content": "b"}]
    if system:
        msgs.insert(0, {"role": "system", "content": "You are terse."})
    return {"messages": msgs}


def play(env: ReplayEnv, actions: list[str]) -> list[dict]:
    r = env.renderer
    env.reset(seed=0)
    infos = []
    for text in actions:
        _, _, term, trunc, info = env.step(np.array(r.encode(text) + list(r.turn_end_ids)))
        infos.append(info)
        if term or trunc:
            break
    return infos


def test_a_template_error_in_the_check_is_a_reported_mismatch(qwen25):
    env = ReplayEnv(qwen25, two_turns(), chat_template=ONE_ANSWER, conformance="warn")
    infos = play(env, ["a", "b"])  # step never raises
    first, second = (i["conformance"] for i in infos)
    assert first.status == "ok"
    assert second.status == "mismatch" and "this template renders one assistant turn" in second.detail
    strict = ReplayEnv(qwen25, two_turns(), chat_template=ONE_ANSWER, conformance="strict")
    with pytest.raises(ConformanceError, match="one assistant turn"):
        play(strict, ["a", "b"])


def test_whitespace_trimmed_next_to_a_control_token_is_named(qwen25):
    env = ReplayEnv(qwen25, two_turns(), chat_template=TRIMMING)
    infos = play(env, ["  a \n", "b"])
    conf = infos[0]["conformance"]
    assert conf.status == "known" and conf.behaviours == (KnownBehaviour.WHITESPACE_AROUND_CONTROL_TOKEN.value,)
    assert CAUSES["whitespace_around_control_token"] in conf.detail


def test_reasoning_dropped_from_every_turn_is_named(qwen25):
    env = ReplayEnv(qwen25, two_turns(), chat_template=DROPS_REASONING)
    infos = play(env, ["<think>hm</think>a", "b"])
    assert infos[0]["conformance"].status in ("ok", "known")
    second = infos[1]["conformance"]
    assert second.status == "known" and second.behaviours == ("reasoning_dropped",) and second.affected_turns == (0,)


def test_system_prompt_moved_to_the_last_user_message_is_named(qwen25):
    env = ReplayEnv(qwen25, two_turns(system=True), chat_template=MOVING_TOOLS)
    infos = play(env, ["a", "b"])  # the env runs on: the stream keeps what the policy saw
    # The first observation brings the second user message: the system prompt moves to it.
    for info in infos:
        conf = info["conformance"]
        assert conf.status == "known" and conf.behaviours == ("system_moved",)
        assert "the system prompt after the first user message" in conf.detail


def test_an_unexplained_difference_stays_a_mismatch(qwen25):
    # A template that counts the messages in the system turn: nothing tokengym can name.
    counting = "<|im_start|>system\n{{ messages | length }}<|im_end|>\n" + CHATML.replace("{{ CONTENT }}", "{{ m.content }}")
    infos = play(ReplayEnv(qwen25, two_turns(), chat_template=counting), ["a", "b"])
    assert infos[0]["conformance"].status == "mismatch"


def test_check_template_names_the_turn_and_the_cause(tmp_path, capsys):
    (tmp_path / "t.jinja").write_text(MOVING_TOOLS)
    (tmp_path / "c.json").write_text(__import__("json").dumps(two_turns(system=True)))
    code = main(["check-template", "qwen2.5", "--conversation", str(tmp_path / "c.json"),
                 "--chat-template", str(tmp_path / "t.jinja")])
    out = capsys.readouterr().out
    assert code == 1
    assert "not prefix-stable on turn(s) [0, 1]" in out and "system_moved" in out and CAUSES["system_moved"] in out


def test_a_tool_env_on_a_template_without_tool_results_fails_at_construction(qwen25):
    from tokengym.envs.tool_env import ToolEnv

    alternating = (  # Gemma 3's own rule: roles must alternate, so a tool message cannot be rendered
        "{%- for m in messages %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: one.
            b: two.
        """
        return a + b

    with pytest.raises(Exception, match="tool results after an assistant turn with tool calls.*roles must alternate"):
        ToolEnv(qwen25, [{"prompt": "p"}], [add], chat_template=alternating)
