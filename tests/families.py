"""Tool-calling chat templates of every model family, paired with real tokenizers, for tests.

The bridge and the tool-call parsers must hold on the templates people serve models with,
not only on Qwen's. The public templates of Llama 3.x, Hermes, xLAM, Qwen3-Coder, Gemma 3,
DeepSeek, Mistral and Granite differ exactly where token-faithfulness breaks: an assistant
with calls that prints only the calls, tool results inside a user turn, a system prompt
moved to the last user message, reasoning dropped from history, a generation prompt that
depends on what came before. Where the pinned template corpus has a family's real template
that renders tools on a tokenizer we pin (:mod:`tokengym.envs.template_corpus`: Llama 3.1,
Qwen3-Coder, DeepSeek V3.1, Granite 4.0), that is the family's template. Five are written for
these tests in a family's style (same markers, same quirks), each because no real template of
the corpus does what the style is for: Llama 3.2's pythonic calls and xLAM's bare JSON list (no
real template in the corpus writes them), Gemma 3's pythonic calls (Gemma 3's own raises on a
tool message), DeepSeek R1's reasoning dropped around DeepSeek's tool tokens (the real R1-distill
templates move a call turn's content past its end; their rows in ``docs/templates.md`` say so)
and Mistral v3's parallel calls with ids (not in the corpus). The Hermes format is Qwen2.5's own
template (the real Hermes 2 Pro and 3 templates render only with tools; they are rows of the
page). The tokenizers' own templates that support tools are listed as families with ``chat_template=None``.

Whether a family is prefix-stable (rendering a conversation, then the same conversation
plus new messages, only appends text) is a claim that :func:`render_stability` checks by
rendering, and the self-tests hold every family to its claim.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAMILIES",
    "REAL_FAMILIES",
    "REASONING_DROPPED",
    "SECOND_CALLS_UNOPENED",
    "SYSTEM_MOVED",
    "SYSTEM_ONLY_AT_END",
    "TEMPLATE_FAMILIES",
    "TOOLS",
    "Conversation",
    "Family",
    "PrefixBreak",
    "Stability",
    "conversations",
    "drops_none_keys",
    "family",
    "render",
    "render_stability",
    "rendered_turn",
    "tokenizer_for",
]


@dataclass(frozen=True)
class Family:
    """A chat template, the real tokenizer it runs on, and what it does to a stream of turns.

    ``chat_template`` is ``None`` for the tokenizer's own template. ``prefix_stable``: every
    turn boundary of the standard conversations renders as a prefix of the whole conversation
    (checked by :func:`render_stability`); otherwise ``non_prefix_stable_cause`` says why.
    ``call_markers`` are texts every rendered assistant-with-calls contains; ``control_tokens``
    are markers that the paired tokenizer must encode as single added tokens.
    """

    name: str
    tokenizer: str
    chat_template: str | None
    parser: str
    prefix_stable: bool
    non_prefix_stable_cause: str | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    notes: str = ""
    call_markers: tuple[str, ...] = ()
    control_tokens: tuple[str, ...] = ()
    # What an assistant message with calls renders: its content too, or only the calls.
    prints_call_content: bool = False
    # More than one call in one assistant message.
    parallel_calls: bool = True
    # A user message directly after tool results (no assistant answer between).
    user_after_tool: bool = True
    # The template concatenates ``arguments`` as text: pass them as a JSON string.
    arguments_as_text: bool = False
    # Tool-call ids the template accepts: Mistral's are 9 alphanumeric characters.
    call_id_length: int | None = None
    # The template renders ``reasoning_content`` of assistant turns (somewhere in history).
    reasoning: bool = False
    # Consecutive tool results share one rendered block (one user turn, one JSON list...), so a
    # render cut between them is not a prefix: the bridge must add a round's results together.
    groups_tool_results: bool = False
    # Roles after which the generation prompt renders nothing (it is already in the turn, or
    # the model answers right after the turn's closing tag).
    empty_generation_prompt_after: tuple[str, ...] = ()
    # The template prints calls only for ``content: None``, a key some transformers versions
    # drop before rendering (5.24 does, 5.5 does not): see :func:`drops_none_keys`.
    needs_none_content: bool = False
    # The template writes the tools' schemas into the prompt (DeepSeek V3's and V3.1's never do).
    shows_tools: bool = True
    # An earlier turn's content loses its text up to ``</think>`` in history (DeepSeek V3.1), so a
    # model that writes its reasoning there sees a new context in deploy mode.
    think_text_dropped: bool = False
    # Control tokens of the family's own tokenizer that the paired (pinned) tokenizer lacks: added
    # to a copy of it as special tokens, as the family's tokenizer has them.
    extra_special_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.prefix_stable == (self.non_prefix_stable_cause is not None):
            raise ValueError(f"{self.name}: give a non_prefix_stable_cause exactly when prefix_stable is False")


# Causes of a broken prefix, by name, so tests and reports can match on them.
REASONING_DROPPED = "reasoning dropped from earlier assistant turns (a think block only on the last one)"
SYSTEM_MOVED = "system prompt and tool list rendered with the last user message"
SYSTEM_ONLY_AT_END = "system prompt rendered only while the conversation ends with a user message"
SECOND_CALLS_UNOPENED = "a second assistant with calls is rendered without <｜Assistant｜><｜tool▁calls▁begin｜>"


# --- Templates written for the tests -------------------------------------------------------

LLAMA32_PYTHONIC = r"""
{%- set tools = tools if tools is defined else none -%}
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
  {%- set system_text = messages[0].content | trim -%}
  {%- set messages = messages[1:] -%}
{%- else -%}
  {%- set system_text = "" -%}
{%- endif -%}
<|start_header_id|>system<|end_header_id|>{{ "\n\n" }}
{%- if tools is not none -%}
You are an expert in composing functions. To use functions, reply with only
[func_name1(param1=value1, param2=value2), func_name2(param=value)]
and nothing else. The functions you can use, as JSON:
{{ tools | tojson(indent=2) }}{{ "\n\n" }}
{%- endif -%}
{{- system_text }}<|eot_id|>
{%- for m in messages -%}
  {%- if m.role == 'assistant' and m.tool_calls -%}
