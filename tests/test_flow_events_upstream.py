"""End to end: the legacy fixture server's own change notifications as events (the Events extension on, SQLite).

A poll of `resource.updated` for a URI makes the proxy subscribe to it upstream and hold the stream that carries
the notifications; the fixture's `notifications/resources/updated` then reaches the subscriber as an event, and
no other caller. A list's change (`notifications/tools/list_changed`) becomes a `tools.list_changed` event.
"""

from __future__ import annotations

from typing import Any

from tests.support.clients import ClientFactory, Tasks
from tests.support.events import rpc
from tests.support.waiting import until

URI = "test://watched-resource"


async def poll(
    client: Tasks, name: str, cursor: str | None, principal: str = "alice", **arguments: Any
) -> dict[str, Any]:
    params = {"name": name, "arguments": arguments, "cursor": cursor}
    status, message = await rpc(client.client, "events/poll", params, principal=principal)
    assert status == 200, message
    result: dict[str, Any] = message["result"]
    return result


async def call(client: Tasks, tool: str, arguments: dict[str, Any], principal: str = "alice") -> str:
    status, message = await client.call(
        tool, arguments, capabilities={}, headers={"Authorization": f"Bearer {principal}"}
    )
    assert status == 200, message
    return "".join(block.get("text", "") for block in message["result"]["content"])


async def test_a_legacy_resource_update_reaches_a_subscriber_of_that_uri(tasks_client: ClientFactory) -> None:
    client = await tasks_client(events={"enabled": True})
    start = await poll(client, "resource.updated", None, uri=URI)
    other = await poll(client, "resource.updated", None, principal="bob", uri="test://another")

    async def subscribed_upstream() -> bool:
        return await call(client, "update_resource", {"uri": URI}) == "notified 1 subscriber(s)"

    await until(subscribed_upstream, "the proxy never subscribed to the resource upstream", 15)
    found: list[dict[str, Any]] = []

    async def arrived() -> bool:
        found.extend((await poll(client, "resource.updated", start["cursor"], uri=URI))["events"])
        return bool(found)

    await until(arrived, "the update never reached the poll", 10)
    event = found[0]
    assert (event["name"], event["data"]) == ("resource.updated", {"uri": URI})
    assert event["eventId"].startswith("evt_")
    assert (await poll(client, "resource.updated", other["cursor"], principal="bob", uri="test://another"))[
        "events"
    ] == []
    _, unknown = await rpc(client.client, "events/poll", {"name": "resource.updated", "arguments": {}})
    assert unknown["error"]["code"] == -32602  # the uri is required


async def test_a_legacy_tool_list_change_becomes_an_event(tasks_client: ClientFactory) -> None:
    client = await tasks_client(events={"enabled": True})
    start = await poll(client, "tools.list_changed", None)
    found: list[dict[str, Any]] = []

    async def arrived() -> bool:
        await call(client, "test_trigger_tool_change", {})
        found.extend((await poll(client, "tools.list_changed", start["cursor"]))["events"])
        return bool(found)

    await until(arrived, "the list change never became an event", 15)
    assert (found[0]["name"], found[0]["data"]) == ("tools.list_changed", {})
