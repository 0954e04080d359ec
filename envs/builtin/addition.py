"""``tokengym/Addition-v0``: add two small numbers, in one turn, answering ``<answer>N</answer>``.

A task a 135M-parameter chat model solves sometimes, not always and not never: the shape of
task on which a small policy visibly learns from its own reward in minutes on a CPU (the
``learn`` notebook). ``tokengym/Calculator-v0``'s word problems score such a model 0, and
a group of equal rewards has nothing to learn from.

**The prompt**: a system prompt stating the format, one worked example exchange (a user
question and the assistant's ``<answer>7</answer>``), then the question ``What is A + B?``.
A and B are drawn with the env's ``np_random`` from the reset seed, so the episodes of a
GRPO group (one reset seed) get the same question.

**The reward** (one turn, the episode then ends):

* 1.0 for a well-formed answer: the reply holds an ``<answer>...</answer>`` tag and the
  last one holds a whole number (``<answer> 12 </answer>`` is fine; ``<answer>twelve</answer>``,
  ``<answer>12.5</answer>`` or no tag are not);
* plus 1.0 when that number is A + B.

So 0.0 (malformed), 1.0 (well-formed, wrong) or 2.0 (right). The step's ``info["grade"]``
(``format_ok``, ``correct``, ``answer``: the number read, or None) is copied into the
recorded trajectory's ``metadata["grade"]``, so format and correctness rates can be plotted
apart from the reward.
"""

from __future__ import annotations

import re
from typing import Any

from ..chat import AssistantTurn, ChatEnv, EnvResponse, Prompt
from ..tool_env import extract_answer

__all__ = ["AdditionEnv", "grade_addition"]

SYSTEM_PROMPT = "You add two numbers. Reply with the sum only, written as <answer>N</answer>."
EXAMPLE_QUESTION = "What is 3 + 4?"
EXAMPLE_ANSWER = "<answer>7</answer>"

_WHOLE_NUMBER = re.compile(r"[+-]?\d+")


def grade_addition(reply: str, expected: int) -> dict[str, Any]:
    """``{"format_ok", "correct", "answer"}`` of an assistant reply (see the module docstring)."""
    found = extract_answer(reply)
    number = int(found) if found is not None and _WHOLE_NUMBER.fullmatch(found) else None
    return {"format_ok": number is not None, "correct": number is not None and number == expected, "answer": number}


class AdditionEnv(ChatEnv):
    """One-turn addition of two numbers in ``[low, high]``; reward 1 for the format + 1 if right.

    Args:
        tokenizer: as for :class:`~tokengym.envs.ChatEnv`.
        low, high: the range of both numbers, inclusive. ``reset(options={"a": 5, "b": 9})``
            asks a given question instead.
        **kwargs: as for :class:`~tokengym.envs.ChatEnv` (``max_turns`` is 1).
    """
    step_waits = False  # nothing but computation

    reset_options = frozenset({"a", "b"})

    def __init__(self, tokenizer: Any, low: int = 0, high: int = 20, **kwargs: Any) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
        if kwargs.pop("max_turns", 1) != 1:
            raise ValueError("AdditionEnv is a one-turn env: max_turns must be 1")
        super().__init__(tokenizer, max_turns=1, **kwargs)
        self.low, self.high = low, high

    def make_prompt(self, options: dict[str, Any]) -> Prompt:
        if ("a" in options) != ("b" in options):
            raise ValueError("pass both 'a' and 'b' in the reset options, or neither")
        if "a" in options:
            a, b = int(options["a"]), int(options["b"])
        else:
            a, b = (int(x) for x in self.np_random.integers(self.low, self.high + 1, size=2))
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": EXAMPLE_QUESTION},
            {"role": "assistant", "content": EXAMPLE_ANSWER},
            {"role": "user", "content": f"What is {a} + {b}?"},
        ]
        return Prompt(messages, task={"id": f"addition-{a}+{b}", "a": a, "b": b, "answer": a + b})

    def respond(self, turn: AssistantTurn) -> EnvResponse:
        grade = grade_addition(turn.text, int(self._prompt.task["answer"]))
        reward = float(grade["format_ok"]) + float(grade["correct"])
        return EnvResponse(reward=reward, done=True, info={"grade": grade})
