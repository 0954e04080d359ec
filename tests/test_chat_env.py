"""ChatEnv and ReplayEnv: the gymnasium contract, limits, bad actions, conformance."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env

import tokengym.envs
from tokengym.envs import ChatEnv, ConformanceError, EnvResponse, Prompt, ReplayEnv


class Echo(ChatEnv):
    """Answers every assistant turn with a user message; done after ``rounds`` turns."""

    def __init__(self, tokenizer, rounds: int = 3, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.rounds = rounds

    def make_prompt(self, options):
        n = int(self.np_random.integers(100))
        return Prompt([{"role": "user", "content": f"Say a number above {n}."}], task={"n": n})

    def respond(self, turn):
        if turn.turn + 1 >= self.rounds:
            return EnvResponse(reward=1.0, done=True)
        return EnvResponse([{"role": "user", "content": f"You said: {turn.text}"}], reward=0.5)


def play(env, actions_for):
    """Run an episode; return the stream, and each action's context as it was when chosen."""
    obs, _ = env.reset(seed=1)
    stream = list(obs)
    contexts, infos = [], []
    done = False
    while not done:
        action = actions_for(env)
        contexts.append(list(stream))
        obs, _, term, trunc, info = env.step(action)
        stream += list(action) + list(obs)
        infos.append(info)
        done = term or trunc
    return stream, contexts, infos


@pytest.mark.parametrize("env_id", tokengym.envs.registered_envs())
def test_check_env_on_every_registered_env(env_id, tokenizer):
    from gymnasium.envs.registration import load_env_creator

    if getattr(load_env_creator(gym.spec(env_id).entry_point), "needs_vision", False):
        from tokengym.envs.template_corpus import corpus_tokenizer

        with pytest.raises(ValueError, match="needs a chat template that (renders|writes one) image"):
            gym.make(env_id, tokenizer=tokenizer)  # a text template is refused when the env is built
        tokenizer, _ = corpus_tokenizer("Qwen3.5-4B")  # a template that renders image parts
    env = gym.make(env_id, tokenizer=tokenizer)
    check_env(env.unwrapped)
    env.close()


def test_make_accepts_a_pinned_name():
    env = gym.make("tokengym/Replay-v0", tokenizer="qwen2.5")
    obs, info = env.reset(seed=0)
    assert obs.dtype == np.int64 and obs.ndim == 1 and len(obs) == info["num_tokens"]
    assert env.observation_space.contains(obs)


def test_replay_reproduces_the_template_token_for_token_on_qwen25(qwen25):
    env = ReplayEnv(qwen25, conformance="strict")
    stream, _, infos = play(env, lambda e: e.reference_action())
    t = env.transcript
    full = qwen25.apply_chat_template(t["messages"], tools=t["tools"], tokenize=True, return_dict=False)
    assert stream == full[: len(stream)]
    assert qwen25.decode(full[len(stream) :]) == "\n"  # the glue after the final <|im_end|>
    assert [i["conformance"].status for i in infos] == ["ok"] * 5


def test_replay_on_qwen3_reports_reasoning_drop_as_known(qwen3):
    env = ReplayEnv(qwen3, conformance="strict")
    stream, _, infos = play(env, lambda e: e.reference_action())
    statuses = [i["conformance"].status for i in infos]
    assert statuses[:2] == ["ok", "ok"]  # prefix-stable until the user's follow-up
    assert set(statuses[2:]) == {"known"}
    assert "reasoning_dropped" in infos[2]["conformance"].behaviours
    assert infos[2]["conformance"].affected_turns == (0, 1, 2)
    # Reasoning of earlier turns is in the stream (token-faithful) but not in a re-render.
    t = env.transcript
    full = qwen3.apply_chat_template(t["messages"], tools=t["tools"], tokenize=True, return_dict=False)
    text = qwen3.decode(stream)
    assert "I need the weather for both cities" in text
    assert "I need the weather for both cities" not in qwen3.decode(full)
    # Wherever the template is prefix-stable (up to the first dropped block) the tokens agree.
    first_think = stream.index(qwen3.convert_tokens_to_ids("<think>"))
    assert stream[:first_think] == full[:first_think]


