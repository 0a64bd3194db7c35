"""Legacy (2025-11-25) clients of a stdio upstream get resumable SSE streams from the proxy's own server: event
ids naming their stream, a priming event with `retry`, and a stream that broke resumed with GET and
`Last-Event-ID` (https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#resumability-and-redelivery).
Real HTTP, the real fixture as a stdio server; the event store's bookkeeping on its own below.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.legacy._event_store import SessionEvents, position
from proxy.wire.sse import SSEEvent, SSEParser
from tests.support.processes import stdio_upstream

Client = TestClient[web.Request, web.Application]
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
INITIALIZE: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
}
DEADLINE_SECONDS = 15.0


async def open_session(client: Client) -> dict[str, str]:
    """initialize + notifications/initialized; the headers of every later request of the session."""
    url = client.make_url("/mcp")
    async with client.session.post(url, json=INITIALIZE, headers=HEADERS) as response:
        assert response.status == 200
        session_id = response.headers["Mcp-Session-Id"]
    headers = {**HEADERS, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    async with client.session.post(url, json=initialized, headers=headers) as response:
        assert response.status == 202
    return headers


async def next_event(response: aiohttp.ClientResponse, parser: SSEParser, pending: list[SSEEvent]) -> SSEEvent:
    while not pending:
        chunk = await asyncio.wait_for(response.content.readany(), DEADLINE_SECONDS)
        assert chunk, "the stream ended"
        pending.extend(parser.feed(chunk))
    return pending.pop(0)


async def events_until_answer(response: aiohttp.ClientResponse, request_id: int) -> list[SSEEvent]:
    """Every event of the stream up to the answer to `request_id`, which must end it."""
    parser, pending, events = SSEParser(), list[SSEEvent](), list[SSEEvent]()
    while True:
        event = await next_event(response, parser, pending)
        events.append(event)
        message = json.loads(event.data) if event.data else {}
        if message.get("id") == request_id and "method" not in message:
            assert await asyncio.wait_for(response.content.read(), DEADLINE_SECONDS) == b""  # the stream ends
            return events


def sleep_call(request_id: int, seconds: float) -> dict[str, Any]:
    params = {"name": "sleep", "arguments": {"seconds": seconds}, "_meta": {"progressToken": "p"}}
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}


@pytest.fixture
async def stdio_proxy(make_proxy: Callable[..., Any]) -> Client:
    client: Client = await make_proxy("", upstream=stdio_upstream())
    return client


async def test_a_post_is_answered_on_a_primed_stream_of_numbered_events(stdio_proxy: Client) -> None:
    headers = await open_session(stdio_proxy)
    async with stdio_proxy.session.post(stdio_proxy.make_url("/mcp"), json=sleep_call(2, 0.3), headers=headers) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        priming, *progress, answer = await events_until_answer(r, 2)
    assert priming.data == ""
    assert priming.retry_ms == 1000
    assert progress
    assert json.loads(answer.data)["result"]["content"][0]["text"] == "slept 0.3"
    positions = [position(event.id or "none") for event in (priming, *progress, answer)]
    assert None not in positions  # every event has an id of ours
    assert len({where[0] for where in positions if where}) == 1  # one stream
    seqs = [where[1] for where in positions if where]
    assert seqs == sorted(set(seqs))  # increasing, unique


async def test_a_broken_post_stream_is_resumed_with_last_event_id(stdio_proxy: Client) -> None:
    """The client reads the priming event and one progress event, then its connection breaks: the call goes
    on, and a GET with the last id it saw brings what it missed of that stream, then the answer."""
    headers = await open_session(stdio_proxy)
    url = stdio_proxy.make_url("/mcp")
    async with aiohttp.ClientSession() as first:  # a connection of its own, to break
        response = await first.post(url, json=sleep_call(7, 1.0), headers=headers)
        parser: SSEParser = SSEParser()
        pending: list[SSEEvent] = []
        priming = await next_event(response, parser, pending)
        seen = await next_event(response, parser, pending)
        assert priming.data == ""
        assert json.loads(seen.data)["method"] == "notifications/progress"
        response.close()
    assert seen.id is not None
    resume = {"Accept": "text/event-stream", **headers, "Last-Event-ID": seen.id}
    del resume["Content-Type"]
    async with stdio_proxy.session.get(url, headers=resume) as r:
        assert r.status == 200
        events = await events_until_answer(r, 7)
    messages = [json.loads(event.data) for event in events if event.data]
    assert messages[-1]["result"]["content"][0]["text"] == "slept 1"
    seen_position = position(seen.id)
    assert seen_position is not None
    for event in events:
        assert event.id is not None
        event_position = position(event.id)
        assert event_position is not None
        assert event_position[0] == seen_position[0]  # that stream's events only
        assert event_position[1] > seen_position[1]  # none it had seen
    progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
    assert progress == sorted(progress)
    assert progress[0] > json.loads(seen.data)["params"]["progress"]


async def test_a_resume_of_an_answered_stream_replays_what_is_held_and_ends(stdio_proxy: Client) -> None:
    headers = await open_session(stdio_proxy)
    url = stdio_proxy.make_url("/mcp")
    async with stdio_proxy.session.post(url, json=sleep_call(3, 0.3), headers=headers) as r:
        priming, *_ = await events_until_answer(r, 3)
    assert priming.id is not None
    resume = {"Accept": "text/event-stream", "Mcp-Session-Id": headers["Mcp-Session-Id"], "Last-Event-ID": priming.id}
    async with stdio_proxy.session.get(url, headers=resume) as r:
        assert r.status == 200
        replayed = await events_until_answer(r, 3)
    assert json.loads(replayed[-1].data)["result"]["content"][0]["text"] == "slept 0.3"


async def test_the_get_stream_is_resumed_with_what_it_missed(stdio_proxy: Client) -> None:
    """A resource update reaches the GET stream (the call that causes it is answered with JSON, so it has no
    stream); the client reads the first, misses the second as its connection breaks, and resuming the GET
    stream from the first brings the second."""
    headers = await open_session(stdio_proxy)
    url = stdio_proxy.make_url("/mcp")
    json_only = {**headers, "Accept": "application/json"}
    subscribe = {"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe", "params": {"uri": "test://watched"}}
    async with stdio_proxy.session.post(url, json=subscribe, headers=json_only) as r:
        assert r.status == 200
    listen = {
        "Accept": "text/event-stream",
        "Mcp-Session-Id": headers["Mcp-Session-Id"],
        "MCP-Protocol-Version": "2025-11-25",
    }

    async def update(request_id: int) -> None:
        params = {"name": "update_resource", "arguments": {"uri": "test://watched"}}
        call = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
        async with stdio_proxy.session.post(url, json=call, headers=json_only) as r:
            assert (await r.json())["result"]["content"][0]["text"] == "notified 1 subscriber(s)"

    async with aiohttp.ClientSession() as first:  # a connection of its own, to break
        get = await first.get(url, headers=listen)
        parser, pending = SSEParser(), list[SSEEvent]()
        assert (await next_event(get, parser, pending)).data == ""  # priming
        await update(3)
        first_update = await next_event(get, parser, pending)
        await update(4)  # written to the stream; this client never reads it
        get.close()
    assert first_update.id is not None
    assert json.loads(first_update.data)["method"] == "notifications/resources/updated"
    async with stdio_proxy.session.get(url, headers={**listen, "Last-Event-ID": first_update.id}) as r:
        assert r.status == 200
        parser, pending = SSEParser(), list[SSEEvent]()
        event = await next_event(r, parser, pending)
        while not event.data:  # a priming event of the resumed stream
            event = await next_event(r, parser, pending)
    assert json.loads(event.data)["method"] == "notifications/resources/updated"
    assert event.id is not None
    assert event.id != first_update.id
    assert position(event.id) is not None


async def test_without_an_event_store_answers_are_plain_json(make_proxy: Callable[..., Any]) -> None:
    client: Client = await make_proxy("", upstream=stdio_upstream(), limits={"legacy_replay_bytes": 0})
    headers = await open_session(client)
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "x"}}}
    async with client.session.post(client.make_url("/mcp"), json=call, headers=headers) as r:
        assert r.headers["Content-Type"].startswith("application/json")
        assert (await r.json())["result"]["content"][0]["text"] == "x"


# --- the store on its own ---------------------------------------------------------------------------------


def test_events_are_replayed_per_stream_and_bounded_by_bytes() -> None:
    events = SessionEvents(max_bytes=200)
    first, second = events.new_stream(), events.new_stream()
    a1 = events.add(first, {"n": "a1"})
    events.add(second, {"n": "b1"})
    a2 = events.add(first, {"n": "a2"})
    assert [event.event_id for event in events.after(first, 0)] == [a1.event_id, a2.event_id]
    assert position(a1.event_id) == (first, a1.seq)
    assert [json.loads(event.data)["n"] for event in events.after(first, a1.seq)] == ["a2"]
    for index in range(50):
        events.add(second, {"n": f"b{index:03}"})
    assert events.held_bytes <= 200
    assert events.after(first, 0) == []  # the oldest went first
    assert json.loads(events.after(second, 0)[-1].data)["n"] == "b049"


def test_ids_of_other_servers_are_not_positions() -> None:
    assert position("1/7") is None
    assert position("abc") is None
    assert position("-3") is None
    assert position("2-5") == (2, 5)
