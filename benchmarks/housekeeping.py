"""Housekeeping beside creations, and a scrape's read, on a store of 200,000 records, SQLite or PostgreSQL (issue:
bounded as the work grows).

- purge: 200,000 settled records expire within 10 s while a creator commits a task every 5 ms; the sweep runs as
  the proxy's does (every second: expired live tasks settled, expired records purged with tombstones). Creation
  latency (p50, p99, max) during the purge, and the expired records left 30 s after the last expiry.
- trim: 200,000 tombstones, 100,000 kept (`tasks.max_tombstones`): the trim runs while the creator does.
- scrape: the store's part of a `/metrics` scrape (`stats` and `size_bytes`) with 200,000 records against an
  empty store, as a ratio measured in one run.
- triggers (SQLite): the purge's writer time per batch with the row triggers that keep the status counts, and
  with them dropped.

`--backend postgresql` runs a throwaway server of `tests/pg.py` with its durable settings (fsync on). `--batch N`
sets the rows per housekeeping transaction (the shipped values are SQLite's `HOUSEKEEPING_BATCH` and PostgreSQL's
`PURGE_CHUNK`; a batch as large as the backlog is one transaction, as the SQLite store did before). The machine
may be shared: read the ratios.

    python -m benchmarks.housekeeping [--backend sqlite|postgresql] [--rows 200000] [--batch 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import psycopg

from proxy.tasks.store import TaskStore, pg_schema
from proxy.tasks.store import postgres as pg_store
from proxy.tasks.store import sqlite as sqlite_store
from proxy.tasks.store import sqlite_schema as schema
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.tasks.store.rows import TERMINAL_SQL, row_from_record
from proxy.tasks.store.sqlite import SqliteTaskStore
from proxy.wire.tasks import TaskRecord, TaskStatus
from tests import pg

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


def old_records(rows: int, now_ms: int, spread_ms: int) -> list[TaskRecord]:
    """`rows` settled records expiring evenly over the next `spread_ms`."""
    return [
        record(
            f"old_{n}",
            status=TaskStatus.COMPLETED,
            created_at_ms=now_ms - 300_000,
            ttl_ms=300_000 + (n * spread_ms) // rows,
        )
        for n in range(rows)
    ]


def gone(rows: int, now_ms: int) -> list[tuple[str, str, str, int, int]]:
    """`rows` tombstones, each gone at its own millisecond before `now_ms`."""
    return [(f"gone_{n}", "principal-hash", "expired", now_ms - rows + n, now_ms - rows + n) for n in range(rows)]


Opener = Callable[[], Awaitable[TaskStore]]  # opens the store again each time


class Backend(Protocol):
    """One kind of store: written to directly for the fill (the store's triggers count those rows as the proxy's
    writes would), read directly for what is left."""

    def open(self, name: str, rows: int) -> Opener: ...

    def fill(self, name: str, records: list[TaskRecord]) -> None: ...

    def tombstones(self, name: str, rows: list[tuple[str, str, str, int, int]]) -> None: ...

    def count(self, name: str, sql: str, params: list[Any]) -> int: ...


class Sqlite:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def open(self, name: str, rows: int) -> Opener:
        async def opened() -> TaskStore:
            return await SqliteTaskStore.open(self.directory / f"{name}.db", max_records=10 * rows)

        return opened

    def fill(self, name: str, records: list[TaskRecord]) -> None:
        with sqlite3.connect(self.directory / f"{name}.db") as conn:
            conn.executemany(schema.INSERT_SQL, (row_from_record(one) for one in records))

    def tombstones(self, name: str, rows: list[tuple[str, str, str, int, int]]) -> None:
        with sqlite3.connect(self.directory / f"{name}.db") as conn:
            conn.executemany(
                "INSERT INTO tombstones (task_id, principal, reason, expired_at_ms, gone_at_ms) VALUES (?, ?, ?, ?, ?)",
                rows,
            )

    def count(self, name: str, sql: str, params: list[Any]) -> int:
        with sqlite3.connect(self.directory / f"{name}.db") as conn:
            return int(conn.execute(sql, params).fetchone()[0])


class Postgres:
    def __init__(self, server: pg.PgServer) -> None:
        self.server = server
        self.dsns: dict[str, str] = {}

    def dsn(self, name: str) -> str:
        if name not in self.dsns:
            self.dsns[name] = self.server.dsn(self.server.create_database())
        return self.dsns[name]

    def open(self, name: str, rows: int) -> Opener:
        dsn = self.dsn(name)

        async def opened() -> TaskStore:
            return await PostgresTaskStore.open(dsn, max_records=10 * rows)

        return opened

    def fill(self, name: str, records: list[TaskRecord]) -> None:
        with psycopg.connect(self.dsn(name)) as conn:
            for at in range(0, len(records), 10_000):
                rows = [row_from_record(one) for one in records[at : at + 10_000]]
                conn.execute(pg_schema.INSERT_SQL, {column: [row[column] for row in rows] for column in rows[0]})
        with psycopg.connect(self.dsn(name), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE tasks")

    def tombstones(self, name: str, rows: list[tuple[str, str, str, int, int]]) -> None:
        with psycopg.connect(self.dsn(name)) as conn, conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO tombstones (task_id, principal, reason, expired_at_ms, gone_at_ms)"
                " VALUES (%s, %s, %s, %s, %s)",
                rows,
            )
        with psycopg.connect(self.dsn(name), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE tombstones")

    def count(self, name: str, sql: str, params: list[Any]) -> int:
        with psycopg.connect(self.dsn(name)) as conn:
            row = conn.execute(sql.replace("?", "%s"), params).fetchone()
            assert row is not None
            return int(row[0])


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@asynccontextmanager
async def creating(store: TaskStore) -> AsyncIterator[list[tuple[float, float]]]:
    """A creator committing a task every CREATE_EVERY_SECONDS for the block: (start, seconds) of each."""
    stop, latencies = asyncio.Event(), list[tuple[float, float]]()

    async def run() -> None:
        number = 0
        while not stop.is_set():
            number += 1
            started = time.perf_counter()
            await store.records.create(
                record(f"new_{number}", status=TaskStatus.WORKING, created_at_ms=now_ms(), ttl_ms=600_000)
            )
            latencies.append((started, time.perf_counter() - started))
            await asyncio.sleep(CREATE_EVERY_SECONDS)

    task = asyncio.ensure_future(run())  # noqa: TID251
    try:
        yield latencies
    finally:
        stop.set()
        await task


def summary(latencies: list[float]) -> str:
    if not latencies:
        return "no creations"
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"{len(ordered)} creations: p50 {statistics.median(ordered) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
        f"max {ordered[-1] * 1000:.1f} ms"
    )


async def purge(backend: Backend, rows: int) -> None:
    opened = backend.open("purge", rows)
    await (await opened()).close()  # the schema
    start_ms = now_ms()
    await asyncio.to_thread(backend.fill, "purge", old_records(rows, start_ms, 10_000))
    store: TaskStore = await opened()
    last_expiry_ms = start_ms + 10_000
    purged = 0
    async with creating(store) as latencies:
        began = time.perf_counter()
        while now_ms() < last_expiry_ms + 30_000:
            await asyncio.sleep(SWEEP_SECONDS)
            error = {"code": -32603, "message": "expired"}
            await store.records.settle_expired(now_ms(), error=error, status_message="expired")
            purged += await store.records.purge_expired(now_ms(), tombstones=True)
            if purged >= rows and now_ms() > last_expiry_ms + 2_000:
                break
        left = await asyncio.to_thread(
            backend.count,
            "purge",
            f"SELECT COUNT(*) FROM tasks WHERE expires_at_ms <= ? AND status IN ({TERMINAL_SQL})",
            [now_ms()],
        )
    await store.close()
    during = [seconds for at, seconds in latencies if at >= began]
    print(f"purge ({rows} records expiring within 10 s): {summary(during)}; purged {purged}; expired left {left}")


async def trim(backend: Backend, rows: int) -> None:
    opened = backend.open("trim", rows)
    await (await opened()).close()
    await asyncio.to_thread(backend.tombstones, "trim", gone(rows, now_ms()))
    store: TaskStore = await opened()
    async with creating(store) as latencies:
        await asyncio.sleep(0.5)
        began = time.perf_counter()
        trimmed = await store.records.trim_tombstones(0, rows // 2)
        took = time.perf_counter() - began
        await asyncio.sleep(0.2)
    await store.close()
    during = [seconds for at, seconds in latencies if began <= at <= began + took]
    print(f"trim ({rows} tombstones, {rows // 2} kept): {summary(during)}; trimmed {trimmed} in {took:.2f} s")


async def scrape(backend: Backend, rows: int, reps: int = 50) -> None:
    async def timed(name: str) -> float:
        store: TaskStore = await backend.open(name, rows)()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            await store.operators.stats()
            await store.operators.size_bytes()
            times.append(time.perf_counter() - started)
        await store.close()
        return statistics.median(times)

    for name in ("empty", "full"):
        await (await backend.open(name, rows)()).close()
    await asyncio.to_thread(backend.fill, "full", old_records(rows, now_ms() + 3_600_000, 1))
    empty_s, full_s = await timed("empty"), await timed("full")
    print(
        f"scrape: empty {empty_s * 1000:.2f} ms, {rows} records {full_s * 1000:.2f} ms "
        f"(ratio {full_s / empty_s:.2f}, median of {reps})"
    )


async def triggers(backend: Backend, rows: int) -> None:
    """SQLite only: the purge's time per batch with the status counts' row triggers and with them dropped."""
    if not isinstance(backend, Sqlite):
        return
    for run, keep in enumerate((True, False, True, False)):
        name = f"triggers_{run}"
        opened = backend.open(name, rows)
        await (await opened()).close()
        if not keep:
            with sqlite3.connect(backend.directory / f"{name}.db") as conn:
                for trigger in ("tasks_status_added", "tasks_status_removed", "tasks_status_changed"):
                    conn.execute(f"DROP TRIGGER {trigger}")
        await asyncio.to_thread(backend.fill, name, old_records(rows // 2, now_ms() - 20_000, 1))
        store = await opened()
        began = time.perf_counter()
        purged = await store.records.purge_expired(now_ms(), tombstones=True)
        took = time.perf_counter() - began
        await store.close()
        batches = max(1, -(-purged // sqlite_store.HOUSEKEEPING_BATCH))
        label = "with the count triggers" if keep else "without them"
        print(f"purge of {purged} records {label}: {took * 1000 / batches:.1f} ms per batch ({batches} batches)")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, help="rows per housekeeping transaction (default: the shipped value)")
    parser.add_argument("--only", choices=("purge", "trim", "scrape", "triggers"))
    args = parser.parse_args()
    if args.batch is not None:
        sqlite_store.HOUSEKEEPING_BATCH = args.batch  # type: ignore[misc]
        pg_store.PURGE_CHUNK = args.batch  # type: ignore[misc]
    batch = sqlite_store.HOUSEKEEPING_BATCH if args.backend == "sqlite" else pg_store.PURGE_CHUNK
    print(f"{args.backend}: rows per housekeeping transaction: {batch}")
    runs = [("purge", purge), ("trim", trim), ("scrape", scrape), ("triggers", triggers)]
    if args.backend == "sqlite":
        with tempfile.TemporaryDirectory() as directory:
            for name, run in runs:
                if args.only in (None, name):
                    await run(Sqlite(Path(directory)), args.rows)
        return
    server = await asyncio.to_thread(pg.start_throwaway, durable=True)
    try:
        for name, run in runs:
            if args.only in (None, name):
                await run(Postgres(server), args.rows)
    finally:
        await asyncio.to_thread(server.stop)


if __name__ == "__main__":
    asyncio.run(main())
