"""End to end: `upstream.max_concurrent_calls` against the real legacy fixture. The upstream never holds more
calls than the cap; the calls beyond it wait in a queue that is fair between callers (round robin, first come
first served within one); a declaring client's call that has to wait becomes a task at once (`queued: N
ahead`), a queued task cancelled never reaches the upstream, and a synchronous call that waits its whole budget
gets 503 with `Retry-After` (RFC 9110 §10.2.3) having never reached the upstream. An MRTR retry needs no slot.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests import pg
from tests.support.clients import TERMINAL, ClientFactory, Tasks, rpc, task_until
from tests.support.ops import scrape
from tests.support.processes import ProxyProcess, Upstream, key_file
from tests.support.sdk import held_at_once, until_started_upstream
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, policies, result_text

ELICIT: dict[str, Any] = {"elicitation": {}}
HOLD_SECONDS = 0.2


def as_caller(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


def settled_at(task: dict[str, Any]) -> float:
    """When the task settled (its lastUpdatedAt), epoch seconds."""
    return datetime.fromisoformat(task["lastUpdatedAt"].replace("Z", "+00:00")).timestamp()


def another(client: Tasks) -> Tasks:
    """A client of the same proxy with its own request ids, for requests sent at once."""
    return Tasks(client.client, client.core, client.tasks)


async def count_of(client: Tasks, key: str) -> int:
    """How often `counted` ran upstream with `key` (asked through the proxy: this call takes a slot too)."""
    return int(await client.text("call_count", {"key": key}))


async def test_a_burst_from_two_callers_never_exceeds_the_cap_and_the_lighter_caller_is_not_starved(
    tasks_client: ClientFactory, upstream: Upstream
) -> None:
    client = await tasks_client(upstream={"max_concurrent_calls": 2}, tasks=policies(held={"mode": "required"}))
    await held_at_once(upstream.url, reset=True)
    began = time.time()
    heavy = await asyncio.gather(
        *(
            another(client).create("held", {"tag": f"heavy-{n}", "seconds": HOLD_SECONDS}, headers=as_caller("heavy"))
            for n in range(20)
        )
    )
    light = [
        await client.create("held", {"tag": f"light-{n}", "seconds": HOLD_SECONDS}, headers=as_caller("light"))
        for n in range(4)
    ]
    queued = await client.until(
        light[-1], lambda task: str(task.get("statusMessage", "")).startswith("queued: "), headers=as_caller("light")
    )
    assert queued["status"] == "working"
    finished: dict[str, list[float]] = {"heavy": [], "light": []}
    for caller, task_ids in (("heavy", heavy), ("light", light)):
        for task_id in task_ids:
            task = await client.until(task_id, lambda task: task["status"] in TERMINAL, 30, headers=as_caller(caller))
            assert task["status"] == "completed", task
            finished[caller].append(settled_at(task) - began)
    counts = await held_at_once(upstream.url)
    assert counts["most"] == 2  # the cap held exactly, and was used
    order = sorted((at, caller) for caller, times in finished.items() for at in times)
    light_places = [place for place, (_, caller) in enumerate(order, 1) if caller == "light"]
    print(
        "completion seconds after the burst began: "
        f"heavy {sorted(round(at, 2) for at in finished['heavy'])}, "
        f"light {sorted(round(at, 2) for at in finished['light'])}; light's places {light_places}"
    )
    # Round robin: the light caller's 4 calls, queued behind 18 of the heavy caller's, alternate with them (first
    # come first served would have put them last, at places 21-24 of 24).
    assert max(light_places) <= 15, order
    assert max(finished["light"]) < max(finished["heavy"])
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(await scrape(client.client.app))
        for sample in family.samples
    }
    assert samples[("mcp_tasks_proxy_queued_calls", (("tool", "held"),))] == 0  # every queued call left the queue
    assert samples[("mcp_tasks_proxy_queue_wait_seconds_count", ())] >= 18  # 22 queued behind the first 2 or so


async def test_a_declaring_call_that_would_wait_becomes_a_task_at_once_whatever_its_window(
    tasks_client: ClientFactory,
) -> None:
    client = await tasks_client(
        upstream={"max_concurrent_calls": 1},
        tasks=policies(held={"sync_window_ms": 60_000}, sleep={"mode": "required"}),
    )
    first = await client.create("sleep", {"seconds": 2}, headers=as_caller("a"))
    status, message = await client.call("held", {"tag": "second", "seconds": 0}, headers=as_caller("b"))
    assert status == 200
    assert message["result"]["resultType"] == "task"  # not 60 s of window: it waits as a task
    second = message["result"]["taskId"]
    task = await client.until(second, lambda task: "statusMessage" in task, headers=as_caller("b"))
    assert (task["status"], task["statusMessage"]) == ("working", "queued: 0 ahead")
    done = await client.until(second, lambda task: task["status"] in TERMINAL, 20, headers=as_caller("b"))
    assert done["status"] == "completed"
    assert await client.until(first, lambda task: task["status"] in TERMINAL, 20, headers=as_caller("a"))


async def test_a_queued_task_cancelled_ends_cancelled_and_never_reaches_the_upstream(
    tasks_client: ClientFactory,
) -> None:
    client = await tasks_client(
        upstream={"max_concurrent_calls": 1}, tasks=policies(held={"mode": "required"}, counted={"mode": "required"})
    )
    key = uuid.uuid4().hex
    running = await client.create("held", {"tag": "running", "seconds": 1})
    queued = await client.create("counted", {"key": key})
    await client.until(queued, lambda task: str(task.get("statusMessage", "")).startswith("queued: "))
    status, ack = await client.post("tasks/cancel", {"taskId": queued})
    assert (status, ack["result"]["resultType"]) == (200, "complete")
    assert (await client.settled(queued))["status"] == "cancelled"
    assert (await client.settled(running))["status"] == "completed"
    assert await count_of(client, key) == 0  # the slot came free and the cancelled call never took it


async def test_a_synchronous_call_waits_its_turn_within_its_budget(tasks_client: ClientFactory) -> None:
    client = await tasks_client(upstream={"max_concurrent_calls": 1}, tasks=policies(sleep={"mode": "required"}))
    running = await client.create("sleep", {"seconds": 0.5})
    assert await client.text("held", {"tag": "waited", "seconds": 0}) == "waited"
    assert (await client.settled(running))["status"] == "completed"


async def test_a_synchronous_call_behind_a_full_queue_gets_503_with_retry_after_and_never_runs(
    tasks_client: ClientFactory,
) -> None:
    client = await tasks_client(
        upstream={"max_concurrent_calls": 1, "max_queue_wait_ms": 300}, tasks=policies(held={"mode": "required"})
    )
    key = uuid.uuid4().hex
    running = await client.create("held", {"tag": "running", "seconds": 2})
    params = {"name": "counted", "arguments": {"key": key}}
    response = await client.client.post(
        "/mcp",
        json=modern_body("tools/call", params, request_id=1, capabilities={}),
        headers=modern_headers("tools/call", "counted"),
    )
    message = await response.json()
    assert response.status == 503
    assert int(response.headers["Retry-After"]) >= 1
    error = message["error"]
    assert error["code"] == -32603
    assert error["data"]["limit"] == "max_concurrent_calls"
    assert error["data"]["retryAfterMs"] == int(response.headers["Retry-After"]) * 1000
    assert (await client.settled(running))["status"] == "completed"
    assert await count_of(client, key) == 0


async def test_an_mrtr_retry_needs_no_slot_while_new_work_waits(tasks_client: ClientFactory) -> None:
    client = await tasks_client(upstream={"max_concurrent_calls": 1}, tasks=policies(held={"mode": "required"}))
    params = {"name": "ask_name", "arguments": {}}
    _, parked = await client.post("tools/call", params, capabilities=ELICIT)
    assert parked["result"]["resultType"] == "input_required"  # the parked call holds the only slot
    behind = await client.create("held", {"tag": "behind", "seconds": 0})
    await client.until(behind, lambda task: str(task.get("statusMessage", "")).startswith("queued: "))
    (key,) = parked["result"]["inputRequests"]
    retry = {
        **params,
        "inputResponses": {key: {"action": "accept", "content": {"name": "Ada"}}},
        "requestState": parked["result"]["requestState"],
    }
    _, answered = await client.post("tools/call", retry, capabilities=ELICIT)
    assert answered["result"]["content"][0]["text"] == "Hello, Ada"
    assert (await client.settled(behind))["status"] == "completed"


async def test_tasks_queued_when_the_proxy_is_killed_run_after_the_restart_in_order(
    processes: list[ProxyProcess], own_upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sections = {
        "upstream": {"max_concurrent_calls": 1},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(sleep={"mode": "required"}, counted={"mode": "required"}),  # on_restart: fail
    }
    first = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(first)
    await first.start()
    key = uuid.uuid4().hex

    async def create(proxy: ProxyProcess, tool: str, arguments: dict[str, Any]) -> str:
        status, message = await rpc(http, proxy.url, "tools/call", {"name": tool, "arguments": arguments}, DECLARING)
        assert (status, message["result"]["resultType"]) == (200, "task"), message
        task_id: str = message["result"]["taskId"]
        return task_id

    running = await create(first, "sleep", {"seconds": 5})
    await until_started_upstream(own_upstream.url, "sleep", 0)
    queued = [await create(first, "counted", {"key": key}) for _ in range(3)]
    for place, task_id in enumerate(queued):
        task = await task_until(http, first.url, task_id, lambda task: "statusMessage" in task)
        assert task["statusMessage"] == f"queued: {place} ahead"
    first.stop()  # kill -9: nothing is written on the way out

    second = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(second)
    await second.start()
    failed = await task_until(http, second.url, running, lambda task: task["status"] != "working")
    assert failed["status"] == "failed"  # it had reached the upstream: on_restart says fail
    results = []
    for task_id in queued:
        done = await task_until(http, second.url, task_id, lambda task: task["status"] in TERMINAL)
        assert done["status"] == "completed", done  # never failed: it had never reached the upstream
        results.append(result_text(done))
    assert results == ["1", "2", "3"]  # each ran once, in the order they were queued


# --- quotas: limits.calls_per_minute_per_principal ------------------------------------------------------------


async def early_in_a_minute() -> None:
    """The quota's window is the UTC minute: start a test's calls where the window has 45 s left or more, so
    they all fall in one window."""

    def early() -> bool:
        return time.time() % 60 < 15

    await until(early, "no minute began", 65)


async def refused_call(client: Tasks, caller: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    response = await client.client.post(
        "/mcp",
        json=modern_body("tools/call", {"name": "echo", "arguments": {"text": "x"}}, request_id=1, capabilities={}),
        headers={**modern_headers("tools/call", "echo"), **as_caller(caller)},
    )
    message = await response.json()
    return response.status, dict(response.headers), message


async def test_a_caller_past_its_quota_gets_429_with_retry_after_and_the_ratelimit_fields(
    tasks_client: ClientFactory,
) -> None:
    client = await tasks_client(limits={"calls_per_minute_per_principal": 2})
    await early_in_a_minute()
    for _ in range(2):
        status, message = await client.call("echo", {"text": "x"}, capabilities={}, headers=as_caller("busy"))
        assert status == 200, message
    status, headers, message = await refused_call(client, "busy")
    assert status == 429
    retry_after = int(headers["Retry-After"])
    assert 1 <= retry_after <= 60
    assert headers["RateLimit-Policy"] == '"calls";q=2;w=60'
    assert headers["RateLimit"] == f'"calls";r=0;t={retry_after}'
    client.core.validate(message, "JSONRPCErrorResponse")
    assert message["error"]["code"] == -32603
    assert message["error"]["data"] == {
        "limit": "calls_per_minute_per_principal",
        "max": 2,
        "retryAfterMs": retry_after * 1000,
    }
    status, _ = await client.call("echo", {"text": "x"}, capabilities={}, headers=as_caller("other"))
    assert status == 200  # each caller has its own quota


async def test_two_replicas_on_postgresql_share_a_callers_quota(
    tasks_client: ClientFactory, pg_dsn: str, tmp_path: Path
) -> None:
    sections: dict[str, Any] = {
        "store": {"url": pg.as_url(pg_dsn), "lease_seconds": 3},
        "security": {"key_file": key_file(tmp_path)},  # replicas share the key: a caller is one caller on both
        "limits": {"calls_per_minute_per_principal": 3},
    }
    first, second = await tasks_client(**sections), await tasks_client(**sections)
    await early_in_a_minute()
    for replica in (first, second, first):
        status, message = await replica.call("echo", {"text": "x"}, capabilities={}, headers=as_caller("shared"))
        assert status == 200, message
    for replica in (second, first):
        status, _, message = await refused_call(replica, "shared")
        assert status == 429, message  # three calls in all, on either replica


# --- quotas of one tool: tasks.tools.<key>.calls_per_minute_per_principal -------------------------------------

ECHO_QUOTA = "tasks.tools.echo.calls_per_minute_per_principal"


async def refusals(client: Tasks, limit: str) -> float:
    for family in text_string_to_metric_families(await scrape(client.client.app)):
        for sample in family.samples:
            if sample.name == "mcp_tasks_proxy_limit_refusals_total" and sample.labels == {"limit": limit}:
                return float(sample.value)
    return 0.0


async def test_a_tools_quota_refuses_its_next_call_while_another_tool_still_runs(
    tasks_client: ClientFactory,
) -> None:
    client = await tasks_client(tasks=policies(echo={"calls_per_minute_per_principal": 2}, sleep={"mode": "required"}))
    await early_in_a_minute()
    running = await client.create("sleep", {"seconds": 1}, headers=as_caller("busy"))
    for _ in range(2):
        status, message = await client.call("echo", {"text": "x"}, capabilities={}, headers=as_caller("busy"))
        assert status == 200, message
    status, headers, message = await refused_call(client, "busy")
    assert status == 429
    retry_after = int(headers["Retry-After"])
    assert 1 <= retry_after <= 60
    assert headers["RateLimit-Policy"] == '"tool:echo";q=2;w=60'  # the tool's policy, not the global `calls`
    assert headers["RateLimit"] == f'"tool:echo";r=0;t={retry_after}'
    client.core.validate(message, "JSONRPCErrorResponse")
    assert message["error"]["code"] == -32603
    assert message["error"]["data"] == {"limit": ECHO_QUOTA, "max": 2, "retryAfterMs": retry_after * 1000}
    assert await refusals(client, ECHO_QUOTA) == 1
    status, message = await client.call("held", {"tag": "x", "seconds": 0}, capabilities={}, headers=as_caller("busy"))
    assert status == 200, message  # another tool of the same caller is not held back
    assert (await client.task(running, headers=as_caller("busy")))["status"] == "working"  # ran on meanwhile
    done = await client.until(running, lambda task: task["status"] in TERMINAL, 15, headers=as_caller("busy"))
    assert done["status"] == "completed"
    status, _ = await client.call("echo", {"text": "x"}, capabilities={}, headers=as_caller("other"))
    assert status == 200  # each caller has its own quota of the tool


async def test_the_global_and_a_tools_quota_apply_together_and_both_are_listed(
    tasks_client: ClientFactory,
) -> None:
    client = await tasks_client(
        limits={"calls_per_minute_per_principal": 3}, tasks=policies(echo={"calls_per_minute_per_principal": 1})
    )
    await early_in_a_minute()
    status, message = await client.call("echo", {"text": "x"}, capabilities={}, headers=as_caller("both"))
    assert status == 200, message
    status, headers, message = await refused_call(client, "both")  # the tool's one call is spent
    assert status == 429
    retry_after = int(headers["Retry-After"])
    assert headers["RateLimit-Policy"] == '"calls";q=3;w=60, "tool:echo";q=1;w=60'
    assert headers["RateLimit"] == f'"calls";r=1;t={retry_after}, "tool:echo";r=0;t={retry_after}'
    assert message["error"]["data"]["limit"] == ECHO_QUOTA
    status, message = await client.call("held", {"tag": "x", "seconds": 0}, capabilities={}, headers=as_caller("both"))
    assert status == 200, message  # the third call of the window: the global quota's last
    response = await client.client.post(
        "/mcp",
        json=modern_body("tools/call", {"name": "held", "arguments": {"tag": "x"}}, request_id=1, capabilities={}),
        headers={**modern_headers("tools/call", "held"), **as_caller("both")},
    )
    assert response.status == 429  # now the global quota: a tool without a quota of its own is refused too
    assert response.headers["RateLimit-Policy"] == '"calls";q=3;w=60'
    assert (await response.json())["error"]["data"]["limit"] == "calls_per_minute_per_principal"
    assert await refusals(client, ECHO_QUOTA) == 1
    assert await refusals(client, "calls_per_minute_per_principal") == 1


async def test_two_replicas_on_postgresql_share_a_callers_quota_of_one_tool(
    tasks_client: ClientFactory, pg_dsn: str, tmp_path: Path
) -> None:
    sections: dict[str, Any] = {
        "store": {"url": pg.as_url(pg_dsn), "lease_seconds": 3},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(echo={"calls_per_minute_per_principal": 3}),
    }
    first, second = await tasks_client(**sections), await tasks_client(**sections)
    await early_in_a_minute()
    for replica in (first, second, first):
        status, message = await replica.call("echo", {"text": "x"}, capabilities={}, headers=as_caller("shared"))
        assert status == 200, message
    for replica in (second, first):
        status, _, message = await refused_call(replica, "shared")
        assert status == 429, message  # three calls of the tool in all, on either replica
        assert message["error"]["data"]["limit"] == ECHO_QUOTA
    assert await second.text("held", {"tag": "other tool", "seconds": 0}) == "other tool"


async def test_a_tool_with_a_cap_of_its_own_runs_one_at_a_time_while_other_tools_go_on(
    tasks_client: ClientFactory, upstream: Upstream
) -> None:
    client = await tasks_client(tasks=policies(held={"mode": "required", "max_concurrent": 1}))  # no upstream cap
    await held_at_once(upstream.url, reset=True)
    task_ids = await asyncio.gather(
        *(another(client).create("held", {"tag": f"held-{n}", "seconds": HOLD_SECONDS}) for n in range(4))
    )
    assert await client.text("echo", {"text": "not held back"}) == "not held back"
    for task_id in task_ids:
        assert (await client.settled(task_id))["status"] == "completed"
    assert (await held_at_once(upstream.url))["most"] == 1


# --- the queued place kept up to date -------------------------------------------------------------------------


def queued_place(task: dict[str, Any]) -> int | None:
    message = str(task.get("statusMessage", ""))
    if not message.startswith("queued: "):
        return None
    return int(message.removeprefix("queued: ").removesuffix(" ahead"))


async def test_a_queued_tasks_place_falls_in_the_store_as_the_calls_before_it_finish(
    tasks_client: ClientFactory, pg_dsn: str, tmp_path: Path
) -> None:
    shared: dict[str, Any] = {
        "store": {"url": pg.as_url(pg_dsn), "lease_seconds": 3},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(held={"mode": "required"}),
    }
    queueing = await tasks_client(upstream={"max_concurrent_calls": 1}, **shared)
    reader = await tasks_client(**shared)  # another replica: it sees only what the store holds
    running = await queueing.create("held", {"tag": "running", "seconds": 1})
    queued = [await queueing.create("held", {"tag": f"queued-{n}", "seconds": 1}) for n in range(4)]
    last = queued[-1]
    places: list[int] = []
    while True:
        task = await reader.task(last)
        place = queued_place(task)
        if place is not None and (not places or places[-1] != place):
            places.append(place)
        if task["status"] in TERMINAL:
            break
        await asyncio.sleep(0.1)
    assert task["status"] == "completed"
    assert result_text(task) == "queued-3"  # it ran, last
    assert places == [3, 2, 1, 0], places  # each call that finished before it moved it up one place
    assert (await queueing.settled(running))["status"] == "completed"


# --- the caps read live ---------------------------------------------------------------------------------------


async def applied_reloads(http: aiohttp.ClientSession, proxy: ProxyProcess) -> float:
    async with http.get(proxy.ops_url("/metrics")) as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mcp_tasks_proxy_config_reloads_total" and sample.labels == {"result": "applied"}:
                return float(sample.value)
    return 0.0


async def reload_with(http: aiohttp.ClientSession, proxy: ProxyProcess, **sections: dict[str, Any]) -> None:
    """Rewrite the proxy's config file with `sections` merged in, SIGHUP it and wait until the reload applied."""
    before = await applied_reloads(http, proxy)
    config: dict[str, Any] = yaml.safe_load(proxy.config.read_text())
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    proxy.config.write_text(yaml.safe_dump(config))
    assert proxy.process is not None
    os.kill(proxy.process.pid, signal.SIGHUP)

    async def applied() -> bool:
        return await applied_reloads(http, proxy) > before

    await until(applied, "the reload applied")


