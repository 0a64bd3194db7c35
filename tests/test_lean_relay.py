"""The legacy relay's lean upstream client (POSTs to a plain-HTTP upstream), against real servers on loopback:
connections kept and reused, given up when the upstream closes them, answers of every framing relayed whole,
interim answers skipped, the call timeout kept, no cookie shared between clients, and flow control on a large
answer nobody reads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from proxy.config.loader import ConfigError, load_config
from proxy.upstream.http.h1 import H1ConnectionError, H1LimitError, H1RequestError
from proxy.upstream.http.lean import HIGH_WATER_BYTES, LeanClient
from tests.support.clients import meta
from tests.support.h1 import RawUpstream

LEGACY_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo"}}
MODERN_CALL = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta({})}}
MODERN_HEADERS = {**LEGACY_HEADERS, "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "tools/list"}


@asynccontextmanager
async def serve(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], **server: Any
) -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_route("*", "/mcp", handler)
    test_server = TestServer(app, host="127.0.0.1")
    await test_server.start_server(**server)
    try:
        yield test_server
    finally:
        await test_server.close()


class Peers:
    """An upstream that notes the client port each tools/call came from (the proxy's own requests, such as its
    readiness probe, go on clients of their own)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    async def handle(self, request: web.Request) -> web.Response:
        assert request.transport is not None
        if (await request.json()).get("method") == "tools/call":
            self.seen.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {}})


@pytest.fixture
async def peers() -> AsyncIterator[tuple[Peers, TestServer]]:
    upstream = Peers()
    async with serve(upstream.handle) as server:
        yield upstream, server


async def test_consecutive_calls_share_one_upstream_connection(
    make_proxy: Callable[..., Any], peers: tuple[Peers, TestServer]
) -> None:
    upstream, server = peers
    proxy = await make_proxy(str(server.make_url("/mcp")))
    for _ in range(5):
        response = await proxy.post("/mcp", json=CALL, headers=LEGACY_HEADERS)
        assert response.status == 200
    assert len(upstream.seen) == 5
    assert len(set(upstream.seen)) == 1, upstream.seen


async def test_a_connection_the_upstream_closed_while_idle_is_not_used_again(
    make_proxy: Callable[..., Any],
) -> None:
    """An upstream whose keep-alive (0.1 s) is shorter than the proxy's: the next call, after it closed the idle
    connection, goes out on a new one and succeeds."""
    upstream = Peers()
    async with serve(upstream.handle, keepalive_timeout=0.1) as server:
        proxy = await make_proxy(str(server.make_url("/mcp")))
        for _ in range(3):
            response = await proxy.post("/mcp", json=CALL, headers=LEGACY_HEADERS)
            assert response.status == 200, await response.text()
            await asyncio.sleep(0.4)
        assert len(set(upstream.seen)) == 3


