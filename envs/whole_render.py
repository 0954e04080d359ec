"""The chat template's text for a conversation, as ``apply_chat_template`` renders it, faster.

Every render of a :class:`~tokengym.envs.render.ChatRenderer` goes through here (each turn's
observation, prompts, and the conformance check's whole conversation on its scheduled turns), and
most of a render's time is not the template's own work: Jinja's sandbox decides, on every attribute read
(``message.role``, ``content.startswith``), whether the read is safe, through a dozen
``isinstance`` checks against abstract base classes, and reads a dict key by first failing an
attribute lookup. Those decisions depend only on the type of the object and the attribute's
name, so :class:`WholeRenderer` compiles the same template in the same sandbox (an overlay of
transformers' own environment: the same filters, globals and extensions) and remembers each
decision per type. Every read still goes through the sandbox's rules, and a read that the
sandbox refuses still ends in the sandbox's own refusal: the text is the same, about three times
sooner.

A one-off render (:meth:`WholeRenderer.render_once`, the renderer's ``render_text``) converts
its messages and keeps nothing. For the check's whole conversation, the inputs go through the
steps ``apply_chat_template`` applies (messages to plain dicts without
``None`` values, plain template data, the reasoning field aliases, the special tokens map and the
renderer's template variables as template variables), one message at a time, and each message's
converted form is kept with a copy of the message: the next check converts only the messages that
are new or no longer equal to their copy. Plain data (what JSON and the environments give) is
converted by one direct copy, which is what those steps make of it, and ``loop`` and
``namespace()`` reads that the sandbox would return as they are skip its wrapping step. That uses
transformers' helper functions (a step an older version does not take is skipped, as that version
skips it); where this transformers
version lacks the template compiler, or renders the probe conversation differently, or a
render raises, the whole render goes through ``apply_chat_template`` itself (the
:attr:`WholeRenderer.unavailable` reason says why for the first two), so the text, and any
error, is always the template's own.
"""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Callable, Sequence
from types import BuiltinMethodType
from typing import TYPE_CHECKING, Any

from .plain_copy import NotPlainData, plain_copy, plain_data
from .template_inputs import Message, TemplateError, string_arguments

if TYPE_CHECKING:
    from .render import ChatRenderer

__all__ = ["WholeRenderer", "whole_renderer"]

_ITEM, _ATTR, _SANDBOX = "item", "attr", "sandbox"
# Types whose attributes are their class's alone (no instance dict, no __getattr__): whether an
# attribute read succeeds, and what the sandbox says of it, is the same for every instance.
_PLAIN_TYPES = frozenset({dict, list, tuple, str, int, float, bool, type(None)})

# A conversation that takes the usual branches of templates: system prompt, user turns, an
# assistant turn with reasoning and a tool call, a tool result, a final answer.
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        },
    }
]
_PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a tarn?"},
    {
        "role": "assistant",
        "content": "Let me look it up.",
        "reasoning_content": "A lookup helps.",
        "tool_calls": [{"id": "call00001", "type": "function", "function": {"name": "lookup", "arguments": {"word": "tarn"}}}],
    },
    {"role": "tool", "content": "A small mountain lake.", "tool_call_id": "call00001", "name": "lookup"},
    {"role": "assistant", "content": "A small mountain lake."},
    {"role": "user", "content": "Thanks."},
]


def _is_runtime_type(kind: type) -> bool:
    """Whether ``kind`` is one of jinja's own template-time objects (``loop``; ``namespace()``,
    transformers' subclass of it included, as long as it reads attributes the way jinja's does)."""
    from jinja2.runtime import LoopContext
    from jinja2.utils import Namespace

    if kind is LoopContext or kind is Namespace:
        return True
    return (
        issubclass(kind, Namespace)
        and kind.__getattribute__ is Namespace.__getattribute__
        and not hasattr(kind, "__getattr__")
    )


