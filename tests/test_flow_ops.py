"""Operating the sidecar: bare /healthz and /readyz on the MCP port, /metrics and readiness reasons on the
operations port, the `tasks` and `probe` commands, JSON logs, and a graceful SIGTERM, against real processes
(the proxy as `python -m proxy serve`, the legacy fixture upstream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxy.cli import main
from tests.support.processes import ProxyProcess, Upstream, free_port, stdio_upstream
from tests.support.sdk import calls_started, until_started_upstream
from tests.support.waiting import until
from tests.support.wire import TASKS, modern_body, modern_headers, parse_sse

Client = TestClient[web.Request, web.Application]
DECLARING: dict[str, Any] = {"extensions": {TASKS: {}}}


async def call(
    http: Any, url: str, tool: str, arguments: dict[str, Any], *, capabilities: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    async with http.post(
        url,
        json=modern_body("tools/call", {"name": tool, "arguments": arguments}, capabilities=capabilities),
        headers={**modern_headers("tools/call", tool), **kw.pop("headers", {})},
    ) as response:
        text = await response.text()
        messages = parse_sse(text) if response.content_type == "text/event-stream" else [json.loads(text)]
        final: dict[str, Any] = messages[-1]
        return final


async def task_get(http: Any, url: str, task_id: str, **headers: str) -> dict[str, Any]:
    async with http.post(
        url,
        json=modern_body("tasks/get", {"taskId": task_id}, capabilities=DECLARING),
        headers={**modern_headers("tasks/get", task_id), **headers},
    ) as response:
        message: dict[str, Any] = await response.json()
        return message


# --- health and readiness -----------------------------------------------------------------------------


async def test_health_endpoints_skip_the_host_check_and_nothing_else(
    make_proxy: Callable[..., Any], upstream: Upstream
) -> None:
    client: Client = await make_proxy(upstream.url)
    pod_ip = {"Host": "10.1.2.3:8080"}  # what kubelet sends
    for path in ("/healthz", "/readyz"):
        response = await client.get(path, headers=pod_ip)
        assert response.status == 200, path
    assert (await client.get("/healthz")).headers["Content-Type"].startswith("application/json")
    response = await client.post(
        "/mcp", json=modern_body("server/discover"), headers={**modern_headers("server/discover"), **pod_ip}
    )
    assert response.status == 403  # the MCP endpoint still checks Host
    response = await client.post("/healthz", headers=pod_ip)
    assert response.status in (403, 405)  # only GET probes are exempt


async def test_the_mcp_port_serves_no_metrics_and_no_readiness_reasons(
    make_proxy: Callable[..., Any], own_upstream: Upstream, operations: Callable[..., Any]
) -> None:
    """The MCP port is what a Service or an ingress exposes: /metrics there is a 404 that says where metrics
    went (never relayed to the upstream), and /readyz gives a status without the reasons, which name the
    upstream and the store. Both are on the operations listener."""
    client: Client = await make_proxy(
        own_upstream.url, relay={"prefixes": ["/"]}, observability={"readiness_max_age_seconds": 0.2}
    )
    ops: Client = await operations(client)
    response = await client.get("/metrics")
    assert response.status == 404
    assert "observability.port" in (await response.json())["message"]
    assert "mcp_tasks_proxy_" not in await response.text()
    scraped = await ops.get("/metrics")
    assert scraped.status == 200
    assert "mcp_tasks_proxy_requests_total" in await scraped.text()
    own_upstream.stop()
    await asyncio.sleep(0.3)  # past readiness_max_age_seconds: the probe must ask the upstream again
    public = await client.get("/readyz")
    assert public.status == 503
    assert await public.json() == {"status": "unavailable"}
    detailed = await ops.get("/readyz")
    assert detailed.status == 503
    assert any(reason.startswith("upstream:") for reason in (await detailed.json())["reasons"])


async def test_readiness_follows_the_upstream(
    make_proxy: Callable[..., Any], own_upstream: Upstream, operations: Callable[..., Any]
) -> None:
    client: Client = await make_proxy(own_upstream.url, observability={"readiness_max_age_seconds": 0.2})
    ops: Client = await operations(client)
    ready = await ops.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["status"] == "ready"
    port = own_upstream.port
    own_upstream.stop()
    await asyncio.sleep(0.3)  # past readiness_max_age_seconds: the probe must ask the upstream again
    down = await ops.get("/readyz")
    assert down.status == 503
    body = await down.json()
    assert body["status"] == "unavailable"
    assert any(reason.startswith("upstream:") for reason in body["reasons"])
    assert (await client.get("/healthz")).status == 200  # alive all the same: no restart loop
    assert (await ops.get("/healthz")).status == 200
    own_upstream.start(port)

    async def ready_again() -> bool:
        return (await client.get("/readyz")).status == 200

    await until(ready_again, "readiness never came back")


# --- metrics ----------------------------------------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


async def legacy_session_calls(client: Client, calls: int) -> None:
    """A 2025-11-25 session through the proxy: initialize, notifications/initialized, `calls` tools/call and
    one request of a method the metrics do not know."""
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    params = {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    response = await client.post(
        "/mcp", json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params}, headers=headers
    )
    assert response.status == 200
    headers["Mcp-Session-Id"] = response.headers["Mcp-Session-Id"]
    await response.read()
    messages: list[dict[str, Any]] = [{"jsonrpc": "2.0", "method": "notifications/initialized"}]
    messages += [
        {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "l"}}}
        for n in range(1, calls + 1)
    ]
    messages.append({"jsonrpc": "2.0", "id": "x", "method": "vendor/unknown", "params": {}})
    for message in messages:
        response = await client.post("/mcp", json=message, headers=headers)
        assert response.status in (200, 202), await response.text()
        await response.read()


async def test_metrics_count_requests_tasks_upstream_and_store(
    make_proxy: Callable[..., Any], upstream: Upstream, operations: Callable[..., Any]
) -> None:
    client: Client = await make_proxy(
        upstream.url, tasks={"tools": {"echo": {"mode": "required"}, "greet": {"mode": "forbidden"}}}
    )
    url = "/mcp"
    await call(client, url, "greet", {"name": "m"})
    created = await call(client, url, "echo", {"text": "t"}, capabilities=DECLARING)
    task_id = created["result"]["taskId"]
    await call(client, url, "sleep", {"seconds": 0}, capabilities={"extensions": {TASKS: {}}})
    await call(client, url, "raise_error", {"message": "x", "code": -32000})
    await client.post("/mcp", data=b"{not json", headers=modern_headers("tools/call"))
    await legacy_session_calls(client, 3)

    async def completed() -> bool:
        return bool((await task_get(client, url, task_id))["result"]["status"] == "completed")

    await until(completed, "the task never completed")
    response = await (await operations(client)).get("/metrics")
    assert response.headers["Content-Type"].startswith("text/plain")
    found = samples(await response.text())
    prefix = "mcp_tasks_proxy_"
    assert value(found, f"{prefix}requests_total", era="modern", method="tools/call", outcome="ok") >= 2
    assert value(found, f"{prefix}requests_total", era="modern", method="tools/call", outcome="jsonrpc_error") >= 1
    assert value(found, f"{prefix}requests_total", era="modern", method="tasks/get", outcome="ok") >= 1
    assert value(found, f"{prefix}requests_total", era="modern", method="-", outcome="client_error") >= 1
    # Legacy POSTs are counted by the method their body names, each one once (the children are kept).
    assert value(found, f"{prefix}requests_total", era="legacy", method="initialize", outcome="ok") == 1
    assert value(found, f"{prefix}requests_total", era="legacy", method="notifications/initialized", outcome="ok") == 1
    assert value(found, f"{prefix}requests_total", era="legacy", method="tools/call", outcome="ok") == 3
    assert value(found, f"{prefix}request_duration_seconds_count", era="legacy", method="tools/call") == 3
    assert value(found, f"{prefix}requests_total", era="legacy", method="other", outcome="ok") == 1
    assert value(found, f"{prefix}tasks_created_total", tool="echo") == 1
    assert value(found, f"{prefix}tasks_settled_total", tool="echo", status="completed") == 1
    assert value(found, f"{prefix}task_duration_seconds_count", tool="echo", status="completed") == 1
    assert value(found, f"{prefix}task_create_seconds_count", path="task") == 1
    assert value(found, f"{prefix}tasks", status="completed") >= 1
    assert value(found, f"{prefix}tasks_running") == 0
    assert value(found, f"{prefix}store_size_bytes") > 0
    assert value(found, f"{prefix}upstream_request_duration_seconds_count", method="tools/call") >= 3
    tools = {labels for (name, labels) in found if name == f"{prefix}tasks_created_total"}
    assert tools <= {(("tool", "echo"),), (("tool", "other"),)}  # unlisted tools are `other` (bounded labels)


async def test_metrics_can_be_turned_off(
    make_proxy: Callable[..., Any], upstream: Upstream, operations: Callable[..., Any]
) -> None:
    client: Client = await make_proxy(upstream.url, observability={"metrics": False})
    ops: Client = await operations(client)
    assert (await ops.get("/metrics")).status == 404
    assert (await ops.get("/readyz")).status == 200


# --- a real process: logs, CLI, SIGTERM -----------------------------------------------------------------


async def test_sigterm_lets_a_sync_call_finish_within_the_drain_and_keeps_a_longer_task_for_the_next_start(
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The sync call ends within the drain; the task outlives it and is left for the next start.
    sections = {"tasks": {"tools": {"counted": {"mode": "required"}}, "drain_seconds": 5}}
    first = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(first)
    await first.start()
    created = await call(
        http,
        first.url,
        "counted",
        {"key": "arg-value-7f3a", "seconds": 30},
        capabilities=DECLARING,
        headers={"Authorization": "Bearer ops-secret-token"},
    )
    task_id = created["result"]["taskId"]
    before = await calls_started(own_upstream.url, "sleep")
    sync_call = asyncio.get_running_loop().create_task(call(http, first.url, "sleep", {"seconds": 1.5}))
    await until_started_upstream(own_upstream.url, "sleep", before)  # the sync call is running upstream
    exit_code = await first.terminate()
    finished = await sync_call
    assert finished["result"]["content"][0]["text"] == "slept 1.5"  # completed within the drain
    assert exit_code == 0
    events = first.events()
    assert any(
        event["event"] == "task_created" and event["task_id"] == task_id and event["tool"] == "counted"
        for event in events
    )
    request_lines = [event for event in events if event["event"] == "request"]
    assert request_lines
    assert {"request_id", "mcp_method", "era", "status", "duration_ms"} <= request_lines[0].keys()
    assert "ops-secret-token" not in first.log.read_text()  # tokens never reach the log
    assert "arg-value-7f3a" not in first.log.read_text()  # nor argument values

    # The record survived the stop: the CLI reads it (read-only), still `working`.
    database = str(tmp_path / "ops.db")
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["tasks", "show", task_id, "--db", database]) == 0
    stored = json.loads(capsys.readouterr().out)
    assert stored["status"] == "working"  # left for the next start to fail or re-run (on_restart)

    second = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(second)
    await second.start()
    message = await task_get(http, second.url, task_id, Authorization="Bearer ops-secret-token")
    assert message["result"]["status"] == "failed"
    assert "restarted" in message["result"]["error"]["message"]
    assert any(event["event"] == "task_interrupted" and event["task_id"] == task_id for event in second.events())
    assert await second.terminate() == 0


UVLOOP, STANDARD = "uvloop.Loop", "asyncio.unix_events._UnixSelectorEventLoop"


@pytest.mark.parametrize(
    ("choice", "loop", "stdio"), [("uvloop", UVLOOP, False), ("asyncio", STANDARD, False), ("uvloop", UVLOOP, True)]
)
async def test_the_proxy_serves_on_uvloop_and_on_the_standard_loop(
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
    choice: str,
    loop: str,
    stdio: bool,
) -> None:
    """Synchronous calls and a durable task, in front of an HTTP upstream and of a stdio server the proxy runs."""
    sections: dict[str, Any] = {"listen": {"event_loop": choice}, "tasks": {"tools": {"counted": {"mode": "required"}}}}
    if stdio:
        sections["upstream"] = stdio_upstream()
    proxy = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(proxy)
    await proxy.start()
    answered = await asyncio.gather(*(call(http, proxy.url, "echo", {"text": f"on {choice} {n}"}) for n in range(5)))
    assert [message["result"]["content"][0]["text"] for message in answered] == [f"on {choice} {n}" for n in range(5)]
    created = await call(http, proxy.url, "counted", {"key": choice, "seconds": 0}, capabilities=DECLARING)
    assert created["result"]["resultType"] == "task"
    assert [event["loop"] for event in proxy.events() if event["event"] == "event_loop"] == [loop]
    assert await proxy.terminate() == 0


async def test_sigterm_cancels_a_sync_call_that_outlives_the_drain_and_the_grace(
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
    make_proxy: Callable[..., Any],
) -> None:
    proxy = ProxyProcess(
        tmp_path, own_upstream.url, listen={"shutdown_grace_seconds": 0.5}, tasks={"drain_seconds": 0.5}
    )
    processes.append(proxy)
    await proxy.start()
    before = await calls_started(own_upstream.url, "sleep")
    sync_call = asyncio.get_running_loop().create_task(call(http, proxy.url, "sleep", {"seconds": 30}))
    await until_started_upstream(own_upstream.url, "sleep", before)
    started = asyncio.get_running_loop().time()
    assert await proxy.terminate() == 0
    assert asyncio.get_running_loop().time() - started < 15  # not the 30 s of the call
    with pytest.raises((aiohttp.ClientError, json.JSONDecodeError, IndexError)):
        await sync_call
    # The upstream was told (notifications/cancelled), so it does not run the abandoned call to its end.
    observer: Client = await make_proxy(own_upstream.url)
    cancelled = await call(observer, "/mcp", "cancelled_requests", {})
    assert json.loads(cancelled["result"]["content"][0]["text"])


# --- CLI ------------------------------------------------------------------------------------------------


async def test_tasks_cli_reads_a_live_database(
    make_proxy: Callable[..., Any],
    upstream: Upstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    database = tmp_path / "cli.db"
    client: Client = await make_proxy(
        upstream.url, store={"path": str(database)}, tasks={"default": {"mode": "required"}}
    )
    created = await call(client, "/mcp", "echo", {"text": "cli"}, capabilities=DECLARING)
    task_id = created["result"]["taskId"]

    async def completed() -> bool:
        return bool((await task_get(client, "/mcp", task_id))["result"]["status"] == "completed")

    await until(completed, "the task never completed")
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["tasks", "show", task_id, "--db", str(database)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["taskId"] == task_id
    assert shown["status"] == "completed"
    assert shown["tool"] == "echo"
    assert shown["result"]["content"][0]["text"] == "cli"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"upstream": {"url": upstream.url}, "store": {"path": str(database)}}))
    assert await asyncio.to_thread(main, ["tasks", "stats", "--config", str(config)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["completed"] == 1
    assert stats["records"] == 1
    assert await asyncio.to_thread(main, ["tasks", "show", "task_missing", "--db", str(database)]) == 1
    assert "no task" in capsys.readouterr().err
    assert await asyncio.to_thread(main, ["tasks", "stats", "--db", str(tmp_path / "absent.db")]) == 1


async def test_probe_command(make_proxy: Callable[..., Any], upstream: Upstream) -> None:
    client: Client = await make_proxy(upstream.url)
    url = str(client.make_url("/healthz"))
    assert await asyncio.to_thread(main, ["probe", url]) == 0
    assert await asyncio.to_thread(main, ["probe", str(client.make_url("/nope"))]) == 1
    assert await asyncio.to_thread(main, ["probe", f"http://127.0.0.1:{free_port()}/healthz", "--timeout", "1"]) == 1


@pytest.mark.parametrize(
    "argv",
    [["tasks", "--help"], ["tasks", "show", "--help"], ["tasks", "stats", "--help"], ["probe", "--help"]],
)
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 0
    assert "usage: mcp-tasks-proxy" in capsys.readouterr().out
