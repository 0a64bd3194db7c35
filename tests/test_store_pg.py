"""PostgresTaskStore as replicas use it: several store objects (replicas) on one real PostgreSQL database.

Visibility across replicas, first settle wins across them, exact eviction under concurrent creators, one
migration for replicas that start at once, lease expiry and take-over by exactly one survivor, fencing of a
stale owner, the change feed across replicas (committed only, and back after its connection is killed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest

from proxy.config.schema import StoreConfig
from proxy.tasks.store import (
    CANCEL,
    INPUT,
    RESYNC,
    STATUS,
    Change,
    FencedError,
    KeyRecord,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    open_store,
)
from proxy.tasks.store.pg_schema import MIGRATIONS
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.wire.jsonrpc import RawJSON
from proxy.wire.tasks import TaskStatus
from tests import pg
from tests.support.records import check_trace_context_migrated, make_record, next_change
from tests.support.waiting import until

DEADLINE_SECONDS = 10.0


async def rows(dsn: str, sql: str, params: list[object] | None = None) -> list[tuple[object, ...]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cursor = await conn.execute(sql.encode(), params)
        return await cursor.fetchall() if cursor.description is not None else []


@pytest.fixture
async def replicas(pg_dsn: str) -> AsyncIterator[list[PostgresTaskStore]]:
    """Three store objects on one database, as three replicas would hold them."""
    opened = [await PostgresTaskStore.open(pg_dsn, max_records=1000) for _ in range(3)]
    yield opened
    for store in opened:
        await store.close()


async def test_a_creation_on_one_replica_is_visible_on_another_at_once(replicas: list[PostgresTaskStore]) -> None:
    a, b, _ = replicas
    for index in range(20):
        await a.records.create(make_record(f"task_{index}"))
        assert await b.records.get(f"task_{index}") == make_record(
            f"task_{index}"
        )  # committed before create() returned


async def test_concurrent_settles_from_two_replicas_first_wins(replicas: list[PostgresTaskStore]) -> None:
    a, b, _ = replicas
    ids = [f"task_{index}" for index in range(30)]
    for task_id in ids:
        await a.records.create(make_record(task_id))
    outcomes = await asyncio.gather(
        *(a.records.settle(task_id, TaskStatus.COMPLETED, now_ms=2_000, result={"by": "a"}) for task_id in ids),
        *(b.records.settle(task_id, TaskStatus.CANCELLED, now_ms=2_000, status_message="by b") for task_id in ids),
    )
    for index, task_id in enumerate(ids):
        by_a, by_b = outcomes[index], outcomes[len(ids) + index]
        winners = [record for record in (by_a, by_b) if record is not None]
        assert len(winners) == 1, task_id
        assert await b.records.get(task_id) == winners[0]


async def test_eviction_at_capacity_with_concurrent_creators_is_exact(pg_dsn: str) -> None:
    """Two replicas creating at once at the limit: never more than max_records rows, never a live task evicted,
    exactly as many creations succeed as there were settled records to evict."""
    a = await PostgresTaskStore.open(pg_dsn, max_records=20)
    b = await PostgresTaskStore.open(pg_dsn, max_records=20)
    try:
        for index in range(20):
            await a.records.create(make_record(f"old_{index:02}", created_at_ms=index))
        for index in range(0, 20, 2):  # ten settled, ten live
            await a.records.settle(f"old_{index:02}", TaskStatus.COMPLETED, now_ms=100 + index)
        live_before = {record.task_id for record in await a.records.live()}

        async def create(store: PostgresTaskStore, task_id: str) -> bool:
            try:
                await store.records.create(make_record(task_id, created_at_ms=1_000))
            except StoreFullError:
                return False
            return True

        attempts = [create(store, f"new_{name}_{index}") for index in range(15) for name, store in (("a", a), ("b", b))]
        created = sum(await asyncio.gather(*attempts))
        assert created == 10  # one per settled record
        assert (await a.operators.stats())["records"] == 20
        assert await rows(pg_dsn, "SELECT records FROM task_count") == [(20,)]  # the count row stayed exact
        live_after = {record.task_id for record in await a.records.live()}
        assert live_before <= live_after  # no live task was evicted
        assert len(live_after) == 20
    finally:
        await a.close()
        await b.close()


async def test_replicas_that_start_at_once_migrate_once(pg_dsn: str) -> None:
    stores = await asyncio.gather(*(PostgresTaskStore.open(pg_dsn, max_records=10) for _ in range(4)))
    try:
        names = await rows(pg_dsn, "SELECT name FROM schema_migrations ORDER BY name")
        assert names == [
            ("0001_create_tasks",),
            ("0002_create_replicas_and_messages",),
            ("0003_create_tool_durations",),
            ("0004_add_upstream_task",),
            ("0005_add_traceparent",),
            ("0006_add_jobs",),
            ("0007_create_tombstones",),
            ("0008_add_admission_queue",),
            ("0009_create_quota_windows",),
            ("0010_create_idempotency_keys",),
            ("0011_create_lease_watch",),
            ("0012_count_tasks_by_status",),
            ("0013_create_grants",),
        ]
        await stores[0].records.create(make_record("task_a"))
        assert await stores[3].records.get("task_a") is not None
    finally:
        for store in stores:
            await store.close()
    again = await PostgresTaskStore.open(pg_dsn, max_records=10)  # a restart applies nothing
    await again.close()
    assert len(await rows(pg_dsn, "SELECT name FROM schema_migrations")) == len(MIGRATIONS)


async def test_a_dead_replicas_tasks_are_taken_over_by_exactly_one_survivor(
    replicas: list[PostgresTaskStore],
) -> None:
    dead, b, c = replicas
    dying = await dead.replicas.renew_lease("replica-a", 0.3)
    fence_b = await b.replicas.renew_lease("replica-b", 30)
    fence_c = await c.replicas.renew_lease("replica-c", 30)
    for index in range(5):
        await dead.records.create(make_record(f"task_{index}", owner="replica-a", created_at_ms=index))
    await dead.records.settle("task_4", TaskStatus.COMPLETED, now_ms=10, fence=dying)
    await b.records.create(make_record("task_b", owner="replica-b"))
    await dead.replicas.notify_owner("task_0", CANCEL, {"reason": "cancelled"})
    await dead.replicas.notify_replica("replica-a", "mrtr", "parked-1", {})

    assert await b.replicas.take_over("replica-a", fence_b) == []  # still within its lease
    await until(lambda: _expired(b, "replica-a"), "replica-a's lease expires")
    taken_b, taken_c = await asyncio.gather(
        b.replicas.take_over("replica-a", fence_b), c.replicas.take_over("replica-a", fence_c)
    )

    winner, loser = (taken_b, taken_c) if taken_b else (taken_c, taken_b)
    assert loser == []
    assert [record.task_id for record in winner] == ["task_0", "task_1", "task_2", "task_3"]
    new_owner = "replica-b" if winner is taken_b else "replica-c"
    assert {record.owner for record in winner} == {new_owner}
    assert [record.task_id for record in await b.records.live(owner=new_owner)][:4] == [
        "task_0",
        "task_1",
        "task_2",
        "task_3",
    ]
    assert await b.records.live(owner="replica-a") == []
    assert await b.replicas.expired_replicas() == []  # its lease row is gone
    # The cancel addressed to the dead owner follows its task; a message that was not about a task goes.
    assert [(message.key, message.kind) for message in await b.replicas.take_messages(new_owner)] == [
        ("task_0", CANCEL)
    ]
    assert await b.replicas.take_messages("replica-a") == []
    # A second try finds nothing left.
    assert await c.replicas.take_over("replica-a", fence_c) == []


async def _expired(store: PostgresTaskStore, replica_id: str) -> bool:
    return replica_id in await store.replicas.expired_replicas()


async def test_owners_without_any_lease_count_as_dead(replicas: list[PostgresTaskStore]) -> None:
    a, b, _ = replicas
    await a.records.create(make_record("task_orphan", owner="never-leased"))
    assert await b.replicas.expired_replicas() == ["never-leased"]
    fence = await b.replicas.renew_lease("replica-b", 30)
    assert [record.task_id for record in await b.replicas.take_over("never-leased", fence)] == ["task_orphan"]


async def test_a_replica_without_a_lease_cannot_take_over(replicas: list[PostgresTaskStore]) -> None:
    a, b, _ = replicas
    await a.records.create(make_record("task_orphan", owner="never-leased"))
    paused = await b.replicas.renew_lease("replica-b", 0.2)
    await until(lambda: _expired(b, "replica-b"), "replica-b's own lease expires")
    with pytest.raises(FencedError, match="replica-b holds no lease"):
        await b.replicas.take_over("never-leased", paused)
    got = await a.records.get("task_orphan")
    assert got is not None
    assert got.owner == "never-leased"


async def test_fencing_refuses_a_stale_owners_writes(replicas: list[PostgresTaskStore]) -> None:
    """A replica paused past its lease writes nothing: not before its tasks are taken over, not after."""
    a, b, _ = replicas
    stale = await a.replicas.renew_lease("replica-a", 0.3)
    await a.records.create(make_record("task_a", owner="replica-a"))
    assert await a.records.set_status_message("task_a", "1/2", now_ms=2_000, fence=stale) is not None
    await until(lambda: _expired(b, "replica-a"), "replica-a's lease expires")

    with pytest.raises(FencedError):  # lapsed, not yet taken over: still refused
        await a.records.settle("task_a", TaskStatus.COMPLETED, now_ms=3_000, result={}, fence=stale)
    fence_b = await b.replicas.renew_lease("replica-b", 30)
    assert [record.task_id for record in await b.replicas.take_over("replica-a", fence_b)] == ["task_a"]

    renewed = await a.replicas.renew_lease("replica-a", 30)  # it wakes up: a new epoch, and nothing of its own any more
    assert renewed.epoch != stale.epoch
    for fence in (stale, renewed):
        with pytest.raises(FencedError, match="owned by replica-b"):
            await a.records.settle("task_a", TaskStatus.COMPLETED, now_ms=4_000, result={}, fence=fence)
        with pytest.raises(FencedError):
            await a.records.set_inputs("task_a", {"k": {}}, 1, now_ms=4_000, fence=fence)
    got = await b.records.get("task_a")
    assert got is not None
    assert (got.status, got.owner, got.status_message) == (TaskStatus.WORKING, "replica-b", "1/2")
    done = await b.records.settle("task_a", TaskStatus.COMPLETED, now_ms=5_000, result={"ok": True}, fence=fence_b)
    assert done is not None
    assert done.result == RawJSON('{"ok":true}')


async def test_a_lease_that_lapsed_while_no_replica_could_renew_gets_a_lease_period_after_the_return(
    replicas: list[PostgresTaskStore], pg_dsn: str
) -> None:
    """Nobody renews for longer than half a lease (the store was away for all): the first renewal after that marks
    the store's return, and a holder whose lease lapsed meanwhile is alive (not taken over) until it has had its
    lease period from the return to renew; renewing then keeps its tasks (a new epoch, the same owner)."""
    a, b, _ = replicas
    lapsing = await a.replicas.renew_lease("replica-a", 1.0)
    await a.records.create(make_record("task_a", owner="replica-a"))
    await b.replicas.renew_lease("replica-b", 1.0)
    await until(lambda: _lapsed(pg_dsn, "replica-a"), "replica-a's lease runs out")
    fence_b = await b.replicas.renew_lease("replica-b", 1.0)  # the first renewal after the gap: the store is back
    assert await b.replicas.expired_replicas() == []
    assert await b.replicas.replica_alive("replica-a")
    assert await b.replicas.take_over("replica-a", fence_b) == []
    renewed = await a.replicas.renew_lease("replica-a", 1.0)  # in time: a new epoch, its tasks still its own
    assert renewed.epoch != lapsing.epoch
    done = await a.records.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000, result={}, fence=renewed)
    assert done is not None
    assert done.owner == "replica-a"


async def test_a_holder_that_does_not_renew_after_the_return_is_gone_a_lease_period_later(
    replicas: list[PostgresTaskStore], pg_dsn: str
) -> None:
    a, b, _ = replicas
    await a.replicas.renew_lease("replica-a", 0.6)
    await a.records.create(make_record("task_a", owner="replica-a"))
    await b.replicas.renew_lease("replica-b", 30)
    await until(lambda: _lapsed(pg_dsn, "replica-a"), "replica-a's lease runs out")  # nobody renewed: a gap
    fence_b = await b.replicas.renew_lease("replica-b", 0.6)
    returned = time.monotonic()
    assert await b.replicas.take_over("replica-a", fence_b) == []  # spared: the store has just come back
    await until(lambda: _expired(b, "replica-a"), "replica-a is gone a lease period after the return")
    assert time.monotonic() - returned >= 0.5
    fence_b = await b.replicas.renew_lease("replica-b", 30)
    assert [record.task_id for record in await b.replicas.take_over("replica-a", fence_b)] == ["task_a"]


async def test_a_replica_that_stops_renewing_while_another_renews_is_gone_when_its_lease_runs_out(
    replicas: list[PostgresTaskStore],
) -> None:
    """No gap in the renewals (the store answered all along): a lapsed lease is the holder's own doing (killed,
    paused, cut off alone), and it is gone at once."""
    a, b, _ = replicas
    await a.replicas.renew_lease("replica-a", 0.5)
    fence_b = await b.replicas.renew_lease("replica-b", 0.5)

    async def renewing_b() -> bool:
        nonlocal fence_b
        fence_b = await b.replicas.renew_lease("replica-b", 0.5)
        return await _expired(b, "replica-a")

    await until(renewing_b, "replica-a is gone once its lease ran out")
    assert not await b.replicas.replica_alive("replica-a")


async def _lapsed(dsn: str, replica_id: str) -> bool:
    """Has `replica_id`'s lease run out, by the database's clock?"""
    sql = "SELECT expires_at <= clock_timestamp() FROM replicas WHERE replica_id = %s"
    return bool(await rows(dsn, sql, [replica_id]) == [(True,)])


async def test_a_key_claim_sent_to_a_frozen_server_is_never_committed_after_its_deadline(
    own_pg_server: pg.PgServer,
) -> None:
    """The claim's INSERT reaches the server, which is frozen: the claimer gives up at its deadline (unavailable),
    and when the server thaws and runs the INSERT, nothing commits it (the claimer never sent COMMIT): the key is
    free at once, on any replica."""
    dsn = own_pg_server.dsn(await asyncio.to_thread(own_pg_server.create_database))
    store = await PostgresTaskStore.open(dsn, max_records=10, timeout_seconds=0.5, connect_timeout_seconds=1)
    try:
        record = KeyRecord("alice", "frozen", "fp", "replica-a", created_at_ms=1_000, expires_at_ms=99_000)
        backends = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        before = {row[0] for row in await rows(dsn, backends)}
        own_pg_server.freeze()
        try:
            with pytest.raises(StoreUnavailableError):
                await store.keys.claim_key(record)
        finally:
            own_pg_server.thaw()

        async def settled() -> bool:  # the claim's backend ran what it had been sent, then found its client gone
            return len(before & {row[0] for row in await rows(dsn, backends)}) < len(before)

        await until(settled, "the frozen claim's backend finished")
        assert await rows(dsn, "SELECT key FROM idempotency_keys") == []
        assert await store.keys.claim_key(dataclasses.replace(record, owner="replica-b")) is None
    finally:
        await store.close()


async def test_a_released_lease_can_be_taken_over_at_once(replicas: list[PostgresTaskStore]) -> None:
    a, b, _ = replicas
    leaving = await a.replicas.renew_lease("replica-a", 30)
    await a.records.create(make_record("task_a", owner="replica-a"))
    await a.replicas.release_lease(leaving)
    assert await b.replicas.expired_replicas() == ["replica-a"]
    fence_b = await b.replicas.renew_lease("replica-b", 30)
    assert [record.task_id for record in await b.replicas.take_over("replica-a", fence_b)] == ["task_a"]


async def test_the_feed_carries_a_commit_on_one_replica_to_a_listener_on_another(
    replicas: list[PostgresTaskStore], pg_dsn: str
) -> None:
    a, b, _ = replicas
    await a.records.create(make_record("task_a", owner="replica-b"))
    async with b.replicas.changes(for_replica="replica-b") as changes:
        assert await next_change(changes, skip_resync=False) == Change(RESYNC)
        # A notification in a transaction that rolls back is never delivered.
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            await conn.execute(
                "SELECT pg_notify(%s, %s)", [a.db.channel, Change(CANCEL, "ghost", "replica-b").to_json()]
            )
            await conn.rollback()
        await a.replicas.notify_owner("task_a", INPUT, {"k1": {"action": "accept"}})
        assert await next_change(changes) == Change(INPUT, "task_a", "replica-b")
        await a.records.settle("task_a", TaskStatus.CANCELLED, now_ms=2_000)
        assert await next_change(changes) == Change(STATUS, "task_a", "replica-b", TaskStatus.CANCELLED)
        (message,) = await b.replicas.take_messages("replica-b")
        assert message.payload == {"k1": {"action": "accept"}}


async def test_the_feed_reconnects_after_its_connection_is_killed(
    replicas: list[PostgresTaskStore], pg_dsn: str
) -> None:
    a, b, _ = replicas
    await a.records.create(make_record("task_a", owner="replica-b"))
    async with b.replicas.changes() as changes:
        assert await next_change(changes, skip_resync=False) == Change(RESYNC)
        killed = await rows(
            pg_dsn,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'mcp-tasks-proxy-listen' AND datname = current_database()",
        )
        assert killed == [(True,)]
        assert await next_change(changes, skip_resync=False) == Change(RESYNC)  # back, and says so
        await a.records.set_status_message("task_a", "after the reconnection", now_ms=2_000)
        assert await next_change(changes) == Change(STATUS, "task_a", "replica-b", TaskStatus.WORKING)


async def test_expiry_and_purge_sweeps_do_the_work_once_across_replicas(replicas: list[PostgresTaskStore]) -> None:
    a, b, c = replicas
    for index in range(60):
        await a.records.create(make_record(f"live_{index:02}", created_at_ms=1_000, ttl_ms=100))
        await a.records.create(make_record(f"done_{index:02}", created_at_ms=1_000, ttl_ms=100))
        await a.records.settle(f"done_{index:02}", TaskStatus.COMPLETED, now_ms=1_050)
    error = {"code": -32603, "message": "expired"}
    settled = await asyncio.gather(
        *(store.records.settle_expired(5_000, error=error, status_message="expired") for store in replicas)
    )
    ids = [record.task_id for chunk in settled for record in chunk]
    assert sorted(ids) == [f"live_{index:02}" for index in range(60)]  # each one settled once, by one replica

    purged = await asyncio.gather(
        a.records.purge_expired(5_000), b.records.purge_expired(5_000), c.records.purge_expired(5_000)
    )
    assert sum(purged) == 120  # every record is settled and past its TTL now; each one deleted once
    assert (await c.operators.stats())["records"] == 0


async def test_open_store_picks_postgresql_from_the_config(pg_dsn: str, tmp_path: Path) -> None:
    store = await open_store(StoreConfig(url=pg_dsn_url(pg_dsn), path=str(tmp_path / "unused.db")), max_records=5)
    try:
        assert isinstance(store, PostgresTaskStore)
        await store.records.create(make_record("task_a"))
        assert await store.records.get("task_a") is not None
    finally:
        await store.close()
    assert not (tmp_path / "unused.db").exists()


def pg_dsn_url(dsn: str) -> str:
    """The test DSN (key=value form) as the postgresql:// URL the config takes."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"postgresql://{params['user']}@{params['host']}:{params['port']}/{params['dbname']}"


