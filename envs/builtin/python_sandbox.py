"""``tokengym/PythonSandbox-v0``: write a Python function; hidden unit tests run in the sandbox.

Each episode draws a coding task (seeded: ``reset(seed=...)``, or ``options={"index": i}`` /
``{"task_id": "coding-fizzbuzz"}``) from a small set shipped in the package
(``envs/data/coding_tasks.jsonl``: a signature, a description, two visible examples and hidden
tests). The model gets the episode's sandbox through ``run_python``, ``run_shell``,
``write_file`` and ``read_file``, and answers with its final code in a ```python block (or
leaves it in ``solution.py`` in the workspace).

The reward runs in the same sandbox, after the model's last call (nothing of the model's is
running any more): the solution and the test *inputs* go to a fresh directory, a fixed grader
runs under ``python3 -I`` (so nothing the model planted in the workspace is imported), calls
the function on every input with a per-case time limit, and writes what came back as JSON.
The expected outputs never enter the sandbox: the host compares, with exact types (``True``
is not ``1``, an object whose ``__eq__`` always says yes is not a list). Reward 1.0 when every
case passes (``reward="fraction"``: the share that pass); ``info["grade"]`` on the final step
says which failed and why.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any, Literal

from ..sandbox.base import Sandbox, SandboxError
from ..sandbox.env import SandboxToolEnv
from ..chat import EnvResponse

__all__ = ["Grade", "PythonSandboxEnv", "coding_prompt", "coding_tasks", "extract_code", "grade_solution"]

SOLUTION_FILE = "solution.py"
MAX_RESULT_BYTES = 4 * 1024 * 1024
MODEL_OUTPUT_ERRORS = (RecursionError, ValueError, OverflowError, MemoryError, TypeError)
"""What parsing or comparing what the model's code produced may raise (``'[' * 100000`` in the
results file, a huge integer...): such a case fails with the reason, the reward goes on."""

GRADER = r"""
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import json, os, signal

os.chdir(sys.argv[1])
spec = json.load(open("cases.json"))
out = open("results.jsonl", "w")


def enc(v, depth=0):
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if v == v and v not in (float("inf"), float("-inf")) else {"__float__": repr(v)}
    if depth < 50 and t in (list, tuple):
        return [enc(x, depth + 1) for x in v]
    if depth < 50 and t is dict and all(type(k) is str for k in v):
        return {k: enc(x, depth + 1) for k, x in v.items()}
    return {"__unencodable__": t.__name__, "repr": repr(v)[:200]}


def emit(rec):
    try:
        line = json.dumps(rec)
    except Exception as e:
        line = json.dumps({"i": rec.get("i"), "error": "result not serializable: " + type(e).__name__})
    out.write(line + "\n")
    out.flush()


def alarm(*_):
    raise TimeoutError("the case took longer than %g s" % spec["case_timeout_s"])


signal.signal(signal.SIGALRM, alarm)
try:
    ns = {"__name__": "solution"}
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
    fn = ns[spec["entry_point"]]
except BaseException as e:
    emit({"load_error": (type(e).__name__ + ": " + str(e))[:300]})
    sys.exit(0)
