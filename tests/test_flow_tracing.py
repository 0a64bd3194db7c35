"""Tracing end to end: the SDK's in-memory exporter behind the real proxy, the mcp 1.x fixture upstream over
Streamable HTTP and over stdio. One trace runs from the client's context through the proxy's SERVER span, a
call's background work and the CLIENT span to what the upstream received; tasks/* spans carry the task id and
link to the span that created the task, also on another replica and after a restart, where the task's work
goes on in its creating trace; requests refused before any JSON-RPC message was read have their SERVER span
too; nothing the client sent as content ends up in a span.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.observe import span_attributes, tracing
from tests import pg
from tests.support.clients import Client, ClientFactory, Tasks, upstream_calls_open
from tests.support.processes import Upstream, key_file, stdio_upstream
from tests.support.waiting import until
from tests.support.wire import (
    DECLARING,
    HEADERS,
    TASKING,
    modern_body,
    modern_headers,
    policies,
    read_messages,
    result_text,
)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
META_TRACE = "0af7651916cd43dd8448eb211c80319c"
META_SPAN = "b7ad6b7169203331"
META_TRACEPARENT = f"00-{META_TRACE}-{META_SPAN}-01"


@pytest.fixture(params=["http", "stdio"])
def upstream_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def traced_client(tasks_client: ClientFactory, upstream_kind: str) -> Callable[..., Any]:
    async def start(**sections: dict[str, Any]) -> Tasks:
        if upstream_kind == "stdio":
            sections["upstream"] = stdio_upstream()
        return await tasks_client(**sections)

    return start


async def eventually(
    exporter: InMemorySpanExporter, name: str, count: int = 1, kind: SpanKind | None = None
) -> list[ReadableSpan]:
    """The finished spans called `name` (of `kind`, if given), once there are `count` of them."""

    def found() -> list[ReadableSpan]:
        spans = [span for span in exporter.get_finished_spans() if span.name == name and kind in (None, span.kind)]
        return spans if len(spans) >= count else []

    def missing() -> str:
        return f"{count} span(s) {name!r}; finished: {[span.name for span in exporter.get_finished_spans()]}"

    spans: list[ReadableSpan] = await until(found, missing, 10)
    return spans


def hex_span(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


def hex_trace(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.trace_id, "032x")


def parent_of(span: ReadableSpan) -> str | None:
    return None if span.parent is None else format(span.parent.span_id, "016x")


def links_of(span: ReadableSpan) -> list[tuple[str, str]]:
    """(trace id, span id) of each span `span` links to."""
    return [(format(link.context.trace_id, "032x"), format(link.context.span_id, "016x")) for link in span.links]


def server(spans: list[ReadableSpan]) -> ReadableSpan:
    [found] = [span for span in spans if span.kind is SpanKind.SERVER]
    return found


async def test_one_trace_from_the_client_through_the_proxy_to_the_upstream(
    spans: InMemorySpanExporter, traced_client: Callable[..., Any], upstream_kind: str
) -> None:
    client = await traced_client()
    status, message = await client.call("trace_context", headers={"traceparent": CLIENT_TRACEPARENT})
    assert status == 200, message
    [server] = await eventually(spans, "tools/call trace_context", kind=SpanKind.SERVER)
    [upstream_call] = await eventually(spans, "tools/call trace_context", kind=SpanKind.CLIENT)
    # Parentage: client's span -> SERVER -> CLIENT (the call's work, in the background), one trace.
    assert hex_trace(server) == hex_trace(upstream_call) == CLIENT_TRACE
    assert parent_of(server) == CLIENT_SPAN
    assert parent_of(upstream_call) == hex_span(server)
    # The upstream received the CLIENT span's context: as headers over HTTP, in _meta on stdio.
    seen = json.loads(result_text(message))
    sent = f"00-{CLIENT_TRACE}-{hex_span(upstream_call)}-01"
    if upstream_kind == "http":
        assert seen["headers"]["traceparent"] == sent
        assert seen["meta"]["traceparent"] is None
    else:
        assert seen["meta"]["traceparent"] == sent
    # The attributes of the MCP semantic conventions.
    assert server.attributes is not None
    assert server.attributes["mcp.method.name"] == "tools/call"
    assert server.attributes["gen_ai.tool.name"] == "trace_context"
    assert server.attributes["gen_ai.operation.name"] == "execute_tool"
    assert server.attributes["jsonrpc.request.id"] == "1"
    assert server.attributes["mcp.protocol.version"] == "2026-07-28"
    assert "error.type" not in server.attributes
    assert upstream_call.attributes is not None
    assert upstream_call.attributes["mcp.method.name"] == "tools/call"
    assert upstream_call.attributes["gen_ai.tool.name"] == "trace_context"
    assert upstream_call.attributes["network.transport"] == ("tcp" if upstream_kind == "http" else "pipe")
    assert upstream_call.attributes["mcp.protocol.version"] in {"2025-11-25", "2025-06-18"}
    assert int(str(upstream_call.attributes["jsonrpc.request.id"])) >= 1
    if upstream_kind == "http":
        assert upstream_call.attributes["mcp.session.id"]


async def test_meta_context_is_the_parent_and_the_http_one_a_link(
    spans: InMemorySpanExporter, traced_client: Callable[..., Any], upstream_kind: str
) -> None:
    client = await traced_client()
    status, message = await client.call(
        "trace_context", headers={"traceparent": CLIENT_TRACEPARENT}, traceparent=META_TRACEPARENT
    )
    assert status == 200, message
    [server] = [s for s in await eventually(spans, "tools/call trace_context", 2) if s.kind is SpanKind.SERVER]
    assert hex_trace(server) == META_TRACE
    assert parent_of(server) == META_SPAN
    [link] = server.links
    assert format(link.context.trace_id, "032x") == CLIENT_TRACE
    assert format(link.context.span_id, "016x") == CLIENT_SPAN
    [upstream_call] = [s for s in await eventually(spans, "tools/call trace_context", 2) if s.kind is SpanKind.CLIENT]
    # The upstream never sees the client's context beside the proxy's: where the client put it, it is replaced.
    seen = json.loads(result_text(message))
    sent = f"00-{META_TRACE}-{hex_span(upstream_call)}-01"
    assert seen["meta"]["traceparent"] == sent
    if upstream_kind == "http":
        assert seen["headers"]["traceparent"] == sent


async def test_a_task_keeps_its_background_work_in_the_creating_trace(
    spans: InMemorySpanExporter, traced_client: Callable[..., Any]
) -> None:
    client = await traced_client(tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 0.3}, headers={"traceparent": CLIENT_TRACEPARENT})
    [created] = [s for s in await eventually(spans, "tools/call sleep") if s.kind is SpanKind.SERVER]
    assert created.attributes is not None
    assert created.attributes[span_attributes.TASK_ID] == task_id
    assert (await client.settled(task_id))["status"] == "completed"
    # The task's background work: the upstream call's CLIENT span, in the creating trace, outliving the request.
    [work] = await eventually(spans, "tools/call sleep", kind=SpanKind.CLIENT)
    assert parent_of(work) == hex_span(created)
    assert hex_trace(work) == CLIENT_TRACE
    assert work.attributes is not None
    assert work.attributes[span_attributes.TASK_ID] == task_id
    assert work.end_time is not None
    assert created.end_time is not None
    assert work.end_time > created.end_time  # it outlived the request that created the task
    # tasks/get (in traces of their own here) carry the task id and link to the span that created the task.
    gets = await eventually(spans, "tasks/get")
    for get in gets:
        assert get.attributes is not None
        assert get.attributes[span_attributes.TASK_ID] == task_id
        assert [(link.context.span_id, link.context.trace_id) for link in get.links] == [
            (created.context.span_id, created.context.trace_id) if created.context else (0, 0)
        ]
    status, message = await client.post("tasks/cancel", {"taskId": task_id})
    assert status == 200 or "error" in message
    [cancel] = await eventually(spans, "tasks/cancel")
    assert cancel.attributes is not None
    assert cancel.attributes[span_attributes.TASK_ID] == task_id
    assert len(cancel.links) == 1


async def test_errors_name_their_type(spans: InMemorySpanExporter, traced_client: Callable[..., Any]) -> None:
    client = await traced_client()
    _, message = await client.call("raise_error", {"message": "no", "code": -32602})
    assert message["error"]["code"] == -32602
    _, message = await client.call("tool_error", {"message": "no"})
    assert message["result"]["isError"] is True
    [raised] = [s for s in await eventually(spans, "tools/call raise_error", 2) if s.kind is SpanKind.SERVER]
    [tool_error] = [s for s in await eventually(spans, "tools/call tool_error", 2) if s.kind is SpanKind.SERVER]
    assert raised.attributes is not None
    assert raised.attributes["error.type"] == "-32602"
    assert raised.attributes["rpc.response.status_code"] == "-32602"
    assert raised.status.status_code is StatusCode.ERROR
    assert tool_error.attributes is not None
    assert tool_error.attributes["error.type"] == "tool_error"


def _everything_recorded(exporter: InMemorySpanExporter) -> str:
    parts: list[str] = []
    for span in exporter.get_finished_spans():
        parts.append(span.name)
        parts.append(str(span.status.description))
        parts.extend(f"{key}={value!r}" for key, value in (span.attributes or {}).items())
        for event in span.events:
            parts.append(event.name)
            parts.extend(f"{key}={value!r}" for key, value in (event.attributes or {}).items())
        for link in span.links:
            parts.extend(f"{key}={value!r}" for key, value in (link.attributes or {}).items())
    return "\n".join(parts)


async def test_no_argument_result_answer_or_credential_is_recorded(
    spans: InMemorySpanExporter, traced_client: Callable[..., Any], upstream_kind: str
) -> None:
    secret = "s3cr3t-value-9f1c"
    client = await traced_client()
    credentials = {"Authorization": f"Bearer {secret}-token", "traceparent": CLIENT_TRACEPARENT}
    _, message = await client.call("echo", {"text": f"{secret}-argument"}, headers=credentials)
    assert secret in result_text(message)
    _, message = await client.call("raise_error", {"message": f"{secret}-error", "code": -32602}, headers=credentials)
    assert secret in message["error"]["message"]
    _, message = await client.call("tool_error", {"message": f"{secret}-tool-error"}, headers=credentials)
    # An elicitation round: the question goes to the client, whose answer carries the secret back.
    _, message = await client.call("ask_name", capabilities={"elicitation": {}}, headers=credentials)
    assert message["result"]["resultType"] == "input_required", message
    [key] = message["result"]["inputRequests"]
    _, message = await client.post(
        "tools/call",
        {
            "name": "ask_name",
            "arguments": {},
            "requestState": message["result"]["requestState"],
            "inputResponses": {key: {"action": "accept", "content": {"name": f"{secret}-answer"}}},
        },
        capabilities={"elicitation": {}},
        headers=credentials,
    )
    assert secret in result_text(message)
    await eventually(spans, "tools/call ask_name", 3)  # both requests' SERVER spans and the upstream's CLIENT span
    recorded = _everything_recorded(spans)
    assert "tools/call echo" in recorded
    assert "mrtr_input_required" in recorded
    assert "input_requested" in recorded
    assert "mrtr_resumed" in recorded
    assert "input_answered" in recorded
    assert secret not in recorded


async def test_legacy_clients_get_a_server_span_with_their_session(spans: InMemorySpanExporter, proxy: Client) -> None:
    client = proxy
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
    }
    async with client.post("/mcp", json=init, headers=headers) as response:
        session_id = response.headers["Mcp-Session-Id"]
        await response.read()
    session_headers = {**headers, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
    async with client.post(
        "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session_headers
    ):
        pass
    call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "trace_context", "arguments": {}}}
    async with client.post("/mcp", json=call, headers={**session_headers, "traceparent": CLIENT_TRACEPARENT}) as r:
        [message] = await read_messages(r)
    named = await eventually(spans, "tools/call trace_context", 2)
    [server] = [s for s in named if s.kind is SpanKind.SERVER]
    [relayed] = [s for s in named if s.kind is SpanKind.CLIENT]
    assert server.attributes is not None
    assert server.attributes["mcp.era"] == "legacy"
    assert server.attributes["mcp.session.id"] == session_id
    assert server.attributes["jsonrpc.request.id"] == "7"
    assert server.attributes["mcp.protocol.version"] == "2025-11-25"
    assert parent_of(server) == CLIENT_SPAN
    assert parent_of(relayed) == hex_span(server)
    assert relayed.attributes is not None
    assert relayed.attributes["mcp.method.name"] == "tools/call"
    assert relayed.attributes["gen_ai.tool.name"] == "trace_context"
    seen = json.loads("".join(block["text"] for block in message["result"]["content"]))
    assert seen["headers"]["traceparent"] == f"00-{CLIENT_TRACE}-{hex_span(relayed)}-01"
    [initialize] = [s for s in await eventually(spans, "initialize", 2) if s.kind is SpanKind.SERVER]
    assert initialize.attributes is not None
    assert initialize.attributes["mcp.protocol.version"] == "2025-11-25"


async def test_tracing_off_leaves_the_clients_context_as_it_was(tasks_client: ClientFactory) -> None:
    assert not tracing.enabled()
    client = await tasks_client()
    _, message = await client.call("trace_context", headers={"traceparent": CLIENT_TRACEPARENT})
    seen = json.loads(result_text(message))
    assert seen["headers"]["traceparent"] == CLIENT_TRACEPARENT


async def two_replicas(tasks_client: ClientFactory, pg_dsn: str, tmp_path: Path, tool: str) -> tuple[Tasks, Tasks]:
    """Two proxies on one PostgreSQL database, sharing the request-state key, `tool` a task-only tool: the first
    to own a task, the second to act on it."""
    sections: dict[str, Any] = {
        "store": {"url": pg.as_url(pg_dsn), "lease_seconds": 3},
        "inputs": {"secret_file": key_file(tmp_path)},
        "tasks": policies(**{tool: {"mode": "required"}}),
    }
    return await tasks_client(**sections), await tasks_client(**sections)


async def test_a_cancel_from_another_replica_is_linked_work_on_the_owner(
    spans: InMemorySpanExporter, tasks_client: ClientFactory, pg_dsn: str, tmp_path: Path
) -> None:
    """Two replicas on one PostgreSQL database: a tasks/cancel on B reaches the owner A through the store; A's
    work on it is a span linked to the span that created the task, and B's tasks/cancel span names the task."""
    owner, other = await two_replicas(tasks_client, pg_dsn, tmp_path, "sleep")
    task_id = await owner.create("sleep", {"seconds": 30}, headers={"traceparent": CLIENT_TRACEPARENT})
    await owner.until(task_id, lambda task: "statusMessage" in task)  # the owner's upstream runs it
    status, message = await other.post("tasks/cancel", {"taskId": task_id})
    assert status == 200, message
    [created] = [s for s in await eventually(spans, "tools/call sleep") if s.kind is SpanKind.SERVER]
    [relayed] = await eventually(spans, "task settled elsewhere")
    assert relayed.attributes is not None
    assert relayed.attributes[span_attributes.TASK_ID] == task_id
    assert created.context is not None
    assert [(link.context.trace_id, link.context.span_id) for link in relayed.links] == [
        (created.context.trace_id, created.context.span_id)
    ]
    [cancel] = await eventually(spans, "tasks/cancel")
    assert cancel.attributes is not None
    assert cancel.attributes[span_attributes.TASK_ID] == task_id
    assert links_of(cancel) == [(hex_trace(created), hex_span(created))]  # from the record: B never saw it created
    [work] = await eventually(spans, "tools/call sleep", kind=SpanKind.CLIENT)
    assert hex_trace(work) == CLIENT_TRACE
    assert work.attributes is not None
    assert work.attributes[span_attributes.TASK_ID] == task_id


