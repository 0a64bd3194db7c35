"""End to end, on the wire: task handles for clients that do not declare the Tasks extension.

What each era's `tools/list` shows (and a declaring client's does not), that every other legacy message is still
relayed byte for byte, a handle call that ends within the hold, a question that ends the hold at once, a failed
task's result, `handle` before `undeclared_required`, the progress that keeps a held client warm, a handle that
outlives the legacy session that made it, anonymous callers, a result read after a restart, and a start refused
when the upstream lists a synthesised tool's name. The real clients' flows are `test_flow_handles_clients.py`.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.support.clients import ClientFactory
from tests.support.processes import ProxyProcess, Upstream
from tests.support.schemas import LEGACY_SCHEMA, SchemaValidator
from tests.support.sdk import connect
from tests.support.waiting import until
from tests.support.wire import DECLARING, HEADERS, INITIALIZE, modern_body, modern_headers, parse_sse, sse_messages
from tests.upstream.handle_fixtures import story

Client = TestClient[web.Request, web.Application]

LIST_CHANGED = "notifications/tools/list_changed"
SYNTHESISED = ["task_status", "task_result", "task_cancel", "task_respond"]
HOLD_MS = 1000


def handles(hold_ms: int = HOLD_MS, **tools: dict[str, Any]) -> dict[str, Any]:
    return {
        "tasks": {"tools": tools or {"long_report": {"without_tasks": "handle"}}},
        "handles": {"hold_ms": hold_ms},
    }


def new_key() -> str:
    return f"report-{uuid.uuid4().hex[:12]}"


class Legacy:
    """A raw 2025-11-25 session through the proxy (or directly with the upstream)."""

    def __init__(self, http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> None:
        self.http = http
        self.url = url
        self.headers = {**HEADERS, **(headers or {})}
        self.ids = 1

    async def open(self) -> Legacy:
        async with self.http.post(self.url, json=INITIALIZE, headers=self.headers) as response:
            assert response.status == 200, await response.text()
            self.headers = {
                **self.headers,
                "Mcp-Session-Id": response.headers["Mcp-Session-Id"],
                "MCP-Protocol-Version": "2025-11-25",
            }
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        async with self.http.post(self.url, json=initialized, headers=self.headers) as response:
            assert response.status == 202
        return self

    async def raw(self, method: str, params: dict[str, Any] | None = None) -> tuple[int, str, str]:
        self.ids += 1
        body = {"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params or {}}
        async with self.http.post(self.url, json=body, headers=self.headers) as response:
            return response.status, response.content_type, await response.text()

    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        status, content_type, body = await self.raw(method, params)
        assert status == 200, body
        messages = parse_sse(body) if content_type == "text/event-stream" else [json.loads(body)]
        final: dict[str, Any] = messages[-1]
        assert final["id"] == self.ids
        return final

    async def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        message = await self.request("tools/call", {"name": name, "arguments": arguments})
        assert "result" in message, message
        result: dict[str, Any] = message["result"]
        return result

    async def close(self) -> None:
        async with self.http.delete(self.url, headers=self.headers) as response:
            assert response.status == 200


async def settled_result(session: Legacy, task_id: str) -> dict[str, Any]:
    """`task_result` until the task has settled (each call waits up to the hold)."""

    async def settled() -> dict[str, Any] | None:
        result = await session.call("task_result", {"taskId": task_id})
        return None if result.get("structuredContent", {}).get("status") == "working" else result

    answer: dict[str, Any] = await until(settled, "the task never settled")
    return answer


@pytest.fixture
async def legacy_http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def tools_by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {tool["name"]: tool for tool in result["tools"]}


# --- what each client is listed ------------------------------------------------------------------------------


async def test_only_clients_without_tasks_are_listed_the_task_tools(
    tasks_client: ClientFactory, legacy_http: aiohttp.ClientSession, upstream: Upstream
) -> None:
    client = await tasks_client(**handles())
    _, declaring = await client.post("tools/list", {})
    _, undeclared = await client.post("tools/list", {}, capabilities={})
    declared_tools, undeclared_tools = tools_by_name(declaring["result"]), tools_by_name(undeclared["result"])
    assert not set(SYNTHESISED) & set(declared_tools)
    assert "outputSchema" in declared_tools["long_report"]  # a declaring client's list is unchanged
    assert list(undeclared_tools)[-4:] == SYNTHESISED  # at the end of the last page
    assert "outputSchema" not in undeclared_tools["long_report"]  # a handle would not fit the tool's own schema
    assert all("outputSchema" not in undeclared_tools[name] for name in SYNTHESISED)
    assert set(undeclared_tools) - set(SYNTHESISED) == set(declared_tools)
    # A legacy client's list through the pass-through: the upstream's (SSE, with its event ids), rewritten alike.
    direct = await (await Legacy(legacy_http, upstream.url).open()).raw("tools/list")
    proxied = await (await Legacy(legacy_http, str(client.client.make_url("/mcp"))).open()).raw("tools/list")
    assert direct[:2] == proxied[:2] == (200, "text/event-stream")
    direct_events, proxied_events = direct[2].split("\n\n"), proxied[2].split("\n\n")
    assert len(direct_events) == len(proxied_events)  # the priming event, the answer, the end
    assert [line.startswith("id:") for line in direct[2].splitlines()] == [
        line.startswith("id:") for line in proxied[2].splitlines()
    ]
    [listed] = [message for message in parse_sse(proxied[2]) if "result" in message]
    legacy_tools = tools_by_name(listed["result"])
    assert list(legacy_tools)[-4:] == SYNTHESISED
    assert "outputSchema" not in legacy_tools["long_report"]
    SchemaValidator(LEGACY_SCHEMA).validate(listed["result"], "ListToolsResult")


async def test_every_other_legacy_message_is_relayed_byte_for_byte(
    make_proxy: Callable[..., Any], legacy_http: aiohttp.ClientSession, upstream: Upstream
) -> None:
    """With handles on, what is neither a tools/list nor a call of a handle or task tool is relayed as it came:
    the same bytes as directly (event ids aside: they name the session)."""
    proxy: Client = await make_proxy(upstream.url, **handles())

    async def exchange(url: str) -> list[tuple[int, str, str]]:
        session = await Legacy(legacy_http, url).open()
        seen = [
            await session.raw("tools/call", {"name": "echo", "arguments": {"text": "é"}}),
            await session.raw("tools/call", {"name": "tool_error", "arguments": {"message": "no"}}),
            await session.raw("prompts/list"),
            await session.raw("resources/read", {"uri": "test://static-text"}),
            await session.raw("tools/call", {"name": "raise_error", "arguments": {"message": "bad", "code": -32000}}),
        ]
        session_id = session.headers["Mcp-Session-Id"]
        await session.close()
        return [(status, kind, _scrub(body, session_id)) for status, kind, body in seen]

    assert await exchange(str(proxy.make_url("/mcp"))) == await exchange(upstream.url)


def _scrub(body: str, session_id: str) -> str:
    return "\n".join(line for line in body.replace(session_id, "<sid>").splitlines() if not line.startswith("id:"))


async def test_a_list_change_still_reaches_a_legacy_client(make_proxy: Callable[..., Any], upstream: Upstream) -> None:
    proxy: Client = await make_proxy(upstream.url, **handles())
    async with connect(str(proxy.make_url("/mcp"))) as conn:
        await conn.session.call_tool("test_trigger_tool_change", {})
        await until(
            lambda: any(
                getattr(note.root, "method", "") == "notifications/tools/list_changed" for note in conn.notifications
            ),
            "notifications/tools/list_changed never reached the client",
        )


# --- the hold -------------------------------------------------------------------------------------------------


async def test_a_call_that_ends_within_the_hold_answers_its_own_result(
    tasks_client: ClientFactory, legacy_http: aiohttp.ClientSession
) -> None:
    client = await tasks_client(**handles(hold_ms=5000))
    key = new_key()
    status, message = await client.call("long_report", {"key": key, "seconds": 0.2}, capabilities={})
    assert status == 200, message
    assert message["result"]["structuredContent"] == {"key": key, "runs": 1, "approved": None}
    legacy = await Legacy(legacy_http, str(client.client.make_url("/mcp"))).open()
    result = await legacy.call("long_report", {"key": key, "seconds": 0.2})
    assert result["structuredContent"] == {"key": key, "runs": 2, "approved": None}
    assert "resultType" not in result  # a legacy result
    SchemaValidator(LEGACY_SCHEMA).validate(result, "CallToolResult")


async def test_a_question_ends_the_hold_at_once(tasks_client: ClientFactory) -> None:
    client = await tasks_client(**handles(hold_ms=8000))
    key = new_key()
    started = time.perf_counter()
    _, message = await client.call("long_report", {"key": key, "ask": True}, capabilities={})
    assert time.perf_counter() - started < 3  # far from the 8 s hold
    handle = message["result"]["structuredContent"]
    assert handle["status"] == "input_required"
    [(question_key, question)] = handle["inputRequests"].items()
    assert question["params"]["message"] == f"Approve report {key}?"
    assert "task_respond" in message["result"]["content"][0]["text"]
    _, declined = await client.call(
        "task_respond",
        {"taskId": handle["taskId"], "inputResponses": {question_key: {"action": "decline"}}},
        capabilities={},
    )
    assert declined["result"]["structuredContent"]["answered"] == [question_key]
    _, result = await client.call("task_result", {"taskId": handle["taskId"]}, capabilities={})
    assert result["result"]["structuredContent"] == {"key": key, "runs": 1, "approved": False}


async def test_a_failed_task_is_an_error_result_saying_so(tasks_client: ClientFactory) -> None:
    client = await tasks_client(**handles(hold_ms=200, protocol_error_job={"without_tasks": "handle"}))
    _, message = await client.call("protocol_error_job", {}, capabilities={})
    handle = message["result"]["structuredContent"]
    assert handle["status"] == "working"

    async def settled() -> dict[str, Any] | None:
        _, answer = await client.call("task_result", {"taskId": handle["taskId"]}, capabilities={})
        working = answer["result"].get("structuredContent", {}).get("status") == "working"
        return None if working else answer

    result = await until(settled, "the task never settled")  # each task_result waits up to the 200 ms hold
    assert result["result"]["isError"] is True
    assert result["result"]["structuredContent"]["status"] == "failed"
    assert "failed" in result["result"]["content"][0]["text"]
    assert result["result"]["structuredContent"]["error"]["code"] == -32603


async def test_handle_comes_before_undeclared_required(tasks_client: ClientFactory) -> None:
    required = {"mode": "required", "without_tasks": "handle"}
    client = await tasks_client(tasks={"tools": {"long_report": required}, "undeclared_required": "reject"})
    key = new_key()
    status, message = await client.call("long_report", {"key": key, "seconds": 0.2}, capabilities={})
    assert status == 200, message  # not -32021: the client gets its result (within the hold)
    assert message["result"]["structuredContent"]["key"] == key
    status, created = await client.call("long_report", {"key": key, "seconds": 0.2}, capabilities=DECLARING)
    assert created["result"]["resultType"] == "task"  # a declaring client still gets its task


async def test_a_held_client_that_asked_for_progress_hears_some_at_least_every_10_s(
    tasks_client: ClientFactory,
) -> None:
    """`held` sends no progress of its own; a client without Tasks held for it (the default `hold`) hears the
    proxy's own progress, so a client that resets its timeout on progress never gives up on it."""
    client = await tasks_client()
    arrived: list[tuple[float, dict[str, Any]]] = []
    started = time.perf_counter()
    body = modern_body("tools/call", {"name": "held", "arguments": {"tag": "kept", "seconds": 9}}, progressToken="p")
    async with client.client.post("/mcp", json=body, headers=modern_headers("tools/call", "held")) as response:
        async for message in sse_messages(response):
            arrived.append((time.perf_counter() - started, message))
    *notes, (_, answer) = arrived
    assert answer["result"]["content"][0]["text"] == "kept"
    assert notes
    assert all(note["method"] == "notifications/progress" for _, note in notes)
    assert all(note["params"]["progressToken"] == "p" for _, note in notes)
    times = [0.0] + [at for at, _ in arrived]
    assert max(later - earlier for earlier, later in itertools.pairwise(times)) < 10


