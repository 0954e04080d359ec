"""Tool-call parsers: the assistant's generated text -> tool calls, or precise error texts.

Each parser knows one model family's format (registered names, aliases in brackets):

* ``"hermes"`` (``"qwen"``, ``"chatml"``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn (Qwen2.5, Qwen3, Hermes and templates that copy them);
* ``"llama3_json"`` (``"llama3"``): a turn that *starts* with ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``;`` or whitespace (Llama 3.1-3.3);
* ``"pythonic"`` (``"llama3_pythonic"``, ``"gemma"``): a Python list of calls with literal
  keyword arguments, ``[f(a=1, b="x"), g()]`` (Llama 3.2/4, Gemma 3), optionally inside
  ``<|python_start|>...<|python_end|>`` or a ```` ```tool_code ```` fence;
* ``"qwen3_coder"``: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``;
  values are text, converted with the tool's JSON schema when the schemas are passed;
* ``"deepseek_v3"`` (``"deepseek"``, ``"deepseek_r1"``): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``
  and a fenced JSON block, or V3.1's ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>``;
* ``"mistral"``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}]`` or the
  newer ``[TOOL_CALLS]NAME[ARGS]{json}``; ids are 9 letters or digits;
* ``"xlam"``: the turn is a JSON list ``[{"name": ..., "arguments": {...}}]`` (or holds one in a
  ```` ```json ```` fence);
* ``"granite"``: ``<|tool_call|>[{"name": ..., "arguments": {...}}]``;
* ``"kimi_k2"`` (``"kimi"``): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{json}<|tool_call_end|>``,
  the model's id (``functions.NAME:0``) kept for the result;
* ``"glm45"`` (``"glm47"``, ``"glm"``, ``"glm4_moe"``): ``<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>``
  (GLM-4.5 to 4.7; without the line breaks in 4.7); values are text for strings and JSON otherwise;
* ``"harmony"`` (``"gpt_oss"``, ``"openai"``): gpt-oss's messages to ``functions.NAME``,
  ``<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{json}<|call|>``;
  it also splits a turn into analysis, answer and call (:meth:`~HarmonyParser.split_message`);
* ``"gemma4"``: ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>`` in Gemma's own argument notation;
* ``"muse_glimmer"`` (``"atem"``): ``<atem:function_calls>\n<atem:invoke name="NAME">\n<atem:parameter name="KEY">VALUE</atem:parameter>\n</atem:invoke>\n</atem:function_calls>``;
* ``"minimax_m2"`` (``"minimax"``): ``<minimax:tool_call>\n<invoke name="NAME"><parameter name="KEY">VALUE</parameter>\n</invoke>\n</minimax:tool_call>``;
* ``"deepseek_v32"`` (``"deepseek_v4"``, ``"dsml"``): DeepSeek V3.2's and V4's DSML,
  ``<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>\n</｜DSML｜invoke>``
  inside ``<｜DSML｜function_calls>`` (V4: ``tool_calls``); the strings' text, JSON otherwise.

:func:`detect_parser` picks a family from a chat template (:func:`detect_parser_evidence` also
says what decided it, or that it guessed), :func:`get_parser` resolves a name, an instance or
``None`` (auto), :func:`register_parser` adds a family. A malformed call is returned as a
:class:`ParsedCall` whose ``error`` is the text the model reads, ending with the family's
:attr:`~ToolCallParser.hint`; nothing is dropped and nothing the model writes makes a parser
raise: deep nesting, huge numbers and other hostile text become errors the model reads.
:func:`call_evidence` says why a turn that no parser call was found in still looks like a
tool call (another family's marker, or a call naming one of the episode's tools), so that
:class:`~tokengym.envs.ToolEnv` can answer with an error instead of scoring it.

One module per family (``hermes``, ``llama3_json``, ``pythonic``, ``qwen3_coder``, ``deepseek``,
``mistral``, ``xlam``, ``granite``, ``kimi_k2``, ``glm``, ``harmony``, ``gemma4``, ``invoke``); ``base`` holds :class:`ToolCallParser` and what every family
shares, ``registry`` the names and the detection from chat templates, ``evidence``
:func:`call_evidence`. This package re-exports their public names.
"""

from .base import MAX_ARGUMENT_DEPTH, ParsedCall, Schemas, ToolCallParser, parse_calls
from .deepseek import DeepSeekParser
from .evidence import CALL_MARKERS, call_evidence
from .granite import GraniteParser
from .hermes import HermesParser
from .gemma4 import Gemma4Parser
from .glm import GLMParser
from .harmony import HarmonyParser
from .invoke import AtemParser, DSMLParser, MiniMaxM2Parser
from .kimi_k2 import KimiK2Parser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .pythonic import PythonicParser
from .qwen3_coder import Qwen3CoderParser
from .registry import PARSERS, ParserDetection, detect_parser, detect_parser_evidence, get_parser, register_parser
from .xlam import XLAMParser

# ``Schemas`` (the type of ``tools=``) is an attribute here too, outside ``__all__``.

__all__ = [
    "AtemParser",
    "CALL_MARKERS",
    "MAX_ARGUMENT_DEPTH",
    "PARSERS",
    "DSMLParser",
    "DeepSeekParser",
    "GraniteParser",
    "HermesParser",
    "GLMParser",
    "Gemma4Parser",
    "HarmonyParser",
    "KimiK2Parser",
    "Llama3JsonParser",
    "MiniMaxM2Parser",
    "MistralParser",
    "ParsedCall",
    "ParserDetection",
    "PythonicParser",
    "Qwen3CoderParser",
    "ToolCallParser",
    "XLAMParser",
    "call_evidence",
    "detect_parser",
    "detect_parser_evidence",
    "get_parser",
    "parse_calls",
    "register_parser",
]
