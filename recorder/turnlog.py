"""A line per assistant turn while a run goes on, and the tool-call count of a finished run.

A run's progress bar moves when an episode ends; the first episodes of a small model on a
CPU take a while, and the bar alone does not show that anything happens meanwhile, nor what
the loop is (generate, call a tool, read the result, answer). :class:`TurnLog` writes what
each turn did as it happens, above the bar: ``tokengym demo`` wraps its envs in it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import gymnasium as gym
import numpy as np

from .trajectory import Trajectory
from .views import add_tool_stats

__all__ = ["TurnLog", "describe_turn", "tool_call_counts"]

_SHOWN_CHARS = 60


def _short(text: str, limit: int = _SHOWN_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _call_text(record: dict[str, Any]) -> str:
    status = record.get("status")
    if record.get("name") and record.get("arguments") is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in record["arguments"].items())
        head = f"{record['name']}({_short(args)})"
    else:
        head = "a call"
    if status == "ok":
        return f"{head} -> {_short(record.get('content', ''))}"
    return f"{head} {status}: {_short(record.get('content', ''))}"


def describe_turn(seed: int | None, info: dict[str, Any], tokens: int, answer: str | None) -> str:
    """One line for one step's ``info``: the episode's seed, the turn, the tokens the policy
    generated and what the env made of them (each tool call and its result, or the scored
    answer, or why the episode stopped). ``answer`` is the final turn's ``<answer>`` content."""
    turn = info.get("turn", "?")
    head = f"seed {seed} turn {turn}: {tokens} tokens, "
    results = info.get("tool_results") or []
    if results:
        body = "; ".join(_call_text(r) for r in results)
    elif "final_reward" in info:
        shown = "no <answer> tag" if answer is None else f"<answer>{_short(answer, 20)}</answer>"
        body = f"final answer {shown}, reward {info['final_reward']:g}"
    else:
        body = "no tool call"
    stop = info.get("stop_reason")
    if stop and "final_reward" not in info:
        body += f" (episode stopped: {stop})"
    return head + body


class TurnLog(gym.Wrapper):
    """Writes :func:`describe_turn` for every step of the wrapped tokengym env.

    Args:
        env: a tokengym chat env (its ``unwrapped.renderer`` decodes the final answer).
        write: where a line goes; ``tqdm.write`` by default, so that lines land above a
            running progress bar instead of through it.
    """

    def __init__(self, env: gym.Env, write: Callable[[str], None] | None = None) -> None:
        super().__init__(env)
        if write is None:
            from tqdm.auto import tqdm

            write = tqdm.write
        self.write = write
        self._seed: int | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        self._seed = seed
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        answer = None
        if "final_reward" in info:
            from tokengym.envs import extract_answer

            answer = extract_answer(self.env.unwrapped.renderer.decode(np.asarray(action).tolist()))
        self.write(describe_turn(self._seed, info, len(action), answer))
        return obs, reward, terminated, truncated, info


def tool_call_counts(trajectories: Iterable[Trajectory]) -> dict[str, int]:
    """The tool calls of a run, from each trajectory's ``metadata["tool_stats"]``: ``calls``
    (attempts), ``valid`` (parsed and run: ``ok``, ``error``, ``timeout``), ``ok`` (returned a
    result), ``invalid`` (malformed, wrong format, unknown tool, bad arguments) and ``episodes``
    (episodes with at least one attempt)."""
    counts: Counter[str] = Counter()
    for t in trajectories:
        add_tool_stats(counts, t.metadata.get("tool_stats"))
    valid = counts["ok"] + counts["error"] + counts["timeout"]
    return {"calls": counts["calls"], "valid": valid, "ok": counts["ok"], "invalid": counts["invalid"], "episodes": counts["episodes"]}

