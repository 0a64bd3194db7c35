"""A lean legacy (2025-11-25) MCP server for benchmarks: `initialize` with a session id, `tools/list`, and two
tools, `echo {text}` and `sleep {seconds}`, answered as plain JSON. Its own cost is small and steady, so what
the benchmarks measure is the proxy, not the SDK of a fixture server. Not a test fixture (tests use the mcp
1.x SDK upstream in `tests/upstream`).

    python -m benchmarks.upstream --port N   # prints "ready http://127.0.0.1:N/mcp"

POST /stats answers `{"calls": n, "cancelled": [t, ...]}`: the tools/call requests received, and when each
`notifications/cancelled` arrived (`time.monotonic()`, the machine's clock shared by every process), so a
benchmark can time a cancel from the client's request to the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

TOOLS = [
    {"name": "echo", "description": "Returns `text`", "inputSchema": {"type": "object"}},
    {"name": "sleep", "description": "Sleeps `seconds`, then returns", "inputSchema": {"type": "object"}},
]


CALLS = [0]
CANCELLED: list[float] = []


def _result(request_id: Any, result: dict[str, Any]) -> web.Response:
    return web.json_response({"jsonrpc": "2.0", "id": request_id, "result": result})


async def _call(params: dict[str, Any]) -> dict[str, Any]:
    arguments = params.get("arguments") or {}
    if params.get("name") == "sleep":
        await asyncio.sleep(float(arguments.get("seconds", 0)))
        return {"content": [{"type": "text", "text": "slept"}], "isError": False}
    return {"content": [{"type": "text", "text": str(arguments.get("text", ""))}], "isError": False}


async def mcp(request: web.Request) -> web.StreamResponse:
    if request.method == "DELETE":
        return web.Response(status=200)
    if request.method == "GET":
        return web.Response(status=405)
    message = json.loads(await request.read())
    if "id" not in message:
        if message.get("method") == "notifications/cancelled":
            CANCELLED.append(time.monotonic())
        return web.Response(status=202)  # notifications (initialized, cancelled)
    method, params = message.get("method"), message.get("params") or {}
    if method == "initialize":
        response = _result(
            message["id"],
            {
                "protocolVersion": "2025-11-25",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "bench-upstream", "version": "1"},
            },
        )
        response.headers["Mcp-Session-Id"] = uuid.uuid4().hex
        return response
    if method == "tools/list":
        return _result(message["id"], {"tools": TOOLS})
    if method == "tools/call":
        CALLS[0] += 1
        return _result(message["id"], await _call(params))
    if method == "ping":
        return _result(message["id"], {})
    return web.json_response(
        {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": "Method not found"}}
    )


async def stats(request: web.Request) -> web.Response:
    return web.json_response({"calls": CALLS[0], "cancelled": CANCELLED})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_route("*", "/mcp", mcp)
    app.router.add_post("/stats", stats)
    web.run_app(
        app,
        host="127.0.0.1",
        port=args.port,
        print=lambda _: print(f"ready http://127.0.0.1:{args.port}/mcp", flush=True),
        access_log=None,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
