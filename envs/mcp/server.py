"""One live connection to an MCP server, held on an event loop of its own.

The official SDK is asyncio (anyio) code whose transports must be entered and left by one task
on one loop, while tokengym's env steps are synchronous and its async tools run on the tool
runner's loop. So each :class:`MCPServer` owns a daemon thread running a loop, and one task on
it holds the transport and the ``ClientSession`` open for the connection's whole life; calls
from any thread or loop are scheduled onto it and can be cancelled from there (a timed-out
call is cancelled on the server too: the SDK sends ``notifications/cancelled``).

Lifetimes: the stdio server is started by the SDK in a session of its own (its process group
is killed when the connection closes) and, where ``setpriv`` exists, with a parent-death
signal, so a server dies with this process however it ends (a SIGKILL included). Every live
connection is closed at interpreter exit. The server's stderr goes to a file whose tail is
quoted when it fails to start or stops.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MCPServer", "MCPServerError", "ServerSpec", "STDERR_TAIL_CHARS"]

log = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 2000
"""How much of a failed server's stderr its error quotes."""

_LIVE: weakref.WeakSet[MCPServer] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
_BY_THREAD: weakref.WeakValueDictionary[int, MCPServer] = weakref.WeakValueDictionary()
"""Each connection's loop thread -> its connection (the SDK logs a stray stdout line there)."""
STDOUT_NOISE_LINES = 5
"""How many of the lines a stdio server wrote to stdout that are not JSON-RPC its errors quote."""


class MCPServerError(RuntimeError):
    """An MCP server could not be started or reached; the message quotes its stderr tail."""


@dataclass(frozen=True)
class ServerSpec:
    """How to reach one server: a command to start (stdio) or a URL (streamable HTTP)."""

    command: tuple[str, ...] = ()
    url: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    start_timeout: float = 60.0
    sandbox: str | None = None
    """The sandbox backend the command runs in (``"local"``, ``"docker"``), or None: on the host."""
    sandbox_options: str = "{}"
    """The sandbox's constructor arguments, as JSON (so that the spec stays hashable)."""

    @property
    def label(self) -> str:
        """The server as a person reads it in an error: its command line or its URL."""
        where = f" (in a {self.sandbox} sandbox)" if self.sandbox else ""
        return (self.url if self.url is not None else " ".join(self.command)) + where


def _install_sdk_hint() -> str:
    return 'MCP tools need the MCP SDK: pip install "tokengym[mcp]" (or pip install mcp)'


