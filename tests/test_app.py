"""app.py: admission (Host/Origin, body size), the error edge, and what malformed input gets.

Nothing a client sends may make the proxy answer 5xx; every modern rejection is a 2026-07-28 JSON-RPC error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
import structlog.testing
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.edge._admission import host_allowed, origin_allowed
from proxy.edge._drain import DRAIN
from tests.support.processes import Upstream
from tests.support.schemas import SCHEMA_DIR, ModernSchema
from tests.support.wire import DECLARING, modern_body, modern_headers, modern_meta, read_messages

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


SERVICE_PATTERNS = ["mcp-server", "mcp-server.*.svc", "mcp-server.*.svc.cluster.local", "*.example.com"]


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("mcp-server", True),
        ("mcp-server.default.svc", True),
        ("mcp-server.team-a.svc:80", True),
        ("MCP-Server.Team-A.svc.cluster.local", True),
        ("api.example.com:443", True),
        ("mcp-server.default", False),  # two labels: not a pattern above
        ("mcp-server..svc", False),  # `*` is one whole, non-empty label
        ("mcp-server.a.b.svc", False),  # ... and only one
        ("other.default.svc", False),
        ("example.com", False),
        ("a.b.example.com", False),
        ("mcp-server.default.svc.evil.example", False),
    ],
)
def test_a_star_label_in_allowed_hosts_matches_exactly_one_label(host: str, allowed: bool) -> None:
    """A Service reached from any namespace: `mcp-server.*.svc.cluster.local`."""
    assert host_allowed(host, SERVICE_PATTERNS) is allowed


def test_origins_are_matched_against_the_same_patterns() -> None:
    assert origin_allowed("http://mcp-server.team-a.svc", SERVICE_PATTERNS, [])
    assert not origin_allowed("http://mcp-server.team-a.evil.com", SERVICE_PATTERNS, [])


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
    """DNS-rebinding protection: 403 with a JSON-RPC body, before anything reaches the upstream."""
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
    """A 2026-07-28 client has no GET stream and no session."""
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
    """On the modern path, methods removed in 2026-07-28 (initialize, ping, …) or with the Tasks extension
    (tasks/list, tasks/result) are unknown methods: HTTP 404 + -32601."""
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
    """The legacy `task` opt-in is ignored by the Tasks extension: not forwarded, and it changes nothing."""
    body = modern_body("tools/call", {"name": "greet", "arguments": {"name": "t"}, "task": {"ttl": 1000}})
    status, message = await post(proxy, body, modern_headers("tools/call", "greet"))
    assert status == 200
    assert message["result"]["content"][0]["text"] == "Hello, t!"
    assert "taskId" not in message["result"]


# --- bodies that decode in Python but are not sound JSON ---------------------------------------------------

LONE = "\ud800"  # a lone surrogate: valid as a JSON escape, not a Unicode scalar value, not encodable as UTF-8


def _with_lone_surrogate(where: str) -> tuple[dict[str, str], bytes]:
    """Headers and body of a modern request with `"\\ud800"` (as a JSON escape) at one place of the body."""
    method, params, request_id = "tools/call", {"name": "echo", "arguments": {"text": "x"}}, 5
    name: str | None = "echo"
    if where == "id":
        request_id = LONE  # type: ignore[assignment]
    elif where == "params":
        params[LONE] = "x"
    elif where == "arguments":
        params["arguments"] = {"text": LONE}
    elif where == "taskId":
        method, params, name = "tasks/get", {"taskId": "task" + LONE}, None  # Mcp-Name may be left out here
    elif where == "cursor":
        method, params, name = "tools/list", {"cursor": LONE}, None
    body = json.dumps(
        modern_body(method, params, request_id=request_id, capabilities=DECLARING)
    )  # ensure_ascii: `\ud800` stays an escape
    assert "\\ud800" in body
    return modern_headers(method, name), body.encode()


@pytest.mark.parametrize("where", ["id", "params", "arguments", "taskId", "cursor"])
async def test_a_lone_surrogate_anywhere_is_a_parse_error_not_a_5xx(
    proxy: Client, modern_schema: ModernSchema, where: str
) -> None:
    headers, raw = _with_lone_surrogate(where)
    status, message = await post(proxy, None, headers, raw=raw)
    assert status == 400, message
    assert message["error"]["code"] == -32700
    assert "id" not in message  # the body as a whole is refused: its id is not trusted either
    modern_schema.check(message, "tools/call")


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"a":' + b"[" * 500 + b"]" * 500 + b"}}",
    ],
    ids=["unclosed", "closed", "inside-params"],
)
async def test_deeply_nested_bodies_are_a_parse_error_not_a_5xx(
    proxy: Client, modern_schema: ModernSchema, raw: bytes
) -> None:
    status, message = await post(proxy, None, modern_headers("tools/list"), raw=raw)
    assert (status, message["error"]["code"]) == (400, -32700), message
    modern_schema.check(message, "tools/list")


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"])
async def test_numbers_json_cannot_carry_are_a_parse_error(proxy: Client, number: bytes) -> None:
    """Python reads `NaN`/`Infinity` (not JSON) and turns 1e999 into infinity, which it would write back as the
    non-JSON `Infinity`: refused where they come in."""
    raw = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"n":' + number + b"}}}"
    status, message = await post(proxy, None, modern_headers("tools/call", "echo"), raw=raw)
    assert (status, message["error"]["code"]) == (400, -32700), message


async def raw_exchange(client: Client, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are (a client library would re-encode the header values) and read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        writer.write(request)  # with `Connection: close`: the answer ends where the connection does
        head, _, body = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body
    finally:
        writer.close()


@pytest.mark.parametrize("era", ["modern", "legacy"])
@pytest.mark.parametrize("value", [b"Bearer \xff", b"caf\xe9", b"\xed\xa0\x80"])
async def test_a_header_value_that_is_not_utf8_is_refused_with_400(proxy: Client, era: str, value: bytes) -> None:
    """HTTP lets a field value carry any byte from 0x80 up, but the proxy could not pass it on unchanged (it would
    reach the upstream altered or dropped): refused, whichever era."""
    if era == "modern":
        headers, body = modern_headers("tools/list"), json.dumps(modern_body("tools/list")).encode()
    else:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        initialize = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": initialize}).encode()
    head = "".join(f"{name}: {text}\r\n" for name, text in headers.items()).encode()
    request = (
        b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        + head
        + b"Authorization: "
        + value
        + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    status, answer = await raw_exchange(proxy, request)
    message = json.loads(answer)
    assert (status, message["error"]["code"]) == (400, -32600), message
    assert "Authorization" in message["error"]["message"]
    SCHEMA.validate(message, "JSONRPCErrorResponse")


# --- slow bodies ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("era", "client_stops"), [("modern", True), ("legacy", True), ("modern", False)], ids=["modern", "legacy", "silent"]
)
async def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closes(
    make_proxy: Callable[..., Any], upstream: Upstream, era: str, client_stops: bool
) -> None:
    """Content-Length says 4 MB, 10 bytes come, then nothing: answered 408 once the body read timeout is up, with
    a JSON-RPC error and `Connection: close`, and the connection ends: at once when the client stops sending, and
    otherwise after aiohttp's lingering close (10 s of draining what the client still sends, so that the answer
    is not lost to a reset)."""
    client: Client = await make_proxy(upstream.url, security={"body_read_timeout_seconds": 0.5})
    headers = modern_headers("tools/list") if era == "modern" else {"Content-Type": "application/json"}
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        writer.write(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}Content-Length: 4000000\r\n\r\n".encode())
        writer.write(b'{"jsonrpc"')
        started = asyncio.get_running_loop().time()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        waited = asyncio.get_running_loop().time() - started
        status_line, *lines = answer.decode().split("\r\n")
        fields = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines if line)}
        assert status_line.split(" ")[1] == "408", answer
        assert fields["connection"] == "close"
        message = json.loads(await reader.readexactly(int(fields["content-length"])))
        SCHEMA.validate(message, "JSONRPCErrorResponse")
        assert message["error"]["code"] == -32600
        assert 0.5 <= waited < 10, waited  # the configured timeout, not the 120 s and more of before
        if client_stops:
            writer.write_eof()  # as a client told `Connection: close` does
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the proxy
    finally:
        writer.close()


async def test_every_error_answer_echoes_the_request_id(proxy: Client, modern_schema: ModernSchema) -> None:
    """The id is bound once, when the message is read: an error raised by the envelope checks, by the method
    table, or deep in a handler answers with the request's own id and the status of its kind."""
    cases: list[tuple[str, dict[str, Any], dict[str, str], int, int]] = [
        ("tools/list", {}, modern_headers("tools/call"), 400, -32020),  # Mcp-Method disagrees with the body
        ("nope/nothing", {}, modern_headers("nope/nothing"), 404, -32601),
        ("tasks/get", {"taskId": "task_unknown"}, modern_headers("tasks/get"), 400, -32021),  # not declared
        (
            "tools/call",
            {"name": "raise_error", "arguments": {"message": "x", "code": -32000}},
            modern_headers("tools/call", "raise_error"),
            200,  # an upstream error is the request's answer, not a failure of the proxy
            -32000,
        ),
    ]
    for number, (method, params, headers, status, code) in enumerate(cases):
        request_id = f"id-{number}"
        response = await proxy.post("/mcp", json=modern_body(method, params, request_id=request_id), headers=headers)
        [message] = await read_messages(response)
        modern_schema.validate(message, "JSONRPCErrorResponse")
        assert (response.status, message["error"]["code"], message["id"]) == (status, code, request_id), message
    # From the task runner: an unknown task of a declaring client.
    body = modern_body("tasks/get", {"taskId": "task_unknown"}, request_id="id-runner", capabilities=DECLARING)
    response = await proxy.post("/mcp", json=body, headers=modern_headers("tasks/get", "task_unknown"))
    [message] = await read_messages(response)
    assert (response.status, message["error"]["code"], message["id"]) == (400, -32602, "id-runner")