async def raw_upstream(answer: bytes, close: bool) -> tuple[asyncio.Server, str]:
    """A socket server that reads one request and writes `answer` as it is (then closes, if `close`)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
            0,
        )
        await reader.readexactly(length)
        writer.write(answer)
        await writer.drain()
        if close:
            writer.close()
        else:
            await reader.read()  # until the proxy closes its side

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/mcp"


BODY = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"content": [{"type": "text", "text": "x" * 3000}]}}).encode()


@pytest.mark.parametrize(
    ("answer", "close"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + BODY, True),
        (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + BODY, True),
        (
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"
            b"HTTP/1.1 200 Fine\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
            + BODY,
            False,
        ),
    ],
    ids=["ended-by-close", "http-1.0", "after-an-interim-answer"],
)
async def test_answers_of_every_framing_are_relayed_whole(
    make_proxy: Callable[..., Any], answer: bytes, close: bool
) -> None:
    server, url = await raw_upstream(answer, close)
    try:
        proxy = await make_proxy(url)
        response = await proxy.post("/mcp", json=CALL, headers=LEGACY_HEADERS)
        assert response.status == 200
        assert await response.read() == BODY
        assert "Link" not in response.headers  # the interim answer's headers are not the final one's
    finally:
        server.close()


async def test_an_upstream_that_never_answers_is_timed_out(make_proxy: Callable[..., Any]) -> None:
    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    async with serve(hang) as server:
        proxy = await make_proxy(str(server.make_url("/mcp")), upstream={"call_timeout_seconds": 0.3})
        response = await asyncio.wait_for(proxy.post("/mcp", json=CALL, headers=LEGACY_HEADERS), 10)
        assert response.status == 504
        assert "timed out" in (await response.json())["error"]["message"]


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_a_cookie_the_upstream_sets_for_one_client_never_reaches_it_with_anothers_request(
    make_proxy: Callable[..., Any], method: str
) -> None:
    """The upstream sets a cookie in its answer to client A: A gets the Set-Cookie; client B's next request
    reaches the upstream with B's own Cookie header only (an HTTP client's cookie jar would have added A's)."""
    received: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        if request.method == "GET" or (await request.json()).get("method") == "tools/call":
            received.append(request.headers.get("Cookie"))
        response = web.json_response({"jsonrpc": "2.0", "id": 1, "result": {}})
        response.set_cookie("secret", "of-client-a")
        return response

    async with serve(handle) as server:
        proxy = await make_proxy(f"http://localhost:{server.port}/mcp")  # a host name: jars ignore IP addresses
        send = proxy.post if method == "POST" else proxy.get
        first = await send("/mcp", json=CALL, headers=LEGACY_HEADERS)
        assert "secret=of-client-a" in first.headers["Set-Cookie"]
        proxy.session.cookie_jar.clear()  # client B: a client with nothing of A's
        second = await send("/mcp", json=CALL, headers={**LEGACY_HEADERS, "Cookie": "mine=b"})
        assert second.status == 200
        assert received == [None, "mine=b"]


