"""history="deploy": every turn's context is what the chat template renders, as when deployed.

Real templates: Qwen3's drops the reasoning of earlier turns (so each new user turn starts a new
context), Qwen2.5's is prefix-stable (no new context). A real tiny Qwen3 through ``HFPolicy``
checks the logprob law on every row; the real store keeps the rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokengym.envs import ReplayEnv
from tokengym.policies import HFPolicy, SamplingParams, ScriptedPolicy
from tokengym.recorder import TrajectoryWriter, read_trajectories, rollout, summary_table, to_trl, to_verl
from tokengym.recorder.integrations.trl import trl_prompts, trl_rollout_func
from tokengym.recorder.wrapper import RecordEpisodes

from lawcheck import recompute_logprobs
from tiny_qwen3 import tiny_qwen3

CHAT = {"messages": [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8"},
], "tools": []}
THOUGHT = "<think>\nAdd them.\n</think>\n\nThe answer."
# ChatML that renders the system prompt with the last user message, as Mistral's templates do:
# every new user message rewrites the context before it, whatever the model said.
SYSTEM_LAST = (
    "{%- set ns = namespace(sys='', last=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.sys = m.content -%}{%- endif -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_start|>user\n{% if loop.index0 == ns.last and ns.sys %}{{ ns.sys }}\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' -%}<|im_start|>assistant\n{{ m.content }}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def reasoning_policy(tok):
    return ScriptedPolicy(lambda ctx: THOUGHT, tok, end_ids=[tok.convert_tokens_to_ids("<|im_end|>")])


def test_qwen3_drops_earlier_reasoning_so_each_user_turn_is_a_new_context(qwen3):
    env = RecordEpisodes(ReplayEnv(qwen3, CHAT, history="deploy"))
    obs, _ = env.reset(seed=0)
    policy = reasoning_policy(qwen3)
    messages = CHAT["messages"][:2]
    infos, done = [], False
    while not done:
        action = policy.generate([obs], SamplingParams())[0].token_ids
        obs, _, term, trunc, info = env.step(action)
        infos.append(info)
        done = term or trunc
        messages = messages + [{"role": "assistant", "content": THOUGHT}]
        if not done:
            messages = messages + [CHAT["messages"][len(messages)]]
            # the whole observation is what the template renders for the conversation so far
            assert info["context_reset"] is True
            assert obs.tolist() == qwen3.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
    rows = env.trajectories
    assert [r.metadata["sequence"] for r in rows] == [0, 1, 2] and {r.metadata["sequences"] for r in rows} == {3}
    assert [r.first_turn for r in rows] == [0, 1, 2] and [r.num_turns for r in rows] == [1, 1, 1]
    assert [r.stop_reason for r in rows] == ["context_reset", "context_reset", "done"]
    assert info["sequences"] == rows and info["trajectory"] is rows[-1]
    # Earlier reasoning is gone from the later contexts: that is what a deployed model is given.
    assert "Add them." not in qwen3.decode(rows[2].token_ids[: rows[2].prompt_len].tolist())
    # Each row is a training row of its own: one per sequence in every layout.
    assert len(to_verl(rows).tensors["responses"]) == 3 and len(to_trl(rows)["completion_ids"]) == 3
    for r in rows:
        assert r.context(r.first_turn).tolist() == r.token_ids[: r.prompt_len].tolist()


def test_a_prefix_stable_template_keeps_one_sequence_identical_to_keep_mode(qwen25):
    policy = ScriptedPolicy(lambda ctx: "The answer.", qwen25, end_ids=[qwen25.convert_tokens_to_ids("<|im_end|>")])
    runs = {}
    for history in ("keep", "deploy"):
        r = rollout(lambda: ReplayEnv(qwen25, CHAT, history=history), policy, episodes=2, seed=1, progress=False)
        runs[history] = r
    assert [t.token_ids.tolist() for t in runs["keep"].trajectories] == \
        [t.token_ids.tolist() for t in runs["deploy"].trajectories]
    assert runs["deploy"].stats.context_resets == 0 and "sequence" not in runs["deploy"].trajectories[0].metadata


def test_the_law_holds_on_every_row_with_a_real_model(qwen3, tmp_path):
    model = tiny_qwen3(len(qwen3))
    policy = HFPolicy(model, qwen3)
    try:
        with TrajectoryWriter(tmp_path / "s", tokenizer=qwen3) as writer:
            r = rollout(lambda: ReplayEnv(qwen3, CHAT, history="deploy", chat_template=SYSTEM_LAST), policy,
                        episodes=3, concurrency=3,
                        sampling=SamplingParams(max_tokens=6), seed=4, progress=False, on_episode=writer.write)
    finally:
        policy.close()
    rows = r.trajectories
    assert r.stats.episodes == 3 and r.stats.failed == 0 and len(rows) == 3 + r.stats.context_resets
    # The system prompt moves to each new user message: every turn after the first is a new context.
    assert r.stats.context_resets == 6 and "new contexts mid-episode" in summary_table(r.stats)
    assert [(t.metadata["episode"], t.metadata["sequence"]) for t in rows] == [(e, k) for e in range(3) for k in range(3)]
    recomputed, recorded = recompute_logprobs(model, to_verl(rows))
    assert recomputed.numel() == sum(int(t.mask.sum()) for t in rows)
    assert torch.max(torch.abs(recomputed - recorded)).item() < 1e-4
    # The store holds the rows in the order episodes finished (each episode's rows together, in order);
    # the result sorts them by episode.
    stored = list(read_trajectories(tmp_path / "s"))
    assert [t.metadata["sequence"] for t in stored] == [0, 1, 2] * 3
    by_row = lambda t: (t.metadata["episode"], t.metadata["sequence"])  # noqa: E731
    assert [t.to_dict() for t in sorted(stored, key=by_row)] == [t.to_dict() for t in rows]
    returns = [sum(t.reward for t in rows if t.metadata["episode"] == e) for e in range(3)]
    assert np.isclose(r.stats.mean_reward, np.mean(returns))  # an episode counts once, its rows' rewards summed


def test_trl_refuses_an_episode_of_several_sequences(qwen3):
    from types import SimpleNamespace

    rollout_fn = trl_rollout_func(lambda: ReplayEnv(qwen3, CHAT, history="deploy"), policy=reasoning_policy(qwen3))
    trainer = SimpleNamespace(args=SimpleNamespace(max_completion_length=512, seed=0, temperature=1.0, top_p=1.0, top_k=0),
                              processing_class=qwen3)
    with pytest.raises(RuntimeError, match="history='keep' with TRL"):
        rollout_fn(trl_prompts(1), trainer)


def test_bad_history_is_named(qwen3):
    with pytest.raises(ValueError, match="'keep' or 'deploy'"):
        ReplayEnv(qwen3, CHAT, history="deployed")


@pytest.mark.parametrize("fam", __import__("families").FAMILIES, ids=lambda f: f.name)
def test_every_family_runs_in_deploy_mode_with_the_law_per_row(fam):
    """Each family on its real tokenizer: deploy mode gives the template's render of the conversation
    as each new context (none on a prefix-stable template), and a real model's rows keep the law."""
    from families import tokenizer_for

    tok = tokenizer_for(fam)

    def env():
        return ReplayEnv(tok, CHAT, history="deploy", chat_template=fam.chat_template,
                         template_kwargs=dict(fam.template_kwargs), require_tools_in_prompt=False)

    # Reasoning, as these models write it: what the template drops from earlier turns.
    e = env()
    assert e.renderer.turn_end_ids
    think = ScriptedPolicy(lambda ctx: THOUGHT, tok, end_ids=list(e.renderer.turn_end_ids))
    scripted = rollout(env, think, episodes=1, seed=0, progress=False)
    rows = scripted.trajectories
    assert scripted.stats.failed == 0, scripted.stats.errors
    for row in rows[1:]:  # a new context is the render of the conversation so far, as deployed
        messages = e.transcript["messages"][: 2 * row.first_turn + 2]
        messages = [*messages[:2], *[m if m["role"] != "assistant" else {"role": "assistant", "content": THOUGHT}
                                     for m in messages[2:]]]
        assert row.token_ids[: row.prompt_len].tolist() == e.renderer.prompt(messages, None, deployed=True).ids
    if fam.prefix_stable and not fam.think_text_dropped:
        assert scripted.stats.context_resets == 0 and len(rows) == 1
    elif fam.think_text_dropped or fam.non_prefix_stable_cause.startswith(("reasoning dropped", "system prompt")):
        assert scripted.stats.context_resets >= 1
    # A real (tiny, random) model: the law on every row.
    model = tiny_qwen3(len(tok))
    policy = HFPolicy(model, tok)
    try:
        r = rollout(env, policy, episodes=2, concurrency=2, sampling=SamplingParams(max_tokens=5), seed=1, progress=False)
    finally:
        policy.close()
    assert r.stats.failed == 0, r.stats.errors
    recomputed, recorded = recompute_logprobs(model, to_verl(r.trajectories))
    assert recomputed.numel() == sum(int(t.mask.sum()) for t in r.trajectories) > 0
    assert torch.max(torch.abs(recomputed - recorded)).item() < 1e-4
    print(f"{fam.name}: {len(r.trajectories)} rows for 2 episodes ({r.stats.context_resets} new contexts), "
          f"scripted reasoning: {scripted.stats.context_resets} new contexts")


