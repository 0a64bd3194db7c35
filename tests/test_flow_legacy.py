"""End to end: legacy (2025-11-25) clients through the proxy see what they see directly (pass-through).

The client is the mcp 1.x SDK's own Streamable HTTP client, so sessions, the GET stream, server→client
requests answered by POST, and DELETE all really cross the proxy.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.support.processes import Upstream
from tests.support.schemas import LEGACY_SCHEMA, SchemaValidator
from tests.support.sdk import run_session
from tests.support.wire import parse_sse

Client = TestClient[web.Request, web.Application]


async def test_sdk_client_sees_the_same_through_the_proxy(proxy: Client, upstream: Upstream) -> None:
    direct = await run_session(upstream.url)
    proxied = await run_session(str(proxy.make_url("/mcp")))
    assert proxied == direct
    assert proxied["asked"]["content"][0]["text"] == "Hello, Grace"  # elicitation answered across the proxy
    assert proxied["sampled"]["content"][0]["text"] == "sampled!"
    assert proxied["progress_seen"]


async def _raw_exchange(http: aiohttp.ClientSession, url: str) -> list[tuple[int, str, str]]:
    """initialize, a bad-session request, a tools/call and DELETE, as raw HTTP: status, type and body."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    seen: list[tuple[int, str, str]] = []
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
    }
    async with http.post(url, json=init, headers=headers) as response:
        session_id = response.headers["Mcp-Session-Id"]
        seen.append((response.status, response.content_type, _scrub(await response.text(), session_id)))
    session_headers = {**headers, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
    async with http.post(
        url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session_headers
    ) as r:
        seen.append((r.status, r.content_type, await r.text()))
    bogus = {**session_headers, "Mcp-Session-Id": "no-such-session"}
    async with http.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers=bogus) as r:
        seen.append((r.status, r.content_type, await r.text()))
    call = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "é"}}}
    async with http.post(url, json=call, headers=session_headers) as r:
        seen.append((r.status, r.content_type, _scrub(await r.text(), session_id)))
    async with http.post(url, data=b"{not json", headers=session_headers) as r:
        seen.append((r.status, r.content_type, await r.text()))
    async with http.delete(url, headers=session_headers) as r:
        seen.append((r.status, r.content_type, await r.text()))
    async with http.post(url, json=call, headers=session_headers) as r:
        seen.append((r.status, r.content_type, await r.text()))
    return seen


def _scrub(body: str, session_id: str) -> str:
    """SSE event ids embed the per-session stream id; everything else must match byte for byte."""
    lines = [line for line in body.replace(session_id, "<sid>").splitlines() if not line.startswith("id:")]
    return "\n".join(lines)


async def test_raw_http_is_relayed_unchanged(proxy: Client, upstream: Upstream) -> None:
    async with aiohttp.ClientSession() as http:
        direct = await _raw_exchange(http, upstream.url)
        proxied = await _raw_exchange(http, str(proxy.make_url("/mcp")))
    assert proxied == direct
    statuses = [status for status, _, _ in direct]
    assert statuses[0] == 200
    assert statuses[2] == 404  # unknown session: the upstream's own answer reaches the client
    assert json.loads(proxied[3][2].split("data: ")[-1])["result"]["content"][0]["text"] == "é"


async def test_legacy_get_without_session_is_relayed(proxy: Client, upstream: Upstream) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(upstream.url, headers={"Accept": "text/event-stream"}) as direct:
            direct_seen = (direct.status, await direct.text())
        async with http.get(proxy.make_url("/mcp"), headers={"Accept": "text/event-stream"}) as proxied:
            proxied_seen = (proxied.status, await proxied.text())
    assert proxied_seen == direct_seen
    assert direct_seen[0] >= 400


async def test_what_a_legacy_client_gets_through_the_proxy_is_valid_2025_11_25(proxy: Client) -> None:
    """The initialize result, a tool's result and the error for a body that is not JSON, checked against the
    published 2025-11-25 schema (vendored in tests/schema/)."""
    schema = SchemaValidator(LEGACY_SCHEMA)
    async with aiohttp.ClientSession() as http:
        proxied = await _raw_exchange(http, str(proxy.make_url("/mcp")))

    def message(body: str) -> Any:
        [only] = parse_sse(body) if body.lstrip().startswith(("event:", "data:")) else [json.loads(body)]
        return only

    initialized, called, refused = message(proxied[0][2]), message(proxied[3][2]), message(proxied[4][2])
    schema.validate(initialized, "JSONRPCResultResponse")
    schema.validate(initialized["result"], "InitializeResult")
    schema.validate(called, "JSONRPCResultResponse")
    schema.validate(called["result"], "CallToolResult")
    schema.validate(refused, "JSONRPCErrorResponse")
    assert refused["error"]["code"] == -32700  # parse error
