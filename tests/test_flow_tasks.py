"""End to end: durable tasks (SEP-2663) for a 2026-07-28 client in front of a real legacy upstream.

Every task message the proxy sends is validated against tests/schema/tasks-extension-2026-07-28.schema.json.
Waiting is by polling with a deadline, never by a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.edge._app_keys import CONFIG, FRONT, STORE
from proxy.policy import decide
from proxy.tasks.live_call import UpstreamRequest
from proxy.tasks.services import starting as starting_module
from proxy.tasks.store import SqliteTaskStore
from proxy.wire.envelope import Caller, validate_modern
from tests.support.clients import ClientFactory, Tasks, post_and_leave, upstream_calls_open
from tests.support.processes import Upstream, key_file
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until
from tests.support.wire import (
    DECLARING,
    TASKS,
    modern_body,
    modern_headers,
    parse_sse,
    policies,
    result_text,
)

# --- the decision: sync, task or -32021, from the policy and this request's declaration ---------------


async def test_window_returns_a_fast_call_synchronously(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "optional", "sync_window_ms": 5000}))
    status, message = await client.call("echo", {"text": "quick"})
    assert status == 200
    assert message["result"]["resultType"] == "complete"  # the immediate-result shortcut
    assert message["result"]["content"][0]["text"] == "quick"


async def test_window_turns_a_slow_call_into_a_task_without_a_second_upstream_call(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(counted={"mode": "optional", "sync_window_ms": 200}))
    task_id = await client.create("counted", {"key": "window-task", "seconds": 1.0})
    task = await client.task(task_id)  # readable at once: the task is durable before its id is returned
    assert task["status"] == "working"
    done = await client.settled(task_id)
    assert done["status"] == "completed"
    assert result_text(done) == "1"
    assert done["result"]["resultType"] == "complete"
    assert await client.text("call_count", {"key": "window-task"}) == "1"  # the same call continued


async def test_a_non_declaring_client_never_gets_a_task(tasks_client: ClientFactory) -> None:
    """The declaration is read from this request alone, even after the same client declared it."""
    client = await tasks_client(tasks=policies(counted={"mode": "optional", "sync_window_ms": 0}))
    await client.create("counted", {"key": "declared-first"})
    status, message = await client.call("counted", {"key": "declared-first", "seconds": 0.3}, capabilities={})
    assert status == 200
    assert message["result"]["resultType"] == "complete"
    assert "taskId" not in message["result"]


async def test_legacy_task_param_is_ignored(tasks_client: ClientFactory) -> None:
    """The legacy `task` opt-in neither creates a task nor reaches the upstream."""
    client = await tasks_client(tasks=policies(echo={"mode": "forbidden"}))
    status, message = await client.post(
        "tools/call", {"name": "echo", "arguments": {"text": "x"}, "task": {"ttl": 1000, "pollInterval": 10}}
    )
    assert status == 200
    assert message["result"]["resultType"] == "complete"


async def test_required_tool_and_a_non_declaring_client_is_rejected(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(counted={"mode": "required"}))
    status, message = await client.call("counted", {"key": "rejected"}, capabilities={})
    assert status == 400  # a task-only tool and a client without the extension: -32021 naming it
    assert message["error"]["code"] == -32021
    assert message["error"]["data"]["requiredCapabilities"] == {"extensions": {TASKS: {}}}
    assert await client.text("call_count", {"key": "rejected"}) == "0"


async def test_required_tool_with_undeclared_wait_answers_synchronously(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks={**policies(counted={"mode": "required"}), "undeclared_required": "wait"})
    status, message = await client.call("counted", {"key": "waited", "seconds": 0.5}, capabilities={})
    assert status == 200
    assert message["result"]["resultType"] == "complete"
    assert message["result"]["content"][0]["text"] == "1"
    status, failing = await client.call("raise_error", {"message": "boom", "code": -32000}, capabilities={})
    assert status == 200  # raise_error follows the default policy (optional): a plain sync call
    assert failing["error"]["code"] == -32000


async def test_wait_holds_the_response_with_keepalive_comments(
    tasks_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(starting_module, "KEEPALIVE_SECONDS", 0.2)
    client = await tasks_client(tasks={**policies(counted={"mode": "required"}), "undeclared_required": "wait"})
    response = await client.client.post(
        "/mcp",
        json=modern_body("tools/call", {"name": "counted", "arguments": {"key": "keepalive", "seconds": 1.0}}),
        headers=modern_headers("tools/call", "counted"),
    )
    assert response.headers["Content-Type"].startswith("text/event-stream")
    text = await response.text()
    assert text.startswith(":")  # SSE comments kept the stream alive before the answer
    [message] = parse_sse(text)
    client.core.check(message, "tools/call")
    assert message["result"]["content"][0]["text"] == "1"


def sse_events(text: str) -> tuple[list[dict[str, Any]], int]:
    """The messages of an SSE body and how many keep-alive comments it has; fails on an event that is not a
    whole JSON message or that has a comment inside it."""
    messages: list[dict[str, Any]] = []
    comments = 0
    blocks = text.replace("\r\n", "\n").split("\n\n")
    assert blocks[-1] == ""  # the body ends with a complete event
    for block in blocks[:-1]:
        lines = block.split("\n")
        if all(line.startswith(":") for line in lines):
            comments += 1
            continue
        assert not any(line.startswith(":") for line in lines), f"a comment inside an event: {block!r}"
        assert all(line.split(":", 1)[0] in ("event", "data", "id") for line in lines), block
        messages.append(json.loads("\n".join(line[5:].lstrip(" ") for line in lines if line.startswith("data:"))))
    return messages, comments


async def test_keepalive_comments_and_progress_share_the_stream_event_by_event(
    tasks_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll-to-sync call that reports progress, with keep-alive comments due far more often than progress:
    the body is whole events and whole comments, never one inside the other, and the answer is last."""
    monkeypatch.setattr(starting_module, "KEEPALIVE_SECONDS", 0.01)
    client = await tasks_client(tasks={**policies(sleep={"mode": "required"}), "undeclared_required": "wait"})
    response = await client.client.post(
        "/mcp",
        json=modern_body(
            "tools/call", {"name": "sleep", "arguments": {"seconds": 0.6, "pad": 2000}}, progressToken="p"
        ),
        headers=modern_headers("tools/call", "sleep"),
    )
    assert response.headers["Content-Type"].startswith("text/event-stream")
    messages, comments = sse_events(await response.text())
    assert comments >= 1
    *progress, answer = messages
    assert progress
    assert all(message["method"] == "notifications/progress" for message in progress)
    assert all(message["params"]["progressToken"] == "p" for message in progress)
    client.core.check(answer, "tools/call")
    assert answer["result"]["content"][0]["text"] == "slept 0.6"


