"""End to end, for both kinds of upstream: the same mcp 1.x fixture over Streamable HTTP and as a stdio server
the proxy runs itself (`upstream.command`). The flows that matter run against both: a synchronous call with
progress, a task, an elicitation inside a task answered with tasks/update, an MRTR round, a cancel the upstream
sees, and an upstream killed mid-task. Real processes throughout.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.clients import Tasks
from tests.support.processes import Upstream, stdio_sessions, stdio_upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until
from tests.support.wire import DECLARING, TASKING, modern_body, modern_headers, parse_sse, policies, result_text

ELICIT: dict[str, Any] = {"elicitation": {}}


Start = Callable[..., Awaitable[Tasks]]


@pytest.fixture(params=["http", "stdio"])
def upstream_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
def start_proxy(
    upstream_kind: str,
    make_proxy: Callable[..., Any],
    upstream: Upstream,
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> Start:
    """A proxy in front of the fixture of `upstream_kind` (HTTP: the shared fixture server, or `url`)."""

    async def start(url: str | None = None, **sections: dict[str, Any]) -> Tasks:
        if upstream_kind == "stdio":
            sections["upstream"] = stdio_upstream(**sections.get("upstream", {}))
            client = await make_proxy("", **sections)
        else:
            client = await make_proxy(url or upstream.url, **sections)
        return Tasks(client, modern_schema, tasks_schema)

    return start


async def cancelled_ids(client: Tasks) -> list[int]:
    ids: list[int] = json.loads(await client.text("cancelled_requests", {}))
    return ids


# --- the flows, against both kinds ------------------------------------------------------------------------


async def test_a_sync_call_with_progress(start_proxy: Start) -> None:
    client = await start_proxy(tasks=policies(sleep={"mode": "forbidden"}))
    response = await client.client.post(
        "/mcp",
        json=modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 0.3}}, progressToken="tok"),
        headers=modern_headers("tools/call", "sleep"),
    )
    messages = parse_sse(await response.text())
    *progress, final = messages
    client.core.check_all(messages, "tools/call")
    assert final["result"]["content"][0]["text"] == "slept 0.3"
    assert progress
    assert {message["params"]["progressToken"] for message in progress} == {"tok"}  # the client's own token
    assert await client.text("echo", {"text": "é ok"}) == "é ok"


async def test_a_task_completes_with_progress_as_its_status(start_proxy: Start) -> None:
    client = await start_proxy(tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 1.0})
    working = await client.until(task_id, lambda task: "statusMessage" in task or task["status"] == "completed")
    done = await client.settled(task_id)
    assert done["status"] == "completed"
    assert result_text(done) == "slept 1"
    assert working["status"] == "completed" or "/1" in working["statusMessage"]


async def test_an_elicitation_inside_a_task_is_answered_with_tasks_update(start_proxy: Start) -> None:
    client = await start_proxy(tasks=policies(ask_name={"mode": "required"}))
    task_id = await client.create("ask_name", capabilities=TASKING)
    task = await client.until(task_id, lambda task: task["status"] == "input_required")
    [(key, question)] = task["inputRequests"].items()
    assert question["params"]["message"] == "What is your name?"
    status, _ = await client.post("tasks/update", {"taskId": task_id, "inputResponses": {key: _accept(name="Ada")}})
    assert status == 200
    done = await client.settled(task_id)
    assert result_text(done) == "Hello, Ada"


async def test_an_mrtr_round_then_the_result(start_proxy: Start) -> None:
    client = await start_proxy()
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    status, message = await client.post("tools/call", params, capabilities=ELICIT)
    assert status == 200
    result = message["result"]
    assert result["resultType"] == "input_required"
    [key] = result["inputRequests"]
    retry = {**params, "inputResponses": {key: _accept(name="Grace")}, "requestState": result["requestState"]}
    status, message = await client.post("tools/call", retry, capabilities=ELICIT)
    assert status == 200
    assert message["result"]["content"][0]["text"] == "Hello, Grace"


async def test_a_cancelled_task_is_cancelled_upstream(start_proxy: Start) -> None:
    client = await start_proxy(tasks=policies(sleep={"mode": "required"}))
    before = await cancelled_ids(client)
    task_id = await client.create("sleep", {"seconds": 30})
    await client.until(task_id, lambda task: "statusMessage" in task)  # the upstream runs it
    status, _ = await client.post("tasks/cancel", {"taskId": task_id})
    assert status == 200
    assert (await client.task(task_id))["status"] == "cancelled"

    async def seen() -> bool:  # notifications/cancelled reached the server
        return len(await cancelled_ids(client)) > len(before)

    await until(seen, "the upstream never saw notifications/cancelled")


async def test_an_upstream_killed_mid_task_fails_it_and_the_next_call_works(
    upstream_kind: str, start_proxy: Start, own_upstream: Upstream
) -> None:
    client = await start_proxy(own_upstream.url, tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 30})
    await client.until(task_id, lambda task: "statusMessage" in task)
    if upstream_kind == "stdio":
        [session] = [session for session in stdio_sessions(client) if session.in_flight]
        pid = session.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    else:
        assert own_upstream.process is not None
        port = own_upstream.port
        own_upstream.process.kill()
        await asyncio.to_thread(own_upstream.process.wait)
    failed = await client.settled(task_id)
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == -32603
    if upstream_kind == "stdio":
        assert f"Upstream stdio server {Path(sys.executable).name}#" in failed["error"]["message"]
        assert "killed by SIGKILL during tools/call" in failed["error"]["message"]
        assert pid not in {session.pid for session in stdio_sessions(client)}
    else:
        assert "Upstream" in failed["error"]["message"]
        await asyncio.to_thread(own_upstream.start, port)
    assert await client.text("echo", {"text": "again"}) == "again"


async def test_an_answer_over_the_result_limit_fails_the_call_and_the_upstream_serves_on(
    upstream_kind: str, start_proxy: Start
) -> None:
    """`limits.max_result_bytes` holds for both kinds: a synchronous caller gets -32603 naming the limit (HTTP
    502), a task fails with it, and the next call is answered (on stdio by the same process: the line was read
    to its end, so the stream of messages is intact)."""
    cap = 1 << 20
    client = await start_proxy(
        limits={"max_result_bytes": cap}, tasks=policies(big_text={"mode": "optional", "sync_window_ms": 0})
    )
    assert await client.text("echo", {"text": "before"}) == "before"
    pids = {session.pid for session in stdio_sessions(client)} if upstream_kind == "stdio" else set()
    limit = {"limit": "max_result_bytes", "max": cap}

    status, message = await client.call("big_text", {"size": 2 * cap}, capabilities={})
    assert status == 502, message
    assert (message["error"]["code"], message["error"]["data"]) == (-32603, limit)

    task_id = await client.create("big_text", {"size": 2 * cap}, capabilities=DECLARING)
    failed = await client.settled(task_id)
    assert failed["status"] == "failed"
    assert (failed["error"]["code"], failed["error"]["data"]) == (-32603, limit)

    assert await client.text("big_text", {"size": cap // 2}) == "x" * (cap // 2)
    if upstream_kind == "stdio":
        assert {session.pid for session in stdio_sessions(client)} & pids, "the shared process was replaced"


def _accept(**content: Any) -> dict[str, Any]:
    return {"action": "accept", "content": content}
