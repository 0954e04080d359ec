"""Continuous batching for :class:`~tokengym.policies.HFPolicy`: requests join and leave at every decode step.

A batched ``generate`` call runs until its longest request is done, and a request that
arrives meanwhile waits for all of it. With episodes at their own pace that is the common
case, so :meth:`HFPolicy.agenerate` sends requests here instead: one thread owns the decode
loop; at every step the requests that arrived are prefilled and join the running batch (their
KV cache rows left-padded to its length), and finished requests leave it (their rows
dropped, shared left padding trimmed). Each request keeps its own ``torch.Generator``, so it
samples the same tokens as it would alone or in a batched ``generate``.

Only caches made of plain full-attention layers can be joined this way; a model whose cache
holds other layer kinds (sliding windows, static or quantized caches) gets an error that says
so when it is first used here, and the driver's request queue (batched ``generate`` calls) is
what to use for it: ``HFPolicy(..., continuous=False)``.

A request whose future is cancelled (its episode was stopped) leaves the batch at the next step
instead of decoding to its token limit. The loop's thread is stopped before the interpreter
finalizes (an exit hook), also when nobody closed the policy: a daemon thread still inside
torch then aborts the process (``terminate called without an active exception``, exit 134
where a stopped run must exit 130).
"""

from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import Generation, SamplingParams
from .versions import PolicyClosed

if TYPE_CHECKING:
    import torch

__all__ = ["ContinuousDecoder", "PolicyClosed", "UnsupportedCache"]


class UnsupportedCache(TypeError):
    """The model's KV cache has layers whose rows cannot be joined between decode steps."""


@dataclass
class _Row:
    context: list[int]
    params: SamplingParams
    future: Future
    generator: Any = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None
    restarts: int = 0


@dataclass
class _Update:
    """New weights to put in between two decode steps, and what the requests in flight do then."""

    apply: Callable[[], None]
    mode: str
    future: Future


