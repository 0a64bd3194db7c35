"""End to end: the Events extension (SEP-3415) in front of the real fixture upstream, on a real SQLite store.

A task's end reaches its owner by `events/poll` (resumable by cursor, no loss or repeat), by `events/stream`, and
by a signed webhook to a real receiver on loopback that verifies every delivery with `standardwebhooks`; another
caller can reach none of it; retries keep the `webhook-id`; a 410 is not retried; callbacks on private
addresses are refused by default. With `events.enabled` off nothing of it is advertised or answered.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.clients import TERMINAL, ClientFactory, Tasks
from tests.support.events import Receiver, open_stream, rpc
from tests.support.waiting import until
from tests.support.wire import policies

EXTENSION = "io.modelcontextprotocol/events"
SUB_META = "io.modelcontextprotocol/subscriptionId"
SLEEP_TASKS = policies(sleep={"mode": "required"}, echo={"mode": "required"})
LOOPBACK_WEBHOOKS = {
    "enabled": True,
    "heartbeat_seconds": 1,
    "webhooks": {"allow_insecure_callbacks": True, "allow_private_callbacks": True, "retry_seconds": [0.3, 0.3, 0.3]},
}


async def events_proxy(tasks_client: ClientFactory, events: dict[str, Any] | None = None) -> Tasks:
    return await tasks_client(tasks=SLEEP_TASKS, events=events if events is not None else LOOPBACK_WEBHOOKS)


async def create(client: Tasks, principal: str, seconds: float = 0.3) -> str:
    return await client.create("sleep", {"seconds": seconds}, headers={"Authorization": f"Bearer {principal}"})


async def settled(client: Tasks, task_id: str, principal: str = "alice") -> dict[str, Any]:
    return await client.until(
        task_id, lambda task: task["status"] in TERMINAL, headers={"Authorization": f"Bearer {principal}"}
    )


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    await found.start()
    yield found
    await found.stop()


async def test_off_by_default_nothing_is_advertised_or_answered(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SLEEP_TASKS)
    status, discovered = await rpc(client.client, "server/discover", {})
    assert status == 200
    assert EXTENSION not in discovered["result"]["capabilities"]["extensions"]
    assert "events" not in discovered["result"]["capabilities"]
    for method in ("events/list", "events/poll", "events/subscribe"):
        status, message = await rpc(client.client, method, {"name": "task.status"})
        assert (status, message["error"]["code"]) == (404, -32601)


async def test_the_extension_is_advertised_and_lists_the_task_status_event(tasks_client: ClientFactory) -> None:
    client = await events_proxy(tasks_client, {"enabled": True, "compat": {"top_level_capability": True}})
    _, discovered = await rpc(client.client, "server/discover", {})
    capabilities = discovered["result"]["capabilities"]
    assert capabilities["extensions"][EXTENSION] == {}
    assert capabilities["events"] == {}  # the compatibility switch
    status, listed = await rpc(client.client, "events/list", {})
    assert status == 200
    offered = {found["name"]: found for found in listed["result"]["events"]}
    assert {"task.status", "resource.updated", "tools.list_changed", "prompts.list_changed"} <= set(offered)
    assert offered["resource.updated"]["inputSchema"]["required"] == ["uri"]
    event_type = offered["task.status"]
    assert sorted(event_type["delivery"]) == ["poll", "push", "webhook"]
    assert "taskId" in event_type["inputSchema"]["properties"]
    assert "result" not in event_type["payloadSchema"]["properties"]
    _, unknown = await rpc(client.client, "events/poll", {"name": "no.such", "arguments": {}})
    assert unknown["error"]["code"] == -32023


async def poll(client: Tasks, cursor: str | None, principal: str = "alice", **params: Any) -> dict[str, Any]:
    status, message = await rpc(
        client.client, "events/poll", {"name": "task.status", "cursor": cursor, **params}, principal=principal
    )
    assert status == 200, message
    result: dict[str, Any] = message["result"]
    return result


async def test_poll_resumes_from_its_cursor_without_losing_or_repeating_an_event(tasks_client: ClientFactory) -> None:
    client = await events_proxy(tasks_client)
    start = await poll(client, None)
    assert (start["events"], start["hasMore"], start["truncated"]) == ([], False, False)
    first = await create(client, "alice")
    await create(client, "bob")  # another caller's: never in alice's events
    seen: list[dict[str, Any]] = []
    cursor = start["cursor"]

    async def ended() -> bool:
        nonlocal cursor
        page = await poll(client, cursor, maxEvents=1)
        seen.extend(page["events"])
        cursor = page["cursor"]  # the client persists it and "disconnects" between polls
        return any(event["data"]["status"] == "completed" for event in seen)

    await until(ended, "the task's end never reached the poll", 15)
    assert [event["data"]["taskId"] for event in seen] == [first]
    event = seen[0]
    assert set(event) == {"eventId", "name", "timestamp", "data"}
    assert "result" not in event["data"]
    assert event["data"]["status"] == "completed"
    second = await create(client, "alice")
    await settled(client, second)
    later = await poll(client, cursor)
    assert [event["data"]["taskId"] for event in later["events"]] == [second]  # nothing again, nothing lost
    assert (await poll(client, later["cursor"]))["events"] == []


async def test_a_task_cancelled_by_its_owner_reaches_the_poll_as_cancelled(tasks_client: ClientFactory) -> None:
    """`tasks/cancel` settles through the running call's own machine; its end is logged like any other."""
    client = await events_proxy(tasks_client)
    start = await poll(client, None)
    task_id = await create(client, "alice", seconds=30)
    status, ack = await client.post("tasks/cancel", {"taskId": task_id}, headers={"Authorization": "Bearer alice"})
    assert status == 200, ack
    assert (await settled(client, task_id))["status"] == "cancelled"
    page = await poll(client, start["cursor"])
    assert [(event["data"]["taskId"], event["data"]["status"]) for event in page["events"]] == [(task_id, "cancelled")]


