"""Workspace tools, bound to one sandbox: run Python, run a shell command, write and read files.

:func:`sandbox_tools` makes them for an episode's sandbox; state (files, anything written
to the workspace) persists across the calls of that episode because they all act on the
same sandbox, and never across episodes because an episode gets a fresh (or reset) one.

Every result is text for the model (:func:`format_result`): the exit code, stdout and
stderr, and, for anything unusual, one plain sentence first, such as ``timed out after 10 s;
the process and its children were killed`` or ``ran out of memory (limit 512 MB)``. Output
that was cut says how much was dropped. A call never raises into the rollout: misuse (a
path outside the workspace, a missing file) becomes a :class:`~tokengym.envs.function_tools.ToolError`
message, a sandbox that failed becomes an error message, and the episode goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..function_tools import Tool, ToolError
from .base import ExecResult, Sandbox, SandboxError

__all__ = ["SANDBOX_TOOL_NAMES", "format_result", "sandbox_tools"]

SANDBOX_TOOL_NAMES = ("run_python", "run_shell", "write_file", "read_file")
TOOL_GRACE_S = 10.0
"""A tool's own timeout is the sandbox's plus this: the sandbox reports its timeout first."""


def _size(n: int) -> str:
    if n < 10 * 1024:
        return f"{n} bytes"
    if n < 10 * 1024 * 1024:
        return f"{n // 1024} KB"
    return f"{n // (1024 * 1024)} MB"


def format_result(result: ExecResult) -> str:
    """The text a model reads for one command: a headline, then stdout and stderr.

    ``exit code: 0`` heads a normal run (any exit code); a timeout, a kill, running out of
    memory or a sandbox failure heads with its message (``Error: timed out after 10 s; the
    process and its children were killed.``). Sections that are empty are left out; output
    that was cut ends with a note of how much was dropped.
    """
    lines: list[str] = []
    if result.status in ("ok", "error"):
        lines.append(f"exit code: {result.exit_code}")
    else:
        msg = result.message.rstrip(".") or result.status
        lines.append(f"Error: {msg}.")
    for name, text, dropped in (
        ("stdout", result.stdout, result.stdout_dropped),
        ("stderr", result.stderr, result.stderr_dropped),
    ):
        if text or dropped:
            lines.append(f"{name}:")
            lines.append(text.rstrip("\n"))
            if dropped:
                lines.append(f"[... {_size(dropped)} more of {name} dropped: output is cut after {_size(len(text.encode()))} ...]")
    if len(lines) == 1 and result.status in ("ok", "error"):
        lines.append("(no output)")
    return "\n".join(lines)


def sandbox_tools(
    sandbox: Sandbox,
    names: Sequence[str] = SANDBOX_TOOL_NAMES,
    *,
    timeout_s: float | None = None,
    max_read_bytes: int | None = None,
) -> list[Tool]:
    """Tools that act on ``sandbox``: any of ``run_python``, ``run_shell``, ``write_file``, ``read_file``.

    Args:
        sandbox: the episode's sandbox (the tools hold it; they do not close it).
        names: which tools, in this order.
        timeout_s: seconds per command (default: the sandbox's ``limits.timeout_s``).
        max_read_bytes: ``read_file`` returns at most this many bytes (default: the sandbox's
            ``limits.max_output_bytes``), with a note when the file is longer.

    The tools run one after another in call order (``parallel=False``): a turn that writes a
    file and then runs it sees its own write.
    """
    unknown = [n for n in names if n not in SANDBOX_TOOL_NAMES]
    if unknown:
        raise ValueError(f"unknown sandbox tool(s) {unknown}; choose from {list(SANDBOX_TOOL_NAMES)}")
    limit = float(timeout_s if timeout_s is not None else sandbox.limits.timeout_s)
    read_cap = int(max_read_bytes if max_read_bytes is not None else sandbox.limits.max_output_bytes)
    tool_timeout = limit + TOOL_GRACE_S

    def guarded(fn: Any) -> Any:
        def call(**kwargs: Any) -> str:
            try:
                return fn(**kwargs)
            except SandboxError as err:
                raise ToolError(str(err)) from None

        return call

    def run_python(code: str) -> str:
        result = sandbox.run_python(code, timeout_s=limit)
        if result.status == "crashed":
            raise ToolError(f"the sandbox failed: {result.message}")
        return format_result(result)

    def run_shell(command: str) -> str:
        result = sandbox.run(command, timeout_s=limit)
        if result.status == "crashed":
            raise ToolError(f"the sandbox failed: {result.message}")
        return format_result(result)

    def write_file(path: str, content: str) -> str:
        sandbox.write_file(path, content)
        return f"wrote {len(content.encode())} bytes to {path}"

    def read_file(path: str) -> str:
        data = sandbox.read_file(path, max_bytes=read_cap + 1)
        text = data[:read_cap].decode("utf-8", "replace")
        if len(data) > read_cap:
            text += f"\n[... the file is longer: only its first {_size(read_cap)} are shown ...]"
        return text

    specs = {
        "run_python": (
            run_python,
            f"Run a Python 3 program in the sandbox and return its exit code, stdout and stderr. It runs in "
            f"the working directory, where files persist between calls; there is no network. "
            f"Each run may take at most {limit:g} s; print what you want to see.",
            {"code": {"type": "string", "description": "the complete Python program to run"}},
        ),
        "run_shell": (
            run_shell,
            f"Run a shell command (sh) in the sandbox's working directory and return its exit code, "
            f"stdout and stderr. Files persist between calls; there is no network. Each command may take at "
            f"most {limit:g} s.",
            {"command": {"type": "string", "description": "the shell command line, e.g. \"ls -la\""}},
        ),
        "write_file": (
            write_file,
            "Write a text file in the sandbox's working directory (parent directories are created; an "
            "existing file is replaced).",
            {
                "path": {"type": "string", "description": "the file's path, relative to the working directory"},
                "content": {"type": "string", "description": "the whole content of the file"},
            },
        ),
        "read_file": (
            read_file,
            f"Read a text file from the sandbox's working directory (at most its first {_size(read_cap)}).",
            {"path": {"type": "string", "description": "the file's path, relative to the working directory"}},
        ),
    }
    tools = []
    for name in names:
        fn, description, props = specs[name]
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": props, "required": list(props)},
            },
        }
        tools.append(Tool(guarded(fn), schema=schema, timeout=tool_timeout, parallel=False))
    return tools