class ContinuousDecoder:
    """The decode loop of one :class:`~tokengym.policies.HFPolicy`, on a thread of its own."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self._queue: queue.SimpleQueue[_Row | _Update | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._exit_hook: weakref.finalize | None = None
        self.steps = 0
        """Decode steps run (a step serves every running request at once)."""
        self.max_batch = 0
        self.late_joins = 0
        """Requests admitted into a batch that was already decoding (they arrived mid-generation)."""
        self.updates = 0
        """Weight updates put in between decode steps."""
        self.updates_asked = 0
        """Weight updates handed to the loop (a ``"finish"`` one waits there for the requests in flight)."""
        self.rebuilds = 0
        """Requests whose KV cache was computed again with new weights (``on_update="continue"``)."""
        self.restarts = 0
        """Requests started again from their context with new weights (``on_update="restart"``)."""

    def submit(self, context: list[int], params: SamplingParams) -> Future:
        """Queue one request; the future gets its :class:`Generation`."""
        row = _Row(context, params, Future())
        with self._lock:
            if self._thread is None:
                self._halt.clear()
                self._thread = threading.Thread(target=self._serve, name="tokengym-hf-decode", daemon=True)
                self._thread.start()
                # At exit (atexit runs before daemon threads are killed): halt and join.
                self._exit_hook = weakref.finalize(self._thread, _halt_and_join, self._halt, self._queue, self._thread)
            self._queue.put(row)
        return row.future

    def update(self, apply: Callable[[], None], mode: str) -> Future:
        """Run ``apply`` (it puts new weights in) between two decode steps, doing ``mode`` to the
        requests in flight (:mod:`tokengym.policies.versions`); the future is done once it is in.
        With no loop running, ``apply`` runs here and now (nothing is in flight)."""
        u = _Update(apply, mode, Future())
        with self._lock:
            self.updates_asked += 1
            if self._thread is None:
                apply()
                self.updates += 1
                u.future.set_result(None)
            else:
                self._queue.put(u)
        return u.future

    def close(self, *, cancel: bool = False) -> None:
        """Stop the loop after the requests it holds are done (cancelled ones leave at the next
        step); with ``cancel`` at the next step, failing the requests it holds."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            if self._exit_hook is not None:
                self._exit_hook.detach()
            if cancel:
                self._halt.set()
            self._queue.put(None)
            thread.join()

    # ------------------------------------------------------------------ the loop
    def _serve(self) -> None:
        import torch

        rows: list[_Row] = []
        state: _Batch | None = None
        stopping = False
        updates: list[_Update] = []
        held: list[_Row] = []  # arrived while a "finish" update waits for the rows in flight
        while True:
            if self._halt.is_set():
                late = [r for r in self._take(block=False) if r is not None]
                closed = PolicyClosed("the policy was closed")
                _fail(rows + held + [r for r in late if isinstance(r, _Row)], closed)
                for u in updates + [r for r in late if isinstance(r, _Update)]:
                    u.future.set_exception(closed)
                return
            items = self._take(block=not rows and not updates and not held)
            if None in items:
                stopping = True
            waiting = held + [r for r in items if isinstance(r, _Row)]
            held = []
            updates += [u for u in items if isinstance(u, _Update)]
            with torch.inference_mode():
                while updates:  # in the order they came
                    if updates[0].mode == "finish" and rows:
                        held, waiting = waiting, []  # new turns wait for the update
                        break
                    rows, state, waiting = self._put_in(updates.pop(0), rows, state, waiting)
                for joined, new in self._admit(waiting):
                    if rows:
                        self.late_joins += len(joined)
                    state = new if state is None else state.join(new)
                    rows += joined
                if rows:
                    assert state is not None
                    try:
                        keep = self._step(rows, state)
                    except BaseException as err:  # a failed step fails the requests it held, not the loop
                        _fail(rows, err)
                        rows, state = [], None
                        continue
                    if len(keep) < len(rows):
                        rows = [rows[i] for i in keep]
                        state = state.select(keep) if rows else None
            if stopping and not rows and not updates and not held:
                return

    def _put_in(
        self, u: _Update, rows: list[_Row], state: _Batch | None, waiting: list[_Row]
    ) -> tuple[list[_Row], _Batch | None, list[_Row]]:
        """Put ``u``'s weights in; the rows in flight, their batch and the rows to admit after it."""
        try:
            u.apply()
        except BaseException as err:  # a refused update changes nothing: the rows go on as they were
            u.future.set_exception(err)
            return rows, state, waiting
        self.updates += 1
        try:
            if rows and u.mode == "restart":
                for r in rows:
                    r.ids, r.logprobs, r.versions, r.generator = [], [], [], None
                    r.restarts += 1
                self.restarts += len(rows)
                rows, state, waiting = [], None, rows + waiting
            elif rows:
                state = self._rebuild(rows)
                self.rebuilds += len(rows)
        except BaseException as err:  # the weights are in; the rows that could not go on fail
            _fail(rows, err)
            rows, state = [], None
        u.future.set_result(None)
        return rows, state, waiting

    def _admit(self, waiting: list[_Row]) -> list[tuple[list[_Row], _Batch]]:
        """Prefill the new requests together; if that fails, one by one, so a bad request fails alone."""
        if not waiting:
            return []
        try:
            joined, batch = self._prefill(waiting)
            return [(joined, batch)] if batch is not None else []
        except BaseException as err:
            if len(waiting) == 1:
                _fail(waiting, err)
                return []
        return [admitted for r in waiting for admitted in self._admit([r])]

    def _take(self, block: bool) -> list[_Row | _Update | None]:
        out: list[_Row | _Update | None] = []
        if block:
            out.append(self._queue.get())
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _prefill(self, rows: list[_Row]) -> tuple[list[_Row], _Batch | None]:
        """Prefill new requests and sample their first tokens; those that go on, with their batch."""
        import torch
        from transformers import DynamicCache

        p = self.policy
        n = len(rows)
        for r in rows:
            r.generator = p.generator(r.params)
        ids, mask, positions = p.left_padded([r.context for r in rows])
        cache = DynamicCache()
        logits = p.forward(ids, mask, positions, cache)
        _check_layers(cache)
        batch = _Batch(cache, mask, positions[:, -1:], torch.zeros((n, 1), dtype=torch.long, device=p.device))
        keep = self._sample(rows, logits, batch)
        done_rows = [r for i, r in enumerate(rows) if i not in keep]
        for r in done_rows:
            self._resolve(r)
        if not keep:
            return [], None
        return [rows[i] for i in keep], batch.select(keep) if len(keep) < n else batch

    def _rebuild(self, rows: list[_Row]) -> _Batch:
        """The running rows' KV cache computed again over their context and the tokens they have
        sampled but the last (which is the next input, as after a prefill), with the weights now
        in place: every later token is sampled from the new weights' own pass over its prefix."""
        import torch
        from transformers import DynamicCache

        p = self.policy
        ids, mask, positions = p.left_padded([r.context + r.ids[:-1] for r in rows])
        cache = DynamicCache()
        p.forward(ids, mask, positions, cache)
        last = torch.as_tensor([[r.ids[-1]] for r in rows], dtype=torch.long, device=p.device)
        return _Batch(cache, mask, positions[:, -1:], last)

    def _step(self, rows: list[_Row], batch: _Batch) -> list[int]:
        """One decode step for every running request; the indices of those that go on."""
        import torch

        p = self.policy
        self.steps += 1
        self.max_batch = max(self.max_batch, len(rows))
        batch.mask = torch.cat([batch.mask, torch.ones((len(rows), 1), dtype=batch.mask.dtype, device=p.device)], 1)
        batch.positions = batch.positions + 1
        logits = p.forward(batch.next_ids, batch.mask, batch.positions, batch.cache)
        keep = self._sample(rows, logits, batch)
        going = set(keep)
        for i, r in enumerate(rows):
            if i not in going:
                self._resolve(r)
        return keep

    def _sample(self, rows: list[_Row], logits: torch.Tensor, batch: _Batch) -> list[int]:
        tokens, toks, lps = self.policy.sample_rows(logits, range(len(rows)), [r.params for r in rows], [r.generator for r in rows])
        batch.next_ids[:, 0] = tokens
        keep = []
        for i, (r, tok, lp) in enumerate(zip(rows, toks, lps)):
            r.ids.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self.policy.version)
            r.finish = self.policy.finish_reason(r.ids, r.params)
            if r.finish is None and not r.future.cancelled():  # a stopped episode's request leaves now
                keep.append(i)
        self.policy.sampled(len(rows))  # before any finished request is resolved: counted while it runs
        return keep

    def _resolve(self, r: _Row) -> None:
        if not r.future.done():
            r.future.set_result(Generation(
                np.array(r.ids), np.array(r.logprobs), r.finish or "length", self.policy.logprob_kind,  # type: ignore[arg-type]
                {"restarts": r.restarts} if r.restarts else {}, versions=np.array(r.versions, dtype=np.int32),
            ))


