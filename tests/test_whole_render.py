"""The whole-conversation render of the conformance check: the memoized sandbox gives the text
``apply_chat_template`` gives, on every family's template, refuses what the sandbox refuses, and
never decides a check differently. On real tokenizers and templates."""

from __future__ import annotations

import functools
import numpy as np
import pytest
from families import FAMILIES, REAL_FAMILIES, TOOLS, Family, conversations, tokenizer_for
from jinja2.exceptions import SecurityError

from tokengym.envs import ChatEnv, ChatRenderer, TemplateError
from tokengym.envs.chat import EnvResponse, Prompt
from tokengym.envs.conformance import check_conformance, is_scheduled
from tokengym.envs.whole_render import WholeRenderer, whole_renderer


def family_renderer(fam: Family) -> ChatRenderer:
    return ChatRenderer(
        tokenizer_for(fam),
        chat_template=fam.chat_template,
        template_kwargs=dict(fam.template_kwargs),
        require_tools_in_prompt=False,
    )


class Spy:
    """Counts the renderer's renders through ``apply_chat_template``."""

    def __init__(self, renderer: ChatRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = renderer._apply

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(renderer, "_apply", counted)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_every_family_renders_as_apply_chat_template_does(fam, monkeypatch):
    r = family_renderer(fam)
    whole = whole_renderer(r)
    assert whole.unavailable is None
    spy = Spy(r, monkeypatch)
    rendered = 0
    for conv in conversations(fam).values():
        for cut in range(2, len(conv.messages) + 1):
            messages = conv.messages[:cut]
            for generation_prompt in (True, False):
                try:
                    expected = r.render_text(messages, conv.tools, add_generation_prompt=generation_prompt, reference=True)
                except TemplateError as err:  # the template refuses this conversation: so does the check
                    with pytest.raises(TemplateError) as again:
                        whole.render(messages, conv.tools, add_generation_prompt=generation_prompt)
                    assert str(again.value) == str(err)
                    with pytest.raises(TemplateError) as again:  # and every other render
                        r.render_text(messages, conv.tools, add_generation_prompt=generation_prompt)
                    assert str(again.value) == str(err)
                    continue
                before = spy.calls
                assert whole.render(messages, conv.tools, add_generation_prompt=generation_prompt) == expected
                assert r.render_text(messages, conv.tools, add_generation_prompt=generation_prompt) == expected
                assert spy.calls == before, "the whole render fell back to apply_chat_template"
                rendered += 1
    assert rendered >= 5


# Template constructs that go through the sandbox's attribute, item and call rules: dict keys as
# attributes, dict and str methods, loop and namespace attributes, str.format (wrapped by the sandbox).
CONSTRUCTS = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}"
    "{%- set ns.n = ns.n + m.content | length -%}"
    "<|im_start|>{{ m.role }}\n{{ m.get('content') }} {{ m['role'] | upper }} {{ m.keys() | list | length }} "
    "{{ m.content.split(' ')[0].strip() }} {{ '{}-{}'.format(loop.index0, loop.length) }} "
    "{{ loop.previtem.role if loop.previtem is defined else 'first' }} {{ m.missing is defined }} "
    "{{ (m.content ~ '').startswith('a') }} {{ ns.n }}<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def test_sandbox_constructs_render_the_same(qwen25, monkeypatch):
    r = ChatRenderer(qwen25, chat_template=CONSTRUCTS)
    whole = whole_renderer(r)
    spy = Spy(r, monkeypatch)
    messages = [
        {"role": "user", "content": "a tarn is a lake"},
        {"role": "assistant", "content": "  yes, a small one", "items": "a key named like a dict method"},
        {"role": "user", "content": "thanks"},
    ]
    text = whole.render(messages, None, add_generation_prompt=True)
    assert spy.calls == 0
    assert text == r.render_text(messages, None, add_generation_prompt=True, reference=True)
    assert text == r.render_text(messages, None, add_generation_prompt=True) and spy.calls == 1
    assert "0-3 first False True" in text and "2-3 assistant" in text


