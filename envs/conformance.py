"""Per-turn check that the token stream is what the chat template renders for the conversation.

The stream is built incrementally (prompt, then action and bridge per turn). The check
renders the whole conversation so far, with each assistant turn as the text of the tokens
the model produced, and compares it with the stream's text. Known template behaviours
(Qwen3 dropping ``<think>`` from turns before the last user message, adding an empty think
block to a final turn) are recognised by reproducing them on the stream and are reported
as such; anything else is reported with the turn, the segment and the differing tokens.

A template that is not prefix-stable (its render of a conversation is not the start of its
render of the same conversation plus more messages) cannot equal a growing stream. Its
causes are named, not raised: reasoning dropped from earlier turns (Qwen3, DeepSeek R1),
the system prompt or tools moved to the last user message (Mistral), whitespace trimmed or
added around a control token (templates that ``| trim`` content). A template that raises
while rendering the whole conversation is a reported mismatch carrying the template's own
message in ``warn`` mode, so the check never breaks ``step``.

Rendering the whole conversation costs time in proportion to its length, so checking every
turn makes an episode's checking cost quadratic in its turns. The ``"doubling"`` schedule
checks turns 0, 1, 3, 7, 15, ... and always the episode's last turn: the checks then cost
about two renders of the final conversation in all, and every turn is still covered, since
the stream only grows and a later check compares everything before it too (a difference is
reported with the turn it happened in: ``affected_turns``, ``segment``, ``position``). A turn
between checks gets ``status="deferred"`` with its own cheap notes, never a copied ``"ok"``.
The whole conversation is rendered by :class:`~tokengym.envs.whole_render.WholeRenderer`: the
same template in the same sandbox as ``apply_chat_template``, with the sandbox's per-type safety
decisions remembered, so a check costs about a third of what it did through
``apply_chat_template`` and the checks' share of a step stays small against the rest of it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import numpy as np

from .render import ChatRenderer, Message, TemplateError
from .whole_render import whole_renderer

__all__ = [
    "Conformance",
    "ConformanceError",
    "ConformanceMode",
    "ConformanceSchedule",
    "CAUSES",
    "KnownBehaviour",
    "Piece",
    "check_conformance",
    "deferred_conformance",
    "is_scheduled",
    "next_scheduled",
]

ConformanceMode = Literal["strict", "warn", "off"]
ConformanceSchedule = Literal["doubling", "every_turn"]
SCHEDULES: tuple[str, ...] = ("doubling", "every_turn")
PieceKind = Literal["prompt", "action", "observation"]


class KnownBehaviour(str, Enum):
    """Template behaviours that make a token-faithful stream differ from a full re-render."""

    REASONING_DROPPED = "reasoning_dropped"
    """The template removes ``<think>`` content from assistant turns before the last user message."""
    EMPTY_THINK_DROPPED = "empty_think_dropped"
    """The template removes an empty ``<think></think>`` block from assistant turns that are not last."""
    EMPTY_THINK_ADDED = "empty_think_added"
    """The template adds an empty ``<think></think>`` block to a final assistant turn without one."""
    THINK_RESPACED = "think_respaced"
    """The template rewrites the line breaks around a kept ``<think>`` block and its content."""
    SYSTEM_MOVED = "system_moved"
    """The template renders the system prompt or the tools with the last user message, so they
    move each time a user message is added, or drops them once the last message is not a
    user's (Mistral)."""
    WHITESPACE_AROUND_CONTROL_TOKEN = "whitespace_around_control_token"
    """The template strips or adds whitespace next to a control token (``| trim`` on content)."""
    TURN_END_REWRITTEN = "turn_end_rewritten"
    """The template writes another end-of-turn token for a turn once a message follows it than the
    model ends it with (gpt-oss: a final answer ends with ``<|return|>``, which the history shows as
    ``<|end|>``)."""
    TOOL_RESULT_END_DROPPED = "tool_result_end_dropped"
    """The template drops the end-of-turn token after a tool result once a message follows it
    (Bielik 11B v3: its loop reads ``messages[loop.index0 + 1]`` over a slice that skips the system
    message, so it takes the tool message itself for the next one); the policy was shown it."""