async def test_a_push_is_an_event_on_the_listen_streams_span(
    spans: InMemorySpanExporter, tasks_client: ClientFactory
) -> None:
    client = await tasks_client(tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 0.3})
    body = modern_body(
        "subscriptions/listen", {"notifications": {"taskIds": [task_id]}}, request_id="L1", capabilities=DECLARING
    )
    response = await client.client.post("/mcp", json=body, headers=modern_headers("subscriptions/listen"))
    assert response.status == 200
    statuses: list[str] = []
    async for chunk in response.content.iter_any():
        statuses += re.findall(r'"status":\s*"(\w+)"', chunk.decode())
        if "completed" in statuses:
            break
    response.close()
    [listen] = await eventually(spans, "subscriptions/listen")
    pushed = [event for event in listen.events if event.name == "task_pushed"]
    assert pushed
    assert all(
        event.attributes is not None and event.attributes[span_attributes.TASK_ID] == task_id for event in pushed
    )
    assert pushed[-1].attributes is not None
    assert pushed[-1].attributes["mcp.task.status"] == "completed"
    assert listen.status.status_code is not StatusCode.ERROR  # the client closing its stream is no failure


async def test_an_answer_from_another_replica_is_linked_work_on_the_owner(
    spans: InMemorySpanExporter, tasks_client: ClientFactory, pg_dsn: str, tmp_path: Path
) -> None:
    """Two replicas on one PostgreSQL database: the task's question is answered on B (tasks/update), the answer
    reaches the owner A through the store; A's work on it is a span of its own trace linked to the span that
    created the task, where the answer's delivery upstream shows. B's tasks/get and tasks/update spans link to
    the creating span too, read from the task's record."""
    owner, other = await two_replicas(tasks_client, pg_dsn, tmp_path, "ask_name")
    task_id = await owner.create("ask_name", capabilities=TASKING, headers={"traceparent": CLIENT_TRACEPARENT})
    task = await other.until(task_id, lambda task: task["status"] == "input_required")
    [key] = task["inputRequests"]
    answer = {key: {"action": "accept", "content": {"name": "Ada"}}}
    status, ack = await other.post("tasks/update", {"taskId": task_id, "inputResponses": answer})
    assert status == 200, ack
    assert result_text(await owner.settled(task_id)) == "Hello, Ada"
    created = server(await eventually(spans, "tools/call ask_name"))
    assert hex_trace(created) == CLIENT_TRACE
    creation = (hex_trace(created), hex_span(created))
    [relayed] = await eventually(spans, "task answers relayed")
    assert relayed.kind is SpanKind.INTERNAL
    assert relayed.attributes is not None
    assert relayed.attributes[span_attributes.TASK_ID] == task_id
    assert links_of(relayed) == [creation]
    assert hex_trace(relayed) != CLIENT_TRACE  # linked work, in a trace of its own
    assert "input_answered" in [event.name for event in relayed.events]  # the answer went upstream there
    [update] = await eventually(spans, "tasks/update")
    assert update.attributes is not None
    assert update.attributes[span_attributes.TASK_ID] == task_id
    assert links_of(update) == [creation]
    for get in await eventually(spans, "tasks/get"):
        assert links_of(get) == [creation]


