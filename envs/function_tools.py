"""Function tools: plain Python callables with a JSON schema, validated arguments and enforced timeouts.

A tool is any sync or async callable. Its schema comes from its signature and Google-style
docstring through ``transformers.utils.get_json_schema`` (the schema chat templates expect);
:func:`tool` (a decorator) or :class:`Tool` can override the name, description or the whole
schema. A tool returns text (or bytes, or anything JSON-serialisable), or a
:class:`ToolResult` to add a reward of its own; it raises :class:`ToolError` to tell the
model what went wrong in its own words.

Per-episode state: give the environment a factory that builds fresh tools for each
episode (closures over a new dict, or the :func:`tool`-decorated methods of a new object,
collected with :func:`tools_of`). Nothing is shared between episodes unless the factory
shares it.

:class:`~tokengym.envs.tool_runner.ToolRunner` (its own module) runs the calls of a turn under
their timeouts.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolOutcome",
    "ToolResult",
    "as_tool",
    "check_arguments",
    "expand_tools",
    "is_image",
    "result_content",
    "result_text",
    "tool",
    "tools_of",
]

OutcomeStatus = Literal["ok", "error", "timeout", "unknown_tool", "invalid_arguments"]

ERROR_CHARS = 300  # longest exception message quoted back to the model


class ToolError(Exception):
    """Raised by a tool to give the model a clean error text: ``Error: <tool>: <message>``."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool may return instead of bare content: the content and a reward of its own."""

    content: Any = ""
    reward: float = 0.0


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: a tool name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one call as the model will read it (before any token-budget truncation)."""

    status: OutcomeStatus
    content: str
    reward: float = 0.0
    images: tuple[Any, ...] = ()
    """Images the tool returned, shown after ``content`` in the tool message (an env with
    ``vision=`` shows them; see :func:`result_content`)."""

    @property
    def ok(self) -> bool:
        """True when the tool ran and returned (no error, no timeout)."""
        return self.status == "ok"


# --------------------------------------------------------------------- schema
def _normalize_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``{"type": "function", "function": {...}}`` from that form or the bare function dict."""
    schema = copy.deepcopy(dict(schema))
    if "function" in schema:
        fn = dict(schema["function"])
    elif "name" in schema:
        fn = schema
    else:
        raise ValueError(
            'a tool schema is {"type": "function", "function": {"name": ..., "parameters": {...}}} '
            f'or the inner {{"name": ..., "parameters": {{...}}}}; got keys {sorted(schema)}'
        )
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError("a tool schema needs a non-empty 'name'")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, Mapping) or params.get("type", "object") != "object"):
        raise ValueError(f"tool {fn['name']!r}: 'parameters' must be a JSON schema of type object")
    return {"type": "function", "function": fn}


def _is_async(fn: Callable[..., Any]) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)
    return not inspect.isfunction(fn) and not inspect.ismethod(fn) and inspect.iscoroutinefunction(call)


