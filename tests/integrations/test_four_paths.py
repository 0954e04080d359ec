"""One test, four paths, the same rows: tokengym's ``rollout()``, verl's ``AgentLoopWorker`` running
``TokenGymAgentLoop``, TRL's ``rollout_func`` and SkyRL's generator interface running
``TokenGymGenerator`` play the same seeded episodes with the same
tiny random Qwen3 (the real Qwen3 vocabulary and template) and give the same tokens, masks,
logprobs and rewards. The env is ``tokengym/Replay-v0`` (a tool conversation replayed whatever
the model writes), so every episode has several turns and observations whatever a random model
samples.

The three libraries fit one venv only on Python 3.12 with transformers 5.8 (SkyRL 0.3.0 needs
both; verl 0.9.1 and TRL 1.16.0 accept them): ``.ci/integrations.sh skyrl`` builds it. Sampling
is greedy: TRL's rollout function keys its turn seeds by its own prompts, so only greedy
decoding makes its rows comparable to the seeded paths' (the other three agree when sampled too:
``test_verl_agent_loop.py`` and ``test_skyrl_generator.py``).
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REQUIRED = os.environ.get("TOKENGYM_REQUIRE_INTEGRATIONS") == "1" and os.environ.get("TOKENGYM_SKYRL_GENERATOR") == "1"
try:
    import skyrl  # noqa: F401
    import trl  # noqa: F401
    import verl  # noqa: F401
except ImportError:
    if REQUIRED:
        raise
    pytest.skip("verl, TRL and SkyRL together (.ci/integrations.sh tests them in .venv-skyrl)", allow_module_level=True)

from skyrl.train.generators.base import GeneratorInput  # noqa: E402
from test_verl_agent_loop import P, R, rows, run_verl, verl_world  # noqa: E402

from tokengym.envs import ReplayEnv  # noqa: E402
from tokengym.policies import HFPolicy, SamplingParams  # noqa: E402
from tokengym.recorder import rollout, to_trl, to_verl  # noqa: E402
from tokengym.recorder.integrations.skyrl_generator import PolicyInferenceEngine, TokenGymGenerator, generator_row  # noqa: E402
from tokengym.recorder.integrations.trl import trl_prompts, trl_rollout_func  # noqa: E402

pytestmark = pytest.mark.integration

ENV = "tokengym/Replay-v0"
N, TURNS, TOKENS = 3, 2, 12


def test_rollout_verl_trl_and_skyrl_give_the_same_rows(qwen3, tmp_path):
    world = verl_world(
        qwen3, tmp_path, env_id=ENV, max_turns=TURNS, max_tokens=TOKENS, overrides=["actor_rollout_ref.rollout.temperature=0"]
    )
    model = world[2]
    make = lambda: ReplayEnv(qwen3, max_turns=TURNS)  # noqa: E731
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0.0)
    extras = [{"seed": i, "episode": i} for i in range(N)]

    # 1. tokengym's own driver: the reference.
    ours = rollout(make, HFPolicy(model, qwen3), episodes=N, sampling=sampling, seed=0, progress=False).trajectories
    assert len(ours) == N and all(t.num_turns == TURNS for t in ours)  # observations between the turns

    # 2. verl's own worker, post-processing and batch.
    data, _ = run_verl(world, rows(extras))
    expected = to_verl(ours, prompt_length=P, response_length=R, pad_token_id=qwen3.pad_token_id).tensors
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(data.batch[key], expected[key]), f"verl: {key}"
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(data.batch["rollout_log_probs"][mask], expected["rollout_log_probs"][mask])
    torch.testing.assert_close(data.batch["rm_scores"].sum(-1), torch.tensor([t.reward for t in ours]))

    # 3. TRL's rollout_func, as GRPOTrainer calls it.
    func = trl_rollout_func(make, policy=HFPolicy(model, qwen3), sampling=sampling, seed=0)
    try:
        out = func(trl_prompts(N, seed=0), SimpleNamespace(args=SimpleNamespace(num_generations=1, max_completion_length=None)))
    finally:
        func.close()
    laid = to_trl(ours)
    for key in ("prompt_ids", "completion_ids", "env_mask"):
        assert [list(x) for x in out[key]] == [list(x) for x in laid[key]], f"TRL: {key}"
    for got, want in zip(out["logprobs"], laid["logprobs"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert out["env_reward"] == [t.reward for t in ours]

    # 4. SkyRL's generator interface, every turn through a SkyRL inference engine.
    generator = TokenGymGenerator(
        PolicyInferenceEngine(HFPolicy(model, qwen3), qwen3), qwen3, env_id=ENV,
        env_kwargs={"max_turns": TURNS}, sampling={"temperature": 0.0, "logprobs": 0}, max_tokens=TOKENS, seed=0,
    )  # fmt: skip
    sky = asyncio.run(generator.generate(GeneratorInput(
        prompts=[[]] * N, env_classes=["tokengym"] * N, env_extras=extras, sampling_params=None, trajectory_ids=None,
        batch_metadata=None,
    )))  # fmt: skip
    for i, traj in enumerate(ours):
        want = generator_row(traj)
        for key in ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons"):
            assert sky[key][i] == want[key], f"SkyRL: {key} of row {i}"
        np.testing.assert_allclose(sky["rollout_logprobs"][i], want["rollout_logprobs"], rtol=0, atol=1e-5)
