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
from multidict import CIMultiDict

from proxy.errors import InvalidRequestError, UpstreamRequestInvalidError
from proxy.legacy.passthrough import BUFFERED_BODY_MAX_BYTES, _checked
from proxy.upstream.http.answers import checked_headers
from proxy.upstream.http.h1 import H1RequestError, RequestWriter

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


# --- what reaches the upstream: the client's headers, plus the conventional X-Forwarded-* -------------------


async def echo_request(request: web.Request) -> web.Response:
    """The upstream: answers with the request line's method, the headers in the order received, and the body."""
    body = await request.read()
    received = [[name.decode("latin-1"), value.decode("latin-1")] for name, value in request.raw_headers]
    return web.json_response({"method": request.method, "headers": received, "body": body.decode("latin-1")})


@pytest.fixture
async def echo() -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_route("*", "/mcp", echo_request)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


async def raw_request(port: int, method: str, headers: list[tuple[str, str]], body: bytes = b"") -> dict[str, Any]:
    """Exactly these headers (no client library adding its own), `Connection: close`, the echo's answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = "".join(f"{name}: {value}\r\n" for name, value in [*headers, ("Connection", "close")])
        writer.write(f"{method} /mcp HTTP/1.1\r\n{head}\r\n".encode("latin-1") + body)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split(b" ")[1] == b"200", answer[:500]
    echoed: dict[str, Any] = json.loads(rest.partition(b"\r\n\r\n")[2])
    return echoed


def _without(received: list[list[str]], *names: str) -> list[tuple[str, str]]:
    return [(name.lower(), value) for name, value in received if name.lower() not in names]


FORWARDED = ("x-forwarded-for", "x-forwarded-proto", "x-forwarded-host")


@pytest.mark.parametrize("method", ["POST", "GET", "DELETE"])
async def test_the_upstream_gets_the_clients_headers_and_nothing_of_the_proxys_own(
    make_proxy: Callable[..., Any], echo: TestServer, method: str
) -> None:
    """A client that sends no Accept-Encoding, Accept, Content-Type or User-Agent: the upstream sees none either
    (aiohttp's client would add `Accept-Encoding: gzip, deflate`, `Accept: */*` and a content type by itself),
    the same headers in the same order as a direct client's, plus the X-Forwarded-* of this hop."""
    proxy = await make_proxy(str(echo.make_url("/mcp")))
    body = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}' if method == "POST" else b""
    sent = [("Mcp-Session-Id", "s-1"), ("X-Custom", "a"), ("X-Custom", "b")]
    if body:
        sent.append(("Content-Length", str(len(body))))
    assert echo.port is not None
    direct = await raw_request(echo.port, method, [("Host", f"127.0.0.1:{echo.port}"), *sent], body)
    proxied = await raw_request(proxy.port, method, [("Host", f"localhost:{proxy.port}"), *sent], body)
    assert proxied["method"] == direct["method"] == method
    assert proxied["body"] == direct["body"]
    expected = _without(direct["headers"], "connection")
    if method == "DELETE":  # framing only: aiohttp's client always says a DELETE without a body has none
        expected.append(("content-length", "0"))
    assert _without(proxied["headers"], "connection", *FORWARDED) == expected
    forwarded = dict(_without(proxied["headers"], *(n for n, _ in _without(proxied["headers"], *FORWARDED))))
    assert forwarded == {
        "x-forwarded-for": "127.0.0.1",
        "x-forwarded-proto": "http",
        "x-forwarded-host": f"localhost:{proxy.port}",
    }


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_hop_by_hop_headers_and_those_connection_names_are_not_relayed(
    make_proxy: Callable[..., Any], echo: TestServer, method: str
) -> None:
    """RFC 9110 §7.6.1: the hop-by-hop headers, whatever their case, and those the Connection header names are
    this hop's; the others reach the upstream in their order, on both clients."""
    proxy = await make_proxy(str(echo.make_url("/mcp")))
    body = b'{"jsonrpc":"2.0","id":1,"method":"ping"}' if method == "POST" else b""
    sent = [
        ("Host", "localhost"),
        ("X-First", "1"),
        ("keep-alive", "timeout=5"),
        ("Connection", "X-Private, x-other"),
        ("X-Private", "for this hop"),
        ("PROXY-AUTHORIZATION", "Basic abc"),
        ("X-Other", "for this hop too"),
        ("TE", "trailers"),
        ("X-Last", "2"),
    ]
    if body:
        sent.append(("Content-Length", str(len(body))))
    proxied = await raw_request(proxy.port, method, sent, body)
    assert _without(proxied["headers"], "host", "connection", "content-length", *FORWARDED) == [
        ("x-first", "1"),
        ("x-last", "2"),
    ]


async def test_accept_encoding_is_the_clients_own(make_proxy: Callable[..., Any], echo: TestServer) -> None:
    proxy = await make_proxy(str(echo.make_url("/mcp")))
    headers = [("Host", "localhost"), ("Accept-Encoding", "br"), ("Accept", "application/json, text/event-stream")]
    proxied = await raw_request(proxy.port, "GET", headers)
    received = _without(proxied["headers"])
    assert ("accept-encoding", "br") in received
    assert [name for name, _ in received].count("accept-encoding") == 1
    assert ("accept", "application/json, text/event-stream") in received


