"""tokengym's ``rollout_func`` in real TRL 1.16.0 ``GRPOTrainer`` runs, on CPU.

Runs in its own venv (``.ci/integrations.sh`` builds ``.venv-trl``); skipped where TRL is not
installed, unless ``TOKENGYM_REQUIRE_INTEGRATIONS=1`` makes a missing TRL a failure.

The model is a tiny random Qwen3 with the real Qwen3 vocabulary; the rollout function
samples with the trainer's own model, so training is on-policy. Two runs:

- ``tokengym/Calculator-v0`` by id (the env takes the trainer's tokenizer), two training steps;
- two-turn ``ReplayEnv`` episodes from a factory, whose completions hold observation tokens:
  ``env_mask`` 0 keeps them out of TRL's loss.

A random model never solves a calculator task, so besides ``env_reward`` a toy reward
(ASCII share) gives the advantages something to work with.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental: TRL warns once per trainer

if os.environ.get("TOKENGYM_REQUIRE_INTEGRATIONS") == "1":
    import trl  # noqa: F401 -- CI's TRL run: a missing TRL is a failure
else:
    pytest.importorskip("trl", reason="TRL is not installed (.ci/integrations.sh tests it in .venv-trl)")

from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tokengym.envs import ChatRenderer, ReplayEnv  # noqa: E402
from tokengym.recorder.integrations.trl import env_reward, trl_dataset, trl_prompts, trl_rollout_func  # noqa: E402

pytestmark = pytest.mark.integration

G = 2  # num_generations
PROMPTS_PER_STEP = 2


def tiny_model(tokenizer) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def grpo_args(tmp_path, **overrides) -> GRPOConfig:
    args = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, seed=0,
        per_device_train_batch_size=G * PROMPTS_PER_STEP, num_generations=G,
        max_completion_length=24, max_steps=2, learning_rate=1e-2,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
    )
    args.update(overrides)
    return GRPOConfig(**args)


def ascii_share(completions, **kwargs) -> list[float]:
    """A toy reward a random model earns by chance: the share of ASCII characters."""
    return [sum(c.isascii() for c in text) / max(len(text), 1) for text in completions]


class Spy:
    """Wraps the rollout function and the trainer's loss to see what TRL does with the rollout."""

    def __init__(self, rollout):
        self.rollout = rollout
        self.prompts: list[list] = []
        self.outputs: list[dict] = []
        self.losses: list[dict] = []

    def __call__(self, prompts, trainer):
        self.prompts.append(list(prompts))
        out = self.rollout(prompts, trainer)
        self.outputs.append(out)
        return out

    def attach(self, trainer):
        """Look inside the first training step (each look costs forward passes over the whole vocabulary)."""
        compute_loss = trainer.compute_loss

        def spied(model, inputs, *args, **kwargs):
            if self.losses:
                return compute_loss(model, inputs, *args, **kwargs)
            with torch.no_grad():
                found = self.inspect(trainer, model, inputs)
            loss = compute_loss(model, inputs, *args, **kwargs)
            found["loss"] = loss.item()  # TRL's own loss: old logprobs = the current ones
            self.losses.append(found)
            return loss

        trainer.compute_loss = spied

    @staticmethod
    def inspect(trainer, model, inputs) -> dict:
        """TRL's own view of a batch: its loss mask, its logprobs, and its loss under perturbations."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], dim=1), attention, completion_ids.size(1)
        )
        loss_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        found = {"loss_mask": loss_mask.clone(), "logps": logps, "inputs": dict(inputs)}
        # The loss with junk old logprobs on every mask-0 position, then also one policy token's moved.
        junk = logps.clone()
        junk[loss_mask == 0] = 5.0
        found["loss_junk_masked"] = trainer._compute_loss(model, {**inputs, "old_per_token_logps": junk}).item()
        trained = (loss_mask == 1) & (inputs["advantages"].reshape(-1, 1) != 0)
        if trained.any():  # a policy token of an episode with a non-zero advantage
            row, col = trained.nonzero()[0].tolist()
            junk[row, col] -= 1.0
            found["loss_moved"] = trainer._compute_loss(model, {**inputs, "old_per_token_logps": junk}).item()
        return found


def check_on_policy_and_masks(spy: Spy) -> None:
    """TRL's loss mask is tokengym's env_mask, and TRL's logprobs are the rollout's (on-policy).

    TRL shuffles a generation batch before it trains on it, so rows are matched by their tokens.
    """
    assert len(spy.losses) == 1
    for out, seen in zip(spy.outputs, spy.losses):
        by_tokens = {
            (tuple(p), tuple(c)): (m, lp)
            for p, c, m, lp in zip(out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"])
        }
        inputs = seen["inputs"]
        for row in range(seen["loss_mask"].shape[0]):
            prompt = inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].tolist()
            completion = inputs["completion_ids"][row][inputs["completion_mask"][row].bool()].tolist()
            env_mask, logprobs = by_tokens[(tuple(prompt), tuple(completion))]
            n = len(completion)
            loss_mask = seen["loss_mask"][row]
            assert loss_mask[:n].tolist() == list(env_mask) and not loss_mask[n:].any()
            trained = loss_mask[:n].bool()
            diff = (seen["logps"][row, :n] - torch.tensor(logprobs))[trained].abs().max().item()
            assert diff < 1e-4, f"TRL's recomputed logprobs differ from the rollout's by {diff}"
        # Mask-0 positions are out of the loss; a policy token is in it.
        assert seen["loss_junk_masked"] == pytest.approx(seen["loss"], abs=1e-7)
        assert "loss_moved" in seen, "no episode had a non-zero advantage"
        assert abs(seen["loss_moved"] - seen["loss"]) > 1e-5


# ------------------------------------------------------------------- tests
def test_trl_prompts_name_their_task():
    assert trl_prompts(2, seed=5) == ['{"seed": 5}', '{"seed": 6}']
    assert trl_prompts(1, options={"difficulty": 2}) == ['{"options": {"difficulty": 2}, "seed": 0}']
    assert trl_dataset(3)["prompt"] == trl_prompts(3)


def test_grpo_trainer_two_steps_on_calculator(qwen3, tmp_path):
    model = tiny_model(qwen3)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    spy = Spy(trl_rollout_func("tokengym/Calculator-v0", difficulty=1))
    trainer = GRPOTrainer(
        model=model, reward_funcs=[env_reward, ascii_share], args=grpo_args(tmp_path),
        train_dataset=trl_dataset(8), processing_class=qwen3, rollout_func=spy,
    )
    spy.attach(trainer)
    trainer.train()

    assert trainer.state.global_step == 2 and len(spy.prompts) == 2
    for prompts, out in zip(spy.prompts, spy.outputs):
        # TRL hands over each prompt already repeated num_generations times, in a row ...
        assert len(prompts) == G * PROMPTS_PER_STEP
        assert all(prompts[k] == prompts[k - k % G] for k in range(len(prompts)))
        # ... and gets one completion per entry: the copies of a prompt play one task.
        assert all(len(v) == len(prompts) for v in out.values())
        assert out["task_id"][0] == out["task_id"][1] != out["task_id"][2] == out["task_id"][3]
        assert all(len(c) <= 24 for c in out["completion_ids"])  # max_completion_length
        assert all(len(c) == len(m) == len(lp) for c, m, lp in zip(out["completion_ids"], out["env_mask"], out["logprobs"]))
    check_on_policy_and_masks(spy)
    logged = trainer.state.log_history[0]
    assert "rewards/env_reward/mean" in logged and "rewards/ascii_share/mean" in logged
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters()), "the steps changed nothing"
    # The trainer is back in training mode after sampling in eval mode.
    assert model.training


class AsciiReward(gym.Wrapper):
    """The env's own reward: the share of a turn's tokens that decode to ASCII."""

    def __init__(self, env, ascii_token):
        super().__init__(env)
        self.ascii_token = ascii_token

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        return obs, float(self.ascii_token[np.asarray(action)].mean()), terminated, truncated, info


def test_env_mask_keeps_observations_out_of_the_loss(qwen3, tmp_path):
    renderer = ChatRenderer(qwen3)
    ascii_token = np.array([qwen3.decode([i]).isascii() for i in range(len(qwen3))])
    rollout = trl_rollout_func(
        lambda: AsciiReward(ReplayEnv(renderer, max_turns=2), ascii_token), max_tokens_per_turn=6,
        max_completion_length=512,
    )
    spy = Spy(rollout)
    model = tiny_model(qwen3)
    trainer = GRPOTrainer(
        model=model, reward_funcs=env_reward, args=grpo_args(tmp_path, max_steps=1, max_completion_length=512),
        train_dataset=trl_dataset(4), processing_class=qwen3, rollout_func=spy,
    )
    spy.attach(trainer)
    trainer.train()

    out = spy.outputs[0]
    trajs = rollout.last_trajectories
    assert [t.num_turns for t in trajs] == [2] * len(trajs)
    for t, completion, env_mask in zip(trajs, out["completion_ids"], out["env_mask"]):
        # The completion is the whole episode after the prompt: action, observation, action.
        assert completion == t.token_ids[t.prompt_len :].tolist()
        first, obs, second = (len(s) for s in t.segments[1:])
        assert env_mask == [1] * first + [0] * obs + [1] * second and obs > 0
    assert len({round(r, 6) for r in out["env_reward"]}) > 1  # the env's reward varies: real advantages
    check_on_policy_and_masks(spy)


def test_the_docs_trl_example_runs(qwen3, tmp_path, monkeypatch):
    """The docs' block as written, with a tiny model and a config cut to one CPU step."""
    import trl

    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- run: trl -->\s*```python\n(.*?)```", doc, flags=re.S).group(1)

    def small_config(**kwargs):
        kwargs.update(output_dir=str(tmp_path), max_steps=1, max_completion_length=16, num_generations=2)
        kwargs.update(per_device_train_batch_size=2, use_cpu=True, bf16=False, report_to=[], save_strategy="no")
        return GRPOConfig(**kwargs)

    monkeypatch.setattr(trl, "GRPOConfig", small_config)
    scope = {"model": tiny_model(qwen3), "tokenizer": qwen3}
    exec(compile(block, "docs/integrations.md", "exec"), scope)
    assert scope["trainer"].state.global_step == 1