CAUSES: dict[str, str] = {
    KnownBehaviour.REASONING_DROPPED.value: "reasoning is dropped from earlier assistant turns",
    KnownBehaviour.EMPTY_THINK_DROPPED.value: "empty think blocks are dropped from earlier assistant turns",
    KnownBehaviour.EMPTY_THINK_ADDED.value: "an empty think block is added to a final assistant turn",
    KnownBehaviour.THINK_RESPACED.value: "line breaks around a kept think block are rewritten",
    KnownBehaviour.SYSTEM_MOVED.value: "the system prompt or the tools move to the last user message (or vanish after it)",
    KnownBehaviour.WHITESPACE_AROUND_CONTROL_TOKEN.value: "whitespace next to a control token is stripped or added",
    KnownBehaviour.TURN_END_REWRITTEN.value: "the end-of-turn token a model writes is another one once a message follows",
    KnownBehaviour.TOOL_RESULT_END_DROPPED.value: "the end-of-turn token after a tool result is dropped once a message follows",
}
"""Why a template is not prefix-stable, in words, per :class:`KnownBehaviour` value."""


@dataclass(frozen=True, eq=False, slots=True)
class Piece:
    """One tokenized piece of the stream and the text it was tokenized from."""

    kind: PieceKind
    turn: int
    ids: np.ndarray
    """The piece's token ids: a read-only int64 array (made from the env's
    :class:`~tokengym.envs.stream.TokenStream` when a check asks for its pieces)."""
    text: str
    has_user: bool = False  # an observation that renders a real user message
    n_messages: int = 1  # messages rendered in this piece (an observation may render none)


@dataclass(frozen=True, slots=True)
class Conformance:
    """Result of one turn's check.

    ``status`` is ``"ok"`` (identical), ``"known"`` (differs only by the listed known
    behaviours), ``"mismatch"`` (differs otherwise: see ``detail``), ``"deferred"`` (not
    compared on this turn: a later check covers it, at the latest the one on the episode's
    last turn; ``notes`` are still this turn's) or ``"off"``.
    """

    turn: int
    status: Literal["ok", "known", "mismatch", "deferred", "off"]
    behaviours: tuple[str, ...] = ()
    detail: str = ""
    position: int | None = None
    segment: str | None = None
    expected_text: str = ""
    actual_text: str = ""
    expected_ids: tuple[int, ...] = ()
    actual_ids: tuple[int, ...] = ()
    affected_turns: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True unless the stream differs from the template in an unexplained way (a deferred or
        unchecked turn has shown no difference; :attr:`checked` says whether it was compared)."""
        return self.status != "mismatch"

    @property
    def checked(self) -> bool:
        """Whether this turn compared the stream with the template (``ok``, ``known`` or ``mismatch``)."""
        return self.status in ("ok", "known", "mismatch")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form, as stored in trajectory metadata."""
        return {
            "turn": self.turn,
            "status": self.status,
            "behaviours": list(self.behaviours),
            "detail": self.detail,
            "position": self.position,
            "segment": self.segment,
            "affected_turns": list(self.affected_turns),
            "notes": list(self.notes),
        }


class ConformanceError(AssertionError):
    """Raised in ``strict`` mode when a turn does not conform."""

    def __init__(self, result: Conformance) -> None:
        super().__init__(result.detail)
        self.result = result


_EMPTY_THINK = "<think>\n\n</think>\n\n"


def _matches(actual: str, expected: str, final: bool, ends: Sequence[str]) -> bool:
    if actual == expected:
        return True
    if not final:
        return False
    if expected.startswith(actual):
        rest = expected[len(actual) :]
        # The template's glue after the last end-of-turn (and the end-of-turn itself when the
        # final action was cut off) is never generated by anyone at the end of an episode.
        return rest.strip() == "" or any(rest.startswith(e) and rest[len(e) :].strip() == "" for e in ends)
    # A template that leaves a last turn open (GLM) does not write the end the model wrote for it:
    # the next message's opening.
    return any(
        actual.endswith(e) and expected.startswith(actual[: -len(e)]) and expected[len(actual) - len(e) :].strip() == ""
        for e in ends
    )


