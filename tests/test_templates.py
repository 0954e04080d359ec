"""The tool-capable ChatML template tokengym ships for models whose template has no tools."""

from __future__ import annotations

from tokengym.envs import ReplayEnv
from tokengym.envs.templates import CHATML_TOOLS


def test_chatml_tools_template_replays_token_for_token(qwen25):
    env = ReplayEnv(qwen25, chat_template=CHATML_TOOLS, conformance="strict")
    obs, _ = env.reset(seed=0)
    stream, done = list(obs), False
    while not done:
        action = env.unwrapped.reference_action()
        obs, _, term, trunc, info = env.step(action)
        stream += list(action) + list(obs)
        done = term or trunc
        assert info["conformance"].status == "ok"
    t = env.transcript
    full = qwen25.apply_chat_template(
        t["messages"], tools=t["tools"], chat_template=CHATML_TOOLS, tokenize=True, return_dict=False
    )
    assert stream == full[: len(stream)] and qwen25.decode(full[len(stream) :]) == "\n"
    text = qwen25.decode(stream)
    assert '"name": "get_weather"' in text and "<tool_response>\n15.0\n</tool_response>" in text


def test_chatml_tools_default_system_prompt_is_a_variable(qwen25):
    env = ReplayEnv(qwen25, chat_template=CHATML_TOOLS, template_kwargs={"default_system": "Be brief."})
    obs, _ = env.reset(options={"messages": [{"role": "user", "content": "hi"}]})
    assert qwen25.decode(obs).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")
