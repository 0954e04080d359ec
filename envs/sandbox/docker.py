"""The Docker sandbox: one hardened container per sandbox, a warm pool, and orphan cleanup.

Each :class:`DockerSandbox` is a container started from a small local image (default
``tokengym-sandbox:bookworm``, built without any registry by ``.ci/sandbox-image.sh``) with

* network mode ``none`` (only ``lo``), a read-only root file system and tmpfs mounts for the
  workspace (``/workspace``) and ``/tmp`` -- nothing of the host is mounted;
* memory = memory+swap (no swap), a pids limit, a CPU quota, rlimits for CPU seconds, file size
  and open files;
* all capabilities dropped, ``no-new-privileges``, an init (``init=True``: orphans are reaped, so
  zombies never eat the pids limit), and unprivileged users: the container's keeper process runs as
  ``nobody`` and every command as the ``sandbox`` user (1000), which therefore cannot kill the
  keeper;
* optionally another OCI runtime (``runtime="runsc"`` for gVisor).

Every command runs through a small wrapper inside the container: ``timeout -s KILL`` enforces the
wall-clock limit there, and afterwards ``kill -9 -1`` (as the sandbox user) removes whatever the
command left running in the background; the wrapper reports the exit code and the memory cgroup's
OOM-kill counter on stderr, so a result says ``timeout``, ``oom`` or ``killed`` honestly. A
client-side watchdog covers the case where the engine itself stops answering: the call returns at
the deadline and the container is replaced. Output is read as it comes and cut to
:attr:`Limits.max_output_bytes` (the rest is counted and dropped), so a flood never fills memory.
Calls on one sandbox take turns. ``write_file``/``read_file`` go through the same exec (the
workspace is a tmpfs, which ``docker cp`` cannot reach) and never follow a symlink.

Containers carry the label ``org.tokengym.sandbox`` and their owner (host, pid, process start
time); :func:`cleanup_containers` removes those whose owner is gone (a crash, SIGKILL). A sandbox
is removed by ``close()``, at the end of a ``with`` block, when it is garbage-collected and at
interpreter exit (pools too).

:class:`DockerPool` keeps N containers started and ready; ``pool.acquire()`` (or ``pool()``, so a
pool is a ``sandbox_factory``) hands one out at once, and closing that sandbox gives it back: the
pool replaces it with a fresh container (``recycle="fresh"``, the default) or wipes its workspace
(``recycle="wipe"``), in the background, so an episode never waits for a container start.
"""

from __future__ import annotations

import atexit
import os
import posixpath
import secrets
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .base import OOM_HINTS, ExecResult, Isolation, Limits, Sandbox, SandboxError, Status, oom_message, resolve_limits, signal_message

__all__ = [
    "DEFAULT_IMAGE",
    "LABEL",
    "DockerPool",
    "DockerSandbox",
    "cleanup_containers",
    "docker_client",
]

DEFAULT_IMAGE = "tokengym-sandbox:bookworm"
"""The sandbox image; ``TOKENGYM_SANDBOX_IMAGE`` overrides it."""
IMAGE_HELP = (
    "build it once with `bash .ci/sandbox-image.sh` from the tokengym repository (as root: a minimal "
    "Debian bookworm with python3 from debootstrap, imported with `docker import`; no registry needed), "
    "or pass image=... naming any local image that has /bin/sh, coreutils and python3"
)
LABEL = "org.tokengym.sandbox"
"""Every container this module starts carries this label (value ``"1"``)."""
OWNER_LABEL = "org.tokengym.sandbox.owner"
"""``host:pid:start-time`` of the process that started the container."""
POOL_LABEL = "org.tokengym.sandbox.pool"

WORKSPACE = "/workspace"
SANDBOX_USER = "1000:1000"
"""The user every command runs as (``sandbox`` in the image)."""
KEEPER_USER = "65534:65534"
"""The user of the container's own processes (init and ``sleep``): not the sandbox user, so a
command's ``kill -9 -1`` cannot stop the container."""
ENV = {
    "HOME": WORKSPACE,
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}
GRACE_S = 3.0
"""How long past a command's timeout the client waits for the engine before giving up on it."""
API_TIMEOUT_S = 30
"""Timeout of one Docker API request (create, start, remove...)."""

# The wrapper every command runs in (dash; builtins only after the command, so that it still works
# when a fork bomb has used up the pids limit). $1: a nonce for the status line, $2: the timeout.
_WRAPPER = r"""
n=$1; t=$2; shift 2
oomk() {
  k=-
  for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
    if [ -r "$f" ]; then
      while read -r a b; do if [ "$a" = oom_kill ]; then k=$b; fi; done < "$f"
      break
    fi
  done
}
oomk; o1=$k
timeout -s KILL "$t" "$@"
rc=$?
kill -9 -1 2>/dev/null
kill -9 -1 2>/dev/null
oomk; o2=$k
printf '\036%s:%s:%s:%s\036' "$n" "$rc" "$o1" "$o2" >&2
exit $rc
"""