def _memo_sandbox_class(base: type) -> type:
    """``base`` (transformers' sandbox class) with its safety decisions remembered per type."""

    runtime_types: dict[type, bool] = {}

    class MemoSandbox(base):  # type: ignore[misc, valid-type]
        _decisions: dict[tuple[type, str], bool]
        _reads: dict[tuple[type, str], str]

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            # The base rules test only ``attr`` and ``isinstance(obj, ...)``: a function of the type.
            key = (type(obj), attr)
            found = self._decisions.get(key)
            if found is None:
                found = self._decisions[key] = bool(base.is_safe_attribute(self, obj, attr, value))
            return found

        def getattr(self, obj: Any, attribute: str) -> Any:
            kind = type(obj)
            # Only plain types' reads are remembered, so a known read is one of a plain type.
            how = self._reads.get((kind, attribute)) if type(attribute) is str else _SANDBOX
            if how is None and kind in _PLAIN_TYPES:
                how = self._reads[(kind, attribute)] = self._classify(obj, attribute)
            if how is not None:
                if how is _ITEM:  # not an attribute of the type: the sandbox reads the item
                    try:
                        return obj[attribute]
                    except (TypeError, LookupError):
                        return self.undefined(obj=obj, name=attribute)
                if how is _ATTR:  # an attribute the sandbox allows and does not wrap
                    return builtins.getattr(obj, attribute)
                return base.getattr(self, obj, attribute)
            runtime = runtime_types.get(kind)
            if runtime is None:
                runtime = runtime_types[kind] = _is_runtime_type(kind)
            if runtime:
                # ``loop.index0``, ``ns.flag``: the value depends on the instance, the rule on the
                # type; a plain value is no ``str.format`` to wrap, so the sandbox returns it when
                # the rule allows it. Anything else takes the sandbox's own path.
                try:
                    value = builtins.getattr(obj, attribute)
                except AttributeError:
                    pass
                else:
                    if type(value) in _PLAIN_TYPES and self.is_safe_attribute(obj, attribute, value):
                        return value
            return base.getattr(self, obj, attribute)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            # A method of a plain value (``content.split``): the sandbox finds it safe (such methods
            # carry no attributes) and the context passes it no context; the call is what both do.
            if type(__obj) is BuiltinMethodType and type(__obj.__self__) in _PLAIN_TYPES:
                kwargs.pop("_block_vars", None)
                kwargs.pop("_loop_vars", None)
                try:
                    return __obj(*args, **kwargs)
                except StopIteration:
                    return __context.environment.undefined(
                        "value was undefined because a callable raised a StopIteration exception"
                    )
            return base.call(__self, __context, __obj, *args, **kwargs)

        def _classify(self, obj: Any, attribute: str) -> str:
            try:
                value = builtins.getattr(obj, attribute)
            except AttributeError:
                return _ITEM
            if self.wrap_str_format(value) is not None or not self.is_safe_attribute(obj, attribute, value):
                return _SANDBOX  # str.format is wrapped, an unsafe read is refused: the sandbox does both
            return _ATTR

    return MemoSandbox


_SHARED: dict[tuple[int, str], tuple[Any, Any]] = {}
"""(id of transformers' compiled template, source) -> (that template, ours): one compile per process."""


def _shared_template(reference: Any, source: str) -> Any:
    """The memoizing sandbox's template of ``source``, compiled once per process and shared by every
    renderer of it: its remembered decisions are functions of types alone (see :func:`_memo_sandbox_class`),
    true for every env, and compiling the same template again cost ~85% of building an env."""
    key = (id(reference), source)
    found = _SHARED.get(key)
    if found is not None and found[0] is reference:  # the id is of a template still alive: held here
        return found[1]
    environment = reference.environment.overlay()
    environment.__class__ = _memo_sandbox_class(type(reference.environment))
    environment._decisions, environment._reads = {}, {}
    template = environment.from_string(source)
    _SHARED[key] = (reference, template)  # a race compiles twice and keeps either: both are the same template
    return template


