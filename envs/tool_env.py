"""ToolEnv: a chat environment whose assistant calls tools until it answers.

Each step parses the assistant's text for tool calls (a parser of the model family's format,
chosen from the chat template or given: see :mod:`tokengym.envs.parsers`), runs every call of
the turn (concurrently, each under a timeout), and answers with one tool message per call
attempt, in call order: the tool's output, or a short error text when the call was malformed,
named an unknown tool, had bad arguments, raised or timed out. A turn without any tool call
is the final answer: the episode terminates and the answer is scored. A turn that looks like a
tool call the parser does not read (another family's call marker, or a call naming one of the
episode's tools in another shape) is never scored: the model reads an error that shows the
expected format, and it counts as an invalid call. Limits end the episode as truncated, with
``info["stop_reason"]``.

Tool output is cut to a token budget per result and per turn (head and tail kept around a
marker, measured with the renderer's ``encode_plain``), so a tool can never flood the
context. Tool text is always tokenized as text: special-token strings in a tool's output
stay text (the renderer sees to it), and invalid UTF-8 is replaced by U+FFFD.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .chat import AssistantTurn, ChatEnv, EnvResponse, Prompt
from .parsers import ParsedCall, ToolCallParser, call_evidence, get_parser, parse_calls
from .render import Message, TemplateError
from .function_tools import Tool, ToolCall, expand_tools
from .plain_copy import plain_copy
from .mcp.tools import MCPTools, OpenMCPTools, mcp_tools_of
from .tool_runner import ToolRunner

__all__ = [
    "CallRecord",
    "ToolEnv",
    "answer_reward",
    "extract_answer",
    "strip_reasoning",
    "truncate_middle",
]

TaskSource = Sequence[Mapping[str, Any]] | Callable[[np.random.Generator], Mapping[str, Any]]
RewardFn = Callable[[str, dict[str, Any]], float]

INVALID_STATUSES = frozenset({"parse_error", "wrong_format", "unknown_tool", "invalid_arguments"})
_STATUSES = ("ok", "error", "timeout", "parse_error", "wrong_format", "unknown_tool", "invalid_arguments", "over_limit")
MARKER = "\n[... {} characters cut ...]\n"
_CHARS_PER_TOKEN_BOUND = 64  # texts longer than this many characters per budget token are cut unmeasured
MIN_RESULT_TOKENS = 32


# ------------------------------------------------------------------- answers
def strip_reasoning(text: str, open_tag: str = "<think>", close_tag: str = "</think>") -> str:
    """The text after the reasoning block; ``""`` when a reasoning block was opened and never closed."""
    if close_tag in text:
        return text.split(close_tag)[-1]
    if open_tag in text:
        return ""
    return text


def _with_call_ids(message: Message, calls: list[dict[str, Any]]) -> Message:
    """``message`` (a parser's split of the turn) with the ids the env gave its calls."""
    split = [dict(c) for c in message.get("tool_calls") or ()]
    for mine, call in zip(split, calls):
        mine["id"] = call["id"]
    return {**message, "tool_calls": split} if split else message


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """The content of the last ``<answer>...</answer>`` in ``text``, stripped; ``None`` if there is none."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.S)
    return found[-1].strip() if found else None


def _as_number(text: str) -> Fraction | None:
    cleaned = text.strip().replace(",", "").replace("_", "").replace(" ", "").rstrip(".")
    if cleaned.startswith("$"):
        cleaned = cleaned[1:]
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answer_reward(completion: str, task: Mapping[str, Any]) -> float:
    """1.0 when the last ``<answer>...</answer>`` equals ``task["answer"]``, else 0.0.

    Numbers compare by value (``42``, ``42.0``, ``1,240`` and ``$42`` all read as numbers);
    anything else compares as text, ignoring case and surrounding whitespace.
    """
    got = extract_answer(completion)
    want = task.get("answer")
    if got is None or want is None:
        return 0.0
    a, b = _as_number(got), _as_number(str(want))
    if a is not None and b is not None:
        return float(a == b)
    return float(got.casefold() == str(want).strip().casefold())


# ---------------------------------------------------------------- truncation
def _fit_prefix(text: str, tokens: int, count: Callable[[str], int], *, suffix: bool = False) -> int:
    """The most characters from the start (or end) of ``text`` that count at most ``tokens`` tokens."""
    if tokens <= 0:
        return 0
    lo, hi = 0, min(len(text), tokens * _CHARS_PER_TOKEN_BOUND)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        piece = text[len(text) - mid :] if suffix else text[:mid]
        if count(piece) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return lo


def truncate_middle(text: str, max_tokens: int, count: Callable[[str], int]) -> tuple[str, bool]:
    """``text`` cut to at most ``max_tokens`` tokens, keeping its head and tail around a marker.

    The marker says how many characters were cut: ``"\\n[... 1234 characters cut ...]\\n"``.
    Cuts fall between characters, never inside one. Returns the text and whether it was cut.
    """
    if len(text.encode("utf-8", "surrogatepass")) <= max_tokens:
        return text, False  # a byte-level tokenizer never makes more tokens than bytes
    if len(text) <= max_tokens * _CHARS_PER_TOKEN_BOUND and count(text) <= max_tokens:
        return text, False
    keep = max_tokens - count(MARKER.format(len(text)))
    head, tail = (keep + 1) // 2, keep // 2
    for _ in range(8):
        if head + tail <= 0:
            break
        h = _fit_prefix(text, head, count)
        t = _fit_prefix(text[h:], tail, count, suffix=True)
        out = text[:h] + MARKER.format(len(text) - h - t) + text[len(text) - t :]
        over = count(out) - max_tokens
        if over <= 0:
            return out, True
        head, tail = head - (over + 1) // 2, tail - over // 2  # joins tokenized differently: shrink and retry
    return MARKER.format(len(text)).strip("\n"), True


# ------------------------------------------------------------------- records
@dataclass(frozen=True)
class CallRecord:
    """One tool-call attempt of a turn and what the model reads back."""

    index: int
    status: str
    """``ok``, ``error`` (the tool raised), ``timeout``, ``parse_error``, ``wrong_format`` (the turn
    looks like a tool call the parser does not read), ``unknown_tool``, ``invalid_arguments``
    or ``over_limit`` (not run: too many calls this turn)."""
    content: str
    """Exactly the tool message's content the model reads (after truncation)."""
    name: str | None = None
    arguments: dict[str, Any] | None = None
    id: str | None = None
    reward: float = 0.0
    truncated: bool = False
    images: tuple[Any, ...] = ()
    """Images the tool returned, shown after ``content`` (an env with ``vision=``)."""

    @property
    def invalid(self) -> bool:
        """The model wrote a call that cannot be run (malformed, wrong format, unknown tool, bad arguments)."""
        return self.status in INVALID_STATUSES

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form, as stored in trajectory metadata (``dataclasses.asdict``'s, built directly)."""
        return {
            "index": self.index, "status": self.status, "content": self.content, "name": self.name,
            "arguments": plain_copy(self.arguments), "id": self.id, "reward": self.reward, "truncated": self.truncated,
            **({"images": [list(getattr(im, "size", ())) for im in self.images]} if self.images else {}),
        }


def _new_stats() -> dict[str, int]:
    return {
        "calls": 0, **{s: 0 for s in _STATUSES}, "invalid": 0, "truncated": 0, "consecutive_invalid": 0,
        "render_refused": 0, "server_restarts": 0,
    }


# ------------------------------------------------------------------------ env
class ToolEnv(ChatEnv):
    """A chat env with tools. The episode ends when the assistant answers without a tool call.

    Args:
        tokenizer: as for :class:`ChatEnv`.
        tasks: a list of task dicts (one is drawn per episode with ``np_random``; ``reset(options=
            {"index": i})`` picks one), or a function ``rng -> task``. A task has ``"prompt"``
            (the user's text) or ``"messages"``, optionally ``"system"``, and whatever the reward
            needs (``"answer"``, ``"id"``...). ``reset(options={"task": {...}})`` sets one directly.
        tools: callables or :class:`Tool` s shared by all episodes (keep them stateless), and
            :class:`~tokengym.envs.MCPTools` (an MCP server's tools, started when the env is built).
        mcp_servers: more MCP servers in the JSON-able forms env kwargs and the CLI carry: a
            command (``"uvx mcp-server-time"`` or an argv list), an ``http(s)://`` URL, or a dict
            of :class:`~tokengym.envs.MCPTools` arguments.
        tool_factory: ``task -> tools``, called at every reset: per-episode state lives here
            (closures over a fresh dict, or :func:`~tokengym.envs.function_tools.tools_of` a fresh object).
        reward_fn: ``(final_text, task) -> float`` for the final answer (``final_text`` is the
            assistant's last turn without reasoning); 0 when omitted. See :func:`answer_reward`.
        turn_reward_fn: ``(records, task) -> float`` added on every turn (``records`` are the
            turn's :class:`CallRecord` s; empty on the final turn).
        system_prompt: prepended as a system message unless the task brings its own.
        parser: a parser name (``"hermes"``/``"qwen"``/``"chatml"``, ``"llama3_json"``/``"llama3"``,
            ``"pythonic"``/``"llama3_pythonic"``/``"gemma"``, ``"qwen3_coder"``,
            ``"deepseek_v3"``/``"deepseek"``/``"deepseek_r1"``, ``"mistral"``, ``"xlam"``,
            ``"granite"``, or any :func:`~tokengym.envs.parsers.register_parser` name), a
            :class:`ToolCallParser`, or ``None`` to detect it from the chat template (with a
            warning when the template shows no known format and ``"hermes"`` is guessed).
            Call ids are the model's own where its format has them (Mistral), else made by the
            parser's ``make_call_id`` in the form its family's template accepts.
        tool_timeout: seconds per call (a tool's own ``timeout`` wins).
        max_tool_calls_per_turn: calls beyond this are not run; each gets an error message.
        max_invalid_calls: this many invalid calls in a row (malformed, wrong format, unknown
            tool, bad arguments) end the episode: truncated, ``stop_reason="invalid_tool_calls"``.
        max_result_tokens: token budget of one tool result.
        max_turn_result_tokens: token budget of all results of one turn together.
        template_tool_calls: show the parsed calls to the template when it renders the tool
            results (so that templates which check calls against results take the right branch,
            e.g. Mistral's ids). ``False`` bridges the observation without them.

    A template that cannot render tool results after a tool-calling turn (Gemma 3's own
    template raises when roles do not alternate) is refused here, by name, not mid-episode.
        max_turns, **kwargs: as for :class:`ChatEnv`.

    A step's ``info`` adds ``tool_results`` (one :meth:`CallRecord.as_dict` per attempt),
    ``tool_stats`` (the episode's counters so far: ``calls``, one per status, ``invalid``,
    ``truncated``, ``consecutive_invalid``) and on the final turn ``final_reward``.
    """

    think_tags: tuple[str, str] = ("<think>", "</think>")

    def __init__(
        self,
        tokenizer: Any,
        tasks: TaskSource | None = None,
        tools: Sequence[Any] | MCPTools = (),
        *,
        mcp_servers: Sequence[Any] = (),
        tool_factory: Callable[[dict[str, Any]], Sequence[Any]] | None = None,
        reward_fn: RewardFn | None = None,
        turn_reward_fn: Callable[[list[CallRecord], dict[str, Any]], float] | None = None,
        system_prompt: str | None = None,
        parser: str | ToolCallParser | None = None,
        tool_timeout: float = 5.0,
        max_tool_calls_per_turn: int = 8,
        max_invalid_calls: int = 3,
        max_result_tokens: int = 1024,
        max_turn_result_tokens: int = 4096,
        max_turns: int = 8,
        template_tool_calls: bool = True,
        **kwargs: Any,
    ) -> None:
        if max_tool_calls_per_turn < 1:
            raise ValueError(f"max_tool_calls_per_turn must be at least 1, got {max_tool_calls_per_turn}")
        if max_invalid_calls < 1:
            raise ValueError(f"max_invalid_calls must be at least 1, got {max_invalid_calls}")
        if min(max_result_tokens, max_turn_result_tokens) < MIN_RESULT_TOKENS:
            raise ValueError(f"tool result budgets must be at least {MIN_RESULT_TOKENS} tokens")
        super().__init__(tokenizer, max_turns=max_turns, **kwargs)
        self.tasks = tasks
        servers, plain = mcp_tools_of([tools] if isinstance(tools, MCPTools) else tools)
        servers += [MCPTools.coerce(v) for v in mcp_servers]
        self.static_tools = expand_tools(plain)
        self._check_names(self.static_tools)
        for t in self.static_tools:
            t.schema  # noqa: B018 -- fail now, not in the first episode, when a schema cannot be built
        self.tool_factory = tool_factory
        self.reward_fn = reward_fn
        self.turn_reward_fn = turn_reward_fn
        self.system_prompt = system_prompt
        self.renderer.require("tool_results")
        self.parser = get_parser(parser, renderer=self.renderer)
        self.runner = ToolRunner(tool_timeout)
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.max_invalid_calls = max_invalid_calls
        self.max_result_tokens = max_result_tokens
        self.max_turn_result_tokens = max_turn_result_tokens
        self.template_tool_calls = template_tool_calls
        self._tools_by_name: dict[str, Tool] = {}
        self._schemas: list[dict[str, Any]] = []
        self._stats = _new_stats()
        self._task: dict[str, Any] = {}
        self.mcp: list[OpenMCPTools] = []
        """The env's open MCP servers (started here: a server that does not start fails the build)."""
        try:
            for server in servers:
                self.mcp.append(server.open())
                self.mcp[-1].images_as_parts = self.vision is not None
            self._check_names([*self.static_tools, *self._mcp_tools()])
        except BaseException:
            self.close()
            raise

    def _mcp_tools(self) -> list[Tool]:
        return [t for source in self.mcp for t in source.tools]

    # ----------------------------------------------------------------- hooks
    def sample_task(self, options: dict[str, Any]) -> dict[str, Any]:
        """The episode's task: ``options["task"]``, ``tasks[options["index"]]``, or one drawn with ``np_random``."""
        if "task" in options:
            return copy.deepcopy(dict(options["task"]))
        if self.tasks is None:
            raise NotImplementedError(f"{type(self).__name__}: pass tasks=..., or override sample_task()")
        if callable(self.tasks):
            return copy.deepcopy(dict(self.tasks(self.np_random)))
        if not len(self.tasks):
            raise ValueError("tasks is empty")
        index = int(options["index"]) if "index" in options else int(self.np_random.integers(len(self.tasks)))
        return copy.deepcopy(dict(self.tasks[index]))

    def episode_tools(self, task: dict[str, Any]) -> Sequence[Any]:
        """The tools of one episode: the shared ones, the MCP servers', then the factory's fresh ones."""
        fresh = list(self.tool_factory(task)) if self.tool_factory is not None else []
        return [*self.static_tools, *self._mcp_tools(), *fresh]

    def task_messages(self, task: dict[str, Any]) -> list[Message]:
        """The opening messages for ``task``."""
        if "messages" in task:
            messages = [dict(m) for m in task["messages"]]
        elif "prompt" in task:
            messages = [{"role": "user", "content": str(task["prompt"])}]
        else:
            raise ValueError(f"a task needs 'prompt' or 'messages'; got keys {sorted(task)}")
        system = task.get("system", self.system_prompt)
        if system and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": str(system)})
        return messages

    def final_reward(self, completion: str, task: dict[str, Any]) -> float:
        """Reward of the final answer (``completion`` is the last turn's text without reasoning)."""
        return float(self.reward_fn(completion, task)) if self.reward_fn is not None else 0.0

    def turn_reward(self, records: list[CallRecord], task: dict[str, Any]) -> float:
        """Reward added on every turn, on top of the tools' own rewards."""
        return float(self.turn_reward_fn(records, task)) if self.turn_reward_fn is not None else 0.0

    # ------------------------------------------------------------ properties
    @property
    def task(self) -> dict[str, Any]:
        """The current episode's task."""
        return self._task

    @property
    def tools(self) -> dict[str, Tool]:
        """The current episode's tools by name."""
        return dict(self._tools_by_name)

    @property
    def tool_stats(self) -> dict[str, int]:
        """The current episode's tool-call counters."""
        return dict(self._stats)

    # ------------------------------------------------------------- gymnasium
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        opts = dict(options or {})
        if "messages" in opts:  # ChatEnv's own override: make it a task so tools are set up too
            task = dict(opts.pop("task", {}))
            task["messages"] = opts.pop("messages")
            opts["task"] = task
        self._stats = _new_stats()
        return super().reset(seed=seed, options=opts)

    def make_prompt(self, options: dict[str, Any]) -> Prompt:
        for source in self.mcp:  # a server that stopped or hung last episode is restarted here
            self._stats["server_restarts"] += source.begin_episode()
        task = self.sample_task(options)
        tools = expand_tools(self.episode_tools(task))
        self._check_names(tools)
        self._tools_by_name = {t.name: t for t in tools}
        self._task = task
        schemas = [t.schema for t in tools]
        self._schemas = schemas
        return Prompt(self.task_messages(task), schemas or None, task)

    def close(self) -> None:
        for source in getattr(self, "mcp", ()):
            source.close()
        self.runner.close()
        super().close()

    # ------------------------------------------------------------- internals
    @staticmethod
    def _check_names(tools: Sequence[Tool]) -> None:
        names = [t.name for t in tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"two tools share the name(s) {dup}; give them distinct names")

    def respond(self, turn: AssistantTurn) -> EnvResponse:
        split = self.parser.split_message(turn.text) if hasattr(self.parser, "split_message") else None
        if split is not None:  # the format keeps reasoning apart itself (Harmony's analysis channel)
            content, attempts = str(split.get("content") or ""), parse_calls(self.parser, turn.text, self._schemas)
        else:
            content = strip_reasoning(turn.text, *self.think_tags)
            attempts = parse_calls(self.parser, content, self._schemas)
        task = self._task
        if attempts:
            records = self._run(attempts, turn.turn)
        else:
            evidence = call_evidence(content, self._tools_by_name)
            if evidence is None:
                final = self.final_reward(content, task)
                extra = self.turn_reward([], task)
                info = {"tool_results": [], "tool_stats": dict(self._stats), "final_reward": final}
                return EnvResponse(reward=final + extra, done=True, info=info, message=split)
            text = (
                f"Error: this looks like a tool call ({evidence}), but it is not in the format this "
                f"environment reads ({self.parser.name or type(self.parser).__name__}); nothing was run. {self.parser.hint}"
            ).rstrip()
            records = [CallRecord(0, "wrong_format", text)]
        records = self._truncate(records)
        for r in records:
            self._stats["calls"] += 1
            self._stats[r.status] += 1
            self._stats["invalid"] += r.invalid
            self._stats["truncated"] += r.truncated
            if r.invalid:
                self._stats["consecutive_invalid"] += 1
            elif r.status != "over_limit":
                self._stats["consecutive_invalid"] = 0
        messages: list[Message] = []
        for r in records:
            msg: Message = {"role": "tool", "content": r.content}
            if r.images:  # text first, then the images: content parts a vision template renders
                msg["content"] = [
                    *([{"type": "text", "text": r.content}] if r.content else []),
                    *({"type": "image", "image": im} for im in r.images),
                ]
            if r.id is not None:
                msg["tool_call_id"] = r.id
            elif self.parser.results_need_ids:
                msg["tool_call_id"] = self.parser.make_call_id(turn.turn, r.index)
            if r.name is not None:
                msg["name"] = r.name
            messages.append(msg)
        calls = [
            {"id": r.id, "type": "function", "function": {"name": r.name, "arguments": plain_copy(r.arguments)}}
            for r in records
            if r.id is not None
        ]
        reward = sum(r.reward for r in records) + self.turn_reward(records, task)
        info: dict[str, Any] = {"tool_results": [r.as_dict() for r in records], "tool_stats": dict(self._stats)}
        kept = [part for source in self.mcp for part in source.take_kept()]
        if kept:  # images and blobs MCP tools returned: said in the text, kept here as data
            info["tool_data"] = kept
        stop = None
        if self._stats["consecutive_invalid"] >= self.max_invalid_calls:
            stop = "invalid_tool_calls"
            info["stop_detail"] = (
                f"{self._stats['consecutive_invalid']} invalid tool calls in a row "
                f"(max_invalid_calls={self.max_invalid_calls})"
            )
        shown = calls if calls and self.template_tool_calls else None
        info["parsed_tool_calls"] = calls
        if split is not None and calls:
            split = _with_call_ids(split, calls)
        return EnvResponse(messages, reward, tool_calls=shown, info=info, stop_reason=stop, message=split)

    def refused_observation(self, response: EnvResponse, err: TemplateError) -> list[Message]:
        """One error message in place of results the template refuses to render with their calls."""
        why = str(err.__cause__ or err).strip().splitlines()[0][:300]
        self._stats["render_refused"] += 1
        response.info["tool_stats"] = dict(self._stats)
        text = (
            f"Error: the chat template refused to render this turn's tool calls and results ({why}); "
            f"what the tools returned cannot be shown. {self.parser.hint}"
        ).rstrip()
        msg: Message = {"role": "tool", "content": text}
        if self.parser.results_need_ids:
            msg["tool_call_id"] = self.parser.make_call_id(self._turn, 0)
        return [msg]

    def _run(self, attempts: list[ParsedCall], turn: int) -> list[CallRecord]:
        limit = self.max_tool_calls_per_turn
        records: list[CallRecord | None] = [None] * len(attempts)
        runnable: list[tuple[int, ToolCall]] = []
        for a in attempts:
            cid = (a.id or self.parser.make_call_id(turn, a.index)) if a.ok else None
            if a.index >= limit:
                plural = "s" if limit > 1 else ""
                text = (
                    f"Error: not run: at most {limit} tool call{plural} run per turn, "
                    f"and this turn has {len(attempts)}."
                )
                records[a.index] = CallRecord(a.index, "over_limit", text, a.name, a.arguments, cid)
            elif not a.ok:
                records[a.index] = CallRecord(a.index, "parse_error", a.error or "", a.name, a.arguments)
            else:
                runnable.append((a.index, a.to_call(cid)))
        outcomes = self.runner.run([c for _, c in runnable], self._tools_by_name)
        for (i, call), out in zip(runnable, outcomes, strict=True):
            records[i] = CallRecord(i, out.status, out.content, call.name, call.arguments, call.id, out.reward, images=out.images)
        return [r for r in records if r is not None]

    def _count(self, text: str) -> int:
        return len(self.renderer.encode_plain(text))

    def _truncate(self, records: list[CallRecord]) -> list[CallRecord]:
        """Each result cut to ``max_result_tokens``; then, if the turn's results together exceed
        ``max_turn_result_tokens``, the longest ones share what is left (water-filling), each cut
        once from its original text."""
        records = self._fit_images(records)
        cuts = [truncate_middle(r.content, self.max_result_tokens, self._count) for r in records]
        left = self.max_turn_result_tokens - sum(self._image_tokens(r) for r in records)
        # A byte-level tokenizer never makes more tokens than bytes: results within the budget in
        # bytes are within it in tokens, uncounted (a count is a tokenizer call per result).
        if sum(len(text.encode("utf-8", "surrogatepass")) for text, _ in cuts) <= left:
            return self._records(records, cuts)
        sizes = [self._count(text) for text, _ in cuts]
        if sum(sizes) > left:
            order = sorted(range(len(records)), key=lambda i: sizes[i])
            share = 0
            for k, i in enumerate(order):
                fair = left // (len(order) - k)
                if sizes[i] > fair:
                    share = max(fair, MIN_RESULT_TOKENS)
                    break
                left -= sizes[i]
            for i, r in enumerate(records):
                if sizes[i] > share:
                    cuts[i] = truncate_middle(r.content, min(share, self.max_result_tokens), self._count)
        return self._records(records, cuts)

    @staticmethod
    def _records(records: list[CallRecord], cuts: list[tuple[str, bool]]) -> list[CallRecord]:
        return [
            CallRecord(r.index, r.status, text, r.name, r.arguments, r.id, r.reward, cut, r.images)
            for r, (text, cut) in zip(records, cuts, strict=True)
        ]

    def _image_tokens(self, record: CallRecord) -> int:
        vision = self.vision
        return sum(self.image_features(im).num_tokens for im in record.images) if vision is not None and record.images else 0

    def _fit_images(self, records: list[CallRecord]) -> list[CallRecord]:
        """Images count against ``max_turn_result_tokens``: those that do not fit (in call order)
        are left out, and the text says so; images in an env without ``vision=`` are an error
        that names the fix."""
        if not any(r.images for r in records):
            return records
        if self.vision is None:
            name = next(r.name for r in records if r.images)
            raise ValueError(
                f"the tool {name!r} returned an image, but {type(self).__name__} has no vision processor: pass "
                "vision=Qwen2VLVision(tokenizer) (tokengym.envs.images) for a vision-language model, or return text"
            )
        budget = self.max_turn_result_tokens - MIN_RESULT_TOKENS * len(records)  # text keeps its floor
        out = []
        for r in records:
            kept, dropped = [], 0
            for im in r.images:
                n = self.image_features(im).num_tokens
                if n <= budget:
                    kept.append(im)
                    budget -= n
                else:
                    dropped += 1
            if dropped:
                note = (f"[{dropped} image(s) left out: over this turn's token budget for results "
                        f"(max_turn_result_tokens={self.max_turn_result_tokens})]")
                r = CallRecord(r.index, r.status, f"{r.content}\n{note}" if r.content else note, r.name, r.arguments,
                               r.id, r.reward, r.truncated, tuple(kept))
            out.append(r)
        return out