# --- who a handle belongs to, and how long ----------------------------------------------------------------------


async def test_a_handle_outlives_the_legacy_session_that_made_it(
    make_proxy: Callable[..., Any], legacy_http: aiohttp.ClientSession, upstream: Upstream
) -> None:
    proxy: Client = await make_proxy(upstream.url, **handles())
    url = str(proxy.make_url("/mcp"))
    key = new_key()
    first = await Legacy(legacy_http, url, {"Authorization": "Bearer alice"}).open()
    handle = (await first.call("long_report", {"key": key, "seconds": 2}))["structuredContent"]
    await first.close()  # DELETE: the upstream never ran the call on this session
    second = await Legacy(legacy_http, url, {"Authorization": "Bearer alice"}).open()
    result = await settled_result(second, handle["taskId"])
    assert result["structuredContent"] == {"key": key, "runs": 1, "approved": None}
    assert story(key) == ["started", "finished"]


async def test_anonymous_callers_share_one_principal_unless_refused(
    make_proxy: Callable[..., Any], legacy_http: aiohttp.ClientSession, upstream: Upstream
) -> None:
    shared: Client = await make_proxy(upstream.url, **handles())
    url = str(shared.make_url("/mcp"))
    handle = await (await Legacy(legacy_http, url).open()).call("long_report", {"key": new_key(), "seconds": 2})
    task_id = handle["structuredContent"]["taskId"]
    other = await Legacy(legacy_http, url).open()  # another anonymous client: the same principal
    assert (await other.call("task_status", {"taskId": task_id}))["structuredContent"]["taskId"] == task_id
    refusing: Client = await make_proxy(upstream.url, **handles(), security={"anonymous": "refuse"})
    anonymous = await Legacy(legacy_http, str(refusing.make_url("/mcp"))).open()
    for name, arguments in (("long_report", {"key": new_key()}), ("task_status", {"taskId": task_id})):
        status, _, body = await anonymous.raw("tools/call", {"name": name, "arguments": arguments})
        assert status == 401, body
    assert (await anonymous.call("echo", {"text": "relayed"}))["content"][0]["text"] == "relayed"


