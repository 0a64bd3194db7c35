"""Benchmark rows for deploys (the `deploy` group of `make bench`): the drain on SIGTERM.

- SIGTERM to exit of an idle proxy (SQLite), several times: what a stop costs when nothing runs.
- A rolling restart of one of two replicas on PostgreSQL under steady load of synchronous calls and tasks.
  The client acts as a balancer would: requests go round-robin over the endpoints in rotation; the endpoint
  list drops the stopped replica a moment after its SIGTERM (so some requests still reach it while it drains)
  and adds its replacement once `/readyz` says so; a 503 with `Retry-After` or a refused connection (nothing
  was sent) is retried on another endpoint. A request fails when no endpoint answers it with a result; a task
  fails when it ends other than `completed`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.harness import TASKS, Process, Row, shared_store, start_proxy, start_upstream
from tests.support.wire import modern_body, modern_headers

LEASE_SECONDS = 5.0
STALE_SECONDS = 0.5  # how long the endpoint list still names a replica after its SIGTERM
DRAIN_SECONDS = 20.0
SLEEP_TOOL = {"sleep": {"mode": "optional", "sync_window_ms": 0}}  # declaring: a task; else synchronous


async def idle_stop_row(workdir: Path, quick: bool) -> Row:
    upstream = await start_upstream()
    seconds: list[float] = []
    try:
        for number in range(3 if quick else 7):
            proxy = await start_proxy(upstream.url, workdir, f"idle-{number}")
            await _ready(proxy.url)
            started = time.monotonic()
            proxy.process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proxy.process.wait, 30)
            seconds.append(time.monotonic() - started)
            assert code == 0, f"exit code {code}"
    finally:
        upstream.stop()
    median, worst = statistics.median(seconds), max(seconds)
    return Row(
        "deploy: SIGTERM to exit, idle proxy (SQLite)",
        f"median {median * 1000:.0f} ms, max {worst * 1000:.0f} ms ({len(seconds)} stops)",
        "< 1 s",
        worst < 1.0,
        {"median_s": median, "max_s": worst, "stops": len(seconds)},
    )


async def _ready(url: str, timeout_seconds: float = 30) -> None:
    deadline = time.monotonic() + timeout_seconds
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url.replace("/mcp", "/readyz")) as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not become ready")
            await asyncio.sleep(0.05)


class Balancer:
    """Round-robin over the endpoints in rotation, retrying what a balancer may retry."""

    def __init__(self, http: aiohttp.ClientSession, urls: list[str]) -> None:
        self.http = http
        self.urls = list(urls)
        self._turn = itertools.count()
        self.retried = 0
        self.ids = itertools.count(1)

    async def post(self, method: str, params: dict[str, Any], *, declares: bool, name: str) -> dict[str, Any]:
        capabilities: dict[str, Any] = {"extensions": {TASKS: {}}} if declares else {}
        body = json.dumps(modern_body(method, params, request_id=next(self.ids), capabilities=capabilities))
        headers = modern_headers(method, name)
        for _ in range(4):
            url = self.urls[next(self._turn) % len(self.urls)]
            try:
                async with self.http.post(url, data=body, headers=headers) as answer:
                    text = await answer.text()
                    if answer.status == 503 and "Retry-After" in answer.headers:
                        self.retried += 1
                        continue
                    message: dict[str, Any] = json.loads(_last_data(text))
                    if answer.status != 200 or "error" in message:
                        raise RuntimeError(f"{method}: HTTP {answer.status} {message.get('error')}")
                    return message
            except aiohttp.ClientConnectorError:
                self.retried += 1  # nothing was sent: the endpoint is gone
        raise RuntimeError(f"{method}: no endpoint answered")


def _last_data(text: str) -> str:
    if text.startswith("{"):
        return text
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")][-1]


async def rolling_restart_row(workdir: Path, quick: bool) -> Row:
    async with shared_store(workdir) as ground:

        async def replica(number: int, name: str) -> Process:
            started = await start_proxy(
                ground.upstreams[number].url,
                workdir,
                name,
                store={"url": ground.dsn, "lease_seconds": LEASE_SECONDS},
                inputs={"secret_file": str(ground.key)},
                tasks={"tools": SLEEP_TOOL, "max_running": 20_000, "drain_seconds": DRAIN_SECONDS},
            )
            ground.processes.append(started)
            await _ready(started.url)
            return started

        first, second = await replica(0, "deploy-a"), await replica(1, "deploy-b")
        return await _roll(first, second, lambda: replica(0, "deploy-a2"), quick)


async def _roll(first: Process, second: Process, replace: Any, quick: bool) -> Row:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a cut request is a failure, not a retry
    async with aiohttp.ClientSession(connector=connector) as http:
        balancer = Balancer(http, [first.url, second.url])
        stop = asyncio.Event()
        counts = {"requests": 0, "failed_requests": 0, "tasks": 0, "failed_tasks": 0}
        errors: list[str] = []

        async def sync_worker() -> None:
            while not stop.is_set():
                counts["requests"] += 1
                try:
                    message = await balancer.post(
                        "tools/call", {"name": "sleep", "arguments": {"seconds": 0.3}}, declares=False, name="sleep"
                    )
                    assert message["result"]["content"][0]["text"].startswith("slept"), message
                except (RuntimeError, AssertionError, aiohttp.ClientError) as exc:
                    counts["failed_requests"] += 1
                    errors.append(repr(exc))

        async def task_worker() -> None:
            while not stop.is_set():
                try:
                    counts["requests"] += 1
                    created = await balancer.post(
                        "tools/call", {"name": "sleep", "arguments": {"seconds": 1.0}}, declares=True, name="sleep"
                    )
                    task_id = created["result"]["taskId"]
                    counts["tasks"] += 1
                    while True:
                        await asyncio.sleep(0.2)
                        counts["requests"] += 1
                        task = (await balancer.post("tasks/get", {"taskId": task_id}, declares=True, name=task_id))[
                            "result"
                        ]
                        if task["status"] not in ("working", "input_required"):
                            break
                    if task["status"] != "completed":
                        counts["failed_tasks"] += 1
                        errors.append(f"task {task['status']}: {task.get('error')}")
                except (RuntimeError, KeyError, aiohttp.ClientError) as exc:
                    counts["failed_requests"] += 1
                    errors.append(repr(exc))

        loop = asyncio.get_running_loop()
        workers = [loop.create_task(sync_worker()) for _ in range(4)]
        workers += [loop.create_task(task_worker()) for _ in range(4)]
        await asyncio.sleep(2 if quick else 4)  # steady load on both replicas
        sent = time.monotonic()
        first.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(STALE_SECONDS)
        balancer.urls.remove(first.url)
        code = await asyncio.to_thread(first.process.wait, 60)
        drained = time.monotonic() - sent
        replacement = await replace()
        balancer.urls.append(replacement.url)
        await asyncio.sleep(2 if quick else 4)  # steady load on the new pair
        stop.set()
        await asyncio.gather(*workers)
    met = counts["failed_requests"] == 0 and counts["failed_tasks"] == 0 and code == 0
    return Row(
        "deploy: rolling restart of one of two replicas (PostgreSQL) under load, 4 sync + 4 task clients",
        f"{counts['failed_requests']} failed of {counts['requests']} requests, {counts['failed_tasks']} failed of "
        f"{counts['tasks']} tasks; drain {drained:.2f} s, exit {code}, {balancer.retried} retried elsewhere",
        "0 failed requests, 0 failed tasks",
        met,
        {**counts, "drain_s": drained, "exit_code": code, "retried": balancer.retried, "errors": errors[:5]},
    )


async def deploy_rows(workdir: Path, quick: bool) -> list[Row]:
    return [await idle_stop_row(workdir, quick), await rolling_restart_row(workdir, quick)]
