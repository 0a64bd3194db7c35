"""PostgresTaskStore while its database is away, on a real server of its own: stopped (fast shutdown) and started
again on the same data directory, frozen with SIGSTOP and thawed.

Every operation answers within `store.timeout_seconds` with StoreUnavailableError (never a hang), the store's
health says so, and once the database is back the same store object works again: no connection that died in
the outage is handed out, creations commit, and the change feed comes back with a RESYNC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.tasks.store import RESYNC, StoreUnavailableError
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.wire.tasks import TaskStatus
from tests import pg
from tests.support.records import make_record, next_change
from tests.support.waiting import until

TIMEOUT_SECONDS = 1.0
MARGIN_SECONDS = 0.5  # scheduling on a shared machine: an answer this late is still "within the deadline"

pytestmark = pytest.mark.faults


@pytest.fixture
def server(own_pg_server: pg.PgServer) -> pg.PgServer:
    return own_pg_server


@pytest.fixture
async def store(server: pg.PgServer) -> AsyncIterator[PostgresTaskStore]:
    dsn = server.dsn(await asyncio.to_thread(server.create_database))
    opened = await PostgresTaskStore.open(
        dsn, max_records=1000, pool_size=4, connect_timeout_seconds=1, timeout_seconds=TIMEOUT_SECONDS
    )
    yield opened
    await opened.close()


async def answered_unavailable(operation: Callable[[], Awaitable[Any]]) -> float:
    """How long `operation` took to raise StoreUnavailableError (it must raise it)."""
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as raised:
        await operation()
    assert raised.value.kind == "postgres"
    return time.monotonic() - started


async def test_a_stopped_database_is_answered_unavailable_within_the_deadline_and_served_again_once_back(
    server: pg.PgServer, store: PostgresTaskStore
) -> None:
    failures: list[tuple[str, str]] = []
    store.health.on_failure(lambda operation, reason: failures.append((operation, reason)))
    await store.records.create(make_record("before"))
    for index in range(3):  # several pooled connections in use before the outage: each of them dies in it
        await asyncio.gather(*(store.records.get("before") for _ in range(4)))
        await store.replicas.renew_lease(f"replica-{index}", 30)
    await asyncio.to_thread(server.halt)
    operations: list[Callable[[], Awaitable[Any]]] = [
        lambda: store.records.get("before"),
        lambda: store.records.create(make_record("during")),
        lambda: store.records.settle("before", TaskStatus.COMPLETED, now_ms=2_000, result={"ok": True}),
        lambda: store.replicas.renew_lease("replica-0", 30),
        lambda: store.check_writable(2_000),
    ]
    for operation in operations:
        assert await answered_unavailable(operation) < TIMEOUT_SECONDS + MARGIN_SECONDS
    assert not store.health.available
    assert {operation for operation, _ in failures} >= {"get", "create", "update", "renew_lease", "check_writable"}
    await asyncio.to_thread(server.start)
    back = time.monotonic()
    await until(lambda: served(store), "the store serves again once the database is back", 10)
    assert time.monotonic() - back < 5  # the pool's back-off never keeps it away long
    assert store.health.available
    await store.records.create(make_record("after"))
    settled = await store.records.settle("before", TaskStatus.COMPLETED, now_ms=3_000, result={"ok": True})
    assert settled is not None
    assert settled.status is TaskStatus.COMPLETED
    assert (await store.records.get("during")) is None  # refused while the database was down: never written


async def test_no_connection_that_died_in_a_restart_is_used_after_it(
    server: pg.PgServer, store: PostgresTaskStore
) -> None:
    """Every pooled connection (and the creator's) died in the restart while idle: the first write and the
    first creation after it still succeed (a write is not tried twice, so a dead connection would fail it)."""
    await store.records.create(make_record("task"))
    await asyncio.gather(*(store.records.get("task") for _ in range(4)))  # the pool holds several connections
    await asyncio.to_thread(server.halt)
    await asyncio.to_thread(server.start)
    settled = await store.records.settle("task", TaskStatus.COMPLETED, now_ms=2_000, result={"ok": True})
    assert settled is not None
    await store.records.create(make_record("next"))
    assert await store.records.set_status_message("next", "still fine", now_ms=2_000) is not None
    assert store.health.available


async def test_the_change_feed_comes_back_with_a_resync_after_a_restart(
    server: pg.PgServer, store: PostgresTaskStore
) -> None:
    await store.records.create(make_record("task"))
    async with store.replicas.changes() as changes:
        assert (await next_change(changes, skip_resync=False)).kind == RESYNC
        await asyncio.to_thread(server.halt)
        await asyncio.to_thread(server.start)
        assert (await next_change(changes, skip_resync=False)).kind == RESYNC  # changes may be missed: re-read
        await store.records.settle("task", TaskStatus.COMPLETED, now_ms=2_000, result={"ok": True})
        change = await next_change(changes)
        assert (change.kind, change.key, change.status) == ("status", "task", TaskStatus.COMPLETED)


async def test_a_frozen_database_is_answered_unavailable_within_the_deadline_and_served_after_the_thaw(
    server: pg.PgServer, store: PostgresTaskStore
) -> None:
    await store.records.create(make_record("task"))
    server.freeze()
    try:
        took = await asyncio.gather(
            answered_unavailable(lambda: store.records.get("task")),
            answered_unavailable(lambda: store.records.create(make_record("frozen"))),
            answered_unavailable(lambda: store.replicas.renew_lease("replica", 30)),
        )
        assert max(took) < TIMEOUT_SECONDS + MARGIN_SECONDS
        assert not store.health.available
    finally:
        server.thaw()

    await until(lambda: served(store), "the store serves again after the thaw", 15)
    assert store.health.available


async def served(store: PostgresTaskStore) -> bool:
    try:
        return await store.records.get("before") is None or True
    except StoreUnavailableError:
        return False
