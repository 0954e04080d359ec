"""``tokengym/KeyValue-v0``: follow pointers through a key-value store, then write the result back.

Each episode gets its own :class:`KeyValueStore` (a fresh object made at reset; nothing is
shared between episodes or between env instances), preloaded with the task's records: a
chain of ``"next: <key>"`` values that ends in ``"final: <secret>"``, among distractors. The
assistant reads keys with ``get`` (one hop per call, so the task needs several calls across
turns), stores the secret under the key ``"answer"`` with ``set``, and replies
``<answer>SECRET</answer>``.

Difficulty: 1 = the start key holds the secret, 2 = a chain of three keys, 3 = a chain of
six keys and more distractors. Reward 1.0 when the final answer is the secret **and** the store holds it
under ``"answer"`` (the state the tools left behind is part of the score), else 0.0.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..tool_env import ToolEnv, extract_answer
from ..function_tools import ToolError, tool, tools_of

__all__ = ["KeyValueEnv", "KeyValueStore", "pointer_task"]

_WORDS = ("amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp", "lumen")
_HOPS = {1: 1, 2: 3, 3: 6}  # keys in the chain, the start key included
_DISTRACTORS = {1: 4, 2: 8, 3: 16}
MAX_LISTED_KEYS = 100


class KeyValueStore:
    """One episode's store. Its tools run in call order (``parallel=False``): a ``set`` and a
    ``get`` of the same key in one turn behave as written."""

    def __init__(self, records: dict[str, str] | None = None) -> None:
        self.data: dict[str, str] = dict(records or {})

    @tool(parallel=False)
    def get(self, key: str) -> str:
        """Read the value stored under a key.

        Args:
            key: the key to read
        """
        if key not in self.data:
            raise ToolError(f'no key "{key}"')
        return self.data[key]

    @tool(parallel=False)
    def set(self, key: str, value: str) -> str:
        """Store a value under a key, replacing any previous value.

        Args:
            key: the key to write
            value: the value to store
        """
        self.data[key] = value
        return f'stored "{key}"'

    @tool(parallel=False)
    def list_keys(self, prefix: str = "") -> str:
        """List the stored keys that start with a prefix (at most 100).

        Args:
            prefix: only keys starting with this; all keys when empty
        """
        keys = sorted(k for k in self.data if k.startswith(prefix))
        return json.dumps(keys[:MAX_LISTED_KEYS])


def pointer_task(seed: int, difficulty: int = 1) -> dict[str, Any]:
    """The task for ``seed`` at ``difficulty`` (1-3): ``{"id", "prompt", "answer", "start", "records", "difficulty"}``."""
    if difficulty not in _HOPS:
        raise ValueError(f"difficulty must be one of {tuple(_HOPS)}, got {difficulty!r}")
    r = np.random.default_rng([int(seed), int(difficulty), 7])
    hops, n_distract = _HOPS[difficulty], _DISTRACTORS[difficulty]
    keys: list[str] = []
    while len(keys) < hops + n_distract:
        k = f"k-{int(r.integers(16**4)):04x}"
        if k not in keys:
            keys.append(k)
    chain, others = keys[:hops], keys[hops:]

    def secret() -> str:
        return f"{r.choice(_WORDS)}-{int(r.integers(100, 1000))}"

    answer = secret()
    records = {k: f"next: {chain[i + 1]}" for i, k in enumerate(chain[:-1])}
    records[chain[-1]] = f"final: {answer}"
    for i, k in enumerate(others):
        records[k] = f"next: {others[i + 1]}" if i + 1 < len(others) and r.random() < 0.5 else f"final: {secret()}"
    order = list(records)
    r.shuffle(order)
    prompt = (
        f'A key-value store holds records. Start by reading the key "{chain[0]}". A value "next: <key>" '
        'points to the key to read next; follow the pointers until you reach a value "final: <secret>". '
        'Then store the secret under the key "answer" with the set tool, and reply with <answer>SECRET</answer>.'
    )
    return {
        "id": f"keyvalue-{difficulty}-{int(seed)}",
        "prompt": prompt,
        "answer": answer,
        "start": chain[0],
        "records": {k: records[k] for k in order},
        "difficulty": int(difficulty),
    }


class KeyValueEnv(ToolEnv):
    """Pointer chasing in a per-episode key-value store (tools ``get``, ``set``, ``list_keys``).

    Args:
        tokenizer: as for :class:`~tokengym.envs.ChatEnv`.
        difficulty: 1, 2 or 3; ``reset(options={"difficulty": k, "problem_seed": s})`` overrides.
        **kwargs: as for :class:`~tokengym.envs.ToolEnv` (``max_turns`` defaults to 12).

    :attr:`store` is the current episode's store.
    """
    step_waits = False  # its store is a dict in this process

    reset_options = frozenset({"task", "index", "difficulty", "problem_seed"})

    def __init__(self, tokenizer: Any, difficulty: int = 1, **kwargs: Any) -> None:
        if difficulty not in _HOPS:
            raise ValueError(f"difficulty must be one of {tuple(_HOPS)}, got {difficulty!r}")
        kwargs.setdefault("max_turns", 12)
        super().__init__(tokenizer, **kwargs)
        self.difficulty = difficulty
        self.store = KeyValueStore()

    def sample_task(self, options: dict[str, Any]) -> dict[str, Any]:
        if "task" in options:
            return super().sample_task(options)
        difficulty = int(options.get("difficulty", self.difficulty))
        seed = int(options["problem_seed"]) if "problem_seed" in options else int(self.np_random.integers(2**31))
        return pointer_task(seed, difficulty)

    def episode_tools(self, task: dict[str, Any]) -> list[Any]:
        self.store = KeyValueStore(task.get("records"))
        return [*super().episode_tools(task), *tools_of(self.store)]

    def final_reward(self, completion: str, task: dict[str, Any]) -> float:
        if self.reward_fn is not None:
            return super().final_reward(completion, task)
        want = task.get("answer")
        return float(extract_answer(completion) == want and self.store.data.get("answer") == want)
