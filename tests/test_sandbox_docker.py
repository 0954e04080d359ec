"""The Docker sandbox against a real engine: hardening in effect, every escape attempt contained,
no call that hangs, the warm pool, orphan cleanup, and nothing left behind after 100 episodes.

Needs a Docker engine (``DOCKER_HOST`` or the default socket) with the sandbox image; CI starts a
private one with ``.ci/docker-up.sh``. Without an engine the tests skip with the reason, unless
``TOKENGYM_REQUIRE_DOCKER=1`` (CI), which turns that into a failure.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tokengym.envs.sandbox import Limits, SandboxError, make_sandbox

from sandbox_escapes import CHECKS, LIFECYCLE_CHECKS, check_params

pytestmark = pytest.mark.docker

REQUIRED = os.environ.get("TOKENGYM_REQUIRE_DOCKER") == "1"
REPO = Path(__file__).resolve().parents[1]


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"TOKENGYM_REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def engine():
    """The docker module's client, once it is known that an engine answers and the image is there."""
    try:
        import docker  # noqa: F401
    except ImportError:
        _unavailable('the docker SDK is not installed (pip install "tokengym[docker]")')
    from tokengym.envs.sandbox import docker as backend

    try:
        client = backend.docker_client()
    except SandboxError as e:
        _unavailable(str(e))
    image = os.environ.get("TOKENGYM_SANDBOX_IMAGE") or backend.DEFAULT_IMAGE
    try:
        client.api.inspect_image(image)
    except Exception:
        _unavailable(f"the sandbox image {image!r} is missing: build it with `bash .ci/sandbox-image.sh`")
    return client


@pytest.fixture
def backend(engine):
    from tokengym.envs.sandbox import docker as backend

    return backend


@pytest.fixture
def sb(engine):
    from tokengym.envs.sandbox import DockerSandbox

    with DockerSandbox(timeout_s=10) as sandbox:
        yield sandbox


def our_containers(engine, **labels) -> list[dict]:
    from tokengym.envs.sandbox.docker import LABEL, OWNER_LABEL, process_owner

    filters = [f"{LABEL}=1", f"{OWNER_LABEL}={process_owner()}"] + [f"{k}={v}" for k, v in labels.items()]
    return engine.api.containers(all=True, filters={"label": filters})


def container_processes(engine, cid: str) -> list[str]:
    """The command lines of the processes running in a container, as the engine sees them."""
    top = engine.api.top(cid, ps_args="-eo pid,args")
    return [p[-1] for p in top["Processes"]]


def alive(sandbox) -> None:
    """The sandbox still works after whatever came before, and nothing of it is left running."""
    r = sandbox.run("echo alive")
    assert r.status == "ok" and r.stdout == "alive\n", r
    from tokengym.envs.sandbox.docker import docker_client

    procs = container_processes(docker_client(), sandbox.container_id)
    assert len(procs) == 2 and "sleep infinity" in procs, procs  # docker-init and its sleep only


# --------------------------------------------------------------------------------------------------
# Set-up errors name the fix


def test_no_engine_is_a_clear_error():
    try:
        import docker  # noqa: F401
    except ImportError:
        _unavailable('the docker SDK is not installed: pip install "tokengym[docker]"')
    from tokengym.envs.sandbox import DockerSandbox

    with pytest.raises(SandboxError, match=r"no Docker engine answers at unix:///nonexistent/docker.sock.*docker-up\.sh"):
        DockerSandbox(docker_host="unix:///nonexistent/docker.sock")


def test_missing_image_names_the_build_script(engine):
    from tokengym.envs.sandbox import DockerSandbox

    with pytest.raises(SandboxError, match=r"tokengym-no-such-image:v0.*sandbox-image\.sh"):
        DockerSandbox(image="tokengym-no-such-image:v0")


