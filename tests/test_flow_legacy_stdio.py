"""End to end: legacy (2025-11-25) clients in front of a stdio upstream, served by the proxy's own Streamable
HTTP server (`proxy/legacy/_stdio_server.py`): one server process per legacy session.

The client is the mcp 1.x SDK's own Streamable HTTP client: it must see what it sees talking to the same
fixture over HTTP directly (tools, calls, an elicitation and a sampling request answered across the proxy,
progress, errors), and its DELETE ends the session and stops the process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.edge._app_keys import PASSTHROUGH
from proxy.legacy._stdio_server import StdioLegacyServer
from tests.support.processes import Upstream, children, stdio_upstream
from tests.support.sdk import run_session
from tests.support.waiting import until
from tests.support.wire import HEADERS, INITIALIZE, parse_sse

Client = TestClient[web.Request, web.Application]


@pytest.fixture
async def stdio_proxy(make_proxy: Callable[..., Any]) -> Client:
    client: Client = await make_proxy("", upstream=stdio_upstream())
    return client


def legacy_server(client: Client) -> StdioLegacyServer:
    server = client.app[PASSTHROUGH]
    assert isinstance(server, StdioLegacyServer)
    return server


async def test_sdk_client_sees_what_it_sees_over_http(stdio_proxy: Client, upstream: Upstream) -> None:
    before = children()
    direct = await run_session(upstream.url)
    proxied = await run_session(str(stdio_proxy.make_url("/mcp")))
    assert proxied == direct
    assert proxied["asked"]["content"][0]["text"] == "Hello, Grace"  # the elicitation crossed the proxy
    assert proxied["sampled"]["content"][0]["text"] == "sampled!"
    assert proxied["progress_seen"]
    # The SDK client's DELETE ended the session: its process is stopped and its room in the pool free again.
    await until(lambda: not legacy_server(stdio_proxy).sessions, "the session was not ended")
    await until(lambda: children() <= before, "the session's server process was left running")


async def test_raw_session_lifecycle(stdio_proxy: Client) -> None:
    http = stdio_proxy.session
    url = stdio_proxy.make_url("/mcp")
    async with http.post(url, json=INITIALIZE, headers=HEADERS) as response:
        assert response.status == 200
        session_id = response.headers["Mcp-Session-Id"]
        answer = json.loads(await response.text())  # nothing came before the answer: plain JSON
    assert answer["result"]["serverInfo"]["name"] == "legacy-fixture-upstream"
    session = {**HEADERS, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
    async with http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session) as r:
        assert r.status == 202
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "é"}}}
    async with http.post(url, json=call, headers=session) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        [echoed] = parse_sse(await r.text())
        assert echoed["result"]["content"][0]["text"] == "é"
    other = {**session, "Authorization": "Bearer someone-else"}
    async with http.post(url, json=call, headers=other) as r:  # bound to the principal that opened it
        assert r.status == 404
    async with http.post(url, json={**call, "id": 3}, headers={**HEADERS, "Mcp-Session-Id": "nope"}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == -32600
    async with http.post(url, json={**call, "id": 4}, headers=HEADERS) as r:
        assert r.status == 400  # no session id on a request other than initialize
    async with http.delete(url, headers=session) as r:
        assert r.status == 200
    async with http.post(url, json={**call, "id": 5}, headers=session) as r:
        assert r.status == 404  # ended: the client initializes again
    assert not legacy_server(stdio_proxy).sessions


async def test_a_question_goes_to_the_get_stream_while_no_post_is_open(stdio_proxy: Client) -> None:
    """roots/list sent by the SDK's `list_roots()` names no request; with two calls open it goes to the GET
    stream, and the answer POSTed back reaches the server."""
    http = stdio_proxy.session
    url = stdio_proxy.make_url("/mcp")
    init = {**INITIALIZE, "params": {**INITIALIZE["params"], "capabilities": {"roots": {}}}}
    async with http.post(url, json=init, headers=HEADERS) as response:
        session_id = response.headers["Mcp-Session-Id"]
    session = {**HEADERS, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
    await http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session)
    get = await http.get(url, headers={"Accept": "text/event-stream", "Mcp-Session-Id": session_id})
    assert get.status == 200
    slow = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "sleep", "arguments": {"seconds": 3}}}
    asking = {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "list_roots_standalone"}}
    sleeping = asyncio.get_running_loop().create_task(http.post(url, json=slow, headers=session))
    await until(lambda: len(legacy_server(stdio_proxy).sessions[session_id].posts) == 1, "the first call is not open")
    asked = asyncio.get_running_loop().create_task(http.post(url, json=asking, headers=session))
    line = b""
    while not line.startswith(b"data:"):
        line = await asyncio.wait_for(get.content.readline(), 10)
    question = json.loads(line[5:])
    assert question["method"] == "roots/list"
    answer = {"jsonrpc": "2.0", "id": question["id"], "result": {"roots": [{"uri": "file:///work", "name": "w"}]}}
    async with http.post(url, json=answer, headers=session) as r:
        assert r.status == 202
    async with await asked as r:
        text = await r.text()
    assert "file:///work" in text
    (await sleeping).close()
    get.close()
    async with http.delete(url, headers=session) as r:
        assert r.status == 200


async def test_sessions_count_against_max_processes(make_proxy: Callable[..., Any]) -> None:
    """At the limit, a new session ends the least recently active idle one (whose client then gets 404 and
    initializes again); with every session busy (a stream open), initialize waits, then gets 503."""
    client: Client = await make_proxy("", upstream=stdio_upstream(max_processes=1, connect_timeout_seconds=6))
    url = client.make_url("/mcp")
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=INITIALIZE, headers=HEADERS) as first:
            assert first.status == 200
            first_id = first.headers["Mcp-Session-Id"]
        get = await http.get(url, headers={"Accept": "text/event-stream", "Mcp-Session-Id": first_id})
        assert get.status == 200  # the first session is busy now
        async with http.post(url, json=INITIALIZE, headers=HEADERS) as second:
            assert second.status == 503
            error = (await second.json())["error"]
        assert error["data"] == {"limit": "max_processes", "max": 1}
        assert "upstream.max_processes" in error["message"]
        get.close()
        await until(lambda: not legacy_server(client).sessions[first_id].busy, "the GET stream did not end")
        async with http.post(url, json=INITIALIZE, headers=HEADERS) as third:
            assert third.status == 200  # the idle first session made room
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
        async with http.post(url, json=call, headers={**HEADERS, "Mcp-Session-Id": first_id}) as r:
            assert r.status == 404
