"""The benchmarks' load generator against a real aiohttp server on loopback: answers parsed whole (JSON and
chunked SSE), connections kept alive and reused, and closed when the server says so or drops them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchmarks.loadgen import HttpClient


async def answer(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    peer: int = request.transport.get_extra_info("peername")[1]  # the client's port names its connection
    kind = request.query.get("kind", "json")
    if kind == "json":
        return web.json_response({"port": peer, "body": (await request.read()).decode()})
    if kind == "close":
        return web.json_response({"port": peer}, headers={"Connection": "close"})
    if kind == "sse":
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'event: message\ndata: {"n": 1}\n\n')
        await stream.write(b'event: message\ndata: {"port": %d}\n\n' % peer)
        await stream.write_eof()
        return stream
    request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
    request.transport.close()
    await asyncio.sleep(0.05)
    return web.Response()


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_post("/mcp", answer)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server()
    yield test_server
    await test_server.close()


def client_for(server: TestServer, kind: str) -> HttpClient:
    return HttpClient(str(server.make_url(f"/mcp?kind={kind}")))


async def test_json_answers_come_back_whole_over_one_kept_alive_connection(server: TestServer) -> None:
    client = client_for(server, "json")
    ports = set()
    for number in range(5):
        response = await client.post(f"request {number}".encode(), {"Content-Type": "text/plain"})
        assert response.status == 200
        assert response.json()["body"] == f"request {number}"
        ports.add(response.json()["port"])
    assert len(ports) == 1  # the same connection every time
    client.close()


async def test_concurrent_requests_get_a_connection_each_then_share_them(server: TestServer) -> None:
    client = client_for(server, "json")
    first = await asyncio.gather(*(client.post(b"", {}) for _ in range(3)))
    assert len({response.json()["port"] for response in first}) == 3
    again = await asyncio.gather(*(client.post(b"", {}) for _ in range(3)))
    assert {response.json()["port"] for response in again} == {response.json()["port"] for response in first}
    client.close()


async def test_a_chunked_sse_answer_yields_its_last_message(server: TestServer) -> None:
    client = client_for(server, "sse")
    response = await client.post(b"", {})
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.body.count(b"event: message") == 2
    port = response.json()["port"]
    assert (await client.post(b"", {})).json()["port"] == port  # reused after a chunked body too
    client.close()


async def test_connection_close_is_honoured(server: TestServer) -> None:
    client = client_for(server, "close")
    ports = {(await client.post(b"", {})).json()["port"] for _ in range(3)}
    assert len(ports) == 3


async def test_a_server_that_drops_the_answer_is_an_error(server: TestServer) -> None:
    client = client_for(server, "drop")
    with pytest.raises(ConnectionError, match="mid-response"):
        await client.post(b"", {})


def test_a_url_without_a_port_is_refused() -> None:
    with pytest.raises(ValueError, match="host and a port"):
        HttpClient("http://localhost/mcp")