class MCPServer:
    """A connection to one MCP server: started by :meth:`start`, restartable, closed by :meth:`close`.

    Thread-safe: :meth:`call` may be awaited from any event loop, :meth:`call_sync` called from
    any thread. ``tools`` is the server's tool list as of the last (re)start.
    """

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.tools: list[Any] = []
        self.starts = 0
        self.down_reason: str | None = None
        """Why the connection is known to be unusable (the server stopped, or hung), else None."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: Any = None
        self._held: tuple[Any, asyncio.Event, threading.Event] | None = None
        """The holding task's anyio cancel scope, its stop event, and the event it sets when done."""
        self._lock = threading.Lock()
        self._stderr_path: str | None = None
        self._closed = False
        self._sandbox: Any = None
        """The sandbox a sandboxed server runs in: made at the first start, reset (its processes
        killed, its workspace emptied) at every restart, closed with the connection."""
        self.stdout_noise: collections.deque[str] = collections.deque(maxlen=STDOUT_NOISE_LINES)
        """The last lines the server wrote to stdout that are not JSON-RPC (a print, or the error
        of the command that was to start it, such as ``docker exec``'s)."""

    # ----------------------------------------------------------------- state
    @property
    def alive(self) -> bool:
        """Started, not closed, and not known to be down."""
        return self._session is not None and self.down_reason is None and not self._closed

    def stderr_tail(self, chars: int = STDERR_TAIL_CHARS) -> str:
        """The last ``chars`` characters the server wrote to stderr ("" for a URL server)."""
        if self._stderr_path is None:
            return ""
        try:
            with open(self._stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars * 4))
                return f.read().decode("utf-8", "replace")[-chars:].strip()
        except OSError:
            return ""

    def _with_tail(self, message: str) -> str:
        tail = self.stderr_tail()
        told = f"{message}\n--- the server's stderr (last lines) ---\n{tail}" if tail else f"{message} (it wrote nothing to stderr)"
        if self.stdout_noise:
            told += "\n--- what it wrote to stdout that is not JSON-RPC ---\n" + "\n".join(self.stdout_noise)
        return told

    # ------------------------------------------------------------- lifetime
    def start(self, *, seen_starts: int | None = None) -> None:
        """Start the server (or connect to it), initialize the session and list its tools; a
        running one is stopped first. With ``seen_starts``, nothing is done when the server was
        (re)started since that count was read (another user of a shared server restarted it).

        Raises :class:`MCPServerError` (with the server's stderr tail) when it does not answer
        within ``spec.start_timeout`` seconds, exits, or cannot be spawned.
        """
        with self._lock:
            if seen_starts is not None and self.starts != seen_starts and self.down_reason is None:
                return
            if self._closed:
                raise MCPServerError(f"the MCP server connection {self.spec.label!r} was closed")
            self._shutdown_locked()
            self._fresh_sandbox()
            self.stdout_noise.clear()
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._run_loop, args=(self._loop,), name="tokengym-mcp", daemon=True)
                self._thread.start()
                if self._thread.ident is not None:
                    _BY_THREAD[self._thread.ident] = self
            ready: concurrent.futures.Future = concurrent.futures.Future()
            asyncio.run_coroutine_threadsafe(self._hold(ready), self._loop)
            try:
                self._session, self.tools = ready.result(timeout=self.spec.start_timeout)
            except concurrent.futures.TimeoutError:
                self._shutdown_locked()
                raise MCPServerError(self._with_tail(
                    f"the MCP server {self.spec.label!r} did not answer within {self.spec.start_timeout:g} s "
                    "(start_timeout=...)"
                )) from None
            except MCPServerError:
                self._shutdown_locked()
                raise
            self.down_reason = None
            self.starts += 1
            with _LIVE_LOCK:
                _LIVE.add(self)

    def restart(self, *, seen_starts: int | None = None) -> None:
        """Close the connection (killing a stdio server) and start a fresh one (see :meth:`start`)."""
        self.start(seen_starts=seen_starts)

    def close(self) -> None:
        """Close the session and stop the server (its whole process group); idempotent."""
        with self._lock:
            self._closed = True
            self._shutdown_locked()
            sandbox, self._sandbox = self._sandbox, None
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if sandbox is not None:
            sandbox.close()
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5.0)
            if not thread.is_alive():
                loop.close()
        if self._stderr_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._stderr_path)
            self._stderr_path = None
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def _shutdown_locked(self) -> None:
        """End the holding task (a started session by its stop event, a start by cancelling it)
        and wait until the SDK's shutdown has run: stdin closed, 2 s, SIGTERM to the group, 2 s,
        SIGKILL. A start under way is cancelled through anyio's scope, never ``Task.cancel()``:
        a native cancel can break into the SDK's shielded shutdown and leave the server running."""
        held, loop = self._held, self._loop
        started = self._session is not None
        self._held = self._session = None
        if held is None or loop is None:
            return
        scope, stop, finished = held
        loop.call_soon_threadsafe(stop.set if started else scope.cancel)
        if not finished.wait(timeout=15.0):
            log.warning("the MCP server %r did not shut down within 15 s", self.spec.label)

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        loop.run_forever()

    def _fresh_sandbox(self) -> None:
        """A sandboxed server's sandbox, new or reset (whatever the last server left is gone)."""
        if self.spec.sandbox is None:
            return
        from ..sandbox import SandboxError, make_sandbox

        try:
            if self._sandbox is None or self._sandbox.closed:
                options = json.loads(self.spec.sandbox_options)
                if self.spec.sandbox == "local":
                    options["ro_binds"] = [*options.get("ro_binds", ()), *_shown_for(self._host_exe())]
                self._sandbox = make_sandbox(self.spec.sandbox, **options)
            else:
                self._sandbox.reset()
        except SandboxError as err:
            raise MCPServerError(f"cannot start the MCP server {self.spec.label!r}: its sandbox failed: {err}") from None

    def _host_exe(self) -> str:
        argv = self.spec.command
        exe = shutil.which(argv[0]) if argv else None
        if exe is None:
            raise MCPServerError(f"cannot start the MCP server {self.spec.label!r}: {argv[0]!r} is not on PATH")
        return exe

    def _command(self) -> tuple[str, list[str], dict[str, str] | None, str | None]:
        """The host-side command, its environment and working directory."""
        argv = list(self.spec.command)
        env = dict(self.spec.env) or None
        if self._sandbox is not None:
            from ..sandbox import SandboxError

            inside = argv if self.spec.sandbox == "docker" else [self._host_exe(), *argv[1:]]  # docker: the image's PATH
            try:
                launch = self._sandbox.launch(inside, env=env)
            except SandboxError as err:
                raise MCPServerError(f"cannot start the MCP server {self.spec.label!r}: {err}") from None
            return launch.argv[0], list(launch.argv[1:]), launch.env, launch.cwd
        exe = self._host_exe()
        setpriv = shutil.which("setpriv")
        if setpriv is not None:  # the server gets SIGKILL when this loop's thread (so this process) dies
            return setpriv, ["--pdeathsig", "KILL", "--", exe, *argv[1:]], env, self.spec.cwd
        return exe, argv[1:], env, self.spec.cwd

    async def _hold(self, ready: concurrent.futures.Future) -> None:
        """Open the transport and session, hand them to :meth:`start`, keep them until stopped."""
        stop, finished = asyncio.Event(), threading.Event()
        try:
            import anyio
            from mcp import ClientSession
        except ImportError:
            ready.set_exception(MCPServerError(_install_sdk_hint()))
            finished.set()
            return
        scope = anyio.CancelScope()
        self._held = (scope, stop, finished)
        try:
            with scope:
                await self._open(ready, stop, ClientSession)
            if not ready.done():
                ready.set_exception(MCPServerError(f"the MCP server {self.spec.label!r} was stopped while it started"))
        except BaseException as err:
            if not ready.done():
                message = self._with_tail(f"the MCP server {self.spec.label!r} failed to start: {_reason(err)}")
                ready.set_exception(err if isinstance(err, MCPServerError) else MCPServerError(message))
            if isinstance(err, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
        finally:
            finished.set()

    async def _open(self, ready: concurrent.futures.Future, stop: asyncio.Event, client_session: Any) -> None:
        """The transport and session, held open until ``stop`` is set."""
        async with contextlib.AsyncExitStack() as stack:
            if self.spec.url is not None:
                from mcp.client.streamable_http import streamable_http_client

                streams = await stack.enter_async_context(streamable_http_client(self.spec.url))
            else:
                from mcp import StdioServerParameters, stdio_client

                exe, args, env, cwd = self._command()
                if self._stderr_path is None:
                    fd, self._stderr_path = tempfile.mkstemp(prefix="tokengym-mcp-", suffix=".stderr")
                    os.close(fd)
                errlog = stack.enter_context(open(self._stderr_path, "a", encoding="utf-8"))  # noqa: SIM115
                params = StdioServerParameters(command=exe, args=args, env=env, cwd=cwd)
                streams = await stack.enter_async_context(stdio_client(params, errlog=errlog))
            session = await stack.enter_async_context(client_session(streams[0], streams[1]))
            await session.initialize()
            tools = await _list_all_tools(session)
            ready.set_result((session, tools))
            await stop.wait()

    # ----------------------------------------------------------------- calls
    async def _call_here(self, session: Any, name: str, arguments: Mapping[str, Any]) -> Any:
        return await session.call_tool(name, dict(arguments))

    async def call(self, name: str, arguments: Mapping[str, Any]) -> Any:
        """``tools/call`` from any event loop; cancelling the awaiting task cancels the call."""
        session, loop = self._session, self._loop
        if session is None or loop is None or self.down_reason is not None:
            raise ConnectionError(self.down_reason or "the MCP server is not running")
        fut = asyncio.run_coroutine_threadsafe(self._call_here(session, name, arguments), loop)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as err:
            if _is_connection_lost(err):
                self.down_reason = self._stopped_reason(err)
                raise ConnectionError(self.down_reason) from err
            raise

    def ping(self, timeout: float) -> bool:
        """Whether the server answers a ping within ``timeout`` seconds."""
        session, loop = self._session, self._loop
        if session is None or loop is None:
            return False
        fut = asyncio.run_coroutine_threadsafe(session.send_ping(), loop)
        try:
            fut.result(timeout=timeout)
            return True
        except BaseException:  # a timeout, a closed connection: either way it does not answer
            fut.cancel()
            return False

    def _stopped_reason(self, err: BaseException) -> str:
        tail = self.stderr_tail(300).splitlines()
        last = f"; its stderr ends: {tail[-1].strip()[:200]}" if tail else ""
        return f"the MCP server {self.spec.label!r} stopped ({_reason(err)}){last}"


async def _list_all_tools(session: Any) -> list[Any]:
    tools: list[Any] = []
    cursor = None
    for _ in range(1000):  # a server that pages for ever is refused below
        if cursor is None:
            page = await session.list_tools()
        else:
            from mcp import types

            page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        tools.extend(page.tools)
        cursor = getattr(page, "next_cursor", None)
        if not cursor:
            return tools
    raise MCPServerError("the MCP server's tools/list paged more than 1000 times")


class _StdoutNoise(logging.Handler):
    """Keeps the stdout lines a stdio server wrote that are not JSON-RPC, on their connection.
    The SDK only logs such a line; a server that dies after one (``docker exec`` printing why it
    cannot start the command, say) would fail with "Connection closed" and nothing to go on."""

    def emit(self, record: logging.LogRecord) -> None:
        server = _BY_THREAD.get(threading.get_ident())
        err = record.exc_info[1] if record.exc_info else None
        if server is None or err is None:
            return
        line = None
        errors = getattr(err, "errors", None)
        if callable(errors):
            with contextlib.suppress(Exception):
                line = errors()[0].get("input")
        if isinstance(line, str) and line.strip():
            server.stdout_noise.append(line.strip()[:500])


logging.getLogger("mcp.client.stdio").addHandler(_StdoutNoise())


def _is_connection_lost(err: BaseException) -> bool:
    import anyio

    if isinstance(err, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream, ConnectionError)):
        return True
    code = getattr(getattr(err, "error", None), "code", None)
    return code == -32000  # CONNECTION_CLOSED


