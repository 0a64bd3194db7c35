"""A stdio upstream's processes: who gets one, how many run, when they stop. Against the real mcp 1.x fixture
run as a stdio server by the proxy (in-process app, and `serve -- CMD` as a child process)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.cli import main
from proxy.config.loader import load_config
from proxy.config.schema import StdioUpstreamConfig
from proxy.edge._app_keys import POOL
from proxy.upstream.stdio.session import StdioSession
from tests.support.clients import Tasks, rpc
from tests.support.processes import ROOT, STDIO_FIXTURE, ProxyProcess, children, stdio_sessions, stdio_upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until
from tests.support.wire import DECLARING, policies, result_text

ELICIT: dict[str, Any] = {"elicitation": {}}


def child_pids(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def stdio_client(
    make_proxy: Callable[..., Any], core_schema: ModernSchema, tasks_schema: SchemaValidator, **sections: Any
) -> Tasks:
    upstream = stdio_upstream(**sections.pop("upstream", {}))
    return Tasks(await make_proxy("", upstream=upstream, **sections), core_schema, tasks_schema)


async def test_calls_that_can_ask_get_a_process_of_their_own_the_others_share_one(
    make_proxy: Callable[..., Any], modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    client = await stdio_client(make_proxy, modern_schema, tasks_schema)
    pool = client.client.app[POOL]
    others = [Tasks(client.client, modern_schema, tasks_schema) for _ in range(2)]  # one request at a time each
    quiet = [asyncio.get_running_loop().create_task(other.text("sleep", {"seconds": 1.0})) for other in others]
    shared = pool.session(None)
    assert isinstance(shared, StdioSession)
    await until(lambda: shared.in_flight == 2, "two quiet calls do not share the principal's process")
    assert not [session for session in stdio_sessions(client) if session.in_flight and session is not shared]
    _, message = await client.call("ask_name", capabilities=ELICIT)  # parked: an MRTR round
    assert message["result"]["resultType"] == "input_required"
    [own] = [session for session in stdio_sessions(client) if session.lending.lent]
    assert own is not shared  # lent to that call alone: its questions are the call's
    assert own.pid not in (None, shared.pid)
    [warm] = pool.spare_sessions(None)  # a spare started meanwhile, for this caller's next such call
    await until(lambda: warm.initialize_result is not None, "the spare process did not start")
    assert await asyncio.gather(*quiet) == ["slept 1", "slept 1"]


async def test_an_idle_lent_process_stops_and_the_shared_one_stays(
    make_proxy: Callable[..., Any], modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    client = await stdio_client(make_proxy, modern_schema, tasks_schema, upstream={"process_idle_seconds": 0.5})
    assert await client.text("echo", {"text": "x"}) == "x"
    _, message = await client.call("echo", {"text": "y"}, capabilities=ELICIT)
    assert message["result"]["content"][0]["text"] == "y"
    pool = client.client.app[POOL]
    spares = pool.spare_sessions(None)
    assert spares  # the one lent, and a warm one started for the next call that can ask
    shared = pool.session(None)
    await until(lambda: pool.sessions() == [shared], "idle spare processes were not stopped")
    assert all(spare.initialize_result is None for spare in spares)
    assert shared.initialize_result is not None


async def test_at_max_processes_a_call_waits_then_gets_a_limit_error(
    make_proxy: Callable[..., Any], modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    """A task waiting for an answer keeps its process; with none left to lend, a call that could ask waits
    (bounded), then gets 503 naming the limit; once the task goes on, the process is lent again."""
    client = await stdio_client(
        make_proxy,
        modern_schema,
        tasks_schema,
        upstream={"max_processes": 2, "connect_timeout_seconds": 5},
        tasks=policies(ask_name={"mode": "required"}),
    )
    task_id = await client.create("ask_name", capabilities={**DECLARING, **ELICIT})
    waiting = await client.until(task_id, lambda task: task["status"] == "input_required")
    started = asyncio.get_running_loop().time()
    status, refused = await client.post("tools/call", {"name": "echo", "arguments": {"text": "x"}}, capabilities=ELICIT)
    assert status == 503, refused
    assert refused["error"]["code"] == -32603
    assert refused["error"]["data"] == {"limit": "max_processes", "max": 2}
    assert "upstream.max_processes" in refused["error"]["message"]
    assert asyncio.get_running_loop().time() - started >= 4  # it waited for a process to come free first
    assert len(client.client.app[POOL].sessions()) == 2  # the task's and the shared one
    [key] = waiting["inputRequests"]
    answer = {key: {"action": "accept", "content": {"name": "Ada"}}}
    await client.post("tasks/update", {"taskId": task_id, "inputResponses": answer})
    assert result_text(await client.settled(task_id)) == "Hello, Ada"
    _, done = await client.post("tools/call", {"name": "echo", "arguments": {"text": "y"}}, capabilities=ELICIT)
    assert done["result"]["content"][0]["text"] == "y"


async def test_a_call_parked_between_mrtr_rounds_gives_its_process_up_when_none_is_left(
    make_proxy: Callable[..., Any], modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    client = await stdio_client(make_proxy, modern_schema, tasks_schema, upstream={"max_processes": 2})
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    _, parked = await client.post("tools/call", params, capabilities=ELICIT)
    assert parked["result"]["resultType"] == "input_required"
    _, second = await client.post("tools/call", params, capabilities=ELICIT)  # takes the parked call's process
    assert second["result"]["resultType"] == "input_required"
    [key] = parked["result"]["inputRequests"]
    answer = {key: {"action": "accept", "content": {"name": "Ada"}}}
    retry = {**params, "inputResponses": answer, "requestState": parked["result"]["requestState"]}
    status, refused = await client.post("tools/call", retry, capabilities=ELICIT)
    assert status == 400
    assert refused["error"]["code"] == -32602  # the client sends the request afresh
    retry = {**params, "inputResponses": answer, "requestState": second["result"]["requestState"]}
    _, done = await client.post("tools/call", retry, capabilities=ELICIT)
    assert done["result"]["content"][0]["text"] == "Hello, Ada"


async def test_closing_the_proxy_stops_every_process(
    make_proxy: Callable[..., Any], modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    before = children()
    client = await stdio_client(make_proxy, modern_schema, tasks_schema, tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 30}, capabilities={**DECLARING, **ELICIT})
    await client.until(task_id, lambda task: "statusMessage" in task)
    assert await client.text("echo", {"text": "x"}) == "x"
    assert len(children() - before) >= 2  # the shared process, the task's (and maybe a warm spare)
    await client.client.close()
    assert children() == before  # stopped and reaped before the app's cleanup returned


async def test_serve_runs_the_command_and_sigterm_stops_it(tmp_path: Path, processes: list[ProxyProcess]) -> None:
    proxy = ProxyProcess(tmp_path, "", upstream=stdio_upstream())
    processes.append(proxy)
    await proxy.start()
    async with aiohttp.ClientSession() as http:
        status, message = await rpc(http, proxy.url, "tools/call", {"name": "echo", "arguments": {"text": "hi"}}, {})
    assert status == 200, message
    assert message["result"]["content"][0]["text"] == "hi"
    assert proxy.process is not None
    servers = child_pids(proxy.process.pid)
    assert len(servers) == 2  # the shared process and a warm spare, started with the proxy
    assert await proxy.terminate() == 0
    await until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in servers), "a server outlived the proxy", 15)
    started = [event for event in proxy.events() if event["event"] == "upstream_process_started"]
    assert started[0]["program"] == STDIO_FIXTURE[0]
    assert any(event["event"] == "upstream_process_exited" for event in proxy.events())


def test_the_example_configs_are_valid(capsys: pytest.CaptureFixture[str]) -> None:
    examples = sorted((ROOT / "config" / "examples").glob("*.yaml"))
    assert examples
    for example in examples:
        assert main(["check-config", str(example)]) == 0, capsys.readouterr().err
        assert isinstance(load_config(example, environ={}).upstream, StdioUpstreamConfig)


async def test_a_question_over_the_result_limit_never_reaches_the_client_and_the_call_ends(
    make_proxy: Callable[..., Any], modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    """A server's question longer than `limits.max_result_bytes` is refused on its stdin at once (the server is
    not left waiting for an answer), and the tool's own outcome comes back: this fixture lets the refusal
    surface as its JSON-RPC error, instead of an input_required round."""
    cap = 1 << 20
    client = await stdio_client(make_proxy, modern_schema, tasks_schema, limits={"max_result_bytes": cap})
    status, message = await client.call("test_elicitation", {"message": "?" * (2 * cap)}, capabilities=ELICIT)
    assert status == 200, message
    assert "result" not in message
    assert message["error"] == {"code": -32603, "message": f"Request larger than the client's limit ({cap} bytes)"}
    assert await client.text("echo", {"text": "next"}) == "next"
