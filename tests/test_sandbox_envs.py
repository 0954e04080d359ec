"""The sandbox tools and the two sandbox envs, ``tokengym/PythonSandbox-v0`` and ``tokengym/Shell-v0``,
on the real pinned tokenizers, driven by scripted assistant turns in the template's own tool-call
format: rewards computed inside the sandbox, hostile tool calls answered with a clear message
while the episode goes on, one sandbox per episode closed whatever happens, nothing left behind.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import tokengym.envs  # noqa: F401  (registers the envs)
from tokengym.envs import PythonSandboxEnv, ShellEnv, ToolRunner
from tokengym.envs.builtin import SHELL_KINDS, coding_tasks, extract_code, grade_solution, shell_task
from tokengym.envs.builtin.shell import check_in_sandbox
from tokengym.envs.sandbox import (
    ExecResult,
    LocalSandbox,
    SandboxError,
    SandboxToolEnv,
    format_result,
    make_sandbox,
    sandbox_tools,
)
from tokengym.envs.sandbox.local import TMP_PREFIX
from tokengym.envs.function_tools import ToolCall
from tokengym.recorder import RecordEpisodes

from needs import missing
from test_sandbox_local import ISOLATIONS, assert_no_more_fds_than, fd_targets, require_bwrap, sandbox_dirs, sandbox_processes
from test_tool_env import call, play, templated


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap":
        require_bwrap()
    return request.param


def task_by_id(task_id: str) -> dict:
    return next(t for t in coding_tasks() if t["id"] == task_id)


def answer_with(code: str):
    return templated(f"Here is my solution.\n\n```python\n{code}```")


# ------------------------------------------------------------------- tools
def test_format_result_reads_clearly():
    ok = ExecResult("ok", 0, "hello\n", "", 0.01)
    assert format_result(ok) == "exit code: 0\nstdout:\nhello"
    assert format_result(ExecResult("ok", 0, "", "", 0.01)) == "exit code: 0\n(no output)"
    err = ExecResult("error", 1, "", "Traceback...\nValueError: x\n", 0.02, message="exited with code 1")
    assert format_result(err) == "exit code: 1\nstderr:\nTraceback...\nValueError: x"
    slow = ExecResult("timeout", None, "partial\n", "", 10.0, message="timed out after 10 s; the process and its children were killed")
    assert format_result(slow) == (
        "Error: timed out after 10 s; the process and its children were killed.\nstdout:\npartial"
    )
    flood = ExecResult("ok", 0, "x" * 65536, "", 0.3, stdout_dropped=100 * 1024 * 1024)
    text = format_result(flood)
    assert text.endswith("[... 100 MB more of stdout dropped: output is cut after 64 KB ...]")
    oom = ExecResult("oom", 1, "", "MemoryError\n", 0.1, message="ran out of memory (limit 512 MB)")
    assert format_result(oom).startswith("Error: ran out of memory (limit 512 MB).\nstderr:\nMemoryError")


def test_sandbox_tools_through_the_runner(isolation):
    with LocalSandbox(isolation=isolation, timeout_s=2, max_output_bytes=2000) as sb:
        tools = sandbox_tools(sb)
        assert [t.name for t in tools] == ["run_python", "run_shell", "write_file", "read_file"]
        assert all(not t.parallel and t.timeout == 12.0 for t in tools)
        for t in tools:
            fn = t.schema["function"]
            assert fn["description"] and set(fn["parameters"]["required"]) == set(fn["parameters"]["properties"])
        runner = ToolRunner()
        calls = [
            ToolCall("write_file", {"path": "src/hello.py", "content": "print('hi from a file')\n"}),
            ToolCall("run_shell", {"command": "python3 src/hello.py && ls src"}),
            ToolCall("run_python", {"code": "import sys; sys.exit(4)"}),
            ToolCall("read_file", {"path": "src/hello.py"}),
            ToolCall("read_file", {"path": "missing.txt"}),
            ToolCall("read_file", {"path": "../../etc/passwd"}),
            ToolCall("run_python", {"code": "while True:\n    pass"}),
            ToolCall("run_shell", {"command": "yes"}),
        ]
        out = runner.run(calls, tools)
        runner.close()
        texts = [o.content for o in out]
        assert out[0].ok and texts[0] == "wrote 24 bytes to src/hello.py"
        assert texts[1] == "exit code: 0\nstdout:\nhi from a file\nhello.py"
        assert texts[2] == "exit code: 4\n(no output)"
        assert texts[3] == "print('hi from a file')\n"
        assert out[4].status == "error" and texts[4] == "Error: read_file: no file 'missing.txt' in the workspace"
        assert texts[5] == "Error: read_file: path '../../etc/passwd' is outside the workspace"
        assert texts[6] == "Error: timed out after 2 s; the process and its children were killed."
        assert texts[7].startswith("Error: timed out after 2 s") and "more of stdout dropped" in texts[7]
        sb.write_file("big.txt", "y" * 5000)
        text = runner.run([ToolCall("read_file", {"path": "big.txt"})], tools)[0].content
        assert text == "y" * 2000 + "\n[... the file is longer: only its first 2000 bytes are shown ...]"
    with pytest.raises(ValueError, match="unknown sandbox tool"):
        sandbox_tools(sb, ["run_rust"])


def test_a_tool_on_a_closed_sandbox_is_a_clean_error():
    sb = LocalSandbox(isolation="none")
    tools = sandbox_tools(sb, ["run_shell"])
    sb.close()
    out = ToolRunner().run([ToolCall("run_shell", {"command": "ls"})], tools)
    assert out[0].content == "Error: run_shell: the sandbox is closed"


# ----------------------------------------------------------- coding tasks
def test_the_shipped_coding_tasks():
    tasks = coding_tasks()
    assert 20 <= len(tasks) <= 40
    assert len({t["id"] for t in tasks}) == len(tasks)
    for t in tasks:
        assert {"id", "entry_point", "signature", "description", "examples", "tests", "solution", "prompt"} <= set(t)
        assert t["signature"].startswith(f"def {t['entry_point']}(")
        assert len(t["examples"]) >= 1 and len(t["tests"]) >= 3
        assert t["signature"] in t["prompt"] and "```python" in t["prompt"]
        for e in t["examples"]:
            assert repr(e["expected"]) in t["prompt"]
        for hidden in t["tests"]:  # hidden tests stay hidden
            shown = f"{t['entry_point']}({', '.join(repr(a) for a in hidden['args'])}) == {hidden['expected']!r}"
            assert shown not in t["prompt"].split("Examples:")[-1], (t["id"], shown)


def test_every_reference_solution_passes_and_a_wrong_one_fails():
    with LocalSandbox() as sb:
        for t in coding_tasks():
            g = grade_solution(sb, t["solution"], t)
            assert g.all_passed and g.passed == g.total == len(t["examples"]) + len(t["tests"]), (t["id"], g)
            wrong = f"def {t['entry_point']}(*args):\n    return None\n"
            g = grade_solution(sb, wrong, t)
            assert not g.all_passed and g.failures, t["id"]


GAMES = {
    "always_equal": "class Yes:\n    def __eq__(self, other):\n        return True\n\ndef add_digits(n):\n    return Yes()\n",
    "int_subclass": "class I(int):\n    def __eq__(self, other):\n        return True\n\ndef add_digits(n):\n    return I(0)\n",
    "bool_for_int": "def add_digits(n):\n    return True\n",
    "exit_at_import": "import sys\nsys.exit(0)\n",
    "hard_exit_at_import": "import os\nos._exit(0)\n",
    "hard_exit_in_call": "import os\ndef add_digits(n):\n    os._exit(0)\n",
    "ignore_the_alarm": "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef add_digits(n):\n    while True:\n        pass\n",
    "endless": "def add_digits(n):\n    while True:\n        pass\n",
    "flood": "def add_digits(n):\n    print('x' * 10_000_000)\n    return -1\n",
    "fake_results": (
        "import json\nopen('results.jsonl', 'w').write(''.join(json.dumps({'i': i, 'value': 0}) + '\\n' for i in range(50)))\n"
        "def add_digits(n):\n    return 0\n"
    ),
    "syntax_error": "def add_digits(n)\n    return 1\n",
}


@pytest.mark.parametrize("name", list(GAMES))
def test_the_grader_is_not_fooled(name):
    task = task_by_id("coding-add_digits")
    with LocalSandbox(timeout_s=10) as sb:
        g = grade_solution(sb, GAMES[name], task, timeout_s=8, case_timeout_s=0.5)
        assert not g.all_passed and g.passed < g.total, g
        if name in ("exit_at_import", "syntax_error"):
            assert g.error.startswith("the code did not load: ")


def test_files_planted_in_the_workspace_do_not_reach_the_grader():
    task = task_by_id("coding-fizzbuzz")
    with LocalSandbox() as sb:
        for planted in ("json.py", "signal.py", "os.py", "sitecustomize.py", "usercustomize.py"):
            sb.write_file(planted, "raise SystemExit('hijacked')\n")
        sb.write_file("__init__.py", "")
        g = grade_solution(sb, task["solution"], task)
        assert g.all_passed, g
        assert "hijacked" in sb.run_python("print(1)").stderr  # (the model's own runs do see them)


def test_extract_code():
    assert extract_code("no code") is None
    assert extract_code("```python\na = 1\n```") == "a = 1\n"
    assert extract_code("```\nbare\n```\nthen\n```py\nb = 2\n```\n```text\nnot it\n```") == "b = 2\n"
    assert extract_code("```python\nfirst\n```\n```python\nlast\n```") == "last\n"


# ------------------------------------------------------------------- envs
def test_python_sandbox_episode_solves_a_task(tokenizer):
    env = RecordEpisodes(PythonSandboxEnv(tokenizer))
    options = {"task_id": "coding-run_length_encode"}
    env.reset(seed=0, options=options)
    task = env.unwrapped.task
    sb = env.unwrapped.sandbox
    assert sb is not None and not sb.closed and task["id"] == "coding-run_length_encode"
    traj, infos = play(
        env,
        [
            templated(
                "Let me try it.",
                call("write_file", path="solution.py", content=task["solution"]),
                call("run_python", code="from solution import run_length_encode\nprint(run_length_encode('aaabcc'))"),
            ),
            templated("", call("run_shell", command="ls && wc -l solution.py")),
            answer_with(task["solution"]),
        ],
        options=options,
    )
    first, second, last = infos
    assert [r["content"] for r in first["tool_results"]] == [
        f"wrote {len(task['solution'])} bytes to solution.py",
        "exit code: 0\nstdout:\na3b1c2",
    ]
    assert second["tool_results"][0]["content"].startswith("exit code: 0\nstdout:\nsolution.py\n")
    assert last["final_reward"] == 1.0 and traj.reward == 1.0 and traj.terminated
    assert last["grade"] == {**last["grade"], "all_passed": True, "failures": [], "error": ""}
    assert sb.closed and env.unwrapped.sandbox is None  # closed as soon as the episode ended


def test_python_sandbox_rewards(qwen25):
    env = PythonSandboxEnv(qwen25, reward="fraction")
    task = task_by_id("coding-is_prime")
    half_right = "def is_prime(n):\n    return n in (2, 3, 5, 7, 97)\n"
    env.reset(seed=0, options={"task": task})
    _, reward, term, _, info = env.step(answer_with(half_right)(env))
    assert term and 0 < reward < 1 and reward == info["grade"]["passed"] / info["grade"]["total"]
    env.reset(seed=0, options={"task": task})  # no code block: the workspace's solution.py is graded
    env.step(templated("", call("write_file", path="solution.py", content=task["solution"]))(env))
    _, reward, *_ = env.step(templated("It is in solution.py.")(env))
    assert reward == 1.0
    env.reset(seed=0, options={"task": task})
    _, reward, _, _, info = env.step(templated("I give up.")(env))
    assert reward == 0.0 and info["grade"]["error"] == "no code to test"
    env.close()


def test_tasks_are_drawn_by_seed(qwen25):
    env = PythonSandboxEnv(qwen25, sandbox_kwargs={"isolation": "none"})
    ids = [env.reset(seed=s)[1]["task"]["id"] for s in range(12)]
    again = [env.reset(seed=s)[1]["task"]["id"] for s in range(12)]
    assert ids == again and len(set(ids)) > 4
    assert env.reset(options={"index": 3})[1]["task"]["id"] == coding_tasks()[3]["id"]
    with pytest.raises(ValueError, match="no task with id"):
        env.reset(options={"task_id": "nope"})
    assert env.sandbox is None  # the failed reset left no sandbox open
    env.close()


def _shell_solution(task: dict) -> str:
    """A correct shell command for a generated task (read off its prompt)."""
    kind, prompt = task["kind"], task["prompt"]
    if kind == "find":
        code = re.search(r"ticket (TG-\d+)", prompt).group(1)
        return f"grep -rl 'ticket: {code}' project > answer.txt"
    if kind == "count":
        return "grep -rl --include='*.log' ' ERROR ' logs | wc -l > answer.txt"
    if kind == "edit":
        section, old, new = re.search(r"\[(\w+)\] section from (\d+) to (\d+)", prompt).groups()
        return f"sed -i '/^\\[{section}\\]/,/^\\[/ s/^port = {old}$/port = {new}/' config/app.ini"
    if kind == "rename":
        return 'for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done'
    if kind == "sort":
        return "sort -u names.txt > sorted.txt"
    if kind == "largest":
        return "find data -type f -printf '%s %p\\n' | sort -n | tail -1 | cut -d' ' -f2 > answer.txt"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", SHELL_KINDS)
def test_shell_env_each_kind_solved_and_unsolved(kind, qwen3):
    env = RecordEpisodes(ShellEnv(qwen3))
    for seed in (1, 2):
        options = {"kind": kind, "problem_seed": seed}
        env.reset(seed=seed, options=options)
        task = env.unwrapped.task
        assert task == shell_task(seed, kind) and task["kind"] == kind
        traj, infos = play(
            env,
            [templated("", call("run_shell", command=_shell_solution(task))), templated("Done.")],
            seed=seed,
            options=options,
        )
        assert infos[0]["tool_results"][0]["content"].startswith("exit code: 0"), infos[0]["tool_results"]
        assert infos[-1]["check"]["pass"] and traj.reward == 1.0, (task["id"], infos[-1]["check"])
        traj, infos = play(env, [templated("Done.")], seed=seed, options=options)
        assert traj.reward == 0.0 and not infos[-1]["check"]["pass"] and infos[-1]["check"]["detail"]


def test_shell_tasks_vary_and_repeat():
    assert {shell_task(s)["kind"] for s in range(40)} == set(SHELL_KINDS)
    assert shell_task(7) == shell_task(7)
    assert shell_task(7, "count") != shell_task(8, "count")
    with pytest.raises(ValueError):
        shell_task(1, "delete")
    with pytest.raises(ValueError):
        ShellEnv("qwen2.5", kinds=["nope"])


def test_state_never_crosses_episodes(qwen25):
    env = ShellEnv(qwen25, kinds=["sort"])
    env.reset(seed=1)
    first = env.sandbox
    env.step(templated("", call("run_shell", command="echo secret > left_behind.txt; ls"))(env))
    env.reset(seed=2)
    assert first.closed and env.sandbox is not first
    _, _, _, _, info = env.step(templated("", call("run_shell", command="ls -A; ls -A $TMPDIR 2>/dev/null"))(env))
    assert "left_behind" not in info["tool_results"][0]["content"]
    assert "names.txt" in info["tool_results"][0]["content"]
    env.close()
    assert env.sandbox is None


# ---------------------------------------------------------------- hostile
def test_hostile_tool_calls_get_a_clear_message_and_the_episode_goes_on(qwen3, isolation):
    procs, dirs = sandbox_processes(), sandbox_dirs()
    env = RecordEpisodes(
        PythonSandboxEnv(qwen3, sandbox_kwargs={"isolation": isolation, "timeout_s": 2, "memory_mb": 256})
    )
    options = {"task_id": "coding-fibonacci"}
    env.reset(seed=0, options=options)
    task = env.unwrapped.task
    project_file = Path(__file__).resolve().parents[1] / "pyproject.toml"
    traj, infos = play(
        env,
        [
            templated(
                "",
                call("run_shell", command="bomb() { bomb | bomb & }; bomb; while :; do :; done"),  # the wait needs no fork
                call("run_python", code="a = []\nwhile True:\n    a.append(bytearray(32 * 1024 * 1024))"),
                call("run_python", code="while True:\n    pass"),
            ),
            templated(
                "",
                call("run_python", code="import sys\nsys.stdout.write('z' * (100 * 1024 * 1024))"),
                call("run_shell", command=f"cat /etc/shadow; cat {project_file} | head -3"),
                call("read_file", path="../../../etc/passwd"),
            ),
            templated(
                "",
                call("run_shell", command="ln -s /etc/shadow s; setsid sleep 300 & nohup sleep 300 >/dev/null 2>&1 & echo started"),
                call("read_file", path="s"),
                call("run_python", code="import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)"),
            ),
            answer_with(task["solution"]),
        ],
        options=options,
    )
    texts = [[r["content"] for r in i["tool_results"]] for i in infos[:3]]
    statuses = [[r["status"] for r in i["tool_results"]] for i in infos[:3]]
    assert statuses == [["ok"] * 3, ["ok", "ok", "error"], ["ok", "error", "ok"]], texts
    bomb, memory, loop = texts[0]
    assert bomb.startswith("Error: timed out after 2 s; the process and its children were killed.")
    assert memory.startswith("Error: ran out of memory (limit 256 MB).")
    assert loop == "Error: timed out after 2 s; the process and its children were killed."
    flood, shadow, passwd = texts[1]
    assert flood.startswith("exit code: 0\nstdout:\nzzzz") and "MB more of stdout dropped" in flood
    assert "characters cut" in flood  # then cut again to the env's token budget
    assert "root:" not in shadow
    if isolation == "bwrap":
        assert "[project]" not in shadow and "No such file" in shadow
    assert passwd == "Error: read_file: path '../../../etc/passwd' is outside the workspace"
    started, link, net = texts[2]
    assert started == "exit code: 0\nstdout:\nstarted"
    assert link == "Error: read_file: 's' is a symlink; it is not followed"
    assert net.startswith("exit code: 1\nstderr:\nTraceback") and ("refused" in net or "unreachable" in net or "timed out" in net)
    assert infos[-1]["final_reward"] == 1.0 and traj.reward == 1.0  # the episode went on, and was scored
    env.close()
    assert sandbox_processes() == procs and sandbox_dirs() == dirs


# ---------------------------------------------------------------- lifecycle
class Tracked:
    """A factory of local sandboxes that counts how often each is closed."""

    def __init__(self) -> None:
        self.made: list[LocalSandbox] = []
        self.closes: dict[int, int] = {}

    def __call__(self) -> LocalSandbox:
        sb = LocalSandbox(isolation="none")
        close = sb.close

        def counted() -> None:
            self.closes[id(sb)] = self.closes.get(id(sb), 0) + 1
            close()

        sb.close = counted  # type: ignore[method-assign]
        self.made.append(sb)
        return sb

    def all_closed_once(self) -> bool:
        return all(sb.closed and self.closes.get(id(sb)) == 1 for sb in self.made)


def test_each_sandbox_is_closed_exactly_once_whatever_happens(qwen25):
    factory = Tracked()
    fails = {"reward": None}

    def reward(text, task):
        if fails["reward"]:
            raise fails["reward"]
        return 0.5

    env = ShellEnv(qwen25, sandbox_factory=factory, reward_fn=reward)
    env.reset(seed=1)
    env.step(templated("Done.")(env))  # an episode that ends
    assert len(factory.made) == 1 and factory.all_closed_once() and env.sandbox is None
    env.reset(seed=2)
    env.step(templated("", call("run_shell", command="ls"))(env))
    env.reset(seed=3)  # abandoned mid-episode: closed by the next reset
    assert factory.made[1].closed
    with pytest.raises(ValueError):
        env.step(np.array([-1]))  # a malformed action is the caller's bug: the episode goes on
    assert not factory.made[2].closed
    fails["reward"] = RuntimeError("the reward broke")
    with pytest.raises(RuntimeError, match="the reward broke"):
        env.step(templated("Done.")(env))
    assert factory.made[2].closed
    fails["reward"] = KeyboardInterrupt()
    env.reset(seed=4)
    with pytest.raises(KeyboardInterrupt):
        env.step(templated("Done.")(env))
    fails["reward"] = None
    env.reset(seed=5)
    env.close()  # closed mid-episode
    env.close()
    assert len(factory.made) == 5 and factory.all_closed_once()


def test_ctrl_c_during_a_tool_call_closes_the_sandbox_and_kills_the_call(qwen25):
    import signal

    from sandbox_escapes import wait_no_host_pids

    env = ShellEnv(qwen25, sandbox_kwargs={"timeout_s": 30})
    env.reset(seed=0)
    sb = env.sandbox
    marker = "tgctrlc" + os.urandom(4).hex()

    def interrupt(*_):
        raise KeyboardInterrupt

    # The action is built before the timer starts: on a loaded machine building it can take a
    # second, and the interrupt must land inside step.
    action = templated("", call("run_shell", command=f"exec sh -c 'sleep 60 & sleep 60' {marker}"))(env)
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            env.step(action)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert sb.closed and env.sandbox is None
    wait_no_host_pids(marker)
    env.reset(seed=1)  # and the env goes on
    _, _, _, _, info = env.step(templated("", call("run_shell", command="echo again"))(env))
    assert info["tool_results"][0]["content"] == "exit code: 0\nstdout:\nagain"
    env.close()


def test_a_failing_setup_closes_the_new_sandbox(qwen25):
    factory = Tracked()

    class Broken(ShellEnv):
        def setup_sandbox(self, sandbox, task):
            raise OSError("disk full")

    env = Broken(qwen25, sandbox_factory=factory)
    with pytest.raises(OSError, match="disk full"):
        env.reset(seed=0)
    assert factory.all_closed_once() and env.sandbox is None
    env.close()


def test_sandbox_arguments_reach_the_sandbox(qwen25):
    env = gym.make("tokengym/Shell-v0", tokenizer=qwen25, sandbox_kwargs={"isolation": "none", "timeout_s": 3})
    env.reset(seed=0)
    sb = env.unwrapped.sandbox
    assert isinstance(sb, LocalSandbox) and sb.limits.timeout_s == 3 and not sb.isolation.network
    assert "at most 3 s" in env.unwrapped.tools["run_shell"].schema["function"]["description"]
    env.close()
    with pytest.raises(ValueError, match='"local" or "docker"'):
        PythonSandboxEnv(qwen25, sandbox="firecracker")
    with pytest.raises(ValueError, match="unknown sandbox tool"):
        ShellEnv(qwen25, sandbox_tools=["run_rust"])
    env = ShellEnv(qwen25, sandbox_tools=["run_shell"], sandbox_kwargs={"isolation": "none"})
    env.reset(seed=0)
    assert list(env.tools) == ["run_shell"]
    env.close()
    assert issubclass(PythonSandboxEnv, SandboxToolEnv) and issubclass(ShellEnv, SandboxToolEnv)


@pytest.mark.parametrize("env_cls", [PythonSandboxEnv, ShellEnv])
def test_check_env_without_bubblewrap(env_cls, qwen25):
    env = env_cls(qwen25, sandbox_kwargs={"isolation": "none"})
    check_env(env, skip_render_check=True)
    env.close()
    assert env.sandbox is None


@pytest.mark.slow
def test_100_episodes_leave_no_process_directory_fd_or_thread(qwen25):
    env = PythonSandboxEnv(qwen25)
    leftovers = "sleep 300 & nohup sleep 300 >/dev/null 2>&1 & setsid sleep 300 >/dev/null 2>&1 & echo ok"
    act_shell = templated("", call("run_shell", command=leftovers))
    act_python = templated("", call("run_python", code="import subprocess\nsubprocess.Popen(['sleep', '300'])\nprint('ok')"))
    act_final = templated("No code, sorry.")
    env.reset(seed=0)  # warm up (probe, lazy imports, the tool runner's idle worker thread)
    env.step(act_python(env))
    env.step(act_final(env))
    procs, dirs, fds, threads = sandbox_processes(), sandbox_dirs(), fd_targets(), threading.active_count()
    for i in range(100):  # every case (both tools, an abandoned episode) comes round ten times
        env.reset(seed=i)
        _, _, term, _, info = env.step((act_shell if i % 2 else act_python)(env))
        assert not term and info["tool_results"][0]["content"].endswith("ok"), info["tool_results"]
        if i % 10 != 3:  # every tenth episode is abandoned mid-way: the next reset closes it
            _, _, term, _, _ = env.step(act_final(env))
            assert term and env.sandbox is None
    env.close()
    assert sandbox_processes() == procs
    assert sandbox_dirs() == dirs
    assert_no_more_fds_than(fds)
    assert threading.active_count() == threads


# ------------------------------------------------------------------ docker
@pytest.mark.docker
def test_envs_on_the_docker_backend(qwen25):
    try:
        make_sandbox("docker").close()
    except (ImportError, SandboxError) as err:
        missing("DOCKER", f"no Docker sandbox: {err}")
    env = PythonSandboxEnv(qwen25, sandbox="docker")
    env.reset(seed=0, options={"task_id": "coding-merge_intervals"})
    task = env.task
    env.step(templated("", call("run_python", code="print(sum(range(10)))"))(env))
    _, reward, term, _, info = env.step(answer_with(task["solution"])(env))
    assert term and reward == 1.0, info.get("grade")
    env.close()
    env = ShellEnv(qwen25, sandbox="docker")
    for kind in SHELL_KINDS:
        env.reset(seed=3, options={"kind": kind, "problem_seed": 3})
        _, _, _, _, info = env.step(templated("", call("run_shell", command=_shell_solution(env.task)))(env))
        _, reward, _, _, info = env.step(templated("Done.")(env))
        assert reward == 1.0, (kind, info["check"])
    env.close()


# -------------------------------------------------------------------- docs
DOCS = Path(__file__).resolve().parents[1] / "docs" / "sandboxes.md"


def test_the_sandbox_docs_run():
    """Every ```python block of docs/sandboxes.md runs, in order, in one namespace, and leaves nothing."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) >= 3
    dirs, procs = sandbox_dirs(), sandbox_processes()
    ns: dict = {"__name__": "sandbox_docs"}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), ns)
    assert sandbox_dirs() == dirs and sandbox_processes() == procs


# ------------------------------------------------------- between episodes
# Where the local sandboxes' folders are on the host (the spy looks there for a sibling's files).
SANDBOXES = os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")
SPY = """
import glob, os, time
# the patterns are put together here, so that they are in no file or argv of the spy's own
patterns = [b"tgspy" + bytes.fromhex("{hexed}"), b'"kind": "ans' + b'wer"']
me, end, scans, leaks = os.getpid(), time.time() + {seconds}, 0, set()
while time.time() < end:
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != me:
            for what in ("cmdline", "environ"):
                try:
                    with open(f"/proc/{{pid}}/{{what}}", "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if any(p in data for p in patterns):
                    leaks.add("LEAK-PROC-" + what)
    for d in glob.glob({sandboxes!r}):
        names = [f"run/snippets/snippet_{{i}}.py" for i in range(6)] + ["work/answer.txt"]
        for path in [os.path.join(d, n) for n in names] + glob.glob(os.path.join(d, "work", ".grade-*", "solution.py")):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if any(p in data for p in patterns):
                leaks.add("LEAK-FILE " + path)
    scans += 1
print(sorted(leaks), "scans", scans)
"""


def test_concurrent_episodes_of_one_task_cannot_read_each_other(qwen25, isolation):
    """Two episodes of the same task at once, one spying on the other (its processes' argv and
    environment, the snippets and the grader's files of every sandbox on the host): nothing of
    the other's code, answer or expected result reaches the spy."""
    spy_on_a_concurrent_episode(qwen25, {"sandbox_kwargs": {"isolation": isolation, "timeout_s": 30}})


@pytest.mark.docker
def test_concurrent_docker_episodes_cannot_read_each_other(qwen25):
    try:
        make_sandbox("docker").close()
    except (ImportError, SandboxError) as err:
        missing("DOCKER", f"no Docker sandbox: {err}")
    spy_on_a_concurrent_episode(qwen25, {"sandbox": "docker", "sandbox_kwargs": {"timeout_s": 30}})


def spy_on_a_concurrent_episode(qwen25, kwargs: dict) -> None:
    token = "tgspy" + os.urandom(6).hex()
    spy = PythonSandboxEnv(qwen25, **kwargs)
    spy.reset(seed=0, options={"task_id": "coding-fibonacci"})
    victim = PythonSandboxEnv(qwen25, **kwargs)
    victim.reset(seed=0, options={"task_id": "coding-fibonacci"})
    shell_victim = ShellEnv(qwen25, **kwargs)
    shell_victim.reset(seed=0, options={"kind": "find", "problem_seed": 7})
    box: dict = {}
    spying = threading.Thread(
        target=lambda: box.setdefault(
            "info", spy.step(templated("", call("run_python", code=SPY.format(seconds=6, hexed=token[5:].encode().hex(), sandboxes=SANDBOXES)))(spy))[4]
        )
    )
    spying.start()
    try:
        time.sleep(1.0)
        for _ in range(4):  # the victims work, answer and are graded meanwhile
            _, _, _, _, info = victim.step(
                templated("", call("run_python", code=f"# {token}\nimport time\ntime.sleep(0.5)\nprint(1)"))(victim)
            )
            assert info["tool_results"][0]["content"].endswith("1"), info["tool_results"]
        task = victim.task
        _, reward, term, _, info = victim.step(answer_with(f"# {token}\n{task['solution']}")(victim))
        assert term and reward == 1.0, info.get("grade")
        shell_victim.step(templated("", call("run_shell", command=f"echo {token} > answer.txt"))(shell_victim))
        _, _, term, _, info = shell_victim.step(templated("Done.")(shell_victim))
        assert term and info["check"]["pass"] is False
    finally:
        spying.join(30)
        for env in (spy, victim, shell_victim):
            env.close()
    seen = box["info"]["tool_results"][0]["content"]
    assert "scans" in seen and "scans 0" not in seen and "[]" in seen, seen  # the spy really looked, and saw nothing
    assert "LEAK" not in seen and token not in seen, seen
    assert '"kind": "answer"' not in seen, seen


# ------------------------------------------------------------- graders
def test_a_grader_fed_hostile_results_gives_zero_with_a_reason():
    task = task_by_id("coding-fibonacci")
    hostile = (
        f"{task['solution']}\n"
        "import os\n"
        "with open('results.jsonl', 'w') as f:\n"
        "    f.write('[' * 100000 + '\\n')\n"
        "os._exit(0)\n"
    )
    with LocalSandbox(isolation="none") as sb:
        grade = grade_solution(sb, hostile, task)
        assert grade.passed == 0 and not grade.all_passed
        assert "could not be read" in grade.error and "nested" in grade.error, grade
        huge = f"{task['solution']}\n_real = {task['entry_point']}\ndef {task['entry_point']}(*a):\n    return 10 ** 100000\n"
        grade = grade_solution(sb, huge, task)
        assert grade.passed == 0 and grade.failures, grade
        assert all("not serializable" in f or "cannot be compared" in f for f in grade.failures), grade.failures


def test_check_in_sandbox_takes_its_expected_state_on_stdin():
    task = shell_task(3, "find")
    with LocalSandbox(isolation="none") as sb:
        for path, content in task["files"].items():
            sb.write_file(path, content)
        sb.write_file("answer.txt", task["check"]["expected"])
        assert check_in_sandbox(sb, task["check"]) == {"pass": True, "detail": f"answer.txt holds {task['check']['expected']!r}"}
    import inspect

    source = inspect.getsource(check_in_sandbox)
    assert "stdin=json.dumps(check)" in source and "CHECKER, json.dumps" not in source


# -------------------------------------------------------------- render
def test_render_shows_terminal_escapes_from_tool_output_without_obeying_them(qwen25):
    env = ShellEnv(qwen25, render_mode="ansi", sandbox_kwargs={"isolation": "none"})
    env.reset(seed=0)
    env.step(templated("", call("run_shell", command=r"printf '\033]0;pwned\007\033[2J\033[1;1Hfake\rover'"))(env))
    out = env.render()
    env.close()
    assert "\x1b]0;" not in out and "\x1b[2J" not in out and "\x07" not in out and "\r" not in out
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in out
    ours = {m.group(0) for m in re.finditer(r"\x1b\[[0-9;]*m", out)}
    assert ours <= {"\x1b[32m", "\x1b[90m", "\x1b[0m"}, ours  # only the segment colours remain