class WholeRenderer:
    """Renders whole conversations to the text ``apply_chat_template(..., tokenize=False)`` gives,
    with the renderer's template and template variables (see the module's docstring)."""

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.unavailable: str | None = None
        """Why whole renders go through ``apply_chat_template`` itself (None: they do not)."""
        self._compiled: dict[str, Any] = {}
        self._forms: list[tuple[Message, Message, bool, dict[str, Any]] | None] = []
        self._helpers: tuple[Callable[..., Any], ...] | None = None
        self._plain_steps = False
        try:
            from transformers.utils import chat_template_utils as ctu

            # The input steps came in one by one (transformers 5.5 renders the messages as given);
            # a step this version does not have is one it does not take. The probe below checks
            # the result against apply_chat_template either way.
            self._helpers = (
                ctu._compile_jinja_template,
                getattr(ctu, "_normalize_chat_messages", _as_list),
                getattr(ctu, "_plain_template_data", _as_is),
                getattr(ctu, "_alias_reasoning_fields", _as_is),
            )
            # The steps whose result on plain data _form makes directly: dropping a message's None
            # values (and copying it), then, where this version has it, rebuilding it from plain types.
            self._plain_steps = hasattr(ctu, "_normalize_chat_messages")
        except (ImportError, AttributeError) as err:
            self.unavailable = f"this transformers version lacks a chat-template helper ({err})"
        else:
            self._probe()
        if self.unavailable is not None:
            self._warn_unavailable(stacklevel=4)

    def for_renderer(self, renderer: ChatRenderer) -> WholeRenderer:
        """A renderer of ``renderer``'s conversations with this one's probe verdict and compiled
        templates (``renderer`` adopted this one's renderer: the same tokenizer and template), and
        none of its conversation's state."""
        twin = object.__new__(WholeRenderer)
        twin.renderer = renderer
        twin.unavailable = self.unavailable
        twin._compiled = dict(self._compiled)
        twin._forms = []
        twin._helpers = self._helpers
        twin._plain_steps = self._plain_steps
        return twin

    def _warn_unavailable(self, *, stacklevel: int) -> None:
        """Say once, when it is found, why renders go through ``apply_chat_template`` from now on."""
        warnings.warn(
            f"chat-template renders use apply_chat_template itself (about 3x slower): {self.unavailable}",
            stacklevel=stacklevel,
        )

    def _probe(self) -> None:
        """Compare with ``apply_chat_template`` on probe conversations the template accepts."""
        for messages, tools in ((_PROBE_MESSAGES, _PROBE_TOOLS), (_PROBE_MESSAGES[1:2] + _PROBE_MESSAGES[4:], None)):
            for generation_prompt in (True, False):
                try:
                    slow = self.renderer.render_text(
                        messages, tools, add_generation_prompt=generation_prompt, reference=True
                    )
                except TemplateError:
                    continue  # the template refuses this conversation: no verdict either way
                try:
                    fast = self._render(messages, tools, add_generation_prompt=generation_prompt)
                except Exception as err:
                    self.unavailable = self.unavailable or (
                        f"the memoized sandbox raised on a probe conversation that renders: {err!r}"
                    )
                    return
                if fast != slow:
                    at = next((i for i, (a, b) in enumerate(zip(fast, slow)) if a != b), min(len(fast), len(slow)))
                    self.unavailable = (
                        f"the memoized sandbox renders a probe conversation differently at character {at} "
                        f"({fast[at : at + 30]!r} vs {slow[at : at + 30]!r})"
                    )
                    return

    def render(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, *, add_generation_prompt: bool, keep: bool = True
    ) -> str:
        """The template's text for ``messages``; raises the renderer's ``TemplateError`` as
        ``render_text`` does when the template cannot render them. ``keep``: remember each
        message's converted form for the next render of the same history (a check every turn);
        a caller that renders a history rarely passes False, and nothing of it is kept."""
        if self.unavailable is None:
            try:
                return self._render(messages, tools, add_generation_prompt=add_generation_prompt, keep=keep)
            except Exception:  # render_text raises the template's own error, or retries with string arguments
                if self.unavailable is not None:  # found out just now (a template compiled for other tools)
                    self._warn_unavailable(stacklevel=3)
        return self.renderer.render_text(messages, tools, add_generation_prompt=add_generation_prompt, reference=True)

    def render_once(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, *, add_generation_prompt: bool
    ) -> str:
        """The template's text for a conversation rendered once (nothing of its messages is kept);
        raises whatever the render raises (the caller repeats it through ``apply_chat_template``)."""
        if self.unavailable is not None:
            raise TemplateError(self.unavailable)
        try:
            return self._render(messages, tools, add_generation_prompt=add_generation_prompt, keep=False)
        except Exception:
            if self.unavailable is not None:  # found out just now (a template compiled for other tools)
                self._warn_unavailable(stacklevel=4)
            raise

    def _template(self, source: str) -> Any:
        template = self._compiled.get(source)
        if template is None:
            assert self._helpers is not None
            reference = self._helpers[0](source)  # transformers' own compiled template, cached there
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            if type(reference.environment) is not ImmutableSandboxedEnvironment:  # its own rules: not ours to memoize
                self.unavailable = (
                    f"transformers renders templates in a {type(reference.environment).__name__}, whose safety "
                    "rules may not depend on types alone"
                )
                raise TemplateError(self.unavailable)
            template = self._compiled[source] = _shared_template(reference, source)
        return template

    def _render(
        self, messages: Sequence[Message], tools: Sequence[Any] | None, *, add_generation_prompt: bool, keep: bool = True
    ) -> str:
        r = self.renderer
        tool_list = list(tools) if tools else None
        if tool_list is not None and not all(isinstance(t, dict) for t in tool_list):
            raise TypeError("tools given as functions: apply_chat_template converts them")
        source = r.tokenizer.get_chat_template(r.chat_template, tool_list)
        chat = self._template_messages(messages, keep=keep)
        variables = self._plain({**r.tokenizer.special_tokens_map, **r.template_kwargs})
        return str(
            self._template(source).render(
                messages=chat,
                tools=self._plain(tool_list),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        )

    def _plain(self, value: Any) -> Any:
        """``_plain_template_data(value)`` where this version has it; for plain data, the same copy
        made directly (see :meth:`_form`)."""
        assert self._helpers is not None
        plain = self._helpers[2]
        if plain is not _as_is:
            try:
                return plain_data(value)
            except NotPlainData:
                pass
        return plain(value)

    def _template_messages(self, messages: Sequence[Message], *, keep: bool = True) -> list[dict[str, Any]]:
        """The messages as the template sees them (``apply_chat_template``'s steps, one message at a
        time), each remembered with a copy of the message it came from (``keep``): a check renders
        the same history again and again, and only new or changed messages are converted."""
        strings = self.renderer.string_arguments
        if not keep:  # render_once: the renderer has made the arguments strings where it must
            return [self._form(message) for message in messages]
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            known = self._forms[i] if i < len(self._forms) else None
            if known is not None and known[0] is message and known[2] == strings and _unchanged(known[1], message):
                out.append(known[3])
                continue
            form = self._form(string_arguments([message])[0] if strings else message)
            try:
                entry = (message, plain_copy(message), strings, form)
            except Exception:  # not copyable: converted again next time
                entry = None
            if i < len(self._forms):
                self._forms[i] = entry
            else:
                self._forms.append(entry)
            out.append(form)
        return out

    def _form(self, message: Message) -> dict[str, Any]:
        """One message as the template sees it (``apply_chat_template``'s input steps). A message of
        plain data (dicts with string keys, lists, tuples, strings, numbers, booleans, None: what
        JSON and the environments give) comes out of transformers' steps as a copy of itself without
        its ``None`` values: that copy is made directly, at a fraction of the time the general steps
        take (they test each value against every kind of object a caller might pass)."""
        assert self._helpers is not None
        _, normalize, plain, alias = self._helpers
        if self._plain_steps and type(message) is dict:
            try:
                return alias([{key: value for key, value in plain_data(message).items() if value is not None}])[0]
            except NotPlainData:
                pass
        form = alias(plain(normalize([message])))[0]
        if not isinstance(form, dict):
            raise TypeError("a message is not a dict")
        return form


def _as_list(messages: Any) -> list[Any]:
    return list(messages)


def _as_is(value: Any) -> Any:
    return value


def _unchanged(copied: Any, message: Any) -> bool:
    """Whether ``message`` still equals the copy made when it was converted (its strings are the
    copy's own objects, so this is mostly identity tests)."""
    try:
        return bool(copied == message)
    except Exception:
        return False


def whole_renderer(renderer: ChatRenderer) -> WholeRenderer:
    """The renderer's :class:`WholeRenderer`, made on first use."""
    found = getattr(renderer, "_whole_renderer", None)
    if found is None:
        found = WholeRenderer(renderer)
        renderer._whole_renderer = found  # type: ignore[attr-defined]
    return found
