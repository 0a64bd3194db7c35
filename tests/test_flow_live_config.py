"""End to end: live configuration, with real processes and real signals. SIGHUP and a change of the file (a
ConfigMap's `..data` symlink swap included) reload it; tool policies, limits and the log level change for new
calls while a call in flight keeps its policy; a reload that does not load, or that changes a fixed key, is
refused as a whole and the running config stays. Waiting is by polling with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import ProxyProcess, Upstream
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, parse_sse

RELOADS = "mcp_tasks_proxy_config_reloads_total"


async def sleep_call(http: aiohttp.ClientSession, url: str, seconds: float) -> dict[str, Any]:
    """A declaring client's `sleep`: its policy decides whether the answer is a result or a task."""
    body = modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": seconds}}, capabilities=DECLARING)
    async with http.post(url, json=body, headers=modern_headers("tools/call", "sleep")) as answer:
        text = await answer.text()
        assert answer.status == 200, text
        messages = parse_sse(text) if answer.content_type == "text/event-stream" else [json.loads(text)]
        result: dict[str, Any] = messages[-1]["result"]
        return result


async def echo(http: aiohttp.ClientSession, url: str, text: str) -> str:
    body = modern_body("tools/call", {"name": "echo", "arguments": {"text": text}})
    async with http.post(url, json=body, headers=modern_headers("tools/call", "echo")) as answer:
        message = json.loads(await answer.text())
        assert answer.status == 200, message
        return str(message["result"]["content"][0]["text"])


async def metrics(http: aiohttp.ClientSession, proxy: ProxyProcess) -> dict[tuple[str, str], float]:
    """(sample name, label values joined) -> value."""
    async with http.get(proxy.ops_url("/metrics")) as answer:
        text = await answer.text()
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, ",".join(sample.labels.values()))] = float(sample.value)
    return samples


async def reloads(http: aiohttp.ClientSession, proxy: ProxyProcess, result: str) -> float:
    return (await metrics(http, proxy))[(RELOADS, result)]


def config_of(proxy: ProxyProcess) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(proxy.config.read_text())
    return loaded


def replace_file(path: Path, text: str) -> None:
    """Write beside it and rename over it, as editors and config tools do (no reader sees half a file)."""
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text)
    os.replace(temporary, path)


async def reloaded(http: aiohttp.ClientSession, proxy: ProxyProcess, result: str, before: float) -> None:
    async def counted() -> bool:
        return await reloads(http, proxy, result) > before

    await until(counted, f"a reload counted as {result}")


def hup(proxy: ProxyProcess) -> None:
    assert proxy.process is not None
    os.kill(proxy.process.pid, signal.SIGHUP)