def _end_texts(renderer: ChatRenderer) -> tuple[str, ...]:
    """The texts a model ends its turns with (a plain turn's, a turn with calls')."""
    return tuple(renderer.decode(e) for e in renderer.turn_ends)


def _rewritten_ends(renderer: ChatRenderer, pieces: Sequence[Piece], final: bool) -> tuple[list[Piece], tuple[int, ...]]:
    """The stream with each plain turn's end as the template writes it once a message follows
    (gpt-oss: the ``<|return|>`` a model ends a final answer with is ``<|end|>`` in the history),
    and the turns this changed."""
    sampled, written = renderer.turn_end_text, renderer.turn_end_written
    if sampled == written:
        return list(pieces), ()
    last_action = max((i for i, p in enumerate(pieces) if p.kind == "action"), default=-1)
    out, turns = list(pieces), set()
    for i, p in enumerate(pieces):
        if p.kind == "action" and p.text.endswith(sampled) and not (final and i == last_action):
            out[i] = dataclasses.replace(p, text=p.text[: -len(sampled)] + written)
            turns.add(p.turn)
    return out, tuple(sorted(turns))


def _tool_result_ends_dropped(pieces: Sequence[Piece], ends: Sequence[str]) -> tuple[list[str], tuple[int, ...]]:
    """The stream's texts with the first end-of-turn text (and a line break after it) cut from each
    tool-result observation that an action follows, and the turns this changed."""
    last_action = max((i for i, p in enumerate(pieces) if p.kind == "action"), default=-1)
    texts, turns = [p.text for p in pieces], set()
    for i, p in enumerate(pieces[:last_action]):
        if p.kind != "observation" or p.has_user:
            continue
        for end in ends:
            at = p.text.find(end)
            if at >= 0:
                cut = at + len(end) + (p.text.startswith("\n", at + len(end)))
                texts[i] = p.text[:at] + p.text[cut:]
                turns.add(p.turn)
                break
    return texts, tuple(sorted(turns))


def _split_think(text: str) -> tuple[str, str]:
    """(reasoning, content) the way Qwen3's template splits an assistant message's text."""
    if "</think>" not in text:
        return "", text
    content = text.split("</think>")[-1].lstrip("\n")
    reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content


def _think_form(text: str, keep: bool) -> str:
    """What a Qwen3-style template writes for an assistant turn whose raw text is ``text``."""
    reasoning, content = _split_think(text)
    if keep:
        return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    return content


def _known_variants(
    pieces: Sequence[Piece], final: bool
) -> Iterator[tuple[tuple[KnownBehaviour, ...], tuple[int, ...], list[str]]]:
    """The stream's text as a Qwen3-style template rewrites think blocks, if that changes anything,
    then as a DeepSeek-R1-style one does: made one at a time, as the check tries them in order.

    Such templates keep ``<think>`` only on assistant turns after the last user message,
    and there only on the conversation's last message or where the reasoning is not empty;
    a kept block is re-spaced and an empty one is added where missing. With
    ``enable_thinking=False`` the empty block sits at the end of the generation prompt, so it
    is handled as part of the action that follows it.
    """
    last_user = max((i for i, p in enumerate(pieces) if p.has_user or p.kind == "prompt"), default=-1)
    last_action = max((i for i, p in enumerate(pieces) if p.kind == "action"), default=-1)
    last_is_action = all(p.n_messages == 0 for p in pieces[last_action + 1 :])
    last_message = last_action if last_is_action else -1
    texts = [p.text for p in pieces]
    behaviours: set[KnownBehaviour] = set()
    turns: set[int] = set()
    for i, p in enumerate(pieces):
        if p.kind != "action":
            continue
        lead = _EMPTY_THINK if i > 0 and pieces[i - 1].kind != "action" and texts[i - 1].endswith(_EMPTY_THINK) else ""
        raw = lead + p.text
        reasoning, _ = _split_think(raw)
        keep = i > last_user and (i == last_message or bool(reasoning))
        new = _think_form(raw, keep)
        if new == raw:
            continue
        if lead:
            texts[i - 1] = texts[i - 1][: -len(lead)]
        texts[i] = new
        turns.add(p.turn)
        had_think = "</think>" in raw
        if not keep:
            behaviours.add(KnownBehaviour.REASONING_DROPPED if reasoning else KnownBehaviour.EMPTY_THINK_DROPPED)
        elif not had_think:
            behaviours.add(KnownBehaviour.EMPTY_THINK_ADDED)
        else:
            behaviours.add(KnownBehaviour.THINK_RESPACED)
    if behaviours:
        ordered = tuple(b for b in KnownBehaviour if b in behaviours)
        yield ordered, tuple(sorted(turns)), texts
    yield from _dropped_everywhere(pieces, final)
    yield from _analysis_dropped(pieces, final)


