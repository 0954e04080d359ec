"""Chat-template rendering to token ids that never re-renders the history.

A multi-turn episode is a growing token stream. Re-rendering the whole conversation
every turn costs time that grows with the turn count and, worse, changes tokens the
policy already saw (non-canonical BPE splits, templates that drop earlier reasoning).
So :class:`ChatRenderer` renders only what is new:

* the prompt once, with the generation prompt;
* after each assistant turn, the *bridge*: the template's text that follows the
  assistant's end-of-turn token when the new messages are appended, up to and
  including the next generation prompt. It is cut from a small fixed conversation
  (``[user, assistant] + new``) in which the assistant carries the real tool calls, so
  the template takes the same branch as in the real conversation. Its cost depends on
  the size of the new messages only.

The cut never looks for the assistant's content: many templates (Llama 3.x, Gemma,
Mistral, DeepSeek) print only the calls of a message that has tool calls. The assistant's
turn starts where the generation prompt of ``[user]`` ends and closes at its first
end-of-turn token after that. When appending the new messages rewrites the text before
the assistant turn (Mistral moves the tools and the system prompt to the last user
message), the turn is found by counting end-of-turn tokens instead, and the observation
says so (:attr:`Rendered.rewrites_history`). What a template cannot do at all (render a
tool result, close a turn with tool calls) is probed once at construction and reported
by :meth:`ChatRenderer.require`, naming the construct, before any episode starts.

Text from the environment (tool results, user turns, files, transcripts) is tokenized as
plain text for every added token of the tokenizer, special or not: ``"<|im_end|>"`` or
``"<tool_call>"`` printed by a tool stays text and can never forge a control token. Only the
template's own text becomes control tokens.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .ascii_backend import ascii_twin
from .template_inputs import Message, TemplateError, has_object_arguments, string_arguments
from .tokenizers import load_tokenizer
from .whole_render import whole_renderer

__all__ = ["CONSTRUCTS", "ChatRenderer", "Message", "Rendered", "TemplateError"]


SENTINEL_USER = "tokengym-user-7f3a"
SENTINEL_ASSISTANT = "tokengym-assistant-7f3a"
SENTINEL_TOOL = "tokengym-tool-7f3a"
SENTINEL_FOLLOWUP = "tokengym-followup-7f3a"
_PROTECTED_FIELDS = ("content", "reasoning_content")
PROBE_CALL_ID = "tgprobe01"  # nine alphanumerics: Mistral's templates refuse any other id
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "tokengym_probe",
        "description": "A probe tool.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}
CONSTRUCTS: dict[str, str] = {
    "tool_results": "tool results after an assistant turn with tool calls",
    "user_followup": "a user message after an assistant turn",
}
"""What :meth:`ChatRenderer.require` can check, and how an error names it."""


def _without_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(call)
    if isinstance(out.get("function"), Mapping):
        out["function"] = {**out["function"], "arguments": {}}
    elif "arguments" in out:
        out["arguments"] = {}
    return out


def _tool_words(tools: Sequence[Any]) -> dict[str, list[str]]:
    """Each tool's name with the names of its parameters: what a prompt that shows the schema has."""
    words: dict[str, list[str]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            words[fn["name"]] = [fn["name"], *(k for k in (props or {}) if isinstance(k, str))]
    return words


def _tools_key(tools: Sequence[Any] | None) -> str:
    return json.dumps(list(tools), sort_keys=True, default=str) if tools else ""


_PROBED: weakref.WeakValueDictionary[tuple[Any, ...], ChatRenderer] = weakref.WeakValueDictionary()
"""The first renderer of each (tokenizer, template, variables), while it lives: the twin later ones adopt."""
_SHARED_CACHES = frozenset({"_histories", "_tools_shown"})
"""Caches of renders that a renderer shares with the twins it taught (:meth:`ChatRenderer._adopt`):
pure functions of the tokenizer, template and variables, bounded, and safe to fill from any
thread (a race only renders an entry twice)."""


def _probe_key(
    kind: type, tok: Any, chat_template: str | None, template_kwargs: Mapping[str, Any] | None, require_tools: bool
) -> tuple[Any, ...] | None:
    """What a renderer's probe depends on, or None when the variables are not plain JSON data (not shared)."""
    try:
        variables = json.dumps(dict(template_kwargs or {}), sort_keys=True)
        template = json.dumps(chat_template if chat_template else getattr(tok, "chat_template", None), sort_keys=True)
    except (TypeError, ValueError):
        return None
    return (kind, id(tok), len(tok), template, variables, bool(require_tools))


def _alternation(strings: Sequence[str]) -> str:
    """A regex matching any of ``strings``, built as a trie so that a tokenizer with thousands
    of added tokens (Gemma's) costs one character test per position, not one per token."""
    trie: dict[str, Any] = {}
    for text in strings:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        ends = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 and not ends else "(?:" + "|".join(branches) + ")"
        return body + "?" if ends else body

    return build(trie)


def _repeated_ending(rest: str, turn: str) -> int:
    """How many characters of ``rest``'s end ``turn`` starts with (the part of a generation
    prompt's extra text that the rendered turn repeats: DeepSeek V3.2's ``</think>``)."""
    return next((k for k in range(min(len(rest), len(turn)), 0, -1) if rest.endswith(turn[:k])), 0)


def _template_line(err: BaseException) -> int | None:
    """The line of the chat template a Jinja error was raised at (the last template frame)."""
    line = getattr(err, "lineno", None)
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line if isinstance(line, int) else None


def _render_failed(err: BaseException, messages: Sequence[Message], tools: Sequence[Any] | None) -> TemplateError:
    """A render error that says what was rendered (roles, tools or not) and where the template raised:
    ``'NoneType' object is not iterable`` alone names nothing a user can act on."""
    roles = ", ".join(
        str(m.get("role")) + (" with tool calls" if m.get("tool_calls") else "") for m in messages
    ) or "no messages"
    line = _template_line(err)
    where = f" at line {line} of the template" if line else ""
    hint = ""
    if not tools and isinstance(err, TypeError) and "NoneType" in str(err):
        hint = " (the template may iterate over `tools` without checking them: it renders only with tools)"
    elif type(err).__name__ == "SecurityError":
        hint = (
            " (the template changes a list or dict in place, e.g. `.append`: transformers renders templates in "
            "an immutable sandbox that refuses it, and so do the servers that render through it (vLLM, SGLang)"
            "; pass a chat_template that builds the value with a `namespace` or `+` instead)"
        )
    return TemplateError(
        f"the chat template failed to render [{roles}] {'with' if tools else 'without'} tools{where}: "
        f"{type(err).__name__}: {err}{hint}"
    )


def _without_none(messages: Sequence[Message]) -> list[Message] | None:
    """The messages without their None-valued keys, or ``None`` when no message has one."""
    if not any(v is None for m in messages for v in m.values()):
        return None
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _user_turn_close(prefix: str, text: str) -> int | None:
    """Where the user's turn ends in ``text`` (``[user, assistant]``): after the text that follows
    the user's content in ``prefix`` (``[user]`` with an empty generation prompt), found after the
    same content in ``text``; ``None`` when the template writes no such text."""
    at = prefix.rfind(SENTINEL_USER)
    if at < 0:
        return None
    close = prefix[at + len(SENTINEL_USER) :].strip()
    if not close:
        return None
    found = text.find(close, text.find(SENTINEL_USER) + len(SENTINEL_USER))
    return None if found < 0 else found + len(close)


_MARKER_RE = re.compile(r"<[|｜][^<>\s]+[|｜]>")
"""An added token written as a control marker (``<|...|>``, ``<｜...｜>``), special or not."""
_TAG_RE = re.compile(r"</?[A-Za-z_][\w:.\-]*>")
"""An added token written as a tag (Qwen's ``<tool_call>``, ``<think>``): a template's glue too."""


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class Rendered:
    """A piece of rendered conversation: its text and the token ids the policy sees."""

    text: str
    ids: list[int]
    rewrites_history: str | None = None
    """Set on an observation when appending the new messages changed the template's text
    *before* the assistant turn (the template is not prefix-stable there): what changed."""


def _ids(backend: Any, text: str) -> list[int]:
    """The ids of ``text`` (no special tokens added) from a ``tokenizers.Tokenizer``. Through
    ``encode_batch_fast`` where the library has it: the same ids without the character offsets
    ``encode`` also computes (about a fifth of its time), and the GIL released meanwhile, so that
    env steps on other threads go on."""
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is not None:
        return list(fast([text], add_special_tokens=False)[0].ids)
    return list(backend.encode(text, add_special_tokens=False).ids)


def _decodes_through_backend(tok: Any) -> bool:
    """Whether ``tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)`` is
    the Rust tokenizer's ``decode``: a tokenizer class that overrides neither ``decode`` nor
    ``_decode`` of transformers' fast-tokenizer base (a subclass with its own, e.g. one that
    post-processes the text, keeps going through it)."""
    if getattr(tok, "backend_tokenizer", None) is None:
        return False
    cls = type(tok)
    decode, inner = getattr(cls, "decode", None), getattr(cls, "_decode", None)
    return (
        getattr(decode, "__module__", "") == "transformers.tokenization_utils_base"
        and getattr(inner, "__module__", "") in ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")
    )


class ChatRenderer:
    """Turns chat messages into token ids with a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a tokenizer object, a local folder, a pinned name (``"qwen3"``) or a hub name.
        chat_template: a Jinja template that replaces the tokenizer's own.
        template_kwargs: extra variables for the template, e.g. ``{"enable_thinking": False}``.
        require_tools_in_prompt: a prompt rendered with tools must show every tool's schema (its
            name and its parameters' names, more often than the same prompt without the tools);
            ``False`` when the tools are described elsewhere (your own system prompt).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        require_tools_in_prompt: bool = True,
    ) -> None:
        tok = load_tokenizer(tokenizer)
        if not (chat_template or getattr(tok, "chat_template", None)):
            raise TemplateError(
                f"tokenizer {getattr(tok, 'name_or_path', '?')!r} has no chat template: pass "
                "chat_template=... (a Jinja string), or use the tool-capable ChatML template tokengym "
                "ships: chat_template=tokengym.envs.templates.CHATML_TOOLS"
            )
        key = _probe_key(type(self), tok, chat_template, template_kwargs, require_tools_in_prompt)
        twin = _PROBED.get(key) if key is not None else None
        if twin is not None and twin.tokenizer is tok:
            self._adopt(twin)
            return
        self.tokenizer = tok
        self.chat_template = chat_template
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.vocab_size: int = len(tok)
        self.name: str = str(getattr(tok, "name_or_path", "") or type(tok).__name__)
        self._backend = getattr(tok, "backend_tokenizer", None)
        self._ascii = ascii_twin(self._backend) if self._backend is not None else None
        self._direct_decode = _decodes_through_backend(tok)
        self._plain_backend: Any = None
        self._action_backend: Any = None
        # Placeholders for protected text carry a random marker no message can anticipate.
        marker = secrets.token_hex(6)
        self._placeholder = "\ue000" + marker + "-{}\ue001"
        self._placeholder_re = re.compile("\ue000" + marker + "-(\\d+)\ue001")
        self.special_ids: frozenset[int] = frozenset(tok.all_special_ids) | frozenset(
            i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
        )
        specials = sorted(
            {str(tok.convert_ids_to_tokens(i)) for i in self.special_ids}, key=len, reverse=True
        )
        self._special_re = re.compile(_alternation(specials)) if specials else None
        #: Every added token (special or not: Qwen's ``<tool_call>``, ``<think>``): text from the
        #: environment never becomes one of these.
        self.added_ids: frozenset[int] = self.special_ids | frozenset(getattr(tok, "added_tokens_decoder", {}))
        added = [t for t in {str(tok.convert_ids_to_tokens(i)) for i in self.added_ids} if t]
        self._added_re = re.compile(_alternation(added)) if added else None
        # Control tokens: the special ones, and added ones written as markers or tags (DeepSeek's
        # `<｜Assistant｜>` and Qwen's `<tool_call>` are added tokens not marked special).
        markers = [t for t in added if t.strip() and (_MARKER_RE.fullmatch(t) or _TAG_RE.fullmatch(t)) and t not in specials]
        controls = sorted({t for t in specials if t.strip()} | set(markers), key=len, reverse=True)
        #: A control token with the whitespace around it (group 1: the token), for comparing
        #: texts up to whitespace that templates strip or add there.
        self.control_pattern: re.Pattern[str] | None = (
            re.compile(r"\s*(" + "|".join(map(re.escape, controls)) + r")\s*") if controls else None
        )
        #: True when the template needs tool-call arguments as JSON text, not as an object
        #: (found on the first render that fails with objects and works with text).
        self.string_arguments = False
        self.require_tools_in_prompt = require_tools_in_prompt
        self._histories: dict[str, str] = {}
        self._tools_shown: set[str] = set()
        self._capabilities: dict[str, str | None] = {}
        self._turn_controls: frozenset[str] | None = None
        self._prompt_only: tuple[str, str] | None | bool = False  # False: not probed yet (picklable)
        self._opening: str | None = None
        self._probe()
        if key is not None:
            _PROBED[key] = self

    def _adopt(self, twin: ChatRenderer) -> None:
        """Take what ``twin`` found of the same tokenizer and template, instead of probing again.

        Everything a renderer learns is a fact of its tokenizer, template and variables (the
        probe's results, the backends built for literal text, the caches of renders), so envs of
        one tokenizer share it: probing cost ~80% of building an env once the template's compile
        was shared, and a run builds one env per slot. Containers are copied (no renderer writes
        into another's), but for the caches of renders in :data:`_SHARED_CACHES`: a cache entry
        is true for every twin, and a copy each cost every env in flight its own renders (1.3 kB
        an episode on a tool env); the whole-conversation renderer, which keeps one conversation's
        state, is this renderer's own.
        """
        state = {
            k: v if k in _SHARED_CACHES else copy.copy(v) if type(v) in (dict, set, list) else v
            for k, v in vars(twin).items()
        }
        whole = state.pop("_whole_renderer", None)
        self.__dict__.update(state)
        if whole is not None:
            self._whole_renderer = whole.for_renderer(self)

    # ------------------------------------------------------------------ probing
    def _probe(self) -> None:
        user = {"role": "user", "content": SENTINEL_USER}
        pair = [user, {"role": "assistant", "content": SENTINEL_ASSISTANT}]
        #: True when the template renders only with tools (Hermes 2 Pro's and Hermes 3's tool-use
        #: templates iterate over ``tools`` unconditionally): it is probed with a probe tool, and a
        #: conversation without tools fails to render, saying so.
        self.tools_required = False
        try:
            text = self.render_text(pair, add_generation_prompt=False)
        except TemplateError as without:
            try:
                text = self.render_text(pair, [PROBE_TOOL], add_generation_prompt=False)
            except TemplateError:
                raise without from None
            self.tools_required = True
        tools = [PROBE_TOOL] if self.tools_required else None
        at = text.find(SENTINEL_ASSISTANT)
        if at < 0:
            raise TemplateError(
                "the chat template does not render assistant content verbatim (it rewrites or drops "
                "what the model wrote), so actions cannot be kept token for token: "
                "pass chat_template=tokengym.envs.templates.CHATML_TOOLS or another template that does"
            )
        tail = text[at + len(SENTINEL_ASSISTANT) :]
        #: Turn ends that are the next message's opening (the template leaves a last turn open).
        self._open_ends: set[tuple[int, ...]] = set()
        followed = self._followed(pair, {"role": "user", "content": SENTINEL_FOLLOWUP}, tools)
        #: Token ids a model writes to end a plain assistant turn (what the template puts right
        #: after the content of a last assistant message, or, where it leaves that turn open, the
        #: token that opens the next message: GLM's ``<|user|>``, which GLM models stop on).
        self.turn_end_ids: tuple[int, ...] = self._sampled_end(tail, followed)
        self.turn_end_text: str = self.decode(self.turn_end_ids)
        #: What the template writes at that place once another message follows (gpt-oss's
        #: ``<|end|>`` for a final answer ended by ``<|return|>``); usually ``turn_end_text``.
        self.turn_end_written: str = self._written_end(self.turn_end_text, followed)
        #: The same for an assistant turn with tool calls (gpt-oss's ``<|call|>``, GLM's
        #: ``<|observation|>``, Apertus's ``<|tools_suffix|>``): the plain turn's end where the
        #: template closes a turn with calls as any other turn.
        #: True when the template writes a turn's content after its calls' results, in the same turn
        #: (Gemma 4: the model calls, reads the results, then answers): the observation after a
        #: call turn is cut from a turn without content.
        self.content_after_results = False
        self.call_end_ids, self.call_end_written = self._call_end()
        self.call_end_text: str = self.decode(self.call_end_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        #: Token ids a policy should stop on (the end-of-turn tokens, then EOS).
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(
                [*self.turn_end_ids[-1:], *self.call_end_ids[-1:], *([eos] if isinstance(eos, int) else [])]
            )
        )
        #: Every way a model ends a turn, longest first (the plain turn's and the call turn's).
        self.turn_ends: tuple[tuple[int, ...], ...] = tuple(
            sorted({e for e in (self.turn_end_ids, self.call_end_ids) if e}, key=len, reverse=True)
        )
        with_prompt = self.render_text([user], tools, add_generation_prompt=True)
        without = self.render_text([user], tools, add_generation_prompt=False)
        if not with_prompt.startswith(without):
            raise TemplateError(
                "the generation prompt is not appended at the end of the conversation, so an observation "
                "cannot end where the next action starts: pass a chat_template whose "
                "add_generation_prompt only appends text (e.g. tokengym.envs.templates.CHATML_TOOLS)"
            )
        #: The text the template appends for ``add_generation_prompt=True``.
        self.generation_prompt: str = with_prompt[len(without) :]

    def _leading_specials(self, text: str) -> tuple[int, ...]:
        """The special-token ids ``text`` starts with, after its leading whitespace."""
        ids = self.encode(text.lstrip())
        n = 0
        while n < len(ids) and ids[n] in self.special_ids:
            n += 1
        return tuple(ids[:n])

    def _followed(self, turn: Sequence[Message], message: Message, tools: Sequence[Any] | None) -> str | None:
        """The text between the content of ``turn``'s last (assistant) message and ``message``'s
        content when ``message`` follows it; ``None`` when that cannot be rendered."""
        sentinel = str(message.get("content"))
        try:
            text = self.render_text([*turn, message], tools, add_generation_prompt=False)
        except TemplateError:
            return None
        start, stop = text.find(SENTINEL_ASSISTANT), text.find(sentinel)
        return text[start + len(SENTINEL_ASSISTANT) : stop] if 0 <= start < stop else None

    def _sampled_end(self, last: str, followed: str | None) -> tuple[int, ...]:
        """The ids a model writes to end a turn whose rendered text, as the last message, ends
        with ``last``: the special tokens there, else (an open turn) the first special token of
        ``followed``, the next message's opening."""
        closing = self._leading_specials(last)
        if closing or followed is None:
            return closing
        opening = self._leading_specials(followed)[:1]
        if opening:
            self._open_ends.add(opening)
        return opening

    def _written_end(self, sampled: str, followed: str | None) -> str:
        """What the template writes where a model wrote ``sampled`` once a message follows: the
        same text, or the first special token there when it writes another one (``<|end|>``)."""
        if not sampled or followed is None or sampled in followed:
            return sampled
        other = self._leading_specials(followed)[:1]
        return self.decode(other) if other else sampled

    def _call_end(self) -> tuple[tuple[int, ...], str]:
        """``(ids a model writes to end a turn with tool calls, what the template writes there
        before the tool results)``: the plain turn's end where the template closes such a turn
        with it, else the last special token after the calls when the turn is last, else (open)
        the first special token of the tool results' opening."""
        plain = (self.turn_end_ids, self.turn_end_written)
        user = {"role": "user", "content": SENTINEL_USER}
        call = {"id": PROBE_CALL_ID, "type": "function", "function": {"name": "tokengym_probe", "arguments": {"x": 1}}}
        turn = [user, {"role": "assistant", "content": SENTINEL_ASSISTANT, "tool_calls": [call]}]
        result = {"role": "tool", "content": SENTINEL_TOOL, "tool_call_id": PROBE_CALL_ID, "name": "tokengym_probe"}
        followed = self._followed(turn, result, [PROBE_TOOL])
        try:
            last = self.render_text(turn, [PROBE_TOOL], add_generation_prompt=False).rstrip()
        except TemplateError:
            return plain
        if followed is None:  # the template writes the content after the results (Gemma 4): probe without it
            try:
                turn = [user, {"role": "assistant", "content": "", "tool_calls": [call]}]
                last = self.render_text(turn, [PROBE_TOOL], add_generation_prompt=False).rstrip()
                full = self.render_text([*turn, result], [PROBE_TOOL], add_generation_prompt=False)
            except TemplateError:
                return plain
            history = self._history([PROBE_TOOL])
            if not (last.startswith(history) and full.startswith(last) and SENTINEL_TOOL in full[len(last) :]):
                return plain
            self.content_after_results = True
            calls, followed = last[len(history) :], full[len(history) :]
        else:
            calls = last[last.find(SENTINEL_ASSISTANT) + len(SENTINEL_ASSISTANT) :]
        if not followed.startswith(calls):  # the turn renders otherwise once results follow
            return plain
        ids = self.encode(calls)
        if ids and ids[-1] in self.special_ids:
            closing: tuple[int, ...] = (ids[-1],)
        else:
            closing = self._sampled_end("", followed[len(calls) :])
        if not closing:
            return plain
        return closing, self.decode(closing)  # the template writes it as the model did: the results follow

    # ------------------------------------------------------------ text <-> ids
    def encode(self, text: str) -> list[int]:
        """Tokenize template text: special-token strings become special tokens. ASCII text skips
        a Unicode normalizer that cannot change it (:mod:`tokengym.envs.ascii_backend`)."""
        if self._ascii is not None:
            return _ids(self._ascii.for_text(text), text)
        if self._backend is not None:
            return _ids(self._backend, text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Tokenize environment text: the text of every added token (special or not) stays text."""
        if not self.has_special_text(text):
            return self.encode(text)
        if self._plain_backend is None:
            self._plain_backend = self._literal_backend(every_added=True)
        return _ids(self._plain_backend, text)

    def encode_action_text(self, text: str) -> list[int]:
        """Tokenize text a model writes: the control tokens that the template itself writes
        inside an assistant turn (``<|tool_call|>``, ``[TOOL_CALLS]``, DeepSeek's call markers)
        and non-special added tokens (``<tool_call>``, ``<think>``) are the single tokens a model
        emits for them; any other control-token text (an end of turn inside the content) stays text."""
        if self._action_backend is None:
            self._action_backend = self._literal_backend(every_added=False, allowed=self.turn_control_texts)
        if not (self._special_re and self._special_re.search(text)):
            return self.encode(text)
        return _ids(self._action_backend, text)

    @property
    def turn_control_texts(self) -> frozenset[str]:
        """Control-token texts the template writes inside an assistant turn (tool calls included),
        the closing end-of-turn excepted."""
        if self._turn_controls is None:
            user = {"role": "user", "content": SENTINEL_USER}
            call = {"id": PROBE_CALL_ID, "type": "function", "function": {"name": "tokengym_probe", "arguments": {"x": 1}}}
            found: set[str] = set()
            for message, tools in (
                ({"role": "assistant", "content": SENTINEL_ASSISTANT}, None),
                ({"role": "assistant", "content": SENTINEL_ASSISTANT, "tool_calls": [call]}, [PROBE_TOOL]),
                ({"role": "assistant", "content": None, "tool_calls": [call]}, [PROBE_TOOL]),
            ):
                try:
                    text = self.render_text([user, message], tools, add_generation_prompt=False)
                except TemplateError:
                    continue
                turn = text[len(self._history(tools)) :] if text.startswith(self._history(tools)) else ""
                if self._special_re is not None:
                    found.update(m.group(0) for m in self._special_re.finditer(turn))
            found -= {self.turn_end_text, self.turn_end_written, self.call_end_text, self.generation_prompt.strip()}
            found -= {str(self.tokenizer.convert_ids_to_tokens(i)) for i in self.stop_token_ids}
            self._turn_controls = frozenset(t for t in found if t and t not in self.generation_prompt)
        return self._turn_controls

    def _literal_backend(self, *, every_added: bool, allowed: frozenset[str] = frozenset()) -> Any:
        """A private copy of the tokenizer that never matches special tokens (and, with
        ``every_added``, no added token at all) except those in ``allowed``: the shared
        tokenizer is never mutated. Made once per tokenizer and kind for every renderer of it
        (:data:`_LITERAL_BACKENDS`): copying a 262k-token vocabulary costs seconds, and every
        env built on a tokenizer needs the same copies."""
        if self._backend is None:
            raise TemplateError("tokenizing special-token text as text needs a fast (tokenizers) tokenizer")
        key = (id(self._backend), self._backend.get_vocab_size(with_added_tokens=True), every_added, allowed)
        with _LITERAL_LOCK:
            found = _LITERAL_BACKENDS.get(key)
            if found is not None and found[0] is self._backend:
                _LITERAL_BACKENDS.move_to_end(key)
                return found[1]
        backend = _literal_copy(self._backend, every_added, allowed)
        with _LITERAL_LOCK:
            _LITERAL_BACKENDS[key] = (self._backend, backend)
            while len(_LITERAL_BACKENDS) > _LITERAL_CACHE_SIZE:
                _LITERAL_BACKENDS.popitem(last=False)
        return backend

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids exactly: special tokens kept, no clean-up of spaces. Straight through the
        Rust tokenizer when the tokenizer class decodes with transformers' own code (which does
        just that here), else through ``tokenizer.decode``."""
        if self._direct_decode:
            return str(self._backend.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids), skip_special_tokens=False))
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode_many(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        """:meth:`decode` of each of ``seqs``, in one call to the Rust tokenizer where
        :meth:`decode` goes straight through it (a whole-conversation check decodes every piece)."""
        if self._direct_decode:
            return [str(t) for t in self._backend.decode_batch([list(s) for s in seqs], skip_special_tokens=False)]
        return [self.decode(s) for s in seqs]

    def count_added_texts(self, text: str) -> int:
        """How many times the text of an added token (special or not) occurs in ``text``."""
        return sum(1 for _ in self._added_re.finditer(text)) if self._added_re is not None else 0

    def has_special_text(self, text: str) -> bool:
        """True when ``text`` contains the text of an added token, special or not (environment
        text is then tokenized as plain text, never as that token)."""
        return bool(self._added_re and self._added_re.search(text))

    # -------------------------------------------------------------- rendering
    def render_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        add_generation_prompt: bool,
        reference: bool = False,
    ) -> str:
        """The template's text for a conversation (no tokenizing): ``apply_chat_template``'s text.

        It is rendered through :mod:`~tokengym.envs.whole_render`'s memoized sandbox where that
        renders the probe conversations identically (about three times sooner), else through
        ``apply_chat_template`` itself; a render that fails there is repeated through
        ``apply_chat_template``, so an error is always the template's own. ``reference=True``
        renders through ``apply_chat_template`` alone (what the fast path is checked against).
        """
        apply = self._apply if reference else self._apply_fast
        msgs = string_arguments(messages) if self.string_arguments else list(messages)
        try:
            text = apply(msgs, tools, add_generation_prompt)
        except Exception as err:  # jinja raises many types; the template's own message is what helps
            bare = _without_none(msgs)
            if bare is not None:
                # transformers 5.2x drops None-valued keys before rendering, 5.5 does not: a template
                # that tests `"content" in message` then reads None (gpt-oss's). Render as the newer do.
                try:
                    return self.render_text(bare, tools, add_generation_prompt=add_generation_prompt, reference=reference)
                except TemplateError:
                    pass
            if self.string_arguments or not has_object_arguments(msgs):
                raise _render_failed(err, msgs, tools) from err
            try:
                text = apply(string_arguments(msgs), tools, add_generation_prompt)
            except Exception:
                raise _render_failed(err, msgs, tools) from err
            self.string_arguments = True
        if not isinstance(text, str):
            raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def _apply_fast(self, messages: list[Message], tools: Sequence[Any] | None, add_generation_prompt: bool) -> Any:
        fast = whole_renderer(self)
        if fast.unavailable is None:
            try:
                return fast.render_once(messages, tools, add_generation_prompt=add_generation_prompt)
            except Exception:  # apply_chat_template raises the template's own error (or renders)
                pass
        return self._apply(messages, tools, add_generation_prompt)

    def _apply(self, messages: list[Message], tools: Sequence[Any] | None, add_generation_prompt: bool) -> Any:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=list(tools) if tools else None,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _protect(self, messages: Sequence[Message], *, assistant: bool = True) -> tuple[list[Message], list[str]]:
        """Swap message text that contains special-token strings for placeholders (not the
        assistant's text with ``assistant=False``: its control tokens are the model's own)."""
        out: list[Message] = []
        subs: list[str] = []
        for msg in messages:
            if not assistant and msg.get("role") == "assistant":
                out.append(msg)
                continue
            changed = None
            for field in _PROTECTED_FIELDS:
                value = msg.get(field)
                if isinstance(value, str) and self.has_special_text(value):
                    changed = dict(msg) if changed is None else changed
                    changed[field] = self._protected(value, subs)
                elif field == "content" and isinstance(value, list) and any(
                    isinstance(p, dict) and isinstance(p.get("text"), str) and self.has_special_text(p["text"]) for p in value
                ):  # content parts (text beside images): each text part as a string content is
                    changed = dict(msg) if changed is None else changed
                    changed[field] = [
                        {**p, "text": self._protected(p["text"], subs)}
                        if isinstance(p, dict) and isinstance(p.get("text"), str) and self.has_special_text(p["text"])
                        else p
                        for p in value
                    ]
            out.append(changed if changed is not None else msg)
        return out, subs

    def _protected(self, value: str, subs: list[str]) -> str:
        """``value`` as a placeholder (its core added to ``subs``). Edge whitespace stays outside
        the placeholder, so templates that strip content (Qwen3 lstrips after </think>) treat it
        as they would the real text."""
        core = value.strip()
        head = value[: len(value) - len(value.lstrip())]
        tail = value[len(value.rstrip()) :] if core else ""
        subs.append(core)
        return head + self._placeholder.format(len(subs) - 1) + tail

    def _render_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None,
        *,
        add_generation_prompt: bool,
        cut: Callable[[str], tuple[int, int, str | None]] | None = None,
        protect_assistant: bool = True,
    ) -> Rendered:
        protected, subs = self._protect(messages, assistant=protect_assistant)
        text = self.render_text(protected, tools, add_generation_prompt=add_generation_prompt)
        start, end, note = cut(text) if cut else (0, len(text), None)
        piece = text[start:end]
        if not subs:
            return Rendered(piece, self.encode(piece), note)
        ids: list[int] = []
        texts: list[str] = []
        # A template may drop protected text (Qwen2.5 never renders reasoning_content) or repeat it.
        for i, part in enumerate(self._placeholder_re.split(piece)):
            if i % 2:
                content = subs[int(part)]
                ids += self.encode_plain(content)
                texts.append(content)
            elif part:
                ids += self.encode(part)
                texts.append(part)
        return Rendered("".join(texts), ids, note)

    def prompt(
        self, messages: Sequence[Message], tools: Sequence[Any] | None = None, *, deployed: bool = False
    ) -> Rendered:
        """Token ids of a whole conversation followed by the generation prompt.

        ``deployed=True`` renders assistant messages as a serving engine does: their text goes
        through the template as it is (Qwen3's template then drops earlier reasoning) and their
        control tokens (``<think>``, ``<tool_call>``: the model's own) are tokens; the other
        messages' text is still never read as control tokens.
        """
        if not messages:
            raise ValueError("a prompt needs at least one message")
        rendered = self._render_ids(messages, tools, add_generation_prompt=True, protect_assistant=not deployed)
        if tools and self.require_tools_in_prompt:
            self._check_tools_shown(messages, tools, rendered.text)
        return rendered

    def _check_tools_shown(self, messages: Sequence[Message], tools: Sequence[Any], text: str) -> None:
        """Refuse a template that drops the tool schemas. The schema is judged, not the name: the
        prompt rendered with the tools must hold each tool's name and each of its parameters' names
        more often than the same messages rendered without them (a system prompt that says
        "calculate" shows no schema; a template that cannot render without tools reads them, so
        the names suffice there). Checked once per tool set; a set that passed is not re-rendered."""
        key = _tools_key(tools)
        if key in self._tools_shown:
            return
        words = _tool_words(tools)
        missing = [n for n in words if n not in text]
        if not missing:
            try:
                bare = self.render_text(messages, None, add_generation_prompt=True)
            except Exception:  # jinja raises many types; a template that needs tools to render reads them
                bare = None
            if bare is not None:
                missing = [n for n, ws in words.items() if any(text.count(w) <= bare.count(w) for w in ws)]
        if missing:
            raise TemplateError(
                f"the chat template did not render the tools: the schema of {', '.join(map(repr, missing))} "
                "is missing from the prompt (the prompt with tools shows no more of it than the prompt without), "
                "so the model would never see it. " + self._where_tools_go()
            )
        if len(self._tools_shown) >= 64:
            self._tools_shown.clear()
        self._tools_shown.add(key)

    def _where_tools_go(self) -> str:
        """The fix for a template that drops the tool schemas. One that writes tool calls in its own
        format (DeepSeek V3.1's) expects the schemas where its model card puts them: in the system
        message, written by the caller; switching to another template changes the format it was
        trained on."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        template = template if isinstance(template, str) else ""
        if "tool_calls" in template:
            family = " (DeepSeek V3.1's model card: in the system message)" if "<｜tool▁calls▁begin｜>" in template else ""
            return (
                "The template writes tool calls in its own format but leaves the tool descriptions to the prompt: put "
                f"them where the model's card says{family}, in your own system message, and pass "
                "require_tools_in_prompt=False; or pass chat_template=tokengym.envs.templates.CHATML_TOOLS (ChatML "
                "with the Hermes tool format: another format than the model was trained on)"
            )
        return (
            "Pass chat_template=tokengym.envs.templates.CHATML_TOOLS (ChatML with the Hermes tool format), "
            "or require_tools_in_prompt=False if your own messages describe the tools"
        )

    def _history(self, tools: Sequence[Any] | None) -> str:
        """The text before the bridge's assistant turn: ``[user]`` without the generation prompt."""
        key = _tools_key(tools)
        text = self._histories.get(key)
        if text is None:
            text = self.render_text([{"role": "user", "content": SENTINEL_USER}], tools, add_generation_prompt=False)
            if len(self._histories) >= 64:
                self._histories.clear()
            self._histories[key] = text
        return text

    def _after_assistant(self, text: str, history: str, ends: Sequence[str], found: list[str]) -> tuple[int, int, str | None]:
        """Where the bridge starts in ``text`` (``[user, assistant] + new``): right after the
        assistant's end-of-turn as the template writes it there: the first of ``ends`` that it
        writes (appended to ``found``). A template that leaves a last turn open writes the next
        message's opening there, which depends on that message (GLM: ``<|observation|>`` before tool
        results, ``<|user|>`` before a user message). The assistant's content is never looked for."""
        ends = [e for e in dict.fromkeys(ends) if e]
        if not ends:  # no end-of-turn token to count: the content must be there
            at = text.find(SENTINEL_ASSISTANT)
            if at < 0:
                raise TemplateError(
                    "the chat template has no end-of-turn token and dropped the assistant's content while "
                    "rendering the new messages, so the observation cannot be cut: pass a chat_template "
                    "that closes turns with a special token (e.g. tokengym.envs.templates.CHATML_TOOLS)"
                )
            found.append("")
            return at + len(SENTINEL_ASSISTANT), len(text), None
        note = None
        prefix_stable = text.startswith(history)
        if not prefix_stable:
            at = _first_difference(history, text)
            note = (
                f"appending the new messages changes the template's text before the assistant turn at "
                f"character {at}: {history[at : at + 40]!r} becomes {text[at : at + 40]!r}"
            )
        for end_text in ends:
            if prefix_stable:
                end_at = text.find(end_text, len(history))
            else:
                # The new messages changed the text before the assistant turn: find the turn by the
                # number of end-of-turn tokens before it, which such rewrites keep.
                end_at = -1
                for _ in range(history.count(end_text) + 1):
                    end_at = text.find(end_text, end_at + 1)
                    if end_at < 0:
                        break
            if end_at >= 0:
                found.append(end_text)
                return end_at + len(end_text), len(text), note
        raise TemplateError(
            f"the template did not close the assistant turn with {ends[0]!r} (the end-of-turn token "
            "of a plain assistant message) when rendering the new messages; pass a chat_template that "
            "ends every assistant turn the same way (e.g. tokengym.envs.templates.CHATML_TOOLS)"
        )

    def observation(
        self,
        new_messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        *,
        assistant_tool_calls: Sequence[Mapping[str, Any]] | None = None,
        closed: bool = True,
        add_generation_prompt: bool = True,
    ) -> Rendered:
        """Token ids that follow an assistant turn: the template glue, the new messages, the generation prompt.

        ``closed=False`` means the assistant did not emit its end-of-turn token (it stopped on
        a stop string); the end-of-turn tokens then open the observation.
        ``assistant_tool_calls`` are the calls parsed from the assistant turn: templates that
        check tool-call ids against tool results see the same calls as in the real conversation.
        """
        content = "" if assistant_tool_calls and self.content_after_results else SENTINEL_ASSISTANT
        assistant: Message = {"role": "assistant", "content": content}
        if assistant_tool_calls:
            # Ids and names steer templates that pair calls with results; the arguments are
            # rendered before the cut, and text in them must not look like an end of turn.
            assistant["tool_calls"] = [_without_arguments(c) for c in assistant_tool_calls]
        ends = [(self.turn_end_ids, self.turn_end_written), (self.call_end_ids, self.call_end_written)]
        if assistant_tool_calls:
            ends.reverse()
            if not self.call_end_written:
                self.require("tool_results")  # without an end-of-turn token the calls could land in the cut
        base = [{"role": "user", "content": SENTINEL_USER}, assistant]
        history = self._history(tools)
        found: list[str] = []
        bridge = self._render_ids(
            [*base, *new_messages],
            tools,
            add_generation_prompt=add_generation_prompt,
            cut=lambda text: self._after_assistant(text, history, [w for _, w in ends], found),
        )
        if closed:
            return bridge
        sampled = next((ids for ids, w in ends if w == found[-1]), ())
        return Rendered(self.decode(sampled) + bridge.text, [*sampled, *bridge.ids], bridge.rewrites_history)

    # ------------------------------------------------------------ capabilities
    def capability(self, construct: str) -> str | None:
        """``None`` when the template renders ``construct`` (a key of :data:`CONSTRUCTS`) so that
        an observation can be cut from it; otherwise why not, in a sentence that names it.
        Probed once per renderer with a probe tool and a probe call."""
        if construct not in CONSTRUCTS:
            raise KeyError(f"unknown construct {construct!r}; known: {sorted(CONSTRUCTS)}")
        if construct not in self._capabilities:
            # The probe renders observations itself; while it runs, an observation's own check of
            # this construct must not probe again (it would recurse).
            self._capabilities[construct] = None
            try:
                self._capabilities[construct] = self._probe_construct(construct)
            except BaseException:
                del self._capabilities[construct]
                raise
        return self._capabilities[construct]

    def require(self, construct: str) -> None:
        """Raise :class:`TemplateError` now, naming the construct, when the template cannot give
        the observation for it (environments call this at construction, not mid-episode)."""
        reason = self.capability(construct)
        if reason is not None:
            raise TemplateError(
                f"this chat template cannot be used for {CONSTRUCTS[construct]}: {reason}. Pass a "
                "chat_template that renders them (for tools, e.g. tokengym.envs.templates.CHATML_TOOLS)"
            )

    def _probe_construct(self, construct: str) -> str | None:
        if construct == "tool_results":
            sentinel = SENTINEL_TOOL
            new = [{"role": "tool", "content": sentinel, "tool_call_id": PROBE_CALL_ID, "name": "tokengym_probe"}]
            call = {"id": PROBE_CALL_ID, "type": "function", "function": {"name": "tokengym_probe", "arguments": {"x": 1}}}
            kwargs: dict[str, Any] = {"assistant_tool_calls": [call]}
            tools: list[Any] | None = [PROBE_TOOL]
        else:
            sentinel = SENTINEL_FOLLOWUP
            new = [{"role": "user", "content": sentinel}]
            kwargs, tools = {}, None
        try:
            obs = self.observation(new, tools, **kwargs)
        except TemplateError as err:
            return str(err)
        if construct == "tool_results" and not self.call_end_text and obs.text != self.observation(new, tools).text:
            return (
                "the observation cut after the assistant turn would hold the assistant's own tool calls: the "
                f"template prints them after its content and closes the turn without an end-of-turn token "
                f"({self.turn_end_text!r}) to cut at"
            )
        if sentinel not in obs.text:
            return (
                "the message's content is missing from the observation cut after the assistant turn "
                f"({obs.text[:80]!r}...): the template drops it or does not close the assistant turn "
                f"with {self.turn_end_text!r}"
            )
        return None

    def _token_boundary(self, text: str, at: int) -> int:
        """``at``, or the nearest position before it where ``text`` splits into tokens as a whole
        (``<think>`` and ``</think>`` share their first character, not a token)."""
        whole = self.encode(text)
        while 0 < at < len(text) and self.encode(text[:at]) + self.encode(text[at:]) != whole:
            at -= 1
        return at

    @property
    def prompt_only_text(self) -> tuple[str, str] | None:
        """``(text, kept)`` when the generation prompt ends with ``text`` that a rendered assistant
        turn does not show (an empty think block the model writes after: QwQ, R1 distills, DeepSeek
        V3.2, Gemma 4's thought channel) except for its ending ``kept`` (V3.2 keeps ``</think>``);
        ``None`` when the rendered turn starts with the whole generation prompt."""
        if self._prompt_only is not False:
            return self._prompt_only  # type: ignore[return-value]
        found: tuple[str, str] | None = None
        tools = [PROBE_TOOL] if self.tools_required else None
        user = {"role": "user", "content": SENTINEL_USER}
        history = self._history(tools)
        prefix = history + self.generation_prompt  # the probe checked that the prompt only appends
        text = self.render_text([user, {"role": "assistant", "content": SENTINEL_ASSISTANT}], tools, add_generation_prompt=False)
        common = self._token_boundary(prefix, _first_difference(prefix, text))
        if not text.startswith(prefix) and common >= len(history):
            rest, turn = prefix[common:], text[common:]
            found = (rest, turn[: _repeated_ending(rest, turn)])
        self._prompt_only = found
        return found

    def _opened_think(self, prefix: str, text: str, tools: Sequence[Any] | None) -> int | None:
        """Where the assistant turn starts in ``text`` when the generation prompt (the end of
        ``prefix``) adds an opening ``<think>`` that the rendered turn lacks; else ``None``."""
        history = self._history(tools)
        for opener in ("<think>\n", "<think>"):
            at = len(prefix) - len(opener)
            if (
                prefix.endswith(opener)
                and at >= len(history)
                and text.startswith(prefix[:at])
                and not text[at:].startswith("</think>")  # the rendered turn shows the block's end: GLM-4.7
            ):
                return at
        return None

    @property
    def assistant_opening(self) -> str:
        """What the model writes before a plain turn's content, as the template renders a turn
        (Solar's ``<|content|>``, functionary's recipient ``all\n``; empty for most templates):
        :meth:`assistant`'s text before the content. Found once."""
        if self._opening is None:
            try:
                text = self.assistant({"role": "assistant", "content": SENTINEL_ASSISTANT}).text
            except TemplateError:
                text = ""
            at = text.find(SENTINEL_ASSISTANT)
            self._opening = text[:at] if at > 0 else ""
        return self._opening

    def _no_turn_start_cause(self, message: Message) -> str:
        """Why an assistant turn's start cannot be found, as far as the message and template tell."""
        thinking = self.template_kwargs.get("enable_thinking", self.template_kwargs.get("thinking"))
        if message.get("reasoning_content") and thinking is False:
            return ("the message has reasoning_content and enable_thinking=false: the template renders the turn "
                    "without the prompt's opening; drop its reasoning_content or enable thinking")
        if not self.generation_prompt:
            return ("the template adds nothing for a generation prompt and writes nothing after the user's turn "
                    "that the assistant's turn would follow; pass a chat_template that opens each assistant turn "
                    "with a tag, as the model's own does")
        return ("the template opens an assistant turn in history otherwise than the generation prompt does; "
                "pass a chat_template whose generation prompt is the opening of an assistant turn")

    def assistant(self, message: Message, tools: Sequence[Any] | None = None) -> Rendered:
        """The tokens a model produces for ``message`` after the generation prompt, end-of-turn included.

        Used to replay transcripts and to script policies: tool calls come out in the
        template's own format (``<tool_call>`` JSON for Qwen) and reasoning as the template
        writes it for the latest turn.
        """
        if message.get("role") != "assistant":
            raise ValueError(f"expected an assistant message, got role {message.get('role')!r}")
        user = {"role": "user", "content": SENTINEL_USER}
        prefix = self.render_text([user], tools, add_generation_prompt=True)

        text = self.render_text([user, message], tools, add_generation_prompt=False)
        lead = ""
        if text.startswith(prefix):
            start = len(prefix)
        elif (opened := self._opened_think(prefix, text, tools)) is not None:
            # The generation prompt opens a think block that history does not show (DeepSeek R1):
            # the model writes its reasoning, closes the block, then the turn as history has it.
            start = opened
            lead = str(message.get("reasoning_content") or "").strip("\n") + "\n</think>\n\n"
        elif (
            not message.get("reasoning_content")  # reasoning after a prompt that closed the think block: no turn
            and (common := self._token_boundary(prefix, _first_difference(prefix, text))) >= len(self._history(tools))
            and common < len(prefix)
            and self.generation_prompt
            and not text[common:].startswith(self.generation_prompt)
        ):
            # The generation prompt ends with text the rendered turn lacks (an empty think block:
            # QwQ, R1 distills, DeepSeek V3.2, Gemma 4's thought channel): the model writes after it,
            # so the turn starts after whatever of that text the rendered turn repeats.
            start = common + _repeated_ending(prefix[common:], text[common:])
        elif not self.generation_prompt and (close := _user_turn_close(prefix, text)) is not None:
            # No generation prompt: the template closes the user's turn with the assistant's tag
            # (vLLM's DeepSeek V3 tool template: `<｜User｜>...<｜Assistant｜>`; Mistral's `[/INST]`,
            # whose last user turn differs from an earlier one), and the turn starts after that tag
            # and the whitespace the template puts there (a render's own trailing whitespace, which a
            # later turn's indentation replaces).
            rest = text[close:]
            start = close + len(rest) - len(rest.lstrip())
        else:  # the template's opening depends on the conversation: find the turn's start itself
            found = text.find(self.generation_prompt, text.find(SENTINEL_USER))
            if found < 0 or not self.generation_prompt:
                raise TemplateError(
                    "the template renders this assistant turn so that it does not start with the "
                    f"generation prompt {self.generation_prompt!r}; cannot derive the assistant's tokens "
                    f"({self._no_turn_start_cause(message)})"
                )
            start = found + len(self.generation_prompt)
        end = len(text)
        calls = bool(message.get("tool_calls"))
        end_ids, end_text = (self.call_end_ids, self.call_end_text) if calls else (self.turn_end_ids, self.turn_end_text)
        if end_text and end_ids in self._open_ends:
            # An open turn (GLM): the template writes nothing after a last turn; the model writes
            # the next message's opening, which ends its turn.
            end = len(text.rstrip())
        elif end_text:
            end = text.rfind(end_text)
            if end < start:
                raise TemplateError(
                    "the template did not close the assistant turn; pass a chat_template that ends every "
                    "assistant turn with the same end-of-turn token (e.g. tokengym.envs.templates.CHATML_TOOLS)"
                )
        text = text[:start] + lead + text[start:]
        end += len(lead)
        # What the model writes: control-token text stays text (only the closing end-of-turn is
        # one); other added tokens (<tool_call>, <think>) are the tokens a model emits for them.
        return Rendered(
            text[start:end] + end_text, self.encode_action_text(text[start:end]) + list(end_ids)
        )


_LITERAL_CACHE_SIZE = 16
_LITERAL_LOCK = threading.Lock()
_LITERAL_BACKENDS: OrderedDict[tuple[int, int, bool, frozenset[str]], tuple[Any, Any]] = OrderedDict()
"""(the tokenizer's backend's id, its size with added tokens, kind) -> (that backend, its literal
copy). The backend is kept with its copy, so an id is never reused while its entry lives; the size
makes a tokenizer that gained tokens since get a new copy."""


def _literal_copy(source: Any, every_added: bool, allowed: frozenset[str]) -> Any:
    from tokenizers import Tokenizer

    spec = source.to_str()
    if every_added or allowed:
        data = json.loads(spec)
        for token in data.get("added_tokens") or ():
            if token.get("content") in allowed:
                token["special"] = False
            elif every_added:
                token["special"] = True
        spec = json.dumps(data)
    backend = Tokenizer.from_str(spec)
    backend.encode_special_tokens = True
    return backend