async def test_sighup_applies_a_new_policy_to_new_calls_while_a_call_in_flight_keeps_its_own(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    policy = {"sleep": {"mode": "optional", "sync_window_ms": 9000}}
    proxy = ProxyProcess(tmp_path, upstream.url, tasks={"tools": policy})
    processes.append(proxy)
    await proxy.start()
    before = await metrics(http, proxy)
    (old_hash,) = [labels for (name, labels) in before if name == "mcp_tasks_proxy_config_info"]
    in_flight = asyncio.get_running_loop().create_task(sleep_call(http, proxy.url, 2))

    async def started() -> bool:  # its call exists: its policy was decided under the old config
        return (await metrics(http, proxy))[("mcp_tasks_proxy_drain_calls_left", "")] >= 2

    await until(started, "the call in flight started")

    # An edit the file watcher cannot see (same inode, size and mtime): only SIGHUP reloads it.
    stat = proxy.config.stat()
    text = proxy.config.read_text()
    edited = text.replace("mode: optional", "mode: required").replace("level: info", "level: warn")
    assert len(edited) == len(text)
    with proxy.config.open("r+") as file:
        file.write(edited)
    os.utime(proxy.config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    await asyncio.sleep(0)
    hup(proxy)
    await reloaded(http, proxy, "invalid", before[(RELOADS, "invalid")])  # `warn` is no log level
    with proxy.config.open("r+") as file:
        file.write(edited.replace("level: warn", "level: info"))
    os.utime(proxy.config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    hup(proxy)
    await reloaded(http, proxy, "applied", before[(RELOADS, "applied")])

    assert "taskId" in await sleep_call(http, proxy.url, 0.1)  # a new call: `required`, a task at once
    kept = await in_flight
    assert kept["content"][0]["text"] == "slept 2"  # the call in flight kept `optional` with its 9 s window
    after = await metrics(http, proxy)
    (new_hash,) = [labels for (name, labels) in after if name == "mcp_tasks_proxy_config_info"]
    assert new_hash != old_hash
    last_good = "mcp_tasks_proxy_config_last_reload_success_timestamp_seconds"
    assert after[(last_good, "")] > before[(last_good, "")]
    events = [event for event in proxy.events() if event["event"].startswith("config_reload")]
    assert [(event["event"], event["trigger"]) for event in events] == [
        ("config_reload_refused", "sighup"),
        ("config_reloaded", "sighup"),
    ]
    assert events[1]["changed"] == ["tasks.tools"]


async def test_a_configmap_symlink_swap_is_seen_and_applied(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = ProxyProcess(tmp_path, upstream.url)
    processes.append(proxy)
    # The layout of a mounted ConfigMap: proxy.yaml -> ..data/proxy.yaml, ..data -> ..<timestamp>/
    mount = tmp_path / "configmap"
    first = mount / "..2026_12_01_10_00_00.000000001"
    first.mkdir(parents=True)
    (first / "proxy.yaml").write_text(proxy.config.read_text())
    (mount / "..data").symlink_to(first.name)
    (mount / "proxy.yaml").symlink_to("..data/proxy.yaml")
    proxy.config = mount / "proxy.yaml"
    await proxy.start()
    assert await echo(http, proxy.url, "before") == "before"
    before = await reloads(http, proxy, "applied")

    changed = config_of(proxy)
    changed.setdefault("tasks", {})["tools"] = {"sleep": {"mode": "required"}}
    changed["logging"]["level"] = "debug"
    second = mount / "..2026_12_01_10_05_00.000000002"
    second.mkdir()
    (second / "proxy.yaml").write_text(yaml.safe_dump(changed))
    (mount / "..data_tmp").symlink_to(second.name)
    os.replace(mount / "..data_tmp", mount / "..data")  # the atomic swap the kubelet makes
    for name in os.listdir(first):
        os.remove(first / name)
    first.rmdir()

    await reloaded(http, proxy, "applied", before)
    assert "taskId" in await sleep_call(http, proxy.url, 0.1)
    async with http.get(proxy.url.replace("/mcp", "/healthz")) as answer:
        assert answer.status == 200
    requests = [event for event in proxy.events() if event["event"] == "request" and event["path"] == "/healthz"]
    assert requests, "the log level became debug: probe requests are logged"
    assert [event["trigger"] for event in proxy.events() if event["event"] == "config_reloaded"] == ["file"]


async def test_refused_reloads_keep_the_running_config(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = ProxyProcess(tmp_path, upstream.url, tasks={"tools": {"sleep": {"mode": "forbidden"}}})
    processes.append(proxy)
    await proxy.start()
    good = config_of(proxy)
    # A live change together with a fixed one: refused as a whole.
    fixed = yaml.safe_dump({**good, "store": {**good["store"], "path": str(tmp_path / "other.db")}})
    fixed = fixed.replace("mode: forbidden", "mode: required")
    assert "mode: required" in fixed
    bad: list[tuple[str, Callable[[], object]]] = [
        ("invalid", lambda: replace_file(proxy.config, "tasks: [unclosed\n")),
        ("invalid", lambda: replace_file(proxy.config, yaml.safe_dump({**good, "tasks": {"max_running": -1}}))),
        ("fixed_key", lambda: replace_file(proxy.config, fixed)),
        ("invalid", lambda: replace_file(proxy.config, "")),  # truncated
        ("invalid", lambda: proxy.config.write_bytes(b"\xff\xfe not text")),
        ("invalid", lambda: proxy.config.unlink()),  # deleted
        ("invalid", lambda: proxy.config.mkdir()),  # unreadable: no longer a file
    ]
    for result, break_it in bad:
        before = await reloads(http, proxy, result)
        break_it()
        hup(proxy)
        await reloaded(http, proxy, result, before)
        assert "taskId" not in await sleep_call(http, proxy.url, 0.01)  # still `forbidden`: synchronous
        async with http.get(proxy.url.replace("/mcp", "/readyz")) as answer:
            assert answer.status == 200
    refused = [event for event in proxy.events() if event["event"] == "config_reload_refused"]
    assert {event["field"] for event in refused if event["result"] == "fixed_key"} == {"store.path"}
    assert any("cannot read" in " ".join(event["problems"]) for event in refused if event["result"] == "invalid")
    assert all(event["level"] == "error" for event in refused)

    # A good file again is applied: refusals left the reloading intact.
    proxy.config.rmdir()
    before = await reloads(http, proxy, "applied")
    replace_file(proxy.config, yaml.safe_dump(good).replace("mode: forbidden", "mode: required"))
    hup(proxy)
    await reloaded(http, proxy, "applied", before)
    assert "taskId" in await sleep_call(http, proxy.url, 0.01)


async def test_reloads_during_a_burst_of_calls_fail_none_of_them(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = ProxyProcess(tmp_path, upstream.url, limits={"max_listen_streams": 100})
    processes.append(proxy)
    await proxy.start()
    good = config_of(proxy)
    before = await reloads(http, proxy, "applied")
    calls = 200

    async def burst() -> list[str]:
        answers: list[str] = []
        for batch in range(calls // 10):
            answers += await asyncio.gather(*(echo(http, proxy.url, f"{batch}-{n}") for n in range(10)))
        return answers

    running = asyncio.get_running_loop().create_task(burst())
    for n in range(5):
        good["limits"]["max_listen_streams"] = 101 + n
        replace_file(proxy.config, yaml.safe_dump(good))
        hup(proxy)
        await reloaded(http, proxy, "applied", before + n)
    answers = await running
    assert answers == [f"{batch}-{n}" for batch in range(calls // 10) for n in range(10)]
    assert await reloads(http, proxy, "applied") >= before + 5