@pytest.mark.parametrize(
    "attack, refused_by_the_sandbox",
    [
        ("{{ messages.append(messages[0]) }}", True),  # modifies a list: the immutable sandbox refuses
        ("{{ messages[0].pop('role') }}", True),  # modifies a dict
        ("{{ messages[0].content.__class__.__mro__ }}", True),  # internal attributes
        ("{{ '{0.__class__.__init__.__globals__}'.format(messages) }}", False),  # str.format: rendered as undefined
        ("{{ raise_exception('no') }}", False),  # the template's own refusal
    ],
)
def test_what_the_sandbox_refuses_stays_refused(qwen25, attack, refused_by_the_sandbox):
    base = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    # Only a conversation that opens with "attack" runs it: the renderer's own probes render.
    attacking = "{% if messages[0].content == 'attack' %}" + attack + "{% endif %}"
    generation = "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    r = ChatRenderer(qwen25, chat_template=base + attacking + generation)
    messages = [{"role": "user", "content": "attack"}]
    whole = whole_renderer(r)
    outcome: list[str] = []
    reference = functools.partial(r.render_text, reference=True)
    for render in (reference, whole.render, whole._render, r.render_text):  # _render: the memoized sandbox alone
        try:
            outcome.append(render(messages, None, add_generation_prompt=True))
        except (TemplateError, SecurityError) as err:
            outcome.append(f"raised {type(err).__name__}")
        except Exception as err:  # the template's raise_exception, as jinja raises it
            outcome.append(f"raised {type(err).__name__}")
    assert outcome[0] == outcome[1] == outcome[3]
    assert not any(leak in text for text in outcome for leak in ("<class", "<function", "<built-in", "<module"))
    if refused_by_the_sandbox:
        assert outcome[0] == "raised TemplateError" and outcome[2] == "raised SecurityError"


def test_a_message_changed_in_place_is_converted_again(qwen25, monkeypatch):
    """Converted messages are remembered between renders; one changed in place, nested values
    included, renders as it is now."""
    r = ChatRenderer(qwen25)
    whole = whole_renderer(r)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [tool_call(1, "Paris")]},
        {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
    ]
    first = whole.render(messages, TOOLS, add_generation_prompt=True)
    assert whole.render(messages, TOOLS, add_generation_prompt=True) == first
    messages[1]["tool_calls"][0]["function"]["arguments"]["city"] = "Rome"
    messages[2]["content"] = "rain"
    spy = Spy(r, monkeypatch)
    again = whole.render(messages, TOOLS, add_generation_prompt=True)
    assert spy.calls == 0 and again != first and "Rome" in again and "rain" in again
    assert again == r.render_text(messages, TOOLS, add_generation_prompt=True, reference=True)
    shorter = whole.render(messages[:2], TOOLS, add_generation_prompt=False)  # another conversation, same renderer
    assert shorter == r.render_text(messages[:2], TOOLS, add_generation_prompt=False, reference=True)


def test_a_probe_that_renders_differently_turns_the_fast_path_off_with_a_warning(qwen25, monkeypatch):
    r = ChatRenderer(qwen25)
    real = r._apply
    monkeypatch.setattr(r, "_apply", lambda *a, **k: real(*a, **k) + "drift")
    with pytest.warns(UserWarning, match=r"chat-template renders use apply_chat_template itself \(about 3x slower\): .*differently"):
        whole = WholeRenderer(r)
    assert whole.unavailable and "differently" in whole.unavailable
    messages = [{"role": "user", "content": "hi"}]
    assert whole.render(messages, None, add_generation_prompt=True).endswith("drift")  # the reference path
    r._whole_renderer = whole  # every render of this renderer now goes through apply_chat_template
    assert r.render_text(messages, None, add_generation_prompt=True).endswith("drift")