def test_contexts_are_prefixes_and_info_is_complete(tokenizer):
    env = Echo(tokenizer, rounds=3)
    reply = env.renderer.encode("I say 101.") + list(env.renderer.turn_end_ids)
    stream, contexts, infos = play(env, lambda e: reply)
    for k, ctx in enumerate(contexts):
        assert stream[: len(ctx)] == ctx
        assert stream[len(ctx) : len(ctx) + len(reply)] == reply
    first = infos[0]
    assert first["assistant"] == {"role": "assistant", "content": "I say 101."}
    assert first["messages"] == [{"role": "user", "content": "You said: I say 101."}]
    assert first["closed_by"] == "end_of_turn"
    assert first["num_tokens"] == len(contexts[1])
    assert infos[-1]["stop_reason"] == "done"
    assert [i["turn"] for i in infos] == [0, 1, 2]
    assert all(i["conformance"].status == "ok" for i in infos[:-1])
    last = infos[-1]["conformance"]
    if tokenizer.name_or_path.endswith("qwen3"):  # a final turn without <think> gets an empty block
        assert last.status == "known" and last.behaviours == ("empty_think_added",)
    else:
        assert last.status == "ok"


@pytest.mark.parametrize(
    "action, match",
    [
        (np.array([1.0, 2.0]), "integer"),
        (np.array([[1, 2]]), "1-D"),
        (np.array([], dtype=np.int64), "empty"),
        ([5, -1], "outside the vocabulary"),
        ([10**7], "outside the vocabulary"),
        (["a"], "integer"),
        (np.array([True]), "integer"),
        ([[1], [2, 3]], "1-D sequence"),
        (9707, r"a single token id \(9707\), not a sequence of them: pass \[9707\]"),
        (np.int64(9707), r"a single token id \(9707\).*pass \[9707\]"),
    ],
)
def test_bad_actions_raise_value_error(qwen25, action, match):
    env = Echo(qwen25)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=match):
        env.step(action)
    # The episode is untouched: a valid action still works.
    env.step([9707])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda tok: "What is 2 + 3?", r"the action is text \('What is 2 \+ 3\?'\), not token ids: encode text with "
         r"tokenizer.encode\(text, add_special_tokens=False\)"),
        (lambda tok: tok("What is 2 + 3?"), r"the action is a BatchEncoding with keys \['attention_mask', 'input_ids'\].*"
         r"tokenizer\(text\)\['input_ids'\].*tokenizer.encode\(text, add_special_tokens=False\)"),
        (lambda tok: {"input_ids": [1, 2]}, r"the action is a dict with keys \['input_ids'\]"),
        (lambda tok: [], r"the action is empty \(list of 0 ids\)"),
        (lambda tok: np.array([9707.0, 11.0]), r"got float64 numbers \(ndarray, first values \[9707.0, 11.0\]\): if these are "
         r"token ids, convert with np.asarray\(ids, dtype=np.int64\)"),
        (lambda tok: np.array([0.25, 0.75]), r"got float64 numbers.*sample token ids first"),
        (lambda tok: ["What", "is"], r"got text or objects \(list, first values \['What', 'is'\]\): encode text with"),
        (lambda tok: None, r"the action is None"),
        (lambda tok: np.array([[9707, 11]]), r"got shape \(1, 2\): pass one sequence, e.g. ids\[0\]"),
    ],
)
def test_wrong_action_types_say_what_was_passed_and_how_to_encode(qwen25, make, match):
    env = Echo(qwen25)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=match):
        env.step(make(qwen25))
    obs, *_ = env.step(qwen25.encode("What is 2 + 3?", add_special_tokens=False))  # the fix the message names works
    assert obs.dtype == np.int64


def test_step_before_reset_and_after_end(qwen25):
    env = Echo(qwen25, rounds=1)
    with pytest.raises(ResetNeeded, match="reset"):
        env.step([1])
    env.reset(seed=0)
    *_, term, trunc, _ = env.step([9707, *env.renderer.turn_end_ids])
    assert term and not trunc
    with pytest.raises(ResetNeeded, match="over"):
        env.step([1])


def test_max_turns_truncates_with_reason(qwen25):
    env = Echo(qwen25, rounds=10, max_turns=2)
    env.reset(seed=0)
    _, _, term, trunc, info = env.step([9707])
    assert not (term or trunc)
    obs, _, term, trunc, info = env.step([9707])
    assert trunc and not term and info["stop_reason"] == "max_turns" and len(obs) == 0


def test_context_limit_truncates_before_overflowing(qwen25):
    env = Echo(qwen25, rounds=10, max_context_tokens=60)
    obs, info = env.reset(seed=0)
    total, done = len(obs), False
    while not done:
        action = [9707] * 5
        obs, _, term, trunc, info = env.step(action)
        total += len(action) + len(obs)
        done = term or trunc
    assert trunc and info["stop_reason"] == "context_length"
    assert total <= 60 and info["num_tokens"] == total


