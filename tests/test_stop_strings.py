"""One stop-string check for the env and the policies, on real tokenizers of each family.

The reference is the decode of the whole action (special tokens kept): the check decodes
only a tail, and must agree with the reference wherever the tail starts (inside a
character, after a space) and however long the stop string is.
"""

from __future__ import annotations

import pytest

from tokengym.envs import ReplayEnv
from tokengym.envs.stop_strings import TAIL_TOKENS, check_stop_strings, ends_with_stop_string
from tokengym.policies import SamplingParams, ScriptedPolicy

from conftest import real_tokenizer

FAMILIES = ("qwen3", "qwen2.5", "gemma3", "mistral_nemo", "llama3_2", "deepseek_v3")
GLYPHS = "𓀀𓀁𓀂𓀃𓀄𓀅"  # six characters of three or four byte-level tokens each


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_agrees_with_the_decode_of_the_whole_action_at_every_length(name):
    tok = real_tokenizer(name)
    ids = encode(tok, "Résumé 🦜 naïve 東京 <b>x</b> " + GLYPHS + " the end.") + [tok.eos_token_id]
    checked = 0
    for k in range(1, len(ids) + 1):
        full = decode(tok, ids[:k])
        for n in (1, 3, 8, 30):
            for stop in (full[-n:], "Z" + full[-n:], full[-n:] + "Z"):
                assert ends_with_stop_string(ids[:k], [stop], tok) == full.endswith(stop), (k, stop)
                checked += 1
    assert checked == 12 * len(ids)


@pytest.mark.parametrize("name", FAMILIES)
def test_only_the_end_counts_and_special_tokens_are_text(name):
    tok = real_tokenizer(name)
    action = encode(tok, "<answer>7</answer>")
    assert ends_with_stop_string(action, ["</answer>"], tok)
    assert ends_with_stop_string(action, ("nope", "7</answer>"), tok)
    assert not ends_with_stop_string(encode(tok, "<answer>7</answer> and more"), ["</answer>"], tok)
    assert not ends_with_stop_string(action, [], tok) and not ends_with_stop_string([], ["</answer>"], tok)
    closed = [*action, tok.eos_token_id]
    assert ends_with_stop_string(closed, ["</answer>" + tok.eos_token], tok)
    assert not ends_with_stop_string(closed, ["</answer>"], tok)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_stop_string_longer_than_the_first_tail_is_found(name):
    # The checks this replaces decoded a fixed tail: 16 tokens in the policies, 64 in the env.
    # A stop string spelled by more tokens than that was never found there.
    tok = real_tokenizer(name)
    for stop, old_tail in ((GLYPHS, 16), (GLYPHS * 4, 64)):
        ids = encode(tok, "Say " + stop)
        assert len(ids) > old_tail > 0 and old_tail >= TAIL_TOKENS
        assert not decode(tok, ids[-old_tail:]).endswith(stop)  # what the former check saw
        assert ends_with_stop_string(ids, [stop], tok)
        assert not ends_with_stop_string(ids[:-1], [stop], tok)


def test_bad_stop_strings_are_refused(qwen25):
    with pytest.raises(ValueError, match="empty stop string"):
        ends_with_stop_string([9707], ["</a>", ""], qwen25)
    with pytest.raises(TypeError, match=r"pass \('</a>',\)"):
        check_stop_strings("</a>")
    with pytest.raises(TypeError, match="must be str"):
        check_stop_strings(["</a>", 7])
    with pytest.raises(ValueError, match="empty stop string"):
        ReplayEnv(qwen25, stop_strings=("",))
    assert check_stop_strings(["</a>"]) == ("</a>",)


def test_the_env_and_the_scripted_policy_agree_on_a_long_stop_string(qwen25):
    stop = GLYPHS * 4  # 72 tokens: past both former tails
    policy = ScriptedPolicy(lambda context: "Say " + stop, qwen25)
    sampling = SamplingParams(max_tokens=200, stop_strings=(stop,))
    gen = policy.generate([[9707]], sampling)[0]
    assert gen.finish_reason == "stop_string"  # was "stop" (the script ended the reply)
    assert policy.generate([[9707]], sampling.replace(stop_strings=("Say",)))[0].finish_reason == "stop"

    env = ReplayEnv(qwen25, stop_strings=(stop,))
    env.reset(seed=0)
    obs, _, _, _, info = env.step(gen.token_ids)
    assert info["closed_by"] == "stop_string"
    turn_end = env.renderer.turn_end_ids
    assert tuple(obs[: len(turn_end)].tolist()) == turn_end  # the env closed the turn in the observation


def test_one_finish_rule_for_every_engine_that_answers_with_ids(qwen25):
    """``policies.base.finish_reason``: HFPolicy's decode loops and verl's server-manager path use it."""
    from tokengym.policies.base import finish_reason

    end = qwen25.convert_tokens_to_ids("<|im_end|>")
    p = SamplingParams(max_tokens=50, stop_token_ids=(end,), stop_strings=("</answer>",))
    answer = qwen25.encode("<answer>5</answer>")
    assert finish_reason(answer + [end], p, qwen25) == "stop"
    assert finish_reason(answer, p, qwen25) == "stop_string"
    assert finish_reason(qwen25.encode("still going"), p, qwen25) is None
    long = qwen25.encode(" word" * 50)[:50]
    assert finish_reason(long, p, qwen25) == "length"