for i, args in enumerate(spec["cases"]):
    signal.setitimer(signal.ITIMER_REAL, spec["case_timeout_s"])
    try:
        rec = {"i": i, "value": enc(fn(*args))}
    except BaseException as e:
        rec = {"i": i, "error": (type(e).__name__ + ": " + str(e))[:300]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    emit(rec)
"""


# ------------------------------------------------------------------ tasks
@functools.lru_cache(maxsize=1)
def _load_tasks() -> tuple[str, ...]:
    text = resources.files("tokengym.envs").joinpath("data/coding_tasks.jsonl").read_text(encoding="utf-8")
    return tuple(line for line in text.splitlines() if line.strip())


def coding_tasks() -> list[dict[str, Any]]:
    """The shipped coding tasks (fresh copies), each with its ``prompt``."""
    tasks = [json.loads(line) for line in _load_tasks()]
    for t in tasks:
        t["prompt"] = coding_prompt(t)
    return tasks


def _call_text(entry: str, args: list[Any]) -> str:
    return f"{entry}({', '.join(repr(a) for a in args)})"


def coding_prompt(task: dict[str, Any]) -> str:
    """The user's message for a coding task: signature, description, examples, how to answer."""
    entry = task["entry_point"]
    examples = "\n".join(f"    {_call_text(entry, e['args'])} == {e['expected']!r}" for e in task.get("examples", ()))
    parts = [
        f"Write a Python function\n\n```python\n{task['signature']}:\n```\n\n{task['description']}",
    ]
    if examples:
        parts.append(f"Examples:\n\n{examples}")
    parts.append(
        "You can run Python code and shell commands in a sandbox with the tools (files you write there persist "
        "during this task). When you are done, reply without a tool call, giving the complete code of the "
        "function in one ```python code block. It will be run against hidden tests."
    )
    return "\n\n".join(parts)


def extract_code(text: str) -> str | None:
    """The last fenced code block of ``text`` (```python preferred over a bare ```), or ``None``."""
    blocks = re.findall(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", text, flags=re.S)
    if not blocks:
        return None
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]


# ----------------------------------------------------------------- grading
@dataclass
class Grade:
    """The outcome of running a task's tests on a solution."""

    passed: int
    total: int
    failures: list[str] = field(default_factory=list)
    """One line per failed case (at most 10): the call and what went wrong."""
    error: str = ""
    """Why nothing could be tested (no code, the code did not load, the grader failed)."""

    @property
    def all_passed(self) -> bool:
        """True when every hidden test passed."""
        return self.total > 0 and self.passed == self.total

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form, as stored in the step's ``info`` and the trajectory metadata."""
        return {**asdict(self), "all_passed": self.all_passed}


def _same(got: Any, want: Any) -> bool:
    """Equal, with exact JSON types: bool is not int; an int matches a float by value."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, float) or (isinstance(want, int) and isinstance(got, float)):
        return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(want, int):
        return type(got) is int and got == want
    if isinstance(want, str) or want is None:
        return type(got) is type(want) and got == want
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and set(got) == set(want)
            and all(_same(got[k], w) for k, w in want.items())
        )
    return False


def grade_solution(
    sandbox: Sandbox,
    code: str | None,
    task: dict[str, Any],
    *,
    timeout_s: float = 30.0,
    case_timeout_s: float = 2.0,
) -> Grade:
    """Run ``task``'s examples and hidden tests on ``code`` inside ``sandbox``; compare on the host."""
    cases = [*task.get("examples", ()), *task.get("tests", ())]
    total = len(cases)
    if not code or not code.strip():
        return Grade(0, total, error="no code to test")
    where = f".grade-{secrets.token_hex(6)}"
    try:
        sandbox.write_file(f"{where}/solution.py", code)
        spec = {"entry_point": task["entry_point"], "cases": [c["args"] for c in cases], "case_timeout_s": case_timeout_s}
        sandbox.write_file(f"{where}/cases.json", json.dumps(spec))
        run = sandbox.run(["python3", "-I", "-c", GRADER, where], timeout_s=timeout_s)
        try:
            raw = sandbox.read_file(f"{where}/results.jsonl", max_bytes=MAX_RESULT_BYTES)
        except SandboxError:
            raw = b""
    except SandboxError as err:
        return Grade(0, total, error=f"the sandbox refused the grader: {err}")
    results: dict[int, dict[str, Any]] = {}
    unreadable = 0
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except MODEL_OUTPUT_ERRORS:
            unreadable += 1
            continue
        if not isinstance(rec, dict):
            continue
        if "load_error" in rec:
            return Grade(0, total, error=f"the code did not load: {rec['load_error']}")
        if isinstance(rec.get("i"), int):
            results.setdefault(rec["i"], rec)
    passed = 0
    failures: list[str] = []
    for i, case in enumerate(cases):
        rec = results.get(i)
        call = _call_text(task["entry_point"], case["args"])
        if rec is None:
            problem = f"not run ({run.message or 'no result'})"
        elif "error" in rec:
            problem = f"raised {str(rec['error'])[:300]}"
        else:
            try:
                if _same(rec.get("value"), case["expected"]):
                    passed += 1
                    continue
                problem = f"returned {json.dumps(rec.get('value'))[:200]}, expected {json.dumps(case['expected'])[:200]}"
            except MODEL_OUTPUT_ERRORS as err:
                problem = f"returned a value that cannot be compared ({type(err).__name__})"
        if len(failures) < 10:
            failures.append(f"{call[:200]}: {problem}")
    error = "" if results or run.ok else f"the grader did not finish: {run.message or run.stderr[-300:]}"
    if not results and unreadable:
        error = f"the results could not be read ({unreadable} line(s) of invalid or too deeply nested JSON)"
    return Grade(passed, total, failures, error)


# --------------------------------------------------------------------- env
class PythonSandboxEnv(SandboxToolEnv):
    """Coding tasks with a sandbox: the model may run code; the reward runs hidden tests in the sandbox.

    Args:
        tokenizer: as for :class:`~tokengym.envs.ChatEnv`.
        tasks: coding tasks (default: the shipped set, :func:`coding_tasks`); each has
            ``entry_point``, ``signature``, ``description``, ``examples`` and ``tests`` (lists of
            ``{"args": [...], "expected": ...}``).
        reward: ``"all"`` (1.0 when every case passes, else 0.0) or ``"fraction"``.
        grade_timeout_s: the grader's wall-clock limit; ``case_timeout_s``: each case's.
        sandbox, sandbox_kwargs, sandbox_factory, sandbox_tools: see
            :class:`~tokengym.envs.sandbox.SandboxToolEnv` (``sandbox="docker"`` for containers).
        **kwargs: as for :class:`~tokengym.envs.ToolEnv` (``max_turns`` defaults to 10).
    """

    reset_options = frozenset({"task", "index", "task_id"})

    def __init__(
        self,
        tokenizer: Any,
        tasks: list[dict[str, Any]] | None = None,
        *,
        reward: Literal["all", "fraction"] = "all",
        grade_timeout_s: float = 30.0,
        case_timeout_s: float = 2.0,
        **kwargs: Any,
    ) -> None:
        if reward not in ("all", "fraction"):
            raise ValueError(f'reward must be "all" or "fraction", got {reward!r}')
        kwargs.setdefault("max_turns", 10)
        super().__init__(tokenizer, tasks if tasks is not None else coding_tasks(), **kwargs)
        self.reward_mode = reward
        self.grade_timeout_s = grade_timeout_s
        self.case_timeout_s = case_timeout_s
        self.last_grade: Grade | None = None

    def sample_task(self, options: dict[str, Any]) -> dict[str, Any]:
        if "task_id" in options:
            found = [t for t in self.tasks if t.get("id") == options["task_id"]]  # type: ignore[union-attr]
            if not found:
                raise ValueError(f"no task with id {options['task_id']!r}")
            options = {**options, "task": found[0]}
        task = super().sample_task(options)
        if "prompt" not in task and "messages" not in task:
            task["prompt"] = coding_prompt(task)
        return task

    def final_reward(self, completion: str, task: dict[str, Any]) -> float:
        if self.reward_fn is not None:
            return super().final_reward(completion, task)
        sb = self.sandbox
        if sb is None or sb.closed:
            self.last_grade = Grade(0, 0, error="no sandbox")
            return 0.0
        code = extract_code(completion)
        if code is None:
            try:
                code = sb.read_file(SOLUTION_FILE).decode("utf-8", "replace")
            except SandboxError:
                code = None
        grade = grade_solution(sb, code, task, timeout_s=self.grade_timeout_s, case_timeout_s=self.case_timeout_s)
        self.last_grade = grade
        if self.reward_mode == "fraction":
            return grade.passed / grade.total if grade.total else 0.0
        return float(grade.all_passed)

    def respond(self, turn: Any) -> EnvResponse:
        self.last_grade = None
        response = super().respond(turn)
        if response.done and self.last_grade is not None:
            response.info["grade"] = self.last_grade.as_dict()
        return response
