"""End to end: legacy upstreams that run their own 2025-11-25 tasks, served to 2026-07-28 clients as the proxy's
tasks, in front of the real mcp 1.x fixture (`--legacy-tasks`) and the reference server server-everything over
HTTP. Every message to a modern client is checked against the 2026-07-28 and Tasks schemas by the `Tasks`
client; what the upstream itself says about its task is read directly from it (same session, raw HTTP).
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import mcp.types as mt
import pytest

from proxy.edge._app_keys import STORE
from proxy.wire.tasks import TaskRecord
from tests.reference_server import EverythingServer
from tests.support.clients import ClientFactory, Tasks
from tests.support.processes import Upstream
from tests.support.sdk import connect, text
from tests.support.wire import ELICITING, TASKS, policies, read_messages, result_text

TERMINAL = ("completed", "failed", "cancelled")


async def stored(client: Tasks, task_id: str) -> TaskRecord:
    record = await client.client.app[STORE].records.get(task_id)
    assert record is not None
    return record


async def upstream_task(url: str, record: TaskRecord, method: str = "tasks/get") -> dict[str, Any]:
    """`tasks/get` (or another tasks/* request) straight to the upstream, on the session the proxy's record
    names."""
    assert record.upstream_session_id is not None
    assert record.upstream_task_id is not None
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25",
        "Mcp-Session-Id": record.upstream_session_id,
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {"taskId": record.upstream_task_id}}
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as response:
        message = (await read_messages(response))[-1]
    assert "result" in message, message
    result: dict[str, Any] = message["result"]
    return result


def statuses(seen: list[tuple[str, str | None]]) -> list[tuple[str, str | None]]:
    return [item for index, item in enumerate(seen) if item not in seen[:index]]


async def follow(client: Tasks, task_id: str, **kwargs: Any) -> tuple[dict[str, Any], list[tuple[str, str | None]]]:
    """Poll the task to its end; every (status, statusMessage) seen on the way, in order."""
    seen: list[tuple[str, str | None]] = []

    def done(task: dict[str, Any]) -> bool:
        seen.append((task["status"], task.get("statusMessage")))
        return task["status"] in TERMINAL

    return await client.until(task_id, done, **kwargs), statuses(seen)


# --- the mcp 1.x fixture with its own tasks -------------------------------------------------------------------


async def test_a_tool_the_upstream_requires_as_a_task_runs_as_the_upstreams_task(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    # The default policy is `optional` with a sync window; the upstream requiring a task makes it one at once.
    client = await tasks_client(legacy_task_upstream.url)
    task_id = await client.create("legacy_task_required", {"seconds": 1.2})
    record = await stored(client, task_id)
    assert record.upstream_task_id is not None
    assert record.upstream_task_id != task_id
    assert record.upstream_session_id is not None
    # The policy's, which the upstream was asked for and granted; counted from the upstream's own creation, a
    # millisecond or so earlier than the proxy's record, so that the record never outlives the upstream's task.
    assert record.ttl_ms is not None
    assert 299_000 <= record.ttl_ms <= 300_000
    done, seen = await follow(client, task_id)
    assert done["status"] == "completed"
    assert result_text(done) == "done after 1.2s"
    assert done["result"]["isError"] is False
    assert "_meta" not in done["result"]  # the upstream's related-task tag stays behind
    assert {message for status, message in seen if status == "working"} >= {"step 2/4", "step 3/4"}
    assert (await upstream_task(legacy_task_upstream.url, record))["status"] == "completed"


async def test_a_non_declaring_client_gets_minus_32021_not_the_upstreams_task_error(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    client = await tasks_client(legacy_task_upstream.url)
    status, message = await client.call("legacy_task_required", {"seconds": 0}, capabilities={})
    assert status == 400
    assert message["error"]["code"] == -32021
    assert message["error"]["data"]["requiredCapabilities"] == {"extensions": {TASKS: {}}}
    assert "augment" not in message["error"]["message"]


async def test_a_non_declaring_client_waits_for_the_upstreams_task_with_undeclared_wait(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    client = await tasks_client(legacy_task_upstream.url, tasks={"undeclared_required": "wait"})
    status, message = await client.call("legacy_task_required", {"seconds": 0.4}, capabilities={})
    assert status == 200, message
    assert message["result"]["resultType"] == "complete"
    assert message["result"]["content"] == [{"type": "text", "text": "done after 0.4s"}]


async def test_a_tool_the_upstream_runs_optionally_follows_the_policys_window(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    client = await tasks_client(
        legacy_task_upstream.url, tasks=policies(legacy_task_optional={"mode": "optional", "sync_window_ms": 1000})
    )
    status, quick = await client.call("legacy_task_optional", {"seconds": 0})
    assert status == 200
    assert quick["result"]["resultType"] == "complete"  # ended within the window: no task of the proxy's
    assert quick["result"]["content"][0]["text"] == "optional done"
    task_id = await client.create("legacy_task_optional", {"seconds": 1.5})
    assert (await stored(client, task_id)).upstream_task_id is not None  # the same upstream task goes on
    done, _ = await follow(client, task_id)
    assert result_text(done) == "optional done"
    status, plain = await client.call("legacy_task_optional", {"seconds": 0.1}, capabilities={})
    assert status == 200
    assert plain["result"]["content"][0]["text"] == "optional done"  # a plain call for a non-declaring client


@pytest.mark.parametrize(("answer", "expected"), [({"name": "Ann"}, "Hello, Ann!"), (None, "declined")])
async def test_an_elicitation_inside_the_upstreams_task_is_an_input_request(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream, answer: dict[str, Any] | None, expected: str
) -> None:
    client = await tasks_client(legacy_task_upstream.url)
    task_id = await client.create("legacy_task_elicit", capabilities=ELICITING)
    task = await client.until(task_id, lambda task: task["status"] == "input_required")
    [(key, request)] = task["inputRequests"].items()
    assert key == "elicitation-1"
    assert request["method"] == "elicitation/create"
    assert request["params"]["message"] == "What is your name?"
    assert request["params"]["mode"] == "form"
    assert "_meta" not in request["params"]  # no related-task tag
    record = await stored(client, task_id)
    assert isinstance(record.upstream_input_ids[key], str)  # the SDK's string id, kept for a restart
    response = {"action": "accept", "content": answer} if answer is not None else {"action": "decline"}
    status, ack = await client.post("tasks/update", {"taskId": task_id, "inputResponses": {key: response}})
    assert status == 200, ack
    done, _ = await follow(client, task_id)
    assert done["status"] == "completed"
    assert result_text(done) == expected


async def test_an_elicitation_the_client_did_not_declare_is_declined_upstream(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    client = await tasks_client(legacy_task_upstream.url)
    task_id = await client.create("legacy_task_elicit")
    done, _ = await follow(client, task_id)
    assert result_text(done) == "declined"


@pytest.mark.parametrize("sdk_default", [False, True])
async def test_a_tool_error_completes_with_is_error(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream, sdk_default: bool
) -> None:
    """The upstream says `failed` (2025-11-25) or `completed` (the SDK's own way); either is a completed task
    whose result says isError in 2026-07-28."""
    client = await tasks_client(legacy_task_upstream.url)
    task_id = await client.create("legacy_task_tool_error", {"sdk_default": sdk_default})
    done, _ = await follow(client, task_id)
    assert done["status"] == "completed"
    assert done["result"]["isError"] is True
    assert result_text(done) == "tool failed"
    upstream = await upstream_task(legacy_task_upstream.url, await stored(client, task_id))
    assert upstream["status"] == ("completed" if sdk_default else "failed")


@pytest.mark.parametrize("sdk_default", [False, True])
async def test_a_raising_tool_fails_with_a_json_rpc_error(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream, sdk_default: bool
) -> None:
    """tasks/result answers a JSON-RPC error, or (the SDK's own way) an empty result of a `failed` task: both
    are a failed task whose error says what the upstream said."""
    client = await tasks_client(legacy_task_upstream.url)
    task_id = await client.create("legacy_task_raises", {"sdk_default": sdk_default})
    done, _ = await follow(client, task_id)
    assert done["status"] == "failed"
    assert done["error"] == {"code": -32603, "message": "legacy_task_raises: simulated failure"}
    assert "simulated failure" in done["statusMessage"]
    assert "result" not in done


async def test_cancel_is_tasks_cancel_upstream(tasks_client: ClientFactory, legacy_task_upstream: Upstream) -> None:
    client = await tasks_client(legacy_task_upstream.url)
    task_id = await client.create("legacy_task_required", {"seconds": 30})
    status, ack = await client.post("tasks/cancel", {"taskId": task_id})
    assert status == 200, ack
    cancelled = await client.task(task_id)
    assert cancelled["status"] == "cancelled"
    assert (await upstream_task(legacy_task_upstream.url, await stored(client, task_id)))["status"] == "cancelled"


async def test_a_task_the_upstream_cancels_by_itself_is_cancelled(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    """The mcp 1.x SDK says nothing when a task is cancelled and answers its tasks/result with an empty result:
    the proxy asks tasks/get what that means."""
    client = await tasks_client(legacy_task_upstream.url)
    task_id = await client.create("legacy_task_required", {"seconds": 30})
    record = await stored(client, task_id)
    assert (await upstream_task(legacy_task_upstream.url, record, "tasks/cancel"))["status"] == "cancelled"
    done, _ = await follow(client, task_id)
    assert done["status"] == "cancelled"
    assert done["statusMessage"] == "cancelled by the upstream"


async def test_a_legacy_client_runs_the_upstreams_tasks_through_the_pass_through(
    tasks_client: ClientFactory, legacy_task_upstream: Upstream
) -> None:
    client = await tasks_client(legacy_task_upstream.url)
    url = str(client.client.make_url("/mcp"))
    async with connect(url) as conn:
        assert conn.init.capabilities.tasks is not None  # the upstream's own InitializeResult
        created = await conn.tasks.call_tool_as_task("legacy_task_required", {"seconds": 0.2}, ttl=60_000)
        result = await conn.tasks.get_task_result(created.task.taskId, mt.CallToolResult)
    assert text(result) == "done after 0.2s"


# --- server-everything over HTTP --------------------------------------------------------------------------------


async def test_simulate_research_query_runs_to_its_end(
    tasks_client: ClientFactory, everything: EverythingServer
) -> None:
    # A policy that keeps tasks longer than the upstream does: the record never outlives the upstream's task.
    client = await tasks_client(everything.url, tasks=policies(**{"simulate-research-query": {"ttl_ms": 3_600_000}}))
    started = time.monotonic()
    task_id = await client.create("simulate-research-query", {"topic": "python"})
    created = await client.task(task_id)
    assert created["ttlMs"] <= 300_000  # server-everything keeps its tasks 300 s, whatever it is asked
    done, seen = await follow(client, task_id)
    elapsed = time.monotonic() - started
    assert done["status"] == "completed"
    assert result_text(done).startswith("# Research Report: python")
    assert [message for status, message in seen if status == "working"] == [
        "Gathering sources...",
        "Analyzing content...",
        "Synthesizing findings...",
        "Generating report...",
    ]
    assert elapsed < 30  # four stages of about 1 s each; a generous bound only


async def test_an_ambiguous_research_query_asks_and_is_answered_with_tasks_update(
    tasks_client: ClientFactory, everything: EverythingServer
) -> None:
    client = await tasks_client(everything.url)
    task_id = await client.create(
        "simulate-research-query", {"topic": "python", "ambiguous": True}, capabilities=ELICITING
    )
    task = await client.until(task_id, lambda task: task["status"] == "input_required", timeout_seconds=20)
    [(key, request)] = task["inputRequests"].items()
    assert request["method"] == "elicitation/create"
    schema = request["params"]["requestedSchema"]
    assert {choice["const"] for choice in schema["properties"]["interpretation"]["oneOf"]} == {
        "programming",
        "snake",
        "comedy",
    }
    record = await stored(client, task_id)
    assert isinstance(record.upstream_input_ids[key], int)  # server-everything numbers its requests
    response = {"action": "accept", "content": {"interpretation": "snake"}}
    status, ack = await client.post("tasks/update", {"taskId": task_id, "inputResponses": {key: response}})
    assert status == 200, ack
    done, _ = await follow(client, task_id, timeout_seconds=20)
    assert done["status"] == "completed"
    assert result_text(done).startswith("# Research Report: python (snake)")


async def test_cancelling_a_research_query_cancels_it_upstream(
    tasks_client: ClientFactory, everything: EverythingServer
) -> None:
    client = await tasks_client(everything.url)
    task_id = await client.create("simulate-research-query", {"topic": "cancelled"})
    status, ack = await client.post("tasks/cancel", {"taskId": task_id})
    assert status == 200, ack
    assert (await client.task(task_id))["status"] == "cancelled"
    assert (await upstream_task(everything.url, await stored(client, task_id)))["status"] == "cancelled"


async def test_a_non_declaring_client_gets_the_research_report_synchronously(
    tasks_client: ClientFactory, everything: EverythingServer
) -> None:
    client = await tasks_client(everything.url, tasks={"undeclared_required": "wait"})
    status, message = await client.call("simulate-research-query", {"topic": "owls"}, capabilities={})
    assert status == 200, message
    assert message["result"]["resultType"] == "complete"
    assert message["result"]["content"][0]["text"].startswith("# Research Report: owls")
    assert "isError" not in message["result"]
    rejecting = await tasks_client(everything.url)
    status, refused = await rejecting.call("simulate-research-query", {"topic": "owls"}, capabilities={})
    assert status == 400
    assert refused["error"]["code"] == -32021