def test_unknown_runtime_is_a_clear_error(engine):
    from tokengym.envs.sandbox import DockerSandbox

    with pytest.raises(SandboxError, match=r"refused|could not start"):
        DockerSandbox(runtime="tokengym-no-such-runtime")
    assert not our_containers(engine)


def test_make_sandbox_and_limit_overrides(engine):
    with make_sandbox("docker", timeout_s=3, memory_mb=256) as sb:
        assert sb.limits == Limits(timeout_s=3, memory_mb=256)
        assert sb.run_python("print(6 * 7)").stdout == "42\n"
    with pytest.raises(TypeError, match="memroy_mb"):
        make_sandbox("docker", memroy_mb=1)


# --------------------------------------------------------------------------------------------------
# The hardening is really in effect


def test_hardened_settings_in_effect(engine, backend):
    from tokengym.envs.sandbox import DockerSandbox

    limits = Limits(memory_mb=300, max_processes=50, max_open_files=100)
    with DockerSandbox(limits, cpus=0.5) as sb:
        info = engine.api.inspect_container(sb.container_id)
        hc, cfg = info["HostConfig"], info["Config"]
        assert hc["NetworkMode"] == "none"
        assert hc["ReadonlyRootfs"] is True
        assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd")
        assert "no-new-privileges" in hc["SecurityOpt"]
        assert hc["Privileged"] is False
        assert hc["Init"] is True
        assert hc["PidsLimit"] == 50
        assert hc["Memory"] == 300 << 20 and hc["MemorySwap"] == 300 << 20  # no swap on top
        assert hc["NanoCpus"] == 500_000_000
        assert not hc.get("Binds") and all(m["Type"] == "tmpfs" for m in info.get("Mounts") or [])
        assert set(hc["Tmpfs"]) == {"/workspace", "/tmp"}
        assert cfg["User"] and cfg["User"].split(":")[0] not in ("", "0", "root")
        assert cfg["Labels"][backend.LABEL] == "1"
        ulimits = {u["Name"]: u for u in hc["Ulimits"]}
        assert ulimits["nofile"]["Hard"] == 100 and ulimits["cpu"]["Soft"] == limits.cpu_s

        # ... and as the code inside sees it.
        r = sb.run("id -u; id -g; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; cat /proc/net/dev; ulimit -n")
        lines = r.stdout.split("\n")
        assert lines[0] == "1000" and lines[1] == "1000", r.stdout
        assert "CapEff:\t0000000000000000" in r.stdout and "CapBnd:\t0000000000000000" in r.stdout
        assert "NoNewPrivs:\t1" in r.stdout
        net = lines[lines.index(next(ln for ln in lines if ln.startswith("Inter-|"))) + 2 : -2]
        interfaces = [ln.split(":")[0].strip() for ln in net]
        assert interfaces == ["lo"], r.stdout
        assert lines[-2] == "100"

        iso = sb.isolation
        assert (iso.backend, iso.network, iso.filesystem, iso.limits) == ("docker", True, True, True)
        assert "docker sandbox; network: none; files: isolated; limits: on" in repr(sb)


def test_a_second_runtime_by_name(engine):
    from tokengym.envs.sandbox import DockerSandbox

    runtimes = engine.api.info().get("Runtimes") or {}
    assert "runc" in runtimes
    with DockerSandbox(runtime="runc") as sb:
        assert engine.api.inspect_container(sb.container_id)["HostConfig"]["Runtime"] == "runc"
        assert "runtime runc" in sb.isolation.details


# --------------------------------------------------------------------------------------------------
# Plain use