def test_a_transformers_without_an_input_step_skips_it_and_still_renders_the_templates_text(qwen25, monkeypatch):
    """The fast path borrows transformers' private template compiler and input steps, so that its
    sandbox, filters and input conversion are transformers' own; a version without an input step
    skips it, as that version does, and the probe holds the text to apply_chat_template's."""
    from transformers.utils import chat_template_utils as ctu

    monkeypatch.delattr(ctu, "_normalize_chat_messages", raising=False)  # transformers 5.5 has none
    r = ChatRenderer(qwen25)
    whole = WholeRenderer(r)
    assert whole.unavailable is None and not whole._plain_steps
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    assert whole.render(messages, TOOLS, add_generation_prompt=True) == r.render_text(
        messages, TOOLS, add_generation_prompt=True, reference=True
    )


def test_a_transformers_whose_compiler_uses_another_sandbox_renders_through_apply_chat_template(qwen25, monkeypatch):
    """The remembered safety decisions are sound for the immutable sandbox transformers uses
    today; a version that compiles in another environment gets no memoized sandbox, said once."""
    from jinja2.sandbox import SandboxedEnvironment
    from transformers.utils import chat_template_utils as ctu

    real = ctu._compile_jinja_template

    def other_sandbox(source):
        template = real(source)
        env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[type(e) for e in template.environment.extensions.values()])
        env.filters.update(template.environment.filters)
        env.globals.update(template.environment.globals)
        return env.from_string(source)

    monkeypatch.setattr(ctu, "_compile_jinja_template", other_sandbox)
    r = ChatRenderer(qwen25)
    with pytest.warns(UserWarning, match="renders templates in a SandboxedEnvironment"):
        whole = WholeRenderer(r)
    assert "SandboxedEnvironment" in whole.unavailable
    messages = [{"role": "user", "content": "hi"}]
    assert whole.render(messages, TOOLS, add_generation_prompt=True) == r.render_text(
        messages, TOOLS, add_generation_prompt=True, reference=True
    )


# --- The check decides exactly as with apply_chat_template --------------------------------------