async def held_task(http: aiohttp.ClientSession, proxy: ProxyProcess, tag: str, seconds: float) -> str:
    params = {"name": "held", "arguments": {"tag": tag, "seconds": seconds}}
    status, message = await rpc(http, proxy.url, "tools/call", params, DECLARING)
    assert (status, message["result"]["resultType"]) == (200, "task"), message
    task_id: str = message["result"]["taskId"]
    return task_id


async def live_proxy(tmp_path: Path, server: Upstream, processes: list[ProxyProcess], **sections: Any) -> ProxyProcess:
    proxy = ProxyProcess(tmp_path, server.url, tasks=policies(held={"mode": "required"}), **sections)
    processes.append(proxy)
    await proxy.start()
    return proxy


@pytest.mark.parametrize("new_cap", [4, 0], ids=["raised", "removed"])
async def test_a_cap_raised_or_removed_by_a_reload_starts_the_queued_calls_at_once(
    new_cap: int,
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
) -> None:
    proxy = await live_proxy(tmp_path, own_upstream, processes, upstream={"max_concurrent_calls": 1})
    task_ids = [await held_task(http, proxy, f"held-{n}", 4) for n in range(4)]
    await task_until(http, proxy.url, task_ids[-1], lambda task: queued_place(task) is not None)
    assert (await held_at_once(own_upstream.url))["now"] == 1
    await reload_with(http, proxy, upstream={"max_concurrent_calls": new_cap})

    async def all_running() -> bool:
        return (await held_at_once(own_upstream.url))["now"] == 4

    await until(all_running, "the queued calls started", 2)  # long before the first one's 4 s are up
    for task_id in task_ids:
        done = await task_until(http, proxy.url, task_id, lambda task: task["status"] in TERMINAL)
        assert done["status"] == "completed", done