<|start_header_id|>assistant<|end_header_id|>{{ "\n\n" }}[
    {%- for c in m.tool_calls -%}
      {%- if c.function.arguments is not mapping -%}{{ raise_exception("pythonic calls need arguments as a mapping") }}{%- endif -%}
      {{- c.function.name }}(
      {%- for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor -%}
      ){% if not loop.last %}, {% endif -%}
    {%- endfor -%}
]<|eot_id|>
  {%- elif m.role in ('tool', 'ipython') -%}
<|start_header_id|>ipython<|end_header_id|>{{ "\n\n" }}{{ m.content | tojson if m.content is mapping else m.content }}<|eot_id|>
  {%- else -%}
<|start_header_id|>{{ m.role }}<|end_header_id|>{{ "\n\n" }}{{ m.content | trim }}<|eot_id|>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ "\n\n" }}{% endif -%}
"""


XLAM = r"""
{%- set tools = tools if tools is defined else none -%}
{%- if messages[0].role == 'system' -%}
  {%- set system_text = messages[0].content -%}
  {%- set messages = messages[1:] -%}
{%- else -%}
  {%- set system_text = "You are a helpful assistant that can use tools." -%}
{%- endif -%}
<|im_start|>system{{ "\n" }}{{ system_text }}
{%- if tools is not none %}{{ "\n\n" }}Tools available, as JSON:
{{ tools | tojson }}
When you call tools, answer with only a JSON list: [{"name": "tool", "arguments": {"arg": "value"}}, ...]
{%- endif %}<|im_end|>{{ "\n" }}
{%- for m in messages -%}
  {%- if m.role == 'assistant' and m.tool_calls -%}