async def test_a_task_that_already_ended_delivers_its_end_at_once_and_only_to_its_owner(
    tasks_client: ClientFactory,
) -> None:
    client = await events_proxy(tasks_client)
    task_id = await create(client, "alice", 0.1)
    await settled(client, task_id)
    page = await poll(client, None, arguments={"taskId": task_id})
    assert [(event["data"]["taskId"], event["data"]["status"]) for event in page["events"]] == [(task_id, "completed")]
    for method, params in (
        ("events/poll", {"cursor": None}),
        ("events/stream", {}),
        ("events/subscribe", {"delivery": {"url": "https://receiver.example/hook", "secret": "whsec_" + "A" * 40}}),
    ):
        _, foreign = await rpc(
            client.client,
            method,
            {"name": "task.status", "arguments": {"taskId": task_id}, **params},
            principal="mallory",
        )
        _, unknown = await rpc(
            client.client,
            method,
            {"name": "task.status", "arguments": {"taskId": "task_nope"}, **params},
            principal="mallory",
        )
        assert foreign["error"] == unknown["error"]
        assert foreign["error"]["code"] == -32023


async def test_a_stream_confirms_then_pushes_the_same_events_and_heartbeats_its_cursor(
    tasks_client: ClientFactory,
) -> None:
    client = await events_proxy(tasks_client)
    response, stream = await open_stream(client.client, {"name": "task.status", "arguments": {}, "cursor": None})
    assert response.status == 200
    active = await asyncio.wait_for(anext(stream), 10)
    assert active["method"] == "notifications/events/active"
    assert active["params"]["_meta"][SUB_META] == "S1"
    assert active["params"]["truncated"] is False
    task_id = await create(client, "alice")
    kinds: list[str] = []
    event: dict[str, Any] = {}
    deadline = time.monotonic() + 15
    while not event and time.monotonic() < deadline:
        message = await asyncio.wait_for(anext(stream), 10)
        kinds.append(message["method"])
        assert message["params"]["_meta"][SUB_META] == "S1"
        if message["method"] == "notifications/events/event":
            event = message["params"]
    assert event["data"] == {**event["data"], "taskId": task_id, "status": "completed"}
    heartbeat = await asyncio.wait_for(anext(stream), 10)
    assert heartbeat["method"] == "notifications/events/heartbeat"
    assert heartbeat["params"]["cursor"] == event["cursor"]  # nothing after the event: the position holds
    response.close()
    replay = await poll(client, active["params"]["cursor"])  # a poll from the stream's start sees the same
    assert [found["eventId"] for found in replay["events"]] == [event["eventId"]]


async def subscribe(
    client: Tasks, receiver: Receiver, principal: str | None = "alice", **params: Any
) -> tuple[int, dict[str, Any]]:
    body = {
        "name": "task.status",
        "arguments": {},
        "delivery": {"mode": "webhook", "url": receiver.url, "secret": receiver.secret},
        **params,
    }
    return await rpc(client.client, "events/subscribe", body, principal=principal)


async def test_a_webhook_gets_one_signed_delivery_of_a_tasks_end_within_five_seconds(
    tasks_client: ClientFactory, receiver: Receiver
) -> None:
    client = await events_proxy(tasks_client)
    status, subscribed = await subscribe(client, receiver)
    assert status == 200, subscribed
    result = subscribed["result"]
    assert result["id"].startswith("sub_")
    assert result["truncated"] is False
    assert "refreshBefore" in result
    assert len(receiver.challenges) == 1
    assert receiver.challenges[0].verified
    task_id = await create(client, "alice")
    task = await settled(client, task_id)
    await until(lambda: bool(receiver.deliveries), "no delivery arrived", 10)
    ended_at = time.time()
    delivered = receiver.deliveries[0]
    assert delivered.verified  # standardwebhooks verified it
    assert delivered.headers["X-MCP-Subscription-Id"] == result["id"]
    body = receiver.events()[0]
    assert delivered.headers["webhook-id"] == body["eventId"]
    assert (body["data"]["taskId"], body["data"]["status"]) == (task_id, "completed")
    assert "result" not in body["data"]
    assert "result" in task
    assert delivered.at - ended_at < 5
    await asyncio.sleep(1)  # nothing more comes: exactly one logical delivery
    assert len(receiver.deliveries) == 1
    refreshed_status, refreshed = await subscribe(client, receiver)  # a refresh: same id, no second challenge
    assert (refreshed_status, refreshed["result"]["id"]) == (200, result["id"])
    assert refreshed["result"]["deliveryStatus"]["active"] is True
    assert len(receiver.challenges) == 1
    _, gone = await rpc(
        client.client, "events/unsubscribe", {"name": "task.status", "arguments": {}, "delivery": {"url": receiver.url}}
    )
    assert gone["result"] == {"resultType": "complete"}
    _, again = await rpc(
        client.client, "events/unsubscribe", {"name": "task.status", "arguments": {}, "delivery": {"url": receiver.url}}
    )
    assert again["error"]["code"] == -32023


