"""The legacy relay's body handling against a real HTTP upstream on loopback (an aiohttp app serving canned
answers): plain answers buffered and sent whole, large ones and SSE streamed as they arrive, and what a client
sees when the upstream drops the connection mid-answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.upstream.passthrough import BUFFERED_BODY_MAX_BYTES

LEGACY_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
BIG = BUFFERED_BODY_MAX_BYTES + 12_345


def _event(number: int) -> bytes:
    return (
        f"event: message\ndata: {json.dumps({'jsonrpc': '2.0', 'method': 'n', 'params': {'n': number}})}\n\n".encode()
    )


class Canned:
    """The upstream: its answer depends on the request's JSON-RPC method."""

    def __init__(self) -> None:
        self.release_second_event = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        method = (await request.json())["method"]
        if method == "plain":
            return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {}}, headers={"X-Upstream": "yes"})
        if method == "big":
            return web.Response(body=b"x" * BIG, content_type="application/json")
        if method == "sse":
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            await stream.write(_event(1))
            await self.release_second_event.wait()
            await stream.write(_event(2))
            await stream.write_eof()
            return stream
        assert request.transport is not None
        if method == "drop-plain":  # promises 1,000 bytes, sends 10, then closes
            raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n0123456789"
        else:  # drop-sse: one event, then the connection closes without the chunked end
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            raw = head + f"{len(_event(1)):x}\r\n".encode() + _event(1) + b"\r\n"
        request.transport.write(raw)
        await asyncio.sleep(0.05)
        request.transport.close()
        return web.Response()  # never written: the connection is gone


@pytest.fixture
async def canned() -> AsyncIterator[tuple[Canned, str]]:
    upstream = Canned()
    app = web.Application()
    app.router.add_post("/mcp", upstream.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield upstream, str(server.make_url("/mcp"))
    await server.close()


def _post(method: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": {}}


async def test_a_plain_answer_arrives_whole_with_its_headers(
    make_proxy: Callable[..., Any], canned: tuple[Canned, str]
) -> None:
    proxy = await make_proxy(canned[1])
    response = await proxy.post("/mcp", json=_post("plain"), headers=LEGACY_HEADERS)
    assert response.status == 200
    assert response.headers["X-Upstream"] == "yes"
    assert response.headers["Content-Length"] == str(len(await response.read()))
    assert await response.json() == {"jsonrpc": "2.0", "id": 1, "result": {}}


async def test_a_body_over_the_buffer_limit_is_streamed_intact(
    make_proxy: Callable[..., Any], canned: tuple[Canned, str]
) -> None:
    proxy = await make_proxy(canned[1])
    response = await proxy.post("/mcp", json=_post("big"), headers=LEGACY_HEADERS)
    assert response.status == 200
    assert response.headers["Content-Length"] == str(BIG)
    assert await response.read() == b"x" * BIG


async def test_sse_events_reach_the_client_as_they_arrive(
    make_proxy: Callable[..., Any], canned: tuple[Canned, str]
) -> None:
    upstream, url = canned
    proxy = await make_proxy(url)
    response = await proxy.post("/mcp", json=_post("sse"), headers=LEGACY_HEADERS)
    assert response.headers["Content-Type"] == "text/event-stream"
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)  # before the upstream goes on
    assert first == _event(1)
    upstream.release_second_event.set()
    assert await response.read() == _event(2)


async def test_an_upstream_that_drops_a_plain_answer_is_a_502(
    make_proxy: Callable[..., Any], canned: tuple[Canned, str]
) -> None:
    proxy = await make_proxy(canned[1])
    response = await proxy.post("/mcp", json=_post("drop-plain"), headers=LEGACY_HEADERS)
    assert response.status == 502
    assert (await response.json())["error"]["code"] == -32603
    again = await proxy.post("/mcp", json=_post("plain"), headers=LEGACY_HEADERS)
    assert again.status == 200  # the proxy goes on serving


async def test_an_upstream_that_drops_an_sse_answer_cuts_the_clients_stream(
    make_proxy: Callable[..., Any], canned: tuple[Canned, str]
) -> None:
    proxy = await make_proxy(canned[1])
    response = await proxy.post("/mcp", json=_post("drop-sse"), headers=LEGACY_HEADERS)
    assert response.status == 200  # the headers were out before the upstream went away, as directly
    assert await response.content.readuntil(b"\n\n") == _event(1)
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()


async def test_a_head_answer_keeps_its_content_length(make_proxy: Callable[..., Any]) -> None:
    async def head(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 321, content_type="application/json")

    app = web.Application()
    app.router.add_get("/mcp", head)  # aiohttp answers HEAD from the GET route
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await make_proxy(str(server.make_url("/mcp")))
        response = await proxy.head("/mcp")
        assert response.status == 200
        assert response.headers["Content-Length"] == "321"
        assert await response.read() == b""
    finally:
        await server.close()
