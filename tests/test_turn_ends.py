"""Turn ends the bridge has to find in real templates (issue: the real templates, item 4).

GLM-4.6/4.7 write nothing after a last assistant turn: the model ends its turn by writing the
next message's role token (``<|observation|>`` before tool results, ``<|user|>`` before a user
message; GLM models stop on both). Decided: that token is the action's last token, as the model
sampled it, and the observation starts after it. A turn with calls may end with another token
than a plain turn (GLM's ``<|observation|>``).
"""

from __future__ import annotations

import numpy as np
import pytest
from tokengym.envs import ChatRenderer
from tokengym.envs import template_corpus as tc
from tokengym.envs.builtin import CalculatorEnv
from tokengym.envs.conformance import _matches

CALL = {"id": "call00001", "type": "function", "function": {"name": "calculate", "arguments": {"expression": "6 * 7"}}}


@pytest.fixture(scope="module")
def glm():
    tok, _ = tc.corpus_tokenizer("GLM-4.6")
    return tok


def _id(tok, text: str) -> int:
    (single,) = tok.encode(text, add_special_tokens=False)
    return single


def test_an_open_turn_ends_with_the_next_messages_role_token(glm):
    r = ChatRenderer(glm)
    user, observation = _id(glm, "<|user|>"), _id(glm, "<|observation|>")
    assert r.turn_end_ids == (user,) and r.call_end_ids == (observation,)
    assert {user, observation} <= set(r.stop_token_ids)
    assert set(r.turn_ends) == {(user,), (observation,)}
    # A user follow-up: the observation starts after <|user|>, which the action holds.
    obs = r.observation([{"role": "user", "content": "next"}])
    assert obs.text == "\nnext<|assistant|>"
    # Not closed (a stop string): the role token opens the observation instead.
    assert r.observation([{"role": "user", "content": "next"}], closed=False).ids[0] == user
    # Tool results after a turn with calls: after <|observation|>.
    result = [{"role": "tool", "content": "42", "tool_call_id": "call00001", "name": "calculate"}]
    obs = r.observation(result, assistant_tool_calls=[CALL])
    assert obs.text == "\n<tool_response>\n42\n</tool_response><|assistant|>"
    assert r.observation(result, assistant_tool_calls=[CALL], closed=False).ids[0] == observation
    # The scripted turn ends as the model's does.
    action = r.assistant({"role": "assistant", "content": "", "tool_calls": [CALL]})
    assert action.ids[-1] == observation and "<arg_key>expression</arg_key>" in action.text
    assert r.assistant({"role": "assistant", "content": "Paris."}).ids[-1] == user


def test_a_glm_tool_episode_keeps_the_law_with_the_role_tokens_in_the_actions(glm):
    env = CalculatorEnv(glm, conformance="strict")
    assert env.parser.name == "glm45"
    obs, info = env.reset(seed=0)
    r, tools = env.renderer, info["tools"]
    action = r.assistant({"role": "assistant", "content": "", "tool_calls": [CALL]}, tools)
    obs, _, _, _, info = env.step(np.array(action.ids))
    assert info["closed_by"] == "end_of_turn"
    assert [(c["status"], c["content"]) for c in info["tool_results"]] == [("ok", "42")]
    assert r.decode(obs).startswith("\n<tool_response>\n42")
    answer = r.assistant({"role": "assistant", "content": "<answer>42</answer>"}, tools)
    _, _, terminated, _, info = env.step(np.array(answer.ids))
    # The last action ends with <|user|>, which the whole render of a finished conversation lacks.
    assert terminated and info["conformance"].status == "ok" and "final_reward" in info


def test_a_call_turn_the_model_ends_with_the_other_role_token_is_a_reported_difference(glm):
    env = CalculatorEnv(glm, conformance="warn", conformance_schedule="every_turn")
    _, info = env.reset(seed=0)
    r = env.renderer
    action = r.assistant({"role": "assistant", "content": "", "tool_calls": [CALL]}, info["tools"])
    ids = [*action.ids[:-1], *r.turn_end_ids]  # the model handed the turn to the user, not to the tool
    _, _, _, _, info = env.step(np.array(ids))
    assert info["closed_by"] == "end_of_turn" and info["tool_results"][0]["status"] == "ok"
    conf = info["conformance"]
    assert conf.status == "mismatch" and conf.actual_ids[0] == r.turn_end_ids[0]
    assert conf.expected_text.startswith("observation|>") and conf.segment == "action"


def test_the_final_match_accepts_an_end_the_whole_render_does_not_write():
    assert _matches("a<|assistant|>x<|user|>", "a<|assistant|>x", True, ("<|user|>",))
    assert not _matches("a<|assistant|>x<|user|>", "a<|assistant|>x", False, ("<|user|>",))
    assert not _matches("a<|assistant|>y<|user|>", "a<|assistant|>x", True, ("<|user|>",))
    assert _matches("a<|im_start|>x", "a<|im_start|>x<|im_end|>\n", True, ("<|im_end|>",))
