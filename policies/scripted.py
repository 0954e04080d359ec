"""A scripted policy: replies chosen by a function of the context, for tests and demos.

It goes through the same protocol as a real engine, so an episode driven by a script
exercises exactly the code a model-driven episode does; its tokens come from the
tokenizer (text replies) or are given as ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .base import Generation, SamplingParams, per_request
from .versions import OnUpdate, PolicyClosed, check_on_update, next_version

__all__ = ["ScriptedPolicy", "scripted_replies"]

Reply = str | Sequence[int] | np.ndarray


class ScriptedPolicy:
    """Replies with ``script(context)``: text (tokenized, then ``end_ids`` appended) or token ids.

    Replies are cut to the request's ``max_tokens`` (finish reason ``"length"``). No
    logprobs are produced (``logprob_kind="none"``). It has no weights, but it has a version
    (:meth:`update_weights` bumps it, and every reply is stamped with it), so the bookkeeping of an
    asynchronous run can be tested without a model.
    """

    logprob_kind = "none"

    def __init__(
        self,
        script: Callable[[np.ndarray], Reply],
        tokenizer: Any = None,
        *,
        end_ids: Sequence[int] = (),
        name: str = "scripted",
    ) -> None:
        self.script = script
        self.tokenizer = tokenizer
        self.end_ids = [int(i) for i in end_ids]
        self.name = name
        self.version = 0
        self.closed = False

    def update_weights(self, weights: Any = None, version: int | None = None, *, on_update: OnUpdate = "continue") -> int:
        """A version bump (a script has no weights to change: ``weights`` is not read); every later
        reply is stamped with the new version. Replies are instant, so no turn is ever in flight."""
        if self.closed:
            raise PolicyClosed("this ScriptedPolicy was closed: it takes no updates")
        check_on_update(on_update)
        self.version = next_version(self.version, version)
        return self.version

    def close(self) -> None:
        self.closed = True

    def _ids(self, reply: Reply) -> list[int]:
        if isinstance(reply, str):
            if self.tokenizer is None:
                raise ValueError("a text reply needs ScriptedPolicy(..., tokenizer=...)")
            return list(self.tokenizer.encode(reply, add_special_tokens=False)) + self.end_ids
        return [int(i) for i in reply]

    def generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """The script's reply for each context, cut at ``max_tokens`` like a real engine (finish "length")."""
        out = []
        for context, p in zip(contexts, per_request(sampling, len(contexts))):
            ids = self._ids(self.script(np.asarray(context, dtype=np.int64)))
            if not ids:
                raise ValueError("the script returned an empty reply")
            finish = "stop"  # the script ended the reply
            if len(ids) > p.max_tokens:
                ids, finish = ids[: p.max_tokens], "length"
            elif ids[-1] not in p.stop_token_ids and p.stop_strings and self.tokenizer is not None:
                # The env's own check, imported here so that importing tokengym.policies does not load tokengym.envs.
                from tokengym.envs.stop_strings import ends_with_stop_string

                if ends_with_stop_string(ids, p.stop_strings, self.tokenizer):
                    finish = "stop_string"
            versions = np.full(len(ids), self.version, dtype=np.int32)
            out.append(Generation(np.array(ids), None, finish, self.logprob_kind, versions=versions))  # type: ignore[arg-type]
        return out


def scripted_replies(replies: Sequence[str], tokenizer: Any) -> ScriptedPolicy:
    """Reply ``replies[k]`` on turn k (the last one from then on), each closed by the end-of-turn token.

    The turn is the number of generation prompts in the context, minus one. ``tokenizer`` may
    be a name: ``functools.partial(scripted_replies, replies, "qwen2.5")`` is a picklable policy
    factory (the CLI's ``--policy scripted``; a Ray engine actor loads the tokenizer itself).
    """
    from tokengym.envs import ChatRenderer, load_tokenizer

    if not replies:
        raise ValueError("--policy scripted needs at least one --reply TEXT")
    renderer = ChatRenderer(load_tokenizer(tokenizer))
    marker = renderer.encode(renderer.generation_prompt)
    n = len(marker)

    def script(context: np.ndarray) -> list[int]:
        ids = context.tolist()
        turns = sum(ids[i : i + n] == marker for i in range(len(ids) - n + 1)) if n else 1
        text = replies[min(max(turns - 1, 0), len(replies) - 1)]
        return renderer.encode_action_text(text) + list(renderer.turn_end_ids)

    return ScriptedPolicy(script, name="scripted")