def test_run_python_stdin_files_and_exit_codes(sb):
    r = sb.run_python("import sys; print('out'); print('err', file=sys.stderr)")
    assert (r.status, r.exit_code, r.stdout, r.stderr, r.message) == ("ok", 0, "out\n", "err\n", "")
    r = sb.run("exit 3")
    assert (r.status, r.exit_code, r.message) == ("error", 3, "exited with code 3")
    assert sb.run(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME"]).stdout == "['a b', '$HOME']\n"
    assert sb.run("tr a-z A-Z", stdin="hello\n").stdout == "HELLO\n"
    assert sb.run("pwd; echo $HOME").stdout == "/workspace\n/workspace\n"

    sb.write_file("pkg/mod.py", "X = 41\n")
    assert sb.run_python("from pkg.mod import X; print(X + 1)").stdout == "42\n"
    blob = os.urandom(3 << 20)
    sb.write_file("/workspace/data/blob.bin", blob)
    assert sb.read_file("data/blob.bin") == blob
    assert sb.read_file("data/blob.bin", max_bytes=10) == blob[:10]
    sb.run("echo made by code > made.txt")
    assert sb.read_file("made.txt") == b"made by code\n"
    with pytest.raises(SandboxError, match="no file"):
        sb.read_file("missing.txt")
    with pytest.raises(SandboxError, match="outside the workspace"):
        sb.read_file("../etc/passwd")
    with pytest.raises(SandboxError, match="outside the workspace"):
        sb.write_file("/etc/passwd", "x")
    # A long program goes in on stdin rather than argv.
    big = "x = 0\n" + "x += 1\n" * 30_000 + "print(x)\n"
    assert sb.run_python(big).stdout == "30000\n"


def test_concurrent_calls_on_one_sandbox_take_turns(sb):
    results = []

    def call(i):
        results.append(sb.run_python(f"import time; time.sleep(0.3); print({i})"))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.stdout for r in results) == ["0\n", "1\n", "2\n", "3\n"]
    assert all(r.ok for r in results)


def test_reset_wipes_files_processes_and_tmp(sb, engine):
    sb.write_file("a/b.txt", "x")
    sb.run("mkdir -p locked/deep && touch locked/deep/f && chmod 000 locked/deep locked; echo t > /tmp/t; echo s > /dev/shm/s")
    sb.reset()
    assert sb.run("ls -A /workspace /tmp /dev/shm").stdout == "/dev/shm:\n\n/tmp:\n\n/workspace:\n"
    alive(sb)


def test_closed_sandbox_refuses_and_close_is_idempotent(engine):
    from tokengym.envs.sandbox import DockerSandbox

    sb = DockerSandbox()
    cid = sb.container_id
    sb.close()
    sb.close()
    assert sb.closed
    with pytest.raises(SandboxError, match="closed"):
        sb.run("true")
    assert not engine.api.containers(all=True, filters={"id": cid})


# --------------------------------------------------------------------------------------------------
# Security: each attempt is contained, the episode goes on with a clear message, the host is unchanged


@pytest.mark.parametrize("check", check_params(CHECKS))
def test_escape(check, sb):
    """The backend-neutral escape checks (tests/sandbox_escapes.py), shared with the local backend."""
    check(sb)
    alive(sb)


@pytest.mark.parametrize("check", list(LIFECYCLE_CHECKS.values()), ids=list(LIFECYCLE_CHECKS))
def test_lifecycle_check(check, engine):
    """What a sandbox builds (a 3,000-level tree, IPC objects, background processes) goes with
    its container at close(): no container of it is left."""
    from tokengym.envs.sandbox import DockerSandbox

    made = []

    def make():
        made.append(DockerSandbox(timeout_s=30))
        return made[-1]

    check(make)
    for sb in made:
        assert not engine.api.containers(all=True, filters={"id": sb.container_id})


def test_no_network(sb):
    code = textwrap.dedent(
        """
        import socket
        for host, port in [("1.1.1.1", 53), ("8.8.8.8", 443), ("deb.debian.org", 80)]:
            try:
                socket.create_connection((host, port), timeout=3)
                print("CONNECTED", host)
            except OSError as e:
                print("blocked", host, type(e).__name__)
        """
    )
    r = sb.run_python(code)
    assert r.ok and "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 3, r
    # The engine's own socket is not reachable from inside either.
    docker_host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    sock = docker_host.removeprefix("unix://")
    r = sb.run(f"ls -la {sock} /var/run/docker.sock /run/docker.sock 2>&1; cat /proc/net/unix | wc -l")
    assert "No such file" in r.stdout and "docker.sock " not in r.stdout.replace("No such file", "")
    alive(sb)