async def test_an_error_after_notifications_went_out_is_the_streams_last_event(
    proxy: Client, modern_schema: ModernSchema
) -> None:
    """The upstream reported progress (the answer became an SSE stream), then asked what the client did not
    declare: -32021 arrives as the stream's last event, with the request's id."""
    body = modern_body("tools/call", {"name": "test_streaming_elicitation", "arguments": {}}, request_id="s-1")
    body["params"]["_meta"]["progressToken"] = "p-1"
    response = await proxy.post("/mcp", json=body, headers=modern_headers("tools/call", "test_streaming_elicitation"))
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    messages = await read_messages(response)
    assert [message.get("method") for message in messages[:-1]] == ["notifications/progress"]
    last = messages[-1]
    modern_schema.validate(last, "JSONRPCErrorResponse")
    assert (last["id"], last["error"]["code"]) == ("s-1", -32021)
    assert last["error"]["data"] == {"requiredCapabilities": {"elicitation": {}}}


# --- legacy POSTs: classified by their bytes, read as JSON only when something reads them -------------------

LEGACY_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def legacy_message(method: str, request_id: int, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


INITIALIZE = legacy_message(
    "initialize", 7, {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
)


@pytest.fixture(params=["read", "unread"])
async def legacy_proxy(request: pytest.FixtureRequest, make_proxy: Callable[..., Any], upstream: Upstream) -> Client:
    """A proxy whose legacy POSTs are read as JSON (the request metrics and log lines name their method, as by
    default), or one where nothing reads them (metrics off, logging at warning): they are relayed unread."""
    if request.param == "unread":
        request.getfixturevalue("quiet_logs")
        client: Client = await make_proxy(upstream.url, observability={"metrics": False})
        return client
    client = await make_proxy(upstream.url)
    return client


async def test_a_legacy_session_is_relayed_whether_or_not_its_messages_are_read(legacy_proxy: Client) -> None:
    response = await legacy_proxy.post("/mcp", json=INITIALIZE, headers=LEGACY_HEADERS)
    assert response.status == 200
    session = {**LEGACY_HEADERS, "Mcp-Session-Id": response.headers["Mcp-Session-Id"]}
    assert (await read_messages(response))[-1]["result"]["protocolVersion"] == "2025-11-25"
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await legacy_proxy.post("/mcp", json=initialized, headers=session)).status == 202
    text = 'a\nline with "quotes" and a \\ backslash'  # escapes in the body: decoded to classify it
    for number, arguments in enumerate(({"text": "plain"}, {"text": text})):
        call = legacy_message("tools/call", 8 + number, {"name": "echo", "arguments": arguments})
        response = await legacy_proxy.post("/mcp", json=call, headers=session)
        assert response.status == 200
        [answer] = await read_messages(response)
        assert (answer["id"], answer["result"]["content"][0]["text"]) == (8 + number, arguments["text"])
    response = await legacy_proxy.post("/mcp", data=b"{not json", headers=session)
    assert response.status == 400  # the upstream's own answer to what it cannot parse
    assert (await response.json())["error"]["code"] == -32700


async def test_a_version_key_spelled_with_escapes_still_makes_a_request_modern(legacy_proxy: Client) -> None:
    """The key found only after decoding (here `\\/` for its slash): the request is a modern one (which must
    carry MCP-Protocol-Version), not a legacy one relayed upstream."""
    meta = json.dumps({"_meta": modern_meta()}).replace("/", "\\/")
    raw = f'{{"jsonrpc":"2.0","id":3,"method":"tools/list","params":{meta}}}'.encode()
    status, message = await post(legacy_proxy, None, LEGACY_HEADERS, raw=raw)
    assert (status, message["id"], message["error"]["code"]) == (400, 3, -32020)
    assert "MCP-Protocol-Version header is required" in message["error"]["message"]


async def test_a_draining_proxy_refuses_a_new_legacy_session_with_the_requests_id(legacy_proxy: Client) -> None:
    drain = legacy_proxy.app[DRAIN]
    drain.draining = True
    try:
        response = await legacy_proxy.post("/mcp", json=INITIALIZE, headers=LEGACY_HEADERS)
    finally:
        drain.draining = False
    assert (response.status, response.headers["Retry-After"]) == (503, "1")
    message = await response.json()
    assert (message["id"], message["error"]["data"]) == (7, {"reason": "draining"})


@pytest.mark.parametrize("level", ["info", "warning"])
async def test_a_request_line_per_request_at_info_and_none_below(
    request: pytest.FixtureRequest, make_proxy: Callable[..., Any], upstream: Upstream, level: str
) -> None:
    if level == "warning":
        request.getfixturevalue("quiet_logs")
    client: Client = await make_proxy(upstream.url)
    with structlog.testing.capture_logs() as events:
        response = await client.post("/mcp", json=INITIALIZE, headers=LEGACY_HEADERS)
        await response.read()
        response = await client.post("/mcp", json=modern_body("tools/list"), headers=modern_headers("tools/list"))
        await response.read()
    lines = [(event["era"], event["mcp_method"], event["status"]) for event in events if event["event"] == "request"]
    assert lines == ([("legacy", "initialize", 200), ("modern", "tools/list", 200)] if level == "info" else [])


SECRET = "hunter2-do-not-log"


async def test_client_data_stays_out_of_logs_and_error_answers(proxy: Client) -> None:
    """Argument values never reach a log line, and no error answer echoes what the client sent, whatever way
    the request fails (or succeeds)."""
    arguments = {"text": SECRET, "password": SECRET}
    requests: list[tuple[bytes, dict[str, str]]] = [
        (
            json.dumps(modern_body("tools/call", {"name": "echo", "arguments": arguments})).encode(),
            modern_headers("tools/call", "echo"),
        ),
        (
            json.dumps(modern_body("tools/call", {"name": "echo", "arguments": arguments})).encode(),
            modern_headers("tools/call", "other"),
        ),
        (
            json.dumps(modern_body("tools/call", {"name": "echo", "arguments": [SECRET]})).encode(),
            modern_headers("tools/call", "echo"),
        ),
        (
            json.dumps(modern_body("tools/call", {"name": SECRET, "arguments": {}})).encode()[:-1],
            modern_headers("tools/call"),
        ),
        (
            json.dumps(modern_body("tools/call", {"name": "echo", "arguments": {"p": SECRET + "\ud800"}})).encode(),
            modern_headers("tools/call", "echo"),
        ),
        (("[" * 100_000 + json.dumps(SECRET)).encode(), modern_headers("tools/call")),
    ]
    with structlog.testing.capture_logs() as events:
        answers = []
        for body, headers in requests:
            response = await proxy.post("/mcp", data=body, headers={**headers, "Content-Type": "application/json"})
            answers.append((response.status, await response.text()))
    assert answers[0][0] == 200  # the one good call echoes its own argument back, as it should
    for status, text in answers[1:]:
        assert status < 500
        assert SECRET not in text
    assert events
    assert not [event for event in events if SECRET in repr(event)]


async def test_error_answers_name_no_internal_address(make_proxy: Callable[..., Any]) -> None:
    client: Client = await make_proxy("http://127.0.0.1:9/mcp")
    with structlog.testing.capture_logs() as events:
        response = await client.post("/mcp", json=modern_body("tools/list", {}), headers=modern_headers("tools/list"))
        text = await response.text()
    assert response.status == 502
    assert "Upstream MCP server unavailable" in text
    assert "127.0.0.1" not in text
    assert ":9" not in text
    [rejected] = [event for event in events if event["event"] == "request_rejected"]
    assert "127.0.0.1" in rejected["detail"]  # the operator's log says what happened


def test_once_started_the_collector_leaves_start_up_objects_alone_and_collects_young_ones_less_often() -> None:
    """What the start made is frozen out of the cyclic collector's way, and the youngest generation is collected
    every YOUNG_COLLECTION allocations; the older generations keep their thresholds."""
    import gc

    from proxy.edge.serve import YOUNG_COLLECTION, settle_collector

    thresholds = gc.get_threshold()
    try:
        settle_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_COLLECTION, *thresholds[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