async def test_a_result_is_read_after_a_restart(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    """A settled handle's result, and a handle whose call was running when the proxy stopped (`on_restart:
    fail`, as any task), read through a new process on the same store."""
    proxy = ProxyProcess(tmp_path, upstream.url, **handles())
    processes.append(proxy)
    await proxy.start()
    done_key, running_key = new_key(), new_key()
    legacy = await Legacy(http, proxy.url, {"Authorization": "Bearer alice"}).open()
    done = (await legacy.call("long_report", {"key": done_key, "seconds": 1.5}))["structuredContent"]["taskId"]
    running = (await legacy.call("long_report", {"key": running_key, "seconds": 60}))["structuredContent"]["taskId"]
    settled = await settled_result(legacy, done)
    assert settled["structuredContent"]["key"] == done_key
    assert await proxy.terminate() == 0
    await proxy.start()
    legacy = await Legacy(http, proxy.url, {"Authorization": "Bearer alice"}).open()
    again = await legacy.call("task_result", {"taskId": done})
    assert again == settled
    interrupted = await legacy.call("task_result", {"taskId": running})
    assert interrupted["isError"] is True
    assert "interrupted" in interrupted["content"][0]["text"]


async def test_the_start_stops_when_the_upstream_lists_a_synthesised_tools_name(
    tmp_path: Path, upstream: Upstream
) -> None:
    sections = handles()
    sections["handles"]["tool_prefix"] = "clash_"
    proxy = ProxyProcess(tmp_path, upstream.url, **sections)
    try:
        await _start_and_fail(proxy)
        assert proxy.process is not None
        assert proxy.process.returncode == 2
        [failed] = [event for event in proxy.events() if event.get("event") == "start_failed"]
        assert failed["reason"] == "task_tool_name_taken"
        assert "clash_task_status" in failed["error"]
        assert "handles.tool_prefix" in failed["error"]
    finally:
        proxy.stop()


async def _start_and_fail(proxy: ProxyProcess) -> None:
    process = proxy.process = proxy._spawn()
    await until(lambda: process.poll() is not None, "the proxy started despite the name taken", 30)


async def test_a_synthesised_tool_the_proxy_answers_is_not_sent_upstream(tasks_client: ClientFactory) -> None:
    """A synthesised tool is the proxy's own: an id that is no task's answers "no such task" as a result, and
    a declaring client, which has tasks/*, calls the upstream's tools only (here: none of that name)."""
    client = await tasks_client(**handles())
    _, undeclared = await client.call("task_status", {"taskId": "task_" + "B" * 32}, capabilities={})
    assert undeclared["result"]["isError"] is True
    assert undeclared["result"]["content"][0]["text"].startswith("No such task")
    _, declared = await client.call("task_status", {"taskId": "task_" + "B" * 32})
    assert "No such task" not in json.dumps(declared)  # the upstream's own answer for a tool it lacks
    assert text_of(declared) != text_of(undeclared)


def text_of(message: dict[str, Any]) -> str:
    result = message.get("result", {})
    return "".join(block.get("text", "") for block in result.get("content", []))


async def test_a_legacy_clients_handle_calls_count_against_the_tools_quota(
    make_proxy: Callable[..., Any], legacy_http: aiohttp.ClientSession, upstream: Upstream
) -> None:
    """A legacy client's `handle` call runs as a call of the proxy's own, so it passes what a modern call passes
    before it starts: here the tool's quota of one call a minute. (The quota's window is the UTC minute: of two
    calls after the first, one at least falls in the first's minute or in the next one's with the other.)"""
    limited: dict[str, Any] = {"without_tasks": "handle", "calls_per_minute_per_principal": 1}
    proxy: Client = await make_proxy(upstream.url, **handles(long_report=limited))
    legacy = await Legacy(legacy_http, str(proxy.make_url("/mcp")), {"Authorization": "Bearer alice"}).open()
    answers: list[tuple[int, int, dict[str, Any]]] = []
    for _ in range(3):
        status, _, body = await legacy.raw("tools/call", {"name": "long_report", "arguments": {"key": new_key()}})
        answers.append((status, legacy.ids, json.loads(body) if status != 200 else {}))
    assert answers[0][0] == 200
    refused = [(request_id, message) for status, request_id, message in answers[1:] if status == 429]
    assert refused, answers
    request_id, message = refused[0]
    assert message["id"] == request_id  # answered on the client's POST, with its request's id
    assert message["error"]["data"]["limit"] == "tasks.tools.long_report.calls_per_minute_per_principal"