async def test_a_large_answer_nobody_reads_stops_being_read_from_the_upstream() -> None:
    """Flow control: past HIGH_WATER_BYTES unread, the client stops reading the socket, so the upstream's own
    write buffer fills instead of the proxy's memory; read on, the whole answer arrives intact."""
    size = 16 * HIGH_WATER_BYTES
    written = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
        for _ in range(size // 65536):
            writer.write(b"y" * 65536)
        written.set_result(writer)
        await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = LeanClient(URL(f"http://127.0.0.1:{port}/mcp"), 5, 30)
    try:
        response = await client.post("/mcp", [("Content-Type", "application/json")], b"{}")
        writer = await asyncio.wait_for(written, 10)
        await asyncio.sleep(0.5)  # time for the client to read whatever it would
        assert writer.transport.get_write_buffer_size() > size // 2  # still with the upstream: not read
        assert response._buffered <= HIGH_WATER_BYTES + 262144  # the client holds about HIGH_WATER_BYTES
        body = await asyncio.wait_for(response.read(), 30)
        assert body == b"y" * size
    finally:
        await client.close()
        server.close()


@pytest.mark.parametrize(
    "headers",
    [{"X-Api-Key": "a\r\nInjected: yes"}, {"Bad Name": "v"}, {"X-Api-Key": "nul\0"}],
    ids=["line-break", "space-in-name", "nul"],
)
def test_extra_upstream_headers_must_be_valid_http(headers: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="header"):
        load_config(None, environ={}, overrides={"upstream": {"url": "http://127.0.0.1:1/mcp", "headers": headers}})


async def test_an_answer_let_go_twice_leaves_the_connection_to_the_next_request(
    peers: tuple[Peers, TestServer],
) -> None:
    """Released after its body was read, then closed by a caller that cleans up whatever it had: the connection
    is already back in the pool (or carrying the next request), and the second let-go leaves it alone."""
    upstream, server = peers
    client = LeanClient(URL(str(server.make_url("/mcp"))), 5, 30)
    body = json.dumps(CALL).encode()
    try:
        first = await client.post("/mcp", [("Content-Type", "application/json")], body)
        assert json.loads(await first.read())["result"] == {}
        first.release()
        second = await client.post("/mcp", [("Content-Type", "application/json")], body)
        first.close()  # late, after the connection went on to carry the second request
        assert json.loads(await second.read())["result"] == {}
        third = await client.post("/mcp", [("Content-Type", "application/json")], body)
        assert json.loads(await third.read())["result"] == {}
        assert len(upstream.seen) == 3
        assert len(set(upstream.seen)) == 1  # one connection throughout: the late close did not end it
    finally:
        await client.close()


async def test_a_host_and_a_length_among_the_configured_headers_are_sent_once(make_proxy: Callable[..., Any]) -> None:
    """`upstream.headers` naming Host (a virtual host behind the upstream's address) and Content-Length: the
    upstream gets one Host, the configured one, and one Content-Length, the body's own."""
    received: list[list[tuple[str, str]]] = []

    async def handle(request: web.Request) -> web.Response:
        if (await request.json()).get("method") == "tools/call":
            received.append([(name.decode().lower(), value.decode()) for name, value in request.raw_headers])
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": {}})

    async with serve(handle) as server:
        configured = {"Host": "virtual.example", "Content-Length": "999", "X-Api-Key": "k"}
        proxy = await make_proxy(str(server.make_url("/mcp")), upstream={"headers": configured})
        body = json.dumps(CALL).encode()
        response = await proxy.post("/mcp", data=body, headers=LEGACY_HEADERS)
        assert response.status == 200
        [headers] = received
        assert [value for name, value in headers if name == "host"] == ["virtual.example"]
        assert [value for name, value in headers if name == "content-length"] == [str(len(body))]
        assert ("x-api-key", "k") in headers


async def test_a_client_that_leaves_mid_stream_closes_the_upstream_connection(
    make_proxy: Callable[..., Any],
) -> None:
    """A legacy client reads the first event of a streamed answer and goes away: the proxy gives up the
    upstream connection too, so the upstream sees its client leave (as it would directly) instead of writing
    into a connection nobody reads until the call timeout."""
    upstream_saw_the_end = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        finished = False
        try:
            for number in range(1000):
                await stream.write(f"event: message\ndata: {number}\n\n".encode())
                await asyncio.sleep(0.02)
            finished = True
        finally:  # its write failing, or (the test server cancels handlers whose client left) cancelled
            if not finished:
                upstream_saw_the_end.set()
        return stream

    async with serve(endless) as server:
        proxy = await make_proxy(str(server.make_url("/mcp")))
        assert proxy.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body = json.dumps(CALL).encode()
        writer.write(
            b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        assert b"data: 0" in await asyncio.wait_for(reader.readuntil(b"data: 0"), 10)
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(upstream_saw_the_end.wait(), 10)


async def test_the_call_timeout_also_bounds_an_answer_whose_body_stalls(make_proxy: Callable[..., Any]) -> None:
    """The upstream sends its headers and one event, then nothing: at `call_timeout_seconds` the proxy gives the
    answer up, and the client's stream ends cut (its headers were out), not held open until the upstream wakes."""

    async def stalls(request: web.Request) -> web.StreamResponse:
        await request.read()
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b"event: message\ndata: 0\n\n")
        await asyncio.sleep(30)
        return stream

    async with serve(stalls) as server:
        proxy = await make_proxy(str(server.make_url("/mcp")), upstream={"call_timeout_seconds": 0.5})
        response = await proxy.post("/mcp", json=CALL, headers=LEGACY_HEADERS)
        assert response.status == 200
        assert await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5) == b"event: message\ndata: 0\n\n"
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(response.read(), 5)