def tool_call(n: int, city: str) -> dict:
    return {"id": f"call{n:05d}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


class Weather(ChatEnv):
    """A tool episode: each turn's calls are answered by tool results; turn 3 gets a user follow-up.

    ``actions`` are the assistant messages; their tokens are what the template writes for them."""

    def __init__(self, tokenizer, rounds: int, **kwargs):
        super().__init__(tokenizer, max_turns=64, require_tools_in_prompt=False, **kwargs)
        self.rounds = rounds

    def make_prompt(self, options):
        return Prompt(
            [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather, city by city?"}],
            tools=TOOLS,
        )

    def respond(self, turn):
        if turn.turn + 1 >= self.rounds:
            return EnvResponse(done=True)
        if turn.turn == 3:
            return EnvResponse([{"role": "user", "content": "And the next one?"}])
        calls = [tool_call(turn.turn, f"city {turn.turn}")]
        return EnvResponse(
            [{"role": "tool", "tool_call_id": calls[0]["id"], "content": f"sunny, {20 + turn.turn} C"}], tool_calls=calls
        )


def assistant_message(t: int, rounds: int, reasoning: bool) -> dict:
    message: dict = {"role": "assistant", "content": f"Checking city {t}."}
    if t + 1 < rounds and t != 3:
        message["tool_calls"] = [tool_call(t, f"city {t}")]
    if reasoning:
        message["reasoning_content"] = f"City {t} is next."
    return message


def episode(env: ChatEnv, rounds: int, *, reasoning: bool = False, action=None) -> list:
    """Results of every turn; ``action(t, ids)`` may replace a turn's ids."""
    env.reset(seed=0)
    results = []
    for t in range(rounds):
        ids = env.renderer.assistant(assistant_message(t, rounds, reasoning), env._tools).ids
        if action is not None:
            ids = action(t, ids)
        *_, info = env.step(np.array(ids))
        results.append(info["conformance"])
    return results


def both_ways(make_env, rounds: int, **kwargs) -> tuple[list, list]:
    """The episode's results with the memoized whole render and with apply_chat_template's."""
    fast_env = make_env()
    fast = episode(fast_env, rounds, **kwargs)
    assert whole_renderer(fast_env.renderer).unavailable is None
    slow_env = make_env()
    whole_renderer(slow_env.renderer).unavailable = "compared with the reference path"
    return fast, episode(slow_env, rounds, **kwargs)


@pytest.mark.parametrize("name", ["qwen3", "qwen2.5", "llama3.2"])
@pytest.mark.parametrize("schedule", ["every_turn", "doubling"])
def test_the_check_decides_as_with_apply_chat_template_on_real_templates(name, schedule):
    fam = next(f for f in REAL_FAMILIES if f.name == name)

    def make():
        return Weather(
            ChatRenderer(tokenizer_for(fam), template_kwargs=dict(fam.template_kwargs), require_tools_in_prompt=False),
            rounds=9,
            conformance_schedule=schedule,
        )

    fast, slow = both_ways(make, 9, reasoning=fam.reasoning)
    assert fast == slow
    checked = range(9) if schedule == "every_turn" else (0, 1, 3, 7, 8)
    assert [c.checked for c in fast] == [t in checked for t in range(9)]
    if name == "qwen3":  # reasoning dropped before the follow-up: named, as before
        assert any(c.status == "known" and "reasoning_dropped" in c.behaviours for c in fast)
    else:
        assert all(c.status == "ok" for c in fast if c.checked)


# ChatML that prints SECRET in an assistant turn as REDACTED, LATE too once the conversation has more
# than 12 messages (an early turn rewritten later), and numbers each NUMBERED tool result by its
# place in the whole conversation (the observation, cut from a small conversation, cannot know it).
PLANTING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and ('SECRET' in m.content or ('LATE' in m.content and messages | length > 12)) %}"
    "REDACTED{% elif m.role == 'tool' and 'NUMBERED' in m.content %}#{{ loop.index0 }} {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Planted(ChatEnv):
    """Tool results every turn; the one on ``numbered`` is rendered differently by the whole conversation."""

    def __init__(self, tokenizer, rounds: int, numbered: int, **kwargs):
        super().__init__(tokenizer, max_turns=64, chat_template=PLANTING, **kwargs)
        self.rounds, self.numbered = rounds, numbered

    def make_prompt(self, options):
        return Prompt([{"role": "user", "content": "go"}])

    def respond(self, turn):
        text = f"NUMBERED result {turn.turn}" if turn.turn == self.numbered else f"result {turn.turn}"
        return EnvResponse([{"role": "tool", "content": text}], done=turn.turn + 1 >= self.rounds)


def play(env: ChatEnv, text_for) -> list:
    env.reset(seed=0)
    results, done, t = [], False, 0
    while not done:
        ids = env.renderer.encode(text_for(t)) + list(env.renderer.turn_end_ids)
        *_, term, trunc, info = env.step(np.array(ids))
        results.append(info["conformance"])
        done, t = term or trunc, t + 1
    return results


@pytest.mark.parametrize(
    "where, turn, segment, shows_from",
    [
        ("an early action, rewritten once the conversation grows", 1, "action", 5),
        ("the newest action", 7, "action", 7),
        ("a tool observation", 2, "observation", 2),
    ],
)
def test_a_planted_difference_is_found_and_named_as_with_apply_chat_template(qwen25, where, turn, segment, shows_from):
    plant = {"action": "LATE plan" if shows_from > turn else "SECRET plan", "observation": None}[segment]

    def text_for(t):
        return plant if plant and t == turn else f"step {t}"

    rounds = 9
    for schedule in ("every_turn", "doubling"):
        envs = [Planted(qwen25, rounds, numbered=turn if segment == "observation" else -1, conformance_schedule=schedule)
                for _ in range(2)]
        whole_renderer(envs[1].renderer).unavailable = "compared with the reference path"
        fast, slow = play(envs[0], text_for), play(envs[1], text_for)
        assert whole_renderer(envs[0].renderer).unavailable is None
        assert fast == slow
        found_on = next(
            t for t in range(shows_from, rounds) if schedule == "every_turn" or is_scheduled(t, schedule) or t == rounds - 1
        )
        first = next(c for c in fast if c.status == "mismatch")
        assert (first.turn, first.affected_turns, first.segment) == (found_on, (turn,), segment), where
        assert f"(turn {turn}, {segment} segment)" in first.detail
        assert all(c.status in ("ok", "deferred") for c in fast[:found_on])


def test_check_conformance_renders_through_the_memoized_sandbox(qwen3, monkeypatch):
    """The check's own render goes through the memoized sandbox (apply_chat_template only on a
    template error, or to probe a moved system prompt)."""
    env = Weather(ChatRenderer(qwen3), rounds=4, conformance="off")
    episode(env, 4)
    assert whole_renderer(env.renderer).unavailable is None  # made (and probed) before counting
    spy = Spy(env.renderer, monkeypatch)
    result = check_conformance(env.renderer, env._messages, env._tools, env._pieces, turn=3, final=True)
    assert result.status in ("ok", "known") and spy.calls == 0


def test_a_whole_episode_renders_nothing_through_apply_chat_template(qwen3, monkeypatch):
    """Observations, prompts and checks all render through the memoized sandbox; the steps give the
    same observations and verdicts as with every render through apply_chat_template."""
    fast_env = Weather(ChatRenderer(qwen3), rounds=6)
    actions = [fast_env.renderer.assistant(assistant_message(t, 6, False), TOOLS).ids for t in range(6)]
    spy = Spy(fast_env.renderer, monkeypatch)
    fast_env.reset(seed=0)
    observations, verdicts = [], []
    for t in range(6):
        obs, *_, info = fast_env.step(np.array(actions[t]))
        observations.append(obs.tolist())
        verdicts.append(info["conformance"])
    assert spy.calls == 0
    slow_env = Weather(ChatRenderer(qwen3), rounds=6)
    whole_renderer(slow_env.renderer).unavailable = "compared with the reference path"
    slow_env.reset(seed=0)
    for t in range(6):
        obs, *_, info = slow_env.step(np.array(actions[t]))
        assert obs.tolist() == observations[t] and info["conformance"] == verdicts[t]


def test_tools_given_as_functions_render_through_apply_chat_template(qwen25, monkeypatch):
    """apply_chat_template turns Python functions into schemas; the memoized path leaves that to it
    (a fallback that costs time, never text)."""

    def get_weather(city: str) -> str:
        """Get the weather in a city.

        Args:
            city: The city's name.
        """
        return "sunny"

    r = ChatRenderer(qwen25)
    whole_renderer(r)  # made and probed before counting
    spy = Spy(r, monkeypatch)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = r.render_text(messages, [get_weather], add_generation_prompt=True)
    assert spy.calls == 1 and '"name": "get_weather"' in text
    assert text == r.render_text(messages, [get_weather], add_generation_prompt=True, reference=True)
    assert whole_renderer(r).unavailable is None  # other renders keep the fast path


# Reads of jinja's own objects (loop, namespace()) that the sandbox returns, wraps or refuses.
RUNTIME_READS = (
    "{%- set ns = namespace(flag=false, items=[1, 2], table={'k': 'v'}, fmt='<{}>'.format, n=0) -%}"
    "{%- for m in messages -%}"
    "{%- set ns.n = ns.n + 1 -%}{%- if loop.last %}{% set ns.flag = true %}{% endif -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }} {{ loop.index0 }}/{{ loop.length }} {{ loop.first }} {{ loop.last }} "
    "{{ loop.revindex }} {{ loop.cycle('odd', 'even') }} {{ loop.changed(m.role) }} {{ loop.depth }} "
    "{{ ns.items | length }} {{ ns.table.k }} {{ ns.fmt(m.role) }} {{ ns.n }} {{ ns.missing is defined }} "
    "{{ loop._length is defined }} {{ ns.__class__ is defined }} {{ loop.__class__ is defined }}<|im_end|>\n"
    "{%- endfor -%}"
    "{{ ns.flag }}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def test_loop_and_namespace_reads_render_as_the_sandbox_does(qwen25, monkeypatch):
    """loop and namespace() attributes, plain or not (a str.format the sandbox wraps), missing, or
    private (refused): the memoized sandbox gives apply_chat_template's text."""
    r = ChatRenderer(qwen25, chat_template=RUNTIME_READS)
    whole = whole_renderer(r)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    spy = Spy(r, monkeypatch)
    for generation_prompt in (True, False):
        before = spy.calls
        text = whole.render(messages, None, add_generation_prompt=generation_prompt)
        assert spy.calls == before, "the memoized sandbox fell back to apply_chat_template"
        assert text == r.render_text(messages, None, add_generation_prompt=generation_prompt, reference=True)
    assert "<user> 3 False False False" in text  # wrapped str.format; no private or internal attribute read
    assert "0/3 True False 3 odd True 1" in text and text.endswith("True")


class Role(str):
    """A str subclass: transformers' steps make it a plain str."""


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "reasoning": "because", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": [1.5, True, None],
                                                                                      "z": ("a", {"b": None})}}}]},
        {"role": "tool", "content": [{"type": "text", "text": "ok"}], "tool_call_id": "c1"},
        {"role": Role("user"), "content": "a str subclass"},
        {"role": "user", "content": "numpy", "n": np.int64(3), "flag": np.bool_(False)},
        {"role": "user", "content": "a key that is not a string", "extra": {1: "one"}},
        {"role": "user", "content": "an object", "extra": object()},
        {"role": "user", "content": "deep", "extra": functools.reduce(lambda inner, _: [inner], range(150), [])},
    ],
    ids=["none", "calls", "blocks", "str-subclass", "numpy", "int-key", "object", "deep"],
)
def test_a_message_converts_as_transformers_steps_convert_it(qwen25, message):
    """Plain data is copied directly; anything else goes through transformers' own steps: the same
    result either way, and nothing of the caller's message is shared."""
    whole = whole_renderer(ChatRenderer(qwen25))
    _, normalize, plain, alias = whole._helpers  # the steps this transformers version takes
    expected = alias(plain(normalize([message])))[0]
    form = whole._form(message)
    assert form == expected
    assert [type(v) for v in form.values()] == [type(v) for v in expected.values()]
    if not whole._plain_steps:  # an older version renders the message as given: nothing to copy
        return

    def containers(value, out):
        if isinstance(value, (dict, list, tuple)):
            out.append(id(value))
            for item in value.values() if isinstance(value, dict) else value:
                containers(item, out)
        return out

    shared = set(containers(form, [])) & set(containers(message, []))
    assert not shared, "the form shares a container with the message"


