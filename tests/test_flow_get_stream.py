"""End to end: questions a legacy server sends on its session's GET stream, naming no request (the mcp 1.x
SDK's `list_roots()`, and `create_message()` / `elicit()` without a related request id).

Each call runs on an upstream session of its own while it lasts, so whatever arrives on that session's GET
stream is that call's question: relayed to its client (a task's `inputRequests`, or an MRTR round), and the
answer goes back to the call that asked, however busy the same caller is elsewhere. Real mcp 1.x fixture
upstream on loopback; every message schema-checked by the `Tasks` client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.edge._app_keys import POOL
from tests.support.clients import ClientFactory, Tasks, upstream_calls_open
from tests.support.processes import Upstream
from tests.support.wire import DECLARING, policies, result_text

EVERY_INPUT: dict[str, Any] = {"elicitation": {}, "sampling": {}, "roots": {}}
TASKING: dict[str, Any] = {**EVERY_INPUT, **DECLARING}
SAMPLED = {"role": "assistant", "content": {"type": "text", "text": "4"}, "model": "m", "stopReason": "endTurn"}
ANSWERS: dict[str, dict[str, Any]] = {
    "sampling/createMessage": SAMPLED,
    "roots/list": {"roots": [{"uri": "file:///three"}]},
    "elicitation/create": {"action": "accept", "content": {"name": "Ada"}},
}
THREE_ANSWERED = "sampled=4; roots=file:///three; name=Ada"


def answers_for(input_requests: dict[str, Any]) -> dict[str, Any]:
    return {key: ANSWERS[request["method"]] for key, request in input_requests.items()}


async def waiting_for_input(client: Tasks, task_id: str, keys: int) -> dict[str, Any]:
    return await client.until(
        task_id, lambda task: task["status"] == "input_required" and len(task["inputRequests"]) >= keys
    )


async def mrtr_to_the_end(client: Tasks, params: dict[str, Any]) -> tuple[list[set[str]], dict[str, Any]]:
    """Answer MRTR rounds until the final result; returns the methods asked in each round and the result."""
    rounds: list[set[str]] = []
    _, message = await client.call(params["name"], params["arguments"], capabilities=EVERY_INPUT)
    while message["result"]["resultType"] == "input_required":
        requests = message["result"]["inputRequests"]
        rounds.append({request["method"] for request in requests.values()})
        retry = {**params, "inputResponses": answers_for(requests), "requestState": message["result"]["requestState"]}
        _, message = await client.post("tools/call", retry, capabilities=EVERY_INPUT)
        assert len(rounds) <= 3, message
    return rounds, message["result"]


async def test_get_stream_questions_are_the_asking_calls_own_while_its_caller_is_busy(
    tasks_client: ClientFactory,
) -> None:
    """Sampling and roots on the GET stream and an elicitation on the call's own stream, asked at once, all reach
    the one client that can answer them, as a task's inputRequests and as MRTR rounds. Meanwhile the same
    caller has two tasks waiting for input, an MRTR round it never retried, and 20 synchronous calls running:
    nothing is refused, nothing reaches the wrong call."""
    client = await tasks_client(
        tasks=policies(
            ask_name={"mode": "required"},
            ask_three={"mode": "optional", "sync_window_ms": 60_000},  # a question makes it a task at once
            sleep={"mode": "forbidden"},
        )
    )
    waiting = [await client.create("ask_name", capabilities=TASKING) for _ in range(2)]
    for task_id in waiting:
        await waiting_for_input(client, task_id, 1)
    _, abandoned = await client.call("sample", {"prompt": "never answered"}, capabilities=EVERY_INPUT)
    assert abandoned["result"]["resultType"] == "input_required"  # never retried: it stays parked
    sync_calls = [  # a client object each: request ids are checked per client
        asyncio.get_running_loop().create_task(
            Tasks(client.client, client.core, client.tasks).call("sleep", {"seconds": 3}, capabilities=EVERY_INPUT)
        )
        for _ in range(20)
    ]
    await upstream_calls_open(client.client, 2 + 1 + 20)

    task_id = await client.create("ask_three", capabilities=TASKING)
    task = await waiting_for_input(client, task_id, 3)
    methods = sorted(request["method"] for request in task["inputRequests"].values())
    assert methods == ["elicitation/create", "roots/list", "sampling/createMessage"]
    status, _ = await client.post(
        "tasks/update", {"taskId": task_id, "inputResponses": answers_for(task["inputRequests"])}
    )
    assert status == 200
    assert result_text(await client.settled(task_id)) == THREE_ANSWERED

    params: dict[str, Any] = {"name": "ask_three", "arguments": {}}
    no_task = Tasks(client.client, client.core, client.tasks)
    rounds, result = await mrtr_to_the_end(no_task, params)
    assert set().union(*rounds) == {"elicitation/create", "roots/list", "sampling/createMessage"}
    assert "".join(block["text"] for block in result["content"]) == THREE_ANSWERED

    for index, task_id in enumerate(waiting):  # each waiting task gets its own answer back
        answer = {"elicitation-1": {"action": "accept", "content": {"name": f"waiter-{index}"}}}
        await client.post("tasks/update", {"taskId": task_id, "inputResponses": answer})
    for index, task_id in enumerate(waiting):
        assert result_text(await client.settled(task_id)) == f"Hello, waiter-{index}"
    for status, message in await asyncio.gather(*sync_calls):
        assert status == 200, message
        assert "".join(block["text"] for block in message["result"]["content"]) == "slept 3"


@pytest.fixture
def json_upstream() -> Iterator[Upstream]:
    """An upstream that answers POSTs with one JSON body when the tool ends: the call's response headers come
    only with its result, after any question it sent on the GET stream."""
    server = Upstream("--json-response")
    server.start()
    yield server
    server.stop()


async def test_a_question_sent_before_the_calls_response_headers_is_that_calls(
    tasks_client: ClientFactory, json_upstream: Upstream
) -> None:
    client = await tasks_client(json_upstream.url, tasks=policies(list_roots_standalone={"mode": "required"}))
    task_id = await client.create("list_roots_standalone", capabilities=TASKING)
    task = await waiting_for_input(client, task_id, 1)
    assert task["inputRequests"] == {"roots-1": {"method": "roots/list"}}
    await client.post(
        "tasks/update", {"taskId": task_id, "inputResponses": {"roots-1": {"roots": [{"uri": "file:///early"}]}}}
    )
    assert result_text(await client.settled(task_id)) == "file:///early"

    sync = await tasks_client(json_upstream.url)
    _, message = await sync.call("list_roots_standalone", {}, capabilities=EVERY_INPUT)
    assert message["result"]["resultType"] == "input_required"
    assert list(message["result"]["inputRequests"].values()) == [{"method": "roots/list"}]
    retry = {
        "name": "list_roots_standalone",
        "arguments": {},
        "inputResponses": {key: {"roots": [{"uri": "file:///sync"}]} for key in message["result"]["inputRequests"]},
        "requestState": message["result"]["requestState"],
    }
    _, message = await sync.post("tools/call", retry, capabilities=EVERY_INPUT)
    assert result_text(message) == "file:///sync"


async def test_idle_upstream_sessions_stay_bounded_after_many_callers(tasks_client: ClientFactory) -> None:
    """300 distinct callers come and go: at most `upstream.max_sessions` idle sessions are kept, the rest are
    ended (DELETE), and the proxy keeps answering."""
    client = await tasks_client(upstream={"max_sessions": 8})
    pool = client.client.app[POOL]
    gate = asyncio.Semaphore(10)

    async def one_caller(number: int) -> None:
        async with gate:
            status, message = await Tasks(client.client, client.core, client.tasks).call(
                "echo", {"text": str(number)}, capabilities={}, headers={"Authorization": f"Bearer caller-{number}"}
            )
            assert status == 200, message
            assert result_text(message) == str(number)

    await asyncio.gather(*(one_caller(number) for number in range(300)))
    assert pool.idle_sessions <= 8
    assert pool.open_sessions <= 8
