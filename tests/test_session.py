"""upstream/http/: the proxy's own Streamable HTTP sessions, against a real legacy server (no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.schema import HttpUpstreamConfig
from proxy.errors import (
    UpstreamError,
    UpstreamRefusedError,
    UpstreamRequestInvalidError,
    UpstreamSessionGoneError,
    UpstreamUnreachableError,
)
from proxy.principals import Identity, identity_of, principal_key
from proxy.upstream.http.session import HttpKind, upstream_connector
from proxy.upstream.pool import SessionPool
from proxy.wire.upstream_events import UpstreamErrorResponse
from tests.support.processes import Upstream
from tests.support.tls import loopback_contexts
from tests.support.waiting import until


def make_client(upstream: Upstream, http: aiohttp.ClientSession, max_sessions: int = 8) -> SessionPool:
    return SessionPool(
        HttpKind(HttpUpstreamConfig(url=upstream.url, max_sessions=max_sessions), http, "authorization", None)
    )


async def test_initialize_once_and_reuse(upstream: Upstream, http: aiohttp.ClientSession) -> None:
    client = make_client(upstream, http)
    session = client.session(None)
    results = await asyncio.gather(*(session.ensure_initialized() for _ in range(10)))
    assert all(result is results[0] for result in results)  # one initialize for ten concurrent callers
    assert results[0]["serverInfo"]["name"] == "legacy-fixture-upstream"
    assert session.session_id is not None
    assert (await session.request("tools/list", None))["tools"]
    await client.close()
    assert session.session_id is None  # closed with DELETE


async def test_idle_sessions_are_evicted_busy_ones_kept(upstream: Upstream, http: aiohttp.ClientSession) -> None:
    client = make_client(upstream, http, max_sessions=1)
    async with (
        client.use(Identity("Bearer a")) as first,
        first.call("tools/call", {"name": "sleep", "arguments": {"seconds": 0.2}}) as running,
    ):
        async with client.use(Identity("Bearer b")) as second:
            await second.ensure_initialized()
        client.session(Identity("Bearer c"))  # two idle sessions over a limit of one: "b" (the older) goes
        assert client.session(Identity("Bearer a")) is first  # in use: never evicted
        assert client.session(Identity("Bearer b")) is not second
        assert client.idle_sessions == 1
        async for _ in running.events():
            pass
    await until(lambda: second.session_id is None, "the evicted session was not ended with DELETE", 5)
    await client.close()


async def test_unreachable_upstream_is_an_unreachable_error(http: aiohttp.ClientSession) -> None:
    config = HttpUpstreamConfig(url="http://127.0.0.1:9/mcp", connect_timeout_seconds=1)
    client = SessionPool(HttpKind(config, http, "authorization", None))
    with pytest.raises(UpstreamUnreachableError, match="unavailable"):
        await client.session(None).ensure_initialized()
    await client.close()


def test_principal_keys_are_hashes() -> None:
    assert principal_key(None) == principal_key(identity_of("")) == ""
    key = principal_key(Identity("Bearer secret"))
    assert "secret" not in key
    assert len(key) == 64
    assert key != principal_key(Identity("Bearer other"))


async def refusing_upstream(request: web.Request) -> web.Response:
    """A stateless server that initializes, then refuses `tools/list` as an unknown session would (400) and
    `prompts/list` with a plain server error (500), neither with a JSON-RPC answer."""
    message = await request.json()
    if message.get("method") == "initialize":
        result = {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "serverInfo": {"name": "refusing", "version": "1"},
        }
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})
    if "id" not in message:
        return web.Response(status=202)
    return web.Response(status=400 if message["method"] == "tools/list" else 500, text="no")


async def test_a_refusal_says_by_its_type_whether_the_upstream_forgot_the_session(
    http: aiohttp.ClientSession,
) -> None:
    app = web.Application()
    app.router.add_post("/mcp", refusing_upstream)
    async with TestServer(app, host="127.0.0.1") as server:
        client = SessionPool(
            HttpKind(HttpUpstreamConfig(url=str(server.make_url("/mcp"))), http, "authorization", None)
        )
        session = client.session(None)
        with pytest.raises(UpstreamSessionGoneError, match="HTTP 400"):
            await session.request("tools/list", None)
        with pytest.raises(UpstreamRefusedError, match="HTTP 500") as refused:
            await session.request("prompts/list", None)
        assert not isinstance(refused.value, UpstreamSessionGoneError)
        await client.close()


@pytest.mark.parametrize(
    ("version", "session_id"),
    [("2025-11-25\r\nX-Injected: yes", "s-1"), ("2025-11-25\x00", None)],
)
async def test_an_initialize_result_that_cannot_be_sent_back_as_headers_is_refused(
    http: aiohttp.ClientSession, version: str, session_id: str | None
) -> None:
    """RFC 9110 §5.5: the negotiated version and the session id go back upstream as header values; one that
    holds a control character is refused at initialize, so no later request writes it."""
    seen: list[str] = []

    async def post(request: web.Request) -> web.Response:
        message = await request.json()
        seen.append(message["method"])
        result = {"protocolVersion": version, "capabilities": {}, "serverInfo": {"name": "s", "version": "1"}}
        headers = {"Mcp-Session-Id": session_id} if session_id is not None else {}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result}, headers=headers)

    app = web.Application()
    app.router.add_post("/mcp", post)
    async with TestServer(app, host="127.0.0.1") as server:
        client = SessionPool(
            HttpKind(HttpUpstreamConfig(url=str(server.make_url("/mcp"))), http, "authorization", None)
        )
        with pytest.raises(UpstreamError):
            await client.session(None).ensure_initialized()
        assert seen == ["initialize"]  # not even notifications/initialized was sent
        await client.close()


STOP: web.AppKey[asyncio.Event] = web.AppKey("stop", asyncio.Event)


class Inbox:
    """A listen stream's inbox: what the session's GET stream delivered."""

    def __init__(self) -> None:
        self.messages: list[dict[str, object]] = []

    def offer(self, message: dict[str, object] | None) -> None:
        if message is not None:
            self.messages.append(message)

    def texts(self) -> list[object]:
        return [message["params"]["data"] for message in self.messages]  # type: ignore[index]


def get_stream_upstream(big_bytes: int) -> web.Application:
    """A stateful server whose first GET stream sends one notification of `big_bytes` and stays open; every
    later GET stream sends `reconnected` (so whether the proxy read the stream again is visible)."""
    opened: list[int] = []

    async def post(request: web.Request) -> web.Response:
        message = await request.json()
        if message.get("method") == "initialize":
            result = {"protocolVersion": "2025-11-25", "capabilities": {}, "serverInfo": {"name": "s", "version": "1"}}
            response = {"jsonrpc": "2.0", "id": message["id"], "result": result}
            return web.json_response(response, headers={"Mcp-Session-Id": "kept-session"})
        return web.Response(status=202)

    async def get(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Mcp-Session-Id") != "kept-session":
            return web.Response(status=404)
        opened.append(1)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        data = "x" * big_bytes if len(opened) == 1 else "reconnected"
        message = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": data}}
        await response.write(f"data: {json.dumps(message)}\n\n".encode())
        await request.app[STOP].wait()  # open until the test ends
        return response

    app = web.Application()
    app[STOP] = asyncio.Event()
    app.router.add_post("/mcp", post)
    app.router.add_get("/mcp", get)
    return app


@pytest.mark.parametrize("adopted", [False, True], ids=["initialized", "adopted-after-restart"])
async def test_a_get_stream_message_over_max_result_bytes_is_dropped(
    http: aiohttp.ClientSession, adopted: bool
) -> None:
    """A message on the GET stream larger than `limits.max_result_bytes` is never held whole: it is dropped and
    the stream read again, on a session this process initialized and on one it adopted after a restart."""
    cap = 10_000
    app = get_stream_upstream(big_bytes=4 * cap)
    async with TestServer(app, host="127.0.0.1") as server:
        try:
            config = HttpUpstreamConfig(url=str(server.make_url("/mcp")))
            client = SessionPool(HttpKind(config, http, "authorization", None, max_result_bytes=cap))
            session = client.session(None)
            inbox = Inbox()
            session.subscribers.subscribe(inbox)
            if adopted:
                await session.adopt("kept-session")
            else:
                await session.ensure_initialized()
            await until(lambda: "reconnected" in inbox.texts(), lambda: f"not read again: {inbox.texts()!r:.80}")
            assert inbox.texts() == ["reconnected"]  # the large message never reached a listener
            session.detach()
            await client.close()
        finally:
            app[STOP].set()  # the GET handlers return, so the server stops at once


async def test_calls_answered_on_sse_streams_reuse_their_connections(upstream: Upstream) -> None:
    """The fixture answers each request on an SSE stream it ends after the answer: the stream is read to its end,
    so its connection serves the next request instead of a new one being opened each time."""
    opened: list[object] = []

    async def on_open(*_: object) -> None:
        opened.append(object())

    tracing = aiohttp.TraceConfig()
    tracing.on_connection_create_end.append(on_open)
    async with aiohttp.ClientSession(connector=upstream_connector(), trace_configs=[tracing]) as http:
        client = make_client(upstream, http)
        session = client.session(None)
        await session.request("tools/list", None)  # initialize, its GET stream, a first call
        before = len(opened)
        for _ in range(20):
            result = await session.request("tools/call", {"name": "echo", "arguments": {"text": "x"}})
            assert result["content"][0]["text"] == "x"
        assert len(opened) - before <= 5, f"{len(opened) - before} connections opened for 20 calls"
        await client.close()


SEEN: web.AppKey[list[object]] = web.AppKey("seen", list)


def erring_upstream() -> web.Application:
    """A stateful server that answers `tools/call` with HTTP 500: for the tool `json-error` with the JSON-RPC
    error answering the request in the body (as some servers send errors), for any other with an HTML page.
    Notes the methods it was sent."""

    async def post(request: web.Request) -> web.Response:
        message = await request.json()
        request.app[SEEN].append(message.get("method"))
        if message.get("method") == "initialize":
            result = {"protocolVersion": "2025-11-25", "capabilities": {}, "serverInfo": {"name": "s", "version": "1"}}
            response = {"jsonrpc": "2.0", "id": message["id"], "result": result}
            return web.json_response(response, headers={"Mcp-Session-Id": "erring"})
        if "id" not in message:
            return web.Response(status=202)
        if message["params"]["name"] == "json-error":
            error = {"code": -32050, "message": "the backend is down"}
            return web.json_response({"jsonrpc": "2.0", "id": message["id"], "error": error}, status=500)
        return web.Response(status=500, text="<html>oops</html>", content_type="text/html")

    async def get(request: web.Request) -> web.Response:
        return web.Response(status=405)  # no standalone stream

    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/mcp", post)
    app.router.add_get("/mcp", get)
    return app


@contextlib.asynccontextmanager
async def erring_pool(client: str, directory: Path) -> AsyncIterator[tuple[SessionPool, web.Application]]:
    """A pool of sessions to `erring_upstream`, over plain HTTP (the lean client) or https (aiohttp's)."""
    server_tls, client_tls = loopback_contexts(directory)
    app = erring_upstream()
    server = TestServer(app, host="127.0.0.1")
    await server.start_server(ssl=server_tls if client == "aiohttp" else None)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_tls))
    config = HttpUpstreamConfig(url=str(server.make_url("/mcp")))
    kind = HttpKind(config, http, "authorization", None, max_result_bytes=1 << 20)  # (read as it arrives)
    assert (kind.lean is None) is (client == "aiohttp")
    pool = SessionPool(kind)
    try:
        yield pool, app
    finally:
        await pool.close()
        await http.close()
        await server.close()


