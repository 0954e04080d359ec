"""ChatEnv: the gymnasium base of every tokengym environment.

Observations and actions are token ids. ``reset`` returns the prompt ids; ``step`` takes
the assistant's ids and returns only what the environment appends after them (template
glue, the new messages, the next generation prompt), so the concatenation of everything
returned is exactly the token stream the policy is conditioned on. Subclasses only say
what the environment answers (:meth:`ChatEnv.respond`); the base does all tokenizing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.error import ResetNeeded

from .conformance import (
    SCHEDULES,
    Conformance,
    ConformanceError,
    ConformanceMode,
    ConformanceSchedule,
    Piece,
    check_conformance,
    deferred_conformance,
    is_scheduled,
    next_scheduled,
)
from .images import ImageFeatures, StreamImage, VisionProcessor, expand_images, load_image, split_images
from .near_names import did_you_mean
from .packed import PackedList, PackedMessages
from .plain_copy import plain_copy
from .render import ChatRenderer, Message, Rendered, TemplateError
from .stream import TokenStream
from .step_record import EPISODE_FACTS, RECORD, ClosedBy, ResetRecord, StepRecord, ToolCall, ToolReward, tool_call
from .stop_strings import check_stop_strings, ends_with_stop_string

__all__ = ["COMPLETION_BUDGET", "AssistantTurn", "ChatEnv", "EnvResponse", "Prompt", "UnknownOptionWarning", "token_space"]

History = Literal["keep", "deploy"]


def token_space(vocab_size: int) -> spaces.Sequence:
    """The space of token-id sequences: ``Sequence(Discrete(vocab_size), stack=True)``, as a
    :class:`~tokengym.envs.spaces.TokenSequence` (async vector envs can share its observations)."""
    from .spaces import TokenSequence

    return TokenSequence(vocab_size)


@dataclass(frozen=True)
class Prompt:
    """The start of an episode: messages, the tools the template shows, and task data for rewards."""

    messages: list[Message]
    tools: list[Any] | None = None
    task: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AssistantTurn:
    """One assistant turn as the environment sees it."""

    turn: int
    ids: np.ndarray
    text: str
    """Decoded content, without the closing end-of-turn token."""
    closed_by: ClosedBy
    messages: Sequence[Message]
    """The conversation so far, this assistant message last: a read-only sequence (``list(...)`` for a
    list; with the default schedule each message read is a new copy, unpacked from the env's records)."""

    @property
    def message(self) -> Message:
        """The turn as a chat message (content, reasoning and tool calls), for re-rendering or logging."""
        return self.messages[-1]


@dataclass
class EnvResponse:
    """What the environment answers to an assistant turn."""

    messages: list[Message] = field(default_factory=list)
    """Appended after the assistant message (tool results, a user reply)."""
    reward: float = 0.0
    done: bool = False
    """The task is over (``terminated``); nothing more is tokenized."""
    tool_calls: list[dict[str, Any]] | None = None
    """Tool calls parsed from the assistant turn, shown to the template with the new messages."""
    info: dict[str, Any] = field(default_factory=dict)
    message: Message | None = None
    """The assistant turn as the message a server hands the template (reasoning, answer and calls
    apart: Harmony's channels), for a template that refuses the turn's raw text; the
    conformance check and ``history="deploy"`` render it in the turn's place."""
    stop_reason: str | None = None
    """Ends the episode as ``truncated`` with this ``info["stop_reason"]`` (a limit the environment
    enforces); nothing more is tokenized. Ignored when ``done``."""


class UnknownOptionWarning(UserWarning):
    """A reset option the env does not read (it runs as if the option were not there)."""


COMPLETION_BUDGET = "completion_budget"
"""The reset option that caps one episode's tokens after its prompt (see :meth:`ChatEnv.reset`)."""


def frozen_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a new read-only int64 array: what an env returns (its caller cannot change what
    another reader of the same observation sees)."""
    out = np.array(ids, dtype=np.int64)
    out.setflags(write=False)
    return out


class ChatEnv(gym.Env[np.ndarray, np.ndarray]):
    """Base class for chat environments whose observations and actions are token ids.

    Args:
        tokenizer: tokenizer object, local folder, pinned name (``"qwen3"``) or hub name.
        chat_template: overrides the tokenizer's template.
        template_kwargs: template variables, e.g. ``{"enable_thinking": False}``.
        max_turns: assistant turns before the episode is truncated.
        max_context_tokens: the stream may not grow past this; truncated when the next
            observation would not leave room for one more token.
        history: ``"keep"`` (the default) continues one token stream: each observation extends
            the context the policy saw, its own tokens included. ``"deploy"`` gives the policy, each
            turn, what the chat template renders for the conversation so far, as a deployed model
            gets it (Qwen3 and DeepSeek R1 drop earlier reasoning; Mistral moves the system
            prompt). When that is not an extension of the current context, the episode goes on
            in a new sequence: the observation is the whole new context and
            ``info["context_reset"]`` is True (the recorder then starts a new trajectory row).
        max_action_tokens: the policy's per-turn token limit; an action of this length
            that did not close its turn ends the episode (truncated, ``"action_length"``).
        stop_strings: strings that end an assistant turn without its end-of-turn token; the
            end-of-turn tokens then open the next observation (mask 0).
        conformance: ``"warn"`` checks the stream against the template and reports in
            ``info``; ``"strict"`` raises :class:`ConformanceError`; ``"off"`` skips the check.
        conformance_schedule: which turns render the whole conversation to check it.
            ``"doubling"`` (the default with ``"warn"``): turns 0, 1, 3, 7, 15, ... and always the
            episode's last turn, so an episode's checks cost O(turns) instead of O(turns²); the
            turns between report ``status="deferred"`` and a later check names the turn of any
            difference. ``"every_turn"`` (the default with ``"strict"``): each turn, so a
            difference is reported, or raised, on the turn it happens.
        require_tools_in_prompt: refuse a template that does not show the tools in the prompt
            (:class:`~tokengym.envs.render.TemplateError` naming the fix); ``False`` when your
            own messages describe them.
        vision: the model's image side (:class:`~tokengym.envs.images.Qwen2VLVision`): messages
            (the prompt, user turns, tool results) may then hold image parts,
            ``{"type": "image", "image": <PIL image | bytes | path | array>}``; each stands in the
            observation as the placeholder tokens the processor makes for it, and the images of
            an observation are in ``info["images"]`` (:class:`~tokengym.envs.images.StreamImage`).
            Without it an image part is an error.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 4}
    step_waits: bool = True
    """Whether a step may wait: on a tool's I/O, a sandbox, the network, a lock. A driver runs the
    steps of an env that says False (and of wrappers that add no waiting) on its event loop's
    thread, which saves a hop to a worker thread and back each turn, about as much as a light
    env's whole step; a step that waits there would hold every other episode up. Say False
    only for steps that are computation alone (the built-in calculator, addition, replay)."""
    reset_options: frozenset[str] | None = None
    """The ``reset`` option keys :meth:`make_prompt` reads; another key warns
    (:class:`UnknownOptionWarning`) with the near names: a misspelled option would otherwise run a
    random task. None: any key (a subclass that reads new keys adds them here)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        max_turns: int = 16,
        max_context_tokens: int = 32768,
        max_action_tokens: int | None = None,
        stop_strings: Sequence[str] = (),
        conformance: ConformanceMode = "warn",
        conformance_schedule: ConformanceSchedule | None = None,
        render_mode: str | None = None,
        require_tools_in_prompt: bool = True,
        history: History = "keep",
        vision: VisionProcessor | None = None,
    ) -> None:
        if history not in ("keep", "deploy"):
            raise ValueError(f"history must be 'keep' or 'deploy', got {history!r}")
        if conformance not in ("strict", "warn", "off"):
            raise ValueError(f"conformance must be 'strict', 'warn' or 'off', got {conformance!r}")
        if conformance_schedule is None:
            conformance_schedule = "every_turn" if conformance == "strict" else "doubling"
        if conformance_schedule not in SCHEDULES:
            raise ValueError(
                f"conformance_schedule must be one of {SCHEDULES} (or None for the mode's default), "
                f"got {conformance_schedule!r}"
            )
        for name, value, optional in (("max_turns", max_turns, False), ("max_context_tokens", max_context_tokens, False),
                                      ("max_action_tokens", max_action_tokens, True)):
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        self.renderer = (
            tokenizer
            if isinstance(tokenizer, ChatRenderer)
            else ChatRenderer(
                tokenizer,
                chat_template=chat_template,
                template_kwargs=template_kwargs,
                require_tools_in_prompt=require_tools_in_prompt,
            )
        )
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self._limit = max_context_tokens  # this episode's (a completion budget lowers it)
        self.reset_seed: int | None = None
        self.max_action_tokens = max_action_tokens
        self.history: History = history
        self.stop_strings = check_stop_strings(stop_strings)
        self.conformance_mode: ConformanceMode = conformance
        self.conformance_schedule: ConformanceSchedule = conformance_schedule
        self.render_mode = render_mode
        self.observation_space = token_space(self.renderer.vocab_size)
        self.action_space = token_space(self.renderer.vocab_size)
        if vision is not None and not isinstance(vision, VisionProcessor):
            raise TypeError(f"vision must be a VisionProcessor (e.g. Qwen2VLVision(tokenizer)), got {type(vision).__name__}")
        if vision is not None and history == "deploy":
            raise ValueError("history='deploy' does not take images (vision=...) yet: use history='keep'")
        self.vision = vision
        if vision is not None:
            self._probe_images()
        self._stream: TokenStream | None = None
        self._checked_pieces: list[Piece] | None = None  # during a whole check: its pieces (their texts)
        self._num_tokens = 0
        self._done = False
        self._images: list[StreamImage] = []
        self._features_seen: dict[int, tuple[Any, ImageFeatures]] = {}

    # ----------------------------------------------------------------- hooks
    def make_prompt(self, options: dict[str, Any]) -> Prompt:
        """The episode's opening messages. Use ``self.np_random`` for anything random.

        ``options`` are the reset's (a task from ``rollout(..., tasks=[...])``); ``self.reset_seed``
        is the seed ``reset`` was called with (None for none): the episodes of a GRPO group share it,
        so a task picked from it is the group's task. Put a task id in ``Prompt.task["id"]``.
        """
        raise NotImplementedError(
            f"{type(self).__name__} must implement make_prompt(), or reset with options={{'messages': [...]}}"
        )

    def respond(self, turn: AssistantTurn) -> EnvResponse:
        """The environment's answer to an assistant turn."""
        raise NotImplementedError(f"{type(self).__name__} must implement respond()")

    # ------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer whose chat template defines this env's token law."""
        return self.renderer.tokenizer

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids a policy should stop generating on."""
        return self.renderer.stop_token_ids

    @property
    def num_tokens(self) -> int:
        """Length of the token stream so far."""
        return self._num_tokens

    @property
    def messages(self) -> list[Message]:
        """The conversation so far (assistant turns as the decoded text of their tokens)."""
        if self._stream is None:
            return []
        return self._messages[:] if isinstance(self._messages, PackedList) else plain_copy(self._messages)

    @property
    def token_stream(self) -> TokenStream | None:
        """The current sequence's tokens as the env holds them (read it, don't append): the recorder
        and the driver read the ids from here rather than keep their own. None before a reset."""
        return self._stream

    @property
    def _pieces(self) -> list[Piece] | None:
        """The current sequence's pieces, materialized (for checks and tests; not a per-turn read)."""
        return None if self._stream is None else self._stream.pieces()

    # ------------------------------------------------------------- gymnasium
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode. ``options`` go to :meth:`make_prompt` (or hold a transcript:
        ``messages``, ``tools``, ``task``), but for :data:`COMPLETION_BUDGET`, which caps what
        follows the prompt in this episode (actions and observations, in tokens) below
        ``max_context_tokens``: a driver's budget for one episode, passed rather than set on the env."""
        super().reset(seed=seed)
        self.reset_seed = seed
        opts = dict(options or {})
        budget = opts.pop(COMPLETION_BUDGET, None)
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"options[{COMPLETION_BUDGET!r}] must be a positive int, got {budget!r}")
        if "messages" in opts:
            prompt = Prompt(list(opts["messages"]), opts.get("tools"), dict(opts.get("task", {})))
        else:
            self._check_options(opts)
            prompt = self.make_prompt(opts)
        prompt_messages, images = self._take_images(prompt.messages)
        rendered = self.renderer.prompt(prompt_messages, prompt.tools)
        self._images = []
        if images:
            rendered = self._with_images(rendered, images, turn=-1, start=0)
        if len(rendered.ids) >= self.max_context_tokens:
            raise ValueError(
                f"the prompt has {len(rendered.ids)} tokens, which leaves no room under "
                f"max_context_tokens={self.max_context_tokens}"
            )
        self._limit = self.max_context_tokens if budget is None else min(self.max_context_tokens, len(rendered.ids) + budget)
        self._prompt = prompt
        self._tools = prompt.tools
        # The conversation: packed (a third of the dicts' memory) where a sparse schedule reads it
        # rarely; as dicts where every turn's check renders it (the renderer remembers their forms).
        self._messages: PackedList | list[Message] = (
            plain_copy(prompt_messages) if self.conformance_schedule == "every_turn"
            # an assistant message is its action piece (the stream holds its text), except where a
            # deploy history may start a new stream
            else PackedList(prompt_messages, resolve=None if self.history == "deploy" else self._assistant_messages)
        )
        prompt_ids = frozen_ids(rendered.ids)
        self._stream = TokenStream(self.renderer.decode, self.renderer.decode_many)
        self._stream.append("prompt", 0, prompt_ids, rendered.text, has_user=True)
        self._num_tokens = len(rendered.ids)
        self._turn = 0
        self._done = False
        # assistant message index -> the turn as a server renders it (its parsed calls, or the
        # parser's split of the turn), for templates that refuse the turn as plain text; packed:
        # most templates never read it
        self._structured_at = PackedMessages()
        record = ResetRecord(
            plain_copy(prompt.task), len(rendered.ids), self._limit - len(rendered.ids), tuple(self._images)
        )
        info = {
            "messages": plain_copy(prompt_messages),
            "tools": plain_copy(prompt.tools),
            "task": plain_copy(prompt.task),
            "num_tokens": record.num_tokens,
            "remaining_context": record.remaining_context,
            RECORD: record,
        }
        if self._images:
            info["images"] = list(self._images)
        return prompt_ids, info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self._stream is None:
            raise ResetNeeded("call reset() before step()")
        if self._done:
            raise ResetNeeded("the episode is over; call reset() before step()")
        ids = self.validate_action(action)
        self._features_seen.clear()
        turn = self._turn
        content_ids, closed_by = self._split_closing(ids)
        text = self.renderer.decode(content_ids)
        assistant: Message = {"role": "assistant", "content": text}
        full = self.renderer.decode(ids)
        closing = len(full) - len(text) if full.startswith(text) else None
        self._stream.append("action", turn, ids, full, closing_chars=closing)
        self._num_tokens += len(ids)
        if isinstance(self._messages, PackedList) and self._messages.holds_refs:
            self._messages.append_ref(self._stream.num_pieces - 1)
        else:
            self._messages.append(assistant)

        stop_reason: str | None = None
        if self.num_tokens > self._limit:  # the action alone runs past the context: not scored
            response = EnvResponse()
            stop_reason = "context_length"
        elif closed_by == "none" and self.max_action_tokens is not None and len(ids) >= self.max_action_tokens:
            response = EnvResponse()
            stop_reason = "action_length"
        else:
            response = self.respond(
                AssistantTurn(turn, ids.copy(), text, closed_by, self._snapshot())
            )
            if not math.isfinite(float(response.reward)):
                raise ValueError(
                    f"{type(self).__name__}.respond() returned a non-finite reward ({float(response.reward)}) on turn "
                    f"{turn}: a reward must be a finite number (a NaN would poison every advantage of its group)"
                )
            if response.done:
                stop_reason = "done"
            elif response.stop_reason:
                stop_reason = str(response.stop_reason)
            elif turn + 1 >= self.max_turns:
                stop_reason = "max_turns"
            if response.message is not None:
                self._structured_at[len(self._messages) - 1] = dict(response.message)
            elif response.tool_calls:
                self._structured_at[len(self._messages) - 1] = {
                    **assistant, "content": None, "tool_calls": list(response.tool_calls)
                }

        obs_ids: list[int] | np.ndarray = []
        context_reset = False
        step_images: list[StreamImage] = []
        if stop_reason is None:
            new, images = self._take_images([dict(m) for m in response.messages])
            try:
                obs_ids, obs_text, start, context_reset = self._observation(new, response.tool_calls, closed_by)
            except TemplateError as err:  # the template refuses what the env answers: the model reads why
                new = [dict(m) for m in self.refused_observation(response, err)]
                response.info.setdefault("render_refused", str(err))
                at = len(self._messages) - 1
                split = self._structured_at.pop(at, None)
                if response.message is not None and split is not None:  # the turn's channels, without the calls
                    self._structured_at[at] = {k: v for k, v in split.items() if k != "tool_calls"}
                obs_ids, obs_text, start, context_reset = self._observation(new, None, closed_by)
                images = []  # the error message the model reads instead holds none
            if images:
                shown = self._with_images(Rendered(obs_text, list(obs_ids)), images, turn=turn, start=start)
                obs_ids, step_images = shown.ids, self._images[len(self._images) - len(images):]
            if start + len(obs_ids) >= self._limit:
                stop_reason, obs_ids, context_reset = "context_length", [], False
            else:
                has_user = any(m.get("role") == "user" for m in new)
                obs_ids = frozen_ids(obs_ids)
                if context_reset:  # the deployed context is not an extension of this one: a new sequence
                    self._stream = TokenStream(self.renderer.decode, self.renderer.decode_many)
                    self._stream.append("prompt", turn, obs_ids, obs_text, has_user=True)
                    self._num_tokens = 0
                else:
                    self._stream.append("observation", turn, obs_ids, obs_text, has_user=has_user, n_messages=len(new))
                self._num_tokens += len(obs_ids)
                self._messages.extend(new if isinstance(self._messages, PackedList) else plain_copy(new))

        if step_images and not len(obs_ids):  # the observation did not fit: its images are not in the stream
            del self._images[len(self._images) - len(step_images):]
            step_images = []
        done = stop_reason is not None
        conformance = self._check(turn, final=done)
        self._turn += 1
        self._done = done
        terminated = stop_reason == "done"
        reward = float(response.reward)
        extra = plain_copy(response.info)
        record = StepRecord(
            turn=turn,
            closed_by=closed_by,
            num_tokens=self.num_tokens,
            num_action_tokens=len(ids),
            remaining_context=self._limit - self.num_tokens,
            conformance=conformance,
            stop_reason=stop_reason,
            context_reset=context_reset,
            tool_rewards=_tool_rewards(turn, extra.get("tool_results")),
            tool_calls=_tool_calls(extra.get("tool_results")),
            episode_facts={k: plain_copy(extra[k]) for k in EPISODE_FACTS if k in extra},
            images=tuple(step_images),
        )
        obs_out = obs_ids if isinstance(obs_ids, np.ndarray) else frozen_ids(obs_ids)
        info = _step_info(record, assistant, response, extra)
        if step_images:
            info["images"] = list(step_images)
        return obs_out, reward, terminated, done and not terminated, info

    def render(self) -> str | None:
        """``"ansi"``: the stream's text with segment markers.

        The text is shown, never obeyed: control characters in it (terminal escape sequences from a
        tool's output or the model's text, which could move the cursor, rewrite earlier lines or
        retitle the terminal) are written out as ``\\xNN``; only newlines and tabs pass.
        """
        if self.render_mode != "ansi" or self._stream is None:
            return None
        controls = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}
        return "".join(
            f"\x1b[{'32' if p.kind == 'action' else '90'}m{p.text.translate(controls)}\x1b[0m" for p in self._stream.pieces()
        )

    # ------------------------------------------------------------- internals
    def _probe_images(self) -> None:
        """Refuse, when the env is built, a chat template that does not write one placeholder for
        an image part (a text-only template): every episode would fail at its first image."""
        assert self.vision is not None
        probe = [{"role": "user", "content": [{"type": "text", "text": "Look."}, {"type": "image"}]}]
        try:
            ids = self.renderer.prompt(probe, None).ids
        except TemplateError as err:
            raise ValueError(
                f"vision=... needs a chat template that renders image parts, and this one cannot render a user message "
                f"with one ({str(err).splitlines()[0][:200]}): use the model's own VL template (Qwen2-VL, Qwen2.5-VL, "
                "Qwen3.5: tokengym.envs.template_corpus.corpus_tokenizer('Qwen3.5-4B'))"
            ) from err
        found = sum(1 for i in ids if i == self.vision.placeholder_id)
        if found != 1:
            raise ValueError(
                f"vision=... needs a chat template that writes one image placeholder (id {self.vision.placeholder_id}) "
                f"per image part; this one writes {found}: use the model's own VL template (Qwen2-VL, Qwen2.5-VL, "
                "Qwen3.5: tokengym.envs.template_corpus.corpus_tokenizer('Qwen3.5-4B'))"
            )

    def _take_images(self, messages: Sequence[Message]) -> tuple[list[Message], list[Any]]:
        """``messages`` with their image parts' images taken out (see :func:`split_images`)."""
        out, images = split_images(messages)
        if images and self.vision is None:
            raise ValueError(
                f"a message holds {len(images)} image part(s), but {type(self).__name__} has no vision processor: "
                "pass vision=Qwen2VLVision(tokenizer) (tokengym.envs.images) with the model's image settings"
            )
        return out, images

    def _with_images(self, rendered: Rendered, images: list[Any], *, turn: int, start: int) -> Rendered:
        """``rendered`` with each image's placeholder expanded to its processor's count; the
        images are added to the episode's (``self._images``), their runs placed at ``start`` on."""
        assert self.vision is not None
        loaded = [load_image(img) for img in images]
        features = [self.image_features(img) for img in loaded]
        ids, offsets = expand_images(
            rendered.ids, features, self.vision.placeholder_id, turn=turn, first_index=len(self._images)
        )
        for img, f, at in zip(loaded, features, offsets, strict=True):
            self._images.append(StreamImage(
                img, f, start + at, turn, len(self._images), self.vision.placeholder_id,
                "prompt" if turn < 0 else "observation",
            ))
        self._features_seen.clear()
        return Rendered(rendered.text, ids, rendered.rewrites_history)

    def image_features(self, image: Any) -> ImageFeatures:
        """``vision.features(image)``, computed once per image object and turn (a tool env asks
        first to count the image against the turn's budget, then renders it)."""
        assert self.vision is not None, "image_features needs vision="
        seen = self._features_seen.get(id(image))
        if seen is None or seen[0] is not image:
            seen = self._features_seen[id(image)] = (image, self.vision.features(image))
        return seen[1]

    def _check_options(self, options: Mapping[str, Any]) -> None:
        known = self.reset_options
        unknown = sorted(set(options) - known) if known is not None else []
        for key in unknown:
            hint = did_you_mean(key, known or (), cutoff=0.5)
            warnings.warn(
                f"{type(self).__name__}.reset ignores the option {key!r}: {hint}it reads {sorted(known or ())} "
                f"(a subclass that reads more sets reset_options)",
                UnknownOptionWarning,
                stacklevel=3,
            )

    def validate_action(self, action: Any) -> np.ndarray:
        """The action as a 1-D int64 array of in-vocabulary ids, or a ValueError that says what was
        passed and how to make token ids of it (text and tokenizer outputs are the usual mistakes)."""
        encode = "encode text with tokenizer.encode(text, add_special_tokens=False)"
        if action is None:
            raise ValueError(f"the action is None; an action is the assistant's token ids: {encode}")
        if isinstance(action, (str, bytes)):
            shown = action if len(action) <= 40 else action[:37] + "..."
            raise ValueError(f"the action is text ({shown!r}), not token ids: {encode}")
        if isinstance(action, Mapping):  # a tokenizer's BatchEncoding, or a dict of its outputs
            raise ValueError(
                f"the action is a {type(action).__name__} with keys {sorted(map(str, action))}, not token ids: "
                f"pass the ids alone, e.g. tokenizer(text)['input_ids'], or {encode}"
            )
        try:
            arr = np.asarray(action)
        except Exception as err:  # ragged lists and the like
            raise ValueError(f"the action must be a 1-D sequence of token ids: {err}") from err
        if arr.size == 0:
            raise ValueError(
                f"the action is empty ({type(action).__name__} of 0 ids): a policy turn must produce at least one token"
            )
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            first = arr.reshape(-1)[:3].tolist()
            if arr.dtype.kind in "USO":
                kind, fix = "text or objects", encode
            elif arr.dtype == np.bool_:
                kind, fix = "booleans", "pass the token ids, not a mask"
            elif np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
                kind, fix = f"{arr.dtype} numbers", "if these are token ids, convert with np.asarray(ids, dtype=np.int64)"
            else:
                kind, fix = f"{arr.dtype} numbers", "if these are logits or probabilities, sample token ids first"
            raise ValueError(
                f"the action must hold integer token ids, got {kind} "
                f"({type(action).__name__}, first values {first}): {fix}"
            )
        if arr.ndim == 0:
            raise ValueError(
                f"the action is a single token id ({arr.item()!r}), not a sequence of them: pass [{arr.item()!r}] "
                "(a turn's ids, its closing token included)"
            )
        if arr.ndim != 1:
            hint = ": pass one sequence, e.g. ids[0]" if arr.ndim == 2 and arr.shape[0] == 1 else ""
            raise ValueError(f"the action must be a 1-D array of token ids, got shape {arr.shape}{hint}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.renderer.vocab_size))
        if bad.size:
            raise ValueError(
                f"the action has token ids outside the vocabulary [0, {self.renderer.vocab_size}): "
                f"{arr[bad[:5]].tolist()} at positions {bad[:5].tolist()}"
            )
        return arr.astype(np.int64, copy=True)

    def _split_closing(self, ids: np.ndarray) -> tuple[np.ndarray, ClosedBy]:
        for end in self.renderer.turn_ends:  # a plain turn's end, or a call turn's (gpt-oss: <|call|>)
            if len(ids) >= len(end) and tuple(ids[-len(end) :].tolist()) == end:
                return ids[: -len(end)], "end_of_turn"
        if int(ids[-1]) in self.renderer.stop_token_ids:
            return ids[:-1], "eos"
        if ends_with_stop_string(ids, self.stop_strings, self.renderer.tokenizer):
            return ids, "stop_string"
        return ids, "none"

    def refused_observation(self, response: EnvResponse, err: TemplateError) -> list[Message]:
        """The messages to render instead of ``response.messages`` (what :meth:`respond` answered)
        when the chat template refuses them with the turn's parsed calls (``response.info`` may be
        updated). The default raises ``err``: a
        plain chat env's answer is its own text, so a refusal is the env's bug. :class:`ToolEnv`
        answers with an error message the model reads, as for a malformed call."""
        raise err

    def _observation(
        self, new: list[Message], tool_calls: list[dict[str, Any]] | None, closed_by: ClosedBy
    ) -> tuple[list[int] | np.ndarray, str, int, bool]:
        """The tokens ``new`` appends (ids, text, where they start, whether they start a new sequence)."""
        if self.history == "deploy":
            ids, text, context_reset = self._deploy_observation(new)
            return ids, text, 0 if context_reset else self.num_tokens, context_reset
        obs = self.renderer.observation(
            new, self._tools, assistant_tool_calls=tool_calls, closed=closed_by in ("end_of_turn", "eos")
        )
        return obs.ids, obs.text, self.num_tokens, False

    def _deploy_observation(self, new: list[Message]) -> tuple[list[int], str, bool]:
        """``history="deploy"``: what the template renders for the whole conversation so far (what a
        deployed model is given), as the rest of the current sequence when it extends it, else as a
        new sequence (``True``)."""
        assert self._stream is not None
        messages = [*self._messages, *new]
        try:
            full = self.renderer.prompt(messages, self._tools, deployed=True)
        except TemplateError:
            if not self._structured_at:
                raise
            # The template refuses assistant turns as plain text: render them with their parsed calls.
            full = self.renderer.prompt(
                [self._structured_at.get(i, m) for i, m in enumerate(messages)],
                self._tools,
                deployed=True,
            )
        current = self._stream.tolist()
        if full.ids[: len(current)] == current:
            rest = list(full.ids[len(current):])
            text = self._stream.all_text()
            return rest, full.text[len(text):] if full.text.startswith(text) else self.renderer.decode(rest), False
        return list(full.ids), full.text, True

    def _assistant_messages(self, pieces: Sequence[int]) -> list[Message]:
        """The assistant messages of action pieces ``pieces`` of the current stream, as :meth:`step`
        made them: each one's text less its closing tokens' (the text a check has at hand, else
        decoded again), or its content's ids decoded where that split was not recorded."""
        stream, at_hand = self._stream, self._checked_pieces
        assert stream is not None
        out: list[Message] = []
        for p in pieces:
            content = stream.content(p, at_hand[p].text if at_hand is not None and p < len(at_hand) else None)
            if content is None:
                content = self.renderer.decode(self._split_closing(stream.piece_ids(p))[0])
            out.append({"role": "assistant", "content": content})
        return out

    def _snapshot(self) -> Sequence[Message]:
        """The conversation so far, as :meth:`respond` gets it (later turns do not change it)."""
        return self._messages.snapshot() if isinstance(self._messages, PackedList) else list(self._messages)

    def _check(self, turn: int, *, final: bool) -> Conformance:
        if self.conformance_mode == "off":
            result = Conformance(turn=turn, status="off")
        elif not final and not is_scheduled(turn, self.conformance_schedule):
            assert self._stream is not None
            result = deferred_conformance(  # reads this turn's pieces alone
                self.renderer, self._stream.last_pieces(2 if turn else 3), turn=turn, next_check=next_scheduled(turn, self.conformance_schedule)
            )
        else:
            assert self._stream is not None
            self._checked_pieces = pieces = self._stream.pieces()  # the messages' references read their texts
            try:
                result = check_conformance(
                    self.renderer, self._messages, self._tools, pieces, turn=turn, final=final,
                    structured=self._structured_at, remember=self.conformance_schedule == "every_turn",
                )
            finally:
                self._checked_pieces = None
            if self.conformance_mode == "strict" and not result.ok:
                raise ConformanceError(result)
        return result


def _step_info(record: StepRecord, assistant: Message, response: EnvResponse, extra: dict[str, Any]) -> dict[str, Any]:
    """The user's ``info`` of a step, filled from its record (and the response's own keys)."""
    info: dict[str, Any] = {
        "turn": record.turn,
        "assistant": dict(assistant),
        "closed_by": record.closed_by,
        "messages": plain_copy(response.messages),
        "tool_calls": plain_copy(response.tool_calls),
        "conformance": record.conformance,
        "num_tokens": record.num_tokens,
        "num_action_tokens": record.num_action_tokens,
        "remaining_context": record.remaining_context,
        **extra,
    }
    if record.stop_reason is not None:
        info["stop_reason"] = record.stop_reason
    if record.context_reset:
        info["context_reset"] = True
    info[RECORD] = record
    return info


def _tool_calls(results: Any) -> tuple[ToolCall, ...]:
    """The turn's calls, in order (``info["tool_results"]`` entries: :meth:`CallRecord.as_dict`)."""
    return tuple(
        tool_call(None if r.get("name") is None else str(r["name"]), str(r.get("status")))
        for r in results or ()
        if isinstance(r, dict)
    )


def _tool_rewards(turn: int, results: Any) -> tuple[ToolReward, ...]:
    """The rewards the turn's tools gave (``info["tool_results"]`` entries with a nonzero ``reward``)."""
    return tuple(
        ToolReward(turn, r.get("name"), float(r["reward"]))
        for r in results or ()
        if isinstance(r, dict) and r.get("reward")
    )
