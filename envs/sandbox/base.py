"""The one interface every sandbox backend implements.

A tool that runs model-written code must never hang, crash or flood the rollout: every
operation here returns an :class:`ExecResult` (or raises :class:`SandboxError` only for
misuse such as a closed sandbox or a path outside the workspace), whatever the code does.
Backends differ in *how* they isolate; :attr:`Sandbox.isolation` says, honestly, which
isolation is active so that nobody trains untrusted code under a promise the machine
cannot keep.
"""

from __future__ import annotations

import abc
import posixpath
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import TracebackType
from typing import Literal

__all__ = [
    "ExecResult",
    "Isolation",
    "Launch",
    "Limits",
    "Sandbox",
    "SandboxError",
    "Status",
    "process_start_time",
    "resolve_limits",
]

Status = Literal["ok", "error", "timeout", "killed", "oom", "crashed"]
"""``ok``: exit code 0. ``error``: a non-zero exit. ``timeout``: killed at the wall-clock limit.
``killed``: killed by a signal or a resource limit other than memory. ``oom``: killed for memory.
``crashed``: the sandbox itself failed (backend error); the episode goes on with a clear message."""


class SandboxError(Exception):
    """Misuse of a sandbox (closed, path outside the workspace, bad argument) -- a caller's bug."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox. ``None`` leaves a limit to the backend's default."""

    timeout_s: float = 10.0
    """Wall-clock limit of one command; the whole process group / exec is killed after it."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU locally)."""
    memory_mb: int = 512
    """Memory of the whole sandbox, swap included: the container's (Docker) or a cgroup's (locally,
    where the host allows one; each process's address space is capped at it too)."""
    max_processes: int = 64
    """Processes/threads of the whole sandbox (the pids limit: Docker's, or a local cgroup's; and
    RLIMIT_NPROC locally)."""
    max_file_mb: int = 64
    """Largest file a command may write."""
    max_open_files: int = 256
    disk_mb: int = 256
    """Disk quota of the workspace (a sized tmpfs in both backends; locally, without the privilege to
    mount one, a watchdog that stops the call past it). Its pages are memory in a tmpfs."""
    max_files: int = 20_000
    """Inode quota of the workspace (files, directories and links), held like :attr:`disk_mb`."""
    max_output_bytes: int = 64 * 1024
    """stdout and stderr are each cut to this many bytes (head kept, the rest counted and dropped)."""


