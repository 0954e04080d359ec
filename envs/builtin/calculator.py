"""``tokengym/Calculator-v0``: arithmetic word problems with a safe calculator tool.

Problems are generated from a seed (reproducible: :func:`word_problem`) at three difficulty
levels: 1 = one operation, 2 = two operations, 3 = three or more with larger numbers.
Every answer is a whole number.

**Answer format**: the final assistant turn must contain ``<answer>NUMBER</answer>``; the
last such tag counts. Reward 1.0 when the number equals the answer (``42``, ``42.0``,
``1,240`` read as numbers), else 0.0. A turn with a tool call is never the final one.

The ``calculate`` tool evaluates an arithmetic expression with a small AST interpreter over
exact fractions (no ``eval``): numbers, ``+ - * / // % **`` (``^`` also means power),
parentheses, and ``abs round min max sqrt floor ceil``, ``pi``, ``e``. Anything else is
refused with a message saying what is not supported; sizes are capped.

**Worked examples** (``few_shot=k``): ``k`` solved exchanges go before the question as earlier
turns of the conversation (question, a ``calculate`` call, its result, ``<answer>N</answer>``),
rendered by the chat template like any other turn. A model as small as SmolLM2-135M does not
call a tool from the schema alone; it does copy a pattern it has just seen twice. The examples
use names and items the generated problems never use, so no example is one of the problems.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from ..tool_env import ToolEnv, answer_reward
from ..function_tools import ToolError, tool

__all__ = ["FEW_SHOT_EXAMPLES", "CalculatorEnv", "calculate", "evaluate", "few_shot_messages", "word_problem"]

MAX_EXPRESSION_CHARS = 500
MAX_BITS = 4000  # numerator / denominator size of any intermediate value
MAX_EXPONENT = 1000

SYSTEM_PROMPT = (
    "Solve the math word problem. You may use the calculate tool for arithmetic. "
    "When you are done, reply with the final answer as a number in the form <answer>NUMBER</answer>."
)

FEW_SHOT_EXAMPLES: tuple[tuple[str, str, int], ...] = (
    ("Sam has 12 pears and gets 5 more. How many pears does Sam have now?", "12 + 5", 17),
    ("Tom had 40 coins and gave away 15. How many coins are left?", "40 - 15", 25),
    ("A bag holds 6 beads. How many beads are in 4 bags?", "6 * 4", 24),
)
"""(question, expression, answer) of the worked examples, in the order ``few_shot`` takes them."""
EXAMPLE_LEAD = "I will use the calculator."
"""The text before each example's call: a turn that opens with ``<`` is, to a small model, as
likely the ``<tool_response>`` the template puts at the start of result turns."""
_EXAMPLE_TURN = 1000  # call ids of the examples are made for turns no episode reaches


# ------------------------------------------------------------------ evaluator
def _check_size(x: Fraction) -> Fraction:
    if x.numerator.bit_length() > MAX_BITS or x.denominator.bit_length() > MAX_BITS:
        raise ToolError("the number is too large")
    return x


def _to_fraction(x: Any) -> Fraction:
    if isinstance(x, Fraction):
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            raise ToolError("the result is not a finite number")
        return Fraction(x)
    return Fraction(x)


def _pow(a: Fraction, b: Fraction) -> Fraction:
    if b.denominator == 1:
        if abs(b.numerator) > MAX_EXPONENT:
            raise ToolError(f"exponents above {MAX_EXPONENT} are not supported")
        if a == 0 and b < 0:
            raise ToolError("division by zero")
        bits = max(a.numerator.bit_length(), a.denominator.bit_length())
        if bits * abs(b.numerator) > MAX_BITS:
            raise ToolError("the number is too large")
        return a ** b.numerator
    if a < 0:
        raise ToolError("a negative number to a fractional power is not a real number")
    try:
        return _to_fraction(float(a) ** float(b))
    except OverflowError:
        raise ToolError("the number is too large") from None


def _div(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise ToolError("division by zero")
    return a / b


def _floordiv(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise ToolError("division by zero")
    return Fraction(a // b)


def _mod(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise ToolError("division by zero")
    return a % b


_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _div,
    ast.FloorDiv: _floordiv,
    ast.Mod: _mod,
    ast.Pow: _pow,
    ast.BitXor: _pow,  # people write 2^10
}


def _sqrt(x: Fraction) -> Fraction:
    if x < 0:
        raise ToolError("sqrt of a negative number")
    n, d = x.numerator, x.denominator
    rn, rd = math.isqrt(n), math.isqrt(d)
    if rn * rn == n and rd * rd == d:
        return Fraction(rn, rd)
    return _to_fraction(math.sqrt(float(x)))


def _round(x: Fraction, digits: Fraction = Fraction(0)) -> Fraction:
    if digits.denominator != 1 or not -20 <= digits <= 20:
        raise ToolError("round takes a whole number of digits between -20 and 20")
    return Fraction(round(x, int(digits)))


_FUNCTIONS: dict[str, Callable[..., Fraction]] = {
    "abs": lambda x: abs(x),
    "round": _round,
    "min": lambda *xs: min(xs),
    "max": lambda *xs: max(xs),
    "sqrt": _sqrt,
    "floor": lambda x: Fraction(math.floor(x)),
    "ceil": lambda x: Fraction(math.ceil(x)),
}
_CONSTANTS = {"pi": Fraction(math.pi), "e": Fraction(math.e)}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ToolError("the number is too large")
        return _check_size(Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _check_size(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise ToolError(f"{node.func.id}() takes no keyword arguments")
        args = [_eval(a) for a in node.args]
        try:
            return _check_size(_to_fraction(_FUNCTIONS[node.func.id](*args)))
        except TypeError:
            raise ToolError(f"wrong number of arguments for {node.func.id}()") from None
        except ValueError as err:
            raise ToolError(f"{node.func.id}(): {err}") from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        raise ToolError(f"unknown function {node.func.id!r}; the functions are {', '.join(_FUNCTIONS)}")
    if isinstance(node, ast.Name):
        raise ToolError(f"unknown name {node.id!r}; use numbers, operators and {', '.join(_FUNCTIONS)}")
    if isinstance(node, ast.Tuple):
        raise ToolError("a comma is not an operator: write numbers without thousands separators")
    raise ToolError(f"unsupported syntax ({type(node).__name__}); use numbers, + - * / // % ** and parentheses")


def format_number(x: Fraction) -> str:
    """An integer exactly, anything else as a decimal with 12 significant digits."""
    if x.denominator == 1:
        return str(x.numerator)
    try:
        return format(float(x), ".12g")
    except OverflowError:
        raise ToolError("the result is too large to write as a decimal") from None


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly; raises :class:`ToolError` with a clear reason."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse the expression ({err.msg})") from None
    except (RecursionError, MemoryError, ValueError):
        raise ToolError("the expression is nested too deeply") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise ToolError("the expression is nested too deeply") from None


@tool
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. "(12 + 7) * 3 / 4".

    Args:
        expression: numbers with + - * / // % ** and parentheses; abs, round, min, max, sqrt, floor, ceil
    """
    return format_number(evaluate(expression))


