"""Tools: schemas, argument validation, results, and the runner's concurrency and timeouts."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Literal

import pytest
from transformers.utils import get_json_schema

from tokengym.envs import (
    Tool,
    ToolCall,
    ToolError,
    ToolResult,
    ToolRunner,
    abandoned_threads,
    as_tool,
    check_arguments,
    tool,
    tools_of,
)
from tokengym.envs.function_tools import result_text

NEVER = threading.Event()  # never set: a "hung" tool waits on it (10 s at most, then its abandoned thread ends)


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def test_schema_is_transformers_get_json_schema():
    t = Tool(add)
    assert t.schema == get_json_schema(add)
    assert t.name == "add" and t.parameters["required"] == ["a"]
    assert t(2, 3) == 5  # still callable as the function


def test_decorator_and_explicit_schema_override():
    @tool(name="plus", description="Sum.", timeout=2, parallel=False)
    def f(a: int) -> int:
        """Add one.

        Args:
            a: a number
        """
        return a + 1

    assert isinstance(f, Tool) and f.name == "plus" and f.timeout == 2 and not f.parallel
    assert f.schema["function"]["description"] == "Sum." and f.schema["function"]["name"] == "plus"
    inner = {"name": "lookup", "description": "Look up.", "parameters": {"type": "object", "properties": {}}}
    assert Tool(lambda: 1, schema=inner).schema == {"type": "function", "function": inner}
    assert Tool(lambda: 1, schema={"type": "function", "function": inner}).name == "lookup"
    with pytest.raises(ValueError, match="tool schema"):
        Tool(lambda: 1, schema={"parameters": {}})


def test_missing_docstring_says_how_to_fix_it():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="docstring, or pass schema"):
        Tool(bare).schema  # noqa: B018


class Counter:
    def __init__(self) -> None:
        self.n = 0

    @tool
    def bump(self, by: int = 1) -> int:
        """Increase the counter.

        Args:
            by: the step
        """
        self.n += by
        return self.n

    @tool
    async def peek(self) -> int:
        """Read the counter."""
        return self.n


def test_methods_bind_per_instance_and_schema_has_no_self():
    a, b = Counter(), Counter()
    ta, tb = tools_of(a), tools_of(b)
    assert [t.name for t in ta] == ["bump", "peek"]
    assert "self" not in ta[0].schema["function"]["parameters"]["properties"]
    assert ta[1].is_async and not ta[0].is_async
    runner = ToolRunner(1.0)
    runner.run([ToolCall("bump", {"by": 5})], ta)
    assert a.n == 5 and b.n == 0
    assert runner.run([ToolCall("peek", {})], tb)[0].content == "0"
    runner.close()
    with pytest.raises(ValueError, match="no @tool methods"):
        tools_of(object())


@pytest.mark.parametrize(
    "args, problems",
    [
        ({"a": 1}, []),
        ({"a": 2.0}, []),
        ({}, ['missing required argument "a"']),
        ({"a": 1, "c": 2}, ['unexpected argument "c" (it takes a, b)']),
        ({"a": "x"}, ['argument "a" must be integer, got string "x"']),
        ({"a": True}, ['argument "a" must be integer, got boolean true']),
        ({"a": 1.5}, ['argument "a" must be integer, got number 1.5']),
        ({"a": 1, "b": None}, ['argument "b" must be number, got null']),
        ({"b": [1]}, ['missing required argument "a"', 'argument "b" must be number, got array']),
    ],
)
def test_check_arguments(args, problems):
    coerced, found = check_arguments(Tool(add).parameters, args)
    assert found == problems
    if not problems:  # an integer written as 2.0 reaches the function as 2
        assert coerced["a"] == args["a"] and type(coerced["a"]) is int


def test_check_arguments_nested_enum_nullable():
    def f(mode: Literal["fast", "slow"], ids: list[int], tag: str | None = None, opts: dict[str, int] | None = None):
        """F.

        Args:
            mode: m
            ids: i
            tag: t
            opts: o
        """

    params = Tool(f).parameters
    assert check_arguments(params, {"mode": "fast", "ids": [1, 2], "tag": None})[1] == []
    assert check_arguments(params, {"mode": "medium", "ids": [1, "2"], "opts": {"x": "y"}})[1] == [
        'argument "mode" must be one of ["fast", "slow"], got string "medium"',
        'argument "ids"[1] must be integer, got string "2"',
        'argument "opts".x must be integer, got string "y"',
    ]


def test_result_text():
    assert result_text("hi") == ("hi", 0.0)
    assert result_text(b"ok \xff\xfe end") == ("ok \ufffd\ufffd end", 0.0)
    assert result_text({"a": [1, None]}) == ('{"a": [1, null]}', 0.0)
    assert result_text(ToolResult("done", reward=0.5)) == ("done", 0.5)
    assert result_text("bad \udcff surrogate")[0] == "bad \ufffd\ufffd\ufffd surrogate"


@pytest.mark.alone
def test_runner_runs_calls_concurrently_and_in_call_order():
    def nap(s: float) -> float:
        """Sleep.

        Args:
            s: seconds
        """
        time.sleep(s)
        return s

    runner = ToolRunner(5.0)
    t0 = time.monotonic()
    out = runner.run([ToolCall("nap", {"s": x}) for x in (0.4, 0.3, 0.2, 0.1)], [Tool(nap)])
    elapsed = time.monotonic() - t0
    assert [o.content for o in out] == ["0.4", "0.3", "0.2", "0.1"]
    assert elapsed < 0.8  # concurrent: ~0.4 s, not 1.0 s


def test_sequential_tools_run_in_call_order():
    seen: list[str] = []

    @tool(parallel=False)
    def write(x: str) -> str:
        """Write.

        Args:
            x: the text
        """
        time.sleep(0.05 if x == "a" else 0)
        seen.append(x)
        return x

    out = ToolRunner(2.0).run([ToolCall("write", {"x": c}) for c in "abc"], [write])
    assert seen == ["a", "b", "c"] and [o.content for o in out] == ["a", "b", "c"]


@pytest.mark.alone
def test_hung_sync_tool_is_abandoned_after_its_timeout():
    def hang() -> str:
        """Hang (longer than any timeout here)."""
        NEVER.wait(10)
        return "late"

    def quick() -> str:
        """Return at once."""
        return "fast"

    runner = ToolRunner(0.3)
    t0 = time.monotonic()
    out = runner.run([ToolCall("hang", {}), ToolCall("quick", {})], [Tool(hang), Tool(quick)])
    assert time.monotonic() - t0 < 1.5
    assert out[0].status == "timeout"
    assert out[0].content == "Error: hang timed out after 0.3 s; its result is discarded."
    assert out[1].content == "fast"
    assert abandoned_threads() >= 1


@pytest.mark.alone
def test_async_tool_timeout_cancels_the_coroutine():
    cancelled = threading.Event()

    async def slow() -> str:
        """Sleep long."""
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    async def fine(x: int) -> int:
        """Echo.

        Args:
            x: a number
        """
        await asyncio.sleep(0.01)
        return x

    runner = ToolRunner(1.0)  # a second: room for a loaded machine's scheduling (fine needs 0.01 s)
    out = runner.run([ToolCall("slow", {}), ToolCall("fine", {"x": 3})], [Tool(slow), Tool(fine)])
    assert out[0].status == "timeout" and out[1].content == "3"
    assert cancelled.wait(2.0)
    runner.close()


@pytest.mark.alone
def test_async_tool_that_blocks_the_loop_still_times_out():
    async def blocks() -> str:
        """Block the loop."""
        time.sleep(1.0)
        return "late"

    runner = ToolRunner(0.2, grace=0.1)
    t0 = time.monotonic()
    out = runner.run([ToolCall("blocks", {})], [Tool(blocks)])
    assert out[0].status == "timeout" and time.monotonic() - t0 < 0.8
    runner.close()


def test_exceptions_become_short_error_texts():
    def boom(x: int) -> int:
        """Fail.

        Args:
            x: a number
        """
        if x == 0:
            raise ToolError("x must not be zero")
        if x == 1:
            raise SystemExit(3)
        raise ValueError("bad value " + "!" * 1000)

    out = ToolRunner(1.0).run([ToolCall("boom", {"x": v}) for v in (0, 1, 2)], [as_tool(boom)])
    assert [o.status for o in out] == ["error"] * 3
    assert out[0].content == "Error: boom: x must not be zero"
    assert out[1].content == "Error: boom raised SystemExit: 3"
    assert out[2].content.startswith("Error: boom raised ValueError: bad value !!!") and len(out[2].content) < 350


def test_unknown_tool_and_bad_arguments_are_not_run():
    calls = []

    def f(a: int) -> int:
        """F.

        Args:
            a: a
        """
        calls.append(a)
        return a

    out = ToolRunner(1.0).run([ToolCall("g", {}), ToolCall("f", {"a": "x"}), ToolCall("f", {"a": 4.0})], [Tool(f)])
    assert out[0].content == 'Error: unknown tool "g". Available tools: f.'
    assert out[1].content == 'Error: f: argument "a" must be integer, got string "x".'
    assert out[2].content == "4" and calls == [4]


def test_runner_validates_its_timeout():
    with pytest.raises(ValueError, match="timeout"):
        ToolRunner(0)
    with pytest.raises(ValueError, match="timeout"):
        Tool(add, timeout=-1)


def test_a_misspelled_args_entry_is_named_in_the_schema_error():
    def pick(item: int, count: int) -> int:
        """Pick.

        Args:
            itme: the item
            count (int): how many
        """
        return item

    with pytest.raises(ValueError, match=r"no description for the argument 'item'\. The docstring's 'Args:' has 'itme'"):
        Tool(pick).schema

    def plain(item: int) -> int:
        """No Args section at all."""
        return item

    with pytest.raises(ValueError) as err:
        Tool(plain).schema
    assert "misspelling" not in str(err.value)  # nothing to point at: no guess
