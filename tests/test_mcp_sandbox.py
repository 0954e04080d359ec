"""MCP servers run inside a sandbox: ``MCPTools(command, sandbox="local" | "docker" | {...})``.

An untrusted server's command runs under the sandbox's isolation for its whole life: the local
sandbox's bubblewrap (no network, a read-only system, its own uid and an empty workspace) or a
hardened Docker container (``docker exec -i``). The servers are real: the fault server and the
time server, installed by ``tests/mcp_servers.py`` in a venv any uid can run (a root host's local
sandbox runs as a uid of its own). The Docker tests build an image of their own from the sandbox
image with that venv in it, and remove it. Processes are found by a tag each test puts in its
server's command line, so the checks see only what these tests started.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from mcp_servers import any_user_fault_server, server_command
from needs import missing, requires
from sandbox_escapes import host_pids_with
from test_mcp import ANSWER, TASKS, make_env
from test_tool_env import call, play, templated

from tokengym.envs import MCPServerError, MCPTools, ToolEnv
from tokengym.envs.sandbox import SandboxError

pytestmark = pytest.mark.mcp


def tagged_fault_server() -> tuple[list[str], str]:
    """The fault server's argv with a tag of its own (an argument the server ignores)."""
    tag = f"tokengym-test-{uuid.uuid4().hex[:12]}"
    return [*any_user_fault_server(), tag], tag


def processes_with(tag: str) -> list[int]:
    """Live processes whose command line holds ``tag``."""
    return host_pids_with(tag, live=True)


