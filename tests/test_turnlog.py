"""TurnLog: the line per turn ``tokengym demo`` prints while episodes run, and the run's tool-call count."""

from __future__ import annotations

import numpy as np

from tokengym.envs import CalculatorEnv
from tokengym.recorder import RecordEpisodes
from tokengym.recorder.turnlog import TurnLog, describe_turn, tool_call_counts


def _call_ids(env, text):
    r = env.unwrapped.renderer
    return np.array(r.encode(text) + list(r.turn_end_ids), dtype=np.int64)


def test_turn_lines_show_the_call_its_result_and_the_scored_answer(qwen25):
    lines: list[str] = []
    env = RecordEpisodes(TurnLog(CalculatorEnv(qwen25, few_shot=1), write=lines.append))
    env.reset(seed=7)
    task = env.unwrapped.task
    call = f'<tool_call>\n{{"name": "calculate", "arguments": {{"expression": "{task["expression"]}"}}}}\n</tool_call>'
    a1 = _call_ids(env, call)
    env.step(a1)
    a2 = _call_ids(env, f"<answer>{task['answer']}</answer>")
    *_, info = env.step(a2)
    assert lines == [
        f"seed 7 turn 0: {len(a1)} tokens, calculate(expression={task['expression']!r}) -> {task['answer']}",
        f"seed 7 turn 1: {len(a2)} tokens, final answer <answer>{task['answer']}</answer>, reward 1",
    ]
    # A malformed call is named as such; a wrong number scores 0; the counts come from the trajectories.
    env.reset(seed=8)
    env.step(_call_ids(env, '<tool_call>\n{"name": "calculate", "arguments": {"expression": \n</tool_call>'))
    *_, info2 = env.step(_call_ids(env, "no tag here"))
    assert lines[2].startswith("seed 8 turn 0: ") and "a call parse_error: Error:" in lines[2]
    assert lines[3].endswith("final answer no <answer> tag, reward 0")
    counts = tool_call_counts([info["trajectory"], info2["trajectory"]])
    assert counts == {"calls": 2, "valid": 1, "ok": 1, "invalid": 1, "episodes": 2}


def test_describe_turn_names_a_stopped_episode():
    info = {"turn": 2, "tool_results": [], "stop_reason": "max_turns"}
    assert describe_turn(1, info, 5, None) == "seed 1 turn 2: 5 tokens, no tool call (episode stopped: max_turns)"
    err = {"turn": 0, "tool_results": [{"status": "error", "name": "calculate", "arguments": {"expression": "1/0"},
                                        "content": "Error: calculate: division by zero"}]}
    assert describe_turn(0, err, 9, None) == (
        "seed 0 turn 0: 9 tokens, calculate(expression='1/0') error: Error: calculate: division by zero"
    )