# write_file / read_file: walk the path one component at a time from the workspace and never follow
# a symlink (nothing else runs in the container between calls, so nothing can swap one in meanwhile).
# Exit codes: 2 no such file, 3 a symlink, 4 anything else.
_WALK = r"""
cd /workspace || exit 4
while [ $# -gt 1 ]; do
  if [ -L "$1" ]; then echo "$1 is a symlink; it is not followed" >&2; exit 3; fi
  if [ ! -e "$1" ] && [ "$op" = write ]; then mkdir -- "$1" || exit 4; fi
  if [ ! -e "$1" ]; then echo "no such file" >&2; exit 2; fi
  if [ ! -d "$1" ]; then echo "$1 is not a directory" >&2; exit 4; fi
  cd -P -- "$1" || exit 4
  shift
done
"""
_WRITE = "op=write" + _WALK + r"""
if [ -d "$1" ] && [ ! -L "$1" ]; then echo "it is a directory" >&2; exit 4; fi
rm -f -- "$1" || exit 4
exec cat > "$1"
"""
_READ = "op=read" + _WALK + r"""
if [ -L "$1" ]; then echo "it is a symlink; it is not followed" >&2; exit 3; fi
if [ ! -e "$1" ]; then echo "no such file" >&2; exit 2; fi
if [ ! -f "$1" ]; then echo "it is not a regular file" >&2; exit 4; fi
if [ -n "$max" ]; then exec head -c "$max" -- "$1"; fi
exec cat -- "$1"
"""
# Nothing of the sandbox user runs now: every call's wrapper killed what it left (or _kill_all did).
_WIPE = r"""
chmod -R u+rwX /workspace /tmp /dev/shm 2>/dev/null
find /workspace /tmp /dev/shm /dev/mqueue -mindepth 1 -delete 2>/dev/null
ipcrm --all 2>/dev/null
[ -z "$(ls -A /workspace)" ] && [ -z "$(ls -A /tmp)" ] && [ -z "$(ls -A /dev/shm)" ]
"""

def _docker() -> Any:
    try:
        import docker  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'the Docker sandbox needs the docker SDK: pip install "tokengym[docker]"'
        ) from e
    return docker


_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def docker_client(docker_host: str | None = None) -> Any:
    """A shared ``docker.DockerClient`` for ``docker_host`` (default: ``DOCKER_HOST`` or the default
    socket), checked to answer; :class:`SandboxError` with a clear reason when no engine does."""
    docker = _docker()
    key = docker_host or os.environ.get("DOCKER_HOST") or ""
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        where = key or "the default socket (unix:///var/run/docker.sock)"
        try:
            if docker_host:
                client = docker.DockerClient(base_url=docker_host, timeout=API_TIMEOUT_S, max_pool_size=64)
            else:
                client = docker.from_env(timeout=API_TIMEOUT_S, max_pool_size=64)
            _one_connection_pool(client)
            client.ping()
        except Exception as e:
            raise SandboxError(
                f"no Docker engine answers at {where}: {type(e).__name__}: {e}. Start one (as root, "
                "`bash .ci/docker-up.sh` starts a private engine and prints its DOCKER_HOST) or set DOCKER_HOST"
            ) from e
        _CLIENTS[key] = client
        return client


def _one_connection_pool(client: Any) -> None:
    """Let a Unix-socket client keep one connection pool instead of one per URL.

    The SDK's Unix adapter keys its pools by the whole URL, and every container and exec has URLs
    of its own: with many sandboxes that is 25 pools (its cap) of idle sockets, each holding as
    many as there were concurrent requests. All of them go to the same socket, so one pool does.
    """
    try:
        from docker.transport.unixconn import UnixHTTPAdapter  # noqa: PLC0415
    except ImportError:  # pragma: no cover - another SDK layout: keep its behaviour
        return
    for adapter in client.api.adapters.values():
        if isinstance(adapter, UnixHTTPAdapter):
            get = adapter.get_connection
            adapter.get_connection = lambda url, proxies=None, _get=get: _get("http+docker://localhost", proxies)


def _proc_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 (starttime), counted after the parenthesised command name.
    return stat[stat.rindex(b")") + 2 :].split()[19].decode()


_OWNERS: dict[int, str] = {}


def _owner() -> str:
    """This process's owner label (computed per pid: a forked child is an owner of its own)."""
    pid = os.getpid()
    if pid not in _OWNERS:
        _OWNERS[pid] = f"{socket.gethostname()}:{pid}:{_proc_start_time(pid) or 0}"
    return _OWNERS[pid]