REAL = ["openai-gpt-oss-120b", "GLM-4.6", "google-gemma-4-31B-it", "moonshotai-Kimi-K2", "deepseek-ai-DeepSeek-V3.1"]


@pytest.mark.parametrize("name", REAL)
def test_real_templates_keep_the_law_on_every_row_in_deploy_mode(name):
    """Templates of the corpus whose turns end in new ways (gpt-oss's <|call|>/<|return|>, GLM's
    role tokens, Gemma 4's results inside the turn): a real (tiny, random) model in deploy mode on
    the matrix's tool conversation; every row's recomputed logprobs are the sampler's."""
    from tokengym.envs import template_corpus as tc
    from tokengym.envs.template_matrix import TOOL_CHAT

    tok, _ = tc.corpus_tokenizer(name)
    tools = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
    model = tiny_qwen3(len(tok))
    policy = HFPolicy(model, tok)
    try:
        shown = name != "deepseek-ai-DeepSeek-V3.1"  # its template never renders tools: the system message describes them
        r = rollout(lambda: ReplayEnv(tok, {"messages": TOOL_CHAT, "tools": tools}, history="deploy", require_tools_in_prompt=shown), policy,
                    episodes=2, concurrency=2, sampling=SamplingParams(max_tokens=5), seed=3, progress=False)
    finally:
        policy.close()
    assert r.stats.failed == 0, r.stats.errors
    rows = r.trajectories
    recomputed, recorded = recompute_logprobs(model, to_verl(rows))
    assert recomputed.numel() == sum(int(t.mask.sum()) for t in rows) > 0
    assert torch.max(torch.abs(recomputed - recorded)).item() < 1e-4