async def test_a_password_file_is_read_for_each_connection(pg_dsn: str, tmp_path: Path) -> None:
    """A role that must give its password (the throwaway server checks passwords of every role but its admin)."""
    role = f"proxy_{time.monotonic_ns()}"
    await rows(pg_dsn, f"CREATE ROLE {role} LOGIN PASSWORD 'right one'")
    try:
        await rows(pg_dsn, f"GRANT CREATE ON SCHEMA public TO {role}")
        params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
        url = f"postgresql://{role}@{params['host']}:{params['port']}/{params['dbname']}"
        password = tmp_path / "password"
        password.write_text("wrong one\n")
        with pytest.raises(StoreError, match="password authentication failed"):
            await PostgresTaskStore.open(url, max_records=5, password_file=str(password))
        password.write_text("right one\n")  # rotated: the next connection reads it again
        store = await PostgresTaskStore.open(url, max_records=5, password_file=str(password))
        try:
            await store.records.create(make_record("task_a"))
            assert await store.records.get("task_a") is not None
        finally:
            await store.close()
    finally:
        await rows(pg_dsn, f"DROP OWNED BY {role}")
        await rows(pg_dsn, f"DROP ROLE {role}")


async def test_an_unreachable_or_foreign_database_is_a_clear_error(pg_dsn: str) -> None:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    with pytest.raises(StoreError, match="cannot connect to the task store"):
        await PostgresTaskStore.open(
            f"postgresql://postgres@127.0.0.1:1/{params['dbname']}", max_records=5, connect_timeout_seconds=1
        )
    with pytest.raises(StoreError, match="not a task database"):
        await PostgresTaskStore.open(pg_dsn, max_records=5, read_only=True)  # an empty database, nothing migrated


