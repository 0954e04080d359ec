"""HFPolicy's continuous batching: requests join and leave the decode batch at every step.

A real tiny Qwen3 (random weights) on the real Qwen3 tokenizer; each request's tokens must be
those the batched ``generate`` samples for it, whenever it arrives.
"""

from __future__ import annotations

import asyncio
import threading
import numpy as np
import pytest
import torch

from tiny_qwen3 import tiny_qwen3
from tokengym.envs import ReplayEnv
from tokengym.policies import HFPolicy, SamplingParams
from tokengym.policies.batching import RequestBatcher
from tokengym.policies.continuous import UnsupportedCache
from tokengym.recorder import rollout


tiny = tiny_qwen3


@pytest.fixture(scope="module")
def policy(qwen3):
    p = HFPolicy(tiny(len(qwen3)), qwen3)
    yield p
    p.close()


CONTEXTS = [[1, 2, 3], list(range(40, 67)), [4] * 20, [7, 7], list(range(300, 311))]
PARAMS = [SamplingParams(max_tokens=m, seed=s, temperature=t) for m, s, t in
          [(5, 1, 1.0), (12, 2, 0.7), (3, 3, 1.0), (9, 4, 0.0), (7, 5, 1.0)]]


async def staggered(policy, delays):
    async def one(i):
        await asyncio.sleep(delays[i])
        return (await policy.agenerate([CONTEXTS[i]], [PARAMS[i]]))[0]

    return await asyncio.gather(*(one(i) for i in range(len(CONTEXTS))))


def test_requests_that_join_late_sample_what_they_would_alone(policy):
    batched = policy.generate(CONTEXTS, PARAMS)
    alone = [policy.generate([c], [p])[0] for c, p in zip(CONTEXTS, PARAMS)]
    steps = policy._decoder.steps if policy._decoder else 0
    joined = asyncio.run(staggered(policy, [0.0, 0.02, 0.05, 0.0, 0.1]))
    for a, b, c in zip(batched, alone, joined):
        assert a.token_ids.tolist() == b.token_ids.tolist() == c.token_ids.tolist()
        assert a.finish_reason == c.finish_reason == "length"
        np.testing.assert_allclose(a.logprobs, c.logprobs, atol=1e-5)
    decoder = policy._decoder
    assert decoder.max_batch >= 2  # requests shared decode steps
    assert decoder.steps - steps < sum(p.max_tokens for p in PARAMS)


def test_a_request_sent_while_another_decodes_joins_its_batch(policy):
    long, late = SamplingParams(max_tokens=60, seed=7), PARAMS[1]
    alone = policy.generate([CONTEXTS[1]], [late])[0]

    async def run():
        first = asyncio.ensure_future(policy.agenerate([CONTEXTS[0]], [long]))
        while policy._decoder is None or not policy._decoder.steps > steps_before:
            await asyncio.sleep(0.001)  # the first request is decoding now
        joins = policy._decoder.late_joins
        second = (await policy.agenerate([CONTEXTS[1]], [late]))[0]
        return joins, second, first.done(), (await first)[0]

    steps_before = policy._decoder.steps if policy._decoder else 0
    joins, second, first_done_before, first = asyncio.run(run())
    # It joined the running batch (not a batch of its own after the first ended), finished first,
    # and sampled what it samples alone.
    assert policy._decoder.late_joins == joins + 1 and not first_done_before
    assert second.token_ids.tolist() == alone.token_ids.tolist() and len(first.token_ids) == 60
    np.testing.assert_allclose(second.logprobs, alone.logprobs, atol=1e-5)


def test_stop_tokens_and_strings_end_a_request_inside_the_batch(policy, qwen3):
    free = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))[0].token_ids.tolist()
    text = qwen3.decode(free[:3])
    stop = text[-2:] if len(text.strip()) >= 2 else text

    async def both():
        return await policy.agenerate(
            [[1, 2, 3], [1, 2, 3], [9, 9, 9]],
            [SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(free[0],)),
             SamplingParams(max_tokens=8, temperature=0, stop_strings=(stop,)),
             SamplingParams(max_tokens=8, temperature=0)],
        )

    by_token, by_string, other = asyncio.run(both())
    assert by_token.token_ids.tolist() == free[:1] and by_token.finish_reason == "stop"
    assert by_string.finish_reason == "stop_string" and len(by_string.token_ids) <= 3
    assert other.finish_reason == "length" and len(other.token_ids) == 8


