"""``tokengym/ToolAddition-v0``: add two 3-digit numbers by calling a calculator, in two turns.

The smallest multi-turn tool task: turn 1 calls ``calculate("A + B")``, the environment runs
it, turn 2 answers ``<answer>N</answer>`` with the result. Its point is RL on a multi-turn
episode (policy tokens in two turns, the tool result between them masked out) with a model as
small as SmolLM2-135M: the numbers are large enough that such a model rarely adds them right
in its head, and the call is a pattern it can copy from the worked examples before the
question (as ``tokengym/Calculator-v0``'s ``few_shot`` gives them), so a group of samples
usually holds both episodes that used the tool well and episodes that did not.

**The prompt**: a system prompt asking for the call and then the answer, ``few_shot`` worked
examples (default 2: a question, the call, its result, the answer; their numbers are never
asked), then ``What is A + B?`` with A and B drawn with the env's ``np_random`` from the
reset seed (so the episodes of a GRPO group get the same question).

**The reward**, per turn:

* 1.0 on the turn of the episode's first *valid* ``calculate`` call (it parsed and ran,
  whatever its expression);
* 1.0 on the final turn when it answers ``<answer>A+B</answer>`` (a whole number in the last
  tag, as ``tokengym/Addition-v0`` reads it).

So 0, 1 or 2 per episode: a right answer without the tool scores 1, as does a valid call
followed by a wrong answer. ``max_turns`` is 2: a second call instead of the answer ends the
episode (truncated, ``max_turns``) unanswered.

The last step's ``info["grade"]`` (copied into the recorded trajectory's ``metadata["grade"]``)
holds booleans for :func:`~tokengym.recorder.learning.grade_metrics`: ``called`` (any call was
attempted, even one that could not run), ``call_valid`` (a ``calculate`` call ran),
``call_right`` (a call returned A+B), ``format_ok`` and ``correct`` (of the final answer), and
``answer`` (the number read, or None).
"""

from __future__ import annotations

from typing import Any

from ..chat import AssistantTurn, EnvResponse, Prompt
from ..tool_env import CallRecord, ToolEnv, strip_reasoning
from .addition import grade_addition
from .calculator import calculate, few_shot_messages

__all__ = ["TOOL_ADDITION_EXAMPLES", "ToolAdditionEnv"]

SYSTEM_PROMPT = (
    "You add two numbers with the calculate tool. First call calculate with the sum, "
    "then reply with its result as <answer>N</answer>."
)
TOOL_ADDITION_EXAMPLES: tuple[tuple[str, str, int], ...] = (
    ("What is 312 + 145?", "312 + 145", 457),
    ("What is 268 + 531?", "268 + 531", 799),
    ("What is 604 + 287?", "604 + 287", 891),
)
"""(question, expression, answer) of the worked examples, in the order ``few_shot`` takes them;
their number pairs are never asked (:meth:`ToolAdditionEnv.sample_task` draws again)."""
_EXAMPLE_PAIRS = {(int(e.split(" + ")[0]), int(e.split(" + ")[1])) for _, e, _ in TOOL_ADDITION_EXAMPLES}
CALL_REWARD = 1.0
ANSWER_REWARD = 1.0