async def test_a_database_of_the_previous_version_gains_the_upstream_task_columns(pg_dsn: str) -> None:
    """A database written before tasks the upstream runs itself existed: the migration adds their columns, once,
    and every record reads as a task of the proxy's own."""
    store = await PostgresTaskStore.open(pg_dsn, max_records=10)
    await store.records.create(make_record("task_old"))
    await store.close()
    await rows(pg_dsn, "DELETE FROM schema_migrations WHERE name = '0004_add_upstream_task'")
    await rows(
        pg_dsn,
        "ALTER TABLE tasks DROP COLUMN upstream_task_id, DROP COLUMN upstream_session_id,"
        " DROP COLUMN upstream_input_ids",
    )

    store = await PostgresTaskStore.open(pg_dsn, max_records=10)
    try:
        old = await store.records.get("task_old")
        assert old is not None
        assert (old.upstream_task_id, old.upstream_session_id, old.upstream_input_ids) == (None, None, {})
        await store.records.create(make_record("task_new", upstream_task_id="up-1", upstream_session_id="s-1"))
        new = await store.records.get("task_new")
        assert new is not None
        assert (new.upstream_task_id, new.upstream_session_id) == ("up-1", "s-1")
    finally:
        await store.close()


async def test_a_database_of_the_previous_version_gains_the_trace_context_column(pg_dsn: str) -> None:
    """A database written before the creating trace context was stored: the migration adds its column, once,
    every older record reads as created with tracing off, and new records keep their context."""
    store = await PostgresTaskStore.open(pg_dsn, max_records=10)
    await store.records.create(make_record("task_old", upstream_task_id="up-1"))
    await store.close()
    await rows(pg_dsn, "DELETE FROM schema_migrations WHERE name = '0005_add_traceparent'")
    await rows(pg_dsn, "ALTER TABLE tasks DROP COLUMN traceparent")

    store = await PostgresTaskStore.open(pg_dsn, max_records=10)
    try:
        await check_trace_context_migrated(store)
    finally:
        await store.close()
    assert await rows(pg_dsn, "SELECT count(*) FROM schema_migrations WHERE name = '0005_add_traceparent'") == [(1,)]


