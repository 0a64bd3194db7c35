"""End to end: an upstream that answers a tools/call with an HTTP error status. With the JSON-RPC error in the
body, the modern client gets that error (its code and message) exactly as it gets the same error answered with
HTTP 200; without one, a gateway error with a JSON-RPC body, never an HTML page."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.wire import modern_body, modern_headers, read_messages

TOOLS = [{"name": name, "inputSchema": {"type": "object"}} for name in ("json-error", "json-error-200", "html-error")]


async def erring(request: web.Request) -> web.Response:
    message = await request.json()
    method = message.get("method")
    if "id" not in message:
        return web.Response(status=202)
    if method == "initialize":
        result = {
            "protocolVersion": "2025-11-25",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "s", "version": "1"},
        }
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
    if method == "tools/list":
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": TOOLS}})
    if message["params"]["name"].startswith("json-error"):  # the same error, under HTTP 500 or 200
        error = {"code": -32050, "message": "the backend is down"}
        status = 200 if message["params"]["name"].endswith("200") else 500
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": error}, status=status)
    return web.Response(status=500, text="<html>oops</html>", content_type="text/html")


async def call(client: Any, tool: str) -> tuple[int, dict[str, Any]]:
    response = await client.post(
        "/mcp",
        json=modern_body("tools/call", {"name": tool, "arguments": {}}),
        headers=modern_headers("tools/call", tool),
    )
    [message] = await read_messages(response)
    return response.status, message


async def test_an_upstream_error_status_reaches_the_client_as_the_upstreams_json_rpc_error(
    make_proxy: Callable[..., Any],
) -> None:
    app = web.Application()
    app.router.add_post("/mcp", erring)
    async with TestServer(app, host="127.0.0.1") as server:
        client = await make_proxy(str(server.make_url("/mcp")))
        status, message = await call(client, "json-error")
        assert "the backend is down" in message["error"]["message"]  # not "malformed message"
        assert "-32050" in message["error"]["message"]
        assert (status, message) == await call(client, "json-error-200")  # as if it had come with HTTP 200
        status, message = await call(client, "html-error")
        assert status == 502
        assert message["error"]["code"] == -32603
        assert "HTTP 500" in message["error"]["message"]
