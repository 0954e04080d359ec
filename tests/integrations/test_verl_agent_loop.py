"""tokengym envs inside verl's own trainer: ``TokenGymAgentLoop`` run by verl 0.9.1's real
``AgentLoopWorker`` (its config composed from verl's own ``ppo_trainer.yaml``, the loop found
through an ``agent_loop_config_path`` YAML entry, instantiated by hydra, post-processed and
batched by verl's own code into a ``DataProto``).

The server speaks verl's ``server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``
protocol and is backed by a real model: a tiny random Qwen3 (the real Qwen3 vocabulary and
template) through ``HFPolicy``. The same seeded episodes through tokengym's own ``rollout()``
give the same rows, tensor for tensor.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("TOKENGYM_REQUIRE_INTEGRATIONS") == "1":
    import verl  # CI's verl run: a missing verl is a failure
else:
    verl = pytest.importorskip("verl", reason="verl is not installed (.ci/integrations.sh tests it in .venv-verl)")

from hydra import compose, initialize_config_dir  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.utils.torch_functional import logprobs_from_logits  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from tokengym.envs import CalculatorEnv  # noqa: E402
from tokengym.policies import HFPolicy, SamplingParams  # noqa: E402
from tokengym.recorder import rollout, to_verl  # noqa: E402

pytestmark = pytest.mark.integration

N = 4
P, R = 512, 256  # verl's prompt_length and response_length
MAX_TOKENS = 24  # per turn
MAX_TURNS = 2


class HFServer:
    """verl's server-manager protocol (``generate`` -> ``TokenOutput``) over a real model."""

    def __init__(self, policy: HFPolicy) -> None:
        self.policy = policy
        self.lock = asyncio.Lock()
        self.calls: list[tuple[str, int]] = []  # (request id, prompt length)
        self.sampling: list[dict] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_):
        sp = dict(sampling_params)
        self.calls.append((request_id, len(prompt_ids)))
        self.sampling.append(sp)
        assert sp.pop("ignore_eos") is True and sp.get("include_stop_str_in_output", True) is True
        params = SamplingParams(
            max_tokens=sp["max_tokens"], temperature=sp["temperature"], top_p=sp["top_p"], top_k=max(sp["top_k"], 0),
            seed=sp.get("seed"), stop_token_ids=tuple(sp["stop_token_ids"]), stop_strings=tuple(sp.get("stop", ())),
        )  # fmt: skip
        async with self.lock:  # one request at a time, as rollout(concurrency=1) below
            (gen,) = await asyncio.to_thread(self.policy.generate, [prompt_ids], params)
        lps = gen.logprobs.tolist() if sp.get("logprobs") else None
        # the weights' version as verl's own server manager (llm_server.py) reports it for a call
        v = int(gen.versions[0])
        steps = {"global_steps": v, "min_global_steps": v, "max_global_steps": v}
        return TokenOutput(token_ids=gen.token_ids.tolist(), log_probs=lps, stop_reason="completed", extra_fields=steps)


