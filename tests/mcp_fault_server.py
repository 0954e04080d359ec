"""An MCP server that misbehaves on request, for the fault tests of MCP tools (tests/test_mcp.py).

Written with the SDK's own server (``mcp.server.mcpserver.MCPServer``, FastMCP's successor) and
run as a real stdio (or streamable-HTTP) server process. Its tools: ``echo``, ``pid`` (whose
process answers), ``count`` (state kept across calls), ``crash`` (the process exits), ``hang``
(blocks the server's whole event loop, so it answers nothing, pings included), ``fail`` (a tool
error), ``big`` (a long output), ``pixel`` (an image), ``probe`` (where it runs: its uid, folder and
host name, whether it can write a path or reach a port), ``note`` (writes a file in its folder and
lists the folder). ``FAULT`` in its environment makes it fail
before it serves: ``exit`` (an error on stderr, exit 2), ``silent`` (never answers),
``bad_schema`` (lists a tool whose inputSchema is no valid JSON schema).

    python tests/mcp_fault_server.py [stdio | http PORT]
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp_types import ImageContent, TextContent
from mcp_types import Tool as ListedTool

PIXEL_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


class FaultServer(MCPServer):
    async def list_tools(self):  # type: ignore[override]
        tools = await super().list_tools()
        if os.environ.get("FAULT") == "bad_schema":
            # The SDK checks only `type: object`; "datetime" is no JSON schema type.
            bad = {"type": "object", "properties": {"when": {"type": "datetime"}}}
            tools.append(ListedTool(name="odd", description="takes a date", input_schema=bad))
        return tools


server = FaultServer("fault")
calls = {"n": 0}


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return f"echo: {text}"


@server.tool()
def pid() -> str:
    """The server's process id."""
    return str(os.getpid())


@server.tool()
def count() -> str:
    """How many times this tool was called in this server process."""
    calls["n"] += 1
    return str(calls["n"])


@server.tool()
def crash() -> str:
    """The server process exits."""
    print("fault: crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


@server.tool()
async def hang(seconds: float = 60.0) -> str:
    """Blocks the server's event loop (nothing is answered meanwhile, pings included)."""
    time.sleep(seconds)
    return "woke"


@server.tool()
def fail() -> str:
    """Raises: the server answers with a tool error."""
    raise ValueError("the disk is full")


@server.tool()
def big(lines: int = 20000) -> str:
    """A long output."""
    return "".join(f"line {i}: lorem ipsum\n" for i in range(lines))


@server.tool()
def pixel() -> list:
    """A one-pixel PNG between two texts."""
    data = base64.b64encode(PIXEL_PNG).decode()
    return [TextContent(type="text", text="here:"), ImageContent(type="image", data=data, mime_type="image/png")]


@server.tool()
def probe(path: str = "", port: int = 0) -> str:
    """Where the server runs, as JSON: its uid, working folder and host name; whether it can
    write the file ``path`` and connect to 127.0.0.1:``port``."""
    seen: dict = {"uid": os.getuid(), "cwd": os.getcwd(), "hostname": socket.gethostname()}
    if path:
        try:
            with open(path, "w") as f:
                f.write("written from the MCP server")
            seen["wrote"] = True
        except OSError as err:
            seen["wrote"] = False
            seen["write_error"] = str(err)
    if port:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            seen["connected"] = True
        except OSError as err:
            seen["connected"] = False
            seen["connect_error"] = str(err)
    return json.dumps(seen)


@server.tool()
def note(file: str) -> str:
    """Writes ``file`` in the server's working folder; answers the folder's files."""
    with open(file, "w") as f:
        f.write(file)
    return " ".join(sorted(os.listdir(".")))


if __name__ == "__main__":
    fault = os.environ.get("FAULT")
    if fault == "exit":
        print("fault: cannot open the database /nowhere/db.sqlite", file=sys.stderr, flush=True)
        sys.exit(2)
    if fault == "silent":
        print("fault: waiting for ever", file=sys.stderr, flush=True)
        time.sleep(3600)
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
