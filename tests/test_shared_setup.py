"""What envs of one tokenizer share in a process (the probe, the compiled template, tool worker
threads), and what each keeps of its own (its conversation, a hung call's thread)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tokengym.envs import ChatRenderer, Tool, ToolCall, ToolRunner, abandoned_threads
from tokengym.envs.builtin.calculator import CalculatorEnv
from tokengym.envs.tool_runner import IDLE_WORKERS


def test_a_second_renderer_of_the_same_tokenizer_adopts_the_first_ones_probe(qwen3, monkeypatch):
    first = ChatRenderer(qwen3, template_kwargs={"enable_thinking": False})
    monkeypatch.setattr(ChatRenderer, "_probe", lambda self: pytest.fail("probed again"))
    second = ChatRenderer(qwen3, template_kwargs={"enable_thinking": False})
    for name in ("turn_end_ids", "call_end_ids", "stop_token_ids", "generation_prompt", "special_ids", "tools_required"):
        assert getattr(second, name) == getattr(first, name)
    assert second.template_kwargs == first.template_kwargs and second.template_kwargs is not first.template_kwargs
    # the render caches are pure functions of the tokenizer, template and variables: shared; the rest is copied
    assert second._histories is first._histories and second._tools_shown is first._tools_shown
    whole_1, whole_2 = first._whole_renderer, second._whole_renderer
    assert whole_2 is not whole_1 and whole_2.renderer is second and whole_2._forms is not whole_1._forms
    shared = set(whole_1._compiled) & set(whole_2._compiled)
    assert shared and all(whole_2._compiled[s] is whole_1._compiled[s] for s in shared)  # compiled once


def test_other_variables_or_another_tokenizer_object_probe_again(qwen3):
    from tokengym.envs import fetch_tokenizer, load_tokenizer

    ChatRenderer(qwen3)
    another = load_tokenizer(str(fetch_tokenizer("qwen3")))  # the same files, another object
    probed = []
    original = ChatRenderer._probe

    def counting(self):
        probed.append(self)
        original(self)

    ChatRenderer._probe = counting
    try:
        ChatRenderer(qwen3, template_kwargs={"enable_thinking": True, "x": id(probed)})  # not seen before
        ChatRenderer(another)
        ChatRenderer(qwen3, template_kwargs={"tool": object()})  # not plain data: not shared
    finally:
        ChatRenderer._probe = original
    assert len(probed) == 3


def test_envs_that_share_a_renderers_probe_give_the_same_tokens(qwen3):
    def episode(env: CalculatorEnv) -> list[int]:
        obs, _ = env.reset(seed=3)
        stream = obs.tolist()
        call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
        action = np.array(env.renderer.encode_action_text(call) + list(env.renderer.turn_end_ids))
        for _ in range(3):
            obs, *_ = env.step(action)
            stream += action.tolist() + obs.tolist()
        return stream

    alone = episode(CalculatorEnv(qwen3))
    envs = [CalculatorEnv(qwen3) for _ in range(3)]
    assert [episode(e) for e in envs] == [alone] * 3
    assert len({id(e.renderer._whole_renderer) for e in envs}) == 3


def test_sync_tool_calls_reuse_an_idle_worker_thread():
    threads: list[int] = []

    def where() -> str:
        """Say which thread runs the call."""
        threads.append(threading.get_ident())
        return "ok"

    runner = ToolRunner(2.0)
    for _ in range(5):
        assert runner.run([ToolCall("where", {})], [Tool(where)])[0].content == "ok"
    assert len(set(threads)) == 1 and threads[0] != threading.get_ident()
    assert IDLE_WORKERS >= 1


@pytest.mark.alone
def test_a_hung_calls_worker_takes_no_other_call_until_it_returns():
    release = threading.Event()
    ran_on: dict[str, int] = {}

    def hang() -> str:
        """Hang until released."""
        ran_on["hang"] = threading.get_ident()
        release.wait(10)
        return "late"

    def quick() -> str:
        """Return at once."""
        ran_on["quick"] = threading.get_ident()
        return "fast"

    runner = ToolRunner(0.2)
    before = abandoned_threads()
    assert runner.run([ToolCall("hang", {})], [Tool(hang)])[0].status == "timeout"
    assert abandoned_threads() == before + 1
    assert runner.run([ToolCall("quick", {})], [Tool(quick)])[0].content == "fast"
    assert ran_on["quick"] != ran_on["hang"]  # the hung call still holds its thread
    release.set()
    deadline = time.monotonic() + 5
    while abandoned_threads() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert abandoned_threads() == before  # it returned: no longer counted


def test_a_tools_argument_schema_is_shared_and_its_parameters_are_a_copy():
    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: one
            b: two
        """
        return a + b

    tool = Tool(add)
    assert tool.argument_schema is tool.argument_schema
    params = tool.parameters
    params["properties"]["a"]["type"] = "string"
    assert tool.argument_schema["properties"]["a"]["type"] == "integer"