def verl_world(
    tokenizer, folder: Path, *, env_id: str = "tokengym/Calculator-v0", max_turns: int = MAX_TURNS,
    max_tokens: int = MAX_TOKENS, overrides=(),
):
    """(model folder, verl config, tiny model) with the loop registered through a YAML entry."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loops = folder / "agent_loops.yaml"
    loops.write_text(
        "- name: tokengym\n"
        "  _target_: tokengym.recorder.integrations.verl.TokenGymAgentLoop\n"
        f"  env_id: {env_id}\n"
        f"  env_kwargs: {{max_turns: {max_turns}}}\n"
        f"  max_tokens: {max_tokens}\n"
    )
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={folder}",
            "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.prompt_length={P}",
            f"actor_rollout_ref.rollout.response_length={R}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            *overrides,
        ])  # fmt: skip
    return folder, cfg, model


@pytest.fixture(scope="module")
def world(qwen3, tmp_path_factory):
    return verl_world(qwen3, tmp_path_factory.mktemp("tiny-qwen3"))


def rows(extra_infos: list[dict]) -> DataProto:
    n = len(extra_infos)
    raw_prompt = np.empty(n, dtype=object)  # verl's dataset column (the env makes its own prompt)
    raw_prompt[:] = [[] for _ in range(n)]
    return DataProto.from_dict(non_tensors={
        "agent_name": np.array(["tokengym"] * n, dtype=object),
        "raw_prompt": raw_prompt,
        "extra_info": np.array(extra_infos, dtype=object),
        "index": np.arange(n),
    })  # fmt: skip


def run_verl(world, batch: DataProto) -> tuple[DataProto, HFServer]:
    _, cfg, model = world
    worker = AgentLoopWorker(cfg, llm_client=None)  # verl's own worker, from verl's own config
    server = HFServer(HFPolicy(model, worker.tokenizer))
    worker.llm_client = server
    return asyncio.run(worker.generate_sequences(batch)), server


@pytest.fixture(scope="module")
def played(world):
    return run_verl(world, rows([{"seed": i, "episode": i} for i in range(N)]))


def test_verl_plays_tokengym_episodes_in_its_own_worker_as_tokengym_does(world, played, qwen3):
    data, server = played
    _, _, model = world
    ours = rollout(
        lambda: CalculatorEnv(qwen3, max_turns=MAX_TURNS), HFPolicy(model, qwen3), episodes=N, concurrency=1,
        sampling=SamplingParams(max_tokens=MAX_TOKENS), seed=0, progress=False,
    ).trajectories  # fmt: skip
    assert len(data) == N and all(t.num_turns >= 1 for t in ours)
    expected = to_verl(ours, prompt_length=P, response_length=R, pad_token_id=qwen3.pad_token_id).tensors
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(data.batch[key], expected[key]), key
    mask = data.batch["response_mask"].bool()
    torch.testing.assert_close(data.batch["rollout_log_probs"][mask], expected["rollout_log_probs"][mask])
    assert (data.batch["rollout_log_probs"][~mask] == 0).all()
    # The episode's return is verl's score, on the row's last token; each turn's in turn_scores.
    torch.testing.assert_close(data.batch["rm_scores"].sum(-1), torch.tensor([t.reward for t in ours]))
    assert [list(s) for s in data.non_tensor_batch["turn_scores"]] == [t.turn_rewards.tolist() for t in ours]
    assert list(data.non_tensor_batch["stop_reason"]) == [t.stop_reason for t in ours]
    assert list(data.non_tensor_batch["tokengym_error"]) == [None] * N
    # the version verl's server manager reports (global_steps) is on every policy token, as rollout's HFPolicy stamps it
    for i, t in enumerate(ours):
        assert list(data.non_tensor_batch["versions"][i]) == t.versions[t.prompt_len :][: R].tolist()
        assert t.version_span == (0, 0) and data.non_tensor_batch["max_global_steps"][i] == 0
    assert list(data.non_tensor_batch["min_global_steps"]) == [0] * N
    assert list(data.non_tensor_batch["__num_turns__"]) == [len(t.segments) for t in ours]
    # to_verl writes verl's own names too, with the same values
    laid = to_verl(ours).non_tensors
    assert laid["__num_turns__"].tolist() == data.non_tensor_batch["__num_turns__"].tolist()
    assert laid["turn_scores"].tolist() == [list(s) for s in data.non_tensor_batch["turn_scores"]]
    # One request id per episode, kept across its turns; each turn's prompt is the whole stream so far.
    ids = [rid for rid, _ in server.calls]
    assert len(set(ids)) == N and len(ids) == sum(t.num_turns for t in ours)
    assert all(sp["max_tokens"] <= MAX_TOKENS and sp["stop_token_ids"] for sp in server.sampling)


def test_the_rollout_logprobs_are_the_trainers_on_the_response_mask(world, played):
    data, _ = played
    _, _, model = world
    batch = data.batch
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).last_hidden_state
        logits = model.lm_head(hidden[:, -R - 1 : -1]).float()
    recomputed = logprobs_from_logits(logits, batch["responses"])
    mask = batch["response_mask"].bool()
    diff = (recomputed - batch["rollout_log_probs"])[mask].abs().max().item()
    assert diff < 1e-4, diff


def test_a_row_that_cannot_be_played_fails_alone_and_says_why(world):
    data, _ = run_verl(world, rows([
        {"seed": 0, "episode": 0},
        {"seed": 1, "env_id": "tokengym/NoSuchEnv-v0"},
        {"seed": 2, "options": {"task": 5}},  # a task that is not one: the env's reset raises
    ]))  # fmt: skip
    errors = list(data.non_tensor_batch["tokengym_error"])
    assert errors[0] is None and data.batch["attention_mask"][0].sum() > 0
    assert "cannot make 'tokengym/NoSuchEnv-v0'" in errors[1]
    assert "reset failed" in errors[2] and "TypeError" in errors[2]
    for i in (1, 2):
        assert data.batch["attention_mask"][i].sum() == 0 and data.batch["rm_scores"][i].sum() == 0
        assert data.non_tensor_batch["stop_reason"][i] == "error"


def test_a_response_over_verls_length_is_cut_and_said(world, qwen3):
    from tokengym.recorder.integrations.verl import agent_loop_output

    _, _, model = world
    (traj,) = rollout(
        lambda: CalculatorEnv(qwen3, max_turns=MAX_TURNS), HFPolicy(model, qwen3), episodes=1,
        sampling=SamplingParams(max_tokens=MAX_TOKENS), progress=False,
    ).trajectories  # fmt: skip
    n = len(traj) - traj.prompt_len
    out = agent_loop_output(traj, response_length=n - 3, cut=True)
    assert out.extra_fields["response_truncated"] is True
    assert out.response_ids == traj.token_ids[traj.prompt_len : traj.prompt_len + n - 3].tolist()
    assert len(out.response_mask) == n - 3 and out.reward_score == traj.reward
    assert agent_loop_output(traj, response_length=n, cut=True).extra_fields["response_truncated"] is False
    with pytest.raises(ValueError, match="over verl's response_length"):
        agent_loop_output(traj, response_length=n - 1, cut=False)