def test_tools_convert_as_transformers_steps_convert_them(qwen25):
    whole = whole_renderer(ChatRenderer(qwen25))
    plain = whole._helpers[2]  # the step this transformers version takes (older ones take none)
    tools = [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": {"enum": (1, 2.0, True, None)}}}]
    assert whole._plain(tools) == plain(tools)
    assert whole._plain(tools)[-1]["function"]["parameters"]["enum"] == (1, 2.0, True, None)
    odd = [{"type": "function", "function": {"name": Role("h"), "n": np.float32(0.5)}}]
    assert whole._plain(odd) == plain(odd)
    assert type(whole._plain(odd)[0]["function"]["name"]) is type(plain(odd)[0]["function"]["name"])


def test_only_namespaces_that_read_attributes_as_jinja_does_skip_the_wrapping_step():
    from jinja2.runtime import LoopContext
    from jinja2.utils import Namespace

    from tokengym.envs.whole_render import _is_runtime_type

    class Same(Namespace):  # like transformers' TemplateNamespace: checks names on writes only
        def __setitem__(self, name, value):
            super().__setitem__(name, value)

    class Own(Namespace):
        def __getattribute__(self, name):
            return "{}".format

    class Fallback(Namespace):
        def __getattr__(self, name):
            return name

    assert _is_runtime_type(LoopContext) and _is_runtime_type(Namespace) and _is_runtime_type(Same)
    assert not any(map(_is_runtime_type, (Own, Fallback, dict, str, object)))
