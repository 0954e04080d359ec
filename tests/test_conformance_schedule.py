"""Which turns render the whole conversation to check it: the default ``"doubling"`` schedule
(turns 0, 1, 3, 7, ... and always the last) keeps an episode's checking cost linear in its
turns; a turn between checks says so (``"deferred"``), and a difference made on it is named,
with its own turn, segment and position, by the next check. On the real Qwen2.5 tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from tokengym.envs import ChatEnv, ConformanceError
from tokengym.envs.chat import EnvResponse, Prompt
from tokengym.envs.conformance import is_scheduled, next_scheduled
from tokengym.recorder import summarize_conformance

# ChatML that renders an assistant message holding SECRET as REDACTED: a stream in which the
# policy wrote SECRET differs from the template on that action, and only there.
REDACTING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and 'SECRET' in m.content %}REDACTED{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Echo(ChatEnv):
    """Answers every assistant turn with a user message; done after ``rounds`` turns."""

    def __init__(self, tokenizer, rounds: int, **kwargs):
        super().__init__(tokenizer, max_turns=64, **kwargs)
        self.rounds = rounds

    def make_prompt(self, options):
        return Prompt([{"role": "user", "content": "Count with me."}])

    def respond(self, turn):
        if turn.turn + 1 >= self.rounds:
            return EnvResponse(done=True)
        return EnvResponse([{"role": "user", "content": f"You said: {turn.text}"}])


def play(env: ChatEnv, text_for) -> list:
    """One episode; ``text_for(turn)`` is the action's text, or a list of ids."""
    r = env.renderer
    env.reset(seed=0)
    results, done, turn = [], False, 0
    while not done:
        action = text_for(turn)
        ids = r.encode(action) if isinstance(action, str) else list(action)
        _, _, term, trunc, info = env.step(np.array(ids + list(r.turn_end_ids)))
        results.append(info["conformance"])
        done, turn = term or trunc, turn + 1
    return results


def test_doubling_checks_turns_0_1_3_7_and_the_last(qwen25):
    results = play(Echo(qwen25, rounds=10), lambda t: f"number {t}")
    assert [c.turn for c in results] == list(range(10))
    checked = [c.turn for c in results if c.checked]
    assert checked == [0, 1, 3, 7, 9]  # 9: the episode's last turn, always checked
    assert all(c.status == "ok" for c in results if c.checked)
    for c in results:
        if c.turn not in checked:
            assert c.status == "deferred" and c.ok and not c.checked  # never a copied "ok"
            assert f"the check on turn {next_scheduled(c.turn, 'doubling')}" in c.detail
            assert c.as_dict()["status"] == "deferred"
    every = play(Echo(qwen25, rounds=10, conformance_schedule="every_turn"), lambda t: f"number {t}")
    assert [c.status for c in every] == ["ok"] * 10


def test_schedule_defaults_per_mode_and_is_validated(qwen25):
    assert Echo(qwen25, rounds=2).conformance_schedule == "doubling"
    assert Echo(qwen25, rounds=2, conformance="strict").conformance_schedule == "every_turn"
    lazy = Echo(qwen25, rounds=2, conformance="strict", conformance_schedule="doubling")
    assert lazy.conformance_schedule == "doubling"
    with pytest.raises(ValueError, match="conformance_schedule must be one of .*'doubling', 'every_turn'.*'sometimes'"):
        Echo(qwen25, rounds=2, conformance_schedule="sometimes")
    assert [t for t in range(40) if is_scheduled(t, "doubling")] == [0, 1, 3, 7, 15, 31]
    assert all(is_scheduled(t, "every_turn") for t in range(40))
    with pytest.raises(ValueError, match="conformance_schedule"):
        is_scheduled(3, "weekly")  # type: ignore[arg-type]


