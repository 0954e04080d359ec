"""The typed records an env hands its recorder and driver: one at reset, one per step.

Gymnasium's ``info`` is a dict for people: any key, any value, read by name. The recorder and
the driver need a contract instead, one a type checker and a reader can follow: which turn this
was, how the turn closed, how much context is left, the template check, why the episode ended,
whether a new context began, the tools' rewards and the facts about the whole episode.
:class:`ChatEnv <tokengym.envs.chat.ChatEnv>` writes that contract in one place, a
:class:`StepRecord` (a :class:`ResetRecord` at reset), carries it under :data:`RECORD` in
``info`` (the one way through any stack of gymnasium wrappers and vector envs), and fills the
user's keys of ``info`` from it. The recorder and the driver read only the record.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .conformance import Conformance

__all__ = ["EPISODE_FACTS", "RECORD", "ResetRecord", "StepRecord", "ToolCall", "ToolReward", "tool_call", "reset_record", "step_record"]

RECORD = "record"
"""The ``info`` key that holds the step's :class:`StepRecord` (the reset's :class:`ResetRecord`)."""

EPISODE_FACTS = ("tool_stats", "final_reward", "stop_detail", "grade")
"""Keys of an :class:`~tokengym.envs.chat.EnvResponse`'s ``info`` that describe the whole episode
(reported on its last step): the record keeps them, the recorder copies them into the
trajectory's ``metadata``."""

ClosedBy = Literal["end_of_turn", "eos", "stop_string", "none"]


@dataclass(frozen=True, slots=True)
class ToolReward:
    """A reward a tool gave on a turn (``ToolResult(..., reward=...)``), apart from the turn's reward."""

    turn: int
    name: str | None
    reward: float

    def as_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "name": self.name, "reward": self.reward}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """What one tool call of a turn's action was and what became of it (its turn is the step's):
    the trajectory's ``metadata["tool_calls"]``, beside the call's text in the action's tokens and
    its result in the observation's. Made by :func:`tool_call`, which shares equal records between
    turns and episodes (an episode in flight keeps a pointer a call, not a record)."""

    name: str | None
    status: str
    """``ok``, ``error``, ``timeout``, or why it did not run (``parse_error``, ``unknown_tool``, ...)."""


@functools.lru_cache(maxsize=1024)
def tool_call(name: str | None, status: str) -> ToolCall:
    """The one :class:`ToolCall` with these fields (shared: records are immutable)."""
    return ToolCall(name, status)


@dataclass(frozen=True, slots=True)
class ResetRecord:
    """What ``reset`` tells the recorder and the driver."""

    task: dict[str, Any]
    """The prompt's task data (its ``id`` is the GRPO group key): the env's own copy, read it only."""
    num_tokens: int
    """The prompt's length."""
    remaining_context: int
    """Tokens the episode may still add (``max_context_tokens`` or the completion budget)."""
    images: tuple[Any, ...] = ()
    """The prompt's images (:class:`~tokengym.envs.images.StreamImage`), in stream order."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one ``step`` tells the recorder and the driver."""

    turn: int
    """The assistant turn this step took (0 for the first)."""
    closed_by: ClosedBy
    """How the action ended: its end-of-turn token, an EOS, a stop string, or not at all."""
    num_tokens: int
    """The stream's length after this step (of the current context, with ``history="deploy"``)."""
    num_action_tokens: int
    remaining_context: int
    """Tokens the episode may still add."""
    conformance: Conformance
    """The turn's template check."""
    stop_reason: str | None = None
    """Why the episode ended on this step (``"done"``, ``"max_turns"``, ``"context_length"``,
    ``"action_length"`` or the env's own); None while it goes on."""
    context_reset: bool = False
    """The observation is a whole new context (``history="deploy"``): the recorder starts a new row."""
    tool_rewards: tuple[ToolReward, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    """The turn's tool calls, in order (none for envs without tools)."""
    episode_facts: dict[str, Any] = field(default_factory=dict)
    """The response's :data:`EPISODE_FACTS` that it reported (a copy, read it only; a record is
    pickled across processes, so no read-only proxy)."""
    images: tuple[Any, ...] = field(default=(), compare=False)
    """The observation's images (:class:`~tokengym.envs.images.StreamImage`: their runs at offsets
    in the stream), in stream order."""

    @property
    def done(self) -> bool:
        return self.stop_reason is not None


def reset_record(info: Mapping[str, Any]) -> ResetRecord:
    """The :class:`ResetRecord` in a reset's ``info``, or a TypeError naming what is missing."""
    return _record(info, ResetRecord, "reset")


def step_record(info: Mapping[str, Any]) -> StepRecord:
    """The :class:`StepRecord` in a step's ``info``, or a TypeError naming what is missing."""
    return _record(info, StepRecord, "step")


def _record(info: Mapping[str, Any], kind: type, call: str) -> Any:
    record = info.get(RECORD) if isinstance(info, Mapping) else None
    if not isinstance(record, kind):
        got = "no info dict" if not isinstance(info, Mapping) else (
            f"info[{RECORD!r}] is {type(record).__name__}" if RECORD in info else f"no info[{RECORD!r}]"
        )
        raise TypeError(
            f"the env's {call}() returned {got}: the recorder and the drivers need a tokengym env (a "
            f"ChatEnv subclass) whose info carries a {kind.__name__}; a wrapper that rebuilds info must keep that key"
        )
    return record