async def test_after_a_restart_a_task_links_to_its_creation_and_its_rerun_stays_in_the_creating_trace(
    spans: InMemorySpanExporter, tasks_client: ClientFactory, own_upstream: Upstream, tmp_path: Path
) -> None:
    """The creating span's context is stored with the task: the next process (nothing of the first in memory)
    links tasks/get to it, and re-runs the call below a `task re-run` span that is its child."""
    sections: dict[str, Any] = {
        "store": {"path": str(tmp_path / "restart.db")},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(counted={"mode": "required", "on_restart": "rerun"}),
    }
    first = await tasks_client(own_upstream.url, **sections)
    arguments = {"key": "traced-rerun", "seconds": 1.0}
    task_id = await first.create("counted", arguments, headers={"traceparent": CLIENT_TRACEPARENT})
    await upstream_calls_open(first.client, 1)
    await first.client.close()  # the process goes away with the call still running
    created = server(await eventually(spans, "tools/call counted"))
    assert hex_trace(created) == CLIENT_TRACE

    second = await tasks_client(own_upstream.url, **sections)
    done = await second.settled(task_id)
    assert done["status"] == "completed"
    assert result_text(done) == "2"  # the call was sent again
    [rerun] = await eventually(spans, "task re-run")
    assert rerun.kind is SpanKind.INTERNAL
    assert rerun.attributes is not None
    assert rerun.attributes[span_attributes.TASK_ID] == task_id
    assert hex_trace(rerun) == CLIENT_TRACE
    assert parent_of(rerun) == hex_span(created)
    works = await eventually(spans, "tools/call counted", 3)  # the SERVER span, the first run, the re-run
    [again] = [span for span in works if span.kind is SpanKind.CLIENT and parent_of(span) == hex_span(rerun)]
    assert hex_trace(again) == CLIENT_TRACE
    assert again.attributes is not None
    assert again.attributes[span_attributes.TASK_ID] == task_id
    gets = await eventually(spans, "tasks/get")
    assert gets
    for get in gets:
        assert links_of(get) == [(hex_trace(created), hex_span(created))]