def test_host_files_are_not_readable(sb):
    # The project's own files, home directories and the host's secrets are not in the container.
    r = sb.run(f"cat {REPO}/pyproject.toml; ls /work /root /home; cat /etc/shadow; cat /proc/1/environ")
    assert r.status == "error" and "tokengym" not in r.stdout, r
    assert "Permission denied" in r.stderr and "No such file" in r.stderr
    assert os.path.exists(REPO / "pyproject.toml")  # the host's file is there, just not in here
    # /etc is the image's, not the host's.
    assert "sandbox:x:1000" in sb.run("cat /etc/passwd").stdout
    with pytest.raises(SandboxError):
        sb.read_file("/etc/shadow")
    alive(sb)


def test_writing_outside_the_workspace_fails_and_the_host_is_unchanged(sb, tmp_path):
    target = tmp_path / "host-owned"
    target.mkdir()
    r = sb.run(
        f"for p in /etc/x /usr/x /x /var/tmp/x /root/x {target}/x {REPO}/x; do touch $p 2>&1; done; "
        "mount -t tmpfs none /mnt 2>&1; echo done"
    )
    assert r.stdout.count("Read-only file system") + r.stdout.count("Permission denied") + r.stdout.count("No such file") >= 7, r
    assert "done" in r.stdout
    assert list(target.iterdir()) == [] and not (REPO / "x").exists() and not Path("/x").exists()
    assert sb.run("touch /workspace/ok /tmp/ok && echo fine").stdout == "fine\n"
    alive(sb)


def test_fork_bomb(sb):
    r = sb.run("f() { f | f & }; f", timeout_s=5)
    assert r.status in ("timeout", "ok", "error", "killed"), r
    r = sb.run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=3)
    assert r.status == "timeout" and r.exit_code is None and "timed out after 3 s" in r.message, r
    alive(sb)


@pytest.mark.alone
def test_memory_bomb(sb):
    r = sb.run_python("x = []\nwhile True:\n    x.append(bytearray(32 << 20))", timeout_s=20)
    assert r.status == "oom" and r.message == "ran out of memory (limit 512 MB)", r
    # Filling the tmpfs workspace counts too, and is stopped by its size.
    r = sb.run("head -c 400000000 /dev/zero > big; echo $?", timeout_s=20)
    assert r.status in ("ok", "oom", "killed", "error"), r
    alive(sb)


@pytest.mark.alone
def test_infinite_loop_and_cpu_limit(engine):
    from tokengym.envs.sandbox import DockerSandbox

    with DockerSandbox(cpu_s=2, timeout_s=30) as sb:
        t = time.monotonic()
        r = sb.run("while :; do :; done", timeout_s=1)
        assert r.status == "timeout" and r.exit_code is None, r
        assert r.message == "timed out after 1 s; the process and its children were killed"
        assert time.monotonic() - t < 3
        r = sb.run_python("while True: pass")
        assert r.status == "killed" and r.message == "killed: CPU time limit of 2 s reached", r
        alive(sb)


@pytest.mark.alone
def test_output_flood(sb):
    t = time.monotonic()
    r = sb.run("head -c 100000000 /dev/zero; head -c 5000000 /dev/zero >&2")
    assert r.ok and len(r.stdout) == 65536 and r.stdout_dropped == 100_000_000 - 65536, r.message
    assert len(r.stderr) == 65536 and r.stderr_dropped == 5_000_000 - 65536
    assert time.monotonic() - t < 10
    r = sb.run("yes", timeout_s=2)
    assert r.status == "timeout" and len(r.stdout) == 65536 and r.stdout_dropped > 0
    alive(sb)


