"""Built-in environments: ``tokengym/Addition-v0`` (one turn, no tools), the tool environments
``tokengym/Calculator-v0``, ``tokengym/ToolAddition-v0`` (two turns) and ``tokengym/KeyValue-v0``, and the sandbox
environments ``tokengym/PythonSandbox-v0`` and ``tokengym/Shell-v0``."""

from .addition import AdditionEnv, grade_addition
from .calculator import CalculatorEnv, calculate, evaluate, word_problem
from .keyvalue import KeyValueEnv, KeyValueStore, pointer_task
from .python_sandbox import Grade, PythonSandboxEnv, coding_prompt, coding_tasks, extract_code, grade_solution
from .shell import SHELL_KINDS, ShellEnv, check_in_sandbox, shell_task
from .tool_addition import ToolAdditionEnv

__all__ = [
    "SHELL_KINDS",
    "AdditionEnv",
    "CalculatorEnv",
    "Grade",
    "KeyValueEnv",
    "KeyValueStore",
    "PythonSandboxEnv",
    "ShellEnv",
    "ToolAdditionEnv",
    "calculate",
    "check_in_sandbox",
    "coding_prompt",
    "coding_tasks",
    "evaluate",
    "extract_code",
    "grade_addition",
    "grade_solution",
    "pointer_task",
    "shell_task",
    "word_problem",
]