<|im_start|>assistant{{ "\n" }}[
    {%- for c in m.tool_calls -%}
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson if c.function.arguments is mapping else c.function.arguments }}}{% if not loop.last %}, {% endif %}
    {%- endfor -%}
]<|im_end|>{{ "\n" }}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>tool{{ "\n" }}[{% endif -%}
    {{ m.content | tojson }}
    {%- if loop.last or loop.nextitem.role != 'tool' %}]<|im_end|>{{ "\n" }}{% else %}, {% endif -%}
  {%- else -%}
<|im_start|>{{ m.role }}{{ "\n" }}{{ m.get('content') or '' }}<|im_end|>{{ "\n" }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant{{ "\n" }}{% endif -%}
"""

GEMMA3_PYTHONIC = r"""
{{- bos_token -}}
{%- set tools = tools if tools is defined else none -%}
{%- if messages[0].role == 'system' -%}
  {%- set first_prefix = messages[0].content + "\n\n" -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_prefix = "" -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- if tools is not none -%}
  {%- set first_prefix = first_prefix + "When a function helps, reply with only a Python list of calls, "
      + "[func_name(param=value), ...]. You can call:\n" + (tools | tojson(indent=2)) + "\n\n" -%}
{%- endif -%}
{#- Turns alternate user / model: tool results are a user turn, an assistant's calls a model turn. -#}
{%- set ns = namespace(turn=0, open_tools=false) -%}
{%- for m in loop_messages -%}
  {%- set is_user_side = m.role == 'user' or m.role == 'tool' -%}
  {%- if m.role == 'tool' and loop.index0 > 0 and loop.previtem.role == 'tool' -%}
  {%- elif is_user_side != (ns.turn % 2 == 0) -%}
    {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") -}}
  {%- else -%}
    {%- set ns.turn = ns.turn + 1 -%}
  {%- endif -%}
{%- endfor -%}
{%- for m in loop_messages -%}
  {%- if m.role == 'assistant' -%}
<start_of_turn>model{{ "\n" }}
    {%- if m.tool_calls -%}
[
      {%- for c in m.tool_calls -%}
        {%- if c.function.arguments is not mapping -%}{{ raise_exception("pythonic calls need arguments as a mapping") }}{%- endif -%}
        {{- c.function.name }}(
        {%- for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor -%}
        ){% if not loop.last %}, {% endif -%}
      {%- endfor -%}
]
    {%- else -%}
      {{- m.content | trim -}}
    {%- endif -%}
<end_of_turn>{{ "\n" }}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' %}<start_of_turn>user{{ "\n" }}{% endif -%}
```tool_output{{ "\n" }}{{ m.content | trim }}{{ "\n" }}```
    {%- if loop.last or loop.nextitem.role != 'tool' %}<end_of_turn>{{ "\n" }}{% else %}{{ "\n" }}{% endif -%}
  {%- else -%}
<start_of_turn>user{{ "\n" }}{{ first_prefix if loop.first else "" }}{{ m.content | trim }}<end_of_turn>{{ "\n" }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<start_of_turn>model{{ "\n" }}{% endif -%}
"""

# DeepSeek R1: DeepSeek's tool tokens; every earlier assistant turn loses its reasoning, and
# the generation prompt opens a <think> block.
DEEPSEEK_R1 = r"""
{%- set ns = namespace(system="", in_tools=false) -%}
{%- for m in messages if m.role == 'system' -%}
  {%- set ns.system = ns.system + ("\n\n" if ns.system else "") + m.content -%}
{%- endfor -%}
{%- set tools = tools if tools is defined else none -%}
{{- bos_token }}{{ ns.system -}}
{%- if tools is not none %}{{ "\n\n" if ns.system else "" }}## Tools{{ "\n\n" }}You can call these functions:
{% for t in tools %}{{ t | tojson }}{{ "\n" }}{% endfor %}{% endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {%- if ns.in_tools %}<｜tool▁outputs▁end｜>{% endif -%}
    {%- set ns.in_tools = false -%}
<｜User｜>{{ m.content }}
  {%- elif m.role == 'assistant' -%}
    {%- if ns.in_tools %}<｜tool▁outputs▁end｜>{% endif -%}
    {%- set ns.in_tools = false -%}
    {%- set content = m.get('content') or '' -%}
    {%- if '</think>' in content %}{% set content = content.split('</think>')[-1] | trim %}{% endif -%}
<｜Assistant｜>{{ content }}
    {%- if m.tool_calls -%}
<｜tool▁calls▁begin｜>
      {%- for c in m.tool_calls -%}
        {%- if not loop.first %}{{ "\n" }}{% endif -%}
<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}{{ "\n" }}```json{{ "\n" }}{{ c.function.arguments | tojson if c.function.arguments is mapping else c.function.arguments }}{{ "\n" }}```<｜tool▁call▁end｜>
      {%- endfor -%}
<｜tool▁calls▁end｜>
    {%- endif -%}
<｜end▁of▁sentence｜>
  {%- elif m.role == 'tool' -%}
    {%- if ns.in_tools -%}{{ "\n" }}<｜tool▁output▁begin｜>{%- else -%}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{%- endif -%}
    {{- m.content }}<｜tool▁output▁end｜>
    {%- set ns.in_tools = true -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.in_tools %}<｜tool▁outputs▁end｜>{% endif -%}
{%- if add_generation_prompt %}<｜Assistant｜><think>{{ "\n" }}{% endif -%}
"""

# Mistral (v3 style): the tool list and the system prompt go with the last user message;
# calls are a JSON list after [TOOL_CALLS] with 9-character ids.
MISTRAL_PARALLEL = r"""
{%- set tools = tools if tools is defined else none -%}
{%- if messages[0].role == 'system' -%}
  {%- set system_text = messages[0].content -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set system_text = none -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- set ns = namespace(last_user=-1, turn=0) -%}
{%- for m in loop_messages -%}
  {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- endfor -%}
{%- for m in loop_messages if m.role != 'tool' and not m.tool_calls -%}
  {%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception("After the optional system message, roles must alternate user/assistant/user/assistant/...") -}}
  {%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- for m in loop_messages -%}
  {%- if m.role == 'user' -%}
    {%- if tools is not none and loop.index0 == ns.last_user -%}
[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]
    {%- endif -%}
    {%- if loop.index0 == ns.last_user and system_text is not none -%}
[INST] {{ system_text }}{{ "\n\n" }}{{ m.content }}[/INST]
    {%- else -%}
[INST] {{ m.content }}[/INST]
    {%- endif -%}
  {%- elif m.role == 'assistant' and m.tool_calls -%}
[TOOL_CALLS] [
    {%- for c in m.tool_calls -%}
      {%- if c.id is not defined or c.id | length != 9 or not c.id.isalnum() -%}
        {{- raise_exception("Tool call ids must be 9 alphanumeric characters.") -}}
      {%- endif -%}
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson if c.function.arguments is mapping else c.function.arguments }}, "id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}
    {%- endfor -%}
]{{ eos_token }}
  {%- elif m.role == 'assistant' -%}
{{ " " }}{{ m.content }}{{ eos_token }}
  {%- elif m.role == 'tool' -%}
    {%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 -%}
      {{- raise_exception("Tool call ids must be 9 alphanumeric characters.") -}}
    {%- endif -%}
[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
  {%- else -%}
    {{- raise_exception("Only user, assistant and tool roles after the optional system message.") -}}
  {%- endif -%}
{%- endfor -%}
"""


def _template(text: str) -> str:
    # The sources above are laid out for reading; the leading newline is not part of the template.
    return text.strip("\n")


def _corpus(name: str) -> str:
    """A model's own template from the pinned corpus (``tokengym fetch-templates``)."""
    from tokengym.envs.template_corpus import corpus_templates

    return corpus_templates()[name]


TEMPLATE_FAMILIES: tuple[Family, ...] = (
    Family(
        name="llama3.1-json",
        tokenizer="llama3_2",  # Llama 3.1's vocabulary (the llama3_1 package is Llama 3.0's)
        chat_template=_corpus("meta-llama-Llama-3.1-8B-Instruct"),
        parser="llama3_json",
        prefix_stable=True,
        call_markers=('{"name": "', '"parameters": '),
        control_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        parallel_calls=False,
        # Without it the system prompt carries today's date (strftime_now) and changes at midnight.
        template_kwargs={"date_string": "26 Jul 2024"},
        notes="tools in the first user message; one call per message; results as ipython turns",
    ),
    Family(
        name="llama3.2-pythonic",
        tokenizer="llama3_2",
        chat_template=_template(LLAMA32_PYTHONIC),
        parser="pythonic",
        prefix_stable=True,
        call_markers=("[get_weather(city=",),
        control_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        notes="tools in the system message; calls as a Python list; results as ipython turns",
    ),
    Family(
        name="xlam",
        tokenizer="qwen2.5",
        chat_template=_template(XLAM),
        parser="xlam",
        prefix_stable=True,
        call_markers=('[{"name": ', '"arguments": '),
        control_tokens=("<|im_start|>", "<|im_end|>"),
        groups_tool_results=True,
        notes="ChatML; calls as a bare JSON list; consecutive results as one JSON list in a tool turn",
    ),
    Family(
        name="qwen3-coder",
        tokenizer="qwen3",
        chat_template=_corpus("Qwen3-Coder"),
        parser="qwen3_coder",
        prefix_stable=True,
        call_markers=("<tool_call>\n<function=", "<parameter=", "</parameter>\n</function>\n</tool_call>"),
        control_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
        prints_call_content=True,
        groups_tool_results=True,
        notes="XML calls; consecutive results in one user turn inside <tool_response> tags",
    ),
    Family(
        name="gemma3-pythonic",
        tokenizer="gemma3",
        chat_template=_template(GEMMA3_PYTHONIC),
        parser="pythonic",
        prefix_stable=True,
        call_markers=("[get_weather(city=", ")]<end_of_turn>"),
        control_tokens=("<start_of_turn>", "<end_of_turn>"),
        user_after_tool=False,
        groups_tool_results=True,
        notes="no system role (system and tools prefix the first user turn); tool results are a user turn, "
        "so a user message right after them breaks the alternation and raises, as the real template does",
    ),
    Family(
        name="deepseek-v3.1",
        tokenizer="deepseek_v3",
        chat_template=_corpus("deepseek-ai-DeepSeek-V3.1"),
        parser="deepseek_v3",
        prefix_stable=True,
        call_markers=("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁sep｜>{", "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
        control_tokens=("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁output▁begin｜>", "<｜end▁of▁sentence｜>"),
        prints_call_content=True,
        shows_tools=False,
        think_text_dropped=True,
        empty_generation_prompt_after=("tool",),
        notes="the tool list is never rendered; a call is NAME<｜tool▁sep｜>{json}; the model answers tool outputs "
        "without <｜Assistant｜>",
    ),
    Family(
        name="deepseek-r1",
        tokenizer="deepseek_v3",
        chat_template=_template(DEEPSEEK_R1),
        parser="deepseek_v3",
        prefix_stable=False,
        non_prefix_stable_cause=REASONING_DROPPED,
        call_markers=("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>", "<｜tool▁calls▁end｜>"),
        control_tokens=("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜end▁of▁sentence｜>"),
        prints_call_content=True,
        reasoning=True,
        groups_tool_results=True,
        notes="the generation prompt opens <think>; every assistant turn in history is rendered without it",
    ),
    Family(
        name="mistral-parallel",
        tokenizer="mistral_nemo",
        chat_template=_template(MISTRAL_PARALLEL),
        parser="mistral",
        prefix_stable=False,
        non_prefix_stable_cause=SYSTEM_MOVED,
        call_markers=("[TOOL_CALLS] [{", '"id": "'),
        control_tokens=("[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[AVAILABLE_TOOLS]"),
        user_after_tool=False,
        call_id_length=9,
        empty_generation_prompt_after=("user", "tool"),
        notes="no generation prompt (the model answers after [/INST] or [/TOOL_RESULTS]); a space after each "
        "control token",
    ),
    Family(
        name="granite-4.0",
        tokenizer="qwen3",
        chat_template=_corpus("ibm-granite-granite-4.0"),
        parser="hermes",
        prefix_stable=True,
        call_markers=("<tool_call>\n{\"name\": ", "}\n</tool_call>"),
        control_tokens=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<tool_call>"),
        prints_call_content=True,
        groups_tool_results=True,
        extra_special_tokens=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
        notes="no pinned tokenizer has Granite's role tokens: they are added to a copy of qwen3 as special "
        "tokens, as Granite's own tokenizer has them; results are a user turn of <tool_response> blocks",
    ),
)

REAL_FAMILIES: tuple[Family, ...] = (
    Family(
        name="qwen3",
        tokenizer="qwen3",
        chat_template=None,
        parser="hermes",
        prefix_stable=False,
        non_prefix_stable_cause=REASONING_DROPPED,
        call_markers=("<tool_call>\n{\"name\": ",),
        control_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>", "<think>"),
        prints_call_content=True,
        reasoning=True,
        groups_tool_results=True,
        notes="reasoning kept after the last user message, dropped before it; the last assistant turn gets an empty "
        "think block that disappears once another turn follows",
    ),
    Family(
        name="qwen2.5",
        tokenizer="qwen2.5",
        chat_template=None,
        parser="hermes",
        prefix_stable=True,
        call_markers=("<tool_call>\n{\"name\": ",),
        control_tokens=("<|im_start|>", "<|im_end|>", "<tool_call>"),
        prints_call_content=True,
        groups_tool_results=True,
        notes="default system prompt when none is given",
    ),
    Family(
        name="llama3.2",
        tokenizer="llama3_2",
        chat_template=None,
        parser="llama3_json",
        prefix_stable=True,
        call_markers=('{"name": "', '"parameters": '),
        control_tokens=("<|start_header_id|>", "<|eot_id|>"),
        parallel_calls=False,
        # Without it the system prompt carries today's date (strftime_now) and changes at midnight.
        template_kwargs={"date_string": "26 Jul 2024"},
        notes="JSON calls, not pythonic; tools in the first user message; one call per message; today's date "
        "(strftime_now) in the system prompt unless date_string is passed",
    ),
    Family(
        name="deepseek_v3",
        tokenizer="deepseek_v3",
        chat_template=None,
        parser="deepseek_v3",
        prefix_stable=False,
        non_prefix_stable_cause=SECOND_CALLS_UNOPENED,
        call_markers=("<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "```json\n"),
        control_tokens=("<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁outputs▁end｜>"),
        arguments_as_text=True,
        needs_none_content=True,
        shows_tools=False,
        groups_tool_results=True,
        empty_generation_prompt_after=("tool",),
        notes="calls render only for content None; the tool list is never rendered; arguments are concatenated "
        "as text; the second and later assistants with calls lose <｜Assistant｜><｜tool▁calls▁begin｜>",
    ),
    Family(
        name="mistral_nemo",
        tokenizer="mistral_nemo",
        chat_template=None,
        parser="mistral",
        prefix_stable=False,
        non_prefix_stable_cause=SYSTEM_ONLY_AT_END,
        call_markers=("[TOOL_CALLS][{", '"id": "'),
        control_tokens=("[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[AVAILABLE_TOOLS]"),
        user_after_tool=False,
        call_id_length=9,
        empty_generation_prompt_after=("user", "tool"),
        notes="the system prompt is printed only when the conversation ends with a user message; tool results are "
        "not JSON-quoted",
    ),
)

FAMILIES: tuple[Family, ...] = TEMPLATE_FAMILIES + REAL_FAMILIES


_WITH_EXTRA: dict[str, Any] = {}


def tokenizer_for(fam: Family) -> Any:
    """The real tokenizer ``fam`` pairs with, loaded once per test session (a copy with the
    family's missing control tokens added, when it has any)."""
    from conftest import real_tokenizer

    if not fam.extra_special_tokens:
        return real_tokenizer(fam.tokenizer)
    if fam.name not in _WITH_EXTRA:
        import copy

        tok = copy.deepcopy(real_tokenizer(fam.tokenizer))
        tok.add_special_tokens({"additional_special_tokens": list(fam.extra_special_tokens)})
        _WITH_EXTRA[fam.name] = tok
    return _WITH_EXTRA[fam.name]


def family(name: str) -> Family:
    """The family called ``name``."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(f"unknown family {name!r}; known: {[f.name for f in FAMILIES]}")


# --- Standard conversations ------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


@dataclass(frozen=True)
class Conversation:
    """OpenAI-style messages with the tool schemas they were written against."""

    name: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=lambda: list(TOOLS))


def _call_id(fam: Family, n: int) -> str:
    return f"call{n:05d}" if fam.call_id_length == 9 else f"call_{n}"


def _call(fam: Family, n: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    args: Any = json.dumps(arguments) if fam.arguments_as_text else arguments
    return {"id": _call_id(fam, n), "type": "function", "function": {"name": name, "arguments": args}}


def _calls(fam: Family, content: str, *calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None if fam.needs_none_content else content, "tool_calls": list(calls)}


def _result(fam: Family, n: int, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": _call_id(fam, n), "content": content}


def conversations(fam: Family) -> dict[str, Conversation]:
    """The standard conversations for ``fam``, by name, each valid for its template.

    ``single_call``: one call, its result, a final answer. ``parallel_calls``: two calls in one
    message (or two consecutive call messages where the family takes one call per message)
    and their results. ``follow_up``: a user follow-up after the tool round, answered with
    another call. ``user_after_tool``: a user message right after tool results, where the
    family accepts it. ``reasoning``: assistant turns with ``reasoning_content``, for
    families that render reasoning.
    """
    system = {"role": "system", "content": "You answer briefly."}
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    paris = _call(fam, 1, "get_weather", {"city": "Paris"})
    single = [
        system,
        ask,
        _calls(fam, "Let me check.", paris),
        _result(fam, 1, "sunny, 21 C"),
        {"role": "assistant", "content": "It is sunny in Paris, 21 C."},
    ]
    rome = _call(fam, 2, "get_weather", {"city": "Rome", "days": 2})
    add = _call(fam, 3, "add", {"a": 2, "b": 3})
    ask2 = {"role": "user", "content": "Weather in Rome for two days, and what is 2 + 3?"}
    if fam.parallel_calls:
        parallel = [system, ask2, _calls(fam, "Two calls.", rome, add), _result(fam, 2, "rain"), _result(fam, 3, "5")]
    else:
        parallel = [system, ask2, _calls(fam, "First.", rome), _result(fam, 2, "rain")]
        parallel += [_calls(fam, "Second.", add), _result(fam, 3, "5")]
    parallel.append({"role": "assistant", "content": "Rain in Rome; 2 + 3 = 5."})
    follow_up = single + [
        {"role": "user", "content": "And in Rome?"},
        _calls(fam, "Checking Rome.", rome),
        _result(fam, 2, "rain"),
        {"role": "assistant", "content": "Rain in Rome."},
    ]
    convs = {
        "single_call": Conversation("single_call", single),
        "parallel_calls": Conversation("parallel_calls", parallel),
        "follow_up": Conversation("follow_up", follow_up),
    }
    if fam.user_after_tool:
        after_tool = single[:4] + [
            {"role": "user", "content": "Never mind, what is 2 + 3?"},
            {"role": "assistant", "content": "5."},
        ]
        convs["user_after_tool"] = Conversation("user_after_tool", after_tool)
    if fam.reasoning:
        thought = dict(_calls(fam, "", paris), reasoning_content="The user wants Paris weather; call the tool.")
        answer = {
            "role": "assistant",
            "content": "It is sunny in Paris.",
            "reasoning_content": "The tool said sunny.",
        }
        reasoning = [system, ask, thought, _result(fam, 1, "sunny"), answer]
        reasoning += [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]
        convs["reasoning"] = Conversation("reasoning", reasoning)
    return convs


# --- Rendering and the prefix property -------------------------------------------------------


def render(
    fam: Family,
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
) -> str:
    """The text ``fam``'s template renders for ``messages`` on ``tokenizer``."""
    kwargs: dict[str, Any] = dict(fam.template_kwargs)
    if fam.chat_template is not None:
        kwargs["chat_template"] = fam.chat_template
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=list(tools) if tools is not None else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
    return text


@dataclass(frozen=True)
class PrefixBreak:
    """Where the render of a conversation's first ``cut`` messages stops being a prefix of the whole."""

    cut: int
    generation_prompt: bool
    offset: int
    shorter: str
    longer: str
    before: str = ""

    def shows(self, marker: str) -> bool:
        """Whether ``marker`` is in the shorter render where it diverges (it may start just before)."""
        return marker in self.before[-len(marker) :] + self.shorter

    def __str__(self) -> str:
        prompt = " + generation prompt" if self.generation_prompt else ""
        return (
            f"messages[:{self.cut}]{prompt} diverges at character {self.offset}: "
            f"it has {self.shorter!r}, the whole conversation has {self.longer!r}"
        )


@dataclass(frozen=True)
class Stability:
    """The prefix property of one family on one conversation."""

    family: str
    conversation: str
    breaks: tuple[PrefixBreak, ...]

    @property
    def prefix_stable(self) -> bool:
        return not self.breaks


def _diverge(shorter: str, longer: str) -> int:
    n = min(len(shorter), len(longer))
    for i in range(n):
        if shorter[i] != longer[i]:
            return i
    return n


def render_stability(
    fam: Family, tokenizer: Any, conversation: Conversation, *, every_message: bool = False, context: int = 40
) -> Stability:
    """Check that the renders of a conversation's turn boundaries are prefixes of the whole.

    The boundaries are those of an episode: before each assistant message, rendered with the
    generation prompt (what the policy is prompted with), and after each assistant message,
    rendered without it. ``every_message`` also cuts between the messages of one observation
    (between consecutive tool results, between tool results and a user message). Cuts start
    after the first user message: some templates need one to place the tool list.
    """
    messages = conversation.messages
    whole = render(fam, tokenizer, messages, conversation.tools)
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    breaks = []
    for cut in range(first_user + 1, len(messages)):
        gen = messages[cut]["role"] == "assistant"
        if not (gen or every_message or messages[cut - 1]["role"] == "assistant"):
            continue
        part = render(fam, tokenizer, messages[:cut], conversation.tools, add_generation_prompt=gen)
        if not whole.startswith(part):
            at = _diverge(part, whole)
            breaks.append(
                PrefixBreak(cut, gen, at, part[at : at + context], whole[at : at + context], part[max(0, at - context) : at])
            )
    return Stability(fam.name, conversation.name, tuple(breaks))


def rendered_turn(
    fam: Family,
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    index: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The text ``fam`` renders for assistant message ``messages[index]``: what a model of the family writes.

    It is the render up to and including the message minus the prompt before it (with the
    generation prompt), so it ends with the turn's own closing text (end-of-turn token and
    the glue after it). Parser tests feed it to the family's parser.
    """
    if messages[index]["role"] != "assistant":
        raise ValueError(f"messages[{index}] is a {messages[index]['role']} message, not an assistant one")
    prompt = render(fam, tokenizer, messages[:index], tools, add_generation_prompt=True)
    upto = render(fam, tokenizer, messages[: index + 1], tools)
    if not upto.startswith(prompt):
        at = _diverge(prompt, upto)
        raise ValueError(
            f"{fam.name}: the prompt before messages[{index}] is not a prefix of the render with it "
            f"(at character {at}: {prompt[at : at + 40]!r} vs {upto[at : at + 40]!r})"
        )
    return upto[len(prompt) :]


def drops_none_keys(tokenizer: Any) -> bool:
    """Whether this transformers drops ``None``-valued message keys before rendering (5.x does)."""
    probe = "{{ 'kept' if 'content' in messages[0] else 'dropped' }}"
    text = tokenizer.apply_chat_template(
        [{"role": "assistant", "content": None}], chat_template=probe, tokenize=False
    )
    return text == "dropped"