class Tool:
    """A callable the model can call, with its schema.

    Args:
        fn: a sync or async callable. Its schema comes from ``get_json_schema`` (type hints plus a
            Google-style docstring with an ``Args:`` entry per argument) unless ``schema`` is given.
        name, description: override the schema's.
        schema: the whole schema (``{"type": "function", "function": {...}}`` or the inner dict).
        timeout: seconds per call; ``None`` uses the runner's default.
        parallel: ``False`` runs this tool's calls one after another in call order (stateful tools).

    Used as a method decorator (through :func:`tool`), it binds to the instance like a method,
    and the schema leaves out ``self``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        schema: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        parallel: bool = True,
    ) -> None:
        if isinstance(fn, Tool):
            raise TypeError("already a Tool: pass its .fn, or use the Tool itself")
        if not callable(fn):
            raise TypeError(f"a tool must be callable, got {type(fn).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.fn = fn
        self.timeout = timeout
        self.parallel = parallel
        self.is_async = _is_async(fn)
        self._name = name
        self._description = description
        self._override = _normalize_schema(schema) if schema is not None else None
        self._schema: dict[str, Any] | None = None
        functools.update_wrapper(self, fn, updated=())  # type: ignore[arg-type]

    # A Tool used as a method decorator binds like a function does.
    def __set_name__(self, owner: type, attr: str) -> None:
        self._attr = attr

    def __get__(self, obj: Any, objtype: type | None = None) -> Tool:
        binder = getattr(self.fn, "__get__", None)
        if obj is None or binder is None:
            return self
        bound = Tool(
            binder(obj, objtype),
            name=self._name,
            description=self._description,
            schema=self._override,
            timeout=self.timeout,
            parallel=self.parallel,
        )
        attr = getattr(self, "_attr", None)
        if attr is not None:
            try:  # cache on the instance: later lookups skip the schema work
                obj.__dict__[attr] = bound
            except (AttributeError, TypeError):
                pass
        return bound

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style schema chat templates render: ``{"type": "function", "function": {...}}``."""
        return copy.deepcopy(self._built_schema())

    def _built_schema(self) -> dict[str, Any]:
        """The schema, built once; callers here only read it (``schema`` hands out copies)."""
        if self._schema is None:
            if self._override is not None:
                schema = copy.deepcopy(self._override)
            else:
                from transformers.utils import get_json_schema

                try:
                    schema = get_json_schema(self.fn)
                except Exception as err:  # DocstringParsingException, TypeHintParsingException
                    fname = getattr(self.fn, "__name__", repr(self.fn))
                    raise ValueError(
                        f"cannot build a JSON schema for tool {fname!r}: {err}.{_misspelled_arg(self.fn, str(err))} "
                        "Give every argument a type hint and an 'Args:' entry in a Google-style docstring, or pass "
                        "schema=..."
                    ) from err
            if self._name is not None:
                schema["function"]["name"] = self._name
            if self._description is not None:
                schema["function"]["description"] = self._description
            self._schema = schema
        return self._schema

    @property
    def name(self) -> str:
        """The name the model calls the tool by (from the schema)."""
        if self._name is not None:
            return self._name
        if self._override is not None:
            return str(self._override["function"]["name"])
        return str(self._built_schema()["function"]["name"])

    @property
    def parameters(self) -> dict[str, Any] | None:
        """The JSON schema of the arguments, or ``None`` for a tool without parameters (a copy)."""
        return copy.deepcopy(self.argument_schema)

    @property
    def argument_schema(self) -> Mapping[str, Any] | None:
        """:attr:`parameters` itself, not a copy, for code that only reads it (the tool runner's
        argument check, every call): do not modify it."""
        return self._built_schema()["function"].get("parameters")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        kind = "async " if self.is_async else ""
        try:
            name = self.name
        except ValueError:  # no schema can be built: still say which function this is
            name = getattr(self.fn, "__name__", "?")
        return f"<{kind}Tool {name!r}{'' if self.parallel else ' sequential'}>"


