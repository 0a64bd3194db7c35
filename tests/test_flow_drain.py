"""End to end: the drain on SIGTERM, with real processes and real signals (`python -m proxy serve` in front of
the legacy fixture upstream; `os.kill`). While it drains, a replica is unready but alive, serves the work it
holds (task lookups, MRTR retries, listen streams, legacy sessions) and refuses new calls with 503 and
Retry-After; it exits 0 as soon as nothing of its own runs. Waiting is by polling with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import main
from tests.support.processes import ROOT, ProxyProcess, Upstream
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, parse_sse

ELICIT: dict[str, Any] = {"elicitation": {}}
TOOLS: dict[str, Any] = {"sleep": {"sync_window_ms": 0}}  # a declaring client's sleep is a task at once
LEGACY_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


async def post(
    http: aiohttp.ClientSession, url: str, method: str, params: dict[str, Any], **meta: Any
) -> tuple[int, CIMultiDict[str], dict[str, Any]]:
    name = params.get("name") or params.get("taskId")
    async with http.post(url, json=modern_body(method, params, **meta), headers=modern_headers(method, name)) as answer:
        text = await answer.text()
        messages = parse_sse(text) if answer.content_type == "text/event-stream" else [json.loads(text)]
        return answer.status, CIMultiDict(answer.headers), messages[-1]


async def status_of(http: aiohttp.ClientSession, base: str, path: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{base}{path}") as answer:
        return answer.status, await answer.json()


async def metric(http: aiohttp.ClientSession, proxy: ProxyProcess, name: str) -> float:
    async with http.get(proxy.ops_url("/metrics")) as answer:
        text = await answer.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no metric {name}")


async def legacy(
    http: aiohttp.ClientSession, url: str, method: str, session: str | None, request_id: int = 1
) -> tuple[int, CIMultiDict[str], str]:
    params: dict[str, Any] = {}
    if method == "initialize":
        params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    headers = {**LEGACY_HEADERS, **({"Mcp-Session-Id": session} if session else {})}
    body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    async with http.post(url, json=body, headers=headers) as answer:
        return answer.status, CIMultiDict(answer.headers), await answer.text()


async def stored_status(database: Path, task_id: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["tasks", "show", task_id, "--db", str(database)]) == 0
    return str(json.loads(capsys.readouterr().out)["status"])


async def exited(proxy: ProxyProcess, timeout_seconds: float = 60) -> int:
    assert proxy.process is not None
    return await asyncio.to_thread(proxy.process.wait, timeout_seconds)


def drain_reasons(proxy: ProxyProcess) -> list[str]:
    """Why each drain of the proxy's process ended, as its log says (`idle`: nothing of its own ran any more)."""
    return [event["reason"] for event in proxy.events() if event["event"] == "drain_finished"]