async def test_a_task_the_upstream_runs_is_followed_again_in_its_creating_trace_after_a_restart(
    spans: InMemorySpanExporter, tasks_client: ClientFactory, legacy_task_upstream: Upstream, tmp_path: Path
) -> None:
    """The next process follows the upstream's task below a `task followed again` span, child of the span that
    created the task; its upstream requests are that span's children, in the creating trace."""
    sections: dict[str, Any] = {"store": {"path": str(tmp_path / "follow.db")}}
    first = await tasks_client(legacy_task_upstream.url, **sections)
    task_id = await first.create("legacy_task_required", {"seconds": 2}, headers={"traceparent": CLIENT_TRACEPARENT})
    await first.until(task_id, lambda task: task.get("statusMessage") == "step 1/4")
    await first.client.close()  # the upstream's task runs on, for the next process to follow
    # The span that created the task: the upstream request whose answer was the upstream's task.
    named = await eventually(spans, "tools/call legacy_task_required", 2)
    [created] = [span for span in named if "task_created" in [event.name for event in span.events]]
    assert parent_of(created) == hex_span(server(named))

    second = await tasks_client(legacy_task_upstream.url, **sections)
    done = await second.settled(task_id)
    assert done["status"] == "completed", done
    [followed] = await eventually(spans, "task followed again")
    assert followed.attributes is not None
    assert followed.attributes[span_attributes.TASK_ID] == task_id
    assert hex_trace(followed) == CLIENT_TRACE
    assert parent_of(followed) == hex_span(created)
    below = [span for span in spans.get_finished_spans() if parent_of(span) == hex_span(followed)]
    assert below
    assert all(span.kind is SpanKind.CLIENT and hex_trace(span) == CLIENT_TRACE for span in below)