def _owner_alive(owner: str) -> bool:
    """Whether the process that an owner label names is still running (on this host)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True  # another machine's: never ours to judge
    return _proc_start_time(int(pid)) == start


def cleanup_containers(
    *, all: bool = False, client: Any = None, docker_host: str | None = None
) -> list[str]:
    """Remove sandbox containers (label :data:`LABEL`) left behind by a crashed process.

    By default only those whose owner process (on this host) is gone; ``all=True`` removes every
    sandbox container of the engine, including live ones of other processes. Returns the removed ids.
    """
    docker = _docker()
    client = client or docker_client(docker_host)
    removed = []
    for c in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):
        owner = (c.get("Labels") or {}).get(OWNER_LABEL, "")
        if not all and (owner == _owner() or _owner_alive(owner)):
            continue
        try:
            client.api.remove_container(c["Id"], force=True)
            removed.append(c["Id"])
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code != 409:  # 409: removal already in progress
                raise
    return removed


# ---------------------------------------------------------------------------------------------------
# One container


@dataclass
class _Container:
    """A started container and what was measured about it."""

    id: str
    isolation: Isolation


def _swap_limited(client: Any) -> bool:
    info = getattr(client, "_tokengym_info", None)
    if info is None:
        try:
            info = client.api.info()
        except Exception:
            info = {}
        client._tokengym_info = info
    return bool(info.get("SwapLimit", True))


class _Spec:
    """How to start a sandbox container (shared by a sandbox and the pool that makes it)."""

    def __init__(
        self,
        *,
        limits: Limits,
        image: str | None,
        runtime: str | None,
        cpus: float,
        workspace_mb: int,
        tmp_mb: int,
        env: Mapping[str, str] | None,
        labels: Mapping[str, str] | None,
        docker_host: str | None,
        client: Any,
    ) -> None:
        self.limits = limits
        self.image = image or os.environ.get("TOKENGYM_SANDBOX_IMAGE") or DEFAULT_IMAGE
        self.runtime = runtime
        self.cpus = cpus
        self.workspace_mb = workspace_mb
        self.tmp_mb = tmp_mb
        self.env = {**ENV, **(env or {})}
        self.labels = dict(labels or {})
        self.client = client or docker_client(docker_host)
        self._checked_image = False

    def check_image(self) -> None:
        if self._checked_image:
            return
        docker = _docker()
        try:
            self.client.api.inspect_image(self.image)
        except docker.errors.ImageNotFound:
            raise SandboxError(f"the sandbox image {self.image!r} is not in the Docker engine: {IMAGE_HELP}") from None
        self._checked_image = True

    def start(self) -> _Container:
        """Create, start and inspect one container; removed again if anything fails."""
        docker = _docker()
        self.check_image()
        api = self.client.api
        lim = self.limits
        mem = f"{lim.memory_mb}m"
        host_config = api.create_host_config(
            network_mode="none",
            read_only=True,
            tmpfs={
                WORKSPACE: f"rw,exec,nosuid,nodev,size={self.workspace_mb}m,uid=1000,gid=1000,mode=0755",
                "/tmp": f"rw,nosuid,nodev,size={self.tmp_mb}m,mode=1777",
            },
            mem_limit=mem,
            memswap_limit=mem,
            pids_limit=lim.max_processes,
            nano_cpus=int(self.cpus * 1e9),
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            init=True,
            ulimits=[
                # soft < hard: SIGXCPU first (reported as the CPU limit), SIGKILL a second later.
                docker.types.Ulimit(name="cpu", soft=lim.cpu_s, hard=lim.cpu_s + 1),
                docker.types.Ulimit(name="fsize", soft=lim.max_file_mb << 20, hard=lim.max_file_mb << 20),
                docker.types.Ulimit(name="nofile", soft=lim.max_open_files, hard=lim.max_open_files),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            shm_size="16m",
            log_config=docker.types.LogConfig(type="none"),
            runtime=self.runtime,
        )
        labels = {LABEL: "1", OWNER_LABEL: _owner(), **self.labels}
        try:
            cid = api.create_container(
                self.image,
                command=["sleep", "infinity"],
                user=KEEPER_USER,
                working_dir=WORKSPACE,
                environment=self.env,
                hostname="sandbox",
                labels=labels,
                host_config=host_config,
            )["Id"]
        except docker.errors.ImageNotFound:
            self._checked_image = False
            raise SandboxError(f"the sandbox image {self.image!r} is not in the Docker engine: {IMAGE_HELP}") from None
        except docker.errors.APIError as e:
            raise SandboxError(f"the Docker engine refused the sandbox container: {e.explanation or e}") from e
        try:
            api.start(cid)
            info = api.inspect_container(cid)
            return _Container(cid, self._measure(info))
        except BaseException as e:
            try:
                _remove(self.client, cid)
            except Exception:
                pass
            if isinstance(e, docker.errors.APIError):
                raise SandboxError(f"the Docker engine could not start the sandbox container: {e.explanation or e}") from e
            raise

    def _measure(self, info: dict) -> Isolation:
        """What the engine says is in effect for this container (not what was asked for)."""
        hc = info.get("HostConfig") or {}
        cfg = info.get("Config") or {}
        if not (info.get("State") or {}).get("Running"):
            raise SandboxError(f"the sandbox container did not stay up: {info.get('State')}")
        network = hc.get("NetworkMode") == "none"
        mounts_from_host = [m for m in info.get("Mounts") or [] if m.get("Type") != "tmpfs"]
        filesystem = bool(hc.get("ReadonlyRootfs")) and not hc.get("Binds") and not mounts_from_host
        hardened = "ALL" in (hc.get("CapDrop") or []) and "no-new-privileges" in (hc.get("SecurityOpt") or [])
        limits = bool(hc.get("Memory")) and bool(hc.get("PidsLimit")) and bool(hc.get("NanoCpus")) and hardened
        details = [
            f"image {cfg.get('Image', self.image)}",
            f"runtime {hc.get('Runtime') or 'runc'}",
            f"user {SANDBOX_USER}",
            f"memory {hc.get('Memory', 0) >> 20} MB, pids {hc.get('PidsLimit')}, cpus {hc.get('NanoCpus', 0) / 1e9:g}",
        ]
        if not hardened:
            details.append("NOT hardened: capabilities or no-new-privileges missing")
        if not _swap_limited(self.client):
            details.append("the kernel does not limit swap")
        return Isolation(backend="docker", network=network, filesystem=filesystem, limits=limits, details=tuple(details))


def _remove(client: Any, cid: str) -> None:
    docker = _docker()
    try:
        client.api.remove_container(cid, force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code != 409:  # removal already in progress
            raise


# ---------------------------------------------------------------------------------------------------
# Running one command


class _Output:
    """The head of a stream up to a limit, the number of bytes dropped, and a short tail."""

    def __init__(self, limit: int, tail: int = 0) -> None:
        self.limit = limit
        self.head = bytearray()
        self.total = 0
        self.tail_size = tail
        self.tail = bytearray()

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
        if self.tail_size:
            self.tail += data[-self.tail_size :]
            del self.tail[: -self.tail_size]


@dataclass
class _Raw:
    """What one exec produced, before it is judged."""

    stdout: _Output
    stderr: _Output
    exit_code: int | None
    oom: bool
    timed_out: bool  # the client-side watchdog fired
    duration_s: float
    marker: bool  # the wrapper's status line was seen


class _ExecFailed(Exception):
    """The engine did not run the exec (container gone, engine error)."""


def _exec(
    client: Any,
    cid: str,
    argv: list[str],
    *,
    timeout_s: float,
    stdin: bytes | None,
    stdout_limit: int,
    stderr_limit: int,
    env: dict[str, str],
) -> _Raw:
    docker = _docker()
    api = client.api
    nonce = secrets.token_hex(6)
    cmd = ["/bin/sh", "-c", _WRAPPER, "tokengym", nonce, f"{timeout_s:.3f}", *argv]
    start = time.monotonic()
    deadline = start + timeout_s + GRACE_S
    try:
        exec_id = api.exec_create(
            cid, cmd, stdout=True, stderr=True, stdin=stdin is not None, user=SANDBOX_USER, environment=env, workdir=WORKSPACE
        )["Id"]
        res = api._post_json(
            api._url("/exec/{0}/start", exec_id),
            headers={"Connection": "Upgrade", "Upgrade": "tcp"},
            data={"Tty": False, "Detach": False},
            stream=True,
        )
        api._raise_for_status(res)
    except docker.errors.DockerException as e:
        raise _ExecFailed(str(e)) from e
    except OSError as e:  # the engine went away, a request timed out
        raise _ExecFailed(f"{type(e).__name__}: {e}") from e
    # The hijacked connection: read through http.client's buffered reader (it may hold the first
    # bytes already), write stdin to the socket underneath.
    fp = res.raw._fp.fp
    sock = fp.raw._sock if hasattr(fp.raw, "_sock") else fp.raw
    out = _Output(stdout_limit)
    err = _Output(stderr_limit + 64, tail=2048)
    timed_out = False
    writer = None
    if stdin is not None:

        def write() -> None:
            try:
                sock.sendall(stdin)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        writer = threading.Thread(target=write, daemon=True, name="tokengym-sandbox-stdin")
        writer.start()
    buf = bytearray()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            sock.settimeout(remaining)
            try:
                chunk = fp.read1(1 << 16)
            except TimeoutError:
                timed_out = True
                break
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            while len(buf) >= 8:
                kind, size = buf[0], struct.unpack(">I", buf[4:8])[0]
                if len(buf) < 8 + size:
                    break
                (out if kind == 1 else err).add(bytes(buf[8 : 8 + size]))
                del buf[: 8 + size]
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass
        res.close()
    duration = time.monotonic() - start

    # The wrapper's status line ends stderr: \x1e nonce:rc:oom-before:oom-after \x1e
    exit_code: int | None = None
    oom = marker = False
    tail = bytes(err.tail)
    tag = b"\x1e" + nonce.encode() + b":"
    at = tail.rfind(tag)
    if not timed_out and at >= 0 and tail.endswith(b"\x1e"):
        fields = tail[at + len(tag) : -1].decode(errors="replace").split(":")
        marker = True
        marker_len = len(tail) - at
        err.total -= marker_len
        err.tail = bytearray(tail[:at])
        del err.head[err.total :]
        try:
            exit_code = int(fields[0])
        except (ValueError, IndexError):
            exit_code = None
        try:
            oom = int(fields[2]) > int(fields[1])
        except (ValueError, IndexError):
            oom = False
    elif not timed_out:
        try:
            exit_code = api.exec_inspect(exec_id).get("ExitCode")
        except Exception:
            exit_code = None
    if len(err.head) > stderr_limit:
        del err.head[stderr_limit:]
    return _Raw(out, err, exit_code, oom, timed_out, duration, marker)


# ---------------------------------------------------------------------------------------------------
# The sandbox

_LIVE: weakref.WeakSet = weakref.WeakSet()
"""Pools still open (closed at interpreter exit)."""



class _Lease:
    """The container a sandbox holds now; removed by the sandbox's finalizer unless given back."""

    def __init__(self, client: Any, cid: str) -> None:
        self.client = client
        self.cid = cid