class Piecewise:
    """A Channel whose stream takes each event in two writes, with a wait between (a client reading slowly):
    what lands between the two halves of an event lands inside it."""

    def __init__(self) -> None:
        self.body: list[str] = []

    async def notify(self, message: dict[str, Any], *, required: bool = False) -> None:
        event = f"event: message\ndata: {json.dumps(message)}\n\n"
        half = len(event) // 2
        for piece in (event[:half], event[half:]):
            self.body.append(piece)
            await asyncio.sleep(0.02)

    async def keepalive(self, *, open_stream: bool = False) -> None:
        self.body.append(": keep-alive\n\n")


async def test_a_keepalive_never_lands_inside_an_event_written_in_pieces(
    tasks_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep-alive comments go through the call's one writer, after the event being written, not into it; every
    notification is written before the answer comes back."""
    monkeypatch.setattr(starting_module, "KEEPALIVE_SECONDS", 0.005)
    client = await tasks_client(tasks={**policies(sleep={"mode": "required"}), "undeclared_required": "wait"})
    app = client.client.app
    params = {
        "name": "sleep",
        "arguments": {"seconds": 0.5},
        "_meta": modern_body("x", progressToken="p")["params"]["_meta"],
    }
    request = validate_modern(modern_headers("tools/call", "sleep"), 1, "tools/call", params)
    decision = decide(app[CONFIG].tasks, "sleep", declares_tasks=False)
    channel = Piecewise()
    outgoing = UpstreamRequest.of(request, Caller())
    message = await app[FRONT].tasks.call(outgoing, Caller(), channel, decision, None, app[CONFIG])
    assert message["result"]["content"][0]["text"] == "slept 0.5"
    messages, comments = sse_events("".join(channel.body))
    assert comments >= 1
    assert messages
    assert all(message["method"] == "notifications/progress" for message in messages)


async def test_wait_client_disconnect_cancels_the_upstream_call(
    tasks_client: ClientFactory, own_upstream: Upstream
) -> None:
    client = await tasks_client(
        own_upstream.url, tasks={**policies(sleep={"mode": "required"}), "undeclared_required": "wait"}
    )
    await post_and_leave(
        client.client,
        modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 30}}),
        modern_headers("tools/call", "sleep"),
        own_upstream.url,
    )
    await wait_for_upstream_cancellation(client)
    stats = await client.client.app[STORE].operators.stats()
    assert stats["cancelled"] == 1


async def test_leaving_during_the_window_cancels_the_call_and_stores_nothing(
    tasks_client: ClientFactory, own_upstream: Upstream
) -> None:
    """A closed stream inside the sync window: the call is still synchronous, so a disconnect cancels it upstream."""
    client = await tasks_client(own_upstream.url, tasks=policies(sleep={"mode": "optional", "sync_window_ms": 5000}))
    await post_and_leave(
        client.client,
        modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 30}}, capabilities=DECLARING),
        modern_headers("tools/call", "sleep"),
        own_upstream.url,
    )
    await wait_for_upstream_cancellation(client)
    assert (await client.client.app[STORE].operators.stats())["records"] == 0


class Silent:
    """A Channel for a caller with no stream (what a client without SSE gets)."""

    async def notify(self, message: dict[str, Any], *, required: bool = False) -> None:
        return None

    async def keepalive(self, *, open_stream: bool = False) -> None:
        return None


async def test_a_client_leaving_during_creation_leaves_no_orphan_record(tasks_client: ClientFactory) -> None:
    """The commit and the start of the call are one step: a record is never left `working` without a call."""
    client = await tasks_client(tasks=policies(counted={"mode": "required"}))
    app = client.client.app
    params = {
        "name": "counted",
        "arguments": {"key": "orphan"},
        "_meta": modern_body("x", capabilities=DECLARING)["params"]["_meta"],
    }
    request = validate_modern(modern_headers("tools/call", "counted"), 1, "tools/call", params)
    decision = decide(app[CONFIG].tasks, "counted", declares_tasks=True)
    await client.text("echo", {"text": "warm"})  # the upstream session exists
    creating = asyncio.get_running_loop().create_task(
        app[FRONT].tasks.call(UpstreamRequest.of(request, Caller()), Caller(), Silent(), decision, None, app[CONFIG])
    )
    await asyncio.sleep(0)  # creation has begun
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating

    async def completed() -> bool:
        return bool((await app[STORE].operators.stats())["completed"] == 1)

    await until(completed, "the orphaned call's task never completed")
    assert await client.text("call_count", {"key": "orphan"}) == "1"


async def wait_for_upstream_cancellation(client: Tasks, count: int = 1) -> None:

    async def seen() -> bool:
        return len(json.loads(await client.text("cancelled_requests", {}))) >= count

    await until(seen, "the upstream never saw notifications/cancelled")


# --- outcomes: a tool error completes, a JSON-RPC error fails -------------------------------------------


async def test_outcomes_settle_the_task(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks={"default": {"mode": "required"}})
    ok, tool_error, rpc_error = (
        await client.create("echo", {"text": "done"}),
        await client.create("tool_error", {"message": "bad input"}),
        await client.create("raise_error", {"message": "no such thing", "code": -32000}),
    )
    completed = await client.settled(ok)
    assert completed["status"] == "completed"
    assert result_text(completed) == "done"
    errored = await client.settled(tool_error)
    assert errored["status"] == "completed"  # isError is a result, not a failure
    assert errored["result"]["isError"] is True
    failed = await client.settled(rpc_error)
    assert failed["status"] == "failed"  # a JSON-RPC error fails the task and becomes its `error`
    assert failed["error"] == {"code": -32000, "message": "no such thing"}
    assert "no such thing" in failed["statusMessage"]  # a diagnostic statusMessage
    assert "result" not in failed


async def test_progress_becomes_the_status_message(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 1.5})
    task = await client.until(task_id, lambda task: "statusMessage" in task)
    assert task["status"] == "working"
    assert "/1.5 — slept" in task["statusMessage"]
    assert (await client.settled(task_id))["status"] == "completed"


async def test_trace_context_and_principal_reach_the_upstream_from_a_task(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(whoami={"mode": "required"}))
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    task_id = await client.create("whoami", headers={"traceparent": traceparent, "Authorization": "Bearer traced"})

    async def completed() -> dict[str, Any] | None:
        _, message = await client.get(task_id, headers={"Authorization": "Bearer traced"})
        return message if message["result"]["status"] == "completed" else None

    message = await until(completed, "the task never completed")
    seen = json.loads(result_text(message["result"]))
    assert seen == {"authorization": "Bearer traced", "traceparent": traceparent}


async def test_lost_upstream_fails_the_task(tasks_client: ClientFactory, own_upstream: Upstream) -> None:
    client = await tasks_client(own_upstream.url, tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 30})
    await client.until(task_id, lambda task: "statusMessage" in task)
    own_upstream.stop()
    failed = await client.settled(task_id)
    assert failed["status"] == "failed"  # a lost upstream is a failure, never `completed`
    assert failed["error"]["code"] == -32603
    assert "Upstream" in failed["error"]["message"]


# --- tasks/get, tasks/update, tasks/cancel ------------------------------------------------------------


async def test_cancel_reaches_the_upstream_and_is_final(tasks_client: ClientFactory, own_upstream: Upstream) -> None:
    client = await tasks_client(own_upstream.url, tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 30})
    await upstream_calls_open(client.client, 1)
    status, ack = await client.post("tasks/cancel", {"taskId": task_id})
    assert status == 200
    assert ack["result"] == {"resultType": "complete", "_meta": ack["result"]["_meta"]}
    cancelled = await client.task(task_id)
    assert cancelled["status"] == "cancelled"
    await wait_for_upstream_cancellation(client)
    status, again = await client.post("tasks/cancel", {"taskId": task_id})  # terminal → acked all the same
    assert status == 200
    assert again["result"]["resultType"] == "complete"
    assert (await client.task(task_id))["status"] == "cancelled"  # a terminal status never changes


@pytest.fixture
def json_upstream() -> Iterator[Upstream]:
    """An upstream that answers tools/call with one JSON body when the tool ends (no SSE): the proxy's POST
    is still in flight for the whole call."""
    server = Upstream("--json-response")
    server.start()
    yield server
    server.stop()


async def test_cancel_while_the_upstream_post_is_in_flight_still_reaches_it(
    tasks_client: ClientFactory, json_upstream: Upstream
) -> None:
    """Regression: a call abandoned before the upstream's response headers arrived was never cancelled."""
    client = await tasks_client(json_upstream.url, tasks=policies(counted={"mode": "required"}))
    task_id = await client.create("counted", {"key": "in-flight", "seconds": 30})

    async def running() -> bool:  # the upstream is running it
        return await client.text("call_count", {"key": "in-flight"}) == "1"

    await until(running, "the upstream never ran the call")
    await client.post("tasks/cancel", {"taskId": task_id})
    await wait_for_upstream_cancellation(client)


async def test_task_methods_gate_capability_before_lookup(tasks_client: ClientFactory) -> None:
    client = await tasks_client()
    for method, params in (
        ("tasks/get", {"taskId": "nope"}),
        ("tasks/update", {"taskId": "nope", "inputResponses": {}}),
        ("tasks/cancel", {"taskId": "nope"}),
    ):
        status, message = await client.post(method, params, capabilities={})
        assert status == 400, method  # the capability gate comes before the lookup
        assert message["error"]["code"] == -32021
        assert message["error"]["data"]["requiredCapabilities"] == {"extensions": {TASKS: {}}}
        status, message = await client.post(method, params)
        assert message["error"]["code"] == -32602, method  # an unknown id, on every task method
        assert message["error"]["message"] == "Failed to retrieve task: Task not found"


async def test_removed_task_methods_are_not_found(tasks_client: ClientFactory) -> None:
    client = await tasks_client()
    for method in ("tasks/result", "tasks/list"):
        status, message = await client.post(method, {"taskId": "x"} if method == "tasks/result" else {})
        assert status == 404  # removed with the Tasks extension: unknown methods
        assert message["error"]["code"] == -32601


async def test_mcp_name_must_match_the_task_id(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required"}))
    task_id = await client.create("echo", {"text": "x"})
    status, message = await client.get(task_id, headers={"Mcp-Name": "someone-else"})
    assert status == 400  # Mcp-Name must equal params.taskId
    assert message["error"]["code"] == -32020
    response = await client.client.post(
        "/mcp",
        json=modern_body("tasks/get", {"taskId": task_id}, capabilities=DECLARING),
        headers=modern_headers("tasks/get"),  # no Mcp-Name: tolerated (the proxy's choice; the spec is silent)
    )
    assert response.status == 200


async def test_update_acks_and_ignores_unknown_keys(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required"}))
    task_id = await client.create("echo", {"text": "x"})
    status, ack = await client.post(
        "tasks/update", {"taskId": task_id, "inputResponses": {"never-issued": {"action": "accept"}}}
    )
    assert status == 200  # keys that are not outstanding are ignored, and acked
    assert ack["result"]["resultType"] == "complete"
    status, bad = await client.post("tasks/update", {"taskId": task_id})
    assert status == 400
    assert bad["error"]["code"] == -32602
    assert (await client.settled(task_id))["status"] == "completed"


async def test_a_foreign_principal_sees_what_an_unknown_id_gets(tasks_client: ClientFactory) -> None:
    """No existence oracle: another principal's task gets the unknown-id answer; tasks are bound to the
    principal's hash."""
    client = await tasks_client(tasks=policies(echo={"mode": "required"}))
    task_id = await client.create("echo", {"text": "mine"}, headers={"Authorization": "Bearer alice"})
    status, own = await client.get(task_id, headers={"Authorization": "Bearer alice"})
    assert status == 200
    assert own["result"]["taskId"] == task_id
    _, foreign = await client.get(task_id, headers={"Authorization": "Bearer mallory"})
    _, anonymous = await client.get(task_id)
    _, unknown = await client.get("task_doesnotexist", headers={"Authorization": "Bearer mallory"})
    assert foreign["error"] == unknown["error"] == anonymous["error"]
    _, cancel = await client.post("tasks/cancel", {"taskId": task_id}, headers={"Authorization": "Bearer mallory"})
    assert cancel["error"] == unknown["error"]
    store = client.client.app[STORE]
    assert isinstance(store, SqliteTaskStore)
    database = sqlite3.connect(store.path)
    principals = [row[0] for row in database.execute("SELECT principal FROM tasks")]
    database.close()
    assert principals
    assert all("alice" not in principal for principal in principals)  # stored hashed


async def test_task_ids_are_unguessable(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required"}))
    ids = {await client.create("echo", {"text": str(n)}) for n in range(5)}
    assert len(ids) == 5
    for task_id in ids:
        assert len(task_id.removeprefix("task_")) >= 32  # 192 bits, base64url: not guessable
        assert task_id.isascii()


# --- TTL, limits, retention -----------------------------------------------------------------------------


async def test_ttl_expiry_fails_a_live_task_then_forgets_it(
    tasks_client: ClientFactory, own_upstream: Upstream
) -> None:
    client = await tasks_client(own_upstream.url, tasks=policies(sleep={"mode": "required", "ttl_ms": 1500}))
    task_id = await client.create("sleep", {"seconds": 30})
    early = await client.task(task_id)
    assert early["status"] == "working"  # never expired before its TTL
    assert early["ttlMs"] == 1500
    expired = await client.until(task_id, lambda task: task["status"] != "working", timeout_seconds=10)
    assert expired["status"] == "failed"
    assert "expired" in expired["error"]["message"]
    await wait_for_upstream_cancellation(client)  # the call was stopped
    _, gone = await client.get(task_id)
    assert gone["error"]["code"] == -32602  # past its TTL a settled task is gone (unknown id)


async def test_settled_task_stays_readable_for_its_ttl_then_goes(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required", "ttl_ms": 2000}))
    task_id = await client.create("echo", {"text": "x"})
    assert (await client.settled(task_id))["status"] == "completed"

    async def gone() -> dict[str, Any] | None:
        _, message = await client.get(task_id)
        if "error" in message:
            return message
        assert message["result"]["status"] == "completed"
        return None

    message = await until(gone, "the task outlived its ttl")
    assert message["error"]["code"] == -32602
    assert await client.client.app[STORE].records.get(task_id) is None  # purged from the file too


async def test_null_ttl_means_unlimited(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required", "ttl_ms": None}))
    task_id = await client.create("echo", {"text": "x"})
    assert (await client.task(task_id))["ttlMs"] is None  # the key is present, null = unlimited


async def test_max_running_refuses_before_writing(tasks_client: ClientFactory, own_upstream: Upstream) -> None:
    client = await tasks_client(own_upstream.url, tasks={**policies(sleep={"mode": "required"}), "max_running": 1})
    first = await client.create("sleep", {"seconds": 30})
    status, refused = await client.call("sleep", {"seconds": 30})
    assert status == 503
    assert refused["error"]["code"] == -32603
    assert refused["error"]["data"] == {"limit": "max_running", "max": 1}
    assert (await client.client.app[STORE].operators.stats())["records"] == 1
    await client.post("tasks/cancel", {"taskId": first})
    second = await client.create("sleep", {"seconds": 0.1})  # the slot is free again
    assert (await client.settled(second))["status"] == "completed"


async def test_max_records_evicts_settled_records_first(tasks_client: ClientFactory, own_upstream: Upstream) -> None:
    client = await tasks_client(
        own_upstream.url, tasks={**policies(echo={"mode": "required"}, sleep={"mode": "required"}), "max_records": 2}
    )
    oldest = await client.create("echo", {"text": "1"})
    await client.settled(oldest)
    live = await client.create("sleep", {"seconds": 30})
    newest = await client.create("echo", {"text": "2"})  # evicts `oldest`, the only settled record
    _, gone = await client.get(oldest)
    assert gone["error"]["code"] == -32602
    assert (await client.task(live))["status"] == "working"
    await client.settled(newest)
    other_live = await client.create("sleep", {"seconds": 30})  # evicts `newest`
    status, refused = await client.call("sleep", {"seconds": 30})  # every record is live now
    assert status == 503
    assert refused["error"]["data"] == {"limit": "max_records", "max": 2}
    for task_id in (live, other_live):
        await client.post("tasks/cancel", {"taskId": task_id})


# --- restart recovery -----------------------------------------------------------------------------------


async def test_restart_fails_or_reruns_interrupted_tasks(
    make_proxy: Callable[..., Any],
    own_upstream: Upstream,
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
    tmp_path: Path,
) -> None:
    sections = {
        "store": {"path": str(tmp_path / "restart.db")},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(
            sleep={"mode": "required"},
            counted={"mode": "required", "on_restart": "rerun"},
            echo={"mode": "required", "ttl_ms": None},
        ),
    }
    first = Tasks(await make_proxy(own_upstream.url, **sections), modern_schema, tasks_schema)
    done = await first.create("echo", {"text": "kept"})
    await first.settled(done)
    interrupted = await first.create("sleep", {"seconds": 30}, headers={"Authorization": "Bearer a"})
    rerun = await first.create("counted", {"key": "rerun", "seconds": 1.0}, headers={"Authorization": "Bearer a"})
    await upstream_calls_open(first.client, 2)
    await first.client.close()  # the process goes away with both calls still running

    second = Tasks(await make_proxy(own_upstream.url, **sections), modern_schema, tasks_schema)
    failed = await second.task(interrupted, headers={"Authorization": "Bearer a"})
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == -32603
    assert "restarted" in failed["error"]["message"]
    assert "restarted" in failed["statusMessage"]
    status, message = await second.get(rerun, headers={"Authorization": "Bearer a"})
    assert status == 200

    async def rerun_completed() -> dict[str, Any] | None:
        _, message = await second.get(rerun, headers={"Authorization": "Bearer a"})
        return message if message["result"]["status"] == "completed" else None

    message = await until(rerun_completed, "the re-run task never completed", 15)
    assert result_text(message["result"]) == "2"  # the call was sent again
    kept = await second.task(done)
    assert kept["status"] == "completed"  # nothing committed is lost
    assert result_text(kept) == "kept"
    database = sqlite3.connect(tmp_path / "restart.db")
    assert database.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert database.execute("SELECT rerun_principal FROM tasks WHERE task_id = ?", (rerun,)).fetchone() == (None,)
    database.close()


async def test_a_second_proxy_cannot_open_a_database_in_use(
    make_proxy: Callable[..., Any], upstream: Upstream, tmp_path: Path
) -> None:
    sections = {"store": {"path": str(tmp_path / "shared.db")}}
    await make_proxy(upstream.url, **sections)
    with pytest.raises(Exception, match="in use"):
        await make_proxy(upstream.url, **sections)


async def test_poll_interval_follows_how_long_the_tool_usually_takes(tasks_client: ClientFactory) -> None:
    """Once a tool has completed, its next task suggests polling just after its expected end instead of the
    policy's slower pace; the stored policy value is unchanged."""
    client = await tasks_client(tasks=policies(sleep={"mode": "required", "poll_interval_ms": 3000}))
    _, message = await client.call("sleep", {"seconds": 0.3})
    first = message["result"]
    assert first["pollIntervalMs"] == 3000  # nothing known yet
    await client.settled(first["taskId"])
    _, message = await client.call("sleep", {"seconds": 0.3})
    second = message["result"]
    assert 300 <= second["pollIntervalMs"] < 1000, second
    task = await client.task(second["taskId"])
    assert task["status"] != "working" or task["pollIntervalMs"] <= second["pollIntervalMs"]
    done = await client.settled(second["taskId"])
    assert "pollIntervalMs" not in done or done["pollIntervalMs"] == 3000  # settled: the policy's value