# --- what the client writes, and what it refuses to read (RFC 9110 §5.5, RFC 9112 §3.2 and §6.3) ---


async def test_a_header_that_could_split_the_request_is_refused_before_anything_is_sent() -> None:
    """The request fails with the client's own error; the upstream sees no connection, no byte."""
    upstream = await RawUpstream([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"], end="keep").start()
    client = LeanClient(URL(upstream.url), 5, 30)
    try:
        for value in ("a\r\nX-Injected: yes", "a\nb", "a\x00b", "x\r\n\r\nPOST /admin HTTP/1.1\r\nHost: up"):
            with pytest.raises(H1RequestError):
                await client.post("/mcp", [("traceparent", value)], b"{}")
        with pytest.raises(H1RequestError):
            await client.post("/mcp\r\nX-Injected: yes", [], b"{}")
        assert upstream.connections == 0
        answer = await client.post("/mcp", [("traceparent", "fine")], b"{}")  # the client still works
        assert (answer.status, await answer.read()) == (200, b"")
        assert upstream.requests[0].startswith(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:")
    finally:
        await client.close()
        await upstream.stop()


@pytest.mark.parametrize(
    ("answer", "limit"),
    [
        ([b"HTTP/1.1 200 " + b"x" * (1 << 20) + b"\r\n\r\n"], "max_status_line_bytes"),
        ([b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 10_000 + b"\r\n"], "max_headers"),
    ],
    ids=["1-MB-status-line", "10000-headers"],
)
async def test_a_hostile_head_is_refused_at_its_cap_with_a_gateway_error(
    make_proxy: Callable[..., Any], answer: list[bytes], limit: str
) -> None:
    """Directly: the client's own limit error. Through the proxy: a JSON-RPC gateway error (502) that names the
    limit, for the legacy relay and for the proxy's own sessions."""
    upstream = await RawUpstream(answer).start()
    client = LeanClient(URL(upstream.url), 5, 30)
    try:
        with pytest.raises(H1LimitError) as refused:
            await client.post("/mcp", [], b"{}")
        assert refused.value.limit == limit
        proxy = await make_proxy(upstream.url)
        response = await proxy.post("/mcp", json=CALL, headers=LEGACY_HEADERS)
        assert response.status == 502
        error = (await response.json())["error"]
        assert error["code"] == -32603
        assert error["data"]["limit"] == limit
        modern = await proxy.post("/mcp", json=MODERN_CALL, headers=MODERN_HEADERS)
        assert modern.status == 502
        assert (await modern.json())["error"]["data"]["limit"] == limit
    finally:
        await client.close()
        await upstream.stop()


@pytest.mark.parametrize(
    ("head", "end", "whole"),
    [
        (b"HTTP/1.1 200 OK\r\n\r\n", "close", True),  # ends with the connection: a clean close is the end
        (b"HTTP/1.1 200 OK\r\n\r\n", "reset", False),  # ... a reset is not
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", "close", False),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n", "close", False),
    ],
    ids=["until-close-closed", "until-close-reset", "content-length-closed", "chunked-closed"],
)
async def test_a_connection_that_ends_mid_body_is_taken_as_the_end_only_when_it_frames_the_body(
    head: bytes, end: Literal["close", "reset"], whole: bool
) -> None:
    hold = asyncio.Event()  # the upstream ends the connection only once the client has the first bytes
    upstream = await RawUpstream([head + b"hello"], end=end, hold=hold).start()
    client = LeanClient(URL(upstream.url), 5, 30)
    try:
        answer = await client.post("/mcp", [], b"{}")
        assert await answer.next_chunk() == b"hello"
        hold.set()
        if whole:
            assert await answer.next_chunk() == b""
            assert answer.ended
        else:
            with pytest.raises(H1ConnectionError) as cut:
                await answer.read()
            assert cut.value.answered
            assert not answer.ended
    finally:
        await client.close()
        await upstream.stop()
