"""The :class:`DockerSandbox`: one container, its calls taking turns, its files, its lifetime."""

from __future__ import annotations

import os
import shutil
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..base import (
    DISK_FULL_HINTS,
    OOM_HINTS,
    ExecResult,
    Launch,
    Limits,
    Sandbox,
    SandboxError,
    Status,
    disk_full_message,
    oom_message,
    resolve_limits,
    signal_message,
    workspace_parts,
)
from .framing import READ, WIPE, WRITE, exec_in_container, ExecFailed, Raw
from .spec import SANDBOX_USER, WORKSPACE, Container, remove_container, Spec

if TYPE_CHECKING:
    from .pool import DockerPool

# ---------------------------------------------------------------------------------------------------
# The sandbox
class _Lease:
    """The container a sandbox holds now; removed by the sandbox's finalizer unless given back."""

    def __init__(self, client: Any, cid: str) -> None:
        self.client = client
        self.cid = cid


def _finalize(lease: _Lease) -> None:
    try:
        remove_container(lease.client, lease.cid)
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
        workspace_mb, tmp_mb: sizes of the tmpfs workspace (default: the limits' ``disk_mb``) and ``/tmp``;
            each holds at most ``max_files`` inodes of the limits. They count against memory.
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
        workspace_mb: int | None = None,
        tmp_mb: int = 64,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
        docker_host: str | None = None,
        client: Any = None,
        _spec: Spec | None = None,
        _container: Container | None = None,
        _pool: DockerPool | None = None,
        **limit_overrides: Any,
    ) -> None:
        self._closed = True  # until fully built
        if _spec is None:
            _spec = Spec(
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
            remove_container(self._spec.client, self._container.id)
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
    ) -> tuple[ExecResult, Raw | None]:
        self._check_open()
        timeout = float(self.limits.timeout_s if timeout_s is None else timeout_s)
        if not timeout > 0:
            raise SandboxError(f"timeout_s must be positive, got {timeout_s!r}")
        out_limit = self.limits.max_output_bytes if stdout_limit is None else stdout_limit
        with self._lock:
            self._check_open()
            start = time.monotonic()
            try:
                raw = exec_in_container(
                    self._spec.client,
                    self._container.id,
                    argv,
                    timeout_s=timeout,
                    stdin=stdin,
                    stdout_limit=out_limit,
                    stderr_limit=self.limits.max_output_bytes,
                    env=self._spec.env,
                )
            except ExecFailed as e:
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

    def _judge(self, raw: Raw, timeout: float) -> ExecResult:
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
        elif any(h in raw.stderr.tail.decode("utf-8", "replace") for h in DISK_FULL_HINTS):
            status = "error"
            message = disk_full_message(self.limits, code)
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
            raw = exec_in_container(
                self._spec.client,
                self._container.id,
                ["true"],
                timeout_s=1.0,
                stdin=None,
                stdout_limit=1024,
                stderr_limit=1024,
                env=self._spec.env,
            )
        except ExecFailed:
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

    def launch(self, argv: list[str], *, env: Mapping[str, str] | None = None) -> Launch:
        """``docker exec -i`` of ``argv`` in the container, as the sandbox user in the workspace:
        the container's limits, network and file system hold for it, :meth:`reset` and
        :meth:`close` kill it. Needs the docker CLI on the host; the variables of ``env`` reach
        the container through the CLI's environment (``-e NAME``), never through its argv."""
        self._check_open()
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError("argv must be a non-empty list of strings")
        cli = shutil.which("docker")
        if cli is None:
            raise SandboxError(
                "a process in a Docker sandbox is started with the docker CLI (docker exec -i), which is not on PATH: "
                "install it (apt-get install docker.io, or docker-ce-cli)"
            )
        inside = {**self._spec.env, **(env or {})}
        host = {k: os.environ[k] for k in ("PATH", "HOME", "DOCKER_CONFIG", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY") if k in os.environ}
        full = [cli] + (["-H", self._spec.docker_host] if self._spec.docker_host else [])
        full += ["exec", "-i", "-u", SANDBOX_USER, "-w", WORKSPACE]
        for name in inside:
            full += ["-e", name]
        full += [self._container.id, *argv]
        return Launch(tuple(full), {**host, **inside}, None)

    # --- files -------------------------------------------------------------------------------------

    @staticmethod
    def _parts(path: str) -> list[str]:
        return workspace_parts(path, (WORKSPACE,))

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
        result, _ = self._call(["/bin/sh", "-c", WRITE, "write", *parts], timeout_s=max(self.limits.timeout_s, 30.0), stdin=data)
        if result.status != "ok":
            raise self._file_error("write", path, result)

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        self._check_open()
        parts = self._parts(path)
        if max_bytes is not None and max_bytes <= 0:
            return b""
        limit = max_bytes if max_bytes is not None else (self._spec.workspace_mb + self._spec.tmp_mb) << 20
        script = f"max={max_bytes if max_bytes is not None else ''}\n" + READ
        result, raw = self._call(
            ["/bin/sh", "-c", script, "read", *parts], timeout_s=max(self.limits.timeout_s, 30.0), stdin=None, stdout_limit=limit
        )
        if result.status != "ok" or raw is None:
            raise self._file_error("read", path, result)
        return bytes(raw.stdout.head)

    # --- lifetime ----------------------------------------------------------------------------------

    def _wipe(self) -> bool:
        result, _ = self._call(["/bin/sh", "-c", WIPE], timeout_s=30.0, stdin=None)
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