class ToolAdditionEnv(ToolEnv):
    """Two turns: call ``calculate`` with ``A + B``, then answer with its result.

    Args:
        tokenizer: as for :class:`~tokengym.envs.ChatEnv` (its template must render tool calls
            and results: for SmolLM2 pass ``chat_template=CHATML_TOOLS``).
        low, high: the range of both numbers, inclusive (default 100..999).
            ``reset(options={"a": 5, "b": 9})`` asks a given question instead.
        few_shot: how many worked examples (0 to 3, :data:`TOOL_ADDITION_EXAMPLES`) precede the
            question, after the system prompt.
        schema_in_prompt: False leaves the tool's JSON schema (and the template's paragraph
            around it) out of the prompt: the worked examples show the call, and the prompt is
            about half as long, which halves the cost of a CPU run (prefill and training both
            scale with it). Calls are parsed and checked against the schema either way.
        **kwargs: as for :class:`~tokengym.envs.ToolEnv` (``max_turns`` defaults to 2).
    """
    step_waits = False  # its tool adds two numbers in this process

    reset_options = frozenset({"a", "b", "task", "index"})

    def __init__(
        self,
        tokenizer: Any,
        low: int = 100,
        high: int = 999,
        few_shot: int = 2,
        *,
        schema_in_prompt: bool = True,
        **kwargs: Any,
    ) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")
        if not 0 <= few_shot <= len(TOOL_ADDITION_EXAMPLES):
            raise ValueError(f"few_shot must be between 0 and {len(TOOL_ADDITION_EXAMPLES)}, got {few_shot!r}")
        if (high - low + 1) ** 2 <= len(_EXAMPLE_PAIRS):
            raise ValueError(f"the range {low}..{high} holds too few questions besides the worked examples")
        kwargs.setdefault("max_turns", 2)
        kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
        super().__init__(tokenizer, tools=[calculate], **kwargs)
        self.low, self.high, self.few_shot = low, high, few_shot
        self.schema_in_prompt = schema_in_prompt
        self._grade: dict[str, Any] = {}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        self._grade = {"called": False, "call_valid": False, "call_right": False}
        return super().reset(seed=seed, options=options)

    def sample_task(self, options: dict[str, Any]) -> dict[str, Any]:
        if ("a" in options) != ("b" in options):
            raise ValueError("pass both 'a' and 'b' in the reset options, or neither")
        if "a" in options:
            a, b = int(options["a"]), int(options["b"])
        else:
            a, b = self._draw()
            while (a, b) in _EXAMPLE_PAIRS:  # a worked example is never the question
                a, b = self._draw()
        return {"id": f"tool-addition-{a}+{b}", "prompt": f"What is {a} + {b}?", "a": a, "b": b, "answer": a + b}

    def _draw(self) -> tuple[int, int]:
        a, b = self.np_random.integers(self.low, self.high + 1, size=2)
        return int(a), int(b)

    def make_prompt(self, options: dict[str, Any]) -> Prompt:
        prompt = super().make_prompt(options)
        return prompt if self.schema_in_prompt else Prompt(prompt.messages, None, prompt.task)

    def task_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        messages = super().task_messages(task)
        at = 1 if messages and messages[0].get("role") == "system" else 0
        examples = few_shot_messages(self.few_shot, self.parser.make_call_id, TOOL_ADDITION_EXAMPLES)
        return [*messages[:at], *examples, *messages[at:]]

    def final_reward(self, completion: str, task: dict[str, Any]) -> float:
        return ANSWER_REWARD * float(grade_addition(completion, int(task["answer"]))["correct"])

    def turn_reward(self, records: list[CallRecord], task: dict[str, Any]) -> float:
        """:data:`CALL_REWARD` on the turn of the episode's first valid ``calculate`` call."""
        first_valid = not self._grade["call_valid"]
        for r in records:
            self._grade["called"] = True
            if r.status == "ok" and r.name == calculate.name:
                self._grade["call_valid"] = True
                self._grade["call_right"] |= r.content.strip() == str(task["answer"])
        return CALL_REWARD if first_valid and self._grade["call_valid"] else 0.0

    def respond(self, turn: AssistantTurn) -> EnvResponse:
        response = super().respond(turn)
        if response.done or response.stop_reason or turn.turn + 1 >= self.max_turns:  # the episode's last step
            if response.done:
                answer = grade_addition(strip_reasoning(turn.text, *self.think_tags), int(self._task["answer"]))
            else:  # it ended on a call (or a run of invalid ones): no answer
                answer = {"format_ok": False, "correct": False, "answer": None}
            response.info["grade"] = {**self._grade, **answer}
        return response
