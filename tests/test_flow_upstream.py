"""End to end: the upstream process dies and comes back; the proxy keeps serving and recovers by itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.support.processes import Upstream
from tests.support.wire import modern_body, modern_headers, read_messages

Client = TestClient[web.Request, web.Application]


async def greet(client: Client, name: str) -> tuple[int, dict[str, Any]]:
    response = await client.post(
        "/mcp",
        json=modern_body("tools/call", {"name": "greet", "arguments": {"name": name}}),
        headers=modern_headers("tools/call", "greet"),
    )
    [message] = await read_messages(response)
    return response.status, message


async def test_upstream_restart_gets_a_new_session(make_proxy: Callable[..., Any], own_upstream: Upstream) -> None:
    client: Client = await make_proxy(own_upstream.url)
    status, message = await greet(client, "before")
    assert (status, message["result"]["content"][0]["text"]) == (200, "Hello, before!")

    port = own_upstream.port
    own_upstream.stop()
    status, message = await greet(client, "down")
    assert status == 502
    assert message["error"]["code"] == -32603  # a gateway error with a JSON-RPC body, the request id echoed
    assert message["id"] == 1

    own_upstream.start(port)  # same address, a new process that knows none of the old sessions
    status, message = await greet(client, "after")
    assert (status, message["result"]["content"][0]["text"]) == (200, "Hello, after!")