async def test_x_forwarded_for_is_appended_to_and_proto_and_host_are_set(
    make_proxy: Callable[..., Any], echo: TestServer
) -> None:
    """The client's X-Forwarded-For (two lines here) is kept with this hop's client appended; X-Forwarded-Proto
    and X-Forwarded-Host describe this hop, whatever the client claimed."""
    proxy = await make_proxy(str(echo.make_url("/mcp")))
    headers = [
        ("Host", "127.0.0.1"),
        ("X-Forwarded-For", "203.0.113.7"),
        ("X-Forwarded-For", "198.51.100.1, 192.0.2.9"),
        ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "spoofed.example"),
    ]
    received = _without((await raw_request(proxy.port, "GET", headers))["headers"])
    forwarded = [(name, value) for name, value in received if name in FORWARDED]
    assert sorted(forwarded) == [
        ("x-forwarded-for", "203.0.113.7, 198.51.100.1, 192.0.2.9, 127.0.0.1"),
        ("x-forwarded-host", "127.0.0.1"),
        ("x-forwarded-proto", "http"),
    ]


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc":"2.0","id":"\\ud800","method":"tools/call","params":{"x":"\\udfff"}}',
        b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"a":' + b"[" * 5000 + b"]" * 5000 + b"}}",
        b'{"jsonrpc":"2.0","id":1,"method":"m","params":{"n":1e999,"m":NaN}}',
    ],
    ids=["lone-surrogates", "deep", "non-finite"],
)
async def test_a_legacy_body_the_proxy_would_not_decode_is_relayed_byte_for_byte(
    make_proxy: Callable[..., Any], echo: TestServer, body: bytes
) -> None:
    proxy = await make_proxy(str(echo.make_url("/mcp")))
    headers = [("Host", "localhost"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    proxied = await raw_request(proxy.port, "POST", headers, body)
    assert proxied["body"].encode("latin-1") == body


async def test_a_client_that_asks_for_no_compression_gets_none(make_proxy: Callable[..., Any]) -> None:
    """An upstream that compresses whenever the request allows it: through the proxy, as directly, a client
    that sent no Accept-Encoding gets the body as it is."""

    async def compressing(request: web.Request) -> web.Response:
        response = web.json_response({"jsonrpc": "2.0", "id": 1, "result": {"text": "x" * 2000}})
        response.enable_compression()  # only applied when the request's Accept-Encoding names a coding
        return response

    app = web.Application()
    app.router.add_post("/mcp", compressing)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        proxy = await make_proxy(str(server.make_url("/mcp")))
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        body = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}'
        writer.write(
            b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert b"content-encoding" not in head.lower(), head
        assert json.loads(payload)["result"]["text"] == "x" * 2000
    finally:
        await server.close()


# --- what is written: trace context parsed, every header checked -------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_trace_headers_are_relayed_only_as_the_w3c_grammars_read_them(
    make_proxy: Callable[..., Any], echo: TestServer
) -> None:
    """W3C Trace Context §3.2, §3.3 and W3C Baggage §3: a value that does not parse is dropped, never relayed;
    a tracestate goes only with a valid traceparent."""
    proxy = await make_proxy(str(echo.make_url("/mcp")))
    valid = [("traceparent", TRACEPARENT), ("tracestate", "rojo=1"), ("tracestate", "congo=2"), ("baggage", "a=1")]
    received = _without((await raw_request(proxy.port, "GET", [("Host", "localhost"), *valid]))["headers"])
    assert [(name, value) for name, value in received if name in ("traceparent", "tracestate", "baggage")] == [
        ("traceparent", TRACEPARENT),
        ("tracestate", "rojo=1,congo=2"),
        ("baggage", "a=1"),
    ]
    invalid = [("traceparent", TRACEPARENT.upper()), ("tracestate", "rojo=1"), ("baggage", 'a="quoted"')]
    received = _without((await raw_request(proxy.port, "GET", [("Host", "localhost"), *invalid]))["headers"])
    assert [name for name, _ in received if name in ("traceparent", "tracestate", "baggage")] == []


@pytest.mark.parametrize("value", ["a\x01b", "a\x7f", "a\r\nX-Injected: yes", "a\x00", " leading"])
@pytest.mark.parametrize("writer", ["aiohttp", "lean"])
def test_a_header_that_cannot_be_written_fails_the_relayed_request(value: str, writer: str) -> None:
    """RFC 9110 §5.5: a field value holds no control character but tab, and no surrounding whitespace. Each
    client checks every header where it writes it: `checked_headers` before aiohttp's client (which refuses only
    CR and LF itself), the lean client's own writer; nothing is written, and the error never holds the value."""
    headers: CIMultiDict[str] = CIMultiDict({"Accept": "application/json", "X-Forwarded-Host": value})
    refused: UpstreamRequestInvalidError | H1RequestError
    if writer == "aiohttp":
        with pytest.raises(UpstreamRequestInvalidError, match="X-Forwarded-Host") as raised:
            checked_headers(headers)
        refused = raised.value
        assert refused.http_status == 400
        assert value not in refused.message
        checked_headers(CIMultiDict({"Accept": "application/json", "X-Forwarded-Host": "a\tb"}))
    else:
        with pytest.raises(H1RequestError, match="X-Forwarded-Host") as lean:
            RequestWriter("upstream:9000").request("POST", "/mcp", headers.items(), b"{}")
        assert value.strip() not in str(lean.value)
        fine = [("Accept", "application/json"), ("X-Forwarded-Host", "a\tb")]
        assert RequestWriter("upstream:9000").request("POST", "/mcp", fine, b"{}").startswith(b"POST /mcp HTTP/1.1")


@pytest.mark.parametrize("target", ["/mcp\r\nX-Injected: yes", "/mcp x", "mcp", "/mcp\x00"])
def test_a_request_target_that_cannot_be_written_fails_the_relayed_request(target: str) -> None:
    """RFC 9112 §3.2: origin-form, visible ASCII only."""
    with pytest.raises(InvalidRequestError):
        _checked(target)