@pytest.mark.alone
def test_background_processes_do_not_outlive_the_call(sb, engine):
    t = time.monotonic()
    r = sb.run("(sleep 30; echo late) & setsid sleep 40 & nohup sleep 50 >/dev/null 2>&1 & echo now")
    assert r.ok and r.stdout == "now\n" and time.monotonic() - t < 5, r
    r = sb.run_python("import subprocess; subprocess.Popen(['sleep', '60'], start_new_session=True); print('started')")
    assert r.stdout == "started\n"
    alive(sb)  # only the container's init and keeper are left


def test_the_sandbox_user_cannot_stop_the_container(sb):
    r = sb.run("kill -9 1; kill -9 -1")
    assert r.status in ("killed", "error"), r  # kill -1 takes the wrapper with it
    assert sb.run("kill -9 1 2>&1; echo $?").stdout.strip().endswith("1")
    alive(sb)


def test_symlink_escape(sb, tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("host secret")
    sb.run(f"ln -s / root; ln -s /etc/passwd pw; ln -s {secret} hs; ln -s root/etc etcdir")
    for path in ("pw", "root/etc/passwd", "etcdir/passwd", "hs"):
        with pytest.raises(SandboxError, match="symlink"):
            sb.read_file(path)
    with pytest.raises(SandboxError, match="symlink"):
        sb.write_file("root/tmp/evil", "x")
    sb.write_file("hs", "replaced")  # replaces the link itself, never the target
    assert secret.read_text() == "host secret"
    assert sb.run("test -L hs || cat hs").stdout == "replaced"
    # Following the link from inside reaches only the container's files.
    assert "host secret" not in sb.run("cat hs root/etc/passwd 2>&1").stdout
    alive(sb)


# --------------------------------------------------------------------------------------------------
# Never hangs: the engine itself stalls, the container disappears


@pytest.mark.alone
def test_a_stalled_exec_returns_at_the_deadline(sb, engine, backend):
    old = sb.container_id

    def freeze():
        time.sleep(0.5)
        engine.api.pause(old)

    threading.Thread(target=freeze, daemon=True).start()
    t = time.monotonic()
    r = sb.run("sleep 5; echo done", timeout_s=1)
    took = time.monotonic() - t
    assert r.status == "timeout" and "did not answer" in r.message and "restarted" in r.message, r
    assert took < 1 + backend.GRACE_S + 5
    assert sb.container_id != old and not engine.api.containers(all=True, filters={"id": old})
    alive(sb)


def test_a_vanished_container_is_replaced(sb, engine):
    engine.api.remove_container(sb.container_id, force=True)
    r = sb.run("echo x")
    assert r.status == "crashed" and "restarted" in r.message, r
    alive(sb)


# --------------------------------------------------------------------------------------------------
# Lifetime: context manager, Ctrl-C, garbage collection, crashes


def _child(code: str) -> subprocess.Popen:
    env = dict(os.environ)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


@pytest.mark.alone  # a wall-clock bound: on a loaded machine the engine's exec and removal ran past it
def test_ctrl_c_removes_the_container(engine):
    """Ctrl-C during a command: the child exits with KeyboardInterrupt and its container is gone.
    It exits in about 2 s alone; twice, at the end of the whole suite, it had not within 30 s and
    the cause is not known yet: the child dumps its threads' stacks when asked (SIGUSR1), and the
    failure shows them."""
    proc = _child(
        """
        import faulthandler, signal
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        from tokengym.envs.sandbox import DockerSandbox
        with DockerSandbox() as sb:
            print(sb.container_id, flush=True)
            sb.run("sleep 60", timeout_s=60)
        """
    )
    cid = proc.stdout.readline().strip()
    assert cid, proc.stderr.read()
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the child had not exited 90 s after SIGINT; its stacks:\n{err[-6000:]}")
    assert "KeyboardInterrupt" in err
    assert not engine.api.containers(all=True, filters={"id": cid})


def test_unclosed_sandboxes_go_at_exit_and_when_collected(engine):
    proc = _child(
        """
        from tokengym.envs.sandbox import DockerSandbox, DockerPool
        sb = DockerSandbox()
        pool = DockerPool(2)
        pool.wait_ready()
        leased = pool.acquire()
        print(sb.container_id, leased.container_id, flush=True)
        raise RuntimeError("the rollout failed")
        """
    )
    out, err = proc.communicate(timeout=60)
    assert "the rollout failed" in err
    for cid in out.split():
        assert not engine.api.containers(all=True, filters={"id": cid})

    from tokengym.envs.sandbox import DockerSandbox

    sb = DockerSandbox()
    cid = sb.container_id
    del sb
    gc.collect()
    assert not engine.api.containers(all=True, filters={"id": cid})


CRASH = """
    import os, signal
    from tokengym.envs.sandbox import DockerSandbox
    sb = DockerSandbox()
    print(sb.container_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close, no atexit
    """


def _crash(engine, n: int = 1) -> list[str]:
    """The containers that ``n`` processes, each SIGKILLed with a sandbox open, left behind."""
    procs = [_child(CRASH) for _ in range(n)]
    orphans = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        orphans.append(out.strip())
    for orphan in orphans:
        assert engine.api.containers(all=True, filters={"id": orphan}), "the crash should have left it"
    return orphans


@pytest.mark.alone  # a dead owner's containers go at any process's first use of the engine: no other test may run
def test_cleanup_containers_removes_orphans_of_a_crash(engine, backend):
    from tokengym.envs.sandbox import DockerSandbox, cleanup_containers

    (orphan,) = _crash(engine)
    with DockerSandbox() as mine:  # a live sandbox of this process is not an orphan
        removed = cleanup_containers()
        assert orphan in removed and mine.container_id not in removed
        assert not engine.api.containers(all=True, filters={"id": orphan})
        assert mine.run("echo still here").ok


@pytest.mark.alone  # a dead owner's containers go at any process's first use of the engine: no other test may run
def test_a_crashs_containers_go_at_the_next_start_and_by_the_command(engine, tmp_path):
    from tokengym.envs.sandbox import DockerSandbox

    with DockerSandbox() as mine:  # this process's, live: neither removes it
        orphans = _crash(engine, 2)
        nxt = _child("from tokengym.envs.sandbox import DockerSandbox\nDockerSandbox().close()")
        _, err = nxt.communicate(timeout=120)
        assert nxt.returncode == 0, err
        assert "sandbox container(s) of dead owners" in err, err
        assert not any(engine.api.containers(all=True, filters={"id": o}) for o in orphans)
        (orphan,) = _crash(engine)
        gc_ = subprocess.run(
            [sys.executable, "-m", "tokengym.recorder.cli", "sandbox", "gc", "--docker", "yes", "--tmp-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert gc_.returncode == 0, gc_.stderr
        assert "docker: removed" in gc_.stdout and not engine.api.containers(all=True, filters={"id": orphan}), gc_.stdout
        assert mine.run("echo still here").ok


# --------------------------------------------------------------------------------------------------
# The warm pool


@pytest.mark.alone
@pytest.mark.parametrize("recycle", ["fresh", "wipe"])
def test_pool_recycles_without_leaking_between_episodes(engine, recycle):
    from tokengym.envs.sandbox import DockerPool, DockerSandbox

    with DockerPool(2, recycle=recycle, timeout_s=5) as pool:
        assert pool.wait_ready(timeout_s=60)
        seen = set()
        for episode in range(6):
            t = time.monotonic()
            sb = pool()  # a sandbox_factory
            assert isinstance(sb, DockerSandbox)
            if episode == 0:
                assert time.monotonic() - t < 0.05  # ready: no container start on the episode's path
            r = sb.run("ls -A /workspace /tmp /dev/shm; cat /proc/1/cmdline >/dev/null; ls /proc | grep -c '^[0-9]'")
            # Nothing of an earlier episode: no files, no processes (init, keeper, wrapper, timeout,
            # sh, ls, grep).
            assert r.stdout.startswith("/dev/shm:\n\n/tmp:\n\n/workspace:\n") and r.stdout.count("\n") == 6, r.stdout
            assert int(r.stdout.split()[-1]) <= 7, r.stdout
            sb.write_file(f"secret-{episode}.txt", "x")
            assert "0x" not in sb.run("ipcs -m -q -s").stdout  # no System V IPC object either
            sb.run("echo t > /tmp/t; echo s > /dev/shm/s; ipcmk -M 4096; ipcmk -Q; sleep 100 &")
            seen.add(sb.container_id)
            sb.close()
            sb.close()
            pool.wait_ready(1, timeout_s=30)
        if recycle == "fresh":
            assert len(seen) == 6
        else:
            assert len(seen) <= 3  # the same containers again, wiped
        assert pool.stats["hits"] >= 5
    assert not our_containers(engine, **{"org.tokengym.sandbox.pool": pool.id})


def test_pool_close_removes_ready_and_leased(engine):
    from tokengym.envs.sandbox import DockerPool

    pool = DockerPool(3)
    pool.wait_ready(timeout_s=60)
    leased = pool.acquire()
    assert leased.run("true").ok
    pool.close()
    assert leased.closed
    assert not our_containers(engine, **{"org.tokengym.sandbox.pool": pool.id})
    with pytest.raises(SandboxError, match="closed"):
        pool.acquire()


def test_pool_miss_starts_a_container(engine):
    from tokengym.envs.sandbox import DockerPool

    with DockerPool(0) as pool:
        with pool.acquire() as sb:
            assert sb.run_python("print(1)").stdout == "1\n"
        assert pool.stats["misses"] == 1 and pool.stats["hits"] == 0


# --------------------------------------------------------------------------------------------------
# 100 episodes leave nothing behind (the local backend's env test runs 200)


def _episodes(pool, episodes, seen: set[str]) -> None:
    with pool:
        for episode in episodes:
            with pool() as sb:
                seen.add(sb.container_id)
                assert sb.run("ls -A").stdout == ""
                sb.write_file("task.py", f"print({episode} * 2)")
                r = sb.run("python3 task.py; sleep 100 &")
                assert r.ok and r.stdout == f"{episode * 2}\n", r
                if episode % 25 == 0:
                    assert sb.run("while :; do :; done", timeout_s=0.5).status == "timeout"


def _host_processes_of(cids: set[str]) -> list[int]:
    """Host processes that belong to any of these containers (by their cgroup)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cg = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        if any(cid in cg for cid in cids):
            found.append(int(pid))
    return found


@pytest.mark.slow
def test_100_episodes_leave_no_containers_and_no_processes(engine):
    from tokengym.envs.sandbox import DockerPool

    local_engine = os.environ.get("DOCKER_HOST", "unix://").startswith("unix://")
    _episodes(DockerPool(2, recycle="wipe"), range(10), set())  # warm up (the SDK's idle connections)
    threads_before = threading.active_count()
    fds_before = len(os.listdir("/proc/self/fd"))
    containers_before = len(our_containers(engine))
    seen: set[str] = set()
    # Half the episodes on fresh containers, half on wiped ones.
    for recycle, episodes in (("fresh", range(50)), ("wipe", range(50, 100))):
        _episodes(pool := DockerPool(4, recycle=recycle, timeout_s=5), episodes, seen)
        assert not our_containers(engine, **{"org.tokengym.sandbox.pool": pool.id})

    assert len(our_containers(engine)) == containers_before
    for cid in seen:
        assert not engine.api.containers(all=True, filters={"id": cid})
    if local_engine:
        assert _host_processes_of(seen) == []
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threading.active_count() <= threads_before
    # A few idle connections to the engine at most; nothing grows with the episodes.
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 4


# --------------------------------------------------------------------------------------------------
# The sandbox envs on Docker


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _reply(env, content="", *calls):
    import numpy as np

    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = list(calls)
    tools = [t.schema for t in env.unwrapped.tools.values()] or None
    return np.array(env.unwrapped.renderer.assistant(msg, tools).ids, dtype=np.int64)


def _python_episode(env, task_id: str, answer: str):
    env.reset(seed=0, options={"task_id": task_id})
    sb = env.unwrapped.sandbox
    assert type(sb).__name__ == "DockerSandbox"
    cid = sb.container_id
    obs, _, term, trunc, info = env.step(
        _reply(env, "Let me check.", _call("run_python", code="import os, sys; print('uid', os.getuid(), sys.version_info[0])"))
    )
    assert not (term or trunc)
    text = env.unwrapped.renderer.decode(obs)
    assert "uid 1000 3" in text, text  # the tool ran in the container
    _, reward, term, trunc, info = env.step(_reply(env, f"Here it is.\n\n```python\n{answer}\n```"))
    assert term or trunc
    assert env.unwrapped.sandbox is None  # closed when the episode ended
    return reward, info, cid, text


def test_python_sandbox_env_on_docker(engine, qwen3):
    import gymnasium as gym

    from tokengym.envs.builtin import coding_tasks

    task = next(t for t in coding_tasks() if t["id"] == "coding-fizzbuzz")
    env = gym.make("tokengym/PythonSandbox-v0", tokenizer=qwen3, sandbox="docker", sandbox_kwargs={"timeout_s": 10})
    try:
        reward, info, cid, _ = _python_episode(env, task["id"], task["solution"])
        assert reward == 1.0 and info["grade"]["all_passed"], info["grade"]
        assert not engine.api.containers(all=True, filters={"id": cid})
        reward, info, _, _ = _python_episode(env, task["id"], "def fizzbuzz(n):\n    return []")
        assert reward == 0.0 and info["grade"]["failures"]
        # A solution that hangs or floods is graded, not hung on.
        reward, info, _, _ = _python_episode(env, task["id"], "def fizzbuzz(n):\n    while True:\n        pass")
        assert reward == 0.0
    finally:
        env.close()
    assert not our_containers(engine)


def test_shell_env_on_docker_with_a_pool(engine, qwen3):
    import gymnasium as gym

    from tokengym.envs.sandbox import DockerPool

    with DockerPool(2, timeout_s=10) as pool:
        pool.wait_ready(timeout_s=60)
        env = gym.make("tokengym/Shell-v0", tokenizer=qwen3, sandbox="docker", sandbox_factory=pool)
        try:
            for seed, kind in enumerate(("count", "sort", "rename")):
                env.reset(seed=seed, options={"problem_seed": seed, "kind": kind})
                task = env.unwrapped.task
                sb = env.unwrapped.sandbox
                assert type(sb).__name__ == "DockerSandbox"
                # The task's files were laid out, nothing of an earlier episode is there.
                listing = sb.run("find . -type f | sort").stdout.split()
                assert sorted("./" + p for p in task["files"]) == listing
                check = task["check"]
                if kind == "count":
                    calls = [_call("write_file", path=check["path"], content=check["expected"])]
                elif kind == "sort":
                    calls = [_call("run_shell", command="sort -u names.txt > sorted.txt")]
                else:
                    calls = [_call("run_shell", command='for f in notes/*.txt; do mv "$f" "${f%.txt}.md"; done')]
                calls.append(_call("run_shell", command="yes | head -c 10000000; ls"))  # a flood in the middle
                _, _, term, trunc, _ = env.step(_reply(env, "Working.", *calls))
                assert not (term or trunc)
                _, reward, term, trunc, info = env.step(_reply(env, "Done."))
                assert term or trunc
                assert reward == 1.0, info.get("check")
        finally:
            env.close()
        assert pool.stats["hits"] >= 2
    assert not our_containers(engine)
