"""tokengym envs inside SkyRL's generator interface, token in, token out (skyrl 0.3.0, Python 3.12).

:class:`~tokengym.recorder.integrations.skyrl_generator.TokenGymGenerator` is a SkyRL
``GeneratorInterface``; every turn goes through a SkyRL ``InferenceEngineInterface``: here
:class:`~tokengym.recorder.integrations.skyrl_generator.PolicyInferenceEngine` over ``HFPolicy``
with a tiny random Qwen3 on the real Qwen2.5 tokenizer (SkyRL's own engines need vLLM on a GPU).
The output goes through SkyRL's own ``validate_generator_output`` and its own batch layout
(``convert_prompts_responses_to_batch_tensors``), where a teacher-forced forward pass gives back the
rollout logprobs on every loss-mask token.

Runs in ``.venv-skyrl`` (``.ci/integrations.sh``; SkyRL's pydantic models need Python >= 3.12);
skipped elsewhere, unless ``TOKENGYM_REQUIRE_INTEGRATIONS=1`` makes a missing SkyRL a failure.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from tiny_qwen3 import tiny_qwen3
from tokengym.policies import HFPolicy, SamplingParams
from tokengym.recorder import rollout

try:
    from skyrl.train.generators.base import GeneratorInput, TrajectoryID

    from tokengym.recorder.integrations.skyrl_generator import PolicyInferenceEngine, TokenGymGenerator
    HAVE_SKYRL = True
except ImportError:
    if os.environ.get("TOKENGYM_REQUIRE_INTEGRATIONS") == "1" and os.environ.get("TOKENGYM_SKYRL_GENERATOR") == "1":
        raise  # CI's SkyRL venv: a SkyRL that does not import is a failure
    HAVE_SKYRL = False

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not HAVE_SKYRL, reason="skyrl 0.3.0 is not installed (.ci/integrations.sh tests it in .venv-skyrl, Python 3.12)"),
]

ENV = "tokengym/Replay-v0"
SEED = 11
N = 4


@pytest.fixture(scope="module")
def tiny(qwen25):
    return tiny_qwen3(len(qwen25))


@pytest.fixture(scope="module")
def policy(tiny, qwen25):
    p = HFPolicy(tiny, qwen25)
    yield p
    p.close()


def batch(extras) -> GeneratorInput:
    n = len(extras)
    return GeneratorInput(
        prompts=[[{"role": "user", "content": "(the env makes its own prompt)"}]] * n, env_classes=["tokengym"] * n,
        env_extras=extras, sampling_params=None, trajectory_ids=[TrajectoryID("q", i) for i in range(n)],
        batch_metadata=None,
    )  # fmt: skip


def generator(policy, qwen25, **kwargs):
    kwargs = {"env_id": ENV, "env_kwargs": {"max_turns": 3}, "max_tokens": 6, "seed": SEED, **kwargs}
    return TokenGymGenerator(PolicyInferenceEngine(policy, qwen25), qwen25, **kwargs)


@pytest.fixture(scope="module")
def played(policy, qwen25):
    """The generator's output for N seeded rows, and rollout()'s trajectories of the same episodes."""
    out = asyncio.run(generator(policy, qwen25).generate(batch([{"seed": SEED + i, "episode": i} for i in range(N)])))
    reference = rollout(
        ENV, policy, episodes=N, concurrency=2, seed=SEED, env_kwargs={"tokenizer": qwen25, "max_turns": 3},
        sampling=SamplingParams(max_tokens=6, temperature=1.0), progress=False,
    ).trajectories
    return out, reference


def test_the_rows_are_rollouts_rows_token_for_token(played):
    out, reference = played
    assert len(reference) == N and out["rollout_metrics"]["tokengym/failed"] == 0
    for i, traj in enumerate(reference):
        p = traj.prompt_len
        assert out["prompt_token_ids"][i] == traj.token_ids[:p].tolist()
        assert out["response_ids"][i] == traj.token_ids[p:].tolist()  # actions and observations, never re-encoded
        assert out["loss_masks"][i] == traj.mask[p:].tolist()
        np.testing.assert_allclose(out["rollout_logprobs"][i], np.where(traj.mask[p:] == 1, traj.logprobs[p:], 0.0), atol=1e-5)
        assert sum(out["rewards"][i]) == pytest.approx(traj.reward)  # per token; their sum is the return
        assert out["stop_reasons"][i] == traj.stop_reason
        assert out["env_metrics"][i]["turn_rewards"] == traj.turn_rewards.tolist()
        # the weight version of every response token, as the tokengym policy behind the engine stamped it
        assert traj.has_versions and out["env_metrics"][i]["versions"] == traj.versions[p:].tolist()
        assert out["env_metrics"][i]["version_span"] == traj.version_span == (0, 0)
    assert len({tuple(r) for r in out["response_ids"]}) == N  # each row sampled with its own seeds
    assert [t.to_string() for t in out["trajectory_ids"]] == [f"q_{i}" for i in range(N)]


def test_skyrls_own_checks_and_layout_keep_the_law(played, tiny, qwen25):
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
    from skyrl.train.utils.trainer_utils import validate_generator_output

    out, _ = played
    validate_generator_output(N, out)
    sequences, attention, action_mask, rewards, loss_masks, logprobs, _ = convert_prompts_responses_to_batch_tensors(
        qwen25, out["prompt_token_ids"], out["response_ids"], out["rewards"], out["loss_masks"], out["rollout_logprobs"]
    )
    R = action_mask.shape[1]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = tiny(input_ids=sequences, attention_mask=attention, position_ids=positions).logits.float()
    recomputed = torch.log_softmax(logits[:, -R - 1 : -1], -1).gather(-1, sequences[:, -R:, None])[..., 0]
    on = loss_masks.bool()
    assert int(on.sum()) == sum(sum(m) for m in out["loss_masks"]) > 0
    assert torch.max(torch.abs(recomputed[on] - logprobs[on])).item() < 1e-4
    assert rewards.sum().item() == pytest.approx(sum(sum(r) for r in out["rewards"]))


def test_a_row_that_cannot_be_played_fails_alone(policy, qwen25):
    rows = [{"seed": 1, "episode": 0}, {"env_id": "tokengym/NoSuchEnv-v0"}, {"seed": 2, "episode": 1}]
    out = asyncio.run(generator(policy, qwen25).generate(batch(rows)))
    assert out["stop_reasons"][1] == "error" and out["loss_masks"][1] == [0] and out["rewards"][1] == [0.0]
    assert "NoSuchEnv" in out["env_metrics"][1]["tokengym_error"]
    assert out["stop_reasons"][0] != "error" and out["stop_reasons"][2] != "error"
    assert out["rollout_metrics"]["tokengym/failed"] == 1
    # Without env_extras["env_id"] or the generator's env_id, the row's env class is the env id.
    unnamed = batch([{"seed": 3}, {"seed": 3}])
    unnamed["env_classes"] = [ENV, ""]
    out = asyncio.run(generator(policy, qwen25, env_id=None).generate(unnamed))
    assert out["stop_reasons"][0] != "error" and out["env_metrics"][0]["env_id"] == ENV
    assert out["env_metrics"][1]["tokengym_error"].startswith("no env")


def test_unseeded_rows_sample_freely_and_the_engine_refuses_what_it_cannot_serve(policy, qwen25):
    engine = PolicyInferenceEngine(policy, qwen25)
    out = asyncio.run(generator(policy, qwen25).generate(batch([{"seed": 5}, {"seed": 5}])))
    assert out["prompt_token_ids"][0] == out["prompt_token_ids"][1]  # one reset seed: one prompt
    with pytest.raises(NotImplementedError, match="generate"):
        engine.get_endpoint_url()
    with pytest.raises(ValueError, match="token-id prompts"):
        asyncio.run(engine.generate({"prompts": [[{"role": "user", "content": "hi"}]], "prompt_token_ids": None}))


def test_the_docs_example_runs(policy, qwen25, capsys):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- run: skyrl-generator -->\s*```python\n(.*?)```", doc, flags=re.S).group(1)
    exec(compile(block, "docs/integrations.md", "exec"), {"policy": policy, "tokenizer": qwen25})
    assert capsys.readouterr().out.split() == ["2", "0"]
