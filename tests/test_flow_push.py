"""End to end: task status pushed on `subscriptions/listen` (`taskIds` → `notifications/tasks`).

A declaring client follows its tasks; each change reaches it as the complete task, as `tasks/get` returns it,
soon after it happened. Polling keeps working beside it. Real fixture upstream, real SQLite file; every
notification validated against the Tasks extension's schema.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from tests.support.clients import ClientFactory, Tasks
from tests.support.schemas import SchemaValidator
from tests.support.wire import DECLARING, SUBSCRIPTION_ID, modern_body, modern_headers, policies, sse_messages

ELICIT_TASKS: dict[str, Any] = {**DECLARING, "elicitation": {}}
ARRIVAL_BOUND_MS = 100


async def follow(
    client: Tasks, task_ids: list[str], request_id: str = "P1", **headers: str
) -> AsyncIterator[dict[str, Any]]:
    body = modern_body(
        "subscriptions/listen",
        {"notifications": {"taskIds": task_ids}},
        request_id=request_id,
        capabilities=ELICIT_TASKS,
    )
    response = await client.client.post(
        "/mcp", json=body, headers={**modern_headers("subscriptions/listen"), **headers}
    )
    assert response.status == 200
    return sse_messages(response)


async def next_task(stream: AsyncIterator[dict[str, Any]], wait_seconds: float = 15) -> tuple[dict[str, Any], float]:
    message = await asyncio.wait_for(anext(stream), wait_seconds)
    return message, time.time() * 1000


def updated_ms(task: dict[str, Any]) -> float:
    return datetime.fromisoformat(task["lastUpdatedAt"].replace("Z", "+00:00")).timestamp() * 1000


def comparable(task: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in task.items() if key not in ("_meta", "resultType")}


async def test_followed_tasks_are_pushed_as_tasks_get_returns_them(
    tasks_client: ClientFactory, tasks_schema: SchemaValidator
) -> None:
    client = await tasks_client(
        tasks=policies(sleep={"mode": "required"}, ask_name={"mode": "required"}), inputs={"gather_ms": 0}
    )
    completes = await client.create("sleep", {"seconds": 1}, capabilities=ELICIT_TASKS)
    asks = await client.create("ask_name", capabilities=ELICIT_TASKS)
    cancelled = await client.create("sleep", {"seconds": 30}, capabilities=ELICIT_TASKS)
    stream = await follow(client, [completes, asks, cancelled, "task_unknown"])
    ack, _ = await next_task(stream)
    assert ack["method"] == "notifications/subscriptions/acknowledged"
    assert sorted(ack["params"]["notifications"]["taskIds"]) == sorted([completes, asks, cancelled])

    seen: dict[str, list[str]] = {completes: [], asks: [], cancelled: []}
    answered = cancel_sent = False
    while not (
        seen[completes][-1:] == ["completed"]
        and seen[asks][-1:] == ["completed"]
        and seen[cancelled][-1:] == ["cancelled"]
    ):
        message, arrived_ms = await next_task(stream)
        assert message["method"] == "notifications/tasks"
        tasks_schema.validate(message, "TaskStatusNotification")
        task = message["params"]
        assert task["_meta"][SUBSCRIPTION_ID] == "P1"
        assert arrived_ms - updated_ms(task) < ARRIVAL_BOUND_MS, task
        seen[task["taskId"]].append(task["status"])
        if task["status"] in ("completed", "failed", "cancelled", "input_required"):
            polled = await client.task(task["taskId"])  # what tasks/get says at that moment
            assert comparable(polled) == comparable(task)
        if task["taskId"] == asks and task["status"] == "input_required" and not answered:
            answered = True
            [key] = task["inputRequests"]
            answer = {key: {"action": "accept", "content": {"name": "Pushed"}}}
            await client.post("tasks/update", {"taskId": asks, "inputResponses": answer})
        if not cancel_sent:
            cancel_sent = True
            await client.post("tasks/cancel", {"taskId": cancelled})
    assert "input_required" in seen[asks]
    assert (await client.task(asks))["result"]["content"][0]["text"] == "Hello, Pushed"


async def test_a_settled_task_is_pushed_once_at_once_and_foreign_ids_are_left_out(
    tasks_client: ClientFactory, tasks_schema: SchemaValidator
) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required"}))
    mine = await client.create("echo", {"text": "done"}, headers={"Authorization": "Bearer me"})
    theirs = await client.create("echo", {"text": "theirs"}, headers={"Authorization": "Bearer them"})
    await client.until(mine, lambda task: task["status"] == "completed", headers={"Authorization": "Bearer me"})
    stream = await follow(client, [mine, theirs], Authorization="Bearer me")
    ack, _ = await next_task(stream)
    assert ack["params"]["notifications"]["taskIds"] == [mine]  # the foreign id, like an unknown one: not there
    message, _ = await next_task(stream)
    tasks_schema.validate(message, "TaskStatusNotification")
    assert (message["params"]["taskId"], message["params"]["status"]) == (mine, "completed")
    assert message["params"]["result"]["content"][0]["text"] == "done"
    try:
        extra, _ = await next_task(stream, wait_seconds=0.5)
    except TimeoutError:
        extra = None
    assert extra is None  # once, and nothing for the foreign task


async def test_progress_bursts_are_coalesced(tasks_client: ClientFactory) -> None:
    """The fixture reports progress every 100 ms: the stream carries at most one progress change per 200 ms."""
    client = await tasks_client(tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 2})
    stream = await follow(client, [task_id])
    await next_task(stream)  # the acknowledgement
    arrivals: list[float] = []
    while True:
        message, arrived_ms = await next_task(stream)
        if message["params"]["status"] != "working":
            break
        arrivals.append(arrived_ms)
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert arrivals, "progress was pushed"
    assert all(gap >= 180 for gap in gaps), gaps
    assert message["params"]["status"] == "completed"