@dataclass
class _Batch:
    """The running requests' KV cache, attention mask, last positions and next input ids (one row each)."""

    cache: Any
    mask: Any
    positions: Any
    next_ids: Any

    def select(self, keep: list[int]) -> _Batch:
        """Only the rows ``keep``, with the left padding they all share trimmed."""
        import torch

        index = torch.as_tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask[index]
        cut = int(torch.nonzero(mask.any(0))[0, 0]) if mask.numel() else 0
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, cut:, :]
            layer.values = layer.values[index, :, cut:, :]
        return _Batch(self.cache, mask[:, cut:], self.positions[index], self.next_ids[index])

    def join(self, other: _Batch) -> _Batch:
        """This batch's rows, then ``other``'s, left-padded to one length."""
        import torch

        width = max(self.mask.shape[1], other.mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)], 0)
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)], 0)
        return _Batch(
            self.cache,
            torch.cat([pad(self.mask, 1), pad(other.mask, 1)], 0),
            torch.cat([self.positions, other.positions], 0),
            torch.cat([self.next_ids, other.next_ids], 0),
        )


def _halt_and_join(halt: threading.Event, requests: queue.SimpleQueue, thread: threading.Thread) -> None:
    if thread.is_alive():
        halt.set()
        requests.put(None)
        thread.join()


def _fail(rows: list[_Row], err: BaseException) -> None:
    for r in rows:
        if not r.future.done():
            r.future.set_exception(err)


def _check_layers(cache: Any) -> None:
    from transformers.cache_utils import DynamicLayer

    kinds = {type(layer).__name__ for layer in getattr(cache, "layers", [None])}
    if kinds != {DynamicLayer.__name__}:
        raise UnsupportedCache(
            f"continuous batching joins KV caches of full-attention layers (DynamicLayer); this model's cache "
            f"has {sorted(kinds)}: use HFPolicy(..., continuous=False), whose batched generate calls work for it"
        )
