"""End to end: `subscriptions/listen` (basic/patterns/subscriptions) fed by the proxy's upstream GET stream,
and standalone upstream requests on that stream answered instead of left hanging."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient

from tests.support.clients import upstream_calls_open
from tests.support.processes import Upstream
from tests.support.schemas import ModernSchema
from tests.support.waiting import until
from tests.support.wire import SUBSCRIPTION_ID, TASKS, modern_body, modern_headers, read_messages, sse_messages

Client = TestClient[web.Request, web.Application]
DEADLINE_SECONDS = 10.0


async def next_message(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    return await asyncio.wait_for(anext(stream), DEADLINE_SECONDS)


async def open_listen(client: Client, notifications: dict[str, Any], request_id: int | str = "L1") -> ClientResponse:
    body = modern_body("subscriptions/listen", {"notifications": notifications}, request_id=request_id)
    response = await client.post("/mcp", json=body, headers=modern_headers("subscriptions/listen"))
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    return response


async def call(client: Client, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    body = modern_body("tools/call", {"name": tool, "arguments": arguments or {}})
    response = await client.post("/mcp", json=body, headers=modern_headers("tools/call", tool))
    [message] = await read_messages(response)
    return message


async def test_list_changed_reaches_the_listen_stream(proxy: Client, modern_schema: ModernSchema) -> None:
    response = await open_listen(proxy, {"toolsListChanged": True, "promptsListChanged": True})
    stream = sse_messages(response)
    ack = await next_message(stream)
    modern_schema.validate(ack, "SubscriptionsAcknowledgedNotification")
    assert ack["params"]["notifications"] == {"toolsListChanged": True, "promptsListChanged": True}
    assert ack["params"]["_meta"][SUBSCRIPTION_ID] == "L1"
    await call(proxy, "test_trigger_tool_change")
    changed = await next_message(stream)
    modern_schema.validate(changed, "ToolListChangedNotification")
    assert changed["method"] == "notifications/tools/list_changed"
    assert changed["params"]["_meta"][SUBSCRIPTION_ID] == "L1"
    response.close()


async def test_the_filter_is_honoured(proxy: Client) -> None:
    """The server MUST NOT send types the client did not request: a tools change, then a prompts change,
    and only the prompts one arrives (the upstream stream keeps their order)."""
    response = await open_listen(proxy, {"promptsListChanged": True})
    stream = sse_messages(response)
    assert (await next_message(stream))["method"] == "notifications/subscriptions/acknowledged"
    await call(proxy, "test_trigger_tool_change")
    await call(proxy, "test_trigger_prompt_change")
    assert (await next_message(stream))["method"] == "notifications/prompts/list_changed"
    response.close()


async def test_resource_subscriptions(proxy: Client, modern_schema: ModernSchema) -> None:
    uri = "test://watched-resource"
    response = await open_listen(proxy, {"resourceSubscriptions": [uri, "test://not-subscribed"]})
    stream = sse_messages(response)
    ack = await next_message(stream)
    assert ack["params"]["notifications"]["resourceSubscriptions"][0] == uri
    result = await call(proxy, "update_resource", {"uri": uri})
    assert result["result"]["content"][0]["text"] == "notified 1 subscriber(s)"
    updated = await next_message(stream)
    modern_schema.validate(updated, "ResourceUpdatedNotification")
    assert updated["params"]["uri"] == uri
    assert updated["params"]["_meta"][SUBSCRIPTION_ID] == "L1"
    response.close()


async def test_listen_ends_gracefully_at_shutdown(
    make_proxy: Callable[..., Any], upstream: Upstream, modern_schema: ModernSchema
) -> None:
    client: Client = await make_proxy(upstream.url)
    response = await open_listen(client, {"toolsListChanged": True}, request_id=42)
    stream = sse_messages(response)
    assert (await next_message(stream))["method"] == "notifications/subscriptions/acknowledged"
    closing = asyncio.get_running_loop().create_task(client.server.close())
    final = await next_message(stream)
    await closing
    modern_schema.validate(final, "SubscriptionsListenResultResponse")
    assert final["id"] == 42
    assert final["result"]["_meta"][SUBSCRIPTION_ID] == 42


async def test_a_standalone_question_nobody_can_own_is_refused_not_left_hanging(proxy: Client) -> None:
    """The SDK sends list_roots() without a related request on the GET stream. This client declared nothing it
    could be asked, so its call shares the caller's upstream session; with another call running there the
    question could be either's: the upstream is refused at once and the tool ends with what it makes of that,
    instead of waiting for its timeout. (Alone there, the call is told what it lacks: test_flow_capabilities.py;
    a client that declared `roots` has a session of its own and is asked: test_flow_get_stream.py.)"""
    await call(proxy, "greet", {"name": "warm-up"})  # the session (and its GET stream) exists
    sleeping = asyncio.get_running_loop().create_task(call(proxy, "sleep", {"seconds": 2}))
    await upstream_calls_open(proxy, 1)
    message = await asyncio.wait_for(call(proxy, "list_roots_standalone"), DEADLINE_SECONDS)
    text = message["result"]["content"][0]["text"]
    assert text.startswith("roots refused:")
    assert "cannot be relayed" in text
    assert "result" in await sleeping


async def test_listen_survives_an_upstream_restart(make_proxy: Callable[..., Any], own_upstream: Upstream) -> None:
    """The upstream process is replaced: the proxy notices on its GET stream, starts a new session at once,
    renews the resource subscription there, and the open listen stream keeps receiving."""
    client: Client = await make_proxy(own_upstream.url)
    uri = "test://watched-resource"
    response = await open_listen(client, {"resourceSubscriptions": [uri]})
    stream = sse_messages(response)
    assert (await next_message(stream))["method"] == "notifications/subscriptions/acknowledged"
    port = own_upstream.port
    own_upstream.stop()
    own_upstream.start(port)
    last: dict[str, Any] = {}

    async def renewed() -> bool:  # the new upstream process holds the renewed subscription
        last.update(await call(client, "update_resource", {"uri": uri}))
        return "result" in last and last["result"]["content"][0]["text"] == "notified 1 subscriber(s)"

    await until(renewed, lambda: f"subscription not renewed: {last}", DEADLINE_SECONDS)
    updated = await next_message(stream)
    assert (updated["method"], updated["params"]["uri"]) == ("notifications/resources/updated", uri)
    response.close()


async def test_task_ids_need_the_extension(proxy: Client, modern_schema: ModernSchema) -> None:
    """`taskIds` from a non-declaring client is -32021; a declaring one is acknowledged with the subset the
    proxy honours: its own tasks only (an unknown id is left out)."""
    wanted = {"taskIds": ["task_x"], "toolsListChanged": True}
    body = modern_body("subscriptions/listen", {"notifications": wanted}, request_id="T5")
    refused = await proxy.post("/mcp", json=body, headers=modern_headers("subscriptions/listen"))
    assert refused.status == 400
    [error] = await read_messages(refused)
    modern_schema.validate(error, "MissingRequiredClientCapabilityError")
    assert error["error"]["data"]["requiredCapabilities"] == {"extensions": {TASKS: {}}}
    declaring = modern_body(
        "subscriptions/listen", {"notifications": wanted}, request_id="T5b", capabilities={"extensions": {TASKS: {}}}
    )
    response = await proxy.post("/mcp", json=declaring, headers=modern_headers("subscriptions/listen"))
    assert response.status == 200
    ack = await next_message(sse_messages(response))
    assert ack["params"]["notifications"] == {"toolsListChanged": True, "taskIds": []}
    response.close()