def test_the_rollout_func_plays_the_rows_tokengyms_rollout_plays(qwen3):
    """The same episodes through TRL's rollout_func and through tokengym's own rollout() give the
    same rows, token for token (greedy: the two paths key their sampling seeds differently)."""
    from types import SimpleNamespace

    from tokengym.envs import CalculatorEnv
    from tokengym.policies import HFPolicy, SamplingParams
    from tokengym.recorder import rollout, to_trl

    model = tiny_model(qwen3).eval()
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    make = lambda: CalculatorEnv(qwen3, max_turns=2)  # noqa: E731
    func = trl_rollout_func(make, policy=HFPolicy(model, qwen3), sampling=sampling, seed=0)
    trainer = SimpleNamespace(args=SimpleNamespace(num_generations=1, max_completion_length=None))
    out = func(trl_prompts(3, seed=0), trainer)
    ours = rollout(make, HFPolicy(model, qwen3), episodes=3, sampling=sampling, seed=0, progress=False).trajectories
    expected = to_trl(ours)
    for key in ("prompt_ids", "completion_ids", "env_mask"):
        assert [list(x) for x in out[key]] == [list(x) for x in expected[key]], key
    for got, want in zip(out["logprobs"], expected["logprobs"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert out["env_reward"] == [t.reward for t in ours]
    func.close()