def _misspelled_arg(fn: Callable[..., Any], message: str) -> str:
    """`` The docstring's 'Args:' has 'itme', near 'item'.`` when the argument the schema misses a
    description for is near an 'Args:' entry that names no argument, else ``""``."""
    import re

    from .near_names import did_you_mean

    missing = re.search(r"no description for the argument '([^']+)'", message)
    doc = inspect.getdoc(fn) or ""
    section = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc, re.MULTILINE)
    if missing is None or section is None:
        return ""
    entries = re.findall(r"^[ \t]+(\w+)\s*(?:\([^)]*\))?:", section.group(1), re.MULTILINE)
    params = set(inspect.signature(fn).parameters)
    strays = [e for e in entries if e not in params]
    near = did_you_mean(missing.group(1), strays, n=1).removeprefix("did you mean ").removesuffix("? ")
    return f" The docstring's 'Args:' has {near}, which names no argument: a misspelling of {missing.group(1)!r}?" if near else ""


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    schema: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    parallel: bool = True,
) -> Any:
    """Decorator: ``@tool`` or ``@tool(name=..., timeout=..., parallel=False, schema=...)``. See :class:`Tool`."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, schema=schema, timeout=timeout, parallel=parallel)

    return wrap(fn) if fn is not None else wrap


def as_tool(obj: Tool | Callable[..., Any]) -> Tool:
    """A :class:`Tool` for a callable (a Tool is returned as is)."""
    return obj if isinstance(obj, Tool) else Tool(obj)


def tools_of(obj: Any) -> list[Tool]:
    """The :func:`tool`-decorated methods of ``obj``, bound to it, in definition order."""
    names: list[str] = []
    for klass in reversed(type(obj).__mro__):
        for attr, value in vars(klass).items():
            if isinstance(value, Tool) and attr not in names:
                names.append(attr)
    if not names:
        raise ValueError(f"{type(obj).__name__} has no @tool methods")
    return [getattr(obj, attr) for attr in names]


def expand_tools(tools: Iterable[Any]) -> list[Tool]:
    """Tools from what an env was given: a tool or a callable is one tool, anything else (an
    object with ``@tool`` methods) gives all of its tools, so envs accept the three alike."""
    out: list[Tool] = []
    for t in tools:
        if isinstance(t, Tool) or callable(t):
            out.append(as_tool(t))
        else:
            out.extend(tools_of(t))
    return out


# ----------------------------------------------------------------- validation
def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _describe(value: Any) -> str:
    kind = _json_type(value)
    if kind in ("array", "object"):
        return kind
    shown = json.dumps(value, ensure_ascii=False) if kind != "null" else ""
    if len(shown) > 40:
        shown = shown[:37] + '..."' if kind == "string" else shown[:37] + "..."
    return f"{kind} {shown}".strip()


def _matches(kind: str, value: Any) -> tuple[bool, Any]:
    if kind == "integer":
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, value
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if kind == "string":
        return isinstance(value, str), value
    if kind == "boolean":
        return isinstance(value, bool), value
    if kind == "null":
        return value is None, value
    if kind == "array":
        return isinstance(value, (list, tuple)), value
    if kind == "object":
        return isinstance(value, Mapping), value
    return True, value  # a type this validator does not know: do not refuse the call


def _check(schema: Any, value: Any, where: str, errors: list[str]) -> Any:
    """Validate ``value`` against a JSON-schema subset (the one get_json_schema emits); return it, coerced."""
    if not isinstance(schema, Mapping) or not schema:
        return value
    if value is None and schema.get("nullable"):
        return None
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, Sequence) and options:
            for option in options:
                sub: list[str] = []
                coerced = _check(option, value, where, sub)
                if not sub:
                    return coerced
            kinds = [o.get("type") for o in options if isinstance(o, Mapping) and isinstance(o.get("type"), str)]
            shape = " or ".join(kinds) if len(kinds) == len(options) else "one of the allowed forms"
            errors.append(f"{where} must be {shape}, got {_describe(value)}")
            return value
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, Sequence) and types:
        if schema.get("nullable") and "null" not in types:
            types = [*types, "null"]
        for kind in types:
            ok, coerced = _matches(kind, value)
            if ok:
                value = coerced
                break
        else:
            errors.append(f"{where} must be {' or '.join(types)}, got {_describe(value)}")
            return value
    enum = schema.get("enum")
    if isinstance(enum, Sequence) and value not in enum:
        errors.append(f"{where} must be one of {json.dumps(list(enum), ensure_ascii=False)}, got {_describe(value)}")
        return value
    if isinstance(value, (list, tuple)):
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        out = list(value)
        if isinstance(prefix, Sequence) and prefix:
            if len(value) != len(prefix):
                errors.append(f"{where} must have {len(prefix)} items, got {len(value)}")
                return value
            for i, (s, v) in enumerate(zip(prefix, value)):
                out[i] = _check(s, v, f"{where}[{i}]", errors)
        elif isinstance(items, Mapping):
            for i, v in enumerate(value):
                out[i] = _check(items, v, f"{where}[{i}]", errors)
        return out
    if isinstance(value, Mapping):
        props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        extra_schema = schema.get("additionalProperties")
        out_obj = dict(value)
        for req in schema.get("required") or ():
            if req not in value:
                errors.append(f'{where} is missing the key "{req}"')
        for k, v in value.items():
            if k in props:
                out_obj[k] = _check(props[k], v, f"{where}.{k}", errors)
            elif extra_schema is False:
                errors.append(f'{where} has an unexpected key "{k}"')
            elif isinstance(extra_schema, Mapping):
                out_obj[k] = _check(extra_schema, v, f"{where}.{k}", errors)
        return out_obj
    return value


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def check_arguments(parameters: Mapping[str, Any] | None, arguments: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Validate call arguments against a tool's ``parameters`` schema.

    Returns the arguments (integers written as ``3.0`` become ``3``) and the problems found,
    each a short phrase for the model: ``missing required argument "b"``, ``unexpected
    argument "c" (it takes a, b)``, ``argument "a" must be integer, got string "x"``.
    Unknown top-level arguments are refused unless the schema sets ``additionalProperties``.
    """
    args = dict(arguments)
    if not parameters:
        return args, []
    props = parameters.get("properties") if isinstance(parameters.get("properties"), Mapping) else {}
    errors: list[str] = []
    missing = [r for r in parameters.get("required") or () if r not in args]
    if missing:
        errors.append(f"missing required argument{'s' if len(missing) > 1 else ''} {_quoted(missing)}")
    extra_schema = parameters.get("additionalProperties", False)
    extra = [k for k in args if k not in props]
    if extra and not extra_schema:
        takes = f"it takes {', '.join(props)}" if props else "it takes no arguments"
        errors.append(f"unexpected argument{'s' if len(extra) > 1 else ''} {_quoted(extra)} ({takes})")
    for k, v in list(args.items()):
        if k in props:
            args[k] = _check(props[k], v, f'argument "{k}"', errors)
        elif isinstance(extra_schema, Mapping):
            args[k] = _check(extra_schema, v, f'argument "{k}"', errors)
    return args, errors