async def test_an_idle_proxy_exits_0_at_once_on_sigterm(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    proxy = ProxyProcess(tmp_path, upstream.url)  # the default drain of 20 s: nothing runs, so it is not used
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    started = time.monotonic()
    os.kill(proxy.process.pid, signal.SIGTERM)
    assert await exited(proxy) == 0
    assert time.monotonic() - started < 5  # measured well under 1 s alone (benchmarks: sigterm_idle)
    assert drain_reasons(proxy) == ["idle"]


async def test_a_draining_replica_serves_what_it_holds_refuses_new_calls_and_exits_when_done(
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    proxy = ProxyProcess(tmp_path, own_upstream.url, tasks={"tools": TOOLS, "drain_seconds": 40})
    processes.append(proxy)
    await proxy.start()
    base = proxy.url.removesuffix("/mcp")
    assert proxy.process is not None

    # Work held when SIGTERM arrives: two tasks, a synchronous call, a parked MRTR round, a listen stream and a
    # legacy session.
    tasks = []
    for _ in range(2):
        status, _, created = await post(
            http, proxy.url, "tools/call", {"name": "sleep", "arguments": {"seconds": 2}}, capabilities=DECLARING
        )
        assert status == 200, created
        tasks.append(created["result"]["taskId"])
    sync_call = asyncio.get_running_loop().create_task(
        post(http, proxy.url, "tools/call", {"name": "sleep", "arguments": {"seconds": 2}})
    )
    ask = {"name": "ask_name", "arguments": {}}
    _, _, round_one = await post(http, proxy.url, "tools/call", ask, capabilities=ELICIT)
    assert round_one["result"]["resultType"] == "input_required", round_one
    listen_body = modern_body("subscriptions/listen", {"notifications": {"toolsListChanged": True}}, request_id="L")
    listen = await http.post(proxy.url, json=listen_body, headers=modern_headers("subscriptions/listen"))
    assert listen.status == 200
    init_status, init_headers, _ = await legacy(http, proxy.url, "initialize", None)
    assert init_status == 200
    legacy_session = init_headers["Mcp-Session-Id"]

    async def all_running() -> bool:  # two tasks and the parked round, plus the sync call as a call and a request
        return await metric(http, proxy, "mcp_tasks_proxy_drain_calls_left") >= 5

    await until(all_running, "the sync call runs")

    sent = time.monotonic()
    os.kill(proxy.process.pid, signal.SIGTERM)

    async def unready() -> bool:
        status, body = await status_of(http, proxy.ops_url(""), "/readyz")
        return status == 503 and "draining" in body["reasons"]

    await until(unready, "/readyz turns 503 (draining)")
    assert (await status_of(http, base, "/healthz"))[0] == 200
    assert await metric(http, proxy, "mcp_tasks_proxy_draining") == 1
    assert await metric(http, proxy, "mcp_tasks_proxy_drain_calls_left") >= 3
    drainz_status, drainz = await status_of(http, base, "/drainz?wait=0")
    assert (drainz_status, drainz["status"]) == (503, "draining")

    # A new call goes elsewhere: 503, Retry-After, nothing started.
    status, headers, refused = await post(http, proxy.url, "tools/call", {"name": "echo", "arguments": {"text": "x"}})
    assert status == 503
    assert headers["Retry-After"] == "1"
    assert refused["error"]["data"] == {"reason": "draining"}
    new_session, new_headers, _ = await legacy(http, proxy.url, "initialize", None)
    assert (new_session, new_headers.get("Retry-After")) == (503, "1")

    # What it holds is served: lookups, the MRTR retry, the legacy session, the listen stream.
    status, _, looked_up = await post(http, proxy.url, "tasks/get", {"taskId": tasks[0]}, capabilities=DECLARING)
    assert status == 200
    assert looked_up["result"]["status"] == "working"
    retry = {
        **ask,
        "inputResponses": {"elicitation-1": {"action": "accept", "content": {"name": "Ada"}}},
        "requestState": round_one["result"]["requestState"],
    }
    status, _, answered = await post(http, proxy.url, "tools/call", retry, capabilities=ELICIT)
    assert status == 200
    assert answered["result"]["content"][0]["text"] == "Hello, Ada"
    listed_status, _, listed = await legacy(http, proxy.url, "tools/list", legacy_session, request_id=2)
    assert listed_status == 200
    assert '"tools"' in listed
    assert not listen.closed

    # Everything it held ends within the drain, and the process exits 0 right after (not at the drain's end).
    sync_status, _, sync_answer = await sync_call
    assert sync_status == 200
    assert sync_answer["result"]["content"][0]["text"] == "slept 2"
    assert await exited(proxy) == 0
    assert time.monotonic() - sent < 20
    ended = parse_sse(await listen.text())
    assert ended[-1]["id"] == "L"
    assert "result" in ended[-1]  # the listen stream ended with its result
    for task_id in tasks:
        assert await stored_status(tmp_path / "ops.db", task_id, capsys) == "completed"
    assert drain_reasons(proxy) == ["idle"]


async def test_a_task_longer_than_the_drain_is_left_as_at_any_stop(
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sections = {"tasks": {"tools": TOOLS, "drain_seconds": 1}}
    proxy = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    _, _, created = await post(
        http, proxy.url, "tools/call", {"name": "sleep", "arguments": {"seconds": 60}}, capabilities=DECLARING
    )
    task_id = created["result"]["taskId"]
    started = time.monotonic()
    os.kill(proxy.process.pid, signal.SIGTERM)
    assert await exited(proxy) == 0
    assert time.monotonic() - started < 15  # the drain (1 s) and the final shutdown, not the task's 60 s
    timed_out = [event for event in proxy.events() if event["event"] == "drain_timed_out"]
    assert [event["calls_left"] for event in timed_out] == [1]
    assert await stored_status(tmp_path / "ops.db", task_id, capsys) == "working"  # the next start fails or re-runs it

    again = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(again)
    await again.start()
    _, _, looked_up = await post(http, again.url, "tasks/get", {"taskId": task_id}, capabilities=DECLARING)
    assert looked_up["result"]["status"] == "failed"
    assert "restarted" in looked_up["result"]["error"]["message"]
    assert await again.terminate() == 0


async def test_a_second_sigterm_ends_the_drain_at_once(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = ProxyProcess(tmp_path, own_upstream.url, tasks={"tools": TOOLS, "drain_seconds": 60})
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    _, _, created = await post(
        http, proxy.url, "tools/call", {"name": "sleep", "arguments": {"seconds": 60}}, capabilities=DECLARING
    )
    assert created["result"]["taskId"]
    base = proxy.url.removesuffix("/mcp")
    os.kill(proxy.process.pid, signal.SIGTERM)

    async def draining() -> bool:
        return (await status_of(http, base, "/readyz"))[0] == 503

    await until(draining, "the drain began")
    started = time.monotonic()
    os.kill(proxy.process.pid, signal.SIGTERM)
    assert await exited(proxy) == 0
    assert time.monotonic() - started < 15
    assert any(event["event"] == "drain_cut_short" for event in proxy.events())


async def test_a_stdio_server_outlives_the_drain_and_is_stopped_after_it(
    tmp_path: Path,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = [sys.executable, "-m", "tests.upstream", "--stdio"]
    stdio = {"url": None, "command": command, "cwd": str(ROOT), "connect_timeout_seconds": 20}
    proxy = ProxyProcess(tmp_path, "", upstream=stdio, tasks={"tools": TOOLS, "drain_seconds": 30})
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    _, _, created = await post(
        http, proxy.url, "tools/call", {"name": "sleep", "arguments": {"seconds": 2}}, capabilities=DECLARING
    )
    task_id = created["result"]["taskId"]
    sync_call = asyncio.get_running_loop().create_task(
        post(http, proxy.url, "tools/call", {"name": "sleep", "arguments": {"seconds": 2}})
    )

    async def both_running() -> bool:  # the task, plus the sync call as a call and a request
        return await metric(http, proxy, "mcp_tasks_proxy_drain_calls_left") >= 3

    await until(both_running, "the task and the sync call run")
    os.kill(proxy.process.pid, signal.SIGTERM)
    status, _, answer = await sync_call
    assert status == 200
    assert answer["result"]["content"][0]["text"] == "slept 2"  # the server process still ran it
    assert await exited(proxy) == 0
    events = proxy.events()
    names = [event["event"] for event in events]
    assert names.index("drain_finished") < names.index("upstream_process_exited")
    assert await stored_status(tmp_path / "ops.db", task_id, capsys) == "completed"
