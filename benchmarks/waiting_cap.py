"""One caller under the shipped limits against the cap of work waiting for it (issue: bounded as the work grows).

A proxy with the shipped defaults (only `ask_name` made a task tool, metrics on) in front of the SDK fixture
upstream, whose `ask_name` asks the client a question and waits. One caller whose client can answer questions
sends `--calls` (400) task calls at once, `--concurrency` at a time: the proxy admits
`limits.max_waiting_per_principal` (256) of them, which all come to wait in `input_required`, each holding an
upstream session, and refuses the rest with 429, `Retry-After` and `data.limit`. Then, at the cap, a synchronous
call of the same caller that could ask is refused too, and another caller is still admitted. Printed: the
answers by status and limit, the tasks in `input_required`, the proxy's gauges (waiting places, upstream
sessions, descriptors open).

    python -m benchmarks.waiting_cap [--calls 400] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness import Process, free_port, spawn, start_upstream, wait_for_port
from tests.support.wire import TASKING, modern_body, modern_headers, read_messages


async def start_proxy(upstream: str, workdir: Path) -> Process:
    """The shipped defaults, but for the task tool, the metrics and a quiet log."""
    port = free_port()
    config = workdir / "proxy.yaml"
    config.write_text(
        json.dumps(
            {
                "listen": {"host": "127.0.0.1", "port": port, "shutdown_grace_seconds": 1},
                "upstream": {"url": upstream},
                "store": {"path": str(workdir / "tasks.db")},
                "logging": {"level": "warning"},
                "observability": {"metrics": True},
                "tasks": {"tools": {"ask_name": {"mode": "required"}}},
            }
        )
    )
    process = spawn(["-m", "proxy", "serve", "--config", str(config)])
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}/mcp")


async def call(
    http: aiohttp.ClientSession, url: str, caller: str, tool: str, arguments: dict[str, Any] | None = None
) -> tuple[int, str | None, dict[str, Any]]:
    """A tools/call by `caller`: its HTTP status, Retry-After and last message."""
    body = modern_body("tools/call", {"name": tool, "arguments": arguments or {}}, capabilities=TASKING)
    headers = {**modern_headers("tools/call", tool), "Authorization": f"Bearer {caller}"}
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, response.headers.get("Retry-After"), (await read_messages(response))[-1]


async def status_of(http: aiohttp.ClientSession, url: str, caller: str, task_id: str) -> str:
    body = modern_body("tasks/get", {"taskId": task_id}, capabilities=TASKING)
    headers = {**modern_headers("tasks/get", task_id), "Authorization": f"Bearer {caller}"}
    async with http.post(url, json=body, headers=headers) as response:
        message = (await read_messages(response))[-1]
    return str(message["result"]["status"])


async def gauges(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    wanted = ("waiting_places", "upstream_sessions", "upstream_sessions_max", "descriptors_open")
    async with http.get(url.removesuffix("/mcp") + "/metrics") as response:
        text = await response.text()
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        short = name.removeprefix("mcp_tasks_proxy_")
        if short in wanted:
            found[short] = float(value)
    return found


def outcome(status: int, retry_after: str | None, message: dict[str, Any]) -> str:
    if "error" in message:
        limit = (message["error"].get("data") or {}).get("limit")
        return f"{status} {limit} (Retry-After {retry_after})"
    return f"{status} {message['result'].get('resultType', 'result')}"


async def main(calls: int, concurrency: int) -> None:
    upstream = await start_upstream(sdk=True)
    try:
        with tempfile.TemporaryDirectory() as directory:
            proxy = await start_proxy(upstream.url, Path(directory))
            try:
                await drive(proxy, calls, concurrency)
            finally:
                proxy.stop()
    finally:
        upstream.stop()


async def drive(proxy: Process, calls: int, concurrency: int) -> None:
    url = proxy.url
    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        answers: Counter[str] = Counter()
        task_ids: list[str] = []
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                status, retry_after, message = await call(http, url, "hog", "ask_name")
            answers[outcome(status, retry_after, message)] += 1
            if "result" in message and message["result"].get("resultType") == "task":
                task_ids.append(str(message["result"]["taskId"]))

        began = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        print(f"{calls} task calls of one caller, {concurrency} at a time ({time.perf_counter() - began:.1f} s):")
        for answer, count in sorted(answers.items()):
            print(f"  {count:4d} x {answer}")
        deadline = time.monotonic() + 60
        while True:
            statuses = Counter(await asyncio.gather(*(status_of(http, url, "hog", task_id) for task_id in task_ids)))
            if statuses.get("input_required", 0) == len(task_ids) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        print(f"  the admitted tasks: {dict(statuses)}")
        print(f"  the proxy's gauges at the cap: {await gauges(http, url)}")
        status, retry_after, message = await call(http, url, "hog", "echo", {"text": "x"})
        print(f"  then a synchronous call of the same caller that could ask: {outcome(status, retry_after, message)}")
        status, retry_after, message = await call(http, url, "other", "ask_name")
        print(f"  and another caller's task call: {outcome(status, retry_after, message)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.calls, arguments.concurrency))
