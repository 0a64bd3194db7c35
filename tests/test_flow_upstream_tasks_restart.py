"""A proxy restart while a task the upstream runs itself is live: the next start follows that task again, on the
same upstream session, with tasks/get and tasks/result, and fails it only when the upstream no longer knows it.

The proxy runs as a child process (`ProxyProcess`), killed with SIGKILL or stopped with SIGTERM; the upstreams
are the mcp 1.x fixture with `--legacy-tasks` and server-everything over HTTP. Messages are schema-checked by
the `Tasks` client.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from tests.reference_server import EverythingServer
from tests.support.clients import Client, Tasks
from tests.support.processes import ProxyProcess, Upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.wire import ELICITING, result_text

pytestmark = pytest.mark.faults


@pytest.fixture
def own_legacy_task_upstream() -> Iterator[Upstream]:
    """A `--legacy-tasks` fixture upstream for one test alone (it may stop and restart it)."""
    server = Upstream("--legacy-tasks")
    server.start()
    yield server
    server.stop()


class Proxies:
    """Proxy processes in front of one upstream, sharing one task database."""

    def __init__(self, tmp_path: Path, upstream_url: str, processes: list[ProxyProcess], core: Any, tasks: Any) -> None:
        self.tmp_path = tmp_path
        self.upstream_url = upstream_url
        self.processes = processes
        self.database = tmp_path / "resume.db"
        self.schemas = (core, tasks)

    async def start(self) -> ProxyProcess:
        # No drain: a stop leaves what runs for the next start, the path these tests follow.
        process = ProxyProcess(
            self.tmp_path, self.upstream_url, store={"path": str(self.database)}, tasks={"drain_seconds": 0}
        )
        self.processes.append(process)
        await process.start()
        return process

    @asynccontextmanager
    async def client(self, process: ProxyProcess) -> AsyncIterator[Tasks]:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{process.port}") as http:
            yield Tasks(cast(Client, http), *self.schemas)

    def stored(self, task_id: str) -> tuple[str | None, str | None]:
        """(upstream task id, upstream session id) as the database holds them."""
        with sqlite3.connect(self.database) as database:
            row = database.execute(
                "SELECT upstream_task_id, upstream_session_id FROM tasks WHERE task_id = ?", [task_id]
            ).fetchone()
        assert row is not None
        return row[0], row[1]


def resumed(process: ProxyProcess, task_id: str) -> bool:
    return any(event.get("event") == "task_resumed" and event.get("task_id") == task_id for event in process.events())


@pytest.fixture
def proxies_for(
    tmp_path: Path, processes: list[ProxyProcess], modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> Any:
    def make(upstream_url: str) -> Proxies:
        return Proxies(tmp_path, upstream_url, processes, modern_schema, tasks_schema)

    return make


async def test_after_a_kill_9_the_research_query_completes_with_the_upstreams_report(
    proxies_for: Any, everything: EverythingServer
) -> None:
    proxies: Proxies = proxies_for(everything.url)
    first = await proxies.start()
    async with proxies.client(first) as client:
        task_id = await client.create("simulate-research-query", {"topic": "restarts"})
        await client.until(task_id, lambda task: task.get("statusMessage") == "Analyzing content...")
    before = proxies.stored(task_id)
    await asyncio.to_thread(first.stop)  # SIGKILL: nothing is cancelled or ended upstream

    second = await proxies.start()
    async with proxies.client(second) as client:
        done = await client.settled(task_id, timeout_seconds=20)
    assert done["status"] == "completed", done
    assert result_text(done).startswith("# Research Report: restarts")
    assert resumed(second, task_id)
    assert proxies.stored(task_id) == before  # the same upstream task, in the same upstream session


async def test_after_a_kill_9_a_question_asked_before_can_still_be_answered(
    proxies_for: Any, legacy_task_upstream: Upstream
) -> None:
    proxies: Proxies = proxies_for(legacy_task_upstream.url)
    first = await proxies.start()
    async with proxies.client(first) as client:
        task_id = await client.create("legacy_task_elicit", capabilities=ELICITING)
        asked = await client.until(task_id, lambda task: task["status"] == "input_required")
    await asyncio.to_thread(first.stop)

    second = await proxies.start()
    async with proxies.client(second) as client:
        again = await client.until(task_id, lambda task: task["status"] == "input_required")
        assert again["inputRequests"] == asked["inputRequests"]  # the same key, the same question
        response = {"action": "accept", "content": {"name": "Bo"}}
        status, ack = await client.post(
            "tasks/update", {"taskId": task_id, "inputResponses": {"elicitation-1": response}}
        )
        assert status == 200, ack
        done = await client.settled(task_id)
    assert done["status"] == "completed", done
    assert result_text(done) == "Hello, Bo!"


async def test_a_graceful_stop_leaves_the_upstreams_task_and_session_for_the_next_start(
    proxies_for: Any, legacy_task_upstream: Upstream
) -> None:
    proxies: Proxies = proxies_for(legacy_task_upstream.url)
    first = await proxies.start()
    async with proxies.client(first) as client:
        task_id = await client.create("legacy_task_required", {"seconds": 4})
        await client.until(task_id, lambda task: task.get("statusMessage") == "step 1/4")
    assert await first.terminate() == 0  # SIGTERM: no tasks/cancel, no DELETE of the task's session

    second = await proxies.start()
    async with proxies.client(second) as client:
        done = await client.settled(task_id, timeout_seconds=20)
    assert done["status"] == "completed", done
    assert result_text(done) == "done after 4s"


async def test_a_task_the_upstream_forgot_meanwhile_fails(proxies_for: Any, own_legacy_task_upstream: Upstream) -> None:
    proxies: Proxies = proxies_for(own_legacy_task_upstream.url)
    first = await proxies.start()
    async with proxies.client(first) as client:
        task_id = await client.create("legacy_task_required", {"seconds": 60})
        await client.until(task_id, lambda task: task.get("statusMessage") == "step 1/4", timeout_seconds=30)
    await asyncio.to_thread(first.stop)
    port = own_legacy_task_upstream.port
    own_legacy_task_upstream.stop()  # its sessions and tasks are gone with it
    own_legacy_task_upstream.start(port)

    second = await proxies.start()
    async with proxies.client(second) as client:
        failed = await client.settled(task_id)
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == -32603
    assert "no longer knows" in failed["error"]["message"]


async def test_a_research_query_whose_session_was_ended_meanwhile_fails(
    proxies_for: Any, everything: EverythingServer
) -> None:
    """server-everything answers HTTP 400 for a session it does not know (not 404)."""
    proxies: Proxies = proxies_for(everything.url)
    first = await proxies.start()
    async with proxies.client(first) as client:
        task_id = await client.create("simulate-research-query", {"topic": "ended"})
    await asyncio.to_thread(first.stop)
    _, session_id = proxies.stored(task_id)
    assert session_id is not None
    async with aiohttp.ClientSession() as http:
        headers = {"Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
        async with http.delete(everything.url, headers=headers) as response:
            assert response.status == 200

    second = await proxies.start()
    async with proxies.client(second) as client:
        failed = await client.settled(task_id)
    assert failed["status"] == "failed"
    assert "no longer knows" in failed["error"]["message"]
