"""Housekeeping beside creations, and a scrape's read, on a SQLite store of 200,000 records (issue: bounded as the
work grows).

- purge: 200,000 settled records expire within 10 s while a creator commits a task every 5 ms; the sweep runs as
  the proxy's does (every second: expired live tasks settled, expired records purged with tombstones). Creation
  latency (p50, p99, max) during the purge, and the expired records left 30 s after the last expiry.
- trim: 200,000 tombstones, 100,000 kept (`tasks.max_tombstones`): the trim runs while the creator does.
- scrape: the store's part of a `/metrics` scrape (`stats` and `size_bytes`) with 200,000 records against an
  empty store, as a ratio measured in one run.

`--batch N` sets the rows per housekeeping transaction (the shipped value is `HOUSEKEEPING_BATCH`; a batch as
large as the backlog is what the proxy did before: one transaction). The machine may be shared: read the ratios.

    python -m benchmarks.housekeeping [--rows 200000] [--batch 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from proxy.tasks.store import sqlite as sqlite_store
from proxy.tasks.store import sqlite_schema as schema
from proxy.tasks.store.rows import TERMINAL_SQL, row_from_record
from proxy.tasks.store.sqlite import SqliteTaskStore
from proxy.wire.tasks import TaskRecord, TaskStatus

CREATE_EVERY_SECONDS = 0.005
SWEEP_SECONDS = 1.0


def record(task_id: str, *, status: TaskStatus, created_at_ms: int, ttl_ms: int) -> TaskRecord:
    return TaskRecord(
        task_id=task_id,
        principal="principal-hash",
        tool="bench",
        status=status,
        created_at_ms=created_at_ms,
        updated_at_ms=created_at_ms,
        ttl_ms=ttl_ms,
        poll_interval_ms=1000,
        owner="bench",
        on_restart="fail",
        request={"name": "bench", "arguments": {}},
    )


def fill(path: Path, rows: int, now_ms: int, spread_ms: int) -> None:
    """`rows` settled records expiring evenly over the next `spread_ms` (written directly: the store's triggers
    count them as the proxy's writes would)."""
    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(
            schema.INSERT_SQL,
            (
                row_from_record(
                    record(
                        f"old_{n}",
                        status=TaskStatus.COMPLETED,
                        created_at_ms=now_ms - 300_000,
                        ttl_ms=300_000 + (n * spread_ms) // rows,
                    )
                )
                for n in range(rows)
            ),
        )
    conn.close()


def tombstones(path: Path, rows: int, now_ms: int) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.executemany(
            "INSERT INTO tombstones (task_id, principal, reason, expired_at_ms, gone_at_ms) VALUES (?, ?, ?, ?, ?)",
            ((f"gone_{n}", "principal-hash", "expired", now_ms - rows + n, now_ms - rows + n) for n in range(rows)),
        )
    conn.close()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def creator(store: SqliteTaskStore, stop: asyncio.Event, latencies: list[tuple[float, float]]) -> None:
    number = 0
    while not stop.is_set():
        number += 1
        started = time.perf_counter()
        await store.records.create(
            record(f"new_{number}", status=TaskStatus.WORKING, created_at_ms=now_ms(), ttl_ms=600_000)
        )
        latencies.append((started, time.perf_counter() - started))
        await asyncio.sleep(CREATE_EVERY_SECONDS)


def summary(latencies: list[float]) -> str:
    if not latencies:
        return "no creations"
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"{len(ordered)} creations: p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"max {ordered[-1] * 1000:.1f} ms"
    )


async def purge(directory: Path, rows: int) -> None:
    path = directory / "purge.db"
    await (await SqliteTaskStore.open(path, max_records=10 * rows)).close()
    start_ms = now_ms()
    fill(path, rows, start_ms, 10_000)
    store = await SqliteTaskStore.open(path, max_records=10 * rows)
    stop, latencies = asyncio.Event(), list[tuple[float, float]]()
    creating = asyncio.ensure_future(creator(store, stop, latencies))  # noqa: TID251
    began = time.perf_counter()
    last_expiry_ms = start_ms + 10_000
    purged = 0
    while now_ms() < last_expiry_ms + 30_000:
        await asyncio.sleep(SWEEP_SECONDS)
        error = {"code": -32603, "message": "expired"}
        await store.records.settle_expired(now_ms(), error=error, status_message="expired")
        purged += await store.records.purge_expired(now_ms(), tombstones=True)
        if purged >= rows and now_ms() > last_expiry_ms + 2_000:
            break
    left = (
        sqlite3.connect(path)
        .execute(f"SELECT COUNT(*) FROM tasks WHERE expires_at_ms <= ? AND status IN ({TERMINAL_SQL})", [now_ms()])
        .fetchone()[0]
    )
    stop.set()
    await creating
    await store.close()
    during = [seconds for at, seconds in latencies if at >= began]
    print(f"purge ({rows} records expiring within 10 s): {summary(during)}; purged {purged}; expired left {left}")


async def trim(directory: Path, rows: int) -> None:
    path = directory / "trim.db"
    await (await SqliteTaskStore.open(path, max_records=10 * rows)).close()
    tombstones(path, rows, now_ms())
    store = await SqliteTaskStore.open(path, max_records=10 * rows)
    stop, latencies = asyncio.Event(), list[tuple[float, float]]()
    creating = asyncio.ensure_future(creator(store, stop, latencies))  # noqa: TID251
    await asyncio.sleep(0.5)
    began = time.perf_counter()
    trimmed = await store.records.trim_tombstones(0, rows // 2)
    took = time.perf_counter() - began
    await asyncio.sleep(0.2)
    stop.set()
    await creating
    await store.close()
    during = [seconds for at, seconds in latencies if began <= at <= began + took]
    print(f"trim ({rows} tombstones, {rows // 2} kept): {summary(during)}; trimmed {trimmed} in {took:.2f} s")


async def scrape(directory: Path, rows: int, reps: int = 50) -> None:
    async def timed(path: Path) -> float:
        store = await SqliteTaskStore.open(path, max_records=10 * rows)
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            await store.operators.stats()
            await store.operators.size_bytes()
            times.append(time.perf_counter() - started)
        await store.close()
        return statistics.median(times)

    empty, full = directory / "empty.db", directory / "full.db"
    for path in (empty, full):
        await (await SqliteTaskStore.open(path, max_records=10 * rows)).close()
    fill(full, rows, now_ms() + 3_600_000, 1)
    empty_s, full_s = await timed(empty), await timed(full)
    print(
        f"scrape: empty {empty_s * 1000:.2f} ms, {rows} records {full_s * 1000:.2f} ms "
        f"(ratio {full_s / empty_s:.2f}, median of {reps})"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=sqlite_store.HOUSEKEEPING_BATCH)
    parser.add_argument("--only", choices=("purge", "trim", "scrape"))
    args = parser.parse_args()
    sqlite_store.HOUSEKEEPING_BATCH = args.batch  # type: ignore[misc]
    print(f"rows per housekeeping transaction: {args.batch}")
    with tempfile.TemporaryDirectory() as directory:
        for name, run in (("purge", purge), ("trim", trim), ("scrape", scrape)):
            if args.only in (None, name):
                await run(Path(directory), args.rows)


if __name__ == "__main__":
    asyncio.run(main())