# ------------------------------------------------------------------ problems
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena", "Mia", "Noor")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "buttons")


def _level1(r: np.random.Generator) -> tuple[str, int, str]:
    name, items = str(r.choice(_NAMES)), str(r.choice(_ITEMS))
    kind = int(r.integers(4))
    if kind == 0:
        a, b = int(r.integers(5, 100)), int(r.integers(5, 100))
        return f"{name} has {a} {items} and gets {b} more. How many {items} does {name} have now?", a + b, f"{a} + {b}"
    if kind == 1:
        a = int(r.integers(20, 200))
        b = int(r.integers(1, a))
        return f"{name} had {a} {items} and gave away {b}. How many {items} are left?", a - b, f"{a} - {b}"
    if kind == 2:
        a, b = int(r.integers(3, 30)), int(r.integers(3, 30))
        return f"A box holds {a} {items}. How many {items} are in {b} boxes?", a * b, f"{a} * {b}"
    q, b = int(r.integers(2, 30)), int(r.integers(2, 12))
    return (
        f"{q * b} {items} are shared equally among {b} children. How many {items} does each child get?",
        q,
        f"{q * b} / {b}",
    )


def _level2(r: np.random.Generator) -> tuple[str, int, str]:
    name, items = str(r.choice(_NAMES)), str(r.choice(_ITEMS))
    kind = int(r.integers(4))
    if kind == 0:
        n, p = int(r.integers(2, 15)), int(r.integers(2, 20))
        note = int(next(x for x in (20, 50, 100, 200, 500) if x >= n * p))
        return (
            f"{name} buys {n} {items} at {p} dollars each and pays with a {note} dollar note. "
            f"How many dollars of change does {name} get?",
            note - n * p,
            f"{note} - {n} * {p}",
        )
    if kind == 1:
        a = int(r.integers(20, 60))
        b = int(r.integers(1, a))
        c = int(r.integers(1, 40))
        return (
            f"A bus has {a} passengers. At the first stop {b} get off and {c} get on. "
            "How many passengers are on the bus now?",
            a - b + c,
            f"{a} - {b} + {c}",
        )
    if kind == 2:
        p, d, q = int(r.integers(5, 40)), int(r.integers(2, 14)), int(r.integers(1, 40))
        return (
            f"{name} reads {p} pages a day for {d} days, then {q} more pages on the last evening. "
            f"How many pages did {name} read in total?",
            p * d + q,
            f"{p} * {d} + {q}",
        )
    rows, cols = int(r.integers(3, 25)), int(r.integers(3, 25))
    dead = int(r.integers(1, rows * cols))
    return (
        f"A farmer plants {rows} rows of {cols} plants each, and {dead} plants die. How many plants are left?",
        rows * cols - dead,
        f"{rows} * {cols} - {dead}",
    )


