"""The policy protocol: token-id contexts in, generated token ids and their logprobs out.

A policy never sees text. It is given the exact token context an environment built and
returns the exact tokens it sampled, so nothing is decoded and re-encoded between the
engine and the trainer. Each result says why generation stopped and which kind of
logprob it carries: ``"raw"`` (log-softmax of the model's own logits over the whole
vocabulary, what a trainer's forward pass recomputes) or ``"processed"`` (after
temperature / top-k / top-p, renormalized: off from the trainer's value by the log of the
kept probability mass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "FinishReason", "Generation", "LogprobKind", "Policy", "SamplingParams", "StreamsTokens", "TokenListener",
    "VisionContext", "context_images", "finish_reason",
]

FinishReason = Literal["stop", "stop_string", "length"]
LogprobKind = Literal["raw", "processed", "none"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    ``stop_token_ids`` end generation and are kept in the output (the end-of-turn token
    belongs to the policy's action); ``stop_strings`` end it as soon as the decoded output
    ends with one of them (the string's tokens are kept too). ``seed`` makes one request
    reproducible whatever else is in the batch.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (the params are frozen)."""
        return dataclasses.replace(self, **changes)  # validated again; asdict would deep-copy every field

    def for_turn(self, max_tokens: int, seed: int | None) -> SamplingParams:
        """A copy with one turn's token budget (>= 1) and seed: what a driver asks every turn, so
        it skips :meth:`replace`'s checks of the fields it keeps."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        out = object.__new__(SamplingParams)
        out.__dict__.update(self.__dict__)
        object.__setattr__(out, "max_tokens", int(max_tokens))
        object.__setattr__(out, "seed", None if seed is None else int(seed))
        return out

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form, as stored with each trajectory so a run can be reproduced."""
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop_strings"] = list(self.stop_strings)
        return d


@dataclass(frozen=True, eq=False)
class Generation:
    """One request's result: the sampled ids (stop token included), their logprobs, why it stopped."""

    token_ids: np.ndarray
    logprobs: np.ndarray | None
    finish_reason: FinishReason
    logprob_kind: LogprobKind = "raw"
    info: dict[str, Any] = field(default_factory=dict)
    versions: np.ndarray | None = None
    """The weight version that sampled each token (int32, one per token; see
    :mod:`tokengym.policies.versions`), or None where the engine cannot say. A turn that spans a
    weight update under ``on_update="continue"`` holds two versions."""

    def __post_init__(self) -> None:
        ids = np.asarray(self.token_ids, dtype=np.int64).reshape(-1)
        object.__setattr__(self, "token_ids", ids)
        if self.logprobs is not None:
            lp = np.asarray(self.logprobs, dtype=np.float32).reshape(-1)
            if lp.shape != ids.shape:
                raise ValueError(f"{len(lp)} logprobs for {len(ids)} generated tokens")
            object.__setattr__(self, "logprobs", lp)
        if self.versions is not None:
            v = np.asarray(self.versions, dtype=np.int32).reshape(-1)
            if v.shape != ids.shape:
                raise ValueError(f"{len(v)} versions for {len(ids)} generated tokens")
            if v.size and int(v.min()) < 0:
                raise ValueError(f"weight versions are >= 0, got {int(v.min())}")
            object.__setattr__(self, "versions", v)

    def with_version(self, version: int | None) -> Generation:
        """This generation with every token stamped ``version`` (None: left unknown), unless it
        already says per token which version sampled it."""
        if self.versions is not None or version is None:
            return self
        return dataclasses.replace(self, versions=np.full(len(self.token_ids), version, dtype=np.int32))


def finish_reason(out: Sequence[int], p: SamplingParams, tokenizer: Any) -> FinishReason | None:
    """Why a generation whose tokens so far are ``out`` ends here (``"stop"``, ``"stop_string"``,
    ``"length"``), or ``None`` while it goes on: one rule for every decode loop and every engine
    whose answer is only token ids (verl's server manager)."""
    if len(out) and out[-1] in p.stop_token_ids:
        return "stop"
    if p.stop_strings:
        # The env's own check, imported here so that importing tokengym.policies does not load tokengym.envs.
        from tokengym.envs.stop_strings import ends_with_stop_string

        if ends_with_stop_string(out, p.stop_strings, tokenizer):
            return "stop_string"
    if len(out) >= p.max_tokens:
        return "length"
    return None


@runtime_checkable
class Policy(Protocol):
    """Anything that generates token ids from token-id contexts."""

    name: str
    logprob_kind: LogprobKind

    def generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """One :class:`Generation` per context, in order: the new token ids (ending with the
        end-of-turn or stop token when one was hit), their logprobs and the finish reason."""
        ...


TokenListener = Callable[[int], None]
"""Called with how many tokens a policy has just sampled (one decode step of a batch)."""


@runtime_checkable
class StreamsTokens(Protocol):
    """A policy that samples token by token in this process, and says so as it goes.

    A turn of a slow model takes minutes on a CPU; a progress display that counted tokens only
    when a turn came back would stand still all that time. Drivers listen here while a run lasts
    (:class:`~tokengym.policies.HFPolicy` implements it). Engines that hand back whole outputs
    (vLLM, a server) do not, and are counted turn by turn.
    """

    def add_token_listener(self, listener: TokenListener) -> Callable[[], None]:
        """Call ``listener(n)`` after each decode step that sampled ``n`` tokens (possibly from
        the policy's own decode thread), until the returned function is called."""
        ...


def per_request(sampling: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """One SamplingParams per request."""
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    out = list(sampling)
    if len(out) != n:
        raise ValueError(f"{len(out)} sampling settings for {n} contexts")
    return out


class VisionContext(list):  # type: ignore[type-arg]
    """A context's token ids with the images whose placeholder runs they hold
    (:class:`tokengym.envs.images.StreamImage`, offsets into these ids). A policy that reads only
    text refuses it (the request batcher asks ``policy.sees_images``), never drops the images."""

    images: tuple[Any, ...]

    def __init__(self, ids: Sequence[int], images: Sequence[Any]) -> None:
        super().__init__(ids)
        self.images = tuple(images)


def context_images(context: Any) -> tuple[Any, ...]:
    """The images of a context (none for plain token ids)."""
    return getattr(context, "images", ())


def check_contexts(contexts: Sequence[Sequence[int]], max_model_len: int | None = None) -> list[list[int]]:
    """Contexts as lists of ints; each non-empty and, with ``max_model_len``, leaving room to generate.
    A context with images (a :class:`VisionContext`) is refused: these ids alone would have the
    model read placeholder tokens where the images were."""
    out = []
    for i, c in enumerate(contexts):
        if context_images(c):
            raise ValueError(
                f"context {i} holds {len(context_images(c))} image(s), and this policy reads text only: use a "
                "vision-language policy (tokengym.policies.HFVisionPolicy)"
            )
        ids = [int(t) for t in c]
        if not ids:
            raise ValueError("every context needs at least one token")
        if max_model_len is not None and len(ids) >= max_model_len:
            raise ValueError(
                f"context {i} has {len(ids)} tokens; the engine's max_model_len is {max_model_len}, "
                "which leaves no room to generate"
            )
        out.append(ids)
    return out


async def agenerate(
    policy: Policy, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
) -> list[Generation]:
    """The async form for any policy: its own ``agenerate`` when it has one, else a worker thread."""
    native = getattr(policy, "agenerate", None)
    if native is not None:
        return await native(contexts, sampling)
    import asyncio  # loaded by whatever runs the coroutine; importing it with the package costs ~25 ms

    return await asyncio.to_thread(policy.generate, contexts, sampling)
