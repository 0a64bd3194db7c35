"""Nothing a client sends becomes a header line or a request of its own upstream (RFC 9110 §5.5, CWE-113,
request smuggling): trace context (`traceparent`, `tracestate`, `baggage`, W3C Trace Context and W3C Baggage)
holding CR LF, a bare LF, a bare CR, NUL or a whole second request, in `params._meta` and as HTTP headers, on
`tools/call` and `prompts/get`, tracing off and on, and through the legacy pass-through. The proxy runs in
front of the real mcp 1.x fixture behind a recording TCP relay; h11 reads what the upstream received.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.observe import tracing_setup
from tests.support.processes import Upstream
from tests.support.recorder import RecordingRelay, SeenRequest
from tests.support.wire import HEADERS, INITIALIZE, modern_body, modern_headers

Client = TestClient[web.Request, web.Application]

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
GOOD = {"traceparent": TRACEPARENT, "tracestate": "rojo=00f067aa0ba902b7", "baggage": "userId=alice"}
SMUGGLED = "\r\n\r\nPOST /mcp HTTP/1.1\r\nHost: upstream\r\nX-Smuggled: yes\r\nContent-Length: 2\r\n\r\n{}"
PAYLOADS = {
    "crlf": "\r\nX-Injected: yes",
    "lf": "\nX-Injected: yes",
    "cr": "\rX-Injected: yes",
    "nul": "\x00X-Injected: yes",
    "smuggled": SMUGGLED,
}
TRACE_KEYS = ("traceparent", "tracestate", "baggage")
CALLS: dict[str, dict[str, Any]] = {
    "tools/call": {"name": "trace_context", "arguments": {}},
    "prompts/get": {"name": "test_simple_prompt"},
}


@pytest.fixture
async def relay(upstream: Upstream) -> AsyncIterator[RecordingRelay]:
    recorder = RecordingRelay(upstream.port)
    await recorder.start()
    yield recorder
    await recorder.close()


@pytest.fixture(params=["tracing-off", "tracing-on"])
def tracing_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    mode: str = request.param
    if mode == "tracing-on":
        assert tracing_setup.configure(environ={}, processor=SimpleSpanProcessor(InMemorySpanExporter()))
    yield mode
    if mode == "tracing-on":
        tracing_setup.shutdown()


def nothing_injected(relay: RecordingRelay) -> list[SeenRequest]:
    """What the upstream received, checked: no header of the client's making, no request but the proxy's own
    (each a JSON-RPC message, or a GET/DELETE without a body), and no trace value that does not parse."""
    seen = relay.requests()
    assert seen, "the relay recorded the proxy's requests"
    for request in seen:
        assert "x-injected" not in request.names()
        assert "x-smuggled" not in request.names()
        assert request.target == "/mcp"
        if request.method == "POST":
            message = json.loads(request.body)
            assert isinstance(message, dict)
            assert message.get("jsonrpc") == "2.0"
        for name, value in request.headers:
            if name in TRACE_KEYS:
                assert value in GOOD.values() or name == "traceparent", (name, value)  # tracing on: its own span
    for data in relay.sent:
        assert b"injected" not in bytes(data).lower()  # not as a header, not inside a forwarded `_meta` either
        assert b"smuggled" not in bytes(data).lower()
    return seen


async def raw_post(port: int, lines: list[bytes], body: bytes) -> tuple[int, bytes, bytes]:
    """One POST with exactly these header lines (any bytes in them), `Connection: close`: status, type, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = b"".join(line + b"\r\n" for line in lines)
        writer.write(
            b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n".encode()
            + head
            + b"\r\n"
            + body
        )
        answer = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    head_block, _, payload = rest.partition(b"\r\n\r\n")
    content_type = next(
        (
            line.split(b":", 1)[1].strip()
            for line in head_block.split(b"\r\n")
            if line.lower().startswith(b"content-type:")
        ),
        b"",
    )
    return int(status_line.split(b" ")[1]), content_type, payload


def jsonrpc_answer(content_type: bytes, payload: bytes) -> dict[str, Any]:
    """The JSON-RPC message of an answer, JSON or the last `data:` of an SSE stream."""
    if content_type.startswith(b"text/event-stream"):
        data = [line[5:].strip() for line in payload.split(b"\n") if line.startswith(b"data:") and line[5:].strip()]
        message: dict[str, Any] = json.loads(data[-1])
    else:
        message = json.loads(payload)
    assert message["jsonrpc"] == "2.0"
    return message


@pytest.mark.parametrize("method", list(CALLS))
async def test_trace_context_in_meta_never_becomes_a_header_or_a_request(
    make_proxy: Callable[..., Any], relay: RecordingRelay, tracing_mode: str, method: str
) -> None:
    """Each trace key with each payload in `params._meta`: the call goes on without it (W3C Trace Context: a
    value that does not parse is dropped, the trace restarts), the client gets its JSON-RPC answer."""
    proxy: Client = await make_proxy(relay.url)
    name = CALLS[method]["name"]
    for key in TRACE_KEYS:
        for label, payload in PAYLOADS.items():
            meta = {**GOOD, key: GOOD[key] + payload}
            body = modern_body(method, CALLS[method], **meta)
            response = await proxy.post("/mcp", json=body, headers=modern_headers(method, name))
            assert response.status == 200, (key, label, await response.text())
            answer = await response.json()
            assert "result" in answer, (key, label, answer)
            if method == "tools/call" and tracing_mode == "tracing-off":
                received = json.loads(answer["result"]["content"][0]["text"])
                if key != "traceparent":  # a traceparent that does not parse takes its tracestate with it
                    assert received["headers"]["traceparent"] == TRACEPARENT
                assert received["headers"][key] is None
                assert received["meta"][key] is None
    nothing_injected(relay)