def no_process_with(tag: str, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while processes_with(tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def probe(env, **arguments) -> dict:
    _, infos = play(env, [templated("", call("probe", **arguments)), ANSWER])
    result = infos[0]["tool_results"][0]
    assert result["status"] == "ok", result
    return json.loads(result["content"])


def note(env, name: str) -> str:
    _, infos = play(env, [templated("", call("note", file=name)), ANSWER])
    return infos[0]["tool_results"][0]["content"]


def tokyo_time(env) -> None:
    """The time server behind ``env`` converts 12:00 UTC to Tokyo's 21:00; the env is closed after."""
    try:
        _, infos = play(env, [templated("", call("convert_time", source_timezone="UTC", time="12:00", target_timezone="Asia/Tokyo")), ANSWER])
        result = infos[0]["tool_results"][0]
        assert result["status"] == "ok" and "21:00" in result["content"], result
    finally:
        env.close()


@pytest.fixture
def sandbox_root():
    """A folder of this test's own for the local sandboxes' workspaces (any uid may enter it)."""
    root = tempfile.mkdtemp(prefix="tokengym-mcp-sandboxes-")
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def require_bwrap() -> None:
    from tokengym.envs.sandbox import bwrap_status

    status = bwrap_status()
    if not status.works:
        missing("BWRAP", f"bubblewrap does not work here (apt-get install -y --no-install-recommends bubblewrap): {status.reason}")


# ------------------------------------------------------------------- local
def test_a_server_in_the_local_sandbox_sees_only_its_workspace(qwen3, sandbox_root):
    require_bwrap()
    argv, tag = tagged_fault_server()
    outside = tempfile.mkdtemp(prefix="tokengym-mcp-outside-")
    os.chmod(outside, 0o777)  # open to every uid: only the sandbox keeps the server out
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        env = make_env(qwen3, MCPTools(argv, sandbox={"backend": "local", "tmp_root": sandbox_root}))
        try:
            seen = probe(env, path=os.path.join(outside, "escaped.txt"), port=port)
            # On the host, a probe of the same kind reaches both.
            assert socket.create_connection(("127.0.0.1", port), timeout=2)
        finally:
            env.close()
    try:
        assert seen["wrote"] is False and not os.listdir(outside), seen
        assert seen["connected"] is False, seen  # no network inside: the host's loopback is not there
        assert seen["hostname"] != socket.gethostname()
        if os.geteuid() == 0:
            assert seen["uid"] != 0  # a root host's sandbox runs as a uid of its own
        assert no_process_with(tag)
        assert os.listdir(sandbox_root) == []  # the workspace went with the env
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_the_time_server_answers_from_the_local_sandbox(qwen3, sandbox_root):
    require_bwrap()
    tokyo_time(make_env(qwen3, MCPTools(server_command("time", any_user=True), sandbox={"backend": "local", "tmp_root": sandbox_root})))
    assert os.listdir(sandbox_root) == []


def test_a_restart_resets_the_sandbox(qwen3, sandbox_root):
    require_bwrap()
    argv, tag = tagged_fault_server()
    env = make_env(qwen3, MCPTools(argv, sandbox={"backend": "local", "tmp_root": sandbox_root}))
    try:
        assert note(env, "first.txt").split() == ["first.txt"]  # an empty workspace to begin with
        assert note(env, "second.txt").split() == ["first.txt", "second.txt"]  # kept across episodes
        _, infos = play(env, [templated("", call("crash")), ANSWER])
        assert infos[0]["tool_results"][0]["status"] == "error"
        # The next episode restarts the server in the same sandbox, emptied: what it wrote is gone.
        traj, infos = play(env, [templated("", call("note", file="third.txt")), ANSWER])
        assert infos[0]["tool_results"][0]["content"].split() == ["third.txt"]
        assert infos[-1]["tool_stats"]["server_restarts"] == 1
        assert len(processes_with(tag)) >= 1
    finally:
        env.close()
    assert no_process_with(tag)
    assert os.listdir(sandbox_root) == []


def test_scope_episode_gives_each_episode_an_empty_sandbox(qwen3, sandbox_root):
    require_bwrap()
    argv, tag = tagged_fault_server()
    env = make_env(qwen3, MCPTools(argv, scope="episode", sandbox={"backend": "local", "tmp_root": sandbox_root}))
    try:
        assert [note(env, f"{i}.txt").split() for i in range(3)] == [["0.txt"], ["1.txt"], ["2.txt"]]
    finally:
        env.close()
    assert no_process_with(tag)


def test_a_sandbox_limit_holds_for_the_server(qwen3, sandbox_root):
    require_bwrap()
    argv, _ = tagged_fault_server()
    # A server that needs more memory than its sandbox allows does not start; the error says where.
    with pytest.raises(MCPServerError, match=r"\(in a local sandbox\)"):
        ToolEnv(qwen3, TASKS, [MCPTools(argv, sandbox={"backend": "local", "tmp_root": sandbox_root, "memory_mb": 8}, start_timeout=20)])
    assert os.listdir(sandbox_root) == []


@requires("ROOT", None if os.geteuid() == 0 else "a sandbox of its own uid is for root hosts")
def test_a_server_the_sandbox_uid_cannot_reach_is_a_named_error(qwen3, sandbox_root):
    require_bwrap()
    private = tempfile.mkdtemp(prefix="tokengym-mcp-private-")  # 0700: no other uid enters it
    try:
        script = Path(private) / "server.py"
        script.write_text("#!/usr/bin/python3\nprint('never runs')\n")
        script.chmod(0o755)
        with pytest.raises(MCPServerError, match=r"cannot reach .*tokengym-mcp-private-.*install what it runs where any user can read it"):
            ToolEnv(qwen3, TASKS, [MCPTools([str(script)], sandbox={"backend": "local", "tmp_root": sandbox_root})])
    finally:
        shutil.rmtree(private, ignore_errors=True)
    assert os.listdir(sandbox_root) == []


def test_sandbox_arguments_are_checked_when_made():
    for bad, error, message in [
        ({"command": "x", "sandbox": "vm"}, ValueError, 'must be "local" or "docker"'),
        ({"command": "x", "sandbox": 3}, TypeError, 'sandbox= is "local", "docker" or a dict'),
        ({"url": "http://h/mcp", "sandbox": "local"}, ValueError, "a url= server runs wherever someone started it"),
        ({"command": "x", "cwd": "/tmp", "sandbox": "local"}, ValueError, "leave cwd= out"),
        ({"command": "x", "sandbox": {"backend": "local", "ro_binds": {1}}}, TypeError, "must be JSON values"),
    ]:
        with pytest.raises(error, match=message):
            MCPTools(**bad)
    tools = MCPTools("srv --flag", sandbox="local")
    assert tools.label == "srv --flag (in a local sandbox)"
    # The spec keeps the limits a server's whole life needs unless they are given.
    assert json.loads(MCPTools("srv", sandbox={"backend": "docker", "memory_mb": 256})._spec.sandbox_options) == {"cpu_s": 3600, "memory_mb": 256}
    # The dict form travels in env kwargs and on the CLI.
    assert MCPTools.coerce({"command": "srv", "sandbox": "local"}) == tools.__class__("srv", sandbox="local")


def test_a_sandbox_that_cannot_be_made_fails_the_build(qwen3):
    with pytest.raises(MCPServerError, match="its sandbox failed"):
        ToolEnv(qwen3, TASKS, [MCPTools("/usr/bin/python3 -c pass", sandbox={"backend": "local", "tmp_root": "/nonexistent/tokengym"})])


def test_rollout_cli_runs_mcp_servers_in_a_sandbox(qwen3, tmp_path, capsys, sandbox_root, monkeypatch):
    import shlex

    from tokengym.recorder import read_trajectories
    from tokengym.recorder.cli import main

    require_bwrap()
    monkeypatch.setattr(tempfile, "tempdir", sandbox_root)  # where the CLI's local sandbox makes its workspace
    argv, tag = tagged_fault_server()
    probe_call = '<tool_call>\n{"name": "probe", "arguments": {}}\n</tool_call>'
    code = main([
        "rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen3",
        "--mcp", shlex.join(argv), "--mcp-sandbox", "local", "--reply", probe_call, "--reply", "<answer>5</answer>",
        "--episodes", "2", "--out", str(tmp_path / "store"), "--quiet",
    ])
    assert code == 0 and "2 done, 0 failed" in capsys.readouterr().out
    for t in read_trajectories(tmp_path / "store"):
        first, end = t.action_spans[0][1], t.action_spans[1][0]
        seen = json.loads(qwen3.decode(t.token_ids[first:end].tolist()).split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0])
        assert seen["hostname"] != socket.gethostname()  # the probe ran inside the sandbox
    assert no_process_with(tag) and os.listdir(sandbox_root) == []
    # A URL cannot be sandboxed, and --mcp-sandbox alone names what it lacks.
    common = ["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen3", "--reply", "x"]
    assert main([*common, "--mcp", "http://127.0.0.1:1/mcp", "--mcp-sandbox", "local", "--out", str(tmp_path / "u")]) == 2
    assert "is a URL" in capsys.readouterr().err
    assert main([*common, "--mcp-sandbox", "docker", "--out", str(tmp_path / "v")]) == 2
    assert "name one with --mcp" in capsys.readouterr().err


# ------------------------------------------------------------------ docker
MCP_IMAGE_ROOT = "/opt/tokengym-mcp"


@pytest.fixture(scope="module")
def mcp_image():
    """A sandbox image of this module's own: the sandbox image with the servers' venv at
    ``MCP_IMAGE_ROOT`` (the venv's interpreter is the image's /usr/bin/python3). Removed after."""
    try:
        import docker  # noqa: F401
    except ImportError:
        missing("DOCKER", 'the docker SDK is not installed (pip install "tokengym[docker]")')
    from tokengym.envs.sandbox import docker as backend

    try:
        client = backend.docker_client()
    except SandboxError as err:
        missing("DOCKER", str(err))
    if shutil.which("docker") is None:
        missing("DOCKER", "the docker CLI is not on PATH (a sandboxed server is started with docker exec)")
    base = os.environ.get("TOKENGYM_SANDBOX_IMAGE") or backend.DEFAULT_IMAGE
    try:
        client.api.inspect_image(base)
    except Exception:
        missing("DOCKER", f"the sandbox image {base!r} is missing: build it with `bash .ci/sandbox-image.sh`")
    venv = Path(any_user_fault_server()[0]).parent.parent
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        tar.add(venv, arcname=MCP_IMAGE_ROOT.lstrip("/"))
    tag = f"tokengym-mcp-test:{uuid.uuid4().hex[:12]}"
    container = client.api.create_container(base, command=["true"])
    try:
        client.api.put_archive(container, "/", data.getvalue())
        client.api.commit(container, repository=tag.split(":")[0], tag=tag.split(":")[1])
    finally:
        client.api.remove_container(container, force=True)
    try:
        yield client, tag
    finally:
        for c in client.api.containers(all=True, filters={"ancestor": tag}):
            client.api.remove_container(c["Id"], force=True)
        client.api.remove_image(tag, force=True)


@pytest.mark.docker
def test_a_server_in_a_docker_sandbox_is_held_by_the_container(qwen3, mcp_image):
    client, image = mcp_image
    python, script = f"{MCP_IMAGE_ROOT}/bin/python", f"{MCP_IMAGE_ROOT}/mcp_fault_server.py"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        env = make_env(qwen3, MCPTools([python, script], sandbox={"backend": "docker", "image": image}))
        try:
            seen = probe(env, path="/etc/escaped.txt", port=port)
            assert seen["wrote"] is False and seen["connected"] is False, seen
            assert (seen["uid"], seen["cwd"], seen["hostname"]) == (1000, "/workspace", "sandbox")
            assert client.api.containers(filters={"ancestor": image})  # the server's container is up
            assert note(env, "a.txt").split() == ["a.txt"]
            play(env, [templated("", call("crash")), ANSWER])
            # Restarted in the same container, reset: the workspace is empty again.
            _, infos = play(env, [templated("", call("note", file="b.txt")), ANSWER])
            assert infos[0]["tool_results"][0]["content"].split() == ["b.txt"]
            assert infos[-1]["tool_stats"]["server_restarts"] == 1
        finally:
            env.close()
    assert client.api.containers(all=True, filters={"ancestor": image}) == []  # closed with the env


@pytest.mark.docker
def test_the_time_server_answers_from_a_docker_sandbox(qwen3, mcp_image):
    _, image = mcp_image
    tokyo_time(make_env(qwen3, MCPTools([f"{MCP_IMAGE_ROOT}/bin/python", "-m", "mcp_server_time"], sandbox={"backend": "docker", "image": image})))


@pytest.mark.docker
def test_a_command_the_image_lacks_fails_the_build_with_its_stderr(qwen3, mcp_image):
    client, image = mcp_image
    with pytest.raises(MCPServerError, match=r"failed to start[\s\S]*not JSON-RPC ---\n.*no-such-server") as err:
        ToolEnv(qwen3, TASKS, [MCPTools(["/usr/bin/no-such-server"], sandbox={"backend": "docker", "image": image}, start_timeout=20)])
    assert "(in a docker sandbox)" in str(err.value)
    assert client.api.containers(all=True, filters={"ancestor": image}) == []