def test_an_action_past_the_context_limit_ends_the_episode_unscored(qwen25):
    """A policy that ignores its token budget (1M tokens, 30x the context) is not scored: the episode
    is truncated at the context limit before ``respond`` sees the action."""
    seen = []

    class Watched(Echo):
        def respond(self, turn):
            seen.append(turn.turn)
            return super().respond(turn)

    env = Watched(qwen25, rounds=1, max_context_tokens=64)
    obs, info = env.reset(seed=0)
    _, reward, term, trunc, info = env.step([9707] * (64 - len(obs) + 1))
    assert (reward, term, trunc, info["stop_reason"], seen) == (0.0, False, True, "context_length", [])
    env.reset(seed=0)
    _, reward, term, _, info = env.step([9707] * (64 - len(obs) - 1) + [151645])  # up to the limit: scored
    assert term and reward == 1.0 and seen == [0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_refused_at_step(qwen25, bad):
    class Poisoned(Echo):
        def respond(self, turn):
            return EnvResponse(reward=bad, done=True)

    env = Poisoned(qwen25)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"Poisoned.respond\(\) returned a non-finite reward \((nan|inf)\) on turn 0"):
        env.step([9707, 151645])


def test_a_completion_budget_caps_one_episode_and_is_passed_at_reset(qwen25):
    from tokengym.envs.chat import COMPLETION_BUDGET

    env = Echo(qwen25, rounds=10, max_context_tokens=4000)
    obs, info = env.reset(seed=0, options={COMPLETION_BUDGET: 12})
    prompt = len(obs)
    assert info["remaining_context"] == 12 and env.max_context_tokens == 4000  # the env is not changed
    total, done = prompt, False
    while not done:
        obs, _, term, trunc, info = env.step([9707] * 5)
        total += 5 + len(obs)
        done = term or trunc
    assert trunc and info["stop_reason"] == "context_length" and total - prompt <= 12
    # The next episode without one has the env's own limit again.
    obs, info = env.reset(seed=0)
    assert info["remaining_context"] == 4000 - len(obs)
    for bad in (0, -3, 2.5, True, "12"):
        with pytest.raises(ValueError, match="positive int"):
            env.reset(seed=0, options={COMPLETION_BUDGET: bad})


def test_prompt_longer_than_context_is_refused(qwen25):
    with pytest.raises(ValueError, match="max_context_tokens"):
        Echo(qwen25, max_context_tokens=5).reset(seed=0)


def test_unclosed_action_at_the_length_limit_truncates(qwen25):
    env = Echo(qwen25, max_action_tokens=3)
    env.reset(seed=0)
    _, _, term, trunc, info = env.step([9707, 9707, 9707])
    assert trunc and info["stop_reason"] == "action_length" and info["closed_by"] == "none"


def test_stop_string_moves_end_of_turn_into_the_observation(qwen25):
    env = Echo(qwen25, stop_strings=("</answer>",))
    env.reset(seed=0)
    action = env.renderer.encode("<answer>7</answer>")
    obs, _, _, _, info = env.step(action)
    assert info["closed_by"] == "stop_string"
    assert tuple(obs[: len(env.renderer.turn_end_ids)]) == env.renderer.turn_end_ids
    assert info["conformance"].status == "ok"


def test_unclosed_action_without_limit_is_closed_by_the_env(qwen25):
    env = Echo(qwen25)
    env.reset(seed=0)
    obs, _, term, trunc, info = env.step([9707])
    assert info["closed_by"] == "none" and not (term or trunc)
    assert tuple(obs[:1]) == env.renderer.turn_end_ids


