"""End to end: `Idempotency-Key` on 2026-07-28 tools/call (draft-ietf-httpapi-idempotency-key-header) in front
of the real legacy fixture upstream, whose `counted` tool counts its own executions per `key` argument
(`call_count` reads the count): every repeat of a keyed call leaves the count at one.

Waiting is by polling with a deadline, never by a fixed sleep.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import aiohttp

from proxy.tasks.services.idempotency import MAX_KEY_CHARS
from tests.support.clients import ClientFactory, Tasks, post_and_leave
from tests.support.processes import ProxyProcess, Upstream
from tests.support.sdk import calls_started, until_started_upstream
from tests.support.waiting import until
from tests.support.wire import HEADERS, INITIALIZE, modern_body, modern_headers, policies, read_messages

SYNC = policies(counted={"mode": "forbidden"}, tool_error={"mode": "forbidden"})


def keyed(key: str, **headers: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **headers}


def fresh(name: str) -> str:
    """A counter name no other test (or earlier run against the session's upstream) used."""
    return f"{name}-{secrets.token_hex(4)}"


def twin(client: Tasks) -> Tasks:
    """Another client of the same proxy (a `Tasks` checks the ids of its own requests one at a time)."""
    return Tasks(client.client, client.core, client.tasks)


def text_of(message: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in message["result"]["content"])


async def test_sequential_repeats_run_the_tool_once_and_answer_the_same(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    counter = fresh("sequential")
    answers = [await client.call("counted", {"key": counter}, headers=keyed('"order-1"')) for _ in range(3)]
    assert [status for status, _ in answers] == [200, 200, 200]
    assert {text_of(message) for _, message in answers} == {"1"}
    assert answers[1][1]["result"] == answers[0][1]["result"]
    assert await client.text("call_count", {"key": counter}) == "1"
    status, message = await client.call("counted", {"key": counter}, headers=keyed('"order-2"'))
    assert (status, text_of(message)) == (200, "2")  # a new key is a new request


async def test_the_quoted_and_the_bare_form_name_the_same_key(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    counter = fresh("forms")
    await client.call("counted", {"key": counter}, headers=keyed('"8e03978e-40d5"'))
    status, message = await client.call("counted", {"key": counter}, headers=keyed("8e03978e-40d5"))
    assert (status, text_of(message)) == (200, "1")
    assert await client.text("call_count", {"key": counter}) == "1"


async def test_concurrent_repeats_join_the_one_upstream_call(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    counter = fresh("concurrent")
    answers = await asyncio.gather(
        *(twin(client).call("counted", {"key": counter, "seconds": 0.5}, headers=keyed('"together"')) for _ in range(5))
    )
    assert [(status, text_of(message)) for status, message in answers] == [(200, "1")] * 5
    assert await client.text("call_count", {"key": counter}) == "1"


async def test_arguments_in_another_order_are_the_same_request(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    counter = fresh("order")
    await client.call("counted", {"key": counter, "seconds": 0}, headers=keyed('"same"'))
    status, message = await client.call("counted", {"seconds": 0, "key": counter}, headers=keyed('"same"'))
    assert (status, text_of(message)) == (200, "1")


async def test_an_is_error_result_is_recorded_and_replayed(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    first = await client.call("tool_error", {"message": "declined"}, headers=keyed('"bad-card"'))
    again = await client.call("tool_error", {"message": "declined"}, headers=keyed('"bad-card"'))
    assert first[1]["result"]["isError"] is True
    assert again == (200, {**first[1], "id": again[1]["id"]})


async def test_a_task_is_joined_while_it_runs_and_replayed_after_it_completed(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(counted={"mode": "required"}))
    counter = fresh("task")
    task_id = await client.create("counted", {"key": counter, "seconds": 0.5}, headers=keyed('"job"'))
    running = await client.create("counted", {"key": counter, "seconds": 0.5}, headers=keyed('"job"'))
    assert running == task_id  # the same task: its CreateTaskResult again
    done = await client.settled(task_id)
    assert done["status"] == "completed"
    after = await client.create("counted", {"key": counter, "seconds": 0.5}, headers=keyed('"job"'))
    assert after == task_id
    assert await client.text("call_count", {"key": counter}) == "1"


async def test_the_same_key_for_another_request_is_422_and_runs_nothing(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    counter = fresh("mismatch")
    await client.call("counted", {"key": counter}, headers=keyed('"reused"'))
    for tool, arguments in (("counted", {"key": counter, "seconds": 0.01}), ("echo", {"text": "x"})):
        status, message = await client.call(tool, arguments, headers=keyed('"reused"'))
        assert status == 422
        assert message["error"]["code"] == -32602
        assert "different request" in message["error"]["message"]
    assert await client.text("call_count", {"key": counter}) == "1"


async def test_another_principal_with_the_same_key_has_a_key_of_its_own(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    counter = fresh("principals")
    alice = await client.call("counted", {"key": counter}, headers=keyed('"k"', Authorization="Bearer alice"))
    bob = await client.call("counted", {"key": counter}, headers=keyed('"k"', Authorization="Bearer bob"))
    alice_again = await client.call("counted", {"key": counter}, headers=keyed('"k"', Authorization="Bearer alice"))
    assert [text_of(message) for _, message in (alice, bob, alice_again)] == ["1", "2", "1"]


async def test_bad_keys_are_400_and_run_nothing(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC)
    counter = fresh("bad-keys")
    too_long = '"' + "a" * (MAX_KEY_CHARS + 1) + '"'
    for bad in (too_long, '""', '"open', '"a";p=1', '"tab\there"', "two words", '"a\\b"', "é"):
        status, message = await client.call("counted", {"key": counter}, headers=keyed(bad))
        assert status == 400, bad
        assert message["error"]["code"] == -32602, bad
    assert await client.text("call_count", {"key": counter}) == "0"
    status, message = await client.call("counted", {"key": counter}, headers=keyed('"' + "a" * MAX_KEY_CHARS + '"'))
    assert (status, text_of(message)) == (200, "1")


async def test_a_request_refused_before_the_upstream_saw_it_leaves_the_key_free(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(counted={"mode": "required"}))
    counter = fresh("refused")
    status, message = await client.call("counted", {"key": counter}, capabilities={}, headers=keyed('"retry-me"'))
    assert (status, message["error"]["code"]) == (400, -32021)  # a task-only tool, a non-declaring client
    task_id = await client.create("counted", {"key": counter}, headers=keyed('"retry-me"'))
    assert (await client.settled(task_id))["status"] == "completed"
    assert await client.text("call_count", {"key": counter}) == "1"


async def test_a_key_past_its_retention_runs_again(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC, idempotency={"retention_seconds": 0.3})
    counter = fresh("retention")
    await client.call("counted", {"key": counter}, headers=keyed('"short"'))

    async def ran_again() -> bool:
        _, message = await client.call("counted", {"key": counter}, headers=keyed('"short"'))
        return text_of(message) == "2"

    await until(ran_again, "the key was never forgotten", 10)
    _, message = await client.call("counted", {"key": counter}, headers=keyed('"short"'))
    assert text_of(message) == "2"  # and the new outcome is kept for the new retention


async def test_without_the_setting_the_header_is_ignored(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=SYNC, idempotency={"enabled": False})
    counter = fresh("disabled")
    for _ in range(2):
        await client.call("counted", {"key": counter}, headers=keyed('"ignored"'))
    assert await client.text("call_count", {"key": counter}) == "2"


async def test_a_repeat_after_the_client_left_joins_the_call_that_went_on(
    tasks_client: ClientFactory, upstream: Upstream
) -> None:
    """A response lost to a dropped connection: the call is not cancelled upstream, and the retry gets its answer."""
    client = await tasks_client(tasks=SYNC)
    counter = fresh("left")
    arguments = {"key": counter, "seconds": 0.5}
    body = modern_body("tools/call", {"name": "counted", "arguments": arguments}, request_id=99)
    await post_and_leave(client.client, body, keyed('"lost"', **modern_headers("tools/call", "counted")), upstream.url)
    status, message = await client.call("counted", arguments, headers=keyed('"lost"'))
    assert (status, text_of(message)) == (200, "1")
    assert await client.text("call_count", {"key": counter}) == "1"


async def test_outcomes_survive_a_kill_of_the_proxy(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    """After kill -9 and a restart on the same SQLite file: a finished call is replayed; one that was still running
    when the process died is not run again (its outcome is unknown), and the repeat says so."""
    proxy = ProxyProcess(tmp_path, upstream.url, tasks=SYNC)
    processes.append(proxy)
    await proxy.start()
    done, running = fresh("restart-done"), fresh("restart-running")

    async def call(counter: str, key: str, seconds: float = 0) -> tuple[int, dict[str, Any]]:
        arguments = {"key": counter, "seconds": seconds}
        body = modern_body("tools/call", {"name": "counted", "arguments": arguments}, capabilities={})
        headers = keyed(key, **modern_headers("tools/call", "counted"))
        async with http.post(proxy.url, json=body, headers=headers) as response:
            return response.status, (await read_messages(response))[-1]

    assert (await call(done, '"finished"'))[0] == 200
    before = await calls_started(upstream.url, "counted")
    pending = asyncio.get_running_loop().create_task(call(running, '"in-flight"', seconds=30))
    await until_started_upstream(upstream.url, "counted", before)
    proxy.stop()  # SIGKILL
    await asyncio.gather(pending, return_exceptions=True)
    await proxy.start()
    status, message = await call(done, '"finished"')
    assert (status, text_of(message)) == (200, "1")
    status, message = await call(running, '"in-flight"', seconds=30)
    assert status == 500
    assert message["error"]["data"] == {"idempotencyKey": "interrupted"}
    assert await calls_started(upstream.url, "counted") == before + 1  # neither repeat reached the upstream
    assert any(event.get("idempotency") == "replayed" for event in proxy.events() if event.get("event") == "request")


async def test_a_call_stopped_by_a_shutdown_is_not_replayed_as_send_again(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    """SIGTERM past the drain: what the call answers then is the shutdown's, no outcome of the upstream's (it was
    told to cancel); after the restart the repeat hears that the outcome is unknown, and nothing runs again."""
    proxy = ProxyProcess(tmp_path, upstream.url, tasks={**SYNC, "drain_seconds": 0.2})
    processes.append(proxy)
    await proxy.start()
    counter = fresh("shutdown")
    body = modern_body("tools/call", {"name": "counted", "arguments": {"key": counter, "seconds": 30}}, capabilities={})
    headers = keyed('"stopped"', **modern_headers("tools/call", "counted"))

    async def call() -> tuple[int, dict[str, Any]]:
        async with http.post(proxy.url, json=body, headers=headers) as response:
            return response.status, (await read_messages(response))[-1]

    before = await calls_started(upstream.url, "counted")
    first = asyncio.get_running_loop().create_task(call())
    await until_started_upstream(upstream.url, "counted", before)
    assert await proxy.terminate() == 0
    await asyncio.gather(first, return_exceptions=True)  # told it shuts down, or cut off by the exit
    await proxy.start()
    status, message = await call()
    assert status == 500
    assert message["error"]["data"] == {"idempotencyKey": "interrupted"}
    assert await calls_started(upstream.url, "counted") == before + 1


async def test_a_busy_key_is_409_past_the_join_timeout(tasks_client: ClientFactory, upstream: Upstream) -> None:
    client = await tasks_client(tasks=SYNC, idempotency={"join_timeout_seconds": 0.2})
    counter = fresh("busy")
    before = await calls_started(upstream.url, "counted")
    first = asyncio.get_running_loop().create_task(
        twin(client).call("counted", {"key": counter, "seconds": 2}, headers=keyed('"slow"'))
    )
    await until_started_upstream(upstream.url, "counted", before)
    status, message = await client.call("counted", {"key": counter, "seconds": 2}, headers=keyed('"slow"'))
    assert (status, message["error"]["code"]) == (409, -32600)
    assert text_of((await first)[1]) == "1"
    assert await client.text("call_count", {"key": counter}) == "1"


async def test_a_legacy_client_s_calls_pass_through_untouched(tasks_client: ClientFactory) -> None:
    """A 2025-11-25 client's requests are relayed as they came: the header does not make its repeat a replay."""
    client = await tasks_client(tasks=SYNC)
    counter = fresh("legacy")
    async with client.client.post("/mcp", json=INITIALIZE, headers=HEADERS) as response:
        session = {
            **HEADERS,
            "Mcp-Session-Id": response.headers["Mcp-Session-Id"],
            "MCP-Protocol-Version": "2025-11-25",
        }
    async with client.client.post(
        "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=session
    ):
        pass
    call = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "tools/call",
        "params": {"name": "counted", "arguments": {"key": counter}},
    }
    texts = []
    for _ in range(2):
        async with client.client.post("/mcp", json=call, headers=keyed('"legacy"', **session)) as response:
            texts.append(text_of((await read_messages(response))[-1]))
    assert texts == ["1", "2"]