def resolve_limits(limits: Limits | None, overrides: Mapping[str, object], who: str) -> Limits:
    """``limits`` (or the defaults) with keyword overrides of its fields, as every backend takes them."""
    known = {f.name for f in fields(Limits)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown {who} argument(s) {unknown}; Limits fields are {sorted(known)}")
    return replace(limits or Limits(), **overrides)  # type: ignore[arg-type]


OOM_HINTS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory", "Out of memory")
"""What a process prints when an allocation is refused (before or instead of the OOM killer)."""


def oom_message(limits: Limits) -> str:
    """The message of an ``oom`` result, the same on every backend."""
    return f"ran out of memory (limit {limits.memory_mb} MB)"


DISK_FULL_HINTS = ("No space left on device", "Disk quota exceeded")
"""What a process prints when a write is refused for lack of space or inodes."""


def disk_full_message(limits: Limits, code: int | None) -> str:
    """The message of a call that ran into the workspace's quota, the same on every backend."""
    return (
        f"exited with code {code}: the workspace is full (quota {limits.disk_mb} MB, {limits.max_files} files); "
        "remove files to go on"
    )


def quota_message(limits: Limits) -> str:
    """The message of a call stopped because the workspace went past its quota."""
    return f"killed: the workspace went past its quota ({limits.disk_mb} MB, {limits.max_files} files); remove files to go on"


NAME_MAX = 255
"""The longest file name (bytes) Linux file systems take."""


def check_path_length(parts: list[str], path: str) -> list[str]:
    """``parts`` when each name fits ``NAME_MAX`` bytes and the whole path ``PATH_MAX``; else a
    :class:`SandboxError` (the same check, and message, on every backend)."""
    for part in parts:
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise SandboxError(f"path {path[:80]!r}...: the name {part[:40]!r}... is longer than {NAME_MAX} bytes")
    if sum(len(p.encode("utf-8", "surrogateescape")) + 1 for p in parts) > 4000:
        raise SandboxError(f"path {path[:80]!r}... is longer than 4000 bytes")
    return parts


def workspace_parts(path: str, workspaces: Iterable[str]) -> list[str]:
    """The names of ``path`` relative to the workspace (given relative, or under one of the
    ``workspaces`` spellings of its root), or a :class:`SandboxError`: outside the workspace,
    the workspace itself, a bad or overlong path (the same rules, and messages, on every backend)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"bad path {path!r}")
    p = path
    for prefix in workspaces:
        root = prefix.rstrip("/")
        if p == prefix or p == root:
            p = "."
        elif p.startswith(root + "/"):
            p = p[len(root) + 1 :]
    if p.startswith("/"):
        raise SandboxError(f"path {path!r} is outside the workspace; use a path relative to it")
    norm = posixpath.normpath(p)
    if norm == ".." or norm.startswith("../"):
        raise SandboxError(f"path {path!r} is outside the workspace")
    if norm == ".":
        raise SandboxError(f"path {path!r} names the workspace itself, not a file")
    return check_path_length(norm.split("/"), path)


def signal_message(sig: int, limits: Limits) -> str:
    """The message of a ``killed`` result: which limit a signal stands for, the same on every backend."""
    if sig == signal.SIGXCPU:
        return f"killed: CPU time limit of {limits.cpu_s} s reached"
    if sig == signal.SIGXFSZ:
        return f"killed: file size limit of {limits.max_file_mb} MB reached"
    if sig == signal.SIGKILL:
        return "killed by SIGKILL (a resource limit or the kernel)"
    try:
        return f"killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"killed by signal {sig}"


@dataclass(frozen=True)
class Isolation:
    """What isolation is really active -- measured when the sandbox starts, never assumed."""

    backend: str
    """``"local"`` or ``"docker"``."""
    network: bool
    """True when the code has no network (only a loopback interface or nothing)."""
    filesystem: bool
    """True when the host's files outside the workspace are hidden or read-only."""
    limits: bool
    """True when resource limits (CPU, memory, processes, file size) are enforced."""
    details: tuple[str, ...] = field(default=())
    """Free-form notes (e.g. ``"bubblewrap 0.8.0"``, ``"no bubblewrap: plain rlimits only"``)."""
    group_limits: bool = False
    """True when memory and process limits hold for the whole sandbox together (a cgroup, a
    container); False when they hold per process (then N processes may use N times the memory)."""
    disk_quota: bool = False
    """True when the workspace has a disk and inode quota (:attr:`Limits.disk_mb`, :attr:`Limits.max_files`)."""

    def describe(self) -> str:
        """One line for logs and a sandbox's ``repr``."""
        parts = [
            f"{self.backend} sandbox",
            "network: none" if self.network else "network: NOT isolated",
            "files: isolated" if self.filesystem else "files: NOT isolated",
            ("limits: on" if self.limits else "limits: OFF")
            + (" (per sandbox)" if self.group_limits else " (per process)" if self.limits else ""),
            "disk quota: on" if self.disk_quota else "disk quota: OFF",
        ]
        return "; ".join(parts + list(self.details))


@dataclass(frozen=True)
class ExecResult:
    """What one command or snippet did. Never raised, always returned."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    stdout_dropped: int = 0
    """Bytes of stdout dropped over :attr:`Limits.max_output_bytes`."""
    stderr_dropped: int = 0
    message: str = ""
    """A one-line human explanation for anything but ``ok`` (shown to the model by the tools)."""

    @property
    def ok(self) -> bool:
        """True when the command exited with code 0 (status ``ok``)."""
        return self.status == "ok"


@dataclass(frozen=True)
class Launch:
    """How to start a long-lived process inside a sandbox from the host: the host-side command,
    its environment and working directory. The process's stdin, stdout and stderr are whatever
    the caller gives that command (an MCP server's stdio, say); it runs under the sandbox's
    isolation and limits, and :meth:`Sandbox.reset` or :meth:`Sandbox.close` kills it."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None = None


class Sandbox(abc.ABC):
    """A workspace where untrusted commands run. Use as a context manager; ``close`` is idempotent.

    State (files, installed things) persists across calls until :meth:`reset`, which gives an
    empty workspace; nothing persists across :meth:`close`.
    """

    limits: Limits
    isolation: Isolation

    @abc.abstractmethod
    def run(self, command: str | list[str], *, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """Run a shell command (a string, through ``sh -c``) or an argv list in the workspace."""

    @abc.abstractmethod
    def run_python(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run a Python snippet in the workspace with the sandbox's interpreter."""

    @abc.abstractmethod
    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file at ``path`` relative to the workspace (parents created); :class:`SandboxError`
        when it cannot be written (a full workspace, a name too long), never a raw ``OSError``."""

    @abc.abstractmethod
    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Read a file at ``path`` relative to the workspace; :class:`SandboxError` if missing."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Kill everything still running and give an empty workspace."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill everything and release every resource (processes, directories, containers, and
        whatever the sandbox left on the host). Never raises."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` ran; a closed sandbox refuses every call (:class:`SandboxError`)."""

    def launch(self, argv: list[str], *, env: Mapping[str, str] | None = None) -> Launch:
        """How to start ``argv`` inside the sandbox as a long-lived process whose stdio is the
        caller's (a server, not a command run to its end: no wall-clock limit, the other limits
        hold; ``cpu_s`` counts its whole life). ``env`` is set inside, on top of the sandbox's."""
        raise SandboxError(f"{type(self).__name__} cannot start a long-lived process")

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.isolation.describe()}>"


def process_start_time(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22, clock ticks since boot), or None
    when there is no such process: with the pid, it names a process even after the pid is reused.
    Both backends record their sandboxes' owner with it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 (starttime), counted after the parenthesised command name.
    return stat[stat.rindex(b")") + 2 :].split()[19].decode()