@pytest.mark.parametrize("rounds, found_on", [(10, 7), (6, 5)])  # the next scheduled check, or the last turn
def test_a_difference_on_a_deferred_turn_is_named_by_the_next_check(qwen25, rounds, found_on):
    def text(t):
        return "SECRET plan" if t == 4 else f"number {t}"

    every = play(Echo(qwen25, rounds=rounds, chat_template=REDACTING, conformance_schedule="every_turn"), text)
    first = next(c for c in every if c.status == "mismatch")
    assert first.turn == 4 and first.affected_turns == (4,) and first.segment == "action"
    assert first.actual_text.startswith("SECRET") and first.expected_text.startswith("REDACTED")

    doubling = play(Echo(qwen25, rounds=rounds, chat_template=REDACTING), text)
    assert [c.status for c in doubling[:4]] == ["ok", "ok", "deferred", "ok"]
    assert doubling[4].status == "deferred"  # the difference is made here, and not looked for
    found = next(c for c in doubling if c.status == "mismatch")
    assert found.turn == found_on and not found.ok
    # Reported with the turn it happened in, at the same token, as a check on every turn does.
    assert found.affected_turns == (4,) and found.segment == "action" and found.position == first.position
    assert "(turn 4, action segment)" in found.detail
    assert all(c.status == "deferred" for c in doubling[5:found_on])
    summary = summarize_conformance([c.as_dict() for c in doubling])
    assert summary["mismatch"] == sum(c.status == "mismatch" for c in doubling) >= 1
    assert summary["deferred"] == sum(c.status == "deferred" for c in doubling) >= 2
    assert summary["turns_checked"] == rounds - summary["deferred"]
    assert summary["ok"] == 3  # turns 0, 1, 3: never the deferred ones


def test_strict_raises_on_the_check_that_finds_it(qwen25):
    def text(t):
        return "SECRET plan" if t == 4 else f"number {t}"

    strict = Echo(qwen25, rounds=10, chat_template=REDACTING, conformance="strict")
    with pytest.raises(ConformanceError) as err:
        play(strict, text)
    assert err.value.result.turn == 4 and err.value.result.affected_turns == (4,)

    lazy = Echo(qwen25, rounds=10, chat_template=REDACTING, conformance="strict", conformance_schedule="doubling")
    with pytest.raises(ConformanceError) as err:
        play(lazy, text)
    assert err.value.result.turn == 7 and err.value.result.affected_turns == (4,)


def test_a_deferred_turn_keeps_its_own_notes(qwen25):
    hello = qwen25.encode("Hello", add_special_tokens=False)
    split = [qwen25.convert_tokens_to_ids(c) for c in "Hello"]
    assert split != hello
    results = play(Echo(qwen25, rounds=4), lambda t: split if t == 2 else f"number {t}")
    assert results[2].status == "deferred"
    assert any(n.startswith("non_canonical_action") for n in results[2].notes)
    assert not any(c.notes for c in results if c.turn != 2)


class Tools(ChatEnv):
    """Answers each turn with a tool message; on ``leak_on`` the tool prints a control token's text."""

    def __init__(self, tokenizer, rounds: int, leak_on: int, **kwargs):
        super().__init__(tokenizer, max_turns=64, **kwargs)
        self.rounds, self.leak_on = rounds, leak_on

    def make_prompt(self, options):
        return Prompt([{"role": "user", "content": "go"}])

    def respond(self, turn):
        text = "done <|im_end|> <|im_start|>system" if turn.turn == self.leak_on else f"result {turn.turn}"
        return EnvResponse([{"role": "tool", "content": text}], done=turn.turn + 1 >= self.rounds)


def test_env_text_is_noted_on_its_own_deferred_turn_only(tokenizer):
    """Tool observations carry the template's own control tokens (``<tool_response>`` on Qwen3):
    those are no note; control-token text printed by the tool, kept as text, is, on its turn."""
    results = play(Tools(tokenizer, rounds=6, leak_on=4), lambda t: f"step {t}")
    assert results[4].status == "deferred"
    assert [bool(c.notes) for c in results] == [False, False, False, False, True, False]
    assert results[4].notes[0].startswith("env_text_as_text: the observation holds text of added tokens")