async def test_valid_trace_context_still_reaches_the_upstream(
    make_proxy: Callable[..., Any], relay: RecordingRelay
) -> None:
    """The other side of the rule: a trace context of the W3C grammars goes upstream as it came (tracing off),
    from `_meta` and from HTTP headers, so the checks above can see a trace header when there is one."""
    proxy: Client = await make_proxy(relay.url)
    body = modern_body("tools/call", CALLS["tools/call"], **GOOD)
    response = await proxy.post("/mcp", json=body, headers=modern_headers("tools/call", "trace_context"))
    received = json.loads((await response.json())["result"]["content"][0]["text"])
    assert received["headers"] == GOOD
    assert received["meta"] == GOOD
    headers = modern_headers("tools/call", "trace_context", **GOOD)
    body = modern_body("tools/call", CALLS["tools/call"])
    response = await proxy.post("/mcp", json=body, headers=headers)
    received = json.loads((await response.json())["result"]["content"][0]["text"])
    assert received["headers"] == GOOD
    calls = [request for request in nothing_injected(relay) if b'"trace_context"' in request.body]
    assert [dict(request.headers)["traceparent"] for request in calls] == [TRACEPARENT, TRACEPARENT]


@pytest.mark.parametrize("method", list(CALLS))
async def test_trace_context_in_http_headers_never_becomes_a_header_upstream(
    make_proxy: Callable[..., Any], relay: RecordingRelay, tracing_mode: str, method: str
) -> None:
    """Each trace key sent as an HTTP header with a control character in it. A bare LF, a bare CR or a NUL is
    refused by the proxy's HTTP parser (HTTP 400, never a 5xx) before any code of the proxy runs; a CR LF ends
    the header there, and what follows is a header of the client's own request, which the modern path never
    forwards (only the trace keys go upstream, parsed). A second request after an empty line ends the first
    request's headers there, and what is left after the first request's body is data after `Connection:
    close`, which the parser refuses too (HTTP 400)."""
    proxy: Client = await make_proxy(relay.url)
    assert proxy.port is not None
    name = str(CALLS[method]["name"])
    body = json.dumps(modern_body(method, CALLS[method])).encode()
    fixed = [f"{header}: {value}".encode() for header, value in modern_headers(method, name).items()]
    for key in TRACE_KEYS:
        for label in PAYLOADS:
            good = [f"{header}: {value}".encode() for header, value in GOOD.items() if header != key]
            injected = f"{key}: {GOOD[key]}{PAYLOADS[label]}".encode()
            status, content_type, payload = await raw_post(proxy.port, [*fixed, *good, injected], body)
            assert status < 500, (key, label, status, payload[:200])
            if label == "crlf":
                assert status == 200, (key, label, payload[:200])
                assert "result" in jsonrpc_answer(content_type, payload)
            else:
                assert status == 400, (key, label, payload[:200])
    nothing_injected(relay)


async def test_the_legacy_pass_through_relays_no_injected_header_or_request(
    make_proxy: Callable[..., Any], relay: RecordingRelay, tracing_mode: str
) -> None:
    """A legacy (2025-11-25) session through the pass-through. Its body is relayed byte for byte (a `_meta`
    trace value stays a JSON string inside it, escaped: never a header); trace headers with a bare LF, CR or NUL
    are refused by the HTTP parser (400), and a trace header that does not parse is dropped."""
    proxy: Client = await make_proxy(relay.url)
    assert proxy.port is not None
    response = await proxy.post("/mcp", json=INITIALIZE, headers=HEADERS)
    assert response.status == 200
    session = {**HEADERS, "Mcp-Session-Id": response.headers["Mcp-Session-Id"], "MCP-Protocol-Version": "2025-11-25"}
    await response.read()
    response = await proxy.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session)
    assert response.status == 202
    for key in TRACE_KEYS:
        for label, payload in PAYLOADS.items():
            params = {"name": "trace_context", "arguments": {}, "_meta": {key: GOOD[key] + payload}}
            call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
            response = await proxy.post("/mcp", json=call, headers=session)
            assert response.status == 200, (key, label)
            assert "result" in jsonrpc_answer(response.content_type.encode(), await response.read())
        lines = [f"{header}: {value}".encode() for header, value in session.items()]
        body = json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": CALLS["tools/call"]}).encode()
        for label in ("lf", "cr", "nul"):
            injected = f"{key}: {GOOD[key]}{PAYLOADS[label]}".encode()
            status, _, answer = await raw_post(proxy.port, [*lines, injected], body)
            assert status == 400, (key, label, answer[:200])
        status, content_type, answer = await raw_post(proxy.port, [*lines, f"{key}: not valid".encode()], body)
        assert status == 200
        assert "result" in jsonrpc_answer(content_type, answer)
    seen = relay.requests()
    for request in seen:
        assert "x-injected" not in request.names()
        assert "x-smuggled" not in request.names()
        assert request.target == "/mcp"
        assert ("traceparent", "not valid") not in request.headers
        assert ("tracestate", "not valid") not in request.headers
        assert ("baggage", "not valid") not in request.headers
        if request.method == "POST":
            assert json.loads(request.body)["jsonrpc"] == "2.0"
    assert sum(b'"trace_context"' in request.body for request in seen) == len(TRACE_KEYS) * (len(PAYLOADS) + 1)