_ANALYSIS = re.compile(r"(?:<\|channel\|>analysis<\|message\|>.*?<\|end\|><\|start\|>assistant)+", re.S)


def _analysis_dropped(
    pieces: Sequence[Piece], final: bool
) -> Iterator[tuple[tuple[KnownBehaviour, ...], tuple[int, ...], list[str]]]:
    """The stream as gpt-oss's template writes it: a turn's analysis messages (Harmony's
    reasoning channel) are gone from the history, but for a turn with a call that no later answer
    follows, and for the conversation's last turn when nothing follows it."""
    actions = [i for i, p in enumerate(pieces) if p.kind == "action"]
    texts = [p.text for p in pieces]
    turns = set()
    for k, i in enumerate(actions):
        p = pieces[i]
        found = _ANALYSIS.match(p.text)
        if found is None:
            continue
        calls = "to=functions." in p.text
        later_answer = any("to=functions." not in pieces[j].text for j in actions[k + 1 :])
        last = i == actions[-1] and final and all(q.n_messages == 0 for q in pieces[i + 1 :])
        if (calls and not later_answer) or (not calls and last):
            continue
        texts[i] = p.text[found.end() :]
        turns.add(p.turn)
    if turns:
        yield (KnownBehaviour.REASONING_DROPPED,), tuple(sorted(turns)), texts


def _prompt_think_dropped(
    pieces: Sequence[Piece], prompt_only: tuple[str, str] | None
) -> tuple[tuple[int, ...], list[str]] | None:
    """The stream as a template writes it whose generation prompt ends with an empty think block
    (``prompt_only``, see :attr:`ChatRenderer.prompt_only_text`) that no rendered assistant turn
    shows: the block is gone before every action, but for the part the rendered turn keeps."""
    if prompt_only is None:
        return None
    text, kept = prompt_only
    texts = [p.text for p in pieces]
    turns = set()
    for i, p in enumerate(pieces):
        if p.kind == "action" and i > 0 and pieces[i - 1].kind != "action" and texts[i - 1].endswith(text):
            texts[i - 1] = texts[i - 1][: -len(text)] + kept
            turns.add(p.turn)
    return (tuple(sorted(turns)), texts) if turns else None


def _dropped_everywhere(
    pieces: Sequence[Piece], final: bool
) -> Iterator[tuple[tuple[KnownBehaviour, ...], tuple[int, ...], list[str]]]:
    """The stream as a DeepSeek-R1-style template writes it: every assistant turn in the history
    keeps only the text after its last ``</think>``, and the ``<think>`` that the generation
    prompt opened before it is gone too (with the final turn as history, or kept). The text after
    it is kept as is, without the blank line that follows ``</think>`` (MiniMax M2: a turn's calls
    open with their own line break), or without its leading whitespace."""
    last_action = max((i for i, p in enumerate(pieces) if p.kind == "action"), default=-1)
    for keep_last in (False, True):
        for strip in ("", "\n\n", None):
            texts = [p.text for p in pieces]
            turns = set()
            for i, p in enumerate(pieces):
                if p.kind != "action" or "</think>" not in p.text or (keep_last and i == last_action and final):
                    continue
                rest = p.text.split("</think>")[-1]
                texts[i] = rest.lstrip() if strip is None else rest.removeprefix(strip)
                if i > 0 and pieces[i - 1].kind != "action":
                    for opener in ("<think>\n", "<think>"):
                        if texts[i - 1].endswith(opener):
                            texts[i - 1] = texts[i - 1][: -len(opener)]
                            break
                turns.add(p.turn)
            if turns:
                yield (KnownBehaviour.REASONING_DROPPED,), tuple(sorted(turns)), texts


