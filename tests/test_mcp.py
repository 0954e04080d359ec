"""MCP tools: real MCP servers' tools in a ToolEnv, on the real Qwen3 template.

The servers are real processes: the reference servers (``mcp-server-time`` and
``mcp-server-sqlite`` from PyPI, ``@modelcontextprotocol/server-everything`` from npm), installed
pinned by ``tests/mcp_servers.py``, and ``tests/mcp_fault_server.py``, a server written with the
SDK's own server class that crashes, hangs, fails to start or lists a bad schema on request.
Every episode is played with real tool-call text through :func:`test_tool_env.play`, which
checks the token law on the way. Process checks look only at the servers these tests started
(by the pid a server reports itself).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mcp_servers import server_command
from test_tool_env import call, play, templated

from tokengym.envs import MCPServerError, MCPTools, ToolEnv, answer_reward
from tokengym.envs.mcp import result_text_of
from tokengym.recorder import RecordEpisodes

pytestmark = pytest.mark.mcp

FAULT = [sys.executable, str(Path(__file__).with_name("mcp_fault_server.py"))]
TASKS = [{"id": "t0", "prompt": "Use the tools, then answer as <answer>N</answer>.", "answer": 5}]
ANSWER = templated("<answer>5</answer>")


def fault(**kwargs) -> MCPTools:
    env = kwargs.pop("env", None)
    return MCPTools(FAULT, env=env, **kwargs)


def make_env(tokenizer, *servers, **kwargs):
    kwargs.setdefault("tool_timeout", 10.0)
    return RecordEpisodes(ToolEnv(tokenizer, TASKS, list(servers), reward_fn=answer_reward, **kwargs))


def gone(pid: int, within: float = 20.0) -> bool:
    """Whether process ``pid`` ended (exited or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def server_pid(env) -> int:
    """The pid of the fault server behind ``env``, asked through one episode's tool call."""
    _, infos = play(env, [templated("", call("pid")), ANSWER])
    return int(infos[0]["tool_results"][0]["content"])


# ------------------------------------------------------------ reference servers
def test_time_server_answers_a_call_in_an_episode(qwen3):
    env = make_env(qwen3, MCPTools(server_command("time")))
    try:
        env.reset(seed=0)
        assert {"get_current_time", "convert_time"} <= set(env.unwrapped.tools)
        traj, infos = play(
            env,
            [templated("", call("convert_time", source_timezone="UTC", time="12:00", target_timezone="Asia/Tokyo")), ANSWER],
        )
        result = infos[0]["tool_results"][0]
        assert result["status"] == "ok", result
        assert "Asia/Tokyo" in result["content"] and "21:00" in result["content"]
        assert result["content"] in infos[0]["obs_text"]  # the model reads the server's answer
        assert traj.reward == 1.0
        # An argument the schema refuses is the model's invalid call; it never reaches the server.
        _, infos = play(env, [templated("", call("get_current_time", timezone=3)), ANSWER])
        assert infos[0]["tool_results"][0]["status"] == "invalid_arguments"
    finally:
        env.close()


def test_sqlite_server_keeps_its_database_across_an_episodes_calls(qwen3, tmp_path):
    db = tmp_path / "shop.db"
    env = make_env(qwen3, MCPTools([*server_command("sqlite"), "--db-path", str(db)], include=["write_query", "read_query", "create_table"]))
    try:
        env.reset(seed=0)
        assert sorted(env.unwrapped.tools) == ["create_table", "read_query", "write_query"]
        _, infos = play(
            env,
            [
                templated("", call("create_table", query="CREATE TABLE items (name TEXT, n INTEGER)")),
                templated("", call("write_query", query="INSERT INTO items VALUES ('pen', 5)")),
                templated("", call("read_query", query="SELECT n FROM items WHERE name = 'pen'")),
                ANSWER,
            ],
        )
        assert [i["tool_results"][0]["status"] for i in infos[:3]] == ["ok", "ok", "ok"]
        assert "5" in infos[2]["tool_results"][0]["content"]
        assert db.exists()
        # The server's own error (bad SQL) is a tool error the model reads, not a crash.
        _, infos = play(env, [templated("", call("read_query", query="SELECT nope FROM items")), ANSWER])
        first = infos[0]["tool_results"][0]
        assert "no such column: nope" in first["content"], first  # the server says it as text, not as isError
    finally:
        env.close()


def test_everything_server_text_sums_images_and_structured_content(qwen3):
    env = make_env(qwen3, MCPTools(server_command("everything"), exclude=["trigger-long-running-operation"]))
    try:
        _, infos = play(
            env,
            [
                templated("", call("echo", message="hello"), call("get-sum", a=2, b=3)),
                templated("", call("get-tiny-image")),
                templated("", call("get-structured-content", location="New York")),
                ANSWER,
            ],
        )
        echo, total = infos[0]["tool_results"]
        assert (echo["status"], echo["content"]) == ("ok", "Echo: hello")
        assert "5" in total["content"]
        image = infos[1]["tool_results"][0]
        assert image["status"] == "ok" and "[image: image/png," in image["content"] and "kept as data" in image["content"]
        kept = infos[1]["tool_data"]
        assert [(k["type"], k["mime_type"]) for k in kept] == [("image", "image/png")] and len(kept[0]["data"]) > 100
        assert "tool_data" not in infos[0]
        assert infos[2]["tool_results"][0]["status"] == "ok" and infos[2]["tool_results"][0]["content"]
        assert "trigger-long-running-operation" not in env.unwrapped.tools
    finally:
        env.close()


def test_a_long_call_times_out_and_is_cancelled_on_the_server(qwen3):
    env = make_env(qwen3, MCPTools(server_command("everything"), include=["trigger-long-running-operation", "echo"], timeout=0.5))
    try:
        start = time.monotonic()
        _, infos = play(env, [templated("", call("trigger-long-running-operation", duration=30, steps=2)), templated("", call("echo", message="after")), ANSWER])
        assert time.monotonic() - start < 10
        assert infos[0]["tool_results"][0]["status"] == "timeout"
        # The cancelled call left the connection usable: the next call of the episode answers.
        assert infos[1]["tool_results"][0]["content"] == "Echo: after"
    finally:
        env.close()


def test_streamable_http_server_by_url(qwen3):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*FAULT, "http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the HTTP fault server did not start"
                time.sleep(0.1)
        env = make_env(qwen3, MCPTools(url=f"http://127.0.0.1:{port}/mcp", prefix="web_"))
        try:
            _, infos = play(env, [templated("", call("web_echo", text="over http"), call("web_pid")), ANSWER])
            assert infos[0]["tool_results"][0]["content"] == "echo: over http"
            assert int(infos[0]["tool_results"][1]["content"]) == proc.pid
        finally:
            env.close()
        assert proc.poll() is None  # a URL server is someone else's: closing the env leaves it running
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------- faults
def test_a_crashed_server_is_an_error_message_then_restarted_and_counted(qwen3):
    env = make_env(qwen3, fault())
    try:
        first = server_pid(env)
        _, infos = play(env, [templated("", call("crash")), templated("", call("echo", text="still there?")), ANSWER])
        crashed, later = infos[0]["tool_results"][0], infos[1]["tool_results"][0]
        assert crashed["status"] == "error" and "stopped" in crashed["content"], crashed
        assert later["status"] == "error" and "restarted for the next episode" in later["content"], later
        assert gone(first)
        # The next episode starts a fresh server and counts the restart; the summary says so.
        traj, infos = play(env, [templated("", call("echo", text="back")), ANSWER])
        assert infos[0]["tool_results"][0]["content"] == "echo: back"
        assert infos[-1]["tool_stats"]["server_restarts"] == 1
        assert server_pid(env) != first
    finally:
        env.close()


def test_the_run_summary_counts_restarts(qwen3):
    from tokengym.policies import scripted_replies
    from tokengym.recorder import rollout, summary_table

    crash = '<tool_call>\n{"name": "crash", "arguments": {}}\n</tool_call>'
    result = rollout(lambda: make_env(qwen3, fault()).unwrapped, scripted_replies([crash, "<answer>5</answer>"], qwen3),
                     episodes=3, concurrency=1, progress=False)
    assert result.stats.tool_calls == {"calls": 3, "error": 3, "server_restarts": 2, "episodes": 3}
    line = next(x for x in summary_table(result.stats).splitlines() if x.startswith("tool calls"))
    assert line.split(None, 2)[2] == (
        "3 in 3 episodes: 3 valid (ok 0, error 3, timed out 0), 0 invalid; 2 restarts of MCP servers that stopped or hung"
    )
    for traj in result.trajectories:  # the server's error message is an observation: mask 0
        first, end = traj.action_spans[0][1], traj.action_spans[1][0]
        assert traj.mask[first:end].sum() == 0 and end > first


def test_a_hung_server_times_out_fails_its_ping_and_is_restarted(qwen3):
    env = make_env(qwen3, fault(timeout=0.5, ping_timeout=0.5))
    try:
        first = server_pid(env)
        start = time.monotonic()
        _, infos = play(env, [templated("", call("hang", seconds=60)), ANSWER])
        assert infos[0]["tool_results"][0]["status"] == "timeout"
        _, infos = play(env, [templated("", call("echo", text="awake")), ANSWER])
        assert time.monotonic() - start < 15
        assert infos[0]["tool_results"][0]["content"] == "echo: awake"
        assert infos[-1]["tool_stats"]["server_restarts"] == 1
        assert gone(first)
    finally:
        env.close()


def test_a_slow_call_that_timed_out_on_a_healthy_server_is_no_restart(qwen3):
    # The server answers its ping after the timed-out call, so it is kept (state and all).
    env = make_env(qwen3, fault(timeout=0.3))
    try:
        first = server_pid(env)
        play(env, [templated("", call("big", lines=10)), ANSWER])
        _, infos = play(env, [templated("", call("echo", text="x")), ANSWER])
        assert infos[-1]["tool_stats"]["server_restarts"] == 0 and server_pid(env) == first
    finally:
        env.close()


def test_tool_errors_and_long_outputs_are_what_the_model_reads(qwen3):
    env = make_env(qwen3, fault(), max_result_tokens=64)
    try:
        _, infos = play(env, [templated("", call("fail"), call("big")), templated("", call("pixel")), ANSWER])
        failed, big = infos[0]["tool_results"]
        assert failed["status"] == "error" and "fail" in failed["content"]
        assert big["status"] == "ok" and big["truncated"] and "characters cut" in big["content"]
        assert len(qwen3.encode(big["content"], add_special_tokens=False)) <= 64
        assert infos[1]["tool_results"][0]["content"] == "here:\n[image: image/png, 70 bytes, kept as data]"
        assert infos[1]["tool_data"][0]["mime_type"] == "image/png"
        assert infos[-1]["tool_stats"]["truncated"] == 1 and infos[-1]["tool_stats"]["error"] == 1
    finally:
        env.close()


def test_a_server_that_fails_to_start_fails_the_env_with_its_stderr(qwen3):
    with pytest.raises(MCPServerError, match="failed to start") as err:
        ToolEnv(qwen3, TASKS, [fault(env={"FAULT": "exit"})])
    assert "cannot open the database /nowhere/db.sqlite" in str(err.value)
    start = time.monotonic()
    with pytest.raises(MCPServerError, match=r"did not answer within 1 s \(start_timeout=...\)") as err:
        ToolEnv(qwen3, TASKS, [fault(env={"FAULT": "silent"}, start_timeout=1)])
    assert "fault: waiting for ever" in str(err.value)
    assert time.monotonic() - start < 10
    with pytest.raises(MCPServerError, match="'no-such-mcp-server' is not on PATH"):
        ToolEnv(qwen3, TASKS, [MCPTools("no-such-mcp-server --flag")])


def test_a_tool_whose_schema_is_not_an_object_names_the_fix(qwen3):
    with pytest.raises(MCPServerError, match=r"'odd' has an inputSchema that is not a valid JSON schema \(at properties/when/type: .*\); leave it out with exclude=\['odd'\]"):
        ToolEnv(qwen3, TASKS, [fault(env={"FAULT": "bad_schema"})])
    env = ToolEnv(qwen3, TASKS, fault(env={"FAULT": "bad_schema"}, exclude=["odd"]))  # one server: no list needed
    try:
        env.reset(seed=0)
        assert "odd" not in env.tools and "echo" in env.tools
    finally:
        env.close()


def test_names_the_server_does_not_list_and_clashing_names_are_errors(qwen3):
    with pytest.raises(MCPServerError, match="lists no tool 'echoo'"):
        ToolEnv(qwen3, TASKS, [fault(include=["echoo"])])
    with pytest.raises(ValueError, match="echo"):
        ToolEnv(qwen3, TASKS, [fault(include=["echo"]), fault(include=["echo", "pid"])])
    env = ToolEnv(qwen3, TASKS, [fault(include=["echo"]), fault(include=["echo"], prefix="b_")])
    try:
        env.reset(seed=0)
        assert sorted(env.tools) == ["b_echo", "echo"]
    finally:
        env.close()
    for bad, message in [
        ({}, "exactly one of"),
        ({"command": "x", "url": "http://h/mcp"}, "exactly one of"),
        ({"url": "ftp://h"}, "http:// or https://"),
        ({"command": "x", "scope": "run"}, "scope must be one of"),
        ({"command": "x", "timeout": 0}, "timeout must be positive"),
        ({"command": ""}, "command is empty"),
        ({"url": "http://h/mcp", "cwd": "/tmp"}, "a url= server is started by someone else"),
    ]:
        with pytest.raises(ValueError, match=message):
            MCPTools(**bad)


# ------------------------------------------------------------------ lifetimes
def test_scopes_env_episode_and_process(qwen3):
    kept = make_env(qwen3, fault(include=["count", "pid"]))
    fresh = make_env(qwen3, fault(include=["count", "pid"], scope="episode"))
    try:
        counts = [play(kept, [templated("", call("count")), ANSWER])[1][0]["tool_results"][0]["content"] for _ in range(2)]
        assert counts == ["1", "2"]  # scope="env": one server across the env's episodes
        counts = [play(fresh, [templated("", call("count")), ANSWER])[1][0]["tool_results"][0]["content"] for _ in range(2)]
        assert counts == ["1", "1"]  # scope="episode": a fresh server every episode, not counted as restarts
        assert play(fresh, [ANSWER])[1][-1]["tool_stats"]["server_restarts"] == 0
    finally:
        kept.close()
        fresh.close()
    a = make_env(qwen3, fault(scope="process"))
    b = make_env(qwen3, fault(scope="process"))
    try:
        shared = server_pid(a)
        assert server_pid(b) == shared
        a.close()
        assert not gone(shared, within=0.5)  # b still uses it
    finally:
        b.close()
    assert gone(shared)


def test_no_server_outlives_its_env_or_a_failed_build(qwen3):
    env = make_env(qwen3, fault())
    pid = server_pid(env)
    env.close()
    assert gone(pid)
    env.close()  # twice is fine
    # A build that fails after one server started (the second clashes) stops the first.
    other = ToolEnv(qwen3, TASKS, [fault(include=["pid"], prefix="x_")])
    try:
        other.reset(seed=0)
    finally:
        other.close()
    with pytest.raises(ValueError):
        ToolEnv(qwen3, TASKS, [fault(include=["echo"]), fault(include=["echo"])])


OWNER = textwrap.dedent(
    """
    import asyncio, sys, time
    from tokengym.envs.mcp import MCPTools
    opened = MCPTools({command!r}).open()
    pid = asyncio.run([t for t in opened.tools if t.name == "pid"][0].fn())
    print(pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_owner_takes_its_servers_with_it(sig):
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(command=FAULT)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        assert not gone(pid, within=0.2)
        os.kill(owner.pid, sig)
        owner.wait(timeout=10)
        assert gone(pid), f"the MCP server {pid} outlived its owner's {sig.name}"
    finally:
        owner.kill()
        owner.wait()


# -------------------------------------------------------------------- units
def test_mcp_tools_travel_as_data():
    tools = MCPTools("uvx mcp-server-time --local-timezone UTC", scope="process", include=["get_current_time"])
    back = pickle.loads(pickle.dumps(tools))
    assert back == tools and back.label == "uvx mcp-server-time --local-timezone UTC"
    assert MCPTools.coerce("http://127.0.0.1:1/mcp").url == "http://127.0.0.1:1/mcp"
    assert MCPTools.coerce(["a", "b c"]).command == ["a", "b c"]
    assert MCPTools.coerce({"command": "a", "prefix": "p_"}).prefix == "p_"
    with pytest.raises(TypeError, match="an MCP server is a command"):
        MCPTools.coerce(3)


def test_result_text_of_says_every_kind_of_content():
    from mcp_types import CallToolResult, EmbeddedResource, ImageContent, ResourceLink, TextContent, TextResourceContents
    from mcp_types import BlobResourceContents

    result = CallToolResult(
        content=[
            TextContent(type="text", text="a"),
            ImageContent(type="image", data="AAAA", mime_type="image/jpeg"),
            EmbeddedResource(type="resource", resource=TextResourceContents(uri="file:///n.txt", text="note")),
            EmbeddedResource(type="resource", resource=BlobResourceContents(uri="file:///b.bin", blob="AAAAAA==", mime_type="application/zip")),
            ResourceLink(type="resource_link", uri="file:///r.md", name="readme"),
        ]
    )
    text, kept = result_text_of(result)
    assert text.splitlines() == [
        "a",
        "[image: image/jpeg, 3 bytes, kept as data]",
        "note",
        "[resource file:///b.bin: application/zip, 4 bytes, kept as data]",
        "[resource link: file:///r.md (readme)]",
    ]
    assert [k["type"] for k in kept] == ["image", "resource"]
    structured = CallToolResult(content=[], structured_content={"temp": 21})
    assert result_text_of(structured) == ('{"temp": 21}', [])


# ------------------------------------------------------------------------ CLI
def test_rollout_cli_gives_any_tool_env_an_mcp_server(qwen3, tmp_path, capsys):
    import shlex

    from tokengym.recorder import read_trajectories
    from tokengym.recorder.cli import main

    out = tmp_path / "store"
    time_call = '<tool_call>\n{"name": "get_current_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    code = main([
        "rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen3",
        "--mcp", shlex.join(server_command("time")), "--reply", time_call, "--reply", "<answer>5</answer>",
        "--episodes", "2", "--out", str(out), "--quiet",
    ])
    assert code == 0 and "2 done, 0 failed" in capsys.readouterr().out
    trajs = list(read_trajectories(out))
    assert [t.metadata["tool_stats"]["ok"] for t in trajs] == [1, 1]  # the server's tool ran, beside calculate
    for t in trajs:  # the server's answer is in the observation that follows the call
        first, end = t.action_spans[0][1], t.action_spans[1][0]
        assert '"timezone": "UTC"' in qwen3.decode(t.token_ids[first:end].tolist())
    # Both forms at once are refused; a server that does not start fails the run, naming it.
    assert main(["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen3", "--reply", "x",
                 "--mcp", "a", "--env-kwarg", 'mcp_servers=["b"]', "--out", str(tmp_path / "y")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen3", "--reply", "x",
                 "--mcp", "no-such-mcp-server", "--out", str(tmp_path / "z"), "--quiet"]) != 0
    assert "'no-such-mcp-server' is not on PATH" in capsys.readouterr().err


def test_the_docs_example_runs(capsys, monkeypatch):
    """docs/mcp.md's Python blocks, as written (``mcp-server-time`` on PATH, as pip would put it)."""
    import re

    bin_dir = Path(server_command("time")[0]).parent
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "mcp.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert len(blocks) == 2  # the episode, then the sandboxed servers' descriptions
    for block in blocks:
        exec(compile(block, "docs/mcp.md", "exec"), {})
    shown = [line.split("#", 1)[1].strip() for block in blocks for line in block.splitlines() if "print(" in line]
    assert capsys.readouterr().out.splitlines() == shown  # each print shows what its comment says


@pytest.mark.ray
def test_ray_workers_start_their_own_servers_and_stop_them(qwen3, tmp_path, capsys):
    """``--backend ray``: the env (so its server) is built inside each env worker; the servers'
    pids come back in the observations, and none is left when the run ends."""
    import shlex

    from needs import missing

    from tokengym.recorder import read_trajectories
    from tokengym.recorder.cli import main

    try:
        import ray  # noqa: F401
    except ImportError:
        missing("RAY", 'Ray is not installed: pip install "tokengym[ray]"')
    pid_call = '<tool_call>\n{"name": "pid", "arguments": {}}\n</tool_call>'
    code = main([
        "rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen3", "--backend", "ray",
        "--mcp", shlex.join(FAULT), "--reply", pid_call, "--reply", "<answer>5</answer>",
        "--episodes", "3", "--concurrency", "1", "--out", str(tmp_path / "ray"), "--quiet",
    ])
    assert code == 0 and "3 done, 0 failed" in capsys.readouterr().out
    pids = set()
    for t in read_trajectories(tmp_path / "ray"):
        first, end = t.action_spans[0][1], t.action_spans[1][0]
        text = qwen3.decode(t.token_ids[first:end].tolist())
        pids.add(int(text.split("<tool_response>", 1)[1].split("</tool_response>", 1)[0]))
        assert t.metadata["tool_stats"]["ok"] == 1
    assert os.getpid() not in pids and all(gone(p) for p in pids), pids
