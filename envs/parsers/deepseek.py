"""The DeepSeek V3 / R1 / V3.1 call format, registered as ``"deepseek_v3"`` (``"deepseek"``,
``"deepseek_r1"``): ``<｜tool▁calls▁begin｜>`` blocks with a fenced JSON body, or V3.1's
``NAME<｜tool▁sep｜>{json}``.
"""

from __future__ import annotations

from .base import ParsedCall, Schemas, ToolCallParser

__all__ = ["DeepSeekParser"]


class DeepSeekParser(ToolCallParser):
    """DeepSeek V3 / R1 calls, and V3.1's shorter form::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
        ```json
        {"arg": 1}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    """

    name = "deepseek_v3"
    calls_begin = "<｜tool▁calls▁begin｜>"
    calls_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    sep = "<｜tool▁sep｜>"
    hint = (
        "Write the calls as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>TOOL_NAME\n"
        '```json\n{"arg": "value"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>.'
    )

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        return self._sectioned(text, (self.calls_begin, self.calls_end, self.call_begin, self.call_end), self._one)

    def _one(self, index: int, body: str) -> ParsedCall:
        raw = body.strip()
        if self.sep not in body:
            return self._error(index, raw, f"has no {self.sep} between the call type and the tool name")
        head, rest = body.split(self.sep, 1)
        if rest.lstrip().startswith("{"):  # V3.1: NAME<sep>{json}
            name = head.strip()
            return self._json_args(index, raw, "" if name == "function" else name, rest)
        name, _, args = rest.partition("\n")
        args = args.strip()
        if args.startswith("```"):
            args = args.split("\n", 1)[1] if "\n" in args else ""
            if not args.rstrip().endswith("```"):
                return self._error(index, raw, "has a ```json block without its closing ```", name.strip())
            args = args.rstrip()[:-3]
        return self._json_args(index, raw, name.strip(), args)