def _trimmed_actions(pieces: Sequence[Piece], ends: Sequence[str]) -> tuple[list[str], tuple[int, ...]]:
    """The stream with each action's content stripped of edge whitespace (templates that
    ``| trim`` content: the whitespace sits between the turn's header and its end token)."""
    texts, turns = [p.text for p in pieces], set()
    for i, p in enumerate(pieces):
        if p.kind != "action":
            continue
        end = next((e for e in ends if p.text.endswith(e)), "")
        content = p.text[: len(p.text) - len(end)]
        if content != content.strip():
            texts[i] = content.strip() + end
            turns.add(p.turn)
    return texts, tuple(sorted(turns))


def _respaced_turns(pieces: Sequence[Piece], controls: Any) -> set[int]:
    """The turns whose action text has whitespace next to a control token (what :func:`_squeeze` takes off)."""
    return {p.turn for p in pieces if p.kind == "action" and p.text != _squeeze(p.text, controls)}


def _squeeze(text: str, controls: Any) -> str:
    """``text`` without the whitespace next to control tokens (and at its ends)."""
    if controls is None:
        return text.strip()
    return controls.sub(lambda m: m.group(1), text).strip()


_SYSTEM_PROBE = "tokengym-system-5c1e"
_USER_PROBE = "tokengym-first-user-5c1e"
_TOOL_PROBE = "tokengym-tool-description-5c1e"