# -------------------------------------------------------------------- results
def clean_text(text: str) -> str:
    """Valid UTF-8 text: lone surrogates (e.g. from surrogateescape) become U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def is_image(value: Any) -> bool:
    """A PIL image (PIL is imported only by whoever made one)."""
    image_module = sys.modules.get("PIL.Image")
    return image_module is not None and isinstance(value, image_module.Image)


def result_content(value: Any) -> tuple[str, tuple[Any, ...], float]:
    """The text, the images and the tool's own reward of a tool's return value.

    A tool may return an image (a PIL image), or a list or tuple of strings and images: the
    strings are the text (joined by newlines), the images follow it in the tool message. Any
    other value is :func:`result_text`'s (no images).
    """
    reward = 0.0
    if isinstance(value, ToolResult):
        reward = float(value.reward)
        value = value.content
    if is_image(value):
        return "", (value,), reward
    if isinstance(value, (list, tuple)) and any(is_image(v) for v in value):
        texts = [result_text(v)[0] for v in value if not is_image(v)]
        return "\n".join(texts), tuple(v for v in value if is_image(v)), reward
    text, _ = result_text(value)
    return text, (), reward


def result_text(value: Any) -> tuple[str, float]:
    """The text a tool's return value shows the model, and the tool's own reward.

    ``str`` as is; ``bytes`` decoded as UTF-8 with invalid bytes replaced (U+FFFD);
    :class:`ToolResult` unwrapped; anything else as JSON (``str()`` for what JSON cannot hold).
    """
    reward = 0.0
    if isinstance(value, ToolResult):
        reward = float(value.reward)
        value = value.content
    if isinstance(value, str):
        text = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).decode("utf-8", errors="replace")
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    return clean_text(text), reward