async def test_a_receiver_answering_500_twice_gets_it_on_the_third_try_with_the_same_webhook_id(
    tasks_client: ClientFactory, receiver: Receiver
) -> None:
    receiver.statuses = [500, 500, 204]
    client = await events_proxy(tasks_client)
    assert (await subscribe(client, receiver))[0] == 200
    await settled(client, await create(client, "alice"))
    await until(lambda: len(receiver.deliveries) == 3, "the delivery was not retried to success", 15)
    assert len({received.headers["webhook-id"] for received in receiver.deliveries}) == 1
    assert all(received.verified for received in receiver.deliveries)
    await asyncio.sleep(1)
    assert len(receiver.deliveries) == 3


async def test_a_410_ends_the_delivery_unretried_and_the_subscription_stays(
    tasks_client: ClientFactory, receiver: Receiver
) -> None:
    receiver.statuses = [410, 200]
    client = await events_proxy(tasks_client)
    assert (await subscribe(client, receiver))[0] == 200
    await settled(client, await create(client, "alice"))
    await until(lambda: len(receiver.deliveries) == 1, "no delivery arrived", 10)
    await asyncio.sleep(1.5)  # longer than every retry wait together
    assert len(receiver.deliveries) == 1
    await settled(client, await create(client, "alice"))  # the subscription still delivers
    await until(lambda: len(receiver.deliveries) == 2, "the subscription did not stay", 10)


async def test_private_callbacks_http_and_anonymous_callers_are_refused(
    tasks_client: ClientFactory, receiver: Receiver
) -> None:
    client = await events_proxy(tasks_client, {"enabled": True, "webhooks": {"allow_insecure_callbacks": True}})
    status, private = await subscribe(client, receiver)
    assert (status, private["error"]["code"]) == (400, -32602)
    assert "globally routable" in private["error"]["message"]
    localhost = receiver.url.replace("127.0.0.1", "localhost")
    _, named = await rpc(
        client.client,
        "events/subscribe",
        {"name": "task.status", "delivery": {"url": localhost, "secret": receiver.secret}},
    )
    assert named["error"]["code"] == -32602
    assert receiver.challenges == []  # nothing was sent
    strict = await events_proxy(tasks_client, {"enabled": True, "webhooks": {"allow_private_callbacks": True}})
    _, insecure = await subscribe(strict, receiver)
    assert insecure["error"]["code"] == -32602
    assert "https" in insecure["error"]["message"]
    _, anonymous = await subscribe(strict, receiver, principal=None)
    assert anonymous["error"]["code"] == -32024
    _, bad_secret = await rpc(
        strict.client,
        "events/subscribe",
        {"name": "task.status", "delivery": {"url": "https://receiver.example/h", "secret": "whsec_short"}},
    )
    assert bad_secret["error"]["code"] == -32602


async def test_a_callback_that_does_not_echo_the_challenge_is_refused(
    tasks_client: ClientFactory, receiver: Receiver
) -> None:
    receiver.echo = False
    client = await events_proxy(tasks_client)
    status, refused = await subscribe(client, receiver)
    assert refused["error"]["code"] == -32027
    assert refused["error"]["data"] == {"reason": "challenge_failed"}
    assert status == 400


async def test_each_subscribe_and_unsubscribe_writes_an_audit_line_without_the_callback_or_secret(
    tasks_client: ClientFactory, receiver: Receiver, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.log"
    client = await tasks_client(tasks=SLEEP_TASKS, events=LOOPBACK_WEBHOOKS, audit={"path": str(audit)})
    _, subscribed = await subscribe(client, receiver)
    await subscribe(client, receiver)
    params = {"name": "task.status", "arguments": {}, "delivery": {"url": receiver.url}}
    await rpc(client.client, "events/unsubscribe", params)
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    ours = [line for line in lines if line.get("subscription_id")]
    assert [(line["method"], line["outcome"]) for line in ours] == [
        ("events/subscribe", "created"),
        ("events/subscribe", "refreshed"),
        ("events/unsubscribe", "removed"),
    ]
    assert {line["subscription_id"] for line in ours} == {subscribed["result"]["id"]}
    text = audit.read_text()
    assert receiver.url not in text
    assert receiver.secret not in text