async def test_upstream_requests_sent_after_the_creating_request_ended_are_client_spans_in_its_trace(
    spans: InMemorySpanExporter, tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    """A task the upstream runs itself waits for an answer; meanwhile the proxy polls the upstream's task with
    tasks/get at its poll interval, after the request that created the task ended: each poll is a CLIENT span
    of the task, in the creating trace."""
    client = await tasks_client(legacy_task_upstream.url)
    headers = {"traceparent": CLIENT_TRACEPARENT}
    task_id = await client.create("legacy_task_elicit", capabilities=TASKING, headers=headers)
    await client.until(task_id, lambda task: task["status"] == "input_required")
    polls = await eventually(spans, "tasks/get", kind=SpanKind.CLIENT)
    answer = {"elicitation-1": {"action": "accept", "content": {"name": "Bo"}}}
    status, ack = await client.post("tasks/update", {"taskId": task_id, "inputResponses": answer})
    assert status == 200, ack
    assert result_text(await client.settled(task_id)) == "Hello, Bo!"
    created = server(await eventually(spans, "tools/call legacy_task_elicit", 2))
    for poll in polls:
        assert hex_trace(poll) == CLIENT_TRACE
        assert poll.attributes is not None
        assert poll.attributes[span_attributes.TASK_ID] == task_id
        assert poll.start_time is not None
        assert created.end_time is not None
        assert poll.start_time > created.end_time


MODERN_GET = {"MCP-Protocol-Version": "2026-07-28", "traceparent": CLIENT_TRACEPARENT}
MODERN_POST = modern_headers("tools/call", "echo", traceparent=CLIENT_TRACEPARENT)
LEGACY_POST = {**HEADERS, "traceparent": CLIENT_TRACEPARENT}
TOO_LARGE = json.dumps(modern_body("tools/call", {"name": "echo", "arguments": {"text": "x" * 2000}})).encode()


@pytest.mark.parametrize(
    ("http_method", "headers", "body", "status", "error_type", "era"),
    [
        ("GET", MODERN_GET, None, 405, "-32600", "modern"),
        ("DELETE", MODERN_GET, None, 405, "-32600", "modern"),
        ("POST", modern_headers("tools/list", traceparent=CLIENT_TRACEPARENT), b"{not json", 400, "-32700", "modern"),
        (
            "POST",
            modern_headers("tools/call", "echo", traceparent=CLIENT_TRACEPARENT),
            TOO_LARGE,
            413,
            "-32600",
            "modern",
        ),
        ("POST", {**HEADERS, "traceparent": CLIENT_TRACEPARENT}, TOO_LARGE, 413, "-32600", "legacy"),
        ("POST", {**MODERN_POST, "Origin": "http://evil.example"}, b"{}", 403, "-32600", "modern"),
        ("POST", {**LEGACY_POST, "Host": "evil.example"}, b"{}", 403, "-32600", "legacy"),
    ],
    ids=[
        "modern-get-405",
        "modern-delete-405",
        "modern-not-json",
        "modern-too-large",
        "legacy-too-large",
        "modern-origin-forbidden",
        "legacy-host-forbidden",
    ],
)
async def test_a_request_refused_before_its_message_is_read_has_a_server_span_naming_the_error(
    spans: InMemorySpanExporter,
    make_proxy: Any,
    upstream: Upstream,
    http_method: str,
    headers: dict[str, str],
    body: bytes | None,
    status: int,
    error_type: str,
    era: str,
) -> None:
    client: Client = await make_proxy(upstream.url, security={"max_body_bytes": 1024})
    async with client.request(http_method, "/mcp", headers=headers, data=body) as response:
        assert response.status == status
        message = await response.json()
    assert str(message["error"]["code"]) == error_type
    [span] = await eventually(spans, http_method, kind=SpanKind.SERVER)
    assert parent_of(span) == CLIENT_SPAN
    assert hex_trace(span) == CLIENT_TRACE
    assert span.attributes is not None
    assert span.attributes["mcp.era"] == era
    assert span.attributes["http.request.method"] == http_method
    assert span.attributes["error.type"] == error_type
    assert span.attributes["rpc.response.status_code"] == error_type
    assert span.attributes["client.address"] == "127.0.0.1"
    assert "mcp.method.name" not in span.attributes
    assert span.status.status_code is StatusCode.ERROR


async def test_a_request_relayed_to_the_upstreams_origin_has_a_server_span_with_a_client_span_below_it(
    spans: InMemorySpanExporter, proxy: Client
) -> None:
    """A path the proxy does not serve (OAuth metadata, say) goes to the upstream's origin: one SERVER span named
    after the HTTP method, its CLIENT span below it."""
    headers = {"traceparent": CLIENT_TRACEPARENT}
    async with proxy.get("/.well-known/oauth-protected-resource/mcp", headers=headers) as response:
        status = response.status
        await response.read()
    named = await eventually(spans, "GET", 2)
    [server_span] = [span for span in named if span.kind is SpanKind.SERVER]
    [relayed] = [span for span in named if span.kind is SpanKind.CLIENT]
    assert parent_of(server_span) == CLIENT_SPAN
    assert parent_of(relayed) == hex_span(server_span)
    assert server_span.attributes is not None
    assert server_span.attributes["mcp.era"] == "relayed"
    assert server_span.attributes["http.request.method"] == "GET"
    assert relayed.attributes is not None
    assert relayed.attributes["http.request.method"] == "GET"
    assert (server_span.status.status_code is StatusCode.ERROR) == (status >= 500)