COUNTING_TEMPLATE = (
    "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_non_prefix_stable_template_is_reported_precisely(qwen25):
    env = Echo(qwen25, chat_template=COUNTING_TEMPLATE)
    env.reset(seed=0)
    *_, info = env.step(env.renderer.encode("hi<|im_end|>"))
    c = info["conformance"]
    assert c.status == "mismatch" and not c.ok
    assert c.segment == "prompt" and c.affected_turns == (0,)
    assert c.actual_text.startswith("1 messages") and c.expected_text.startswith("3 messages")
    assert c.position == 3  # <|im_start|> system \n -> the count is the 4th token
    assert "turn 0" in c.detail and "prompt segment" in c.detail

    strict = Echo(qwen25, chat_template=COUNTING_TEMPLATE, conformance="strict")
    strict.reset(seed=0)
    with pytest.raises(ConformanceError, match="differs from the chat template"):
        strict.step(env.renderer.encode("hi<|im_end|>"))


def test_conformance_off_skips_the_check(qwen25):
    env = Echo(qwen25, chat_template=COUNTING_TEMPLATE, conformance="off")
    env.reset(seed=0)
    *_, info = env.step([9707])
    assert info["conformance"].status == "off"


def test_non_canonical_action_is_noted(qwen25):
    env = Echo(qwen25)
    env.reset(seed=0)
    hello = qwen25.encode("Hello", add_special_tokens=False)
    split = [qwen25.convert_tokens_to_ids(c) for c in "Hello"]
    assert split != hello
    *_, info = env.step(split + list(env.renderer.turn_end_ids))
    c = info["conformance"]
    assert c.status == "ok"
    assert any(n.startswith("non_canonical_action") for n in c.notes)


def test_seeded_reset_is_reproducible(qwen25):
    env = Echo(qwen25)
    a, ia = env.reset(seed=7)
    b, ib = env.reset(seed=7)
    assert np.array_equal(a, b) and ia["task"] == ib["task"]


def test_reset_options_override_the_prompt(qwen25):
    env = Echo(qwen25)
    obs, info = env.reset(options={"messages": [{"role": "user", "content": "custom"}]})
    assert "custom" in qwen25.decode(obs)
    with pytest.raises(ValueError, match="at least one message"):
        env.reset(options={"messages": []})


def test_invalid_constructor_arguments(qwen25):
    with pytest.raises(ValueError, match="conformance"):
        Echo(qwen25, conformance="loud")
    with pytest.raises(ValueError, match="max_turns"):
        Echo(qwen25, max_turns=0)


def test_sync_vector_env_runs_replay(qwen25):
    envs = gym.vector.SyncVectorEnv([lambda: ReplayEnv(qwen25) for _ in range(2)])
    obs, _ = envs.reset(seed=0)
    assert len(obs) == 2 and all(o.dtype == np.int64 for o in obs)
    actions = tuple(np.array([9707, 151645]) for _ in range(2))
    obs, rewards, term, trunc, infos = envs.step(actions)
    assert len(obs) == 2 and rewards.shape == (2,)
    assert list(infos["turn"]) == [0, 0]
    envs.close()


def test_render_ansi_marks_actions(qwen25):
    env = Echo(qwen25, render_mode="ansi")
    env.reset(seed=0)
    env.step(env.renderer.encode("yo<|im_end|>"))
    out = env.render()
    assert "\x1b[32myo<|im_end|>\x1b[0m" in out


def test_replay_reset_with_messages_replays_them(qwen25):
    msgs = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "hi again"},
    ]
    env = ReplayEnv(qwen25, conformance="strict")
    obs, _ = env.reset(options={"messages": msgs})
    assert env.renderer.decode(obs).endswith("Say hi.<|im_end|>\n<|im_start|>assistant\n")
    texts = []
    done = False
    while not done:
        action = env.reference_action()
        texts.append(env.renderer.decode(action))
        _, _, terminated, truncated, info = env.step(action)
        done = terminated or truncated
    assert texts == ["hi<|im_end|>", "hi again<|im_end|>"]
    assert info["conformance"].ok


def test_replay_reset_with_a_prompt_only_ends_at_the_first_step(qwen25):
    env = ReplayEnv(qwen25)
    obs, _ = env.reset(options={"messages": [{"role": "user", "content": "hi"}]})
    assert qwen25.decode(obs).endswith("hi<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(IndexError, match="0 assistant turns"):
        env.reference_action()
    action = env.renderer.assistant({"role": "assistant", "content": "hello"}).ids
    _, _, terminated, truncated, info = env.step(action)
    assert terminated and not truncated and info["replay"] == "transcript exhausted"


def test_a_reset_option_the_env_does_not_read_is_said_with_the_near_name(qwen25):
    import warnings

    from tokengym.envs import CalculatorEnv
    from tokengym.envs.chat import UnknownOptionWarning

    env = CalculatorEnv(qwen25)
    with pytest.warns(UnknownOptionWarning, match=r"CalculatorEnv.reset ignores the option 'idx': did you mean 'index'\?"):
        env.reset(seed=0, options={"idx": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownOptionWarning)
        env.reset(seed=0, options={"index": 0, "difficulty": 2})
        Echo(qwen25).reset(seed=0, options={"anything": 1})  # an env that does not declare its options: any key
