"""An MCP server written with the SDK, over streamable HTTP, for the tests: `python -m tests.mcp.notes_server PORT`.

It checks the header the gateway sends it from the routers' environment (``X-Notes-Token``), so a test
sees that a credential reaches the server without ever being on the log.
"""

from __future__ import annotations

import asyncio
import sys

from mcp.server.mcpserver import Context, MCPServer

TOKEN = "notes-secret-7"

server = MCPServer("notes")


def _token(ctx: Context) -> str:
    request = ctx.request_context.request
    return request.headers.get("x-notes-token", "") if request is not None else ""


@server.tool()
def echo(text: str, ctx: Context) -> str:
    """Say the text back, if the caller sent the notes token."""
    if _token(ctx) != TOKEN:
        raise ValueError("no notes token")
    return f"echo: {text}"


@server.tool()
def shout(text: str) -> str:
    """Say the text back in capitals."""
    return text.upper()


@server.tool()
async def slow(seconds: float) -> str:
    """Answer after the seconds asked for."""
    await asyncio.sleep(seconds)
    return "done"


if __name__ == "__main__":
    server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
