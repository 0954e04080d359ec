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

Special-token text inside message content (``"<|im_end|>"`` in a tool result) is
tokenized as plain text, never as a control token.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .tokenizers import load_tokenizer

__all__ = ["ChatRenderer", "Message", "Rendered", "TemplateError"]

Message = dict[str, Any]

SENTINEL_USER = "tokengym-user-7f3a"
SENTINEL_ASSISTANT = "tokengym-assistant-7f3a"
_PROTECTED_FIELDS = ("content", "reasoning_content")


def _without_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(call)
    if isinstance(out.get("function"), Mapping):
        out["function"] = {**out["function"], "arguments": {}}
    elif "arguments" in out:
        out["arguments"] = {}
    return out


class TemplateError(ValueError):
    """The chat template cannot be used the way a token-faithful episode needs."""


@dataclass(frozen=True)
class Rendered:
    """A piece of rendered conversation: its text and the token ids the policy sees."""

    text: str
    ids: list[int]


class ChatRenderer:
    """Turns chat messages into token ids with a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a tokenizer object, a local folder, a pinned name (``"qwen3"``) or a hub name.
        chat_template: a Jinja template that replaces the tokenizer's own.
        template_kwargs: extra variables for the template, e.g. ``{"enable_thinking": False}``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        tok = load_tokenizer(tokenizer)
        if not (chat_template or getattr(tok, "chat_template", None)):
            raise TemplateError(
                f"tokenizer {getattr(tok, 'name_or_path', '?')!r} has no chat template: pass "
                "chat_template=... (a Jinja string), or use the tool-capable ChatML template tokengym "
                "ships: chat_template=tokengym.envs.templates.CHATML_TOOLS"
            )
        self.tokenizer = tok
        self.chat_template = chat_template
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.vocab_size: int = len(tok)
        self.name: str = str(getattr(tok, "name_or_path", "") or type(tok).__name__)
        self._backend = getattr(tok, "backend_tokenizer", None)
        self._plain_backend: Any = None
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
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._probe()

    # ------------------------------------------------------------------ probing
    def _probe(self) -> None:
        user = {"role": "user", "content": SENTINEL_USER}
        text = self.render_text(
            [user, {"role": "assistant", "content": SENTINEL_ASSISTANT}], add_generation_prompt=False
        )
        at = text.find(SENTINEL_ASSISTANT)
        if at < 0:
            raise TemplateError(
                "the chat template does not render assistant content verbatim (it rewrites or drops "
                "what the model wrote), so actions cannot be kept token for token: "
                "pass chat_template=tokengym.envs.templates.CHATML_TOOLS or another template that does"
            )
        tail_ids = self.encode(text[at + len(SENTINEL_ASSISTANT) :])
        n = 0
        while n < len(tail_ids) and tail_ids[n] in self.special_ids:
            n += 1
        #: Token ids the template puts right after an assistant message's content.
        self.turn_end_ids: tuple[int, ...] = tuple(tail_ids[:n])
        self.turn_end_text: str = self.decode(self.turn_end_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        #: Token ids a policy should stop on (the end-of-turn token, then EOS).
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*self.turn_end_ids[-1:], *([eos] if isinstance(eos, int) else [])])
        )
        with_prompt = self.render_text([user], add_generation_prompt=True)
        without = self.render_text([user], add_generation_prompt=False)
        if not with_prompt.startswith(without):
            raise TemplateError(
                "the generation prompt is not appended at the end of the conversation, so an observation "
                "cannot end where the next action starts: pass a chat_template whose "
                "add_generation_prompt only appends text (e.g. tokengym.envs.templates.CHATML_TOOLS)"
            )
        #: The text the template appends for ``add_generation_prompt=True``.
        self.generation_prompt: str = with_prompt[len(without) :]

    # ------------------------------------------------------------ text <-> ids
    def encode(self, text: str) -> list[int]:
        """Tokenize template text: special-token strings become special tokens."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Tokenize message text: special-token strings stay text."""
        if not self.has_special_text(text):
            return self.encode(text)
        if self._backend is None:
            raise TemplateError("tokenizing special-token text as text needs a fast (tokenizers) tokenizer")
        if self._plain_backend is None:
            # A private copy with special-token matching off: the shared tokenizer is never mutated.
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return list(self._plain_backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids exactly: special tokens kept, no clean-up of spaces."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def has_special_text(self, text: str) -> bool:
        """True when ``text`` contains the text of a special token (it is then tokenized as plain text, never as the control token)."""
        return bool(self._special_re and self._special_re.search(text))

    # -------------------------------------------------------------- rendering
    def render_text(
        self, messages: Sequence[Message], tools: Sequence[Any] | None = None, *, add_generation_prompt: bool
    ) -> str:
        """The template's text for a conversation (no tokenizing)."""
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as err:  # jinja raises many types; the template's own message is what helps
            raise TemplateError(f"the chat template failed to render: {err}") from err
        if not isinstance(text, str):
            raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def _protect(self, messages: Sequence[Message]) -> tuple[list[Message], list[str]]:
        """Swap message text that contains special-token strings for placeholders."""
        out: list[Message] = []
        subs: list[str] = []
        for msg in messages:
            changed = None
            for field in _PROTECTED_FIELDS:
                value = msg.get(field)
                if isinstance(value, str) and self.has_special_text(value):
                    changed = dict(msg) if changed is None else changed
                    # Edge whitespace stays outside the placeholder, so templates that strip
                    # content (Qwen3 lstrips after </think>) treat it as they would the real text.
                    core = value.strip()
                    head = value[: len(value) - len(value.lstrip())]
                    tail = value[len(value.rstrip()) :] if core else ""
                    changed[field] = head + self._placeholder.format(len(subs)) + tail
                    subs.append(core)
            out.append(changed if changed is not None else msg)
        return out, subs

    def _render_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None,
        *,
        add_generation_prompt: bool,
        cut: Callable[[str], tuple[int, int]] | None = None,
    ) -> Rendered:
        protected, subs = self._protect(messages)
        text = self.render_text(protected, tools, add_generation_prompt=add_generation_prompt)
        start, end = cut(text) if cut else (0, len(text))
        piece = text[start:end]
        if not subs:
            return Rendered(piece, self.encode(piece))
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
        return Rendered("".join(texts), ids)

    def prompt(self, messages: Sequence[Message], tools: Sequence[Any] | None = None) -> Rendered:
        """Token ids of a whole conversation followed by the generation prompt."""
        if not messages:
            raise ValueError("a prompt needs at least one message")
        return self._render_ids(messages, tools, add_generation_prompt=True)

    def _after_assistant(self, text: str) -> tuple[int, int]:
        at = text.find(SENTINEL_ASSISTANT)
        if at < 0:
            raise TemplateError(
                "the chat template dropped the assistant message while rendering the new messages; "
                "cannot compute the observation tokens (Llama-3.1-style templates drop the content of "
                "a message with tool calls: use ToolEnv(..., template_tool_calls=False), or pass "
                "chat_template=tokengym.envs.templates.CHATML_TOOLS)"
            )
        start = at + len(SENTINEL_ASSISTANT)
        if self.turn_end_text:
            end_at = text.find(self.turn_end_text, start)
            if end_at < 0:
                raise TemplateError(
                    f"the template did not close the assistant turn with {self.turn_end_text!r}; "
                    "pass a chat_template that ends every assistant turn the same way "
                    "(e.g. tokengym.envs.templates.CHATML_TOOLS)"
                )
            start = end_at + len(self.turn_end_text)
        return start, len(text)

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
        assistant: Message = {"role": "assistant", "content": SENTINEL_ASSISTANT}
        if assistant_tool_calls:
            # Ids and names steer templates that pair calls with results; the arguments are
            # rendered before the cut, and text in them must not look like an end of turn.
            assistant["tool_calls"] = [_without_arguments(c) for c in assistant_tool_calls]
        base = [{"role": "user", "content": SENTINEL_USER}, assistant]
        bridge = self._render_ids(
            [*base, *new_messages], tools, add_generation_prompt=add_generation_prompt, cut=self._after_assistant
        )
        if closed:
            return bridge
        return Rendered(self.turn_end_text + bridge.text, [*self.turn_end_ids, *bridge.ids])

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
        if text.startswith(prefix):
            start = len(prefix)
        else:  # the template's opening depends on the conversation: find the turn's start itself
            found = text.find(self.generation_prompt, text.find(SENTINEL_USER))
            if found < 0 or not self.generation_prompt:
                raise TemplateError(
                    "the template renders this assistant turn so that it does not start with the "
                    f"generation prompt {self.generation_prompt!r}; cannot derive the assistant's tokens "
                    "(a message with reasoning under enable_thinking=false does this: drop its "
                    "reasoning_content or enable thinking)"
                )
            start = found + len(self.generation_prompt)
        end = len(text)
        if self.turn_end_text:
            found = text.rfind(self.turn_end_text)
            if found < start:
                raise TemplateError(
                    "the template did not close the assistant turn; pass a chat_template that ends every "
                    "assistant turn with the same end-of-turn token (e.g. tokengym.envs.templates.CHATML_TOOLS)"
                )
            end = found
        # Everything the model writes is text; only the closing end-of-turn is a control token.
        return Rendered(text[start:end] + self.turn_end_text, self.encode_plain(text[start:end]) + list(self.turn_end_ids))
