"""End to end: work that waits for clients is capped where it starts, upstream sessions are capped, the process
keeps within its descriptors, and every limit's refusal says which limit (`data.limit`) and when to come back
(`Retry-After`).

A call whose client could answer a question takes a waiting place at its start: one caller cannot hold more than
`limits.max_waiting_per_principal` calls waiting for it (429), nor all callers more than `inputs.max_waiting`
(503); a call admitted is never refused when it asks. An HTTP upstream's sessions stop at
`upstream.max_open_sessions`: a new call that would need one more is refused at its start (503), never a task
that fails later. Started with a soft and hard descriptor limit of 256, the proxy warns at start and refuses new
work with 503 past its budget, never running out of descriptors.
"""

from __future__ import annotations

import asyncio
import os
import resource
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from proxy.edge._app_keys import POOL, RUNNER
from proxy.edge._descriptors import MIN_RESERVE
from tests.support.clients import ClientFactory, Tasks, rpc, task_state
from tests.support.processes import ProxyProcess, Upstream
from tests.support.waiting import until
from tests.support.wire import DECLARING, TASKING, modern_body, modern_headers, policies, read_messages

ELICIT: dict[str, Any] = {"elicitation": {}}


def as_caller(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


async def refused(
    client: Tasks, tool: str, caller: str, capabilities: dict[str, Any], arguments: dict[str, Any] | None = None
) -> tuple[int, Mapping[str, str], dict[str, Any]]:
    """A tools/call expected to be refused: its status, headers and error."""
    body = modern_body("tools/call", {"name": tool, "arguments": arguments or {}}, capabilities=capabilities)
    headers = {**modern_headers("tools/call", tool), **as_caller(caller)}
    response = await client.client.post("/mcp", json=body, headers=headers)
    message = (await read_messages(response))[-1]
    assert "error" in message, message
    return response.status, response.headers, message["error"]


async def waiting_for_input(client: Tasks, task_id: str, caller: str) -> None:
    await client.until(task_id, lambda task: task["status"] == "input_required", headers=as_caller(caller))


async def test_a_caller_cannot_hold_more_calls_waiting_for_it_than_its_share(tasks_client: ClientFactory) -> None:
    client = await tasks_client(
        tasks=policies(ask_name={"mode": "required"}, sleep={"mode": "required"}),
        limits={"max_waiting_per_principal": 2},
    )
    held = [await client.create("ask_name", capabilities=TASKING, headers=as_caller("hog")) for _ in range(2)]
    for task_id in held:
        await waiting_for_input(client, task_id, "hog")

    status, headers, error = await refused(client, "ask_name", "hog", TASKING)

    assert (status, headers.get("Retry-After")) == (429, "1")
    assert (error["code"], error["data"]) == (-32603, {"limit": "max_waiting_per_principal", "max": 2})
    # Any call of that caller that could come to ask is refused too (a synchronous one as well) ...
    status, _, error = await refused(client, "echo", "hog", ELICIT, {"text": "hello"})
    assert (status, error["data"]["limit"]) == (429, "max_waiting_per_principal")
    # ... but not one whose client could never be asked, nor another caller's.
    await client.create("sleep", {"seconds": 0}, capabilities=DECLARING, headers=as_caller("hog"))
    await client.create("ask_name", capabilities=TASKING, headers=as_caller("other"))
    status, _ = await client.post("tasks/cancel", {"taskId": held[0]}, capabilities=TASKING, headers=as_caller("hog"))
    assert status == 200

    async def admitted_again() -> str | None:
        status, message = await client.call("ask_name", capabilities=TASKING, headers=as_caller("hog"))
        return message["result"]["taskId"] if status == 200 else None

    await until(admitted_again, "the cancelled task's place never came free", 10)


async def test_every_callers_waiting_calls_together_stop_at_the_replicas_cap(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(ask_name={"mode": "required"}), inputs={"max_waiting": 2})
    for caller in ("a", "b"):
        await waiting_for_input(
            client, await client.create("ask_name", capabilities=TASKING, headers=as_caller(caller)), caller
        )

    status, headers, error = await refused(client, "ask_name", "c", TASKING)

    assert (status, headers.get("Retry-After"), error["data"]) == (503, "1", {"limit": "max_waiting", "max": 2})
    assert client.client.app[RUNNER].waiting_places == 2


async def test_calls_running_that_could_ask_hold_their_place_from_their_start(tasks_client: ClientFactory) -> None:
    """A place is taken when a call starts, not when it asks: two running tasks of a client that could answer a
    question fill a share of two before either asks, so neither can be refused later when it does."""
    client = await tasks_client(tasks=policies(sleep={"mode": "required"}), limits={"max_waiting_per_principal": 2})
    for _ in range(2):
        await client.create("sleep", {"seconds": 30}, capabilities=TASKING, headers=as_caller("a"))

    status, _, error = await refused(client, "ask_name", "a", TASKING)

    assert (status, error["data"]["limit"]) == (429, "max_waiting_per_principal")
    assert client.client.app[RUNNER].waiting_places == 2


async def test_the_running_limits_refusals_say_when_to_come_back(tasks_client: ClientFactory) -> None:
    client = await tasks_client(
        tasks={**policies(sleep={"mode": "required"}), "max_running": 2}, limits={"max_running_per_principal": 1}
    )
    await client.create("sleep", {"seconds": 30}, headers=as_caller("a"))
    status, headers, error = await refused(client, "sleep", "a", DECLARING, {"seconds": 30})
    assert (status, headers.get("Retry-After"), error["data"]) == (
        429,
        "1",
        {"limit": "max_running_per_principal", "max": 1},
    )
    await client.create("sleep", {"seconds": 30}, headers=as_caller("b"))
    status, headers, error = await refused(client, "sleep", "c", DECLARING, {"seconds": 30})
    assert (status, headers.get("Retry-After"), error["data"]) == (503, "1", {"limit": "max_running", "max": 2})


async def test_upstream_sessions_stop_at_the_cap_and_a_call_needing_one_more_is_refused_at_its_start(
    tasks_client: ClientFactory, upstream: Upstream
) -> None:
    """Three sessions: the caller's shared one and two lent to calls that can ask (one place is always left to
    shared sessions). A third such call is refused before any task exists; calls that cannot ask still run on
    the shared session; once a lent session comes back, the next call takes it."""
    client = await tasks_client(
        upstream={"url": upstream.url, "max_open_sessions": 3}, tasks=policies(ask_name={"mode": "required"})
    )
    pool = client.client.app[POOL]
    held = [await client.create("ask_name", capabilities=TASKING, headers=as_caller("a")) for _ in range(2)]
    for task_id in held:
        await waiting_for_input(client, task_id, "a")

    status, headers, error = await refused(client, "ask_name", "a", TASKING)

    assert (status, headers.get("Retry-After")) == (503, "1")
    assert (error["code"], error["data"]) == (-32603, {"limit": "max_open_sessions", "max": 3})
    assert pool.open_sessions <= 3
    status, message = await client.call("sleep", {"seconds": 0}, capabilities={}, headers=as_caller("a"))
    assert (status, "error" in message) == (200, False)
    status, message = await client.post(
        "tasks/update",
        {"taskId": held[0], "inputResponses": {"elicitation-1": {"action": "accept", "content": {"name": "Ada"}}}},
        capabilities=TASKING,
        headers=as_caller("a"),
    )
    assert status == 200, message
    await client.until(held[0], lambda task: task["status"] == "completed", headers=as_caller("a"))

    async def admitted_again() -> str | None:
        status, message = await client.call("ask_name", capabilities=TASKING, headers=as_caller("a"))
        return message["result"]["taskId"] if status == 200 else None

    await until(admitted_again, "the returned session was never lent again", 10)
    assert pool.open_sessions <= 3


def _low_descriptor_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


async def test_with_256_descriptors_the_proxy_warns_at_start_and_refuses_past_its_budget(
    tmp_path: Path, own_upstream: Upstream
) -> None:
    """400 tasks asked of a proxy whose soft and hard descriptor limits are 256: what fits runs; past the budget
    every refusal is a 503 naming `descriptors` with `Retry-After` (or a caller limit's 429), never a 500, a
    failed task or `EMFILE`."""
    proxy = ProxyProcess(
        tmp_path,
        own_upstream.url,
        tasks={"default": {"mode": "required"}, "max_running": 1024},
        limits={"max_running_per_principal": 1024},
    )
    proxy.preexec = _low_descriptor_limit
    try:
        await proxy.start()
        short = [event for event in proxy.events() if event.get("event") == "descriptor_budget_short"]
        assert short, "no warning at start"
        assert (short[0]["limit"], short[0]["need"] > 256) == (256, True)
        statuses: Counter[int] = Counter()
        limits: Counter[str] = Counter()
        created: list[str] = []
        connector = aiohttp.TCPConnector(limit=16)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def create(number: int) -> None:
                status, message = await rpc(
                    http, proxy.url, "tools/call", {"name": "sleep", "arguments": {"seconds": 60}}, DECLARING
                )
                statuses[status] += 1
                if status == 200:
                    created.append(message["result"]["taskId"])
                else:
                    limits[message["error"]["data"]["limit"]] += 1

            await asyncio.gather(*(create(number) for number in range(400)))
            assert set(statuses) <= {200, 429, 503}, statuses  # no 500
            assert limits["descriptors"] > 0, (statuses, limits)
            assert 32 <= len(created) < 400, (statuses, limits)
            assert proxy.process is not None
            held = len(os.listdir(f"/proc/{proxy.process.pid}/fd"))
            assert held <= 256 - MIN_RESERVE  # what it holds stays within its budget
            for task_id in created[:: max(1, len(created) // 10)]:  # what was admitted runs on
                assert (await task_state(http, proxy.url, task_id))["status"] == "working"
            async with http.post(
                proxy.url,
                json=modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 1}}, capabilities=DECLARING),
                headers=modern_headers("tools/call", "sleep"),
            ) as response:
                assert response.status == 503
                assert response.headers.get("Retry-After") == "1"
        log = proxy.log.read_text()
        assert "EMFILE" not in log
        assert "Too many open files" not in log
    finally:
        proxy.stop()