async def test_the_status_counts_agree_with_a_real_count_across_two_replicas(pg_dsn: str) -> None:
    """Two replicas create, settle, ask, expire and purge tasks at once: the counts their triggers keep (what
    `stats` reads, no scan) equal a count of the rows, as each replica reads them, and after a third replica
    opens the same database (a take-over's view)."""
    first, second = [await PostgresTaskStore.open(pg_dsn, max_records=100_000) for _ in range(2)]
    try:

        async def workload(store: PostgresTaskStore, name: str) -> None:
            for n in range(40):
                task_id = f"{name}_{n}"
                await store.records.create(
                    make_record(task_id, created_at_ms=1_000, ttl_ms=1_000 if n % 4 == 0 else 60_000)
                )
                if n % 3 == 0:
                    await store.records.settle(task_id, TaskStatus.COMPLETED, now_ms=1_500, result={"content": []})
                elif n % 3 == 1:
                    await store.records.set_inputs(task_id, {"k": {"method": "elicitation/create"}}, 1, now_ms=1_500)
                if n % 5 == 0:
                    await store.records.settle(task_id, TaskStatus.CANCELLED, now_ms=1_600, status_message="stop")

        await asyncio.gather(workload(first, "a"), workload(second, "b"))
        await second.records.settle_expired(
            2_500, error={"code": -32603, "message": "expired"}, status_message="expired"
        )
        await first.records.purge_expired(2_500, tombstones=True)
        await first.records.delete("b_1")
        found = await rows(pg_dsn, "SELECT status, count(*) FROM tasks GROUP BY status")
        real = {str(status): int(str(n)) for status, n in found}
        assert real
        assert sum(real.values()) < 80  # some were purged
        for store in (first, second):
            counts = await store.operators.stats()
            assert {status: counts[status] for status in real} == real
            assert counts["records"] == sum(real.values())
        third = await PostgresTaskStore.open(pg_dsn, max_records=100_000)
        try:
            assert (await third.operators.stats())["records"] == sum(real.values())
        finally:
            await third.close()
    finally:
        await first.close()
        await second.close()
