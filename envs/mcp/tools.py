"""MCPTools: an MCP server's tools as tokengym tools.

:class:`MCPTools` is a *description* of a server (a command or a URL and how long a connection
lives), cheap to build and to pickle, so it travels in env kwargs to Ray workers and into the
store's run settings; an env opens it (:meth:`MCPTools.open`) when it is built, which starts
the server and lists its tools. Each listed tool becomes a :class:`~tokengym.envs.Tool` whose
schema is the server's ``inputSchema`` and whose function is an async call through the
connection, so the tool runner treats it as it treats Python tools: arguments checked against
the schema, a timeout that cancels the call, output cut to the token budget, every failure a
message the model reads.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..function_tools import Tool, ToolError
from .server import MCPServer, MCPServerError, ServerSpec, command_of

__all__ = ["MCPTools", "OpenMCPTools", "Scope", "mcp_tools_of", "result_parts_of", "result_text_of"]

log = logging.getLogger(__name__)

Scope = Literal["env", "process", "episode"]
SCOPES: tuple[str, ...] = ("env", "process", "episode")


@dataclass(frozen=True)
class MCPTools:
    """The tools of one MCP server, for ``ToolEnv(tokenizer, tasks, tools=[MCPTools(...), ...])``.

    Args:
        command: the command that starts a stdio server: an argv list or one string split as a
            shell splits it (``"uvx mcp-server-time"``).
        url: instead of ``command``, a streamable-HTTP server's endpoint (``http://host:port/mcp``).
        env: environment variables for a stdio server, on top of the few the SDK passes on
            (``HOME``, ``PATH``, ``USER``...).
        cwd: a stdio server's working directory.
        scope: how long one server lives. ``"env"`` (default): one server per env copy, kept
            across its episodes. ``"episode"``: a fresh server for every episode, the only reset
            MCP itself offers (state a server keeps on disk is the server's to reset).
            ``"process"``: one server shared by every env of this process that names the same
            server (started by the first, stopped with the last).
        include, exclude: tool names to keep (only these) or to leave out; a name the server
            does not list is an error.
        prefix: prepended to every tool name the model sees (``"time_"``), so that two servers
            with a tool of the same name can share an env; the server is called by its own name.
        timeout: seconds per call (the env's ``tool_timeout`` when None); the call is cancelled
            on the server when it runs out.
        start_timeout: seconds a server has to start and list its tools; past them the env's
            construction fails, quoting its stderr.
        ping_timeout: after a call timed out, the next episode first pings the server; one that
            does not answer within this is restarted.
        sandbox: run the command inside a sandbox, for a server you do not trust: ``"local"``
            (bubblewrap: no network, a read-only system, an empty workspace as its home; the
            command's own virtualenv or directory is shown read-only), ``"docker"`` (``docker exec``
            in a fresh container: the server must be in the image) or a dict
            ``{"backend": "docker", "image": ..., "memory_mb": ...}`` of the sandbox's arguments
            (:func:`~tokengym.envs.sandbox.make_sandbox`). The sandbox's limits hold for the server's
            whole life, so ``cpu_s`` defaults to 3600 here and ``memory_mb`` to 1024. A restart
            resets the sandbox: what the server wrote is gone, as after ``scope="episode"``.

    A server that stops (or is found hung) mid-episode answers every later call of the episode
    with an error message, and is restarted when the next episode begins; the episode's
    ``tool_stats["server_restarts"]`` counts it, and the run's summary shows the total.
    """

    command: str | Sequence[str] | None = None
    url: str | None = None
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    scope: Scope = "env"
    include: Sequence[str] | None = None
    exclude: Sequence[str] = ()
    prefix: str = ""
    timeout: float | None = None
    start_timeout: float = 60.0
    ping_timeout: float = 5.0
    sandbox: str | Mapping[str, Any] | None = None
    _spec: ServerSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError("MCPTools needs exactly one of command=[...] (a stdio server) or url=... (streamable HTTP)")
        if self.url is not None and not str(self.url).startswith(("http://", "https://")):
            raise ValueError(f"an MCP server url is http:// or https://, got {self.url!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        for name, value in (("timeout", self.timeout), ("start_timeout", self.start_timeout), ("ping_timeout", self.ping_timeout)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive seconds, got {value!r}")
        if self.url is not None and (self.env or self.cwd):
            raise ValueError("env= and cwd= start a stdio server; a url= server is started by someone else")
        command = command_of(self.command) if self.command is not None else ()
        env = tuple(sorted((str(k), str(v)) for k, v in (self.env or {}).items()))
        backend, options = _sandbox_of(self.sandbox, url=self.url, cwd=self.cwd)
        spec = ServerSpec(command, self.url, env, self.cwd, float(self.start_timeout), backend, options)
        object.__setattr__(self, "_spec", spec)

    @classmethod
    def coerce(cls, value: MCPTools | str | Sequence[str] | Mapping[str, Any]) -> MCPTools:
        """An :class:`MCPTools` from the JSON-able forms env kwargs and the CLI carry: a command
        string or argv list, an ``http(s)://`` URL, or a dict of this class's arguments."""
        if isinstance(value, MCPTools):
            return value
        if isinstance(value, Mapping):
            return cls(**dict(value))
        if isinstance(value, str) and value.startswith(("http://", "https://")):
            return cls(url=value)
        if isinstance(value, str) or (isinstance(value, Sequence) and all(isinstance(a, str) for a in value)):
            return cls(command=value)
        raise TypeError(f"an MCP server is a command, a URL, a dict of MCPTools arguments or an MCPTools; got {value!r}")

    @property
    def label(self) -> str:
        return self._spec.label

    def open(self) -> OpenMCPTools:
        """Start (or join, for ``scope="process"``) the server and list its tools."""
        opened = OpenMCPTools(self)
        try:
            opened.start()
        except BaseException:
            opened.close()
            raise
        return opened


SERVER_LIMITS = {"cpu_s": 3600, "memory_mb": 1024}
"""A sandboxed server's limits unless given: its CPU seconds count for its whole life."""


def _sandbox_of(value: str | Mapping[str, Any] | None, *, url: str | None, cwd: str | None) -> tuple[str | None, str]:
    """The backend and the JSON of the constructor arguments of ``MCPTools(sandbox=...)``."""
    if value is None:
        return None, "{}"
    options = {"backend": value} if isinstance(value, str) else dict(value) if isinstance(value, Mapping) else None
    if options is None:
        raise TypeError(f'sandbox= is "local", "docker" or a dict of sandbox arguments with a "backend"; got {value!r}')
    backend = options.pop("backend", "local")
    if backend not in ("local", "docker"):
        raise ValueError(f'sandbox backend must be "local" or "docker", got {backend!r}')
    if url is not None:
        raise ValueError("sandbox= runs a stdio server's command; a url= server runs wherever someone started it")
    if cwd is not None:
        raise ValueError("a sandboxed server runs in its sandbox's workspace: leave cwd= out")
    options = {**SERVER_LIMITS, **options}
    try:
        return backend, json.dumps(options, sort_keys=True)
    except TypeError:
        raise TypeError(f"sandbox arguments must be JSON values (they travel with the env's kwargs), got {options!r}") from None


# ------------------------------------------------------------------ results
def result_text_of(result: Any) -> tuple[str, list[dict[str, Any]]]:
    """The text a ``CallToolResult`` shows the model, and its non-text parts kept as data.

    Text blocks are joined by newlines; structured content alone is shown as JSON; an image or
    audio block is said in the text (``[image: image/png, 1,234 bytes, kept as data]``) and kept,
    with its bytes base64 as the server sent them, in the returned list; an embedded resource
    shows its text (or is kept like an image when it is a blob); a resource link shows its URI.
    """
    parts: list[str] = []
    kept: list[dict[str, Any]] = []
    for block in getattr(result, "content", None) or ():
        kind = getattr(block, "type", None)
        if kind == "text":
            parts.append(str(block.text))
        elif kind in ("image", "audio"):
            size = _b64_size(block.data)
            kept.append({"type": kind, "mime_type": block.mime_type, "data": block.data})
            parts.append(f"[{kind}: {block.mime_type}, {size:,} bytes, kept as data]")
        elif kind == "resource":
            res = block.resource
            text = getattr(res, "text", None)
            if text is not None:
                parts.append(str(text))
            else:
                blob = getattr(res, "blob", "") or ""
                mime = getattr(res, "mime_type", None) or "application/octet-stream"
                kept.append({"type": "resource", "uri": str(res.uri), "mime_type": mime, "data": blob})
                parts.append(f"[resource {res.uri}: {mime}, {_b64_size(blob):,} bytes, kept as data]")
        elif kind == "resource_link":
            name = getattr(block, "name", "") or ""
            parts.append(f"[resource link: {block.uri}{' (' + name + ')' if name else ''}]")
        else:
            parts.append(f"[{kind or type(block).__name__} content]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, default=str))
    return "\n".join(parts), kept


_SHOWN_IMAGES = ("image/png", "image/jpeg", "image/webp", "image/gif")


def result_parts_of(result: Any) -> tuple[str, list[Any], list[dict[str, Any]]]:
    """:func:`result_text_of` for an env that shows images (``vision=``): each image block of a
    format PIL reads (PNG, JPEG, WebP, GIF) is an image of the result (a PIL image) instead of a
    note in the text and data kept; other blocks are as there. A block whose bytes do not decode
    as its type says is kept as data, and the text says so."""
    import base64

    from tokengym.envs.images import load_image

    shown: list[Any] = []
    others = []
    for block in getattr(result, "content", None) or ():
        if getattr(block, "type", None) == "image" and str(block.mime_type).lower() in _SHOWN_IMAGES:
            try:
                shown.append(load_image(base64.b64decode(block.data, validate=True)))
                continue
            except (ValueError, TypeError):
                pass  # kept as data below, and said in the text
        others.append(block)
    text, kept = result_text_of(_Blocks(others, getattr(result, "structured_content", None) if not shown else None))
    return text, shown, kept


class _Blocks:
    """A result's content blocks without the ones shown as images (what :func:`result_text_of` reads)."""

    def __init__(self, content: list[Any], structured_content: Any) -> None:
        self.content, self.structured_content = content, structured_content


def _b64_size(data: str) -> int:
    try:
        return len(base64.b64decode(data, validate=False))
    except (ValueError, TypeError):
        return len(data)


# ------------------------------------------------------------------- tools
def _schema_of(listed: Any, shown_name: str) -> dict[str, Any]:
    params = getattr(listed, "input_schema", None)
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise MCPServerError(
            f"the MCP server's tool {listed.name!r} has an inputSchema that is not a JSON schema of type object "
            f"({json.dumps(params, default=str)[:200]}); leave it out with exclude=[{listed.name!r}]"
        )
    problem = _schema_problem(params)
    if problem is not None:
        raise MCPServerError(
            f"the MCP server's tool {listed.name!r} has an inputSchema that is not a valid JSON schema ({problem}); "
            f"leave it out with exclude=[{listed.name!r}]"
        )
    params = {k: v for k, v in params.items() if k not in ("$schema", "title")}
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {"type": "function", "function": {"name": shown_name, "description": listed.description or "", "parameters": params}}


def _schema_problem(schema: Mapping[str, Any]) -> str | None:
    """What makes ``schema`` an invalid JSON schema under its own draft (2020-12 if it names
    none), or None. The SDK (whose dependency ``jsonschema`` is) only checks ``type: object``."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "the top"
        return f"at {where}: {err.message}"
    return None


class _ServerCall:
    """The async function behind one MCP tool: calls it through the live connection."""

    def __init__(self, owner: OpenMCPTools, name: str) -> None:
        self.owner = owner
        self.name = name
        self.__name__ = name

    async def __call__(self, **arguments: Any) -> Any:
        server = self.owner.server
        try:
            result = await server.call(self.name, arguments)
        except ConnectionError as err:
            raise ToolError(f"{err}; it is restarted for the next episode") from None
        except BaseException as err:
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            import asyncio

            if isinstance(err, asyncio.CancelledError):
                self.owner.note_timeout()
                raise
            raise ToolError(f"the MCP server refused the call: {err}") from None
        if self.owner.images_as_parts:  # the env shows images: they are the tool message's image parts
            text, images, kept = result_parts_of(result)
        else:
            (text, kept), images = result_text_of(result), []
        self.owner.note_kept(kept)
        if getattr(result, "is_error", False):
            raise ToolError(text or "the tool reported an error")
        return [text, *images] if images else text


class _Shared:
    """``scope="process"`` servers: one per server description, counted by the envs using it."""

    lock = threading.Lock()
    servers: dict[ServerSpec, tuple[MCPServer, int]] = {}

    @classmethod
    def join(cls, spec: ServerSpec) -> MCPServer:
        with cls.lock:
            held = cls.servers.get(spec)
            if held is not None:
                cls.servers[spec] = (held[0], held[1] + 1)
                return held[0]
            server = MCPServer(spec)
            server.start()
            cls.servers[spec] = (server, 1)
            return server

    @classmethod
    def leave(cls, spec: ServerSpec) -> None:
        with cls.lock:
            held = cls.servers.get(spec)
            if held is None:
                return
            server, count = held
            if count > 1:
                cls.servers[spec] = (server, count - 1)
                return
            del cls.servers[spec]
        server.close()


class OpenMCPTools:
    """An :class:`MCPTools` opened by one env: its connection and its tools."""

    def __init__(self, source: MCPTools) -> None:
        self.source = source
        self.server: MCPServer = MCPServer(source._spec)
        self.restarts = 0
        self._tools: list[Tool] = []
        self._timed_out = False
        self._kept: list[dict[str, Any]] = []
        self.images_as_parts = False
        """Set by an env with ``vision=``: image results become image parts, not data kept."""
        self._joined = False
        self._closed = False
        self._used = False

    def start(self) -> None:
        if self.source.scope == "process":
            self.server = _Shared.join(self.source._spec)
            self._joined = True
        else:
            self.server.start()
        self._tools = self._build_tools()

    def _build_tools(self) -> list[Tool]:
        listed = {t.name: t for t in self.server.tools}
        wanted = list(self.source.include) if self.source.include is not None else list(listed)
        unknown = [n for n in [*wanted, *self.source.exclude] if n not in listed]
        if unknown:
            raise MCPServerError(
                f"the MCP server {self.source.label!r} lists no tool {unknown[0]!r} (include/exclude); it lists {sorted(listed)}"
            )
        timeout = self.source.timeout
        out = []
        for name in wanted:
            if name in self.source.exclude:
                continue
            shown = f"{self.source.prefix}{name}"
            out.append(Tool(_ServerCall(self, name), schema=_schema_of(listed[name], shown), timeout=timeout))
        return out

    @property
    def tools(self) -> list[Tool]:
        return list(self._tools)

    def note_timeout(self) -> None:
        self._timed_out = True

    def note_kept(self, kept: Iterable[dict[str, Any]]) -> None:
        self._kept.extend(kept)

    def take_kept(self) -> list[dict[str, Any]]:
        """The non-text parts the episode's calls returned since the last take."""
        kept, self._kept = self._kept, []
        return kept

    def begin_episode(self) -> int:
        """Get the server ready for a new episode; how many restarts of a failed server that took.

        A server that stopped, or that had a call time out last episode and does not answer a
        ping now, is restarted (and counted); ``scope="episode"`` starts a fresh one every
        episode after the first (not counted: it is the scope, not a failure).
        """
        self._kept = []
        server = self.server
        seen = server.starts
        why = server.down_reason
        if why is None and self._timed_out and not server.ping(self.source.ping_timeout):
            why = f"the MCP server {self.source.label!r} did not answer a ping after a call timed out"
        fresh = self.source.scope == "episode" and self._used
        self._timed_out = False
        self._used = True
        if why is None and not fresh:
            return 0
        if why is not None:
            log.warning("%s; restarting it", why)
        server.restart(seen_starts=seen)  # a shared server another env restarted meanwhile is kept
        self._tools = self._build_tools()  # a restarted server may list other tools
        if why is None:
            return 0
        self.restarts += 1
        return 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._joined:
            _Shared.leave(self.source._spec)
        else:
            self.server.close()


def mcp_tools_of(values: Iterable[Any]) -> tuple[list[MCPTools], list[Any]]:
    """Split what an env was given as tools into MCP servers and everything else."""
    servers, rest = [], []
    for v in values:
        (servers if isinstance(v, MCPTools) else rest).append(v)
    return servers, rest