CLIENTS = pytest.mark.parametrize("client", ["lean", "aiohttp"], ids=["http-lean-client", "https-aiohttp-client"])


@CLIENTS
async def test_an_error_status_keeps_its_json_rpc_body_as_the_upstreams_error(client: str, tmp_path: Path) -> None:
    """An HTTP 500 whose body is the JSON-RPC error answering the request reaches the caller as that error (its
    code and message), on either HTTP client; a 500 without one is the gateway's refusal."""
    async with erring_pool(client, tmp_path) as (pool, _):
        session = pool.session(None)
        async with session.call("tools/call", {"name": "json-error", "arguments": {}}) as call:
            events = [event async for event in call.events()]
        assert events == [UpstreamErrorResponse({"code": -32050, "message": "the backend is down"})]
        with pytest.raises(UpstreamRefusedError, match="HTTP 500"):
            async with session.call("tools/call", {"name": "html-error", "arguments": {}}):
                pass


@CLIENTS
@pytest.mark.parametrize("value", ["a\r\nX-Injected: yes", "a\nb", "a\x00b"], ids=["CRLF", "LF", "NUL"])
async def test_a_header_value_that_could_split_the_request_is_refused_on_either_client(
    client: str, value: str, tmp_path: Path
) -> None:
    """RFC 9110 §5.5: the request is refused with -32602 (the value came with it), and nothing of it reaches
    the upstream."""
    async with erring_pool(client, tmp_path) as (pool, app):
        session = pool.session(None)
        await session.ensure_initialized()
        with pytest.raises(UpstreamRequestInvalidError, match="traceparent") as refused:
            async with session.call("tools/call", {"name": "x"}, {"traceparent": value}):
                pass
        assert refused.value.code == -32602
        assert refused.value.status == 400
        assert "tools/call" not in app[SEEN]