def _moved_opening(
    renderer: ChatRenderer, messages: Sequence[Message], tools: Sequence[Any] | None, final: bool
) -> str | None:
    """``"system prompt"`` or ``"tools"`` when the template renders it before the first user
    message in the prompt but after it (or not at all) in the whole conversation: it moves to
    the last user message. Found by rendering both with unique probe texts in their place, so
    that no content can be mistaken for another."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None:
        return None
    probed = [dict(m) for m in messages]
    probed[first]["content"] = _USER_PROBE
    if probed[0].get("role") == "system":
        probed[0]["content"] = _SYSTEM_PROBE
    probed_tools = [json.loads(json.dumps(t)) for t in tools or ()]
    for tool in probed_tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and "description" in fn:
            fn["description"] = _TOOL_PROBE
            break
    try:
        whole = renderer.render_text(probed, probed_tools or None, add_generation_prompt=not final)
        prompt = renderer.render_text(probed[: first + 1], probed_tools or None, add_generation_prompt=True)
    except TemplateError:
        return None
    for probe, name in ((_SYSTEM_PROBE, "system prompt"), (_TOOL_PROBE, "tools")):
        before = 0 <= prompt.find(probe) < prompt.find(_USER_PROBE)
        if before and (probe not in whole or whole.find(probe) > whole.find(_USER_PROBE)):
            return name
    return None


def _known(
    turn: int, behaviours: Sequence[KnownBehaviour], turns: tuple[int, ...], notes: tuple[str, ...]
) -> Conformance:
    names = tuple(b.value for b in behaviours)
    causes = "; ".join(CAUSES[n] for n in names)
    return Conformance(
        turn=turn,
        status="known",
        behaviours=names,
        affected_turns=turns,
        detail=f"known template behaviour {', '.join(names)} on turn(s) {list(turns)} ({causes}): the template "
        "is not prefix-stable here; the stream keeps the tokens the policy saw",
        notes=notes,
    )


def _without_opening(
    renderer: ChatRenderer,
    whole: Any,
    messages: Sequence[Message],
    tools: Sequence[Any] | None,
    final: bool,
    remember: bool,
    classify: Callable[[str, Sequence[Message]], Conformance | None],
) -> Conformance | None:
    """:func:`check_conformance`'s classification of ``messages`` with the assistant turns' opening
    (:attr:`ChatRenderer.assistant_opening`) taken off the front of their content; ``None`` when no
    turn starts with it or the template refuses that form."""
    opening = renderer.assistant_opening
    if not opening:
        return None
    stripped = [
        {**m, "content": m["content"][len(opening) :]}
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"].startswith(opening)
        else m
        for m in messages
    ]
    if all(a is b for a, b in zip(stripped, messages)):
        return None
    try:
        expected = whole.render(stripped, tools, add_generation_prompt=not final, keep=remember)
    except TemplateError:
        return None
    return classify(expected, stripped)


def _locate(pieces: Sequence[Piece], char: int, decode: Callable[[Sequence[int]], str]) -> tuple[int, int, int]:
    """(piece index, token index in the stream, token index in the piece) of a character offset."""
    pos = 0
    tokens_before = 0
    for i, p in enumerate(pieces):
        if char < pos + len(p.text) or i == len(pieces) - 1:
            offset = char - pos
            k = 0
            while k < len(p.ids) and len(decode(p.ids[: k + 1])) <= offset:
                k += 1
            return i, tokens_before + k, k
        pos += len(p.text)
        tokens_before += len(p.ids)
    return len(pieces) - 1, tokens_before, 0


def check_conformance(
    renderer: ChatRenderer,
    messages: Sequence[Message],
    tools: Sequence[Any] | None,
    pieces: Sequence[Piece],
    *,
    turn: int,
    final: bool,
    structured: Mapping[int, Message] | None = None,
    remember: bool = True,
) -> Conformance:
    """Compare the stream (``pieces``) with the template's rendering of ``messages``.

    ``messages`` hold each assistant turn as the decoded text of the model's tokens. With
    ``final=False`` the stream ends with a generation prompt; with ``final=True`` it ends with
    the last action. ``structured`` (message index -> the turn as a server hands it to the
    template: its parsed calls, or Harmony's channels apart) is the second form tried when the
    template refuses assistant turns as plain text (Mistral's counts a message without
    ``tool_calls`` as a turn of its own; gpt-oss's refuses channel tags in content). ``remember``:
    keep the messages' converted forms for the next check of the same history (see
    :meth:`WholeRenderer.render`); False for a history checked on a sparse schedule, where keeping
    them costs more memory than converting them again.
    """
    notes = _notes(renderer, pieces, turn)
    whole = whole_renderer(renderer)
    rendered_messages: Sequence[Message] = messages
    try:
        expected = whole.render(messages, tools, add_generation_prompt=not final, keep=remember)
    except TemplateError as err:
        try:
            if not structured:
                raise
            replaced = [structured.get(i, m) for i, m in enumerate(messages)]
            expected = whole.render(replaced, tools, add_generation_prompt=not final, keep=remember)
            rendered_messages = replaced
        except TemplateError:
            return Conformance(
                turn=turn,
                status="mismatch",
                detail=f"turn {turn}: the chat template raised while rendering the whole conversation: {err}",
                affected_turns=(turn,),
                notes=notes,
            )
    ends = _end_texts(renderer)
    pieces, rewritten = _rewritten_ends(renderer, pieces, final)
    first = (KnownBehaviour.TURN_END_REWRITTEN,) if rewritten else ()

    def known(behaviours: Sequence[KnownBehaviour], turns: tuple[int, ...]) -> Conformance:
        return _known(turn, (*first, *behaviours), tuple(sorted({*rewritten, *turns})), notes)

    actual = "".join(p.text for p in pieces)

    def classify(expected: str, rendered_messages: Sequence[Message]) -> Conformance | None:
        if _matches(actual, expected, final, ends):
            return known((), ()) if first else Conformance(turn=turn, status="ok", notes=notes)
        for behaviours, turns, texts in _known_variants(pieces, final):
            if _matches("".join(texts), expected, final, ends):
                return known(behaviours, turns)
        dropped = _prompt_think_dropped(pieces, renderer.prompt_only_text)
        if dropped is not None and _matches("".join(dropped[1]), expected, final, ends):
            return known((KnownBehaviour.EMPTY_THINK_DROPPED,), dropped[0])
        controls = renderer.control_pattern
        trimmed, turns = _trimmed_actions(pieces, ends)
        if turns and _matches("".join(trimmed), expected, final, ends):
            return known((KnownBehaviour.WHITESPACE_AROUND_CONTROL_TOKEN,), turns)
        if _matches(_squeeze(actual, controls), _squeeze(expected, controls), final, ends):
            return known((KnownBehaviour.WHITESPACE_AROUND_CONTROL_TOKEN,), tuple(sorted(_respaced_turns(pieces, controls) or {turn})))
        cut, cut_turns = _tool_result_ends_dropped(pieces, ends)
        if cut_turns:
            if _matches("".join(cut), expected, final, ends):
                return known((KnownBehaviour.TOOL_RESULT_END_DROPPED,), cut_turns)
            if _matches(_squeeze("".join(cut), controls), _squeeze(expected, controls), final, ends):
                # Bielik 11B v3 also strips the line break it writes before a call in history.
                return known(
                    (KnownBehaviour.TOOL_RESULT_END_DROPPED, KnownBehaviour.WHITESPACE_AROUND_CONTROL_TOKEN),
                    tuple(sorted({*cut_turns, *_respaced_turns(pieces, controls)})),
                )
        if dropped is not None and _matches(_squeeze("".join(dropped[1]), controls), _squeeze(expected, controls), final, ends):
            # Both at once: the prompt's text that history drops, and whitespace the template moves
            # next to a control token (Apriel 1.6: its reasoning preamble, and a line break before `<|end|>`).
            return known((KnownBehaviour.EMPTY_THINK_DROPPED, KnownBehaviour.WHITESPACE_AROUND_CONTROL_TOKEN), dropped[0])
        moved = _moved_opening(renderer, rendered_messages, tools, final)
        if moved is not None:
            conf = known((KnownBehaviour.SYSTEM_MOVED,), (turn,))
            return dataclasses.replace(
                conf,
                **{
                    "detail": conf.detail + f" (the whole render places the {moved} after the first user message, or "
                    "drops it; the rest of the stream cannot be compared with a render that moves it)",
                }
            )
        return None

    found = classify(expected, rendered_messages)
    forms: list[Sequence[Message]] = [rendered_messages]
    if found is None and structured and rendered_messages is messages:
        # The template renders the turns as text without raising, but not as the model wrote them
        # (Gemma 4 places tool results inside the turn with calls): render them as a server would.
        replaced = [structured.get(i, m) for i, m in enumerate(messages)]
        # A turn with calls goes back with content null; a template that reads it as text (vLLM's
        # DeepSeek R1 tool template: `'</think>' in content`) is given an empty string instead.
        empty = [{**m, "content": ""} if m.get("tool_calls") and m.get("content") is None else m for m in replaced]
        forms += [replaced, empty] if empty != replaced else [replaced]
        for form in forms[1:]:
            try:
                found = classify(whole.render(form, tools, add_generation_prompt=not final, keep=remember), form)
            except TemplateError:
                found = None
            if found is not None:
                break
    if found is None:
        # The model writes the assistant turn's opening itself (Solar's `<|content|>`, functionary's
        # recipient `all\n`, muse-glimmer's ` to=user<|message|>`) and the template writes it again
        # before the content: rendered as a server hands the turn back (its content without the
        # opening), the conversation may be the stream.
        # Turns with calls go back as a server hands them too (muse-glimmer's call turn opens with its
        # recipient, ` to=calculate`, where a plain turn opens with ` to=user<|message|>`).
        for form in forms:
            found = _without_opening(renderer, whole, form, tools, final, remember, classify)
            if found is not None:
                break
    if found is not None:
        return found

    char = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
    index, position, in_piece = _locate(pieces, char, renderer.decode)
    piece = pieces[index]
    window = 48
    exp_text, act_text = expected[char : char + window], actual[char : char + window]
    return Conformance(
        turn=turn,
        status="mismatch",
        detail=(
            f"turn {turn}: the stream differs from the chat template at token {position} "
            f"(turn {piece.turn}, {piece.kind} segment): stream has {act_text!r}, "
            f"template renders {exp_text!r}"
        ),
        position=position,
        segment=piece.kind,
        expected_text=exp_text,
        actual_text=act_text,
        expected_ids=tuple(renderer.encode(exp_text)[:16]),
        actual_ids=tuple(piece.ids[in_piece : in_piece + 16].tolist()),
        affected_turns=(piece.turn,),
        notes=notes,
    )


def is_scheduled(turn: int, schedule: ConformanceSchedule) -> bool:
    """Whether ``turn`` gets the whole-conversation check under ``schedule`` (the episode's last
    turn always does, whatever this says). ``"doubling"``: turns 0, 1, 3, 7, 15, ..., so that the
    checks of an episode of N turns render about 2N turns' worth of conversation in all."""
    if schedule == "every_turn":
        return True
    if schedule == "doubling":
        return turn >= 0 and (turn + 1) & turn == 0
    raise ValueError(f"conformance_schedule must be one of {SCHEDULES}, got {schedule!r}")


def next_scheduled(turn: int, schedule: ConformanceSchedule) -> int:
    """The first turn after ``turn`` that ``schedule`` checks."""
    if schedule == "doubling":
        return (1 << (turn + 1).bit_length()) - 1
    return turn + 1


def deferred_conformance(renderer: ChatRenderer, pieces: Sequence[Piece], *, turn: int, next_check: int) -> Conformance:
    """The result of a turn the schedule does not check: its own notes (cheap, this turn's pieces
    only) and ``status="deferred"``. The check on ``next_check``, or on the episode's last turn if
    that comes first, compares the stream up to here with the template and names the turn of any
    difference."""
    notes = _notes(renderer, pieces, turn)
    detail = _DEFERRED.get(next_check)
    if detail is None:  # one string per next check, shared by every turn and episode that defers to it
        detail = _DEFERRED.setdefault(next_check, sys.intern(
            f"not compared with the template on this turn; the check on turn {next_check} or on the episode's "
            "last turn, whichever comes first, covers it (conformance_schedule='every_turn' checks each turn)"
        ))
        _NEXT_OF.setdefault(detail, next_check)
    return Conformance(turn=turn, status="deferred", detail=detail, notes=notes)


_DEFERRED: dict[int, str] = {}
_NEXT_OF: dict[str, int] = {}


def deferred_next(result: Conformance) -> int | None:
    """The next check a deferred result names, when it says nothing else (no notes): such a result
    is :func:`deferred_result` of its turn and that number, so a recorder may keep the two ints."""
    if result.status != "deferred" or result.notes or result.behaviours or type(result) is not Conformance:
        return None
    next_check = _NEXT_OF.get(result.detail)
    return next_check if next_check is not None and _DEFERRED[next_check] is result.detail else None


def deferred_result(turn: int, next_check: int) -> Conformance:
    """The deferred result of ``turn`` whose next check is ``next_check`` and that says nothing else."""
    return Conformance(turn=turn, status="deferred", detail=_DEFERRED[next_check])


def _added_text_as_text(renderer: ChatRenderer, piece: Piece) -> bool:
    """Whether some text of an added token in ``piece`` was tokenized as text: it holds more such
    texts than added-token ids (the template's own control tokens are one id each). Counted, not
    re-encoded: re-encoding each observation was most of the per-turn cost of ``warn``."""
    texts = renderer.count_added_texts(piece.text)
    added = renderer.added_ids
    return texts > 0 and sum(1 for i in piece.ids.tolist() if i in added) < texts


def _notes(renderer: ChatRenderer, pieces: Sequence[Piece], turn: int) -> tuple[str, ...]:
    """Facts worth knowing that are not template differences (about this turn's pieces)."""
    out = []
    for p in pieces[-2:] if turn else pieces[:3]:
        if p.turn != turn or not len(p.ids):
            continue
        if p.kind == "action" and renderer.encode(p.text) != p.ids.tolist():
            out.append(
                "non_canonical_action: re-tokenizing the action's text gives other tokens "
                "(a messages-in loop would train on tokens the policy never produced)"
            )
        elif p.kind != "action" and _added_text_as_text(renderer, p):
            out.append(
                f"env_text_as_text: the {p.kind} holds text of added tokens in messages from the environment, "
                "tokenized as text (a plain render would make it control tokens the environment could forge)"
            )
    return tuple(out)
