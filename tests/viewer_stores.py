"""Stores for the viewer's tests (and docs/viewer.py's screenshots): real rollouts on real tokenizers.

``calc``: the Calculator env with its real tool and the real Qwen2.5 template, a scripted policy
that calls the tool on some problems and answers others at once, in GRPO groups of 3 (rewards 0
and 1 in a group, one and two turns). ``sampled``: a tiny random Qwen3 model sampling on the same
env through the HF policy, so every action token has the logprob it was sampled with.
``hostile``: what a store from elsewhere may hold: HTML and scripts in the env id, the task and
the model's own text, terminal escapes in the stop reason, and an episode of 20,000 tokens.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

HOSTILE_HTML = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
HOSTILE_ESCAPE = "done\x1b[2J\x1b]0;pwned\x07"
HUGE_TOKENS = 20_000


def calculator_script(renderer: Any) -> Any:
    """Calls the calculator on problems whose first number is even and answers with its result;
    guesses a sum at once on the others (right on sums, wrong elsewhere)."""

    def act(context: Any) -> Any:
        text = renderer.decode(context)
        if "<tool_response>" in text:
            result = text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
            return renderer.assistant({"role": "assistant", "content": f"<answer>{result}</answer>"}).ids
        question = text.rsplit("<|im_start|>user\n", 1)[1]
        a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
        if a % 2:
            return renderer.assistant({"role": "assistant", "content": f"<answer>{a + b}</answer>"}).ids
        op = "-" if "left" in question else "*" if ("box" in question or "each" in question) else "+"
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": f"{a} {op} {b}"}}}
        return renderer.assistant({"role": "assistant", "content": "", "tool_calls": [call]}).ids

    return act


def write_calc(path: Path, tok: Any, episodes: int = 12) -> Path:
    from tokengym.envs import ChatRenderer
    from tokengym.policies import ScriptedPolicy
    from tokengym.recorder import TrajectoryWriter, rollout

    policy = ScriptedPolicy(calculator_script(ChatRenderer(tok)))
    with TrajectoryWriter(path, tokenizer=tok, tokenizer_name="qwen2.5", shard_size=5) as writer:
        result = rollout("tokengym/Calculator-v0", policy, episodes=episodes, group_size=3, concurrency=4, seed=0,
                         progress=False, env_kwargs={"tokenizer": tok}, on_episode=writer.write)
    assert result.stats.failed == 0, result.stats.errors
    return path


def write_sampled(path: Path, tok: Any, episodes: int = 4) -> Path:
    from tests.tiny_qwen3 import tiny_qwen3
    from tokengym.policies import HFPolicy, SamplingParams
    from tokengym.recorder import TrajectoryWriter, rollout

    policy = HFPolicy(tiny_qwen3(len(tok)), tok)
    with TrajectoryWriter(path, tokenizer=tok, tokenizer_name="qwen3") as writer:
        result = rollout("tokengym/Calculator-v0", policy, episodes=episodes, concurrency=episodes, seed=1,
                         progress=False, env_kwargs={"tokenizer": tok, "max_turns": 2},
                         sampling=SamplingParams(max_tokens=24, temperature=1.0), on_episode=writer.write)
    assert result.stats.failed == 0, result.stats.errors
    return path


def write_hostile(path: Path, tok: Any) -> Path:
    """Two episodes built as a foreign writer might have: hostile text everywhere, and a huge one."""
    from tokengym.recorder import Segment, SegmentKind, Trajectory, TrajectoryWriter

    def ids(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_special_tokens=False), dtype=np.int64)

    prompt = ids("<|im_start|>user\n" + HOSTILE_HTML + "<|im_end|>\n<|im_start|>assistant\n")
    action = ids("Sure: " + HOSTILE_HTML + " \x1b[31mred\x1b[0m<|im_end|>")
    evil = Trajectory(
        segments=[Segment(SegmentKind.PROMPT, prompt, 0),
                  Segment(SegmentKind.ACTION, action, 0, logprobs=np.full(len(action), -0.5, np.float32), reward=1.0,
                          finish_reason="stop")],
        env_id="evil/" + HOSTILE_HTML, seed=0, stop_reason=HOSTILE_ESCAPE, terminated=True,
        metadata={"task": {"id": HOSTILE_HTML, "prompt": HOSTILE_HTML}, "group": HOSTILE_HTML},
    )
    rng = np.random.default_rng(0)
    words = ids(" the quick brown fox jumps over the lazy dog")
    body = np.resize(words, HUGE_TOKENS - len(prompt))
    huge = Trajectory(
        segments=[Segment(SegmentKind.PROMPT, prompt, 0),
                  Segment(SegmentKind.ACTION, body, 0, logprobs=-rng.random(len(body)).astype(np.float32) * 8,
                          finish_reason="length")],
        env_id="huge-v0", seed=1, stop_reason="truncated", truncated=True,
    )
    with TrajectoryWriter(path, tokenizer=tok, tokenizer_name="qwen3") as writer:
        writer.write(evil)
        writer.write(huge)
    return path


def write_pictures(path: Path, vl_tok: Any, episodes: int = 2) -> Path:
    """The dot-counting env (a picture in the prompt, on Qwen3.5's own template) answered at once,
    through gymnasium's loop (a text policy refuses a context with images)."""
    from tokengym.envs.builtin.dots import DotCountEnv
    from tokengym.recorder import RecordEpisodes, TrajectoryWriter

    answer = np.asarray(vl_tok.encode("<answer>3</answer><|im_end|>", add_special_tokens=False))
    env = RecordEpisodes(DotCountEnv(vl_tok, max_turns=1, template_kwargs={"enable_thinking": False}))
    with TrajectoryWriter(path, tokenizer=vl_tok) as writer:
        for seed in range(episodes):
            env.reset(seed=seed)
            *_, info = env.step(answer)
            writer.write(info["trajectory"])
    return path
