"""Sandboxes where model-written code and shell commands run: a local process sandbox
(the default, no daemon) and a Docker sandbox, behind one interface (:class:`Sandbox`).

The backends import lazily, so ``import tokengym.envs`` never needs the ``docker`` SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import ExecResult, Isolation, Limits, Sandbox, SandboxError, Status

__all__ = [
    "DockerPool",
    "DockerSandbox",
    "ExecResult",
    "Isolation",
    "Limits",
    "LocalSandbox",
    "Sandbox",
    "SandboxError",
    "SandboxToolEnv",
    "Status",
    "bwrap_status",
    "cleanup_containers",
    "format_result",
    "make_sandbox",
    "sandbox_tools",
]

_LAZY = {
    "LocalSandbox": ".local",
    "DockerSandbox": ".docker",
    "DockerPool": ".docker",
    "cleanup_containers": ".docker",
    "bwrap_status": ".local",
    "sandbox_tools": ".workspace_tools",
    "format_result": ".workspace_tools",
    "SandboxToolEnv": ".env",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_sandbox(backend: str = "local", **kwargs: Any) -> Sandbox:
    """A new sandbox of ``backend`` (``"local"`` or ``"docker"``); ``kwargs`` go to its constructor."""
    if backend == "local":
        return __getattr__("LocalSandbox")(**kwargs)
    if backend == "docker":
        return __getattr__("DockerSandbox")(**kwargs)
    raise ValueError(f'unknown sandbox backend {backend!r}: use "local" or "docker"')
