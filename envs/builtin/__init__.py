"""Built-in tool environments: ``tokengym/Calculator-v0`` and ``tokengym/KeyValue-v0``."""

from .calculator import CalculatorEnv, calculate, evaluate, word_problem
from .keyvalue import KeyValueEnv, KeyValueStore, pointer_task

__all__ = [
    "CalculatorEnv",
    "KeyValueEnv",
    "KeyValueStore",
    "calculate",
    "evaluate",
    "pointer_task",
    "word_problem",
]
