"""End to end: legacy (2025-11-25) clients through the proxy see what they see directly (pass-through).

The client is the mcp 1.x SDK's own Streamable HTTP client, so sessions, the GET stream, server→client
requests answered by POST, and DELETE all really cross the proxy.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import mcp.types as mt
from aiohttp import web
from aiohttp.test_utils import TestClient
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.context import RequestContext
from mcp.shared.exceptions import McpError
from pydantic import AnyUrl

from tests.conftest import Upstream

Client = TestClient[web.Request, web.Application]


async def _elicit(context: RequestContext[ClientSession, Any], params: mt.ElicitRequestParams) -> mt.ElicitResult:
    return mt.ElicitResult(action="accept", content={"name": "Grace"})


async def _sample(
    context: RequestContext[ClientSession, Any], params: mt.CreateMessageRequestParams
) -> mt.CreateMessageResult:
    return mt.CreateMessageResult(
        role="assistant", content=mt.TextContent(type="text", text="sampled!"), model="test-model"
    )


async def _run_session(url: str) -> dict[str, Any]:
    """What a legacy client observes in one session; compared between direct and proxied runs."""
    seen: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    async with (
        streamable_http_client(url) as (read, write, get_session_id),
        ClientSession(read, write, elicitation_callback=_elicit, sampling_callback=_sample) as session,
    ):
        init = await session.initialize()
        tools = await session.list_tools()
        greet = await session.call_tool("greet", {"name": "Ada"})
        asked = await session.call_tool("ask_name", {})
        sampled = await session.call_tool("sample", {"prompt": "hi"})
        slept = await session.call_tool("sleep", {"seconds": 0.3}, progress_callback=on_progress)
        try:
            await session.call_tool("raise_error", {"message": "bad", "code": -32000})
        except McpError as exc:
            error = exc.error
        resource = await session.read_resource(AnyUrl("test://static-text"))
        assert get_session_id() is not None
    return {
        "protocol": init.protocolVersion,
        "server": init.serverInfo.name,
        "tools": sorted(tool.name for tool in tools.tools),
        "greet": greet.model_dump(mode="json"),
        "asked": asked.model_dump(mode="json"),
        "sampled": sampled.model_dump(mode="json"),
        "slept": slept.model_dump(mode="json"),
        "progress_seen": bool(seen),
        "error": error.model_dump(mode="json"),
        "resource": resource.model_dump(mode="json"),
    }


async def test_sdk_client_sees_the_same_through_the_proxy(proxy: Client, upstream: Upstream) -> None:
    direct = await _run_session(upstream.url)
    proxied = await _run_session(str(proxy.make_url("/mcp")))
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