def _level3(r: np.random.Generator) -> tuple[str, int, str]:
    name = str(r.choice(_NAMES))
    kind = int(r.integers(3))
    if kind == 0:
        k = int(r.choice([12, 20, 24, 25, 50]))
        per_hour, hours, days = int(r.integers(20, 400)), int(r.integers(4, 12)), int(r.integers(3, 30))
        total = per_hour * hours * days
        return (
            f"A factory makes {per_hour} bolts per hour and runs {hours} hours a day for {days} days. "
            f"The bolts are packed in boxes of {k}. How many boxes can be filled completely?",
            total // k,
            f"({per_hour} * {hours} * {days}) // {k}",
        )
    if kind == 1:
        wage, hours, weeks = int(r.integers(12, 60)), int(r.integers(10, 45)), int(r.integers(2, 16))
        earned = wage * hours * weeks
        spent = int(r.integers(1, earned))
        return (
            f"{name} earns {wage} dollars per hour, works {hours} hours a week for {weeks} weeks "
            f"and spends {spent} dollars. How many dollars does {name} have left?",
            earned - spent,
            f"{wage} * {hours} * {weeks} - {spent}",
        )
    cap = int(r.integers(4, 60)) * 100
    pct = int(r.choice([10, 20, 25, 40, 50, 60, 75, 80]))
    full = cap * pct // 100
    used = int(r.integers(1, full))
    added = int(r.integers(1, cap - full + used + 1))
    return (
        f"A water tank holds {cap} liters and is {pct}% full. {used} liters are used, then {added} liters are "
        "added. How many liters are in the tank now?",
        full - used + added,
        f"{cap} * {pct} / 100 - {used} + {added}",
    )


_LEVELS = {1: _level1, 2: _level2, 3: _level3}
DIFFICULTIES = tuple(_LEVELS)


def word_problem(seed: int, difficulty: int = 1) -> dict[str, Any]:
    """The problem for ``seed`` at ``difficulty`` (1-3): ``{"id", "prompt", "answer", "difficulty", "expression"}``."""
    if difficulty not in _LEVELS:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    prompt, answer, expression = _LEVELS[difficulty](np.random.default_rng([int(seed), int(difficulty)]))
    return {
        "id": f"calculator-{difficulty}-{int(seed)}",
        "prompt": prompt,
        "answer": int(answer),
        "difficulty": int(difficulty),
        "expression": expression,
    }


def few_shot_messages(
    count: int,
    make_call_id: Callable[[int, int], str],
    examples: tuple[tuple[str, str, int], ...] = FEW_SHOT_EXAMPLES,
) -> list[dict[str, Any]]:
    """The first ``count`` worked ``examples`` (question, expression, answer) as chat messages
    (``make_call_id(turn, index)`` names their calls)."""
    if not 0 <= count <= len(examples):
        raise ValueError(f"few_shot must be between 0 and {len(examples)}, got {count!r}")
    messages: list[dict[str, Any]] = []
    for k, (question, expression, answer) in enumerate(examples[:count]):
        call_id = make_call_id(_EXAMPLE_TURN + k, 0)
        call = {"id": call_id, "type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": EXAMPLE_LEAD, "tool_calls": [call]},
            {"role": "tool", "content": calculate(expression), "tool_call_id": call_id, "name": "calculate"},
            {"role": "assistant", "content": f"<answer>{answer}</answer>"},
        ]
    return messages


class CalculatorEnv(ToolEnv):
    """Word problems and a ``calculate`` tool; reward 1 for ``<answer>N</answer>`` with the right N.

    Args:
        tokenizer: as for :class:`~tokengym.envs.ChatEnv`.
        difficulty: 1, 2 or 3; ``reset(options={"difficulty": k})`` overrides it per episode,
            ``reset(options={"problem_seed": s})`` picks a problem.
        few_shot: how many worked examples (0 to 3, :data:`FEW_SHOT_EXAMPLES`) precede the
            question, after the system prompt.
        **kwargs: as for :class:`~tokengym.envs.ToolEnv` (``max_turns`` defaults to 6).
    """
    step_waits = False  # the calculator is arithmetic in this process

    reset_options = frozenset({"task", "index", "difficulty", "problem_seed"})

    def __init__(self, tokenizer: Any, difficulty: int = 1, few_shot: int = 0, **kwargs: Any) -> None:
        if difficulty not in _LEVELS:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
        if not 0 <= few_shot <= len(FEW_SHOT_EXAMPLES):
            raise ValueError(f"few_shot must be between 0 and {len(FEW_SHOT_EXAMPLES)}, got {few_shot!r}")
        kwargs.setdefault("max_turns", 6)
        kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
        kwargs.setdefault("reward_fn", answer_reward)
        super().__init__(tokenizer, tools=[calculate], **kwargs)
        self.difficulty = difficulty
        self.few_shot = few_shot

    def sample_task(self, options: dict[str, Any]) -> dict[str, Any]:
        if "task" in options:
            return super().sample_task(options)
        difficulty = int(options.get("difficulty", self.difficulty))
        seed = int(options["problem_seed"]) if "problem_seed" in options else int(self.np_random.integers(2**31))
        return word_problem(seed, difficulty)

    def task_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        messages = super().task_messages(task)
        if not self.few_shot:
            return messages
        at = 1 if messages and messages[0].get("role") == "system" else 0
        return [*messages[:at], *few_shot_messages(self.few_shot, self.parser.make_call_id), *messages[at:]]