def _reason(err: BaseException) -> str:
    if isinstance(err, BaseExceptionGroup):
        return "; ".join(_reason(e) for e in err.exceptions)
    text = str(err).strip()
    if isinstance(err, OSError) and not text:
        text = os.strerror(err.errno or 0)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def close_all() -> None:
    """Close every live connection (their servers stop); run at interpreter exit."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    threads = [threading.Thread(target=s.close, daemon=True) for s in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10.0)


atexit.register(close_all)


def _shown_for(exe: str) -> list[str]:
    """What a local sandbox must show (read-only) for a host executable to run: its virtualenv
    when it is a venv's script (the venv's interpreter and packages), else its directory."""
    real = os.path.realpath(exe)
    for path in (exe, real):
        venv = os.path.dirname(os.path.dirname(path))
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            prefix = os.path.dirname(os.path.dirname(os.path.realpath(os.path.join(venv, "bin", "python"))))
            return [venv, prefix]  # the venv's interpreter lives under its prefix (/usr is shown anyway)
    return [os.path.dirname(real)]


def command_of(value: str | Sequence[str]) -> tuple[str, ...]:
    """A command line as argv: a string is split the way a shell splits it."""
    import shlex

    argv = tuple(shlex.split(value)) if isinstance(value, str) else tuple(str(a) for a in value)
    if not argv:
        raise ValueError("an MCP server command is empty")
    return argv
