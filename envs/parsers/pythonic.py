"""The pythonic call format (Llama 3.2/4, Gemma 3), registered as ``"pythonic"`` (``"llama3_pythonic"``,
``"gemma"``): a Python list of calls with literal keyword arguments, ``[f(a=1, b="x"), g()]``.

The calls are read with :mod:`ast` and only literals are accepted: nothing the model writes is
ever evaluated.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from .base import GUARDED, MAX_ARGUMENT_DEPTH, ParsedCall, Schemas, ToolCallParser, error_reason

__all__ = ["PythonicParser"]

_MAX_INT_BITS = 14_000  # about 4,200 decimal digits: below Python's int-to-text limit (4,300 digits)


class _NotLiteral(Exception):
    """An argument that is not a literal: said to the model, never evaluated."""


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST, depth: int = 0) -> Any:
    """The value of a literal expression; :class:`_NotLiteral` for anything else (nothing is evaluated)."""
    if depth > MAX_ARGUMENT_DEPTH:
        raise _NotLiteral(f"is nested more than {MAX_ARGUMENT_DEPTH} levels deep")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
            return value
        if isinstance(value, int):
            if value.bit_length() > _MAX_INT_BITS:
                raise _NotLiteral("is an integer too large to use")
            return value
        raise _NotLiteral(f"is a {type(value).__name__} literal (use a string, number, boolean, None, list or dict)")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant):
        value = _literal(node.operand, depth + 1)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise _NotLiteral("is a dict whose keys are not all strings")
            out[k.value] = _literal(v, depth + 1)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:  # the JSON spelling some templates print
        return _JSON_NAMES[node.id]
    kind = {ast.Name: "a variable", ast.Call: "a function call", ast.Attribute: "an attribute", ast.BinOp: "an expression"}
    raise _NotLiteral(f"is {kind.get(type(node), 'not a literal')}; only strings, numbers, booleans, None, lists and dicts are accepted")


_PY_LIST_START = re.compile(r"^[ \t]*\[\s*[A-Za-z_][\w.]*\s*\(", re.M)


def _python_end(s: str, start: int) -> int:
    """Index just past the bracket that closes ``s[start]``, skipping Python strings and
    comments; ``-1`` when it is never closed. Iterative: any nesting depth is fine."""
    depth, i, n = 0, start, len(s)
    while i < n:
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == "#":
            nl = s.find("\n", i)
            i = n if nl < 0 else nl
            continue
        elif c in "'\"":
            quote = s[i : i + 3] if s[i : i + 3] in ("'''", '"""') else c
            i += len(quote)
            while i < n and not s.startswith(quote, i):
                i += 2 if s[i] == "\\" else 1
            i += len(quote)
            continue
        i += 1
    return -1


class PythonicParser(ToolCallParser):
    """A Python list of calls, ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2/4, Gemma 3).

    The list may stand alone (from the start of a line; text after it is ignored), or sit in
    ``<|python_start|>...<|python_end|>`` (Llama 4) or a ```` ```tool_code ```` fence (Gemma), where
    bare calls ``f(a=1)`` one per line are accepted too. It is parsed with :mod:`ast` and only
    literals are accepted as arguments (strings, numbers, booleans, None, lists, dicts, and
    JSON's ``true``/``false``/``null``): nothing is evaluated; anything else is an error.
    """

    name = "pythonic"
    hint = 'Write the calls as a Python list of keyword-argument calls: [tool_a(x=1, y="text"), tool_b()].'

    def _parse(self, text: str, schemas: Schemas) -> list[ParsedCall]:
        for open_mark, close_mark in (("<|python_start|>", "<|python_end|>"), ("```tool_code", "```")):
            at = text.find(open_mark)
            if at >= 0:
                body = at + len(open_mark)
                end = text.find(close_mark, body)
                if end < 0 and close_mark == "```":
                    return [self._error(0, text[body:].strip(), "is not closed: ```tool_code without a closing ```")]
                return self._calls(text[body : end if end >= 0 else len(text)].strip(), wrapped=True)
        found = _PY_LIST_START.search(text)
        if found is None:
            return []
        start = text.index("[", found.start())
        end = _python_end(text, start)
        if end < 0:
            return [self._error(0, text[start:].strip(), "is not closed: the list has no closing ]")]
        return self._calls(text[start:end], wrapped=False)

    def _calls(self, source: str, *, wrapped: bool) -> list[ParsedCall]:
        if not source:
            return [self._error(0, source, "is empty")]
        try:
            module = ast.parse(source, mode="exec")
        except GUARDED as err:
            return [self._error(0, source, f"is not valid Python ({error_reason(err)})")]
        exprs = [s.value for s in module.body if isinstance(s, ast.Expr)]
        if len(exprs) != len(module.body) or not exprs:
            return [self._error(0, source, "must be a list of calls, not statements")]
        if len(exprs) == 1 and isinstance(exprs[0], ast.List):
            elements = exprs[0].elts
        elif wrapped:
            elements = exprs
        else:
            return [self._error(0, source, "must be a list of calls")]
        if not elements:
            return [self._error(0, source, "is an empty list")]
        return [self._one(i, source, e) for i, e in enumerate(elements)]

    def _one(self, index: int, source: str, node: ast.expr) -> ParsedCall:
        raw = ast.get_source_segment(source, node) or ""
        if not isinstance(node, ast.Call):
            return self._error(index, raw, "is not a function call")
        if not isinstance(node.func, ast.Name):
            return self._error(index, raw, "must call a tool by its plain name")
        name = node.func.id
        if node.args:
            return self._error(index, raw, "has positional arguments; write every argument as name=value", name)
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return self._error(index, raw, "unpacks **arguments; write every argument as name=value", name)
            if kw.arg in args:
                return self._error(index, raw, f'gives argument "{kw.arg}" twice', name)
            try:
                args[kw.arg] = _literal(kw.value)
            except _NotLiteral as err:
                return self._error(index, raw, f': argument "{kw.arg}" {err}', name)
        return ParsedCall(index, raw, name=name, arguments=args)
