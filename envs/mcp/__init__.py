"""Tools from Model Context Protocol servers.

``ToolEnv(tokenizer, tasks, tools=[MCPTools("uvx mcp-server-time"), my_function])`` gives the
model a server's tools beside Python ones: their schemas are the server's, their calls go
through the same tool runner (argument checks, a timeout that cancels the call on the server,
output cut to the token budget, failures as messages). The SDK (``pip install "tokengym[mcp]"``)
is imported only when a server is started. docs/mcp.md has the whole story.
"""

from .server import MCPServer, MCPServerError
from .tools import MCPTools, OpenMCPTools, result_text_of

__all__ = ["MCPServer", "MCPServerError", "MCPTools", "OpenMCPTools", "result_text_of"]
