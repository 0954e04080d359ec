"""Replay: an environment that plays back a recorded transcript.

Its observations are the transcript's non-assistant messages, in order, whatever the
policy does. Feeding it the transcript's own assistant turns (:meth:`ReplayEnv.reference_action`)
turns an existing OpenAI-style transcript into a token trajectory, and checks a chat
template against a real multi-turn tool conversation.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from .chat import AssistantTurn, ChatEnv, EnvResponse, Prompt
from .parsers import detect_parser, get_parser
from .plain_copy import plain_copy
from .render import Message, TemplateError

__all__ = [
    "MESSAGE_KEYS",
    "ROLES",
    "ReplayEnv",
    "Transcript",
    "check_message",
    "example_transcript",
    "load_transcript",
    "normalize_message",
]

Transcript = dict[str, Any]


def normalize_message(message: Mapping[str, Any]) -> Message:
    """A copy with tool-call arguments as objects (templates ``tojson`` them) and ``None`` keys dropped."""
    out = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
    calls = out.get("tool_calls")
    if calls:
        for call in calls:
            fn = call.get("function", call)
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args)
                except json.JSONDecodeError:
                    pass  # keep what the transcript says: the template renders it as given
    return out


ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
"""Message roles a transcript may use (``ipython`` is Llama 3's tool-result role)."""
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
"""Keys tokengym knows; other keys pass to the template, unless they look like a misspelling of one of these."""


def _fail(index: int, problem: str, fix: str) -> ValueError:
    return ValueError(f"message {index}: {problem}; {fix}")


_CALL_SHAPE = 'write {"type": "function", "function": {"name": ..., "arguments": {...}}}'


def _check_call(index: int, k: int, call: Any) -> None:
    if not isinstance(call, Mapping):
        raise _fail(index, f"tool call {k} is {type(call).__name__}", _CALL_SHAPE)
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or not name:
        raise _fail(index, f"tool call {k} has no function name", _CALL_SHAPE)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as err:
            raise _fail(
                index,
                f"the arguments of tool call {k} ({name}) are not valid JSON "
                f"({err.msg} at character {err.pos}: {fn['arguments']!r})",
                "write them as a JSON object or a string holding one",
            ) from None
    if not isinstance(args, Mapping):
        problem = f"the arguments of tool call {k} ({name}) are {type(args).__name__}, not an object"
        raise _fail(index, problem, "write them as a JSON object")


def check_message(index: int, message: Any) -> None:
    """A ValueError naming message ``index`` and the fix when it is not a message a chat template
    renders as meant: templates skip unknown roles and read missing keys as empty, silently."""
    if not isinstance(message, Mapping):
        raise _fail(index, f"is {type(message).__name__}, not an object", 'write {"role": ..., "content": ...}')
    role = message.get("role")
    if role not in ROLES:
        near = difflib.get_close_matches(str(role), ROLES, n=1)
        did = f'did you mean "{near[0]}"? ' if near else ""
        raise _fail(index, f"unknown role {role!r}", f"{did}a role is one of {', '.join(ROLES)}")
    for key in message:
        near = difflib.get_close_matches(str(key), MESSAGE_KEYS, n=1, cutoff=0.75)
        if key not in MESSAGE_KEYS and near:
            raise _fail(index, f"unknown key {key!r}", f'did you mean "{near[0]}"? (the template would not see it)')
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise _fail(index, f"content is {type(content).__name__}", "write text (or a list of content parts)")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _fail(index, f"a {role} message has tool_calls", "only assistant messages call tools")
        if not isinstance(calls, list):
            raise _fail(index, f"tool_calls is {type(calls).__name__}", "write a list of calls")
        for k, call in enumerate(calls):
            _check_call(index, k, call)


def load_transcript(source: str | PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> Transcript:
    """Read ``{"messages": [...], "tools": [...]}`` or a bare message list, from a file or an object."""
    if isinstance(source, (str, PathLike)):
        path = Path(source)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
    else:
        data = source
    if isinstance(data, Mapping):
        messages, tools = data.get("messages"), data.get("tools")
    else:
        messages, tools = data, None
    if not isinstance(messages, Sequence) or not messages:
        raise ValueError("a transcript needs a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"message {i} has no role: {m!r}")
        check_message(i, m)
    normalized = [normalize_message(m) for m in messages]
    roles = [m["role"] for m in normalized]
    if "assistant" not in roles:
        raise ValueError("a transcript needs at least one assistant message to replay")
    if roles.index("assistant") == 0:
        raise ValueError("a transcript must open with at least one non-assistant message")
    for i, m in enumerate(normalized[:-1]):
        if m["role"] == "assistant" and m.get("tool_calls") and roles[i + 1] != "tool":
            n = len(m["tool_calls"])
            raise ValueError(
                f"message {i + 1} ({roles[i + 1]}): message {i} (assistant) made {n} tool call{'s' * (n != 1)} and no "
                "result follows it; put the results right after it as role 'tool' messages (one per call, "
                "with its tool_call_id), or drop the calls"
            )
    return {"messages": normalized, "tools": copy.deepcopy(list(tools)) if tools else None}


def example_transcript() -> Transcript:
    """The shipped example: parallel tool calls, several turns, a user follow-up, reasoning."""
    text = resources.files("tokengym.envs").joinpath("data/example_transcript.json").read_text(encoding="utf-8")
    return load_transcript(json.loads(text))


def _message_error(index: int, message: Mapping[str, Any], text: str) -> TemplateError:
    """A TemplateError about transcript message ``index`` (``message_index`` says which)."""
    err = TemplateError(f"message {index} ({message.get('role')}): {text}")
    err.message_index = index  # type: ignore[attr-defined]
    return err


def _fix_for(message: Message, err: TemplateError) -> str:
    """What to change in a transcript message the template refuses: its call ids when the error
    is about ids (Mistral's templates take 9 letters or digits), else its keys and values."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    ids = [str(c["id"]) for c in calls or () if isinstance(c, dict) and c.get("id") is not None]
    if ids and re.search(r"\bids?\b", str(err), re.IGNORECASE):
        return (
            f"the template refuses its call ids ({', '.join(ids)}): give the transcript's calls, and the tool "
            "results that answer them, ids of the form the template takes (Mistral's: 9 letters or digits, as a1b2c3d4e)"
        )
    return "check its keys and values against what the template reads"


class ReplayEnv(ChatEnv):
    """Plays back a transcript: the prompt is everything before the first assistant message;
    each step answers with the messages that follow the next assistant message.

    Args:
        tokenizer: as for :class:`ChatEnv`.
        transcript: a path, a ``{"messages", "tools"}`` dict or a message list; the shipped
            example when omitted. ``reset(options={"transcript": ...})`` replaces it per episode.
        tools: overrides the transcript's tools.
    """
    step_waits = False  # replays a transcript held in memory

    reset_options = frozenset({"transcript"})

    def __init__(
        self,
        tokenizer: Any,
        transcript: str | PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        self._default = example_transcript() if transcript is None else load_transcript(transcript)
        if tools is not None:
            self._default["tools"] = copy.deepcopy(list(tools))
        kwargs.setdefault("max_turns", max(16, self._count_assistant(self._default)))
        super().__init__(tokenizer, **kwargs)
        self._transcript = self._default
        self._default_checked = False

    @staticmethod
    def _count_assistant(transcript: Transcript) -> int:
        return sum(m["role"] == "assistant" for m in transcript["messages"])

    @property
    def transcript(self) -> Transcript:
        """The conversation this env replays."""
        return copy.deepcopy(self._transcript)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start replaying. ``options={"messages": [...], "tools": [...]}`` replays those messages
        as a transcript (the same as ``options={"transcript": {...}}``); messages without an
        assistant turn are only a prompt, and the episode ends at the first step."""
        opts = dict(options or {})
        if "messages" in opts:
            messages = list(opts["messages"])
            if any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages):
                opts["transcript"] = {"messages": messages, "tools": opts.pop("tools", None) or []}
                del opts["messages"]
            else:  # a prompt with nothing to replay (ChatEnv renders it)
                self._transcript = {"messages": copy.deepcopy(messages), "tools": copy.deepcopy(opts.get("tools"))}
                self._assistant_at = []
        try:
            return super().reset(seed=seed, options=opts)
        except TemplateError as err:
            first = self._assistant_at[0] if getattr(self, "_assistant_at", None) else len(self._transcript["messages"])
            raise self._name_message(err, range(first)) from err

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        turn = self._turn
        try:
            return super().step(action)
        except TemplateError as err:
            at = self._assistant_at
            end = at[turn + 1] if turn + 1 < len(at) else len(self._transcript["messages"])
            raise self._name_message(err, range(at[turn], end) if turn < len(at) else range(0)) from err

    def _name_message(self, err: TemplateError, span: range) -> TemplateError:
        """``err`` with the index of the transcript message that makes the template fail: the
        first one whose conversation prefix no longer renders, else the messages being rendered."""
        if getattr(err, "message_index", None) is not None:
            return err
        msgs, tools = self._transcript["messages"], self._transcript["tools"]
        for k in range(len(msgs)):
            try:
                self.renderer.render_text(msgs[: k + 1], tools, add_generation_prompt=False)
            except TemplateError:
                return _message_error(k, msgs[k], f"{err}; the template fails once this message is added: {_fix_for(msgs[k], err)}")
        if not span:
            return TemplateError(f"the transcript: {err}")
        where = f"messages {span.start}-{span.stop - 1}" if len(span) > 1 else f"message {span.start}"
        return TemplateError(f"{where}: {err}")

    def make_prompt(self, options: dict[str, Any]) -> Prompt:
        self._transcript = load_transcript(options["transcript"]) if "transcript" in options else self._default
        msgs = self._transcript["messages"]
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        # Assistant positions and the messages that answer each of them.
        self._assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if self._transcript is not self._default or not self._default_checked:
            self._check_rendered()
            self._default_checked = self._default_checked or self._transcript is self._default
        return Prompt(copy.deepcopy(msgs[:first]), copy.deepcopy(self._transcript["tools"]))

    def _check_rendered(self) -> None:
        """A TemplateError naming the first non-assistant message whose text the template leaves
        out of every conversation that holds it: templates skip roles they do not know, silently.
        A message the whole render leaves out is looked for in the renders of the conversation's
        prefixes that hold it, since some templates render a message only while it is near the end
        (Mistral's system prompt goes with the last user message). (Assistant text is not checked:
        some templates print only an assistant's tool calls.)"""
        msgs, tools = self._transcript["messages"], self._transcript["tools"]

        def rendered(end: int) -> str | None:
            try:
                text = self.renderer.render_text(msgs[:end], tools, add_generation_prompt=end < len(msgs))
            except TemplateError:
                return None
            return " ".join(text.split())

        whole = rendered(len(msgs))
        if whole is None:
            return  # the turn that meets it reports it (conformance: a mismatch in warn mode)
        for i, m in enumerate(msgs):
            content = m.get("content")
            if m["role"] == "assistant" or not isinstance(content, str) or not content.strip():
                continue
            forms = (" ".join(content.split()), " ".join(json.dumps(content)[1:-1].split()))
            if any(f in whole for f in forms):
                continue
            if any(
                (text := rendered(end)) is not None and any(f in text for f in forms) for end in range(i + 1, len(msgs))
            ):
                continue
            raise _message_error(
                i, m, "the chat template leaves its text out of the conversation (a role the template does not "
                "render?); use a role it renders, e.g. user or system"
            )

    def reference_message(self, turn: int | None = None) -> Message:
        """The transcript's assistant message for ``turn`` (the current turn by default)."""
        k = self._turn if turn is None else turn
        if not 0 <= k < len(self._assistant_at):
            raise IndexError(f"the transcript has {len(self._assistant_at)} assistant turns, not {k + 1}")
        return copy.deepcopy(self._transcript["messages"][self._assistant_at[k]])

    def reference_action(self, turn: int | None = None) -> np.ndarray:
        """The token ids the model would emit for the transcript's assistant message of ``turn``."""
        k = self._turn if turn is None else turn
        try:
            rendered = self.renderer.assistant(self.reference_message(k), self._transcript["tools"])
        except TemplateError as err:
            raise self._name_message(err, range(self._assistant_at[k], self._assistant_at[k] + 1)) from err
        return np.array(rendered.ids, dtype=np.int64)

    def _split(self, text: str) -> Message | None:
        """The turn as a server hands it to the template, where the template's call format has
        its own split (Harmony's channels: gpt-oss's template refuses them in content)."""
        parser = getattr(self, "_format_parser", None)
        if parser is None:  # detected once per env: the template does not change between turns
            template = self.renderer.chat_template or getattr(self.renderer.tokenizer, "chat_template", None)
            parser = self._format_parser = get_parser(detect_parser(template if isinstance(template, str) else None))
        return parser.split_message(text)

    def respond(self, turn: AssistantTurn) -> EnvResponse:
        msgs = self._transcript["messages"]
        if turn.turn >= len(self._assistant_at):
            return EnvResponse(done=True, info={"replay": "transcript exhausted"})
        start = self._assistant_at[turn.turn] + 1
        end = self._assistant_at[turn.turn + 1] if turn.turn + 1 < len(self._assistant_at) else len(msgs)
        last = turn.turn + 1 >= len(self._assistant_at)
        calls = msgs[self._assistant_at[turn.turn]].get("tool_calls")
        return EnvResponse(
            messages=plain_copy(msgs[start:end]) if not last else [],
            done=last,
            tool_calls=plain_copy(calls),
            message=self._split(turn.text),
            info={"replay_trailing": plain_copy(msgs[start:end])} if last and start < end else {},
        )
