"""app.py: admission (Host/Origin, body size), the error edge, and what malformed input gets.

Nothing a client sends may make the proxy answer 5xx; every modern rejection is a 2026-07-28 JSON-RPC error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.app import host_allowed, origin_allowed
from tests.conftest import SCHEMA_DIR, ModernSchema, Upstream, modern_body, modern_headers

Client = TestClient[web.Request, web.Application]
SCHEMA = ModernSchema(SCHEMA_DIR / "mcp-2026-07-28.schema.json")
ALLOWED = ["localhost", "127.0.0.1", "[::1]"]


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("localhost", True),
        ("localhost:8080", True),
        ("127.0.0.1:1", True),
        ("[::1]:8080", True),
        ("LOCALHOST", True),
        ("evil.example.com", False),
        ("localhost.evil.example.com", False),
        ("127.0.0.1.nip.io:8080", False),
        ("", False),
        (None, False),
    ],
)
def test_host_allowed(host: str | None, allowed: bool) -> None:
    assert host_allowed(host, ALLOWED) is allowed


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        ("http://localhost:3000", True),
        ("https://127.0.0.1", True),
        ("http://[::1]:9", True),
        ("https://app.example.com", True),  # listed explicitly
        ("http://evil.example.com", False),
        ("null", False),
        ("file://localhost", False),
    ],
)
def test_origin_allowed(origin: str, allowed: bool) -> None:
    assert origin_allowed(origin, ALLOWED, ["https://app.example.com"]) is allowed


async def post(client: Client, body: Any, headers: dict[str, str], raw: bytes | None = None) -> tuple[int, Any]:
    """POST and decode; every error body the proxy sends must be a valid 2026-07-28 JSON-RPC error."""
    response = await client.post("/mcp", data=raw if raw is not None else json.dumps(body), headers=headers)
    text = await response.text()
    message = json.loads(text) if text else None
    if isinstance(message, dict) and "error" in message:
        SCHEMA.validate(message, "JSONRPCErrorResponse")
    return response.status, message


async def test_foreign_host_is_refused_for_both_eras(proxy: Client, modern_schema: ModernSchema) -> None:
    """C-28 / DNS rebinding: 403 with a JSON-RPC body, before anything reaches the upstream."""
    for body, headers in [
        (modern_body("tools/list"), modern_headers("tools/list")),
        ({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}, {"Content-Type": "application/json"}),
    ]:
        status, message = await post(proxy, body, {**headers, "Host": "evil.example.com"})
        assert status == 403
        modern_schema.check(message, "tools/list")
        assert message["error"]["code"] == -32600


async def test_foreign_origin_is_refused(proxy: Client) -> None:
    headers = {**modern_headers("tools/list"), "Origin": "http://evil.example.com"}
    status, message = await post(proxy, modern_body("tools/list"), headers)
    assert status == 403
    assert "Origin" in message["error"]["message"]


async def test_oversized_body_is_413(make_proxy: Callable[..., Any], upstream: Upstream) -> None:
    client: Client = await make_proxy(upstream.url, security={"max_body_bytes": 1024})
    body = modern_body("tools/call", {"name": "echo", "arguments": {"text": "x" * 2000}})
    status, message = await post(client, body, modern_headers("tools/call", "echo"))
    assert status == 413
    assert message["error"]["code"] == -32600
    assert "id" not in message  # the body was never read, so its id is unknown


@pytest.mark.parametrize(
    ("raw", "code", "status"),
    [
        (b"{not json", -32700, 400),
        (b"[]", -32600, 400),
        (b'[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]', -32600, 400),
        (b'"scalar"', -32600, 400),
        (b'{"jsonrpc":"2.0","id":1,"result":{}}', -32600, 400),
    ],
)
async def test_malformed_modern_bodies(
    proxy: Client, modern_schema: ModernSchema, raw: bytes, code: int, status: int
) -> None:
    got_status, message = await post(proxy, None, modern_headers("tools/list"), raw=raw)
    assert (got_status, message["error"]["code"]) == (status, code)
    modern_schema.check(message, "tools/list")


async def test_modern_notifications_are_accepted_with_202(proxy: Client) -> None:
    body = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
    response = await proxy.post("/mcp", json=body, headers=modern_headers("notifications/cancelled"))
    assert response.status == 202
    assert await response.read() == b""


async def test_get_and_delete_with_a_modern_header_are_405(proxy: Client) -> None:
    """C-22: a 2026-07-28 client has no GET stream and no session."""
    for method in ("GET", "DELETE"):
        response = await proxy.request(method, "/mcp", headers={"MCP-Protocol-Version": "2026-07-28"})
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
        message = await response.json()
        SCHEMA.validate(message, "JSONRPCErrorResponse")
        assert message["error"]["code"] == -32600


@pytest.mark.parametrize(
    ("method", "code", "status"),
    [
        ("initialize", -32601, 404),
        ("ping", -32601, 404),
        ("logging/setLevel", -32601, 404),
        ("resources/subscribe", -32601, 404),
        ("tasks/list", -32601, 404),
        ("tasks/result", -32601, 404),
        ("no/such/method", -32601, 404),
    ],
)
async def test_removed_and_unknown_methods_are_404(
    proxy: Client, modern_schema: ModernSchema, method: str, code: int, status: int
) -> None:
    """C-27, K-26, T-40."""
    got_status, message = await post(proxy, modern_body(method, request_id=33), modern_headers(method))
    assert (got_status, message["error"]["code"], message["id"]) == (status, code, 33)
    modern_schema.check(message, method)


async def test_missing_meta_is_400_minus_32602(proxy: Client, modern_schema: ModernSchema) -> None:
    body = {"jsonrpc": "2.0", "id": 4, "method": "server/discover", "params": {}}
    status, message = await post(proxy, body, modern_headers("server/discover"))
    assert (status, message["error"]["code"], message["id"]) == (400, -32602, 4)
    modern_schema.check(message, "server/discover")


async def test_bad_param_types_are_400_minus_32602(proxy: Client) -> None:
    body = modern_body("tools/call", {"name": "echo", "arguments": ["not", "an", "object"]})
    status, message = await post(proxy, body, modern_headers("tools/call", "echo"))
    assert (status, message["error"]["code"]) == (400, -32602)


async def test_legacy_task_param_is_ignored(proxy: Client) -> None:
    """T-11 / K-4: the legacy `task` opt-in is not forwarded and changes nothing."""
    body = modern_body("tools/call", {"name": "greet", "arguments": {"name": "t"}, "task": {"ttl": 1000}})
    status, message = await post(proxy, body, modern_headers("tools/call", "greet"))
    assert status == 200
    assert message["result"]["content"][0]["text"] == "Hello, t!"
    assert "taskId" not in message["result"]