def _finalize(lease: _Lease) -> None:
    try:
        _remove(lease.client, lease.cid)
    except Exception:
        pass


class DockerSandbox(Sandbox):
    """A sandbox in its own hardened container. See the module docstring for what is enforced.

    Args:
        limits: resource limits (:class:`Limits`); keyword overrides of its fields
            (``timeout_s=5``, ``memory_mb=256``...) may be given directly instead or on top.
            Memory is the container's, swap included; processes is the pids limit.
        image: a local image with ``/bin/sh``, coreutils and ``python3`` (default
            ``tokengym-sandbox:bookworm``, or ``TOKENGYM_SANDBOX_IMAGE``).
        runtime: an OCI runtime known to the engine (``"runsc"`` for gVisor); default the engine's.
        cpus: the CPU quota.
        workspace_mb, tmp_mb: sizes of the tmpfs workspace and ``/tmp`` (they count against memory).
        env: extra environment variables for every command.
        docker_host, client: which engine (default ``DOCKER_HOST`` or the default socket).

    Calls on one sandbox run one at a time (a second waits for the first). The container is
    removed by :meth:`close`, at the end of a ``with`` block, when the object is collected, and at
    interpreter exit; :func:`cleanup_containers` removes what a killed process left.
    """

    workdir = WORKSPACE

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        image: str | None = None,
        runtime: str | None = None,
        cpus: float = 1.0,
        workspace_mb: int = 256,
        tmp_mb: int = 64,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        docker_host: str | None = None,
        client: Any = None,
        _spec: _Spec | None = None,
        _container: _Container | None = None,
        _pool: DockerPool | None = None,
        **limit_overrides: Any,
    ) -> None:
        self._closed = True  # until fully built
        if _spec is None:
            _spec = _Spec(
                limits=resolve_limits(limits, limit_overrides, "DockerSandbox"),
                image=image,
                runtime=runtime,
                cpus=cpus,
                workspace_mb=workspace_mb,
                tmp_mb=tmp_mb,
                env=env,
                labels=labels,
                docker_host=docker_host,
                client=client,
            )
        self._spec = _spec
        self.limits = _spec.limits
        self._lock = threading.RLock()
        self._pool = _pool
        self._container = _container or _spec.start()
        self._lease = _Lease(_spec.client, self._container.id)
        self._finalizer = weakref.finalize(self, _finalize, self._lease)
        self.isolation = self._container.isolation
        self._closed = False

    # --- state -------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed sandbox refuses every call."""
        return self._closed

    @property
    def container_id(self) -> str:
        """The id of the container in use now (it changes when the sandbox had to be replaced)."""
        return self._container.id

    @property
    def image(self) -> str:
        """The image the container runs."""
        return self._spec.image

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    def _replace_container(self) -> str:
        """Throw the container away and start a fresh one; returns a note for the message."""
        try:
            _remove(self._spec.client, self._container.id)
        except Exception:
            pass
        try:
            self._container = self._spec.start()
            self._lease.cid = self._container.id
            self.isolation = self._container.isolation
            return "the sandbox was restarted with an empty workspace"
        except Exception as e:
            return f"the sandbox could not be restarted ({type(e).__name__}: {e}); the next call tries again"

    def _ensure_container(self) -> str | None:
        """Whether the container still runs; a note when it had to be replaced."""
        try:
            if (self._spec.client.api.inspect_container(self._container.id).get("State") or {}).get("Running"):
                return None
        except Exception:
            pass
        return self._replace_container()

    # --- running -----------------------------------------------------------------------------------

    def _call(
        self,
        argv: list[str],
        *,
        timeout_s: float | None,
        stdin: bytes | None,
        stdout_limit: int | None = None,
    ) -> tuple[ExecResult, _Raw | None]:
        self._check_open()
        timeout = float(self.limits.timeout_s if timeout_s is None else timeout_s)
        if not timeout > 0:
            raise SandboxError(f"timeout_s must be positive, got {timeout_s!r}")
        out_limit = self.limits.max_output_bytes if stdout_limit is None else stdout_limit
        with self._lock:
            self._check_open()
            start = time.monotonic()
            try:
                raw = _exec(
                    self._spec.client,
                    self._container.id,
                    argv,
                    timeout_s=timeout,
                    stdin=stdin,
                    stdout_limit=out_limit,
                    stderr_limit=self.limits.max_output_bytes,
                    env=self._spec.env,
                )
            except _ExecFailed as e:
                note = self._replace_container()
                return (
                    ExecResult(
                        "crashed",
                        None,
                        "",
                        "",
                        time.monotonic() - start,
                        message=f"the sandbox failed to run the command ({e}); {note}",
                    ),
                    None,
                )
            return self._judge(raw, timeout), raw

    def _judge(self, raw: _Raw, timeout: float) -> ExecResult:
        status: Status
        code = raw.exit_code
        message = ""
        if raw.timed_out:
            # The engine did not answer in time: kill what runs, or replace the container.
            status, code = "timeout", None
            message = f"timed out after {timeout:g} s; the sandbox did not answer"
            message += "; its processes were killed" if self._kill_all() else "; " + self._replace_container()
        elif raw.oom:
            status = "oom"
            message = oom_message(self.limits)
        elif code is None:
            status = "crashed"
            message = "the command ended without an exit status"
        elif code in (124, 137) and raw.duration_s >= timeout * 0.97:
            status, code = "timeout", None
            message = f"timed out after {timeout:g} s; the process and its children were killed"
        elif code == 0:
            status = "ok"
        elif 128 < code <= 128 + 64:
            sig = code - 128  # a shell reports a child killed by signal N as 128 + N
            status = "killed"
            message = signal_message(sig, self.limits)
        elif any(h in raw.stderr.tail.decode("utf-8", "replace") for h in OOM_HINTS):
            # The allocation was refused (MemoryError, ENOMEM) before the OOM killer had to act.
            status = "oom"
            message = oom_message(self.limits)
        else:
            status = "error"
            message = f"exited with code {code}"
        if not raw.timed_out and not raw.marker:
            # The wrapper itself was killed (kill -9 -1 from the command, or the container died), so
            # its clean-up did not run: is the container still there, and kill what is left.
            note = self._ensure_container()
            if note:
                message += "; " + note
            else:
                self._kill_all()
        return ExecResult(
            status,
            code,
            raw.stdout.head.decode("utf-8", "replace"),
            raw.stderr.head.decode("utf-8", "replace"),
            raw.duration_s,
            stdout_dropped=raw.stdout.total - len(raw.stdout.head),
            stderr_dropped=max(0, raw.stderr.total - len(raw.stderr.head)),
            message=message,
        )

    def _kill_all(self) -> bool:
        """Kill every process of the sandbox user (an exec of its own); False when the engine fails to."""
        try:
            raw = _exec(
                self._spec.client,
                self._container.id,
                ["true"],
                timeout_s=1.0,
                stdin=None,
                stdout_limit=1024,
                stderr_limit=1024,
                env=self._spec.env,
            )
        except _ExecFailed:
            return False
        return raw.marker and not raw.timed_out

    def run(self, command: str | list[str], *, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        self._check_open()
        if isinstance(command, str):
            argv = ["/bin/sh", "-c", command]
        elif isinstance(command, (list, tuple)) and command and all(isinstance(c, str) for c in command):
            argv = list(command)
        else:
            raise SandboxError("command must be a string or a non-empty list of strings")
        data = None if stdin is None else stdin.encode("utf-8", "surrogateescape")
        return self._call(argv, timeout_s=timeout_s, stdin=data)[0]

    def run_python(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        self._check_open()
        if not isinstance(code, str):
            raise SandboxError("code must be a string")
        data = code.encode("utf-8", "surrogatepass")
        if len(data) < 100_000 and "\x00" not in code:
            return self._call(["python3", "-c", code], timeout_s=timeout_s, stdin=None)[0]
        # argv has a per-argument limit (128 KiB): a long program comes in on stdin.
        return self._call(["python3", "-"], timeout_s=timeout_s, stdin=data)[0]

    # --- files -------------------------------------------------------------------------------------

    @staticmethod
    def _parts(path: str) -> list[str]:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise SandboxError(f"bad path {path!r}")
        p = path
        if p == WORKSPACE:
            p = "."
        elif p.startswith(WORKSPACE + "/"):
            p = p[len(WORKSPACE) + 1 :]
        if p.startswith("/"):
            raise SandboxError(f"path {path!r} is outside the workspace; use a path relative to it")
        norm = posixpath.normpath(p)
        if norm == ".." or norm.startswith("../"):
            raise SandboxError(f"path {path!r} is outside the workspace")
        if norm == ".":
            raise SandboxError(f"path {path!r} names the workspace itself, not a file")
        return norm.split("/")

    def _file_error(self, verb: str, path: str, result: ExecResult) -> SandboxError:
        why = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.message
        if result.exit_code == 2:
            return SandboxError(f"no file {path!r} in the workspace")
        return SandboxError(f"cannot {verb} {path!r}: {why}")

    def write_file(self, path: str, content: str | bytes) -> None:
        self._check_open()
        parts = self._parts(path)
        data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        if len(data) > self.limits.max_file_mb << 20:
            raise SandboxError(
                f"cannot write {path!r}: {len(data)} bytes is over the file size limit of {self.limits.max_file_mb} MB"
            )
        result, _ = self._call(["/bin/sh", "-c", _WRITE, "write", *parts], timeout_s=max(self.limits.timeout_s, 30.0), stdin=data)
        if result.status != "ok":
            raise self._file_error("write", path, result)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        self._check_open()
        parts = self._parts(path)
        if max_bytes is not None and max_bytes <= 0:
            return b""
        limit = max_bytes if max_bytes is not None else (self._spec.workspace_mb + self._spec.tmp_mb) << 20
        script = f"max={max_bytes if max_bytes is not None else ''}\n" + _READ
        result, raw = self._call(
            ["/bin/sh", "-c", script, "read", *parts], timeout_s=max(self.limits.timeout_s, 30.0), stdin=None, stdout_limit=limit
        )
        if result.status != "ok" or raw is None:
            raise self._file_error("read", path, result)
        return bytes(raw.stdout.head)

    # --- lifetime ----------------------------------------------------------------------------------

    def _wipe(self) -> bool:
        result, _ = self._call(["/bin/sh", "-c", _WIPE], timeout_s=30.0, stdin=None)
        return result.status == "ok"

    def reset(self) -> None:
        """Kill everything still running and empty the workspace, ``/tmp`` and ``/dev/shm`` (a
        fresh container when that fails)."""
        self._check_open()
        with self._lock:
            if not self._wipe():
                self._replace_container()

    def close(self) -> None:
        """Remove the container (or give it back to its pool). Idempotent; never raises, even for
        an engine that has gone away."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            if pool is not None and pool._give_back(self._container):
                self._finalizer.detach()
                return
            self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self._container.id[:12]
        return f"<DockerSandbox {state}: {self.isolation.describe()}>"


# ---------------------------------------------------------------------------------------------------
# The warm pool


class DockerPool:
    """Keeps ``size`` sandbox containers started and ready, so an episode never waits for one.

    ``pool.acquire()`` (or ``pool()``: a pool is a ``sandbox_factory``) returns a
    :class:`DockerSandbox` at once when one is ready (a *hit*) and starts one when none is (a
    *miss*, counted in :attr:`stats`). Closing that sandbox gives the container back; the pool then,
    in the background, removes it and starts a fresh one (``recycle="fresh"``) or wipes its
    workspace and ``/tmp`` and kills its processes (``recycle="wipe"``, cheaper). Either way the
    next episode never sees the previous one's files or processes. ``close()`` (or leaving a
    ``with`` block) removes every container of the pool, ready or handed out.

    Keyword arguments other than ``size``, ``recycle`` and ``workers`` are those of
    :class:`DockerSandbox`. Orphaned sandbox containers of crashed processes are removed when a
    pool starts (``cleanup_orphans=False`` to keep them).
    """

    def __init__(
        self,
        size: int = 4,
        limits: Limits | None = None,
        *,
        recycle: Literal["fresh", "wipe"] = "fresh",
        workers: int = 4,
        cleanup_orphans: bool = True,
        image: str | None = None,
        runtime: str | None = None,
        cpus: float = 1.0,
        workspace_mb: int = 256,
        tmp_mb: int = 64,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        docker_host: str | None = None,
        client: Any = None,
        **limit_overrides: Any,
    ) -> None:
        if size < 0:
            raise ValueError("size must be >= 0")
        if recycle not in ("fresh", "wipe"):
            raise ValueError('recycle must be "fresh" or "wipe"')
        self.size = size
        self.recycle = recycle
        self.id = secrets.token_hex(4)
        self._spec = _Spec(
            limits=resolve_limits(limits, limit_overrides, "DockerPool"),
            image=image,
            runtime=runtime,
            cpus=cpus,
            workspace_mb=workspace_mb,
            tmp_mb=tmp_mb,
            env=env,
            labels={**(labels or {}), POOL_LABEL: self.id},
            docker_host=docker_host,
            client=client,
        )
        self.limits = self._spec.limits
        self._spec.check_image()
        if cleanup_orphans:
            cleanup_containers(client=self._spec.client)
        self._cond = threading.Condition()
        self._ready: deque[_Container] = deque()
        self._pending = 0  # starts (and wipes) in flight
        self._leased: weakref.WeakSet[DockerSandbox] = weakref.WeakSet()
        self._closed = False
        self._errors = 0
        self.last_error: str | None = None
        self.stats = {"hits": 0, "misses": 0, "started": 0, "recycled": 0, "removed": 0}
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        self._executor = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tokengym-docker-pool")
        _LIVE.add(self)
        self._refill()

    # --- background work ---------------------------------------------------------------------------

    def _refill(self) -> None:
        with self._cond:
            if self._closed:
                return
            missing = self.size - len(self._ready) - self._pending
            # Back off after repeated failures (a broken engine): the misses will say why.
            if self._errors >= 3:
                missing = 0
            for _ in range(max(0, missing)):
                self._pending += 1
                self._executor.submit(self._start_one)

    def _start_one(self) -> None:
        try:
            container = self._spec.start()
        except Exception as e:
            with self._cond:
                self._pending -= 1
                self._errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._cond.notify_all()
            return
        with self._cond:
            self._pending -= 1
            self._errors = 0
            self.stats["started"] += 1
            if self._closed:
                keep = False
            else:
                self._ready.append(container)
                keep = True
            self._cond.notify_all()
        if not keep:
            self._remove(container.id)

    def _remove(self, cid: str) -> None:
        try:
            _remove(self._spec.client, cid)
            with self._cond:
                self.stats["removed"] += 1
        except Exception:
            pass

    def _give_back(self, container: _Container) -> bool:
        """Called by a pooled sandbox's close(); False when the pool is closed (remove it then)."""
        with self._cond:
            if self._closed:
                return False
            self.stats["recycled"] += 1
            if self.recycle == "wipe":
                self._pending += 1
            try:
                self._executor.submit(self._recycle, container)
            except RuntimeError:  # the executor is shut down
                if self.recycle == "wipe":
                    self._pending -= 1
                return False
        return True

    def _recycle(self, container: _Container) -> None:
        if self.recycle == "fresh":
            self._remove(container.id)
            self._refill()
            return
        ok = False
        try:
            sb = DockerSandbox(_spec=self._spec, _container=container)
            sb._finalizer.detach()
            ok = sb._wipe()
            sb._closed = True
        except Exception:
            ok = False
        with self._cond:
            self._pending -= 1
            keep = ok and not self._closed
            if keep:
                self._ready.append(container)
            self._cond.notify_all()
        if not keep:
            self._remove(container.id)
            self._refill()

    # --- the public side ---------------------------------------------------------------------------

    @property
    def ready(self) -> int:
        """Containers started and waiting."""
        with self._cond:
            return len(self._ready)

    def wait_ready(self, n: int | None = None, timeout_s: float = 60.0) -> bool:
        """Block until ``n`` (default: ``size``) containers are ready; False on timeout."""
        n = self.size if n is None else n
        end = time.monotonic() + timeout_s
        with self._cond:
            while len(self._ready) < n:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
            return True

    def acquire(self) -> DockerSandbox:
        """A sandbox for one episode: a ready container at once, or a freshly started one."""
        with self._cond:
            if self._closed:
                raise SandboxError("the pool is closed")
            container = self._ready.popleft() if self._ready else None
            self.stats["hits" if container else "misses"] += 1
        self._refill()
        if container is None:
            container = self._spec.start()
            with self._cond:
                self.stats["started"] += 1
                restart = self._errors >= 3
                self._errors = 0  # the engine works again: let the background refill resume
            if restart:
                self._refill()
        sb = DockerSandbox(_spec=self._spec, _container=container, _pool=self)
        with self._cond:
            self._leased.add(sb)
        return sb

    def __call__(self, *args: Any, **kwargs: Any) -> DockerSandbox:
        """``sandbox_factory`` form of :meth:`acquire` (arguments are ignored: the pool's settings hold)."""
        return self.acquire()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed pool hands out no sandbox."""
        return self._closed

    def close(self) -> None:
        """Remove every container of the pool: the ready ones and those handed out. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            ready = list(self._ready)
            self._ready.clear()
            leased = list(self._leased)
            self._cond.notify_all()
        _LIVE.discard(self)
        for sb in leased:
            sb.close()  # the pool is closed, so this removes the container
        self._executor.shutdown(wait=True)
        for c in ready:
            self._remove(c.id)
        # Anything a worker started while closing (it removes its own), and stragglers by label.
        try:
            for c in self._spec.client.api.containers(all=True, filters={"label": f"{POOL_LABEL}={self.id}"}):
                self._remove(c["Id"])
        except Exception:
            pass

    def __enter__(self) -> DockerPool:
        return self

    def __copy__(self) -> DockerPool:
        return self

    def __deepcopy__(self, memo: dict) -> DockerPool:
        # A pool is a handle on shared containers (e.g. in an env spec's kwargs, which gymnasium's
        # wrappers deep-copy): copies are the same pool.
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DockerPool size={self.size} ready={self.ready} recycle={self.recycle} image={self._spec.image}>"


@atexit.register
def _close_all() -> None:
    for obj in list(_LIVE):
        try:
            obj.close()
        except Exception:
            pass
