"""Cookies an upstream sets on the proxy's own sessions (modern calls): kept per upstream session and sent on
that session's later requests (a load balancer's affinity cookie keeps working), never on another session's,
so one caller's cookie never travels with another caller's call. Against a minimal legacy server on loopback
that sets a cookie naming the session in its `initialize` answer."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.wire import modern_body, modern_headers, read_messages


class CookieSettingServer:
    """A 2025-11-25 server: `initialize` opens session sN and sets `affinity=sN`; `tools/call` answers with
    the session id and the Cookie header it arrived with."""

    def __init__(self) -> None:
        self.numbers = itertools.count(1)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return web.Response(status=405)
        message = await request.json()
        if "id" not in message:
            return web.Response(status=202)
        method = message["method"]
        if method == "initialize":
            session = f"s{next(self.numbers)}"
            result = {
                "protocolVersion": "2025-11-25",
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "cookies", "version": "1"},
            }
            response = web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
            response.headers["Mcp-Session-Id"] = session
            response.set_cookie("affinity", session)
            return response
        if method == "tools/list":
            tools = [{"name": "whoami", "inputSchema": {"type": "object"}}]
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"tools": tools}})
        seen = {"session": request.headers.get("Mcp-Session-Id"), "cookie": request.headers.get("Cookie")}
        content = [{"type": "text", "text": json.dumps(seen)}]
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": {"content": content}})


@pytest.fixture
async def cookie_server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_route("*", "/mcp", CookieSettingServer().handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("/mcp"))
    await server.close()


async def test_each_session_sends_its_own_cookie_and_no_other(
    make_proxy: Callable[..., Any], cookie_server: str
) -> None:
    proxy = await make_proxy(cookie_server)

    async def whoami(principal: str) -> dict[str, Any]:
        body = modern_body("tools/call", {"name": "whoami", "arguments": {}})
        headers = modern_headers("tools/call", "whoami", Authorization=principal)
        response = await proxy.post("/mcp", json=body, headers=headers)
        [message] = await read_messages(response)
        seen: dict[str, Any] = json.loads(message["result"]["content"][0]["text"])
        return seen

    first_a, first_b = await whoami("Bearer a"), await whoami("Bearer b")
    assert first_a["session"] != first_b["session"]
    for seen in (first_a, first_b, await whoami("Bearer a"), await whoami("Bearer b")):
        assert seen["cookie"] == f"affinity={seen['session']}", seen
