"""Fault tests (`faults` marker): a killed proxy, a killed upstream, hostile input, many pollers at once.

Real processes on loopback, bounded in time. Nothing committed may be lost, no client input may produce a 5xx,
and every task must end in a clear state.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.app import UPSTREAM
from tests.conftest import DECLARING, TASKS, ClientFactory, ProxyProcess, Tasks, Upstream, policies, result_text

pytestmark = pytest.mark.faults

ELICIT_TASKS: dict[str, Any] = {**DECLARING, "elicitation": {}}


def meta(capabilities: dict[str, Any]) -> dict[str, Any]:
    return {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": capabilities,
    }


async def rpc(
    session: aiohttp.ClientSession, url: str, method: str, params: dict[str, Any], capabilities: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta(capabilities)}}
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": method,
    }
    name = params.get("taskId", params.get("name"))
    if isinstance(name, str):
        headers["Mcp-Name"] = name
    async with session.post(url, json=body, headers=headers) as response:
        text = await response.text()
        status = response.status
    last = [line for line in text.splitlines() if line.startswith("data:")] or [text]
    message: dict[str, Any] = json.loads(last[-1].removeprefix("data:").strip())
    return status, message


async def task_state(session: aiohttp.ClientSession, url: str, task_id: str) -> dict[str, Any]:
    status, message = await rpc(session, url, "tasks/get", {"taskId": task_id}, DECLARING)
    assert status == 200, message
    result: dict[str, Any] = message["result"]
    return result


async def until(session: aiohttp.ClientSession, url: str, task_id: str, done: Callable[[dict[str, Any]], bool]) -> Any:
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        task = await task_state(session, url, task_id)
        if done(task):
            return task
        assert asyncio.get_running_loop().time() < deadline, task
        await asyncio.sleep(0.05)


# --- a killed proxy --------------------------------------------------------------------------------------------


async def test_kill_9_loses_nothing_committed(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    """kill -9 with tasks working and waiting for input: at the next start every task resolves (failed with the
    restart message, or re-run per policy), the completed result is intact, the database is sound."""
    database = tmp_path / "faults.db"
    sections: dict[str, Any] = {
        "store": {"path": str(database)},
        "tasks": policies(
            echo={"mode": "required"},
            sleep={"mode": "required"},
            ask_name={"mode": "required"},
            counted={"mode": "required", "on_restart": "rerun"},
        ),
    }
    first = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(first)
    await first.start()
    async with aiohttp.ClientSession() as session:

        async def create(tool: str, arguments: dict[str, Any]) -> str:
            params = {"name": tool, "arguments": arguments}
            status, message = await rpc(session, first.url, "tools/call", params, ELICIT_TASKS)
            assert status == 200, message
            task_id: str = message["result"]["taskId"]
            return task_id

        done = await create("echo", {"text": "kept"})
        await until(session, first.url, done, lambda task: task["status"] == "completed")
        working = await create("sleep", {"seconds": 30})
        waiting = await create("ask_name", {})
        await until(session, first.url, waiting, lambda task: task["status"] == "input_required")
        rerun = await create("counted", {"key": "kill-9", "seconds": 0.5})
        await asyncio.to_thread(first.stop)  # SIGKILL

        second = ProxyProcess(tmp_path, own_upstream.url, **sections)
        processes.append(second)
        await second.start()
        for task_id in (working, waiting):
            failed = await task_state(session, second.url, task_id)
            assert failed["status"] == "failed"
            assert "restarted" in failed["error"]["message"]
        again = await until(session, second.url, rerun, lambda task: task["status"] == "completed")
        assert result_text(again) in ("1", "2")  # sent again; the first run may or may not have reached the upstream
        kept = await task_state(session, second.url, done)
        assert result_text(kept) == "kept"
    with sqlite3.connect(database) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)


# --- a killed upstream ---------------------------------------------------------------------------------------------


async def test_an_upstream_killed_mid_call_fails_clearly_and_the_proxy_recovers(
    tasks_client: ClientFactory, own_upstream: Upstream
) -> None:
    """kill -9 of the upstream with a task and a sync call running: the task fails with a message naming the
    upstream, the sync caller gets a gateway error, the proxy keeps serving, and once the upstream is back (with
    none of its old sessions) calls work again on a new session."""
    client = await tasks_client(own_upstream.url, tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 30})
    sync_client = Tasks(client.client, client.core, client.tasks)
    sync_call = asyncio.get_running_loop().create_task(
        sync_client.call("slow_compute", {"seconds": 30, "label": "cut"}, capabilities={})
    )
    pool = client.client.app[UPSTREAM]
    deadline = asyncio.get_running_loop().time() + 10
    while pool.calls_in_flight < 2:  # both calls are open upstream
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    assert own_upstream.process is not None
    port = own_upstream.port
    own_upstream.process.kill()
    await asyncio.to_thread(own_upstream.process.wait)
    failed = await client.settled(task_id)
    assert failed["status"] == "failed"
    assert "Upstream" in failed["error"]["message"]
    status, message = await sync_call
    assert status in (502, 504), message
    assert message["error"]["code"] == -32603
    status, message = await client.call("echo", {"text": "down"}, capabilities={})
    assert status in (502, 504)  # the proxy answers, as a gateway, while the upstream is away
    await asyncio.to_thread(own_upstream.start, port)
    status, message = await client.call("echo", {"text": "back"}, capabilities={})
    assert status == 200, message
    assert message["result"]["content"][0]["text"] == "back"


# --- many pollers ------------------------------------------------------------------------------------------------


async def test_two_hundred_pollers_while_tasks_come_and_go(tasks_client: ClientFactory) -> None:
    """200 clients poll tasks/get while tasks are created and settle: no errors, no task lost."""
    client = await tasks_client(tasks={**policies(counted={"mode": "required"}), "max_running": 4096})
    task_ids: list[str] = []
    errors: list[Any] = []
    creating = True

    async def creator() -> None:
        for number in range(60):
            task_ids.append(await client.create("counted", {"key": f"poll-{number}", "seconds": 0.2}))

    async def poller(seed: int) -> None:
        rng = random.Random(seed)
        poller_client = Tasks(client.client, client.core, client.tasks)
        while creating or rng.random() < 0.5:
            if task_ids:
                status, message = await poller_client.get(rng.choice(task_ids))
                if status != 200:
                    errors.append(message)
            await asyncio.sleep(rng.uniform(0, 0.05))

    pollers = [asyncio.get_running_loop().create_task(poller(seed)) for seed in range(200)]
    await creator()
    creating = False
    await asyncio.gather(*pollers)
    assert errors == []
    for task_id in task_ids:
        done = await client.settled(task_id)
        assert done["status"] == "completed"
    assert len(set(task_ids)) == 60


# --- hostile input ------------------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
METHODS = st.sampled_from(
    [
        "tools/call",
        "tools/list",
        "tasks/get",
        "tasks/update",
        "tasks/cancel",
        "tasks/result",
        "tasks/list",
        "server/discover",
        "prompts/get",
        "resources/read",
        "initialize",
        "ping",
        "subscriptions/listen",
    ]
) | st.text(max_size=20)
META = st.one_of(
    st.just(meta({})),
    st.just(meta({"extensions": {TASKS: {}}})),
    st.dictionaries(
        st.sampled_from(
            [
                "io.modelcontextprotocol/protocolVersion",
                "io.modelcontextprotocol/clientCapabilities",
                "io.modelcontextprotocol/clientInfo",
                "progressToken",
            ]
        ),
        JSON_VALUES,
    ),
    JSON_VALUES,
)
PARAMS = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["echo", "sleep", "ask_name"]) | JSON_VALUES,
        "arguments": JSON_VALUES,
        "taskId": st.sampled_from(["task_x", ""]) | JSON_VALUES,
        "inputResponses": JSON_VALUES,
        "requestState": st.text(max_size=200) | JSON_VALUES,
        "_meta": META,
        "uri": JSON_VALUES,
    },
)
HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f"), max_size=40)
REQUESTS = st.fixed_dictionaries(
    {
        "method": METHODS,
        "params": PARAMS | JSON_VALUES,
        "id": st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=10) | JSON_VALUES,
        "shape": st.sampled_from(["object", "batch", "raw", "huge", "no-jsonrpc"]),
        "raw": st.binary(max_size=64),
        "version_header": st.sampled_from(["2026-07-28", "2025-11-25", "", "v999"]) | HEADER_TEXT,
        "method_header": st.none() | METHODS.filter(lambda text: all(32 <= ord(c) <= 126 for c in text)),
        "name_header": st.none() | HEADER_TEXT,
    }
)
ALLOWED_CODES = {
    400: {-32700, -32600, -32602, -32020, -32021, -32022},
    404: {-32601},
    405: {-32600},
    413: {-32600},
}


@pytest.fixture(scope="module")
def hostile_proxy(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[ProxyProcess]:
    tmp_path = tmp_path_factory.mktemp("hostile")
    proxy = ProxyProcess(
        tmp_path, upstream.url, security={"max_body_bytes": 65536}, tasks=policies(sleep={"mode": "required"})
    )
    asyncio.run(proxy.start())
    yield proxy
    proxy.stop()


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(REQUESTS)
def test_hostile_requests_never_get_a_5xx(
    hostile_proxy: ProxyProcess, upstream: Upstream, request_data: dict[str, Any]
) -> None:
    """Malformed, oversized, wrongly typed and wrongly headed requests: never a 5xx from the proxy, never a
    crash, and every error of its own is a JSON-RPC error whose code fits its HTTP status. A request classified
    as legacy is relayed verbatim, so its answer must be exactly what the upstream gives a direct client."""
    message = {"jsonrpc": "2.0", "id": request_data["id"], "method": request_data["method"]}
    message["params"] = request_data["params"]
    shape = request_data["shape"]
    if shape == "batch":
        body = json.dumps([message, message]).encode()
    elif shape == "raw":
        body = request_data["raw"]
    elif shape == "huge":
        body = json.dumps({**message, "padding": "x" * 70_000}).encode()
    elif shape == "no-jsonrpc":
        body = json.dumps({key: value for key, value in message.items() if key != "jsonrpc"}).encode()
    else:
        body = json.dumps(message).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if request_data["version_header"]:
        headers["MCP-Protocol-Version"] = request_data["version_header"]
    if request_data["method_header"] is not None:
        headers["Mcp-Method"] = request_data["method_header"]
    if request_data["name_header"] is not None:
        headers["Mcp-Name"] = request_data["name_header"]
    status, text = post(hostile_proxy.port, headers, body)
    assert hostile_proxy.process is not None
    assert hostile_proxy.process.poll() is None, "the proxy died"
    if status < 400:
        return
    direct_status, direct_text = post(upstream.port, headers, body)
    if (status, text) == (direct_status, direct_text):
        return  # a legacy request relayed verbatim: the upstream's own answer, as a direct client gets it
    assert status < 500, (status, text[:300])
    error = json.loads(text)["error"]
    assert error["code"] in ALLOWED_CODES.get(status, {-32600, -32602}), (status, error)


def post(port: int, headers: dict[str, str], body: bytes) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("POST", "/mcp")
        for name, value in headers.items():
            connection.putheader(name, value.encode("latin-1"))
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", errors="replace")
    finally:
        connection.close()