def test_a_bad_request_fails_alone(policy, qwen3):
    async def run():
        return await asyncio.gather(
            policy.agenerate([[len(qwen3) + 10**6]], SamplingParams(max_tokens=3)),  # outside the vocabulary
            policy.agenerate([[1, 2, 3]], SamplingParams(max_tokens=3, seed=1)),
            return_exceptions=True,
        )

    bad, good = asyncio.run(run())
    assert isinstance(bad, (IndexError, RuntimeError))
    assert len(good[0].token_ids) == 3  # the other request, prefilled in the same round, went on


def test_sliding_window_models_join_too_and_other_caches_are_named(qwen3):
    from transformers import DynamicCache

    from tokengym.policies.continuous import _check_layers

    sliding = tiny(len(qwen3), layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                   use_sliding_window=True)
    cont = HFPolicy(sliding, qwen3)
    try:  # the policy's own caches hold every layer in full (the mask applies the window): they join
        joined = asyncio.run(staggered(cont, [0.0, 0.01, 0.02, 0.0, 0.03]))
        for a, c in zip(cont.generate(CONTEXTS, PARAMS), joined):
            assert a.token_ids.tolist() == c.token_ids.tolist()
    finally:
        cont.close()
    # A cache built from the config keeps only the window for those layers: its rows cannot be joined.
    cache = DynamicCache(config=sliding.config)
    sliding(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{cont._cache_arg: cache})
    with pytest.raises(UnsupportedCache, match="continuous=False"):
        _check_layers(cache)


def test_without_continuous_batching_the_driver_queue_forms_the_batches(qwen3):
    plain = HFPolicy(tiny(len(qwen3)), qwen3, continuous=False)
    batcher = RequestBatcher(plain)
    assert batcher._native is None

    async def two():
        return await asyncio.gather(*(batcher.generate([1, 2, 3], SamplingParams(max_tokens=2, seed=i)) for i in range(2)))

    try:
        assert [len(g.token_ids) for g in asyncio.run(two())] == [2, 2] and batcher.max_batch == 2
    finally:
        batcher.close()


def test_close_stops_the_thread_and_a_new_request_starts_it_again(qwen3):
    p = HFPolicy(tiny(len(qwen3)), qwen3)
    asyncio.run(p.agenerate([[1, 2]], SamplingParams(max_tokens=2)))
    thread = p._decoder._thread
    assert thread in threading.enumerate() and thread.name == "tokengym-hf-decode"
    p.close()
    assert not thread.is_alive()
    assert len(asyncio.run(p.agenerate([[1, 2]], SamplingParams(max_tokens=2)))[0].token_ids) == 2
    p.close()


def test_a_cancelled_request_leaves_the_batch_and_close_can_cancel(qwen3):
    """A stopped episode's request leaves at the next step (not at its token limit), and
    ``close(cancel=True)`` fails the requests still decoding, so the thread ends at once."""
    import time

    from tokengym.policies.continuous import ContinuousDecoder, PolicyClosed

    p = HFPolicy(tiny(len(qwen3)), qwen3)
    decoder = ContinuousDecoder(p)
    long = SamplingParams(max_tokens=100_000, temperature=0.0)
    gone = decoder.submit([1, 2, 3], long)
    while decoder.steps < 3:
        time.sleep(0.01)
    assert gone.cancel()
    short = decoder.submit([4, 5], SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=60)
    assert len(short.token_ids) == 4
    time.sleep(0.2)
    idle = decoder.steps
    time.sleep(0.3)
    assert decoder.steps == idle  # no row decodes on: the cancelled one left with the next step
    held = decoder.submit([6, 7], long)
    while decoder.steps < idle + 10:
        time.sleep(0.01)
    thread = decoder._thread
    decoder.close(cancel=True)
    assert not thread.is_alive()
    with pytest.raises(PolicyClosed):
        held.result(timeout=0)


def test_the_default_driver_uses_it_and_records_the_law(policy, qwen3):
    from lawcheck import recompute_logprobs
    from tokengym.recorder import to_verl

    steps = policy._decoder.steps if policy._decoder else 0
    r = rollout(lambda: ReplayEnv(qwen3, max_turns=3), policy, episodes=4, concurrency=4,
                sampling=SamplingParams(max_tokens=6), seed=2, progress=False)
    assert r.stats.failed == 0 and policy._decoder.steps > steps
    recomputed, recorded = recompute_logprobs(policy.model, to_verl(r.trajectories))
    assert torch.max(torch.abs(recomputed - recorded)).item() < 1e-4
