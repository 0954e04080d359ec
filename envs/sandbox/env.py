"""SandboxToolEnv: a tool environment whose episodes each get a sandbox of their own.

The lifecycle, in one place for every sandbox env:

* ``reset`` closes the previous episode's sandbox (if still open), gets a new one from the
  factory, lets the env prepare it for the task (:meth:`SandboxToolEnv.setup_sandbox`), and
  binds the episode's tools to it;
* the reward runs while the sandbox is still open (inside the final ``step``), then the
  sandbox is closed as soon as the episode ends (terminated or truncated);
* an exception anywhere in ``reset`` or ``step`` (a ``KeyboardInterrupt`` included) closes it
  before it propagates, and so does ``env.close()``. A sandbox is never leaked.

The factory is ``sandbox_factory()`` when given, else ``make_sandbox(sandbox, **sandbox_kwargs)``.
A pool plugs in here: its factory hands out a recycled sandbox whose ``close()`` gives it back
(after a ``reset()``). The env calls ``close()`` exactly once per sandbox it got.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..tool_env import ToolEnv
from . import make_sandbox
from .base import Sandbox
from .workspace_tools import SANDBOX_TOOL_NAMES, sandbox_tools

__all__ = ["SandboxToolEnv"]

log = logging.getLogger(__name__)


class SandboxToolEnv(ToolEnv):
    """A :class:`~tokengym.envs.ToolEnv` with a fresh sandbox per episode and tools bound to it.

    Args:
        tokenizer: as for :class:`~tokengym.envs.ChatEnv`.
        sandbox: the backend, ``"local"`` (default) or ``"docker"``.
        sandbox_kwargs: passed to :func:`~tokengym.envs.sandbox.make_sandbox` (``limits=``,
            ``isolation=``, ``image=``...).
        sandbox_factory: ``() -> Sandbox``, used instead of ``make_sandbox`` (e.g. a warm pool's
            ``acquire``); each sandbox it returns is closed exactly once, at the episode's end.
        sandbox_tools: which of ``run_python``, ``run_shell``, ``write_file``, ``read_file`` the
            model gets.
        command_timeout_s: seconds per command run by a tool (default: the sandbox's limit).
        **kwargs: as for :class:`~tokengym.envs.ToolEnv`.

    :attr:`sandbox` is the current episode's sandbox (``None`` between episodes).
    """

    default_tools: tuple[str, ...] = SANDBOX_TOOL_NAMES

    def __init__(
        self,
        tokenizer: Any,
        tasks: Any = None,
        tools: Sequence[Any] = (),
        *,
        sandbox: str = "local",
        sandbox_kwargs: Mapping[str, Any] | None = None,
        sandbox_factory: Callable[[], Sandbox] | None = None,
        sandbox_tools: Sequence[str] | None = None,
        command_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, tasks, tools, **kwargs)
        if sandbox not in ("local", "docker"):
            raise ValueError(f'sandbox must be "local" or "docker", got {sandbox!r}')
        self.sandbox_backend = sandbox
        self.sandbox_kwargs = dict(sandbox_kwargs or {})
        self.sandbox_factory = sandbox_factory
        self.sandbox_tool_names = tuple(sandbox_tools if sandbox_tools is not None else self.default_tools)
        unknown = [n for n in self.sandbox_tool_names if n not in SANDBOX_TOOL_NAMES]
        if unknown:
            raise ValueError(f"unknown sandbox tool(s) {unknown}; choose from {list(SANDBOX_TOOL_NAMES)}")
        self.command_timeout_s = command_timeout_s
        self._sandbox: Sandbox | None = None

    # ----------------------------------------------------------------- hooks
    def setup_sandbox(self, sandbox: Sandbox, task: dict[str, Any]) -> None:
        """Prepare the episode's sandbox for ``task`` (write its files...). Default: nothing."""

    # ------------------------------------------------------------- sandboxes
    @property
    def sandbox(self) -> Sandbox | None:
        """The current episode's sandbox; ``None`` before the first reset and after an episode ended."""
        return self._sandbox

    def new_sandbox(self) -> Sandbox:
        """The sandbox for a new episode: from ``sandbox_factory`` (e.g. a warm pool) when given, else a new one of the ``sandbox`` backend."""
        if self.sandbox_factory is not None:
            return self.sandbox_factory()
        return make_sandbox(self.sandbox_backend, **self.sandbox_kwargs)

    def close_sandbox(self) -> None:
        """Close the current sandbox (idempotent; errors are logged, never raised)."""
        sb, self._sandbox = self._sandbox, None
        if sb is not None:
            try:
                sb.close()
            except Exception:  # a failing close must not break the rollout
                log.exception("closing the sandbox failed")

    def episode_tools(self, task: dict[str, Any]) -> list[Any]:
        self.close_sandbox()
        sb = self.new_sandbox()
        self._sandbox = sb
        self.setup_sandbox(sb, task)
        fresh = sandbox_tools(sb, self.sandbox_tool_names, timeout_s=self.command_timeout_s) if self.sandbox_tool_names else []
        return [*super().episode_tools(task), *fresh]

    # ------------------------------------------------------------- gymnasium
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self.close_sandbox()
        try:
            return super().reset(seed=seed, options=options)
        except BaseException:
            self.close_sandbox()
            raise

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._stream is not None and not self._done:
            self.validate_action(action)  # a malformed action is the caller's to fix: the episode goes on
        try:
            out = super().step(action)
        except BaseException:
            self.close_sandbox()
            raise
        if out[2] or out[3]:
            self.close_sandbox()
        return out

    def close(self) -> None:
        self.close_sandbox()
        super().close()