async def test_a_cap_lowered_by_a_reload_lets_the_running_calls_finish_and_admits_only_below_it(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = await live_proxy(tmp_path, own_upstream, processes, upstream={"max_concurrent_calls": 3})
    running = [await held_task(http, proxy, f"running-{n}", 2) for n in range(3)]
    queued = [await held_task(http, proxy, f"queued-{n}", 1.5) for n in range(3)]
    await task_until(http, proxy.url, queued[-1], lambda task: queued_place(task) is not None)
    await reload_with(http, proxy, upstream={"max_concurrent_calls": 1})
    assert (await held_at_once(own_upstream.url))["now"] == 3  # none stopped, none more started
    for task_id in running:
        done = await task_until(http, proxy.url, task_id, lambda task: task["status"] in TERMINAL)
        assert done["status"] == "completed", done  # the calls running went on to their end
    await held_at_once(own_upstream.url, reset=True)  # the most from now on
    for task_id in queued:
        done = await task_until(http, proxy.url, task_id, lambda task: task["status"] in TERMINAL)
        assert done["status"] == "completed", done
    assert (await held_at_once(own_upstream.url))["most"] == 1  # the queued calls went one at a time


@pytest.mark.parametrize(
    "cap",
    [{"upstream": {"max_concurrent_calls": 1}}, {"tasks": policies(held={"mode": "required", "max_concurrent": 1})}],
    ids=["upstream", "tool"],
)
async def test_a_cap_set_by_a_reload_where_none_was_at_start_applies(
    cap: dict[str, dict[str, Any]],
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
) -> None:
    proxy = await live_proxy(tmp_path, own_upstream, processes)  # no cap at all: no queue
    await reload_with(http, proxy, **cap)
    await held_at_once(own_upstream.url, reset=True)
    task_ids = [await held_task(http, proxy, f"held-{n}", 0.5) for n in range(3)]
    await task_until(http, proxy.url, task_ids[-1], lambda task: queued_place(task) is not None)
    for task_id in task_ids:
        done = await task_until(http, proxy.url, task_id, lambda task: task["status"] in TERMINAL)
        assert done["status"] == "completed", done
    assert (await held_at_once(own_upstream.url))["most"] == 1
