"""SqliteTaskStore against real SQLite files under tmp_path; the lock is also checked across real processes."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.tasks import store as store_module
from proxy.tasks.store import (
    SqliteTaskStore,
    StoreError,
    StoreFullError,
    StoreLockedError,
    record_from_row,
)
from proxy.wire.tasks import TaskRecord, TaskStatus

ROOT = Path(__file__).resolve().parent.parent

CHILD_OPEN = """
import asyncio, sys
from proxy.tasks.store import SqliteTaskStore

async def main() -> None:
    if sys.argv[2] == "hold":
        sys.stdin.readline()  # imported and ready; open when the parent says so
    try:
        store = await SqliteTaskStore.open(sys.argv[1], max_records=10)
    except Exception as exc:
        print(type(exc).__name__, flush=True)
        return
    print("opened", flush=True)
    if sys.argv[2] == "hold":
        await asyncio.sleep(60)
    await store.close()

asyncio.run(main())
"""


def make_record(
    task_id: str,
    *,
    status: TaskStatus = TaskStatus.WORKING,
    created_at_ms: int = 1_000,
    updated_at_ms: int | None = None,
    ttl_ms: int | None = 60_000,
    **fields: Any,
) -> TaskRecord:
    return TaskRecord(
        task_id=task_id,
        principal="principal-hash",
        tool="slow_tool",
        status=status,
        created_at_ms=created_at_ms,
        updated_at_ms=created_at_ms if updated_at_ms is None else updated_at_ms,
        ttl_ms=ttl_ms,
        poll_interval_ms=fields.pop("poll_interval_ms", None),
        owner=fields.pop("owner", "proxy-1"),
        on_restart=fields.pop("on_restart", "fail"),
        request=fields.pop("request", {"name": "slow_tool", "arguments": {}}),
        **fields,
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "tasks.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteTaskStore]:
    opened = await SqliteTaskStore.open(db_path, max_records=100)
    yield opened
    await opened.close()


def raw_rows(path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


async def run_child(path: Path, mode: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD_OPEN,
        str(path),
        mode,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def test_create_get_round_trips_every_field(store: SqliteTaskStore, db_path: Path) -> None:
    full = make_record(
        "task_full",
        status=TaskStatus.INPUT_REQUIRED,
        created_at_ms=1_700_000_000_123,
        updated_at_ms=1_700_000_000_456,
        ttl_ms=3_600_000,
        poll_interval_ms=750,
        owner="proxy-7",
        on_restart="rerun",
        request={"name": "slow_tool", "arguments": {"q": "ünïcode ✓", "n": [1, 2.5, None, True]}},
        status_message="50/100 — indexing",
        result={"content": [{"type": "text", "text": "x"}]},
        error={"code": -32603, "message": "boom"},
        input_requests={"key-1": {"method": "elicitation/create", "params": {"message": "ok?"}}},
        inputs_issued=3,
        rerun_principal="Bearer secret",
    )
    bare = make_record("task_bare", ttl_ms=None)
    await store.create(full)
    await store.create(bare)

    got_full = await store.get("task_full")
    got_bare = await store.get("task_bare")
    assert got_full == full
    assert got_bare == bare
    assert got_full is not None
    assert got_full.status is TaskStatus.INPUT_REQUIRED
    assert got_bare is not None
    assert got_bare.ttl_ms is None
    assert got_bare.result is None
    assert got_bare.input_requests == {}
    assert await store.get("task_unknown") is None

    stored = dict(
        (row[0], row[1:]) for row in raw_rows(db_path, "SELECT task_id, expires_at_ms, request, result FROM tasks")
    )
    assert stored["task_full"] == (
        1_700_000_000_123 + 3_600_000,
        json.dumps(full.request, separators=(",", ":")),
        '{"content":[{"type":"text","text":"x"}]}',
    )
    assert stored["task_bare"][0] is None
    assert stored["task_bare"][2] is None


def test_record_from_row_decodes_json_and_status() -> None:
    row = {
        "task_id": "t",
        "principal": "p",
        "tool": "tool",
        "status": "failed",
        "status_message": None,
        "created_at_ms": 1,
        "updated_at_ms": 2,
        "ttl_ms": None,
        "expires_at_ms": None,
        "poll_interval_ms": None,
        "owner": "o",
        "on_restart": "fail",
        "request": '{"a":1}',
        "result": None,
        "error": '{"code":1}',
        "input_requests": "{}",
        "inputs_issued": 4,
        "rerun_principal": None,
        "client_capabilities": '{"elicitation":{}}',
    }
    record = record_from_row(row)
    assert record.client_capabilities == {"elicitation": {}}
    assert record.status is TaskStatus.FAILED
    assert record.request == {"a": 1}
    assert record.error == {"code": 1}
    assert record.result is None
    assert record.inputs_issued == 4


async def test_set_inputs_changes_live_tasks_and_bumps_updated_at(store: SqliteTaskStore) -> None:
    original = make_record("task_a", created_at_ms=1_000)
    await store.create(original)
    asking = await store.set_inputs("task_a", {"k1": {"method": "sampling/createMessage"}}, 1, now_ms=5_000)
    assert asking is not None
    assert asking == await store.get("task_a")
    assert asking.updated_at_ms == 5_000
    assert asking.created_at_ms == 1_000
    assert asking.status is TaskStatus.INPUT_REQUIRED
    assert asking.input_requests == {"k1": {"method": "sampling/createMessage"}}
    assert asking.inputs_issued == 1
    assert (asking.request, asking.tool, asking.ttl_ms, asking.owner) == (
        original.request,
        original.tool,
        original.ttl_ms,
        original.owner,
    )

    back = await store.set_inputs("task_a", {}, 1, now_ms=6_000)
    assert back is not None
    assert back.status is TaskStatus.WORKING
    assert back.input_requests == {}
    assert back.inputs_issued == 1

    progressed = await store.set_status_message("task_a", "3/10", now_ms=7_000)
    assert progressed is not None
    assert (progressed.status_message, progressed.updated_at_ms, progressed.status) == (
        "3/10",
        7_000,
        TaskStatus.WORKING,
    )


async def test_claim_takes_a_live_task_back_to_working_for_a_new_owner(store: SqliteTaskStore) -> None:
    await store.create(make_record("task_a", created_at_ms=1_000))
    await store.set_inputs("task_a", {"k1": {"method": "roots/list"}}, 3, now_ms=2_000)
    claimed = await store.claim("task_a", "proxy-2", "re-running", now_ms=3_000)
    assert claimed is not None
    assert (claimed.owner, claimed.status, claimed.status_message) == ("proxy-2", TaskStatus.WORKING, "re-running")
    assert claimed.input_requests == {}
    assert claimed.inputs_issued == 3  # keys already issued stay issued: a re-run never reuses one


async def test_typed_writes_leave_terminal_and_missing_tasks_alone(store: SqliteTaskStore) -> None:
    await store.create(make_record("task_done", created_at_ms=1_000))
    settled = await store.settle("task_done", TaskStatus.COMPLETED, now_ms=2_000, result={"content": []})
    assert settled is not None
    assert await store.set_status_message("task_done", "late", now_ms=3_000) is None
    assert await store.set_inputs("task_done", {"k": {"method": "roots/list"}}, 1, now_ms=3_000) is None
    assert await store.claim("task_done", "other", "again", now_ms=3_000) is None
    assert await store.get("task_done") == settled
    assert await store.set_status_message("task_missing", "x", now_ms=3_000) is None
    assert (await store.stats())["records"] == 1


async def test_first_settle_wins(store: SqliteTaskStore) -> None:
    await store.create(make_record("task_a"))
    completed, cancelled = await asyncio.gather(
        store.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000, result={"content": [], "resultType": "complete"}),
        store.settle("task_a", TaskStatus.CANCELLED, now_ms=2_001, status_message="cancelled by client"),
    )
    winners = [record for record in (completed, cancelled) if record is not None]
    assert len(winners) == 1
    got = await store.get("task_a")
    assert got is not None
    assert got == winners[0]
    assert got.status in {TaskStatus.COMPLETED, TaskStatus.CANCELLED}

    assert await store.settle("task_a", TaskStatus.FAILED, now_ms=3_000, error={"code": 1, "message": "x"}) is None
    assert await store.get("task_a") == got
    assert await store.settle("task_missing", TaskStatus.FAILED, now_ms=3_000) is None


async def test_settle_clears_input_requests_and_rerun_principal(store: SqliteTaskStore) -> None:
    await store.create(
        make_record(
            "task_a",
            status=TaskStatus.INPUT_REQUIRED,
            status_message="waiting",
            input_requests={"k1": {"method": "elicitation/create"}},
            inputs_issued=1,
            rerun_principal="Bearer secret",
        )
    )
    error = {"code": -32603, "message": "upstream lost"}
    settled = await store.settle("task_a", TaskStatus.FAILED, now_ms=9_000, error=error)
    assert settled is not None
    assert settled == await store.get("task_a")
    assert settled.status is TaskStatus.FAILED
    assert settled.error == error
    assert settled.result is None
    assert settled.status_message is None
    assert settled.input_requests == {}
    assert settled.rerun_principal is None
    assert settled.inputs_issued == 1
    assert settled.updated_at_ms == 9_000


async def test_settle_rejects_live_status(store: SqliteTaskStore) -> None:
    await store.create(make_record("task_a"))
    with pytest.raises(ValueError, match="terminal"):
        await store.settle("task_a", TaskStatus.WORKING, now_ms=2_000)
    got = await store.get("task_a")
    assert got is not None
    assert got.status is TaskStatus.WORKING


async def test_max_records_evicts_the_oldest_settled(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=3)
    try:
        for index, task_id in enumerate(("task_a", "task_b", "task_c")):
            await store.create(make_record(task_id, created_at_ms=1_000 + index))
        await store.settle("task_a", TaskStatus.COMPLETED, now_ms=5_000)
        await store.settle("task_b", TaskStatus.FAILED, now_ms=4_000)  # settled last-created, but earlier
        await store.create(make_record("task_d", created_at_ms=6_000))
        assert await store.get("task_b") is None
        assert await store.get("task_a") is not None
        assert await store.get("task_c") is not None
        assert await store.get("task_d") is not None
        assert (await store.stats())["records"] == 3
    finally:
        await store.close()


async def test_eviction_breaks_updated_at_ties_by_created_at(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=2)
    try:
        await store.create(make_record("task_young", created_at_ms=2_000))
        await store.create(make_record("task_old", created_at_ms=1_000))
        await store.settle("task_young", TaskStatus.CANCELLED, now_ms=3_000)
        await store.settle("task_old", TaskStatus.COMPLETED, now_ms=3_000)
        await store.create(make_record("task_new", created_at_ms=4_000))
        assert await store.get("task_old") is None
        assert await store.get("task_young") is not None
    finally:
        await store.close()


async def test_full_of_live_tasks_raises_and_writes_nothing(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=2)
    try:
        await store.create(make_record("task_a"))
        await store.create(make_record("task_b", status=TaskStatus.INPUT_REQUIRED))
        with pytest.raises(StoreFullError, match="task store full: 2 live tasks"):
            await store.create(make_record("task_c"))
        assert await store.get("task_c") is None
        assert (await store.stats())["records"] == 2
        # A settled task makes room again, and the in-memory count stayed right through the refusal.
        await store.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000)
        await store.create(make_record("task_c"))
        assert await store.get("task_a") is None
        assert (await store.stats())["records"] == 2
    finally:
        await store.close()


async def hold_writer(store: SqliteTaskStore) -> tuple[threading.Event, asyncio.Future[None]]:
    """Occupy the writer thread until the returned event is set (creations queue up meanwhile)."""
    release, started = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        release.wait(10)

    held = asyncio.ensure_future(store._write("hold", block))  # noqa: TID251 (a test's own handle)
    await asyncio.to_thread(started.wait, 10)
    return release, held


async def test_creations_queued_while_the_writer_is_busy_share_one_commit(store: SqliteTaskStore) -> None:
    statements: list[str] = []
    await store.set_trace_callback(statements.append)
    release, held = await hold_writer(store)
    creations = [asyncio.ensure_future(store.create(make_record(f"task_{n}"))) for n in range(40)]  # noqa: TID251
    await asyncio.sleep(0.05)
    assert not any(creation.done() for creation in creations)  # nobody is answered before the commit
    release.set()
    await held
    await asyncio.gather(*creations)
    await store.set_trace_callback(None)

    assert len([sql for sql in statements if sql.startswith("INSERT")]) == 40
    assert [sql for sql in statements if sql == "COMMIT"] == ["COMMIT"]  # one transaction, one fsync
    assert (await store.stats())["records"] == 40
    assert await store.get("task_39") is not None


async def test_a_record_that_fails_in_a_group_takes_back_only_itself(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=3)
    try:
        await store.create(make_record("task_a"))
        release, held = await hold_writer(store)
        names = ["task_b", "task_a", "task_c", "task_d"]  # a duplicate id, then one more than fits
        creations = [asyncio.ensure_future(store.create(make_record(name, owner="x"))) for name in names]  # noqa: TID251
        await asyncio.sleep(0.05)
        release.set()
        await held
        outcomes = await asyncio.gather(*creations, return_exceptions=True)

        assert outcomes[0] is None
        assert isinstance(outcomes[1], StoreError)
        assert isinstance(outcomes[1].__cause__, sqlite3.IntegrityError)
        assert outcomes[2] is None
        assert isinstance(outcomes[3], StoreFullError)
        first = await store.get("task_a")
        assert first is not None
        assert first.owner == "proxy-1"  # the duplicate changed nothing
        assert await store.get("task_d") is None
        assert (await store.stats())["records"] == 3  # the in-memory count followed the group's outcomes
        await store.settle("task_b", TaskStatus.COMPLETED, now_ms=2_000)
        await store.create(make_record("task_d"))  # room again: task_b is evicted
        assert await store.get("task_b") is None
    finally:
        await store.close()


async def test_an_unexpected_failure_in_a_group_answers_every_creator(store: SqliteTaskStore) -> None:
    """Whatever breaks a group commit, nobody waits forever: the group is rolled back and each creator hears."""
    release, held = await hold_writer(store)
    good = asyncio.ensure_future(store.create(make_record("task_good")))  # noqa: TID251
    unstorable = make_record("task_bad", request={"not json": {1, 2}})  # a set: the row cannot be encoded
    bad = asyncio.ensure_future(store.create(unstorable))  # noqa: TID251
    await asyncio.sleep(0.05)
    release.set()
    await held
    outcomes = await asyncio.wait_for(asyncio.gather(good, bad, return_exceptions=True), 5)

    assert all(isinstance(outcome, StoreError) for outcome in outcomes)
    assert "create failed" in str(outcomes[0])
    assert isinstance(outcomes[1], StoreError)
    assert isinstance(outcomes[1].__cause__, TypeError)
    assert await store.get("task_good") is None  # rolled back with its group
    assert (await store.stats())["records"] == 0
    await store.create(make_record("task_good"))  # the store goes on working
    assert await store.get("task_good") is not None


async def test_a_creator_that_leaves_does_not_disturb_its_group(store: SqliteTaskStore) -> None:
    release, held = await hold_writer(store)
    leaving = asyncio.ensure_future(store.create(make_record("task_gone")))  # noqa: TID251
    staying = asyncio.ensure_future(store.create(make_record("task_kept")))  # noqa: TID251
    await asyncio.sleep(0.05)
    leaving.cancel()
    release.set()
    await held
    await staying
    with pytest.raises(asyncio.CancelledError):
        await leaving
    # The record of a creator that left is committed all the same (its caller decides what to do with it).
    assert await store.get("task_kept") is not None
    assert await store.get("task_gone") is not None


async def test_record_count_is_loaded_at_open(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=10)
    for index in range(5):
        await store.create(make_record(f"task_{index}", created_at_ms=1_000 + index))
    for index in range(4):
        await store.settle(f"task_{index}", TaskStatus.COMPLETED, now_ms=2_000 + index)
    await store.close()

    smaller = await SqliteTaskStore.open(db_path, max_records=2)
    try:
        await smaller.create(make_record("task_new"))
        assert sorted(record.task_id for record in await smaller.live()) == ["task_4", "task_new"]
        assert (await smaller.stats())["records"] == 2
    finally:
        await smaller.close()


async def test_duplicate_id_is_a_store_error(store: SqliteTaskStore) -> None:
    await store.create(make_record("task_a"))
    with pytest.raises(StoreError, match="create task_a failed") as caught:
        await store.create(make_record("task_a", owner="someone-else"))
    assert isinstance(caught.value.__cause__, sqlite3.IntegrityError)
    got = await store.get("task_a")
    assert got is not None
    assert got.owner == "proxy-1"


async def test_expired_live_and_purge_expired_boundaries(store: SqliteTaskStore, db_path: Path) -> None:
    await store.create(make_record("live_a", created_at_ms=1_000, ttl_ms=100))  # expires 1100
    await store.create(make_record("live_forever", created_at_ms=1_000, ttl_ms=None))
    await store.create(make_record("live_c", status=TaskStatus.INPUT_REQUIRED, created_at_ms=1_000, ttl_ms=200))
    await store.create(make_record("done_d", created_at_ms=1_000, ttl_ms=100))  # expires 1100
    await store.create(make_record("done_e", created_at_ms=1_000, ttl_ms=300))  # expires 1300
    await store.create(make_record("done_forever", created_at_ms=1_000, ttl_ms=None))
    for task_id in ("done_d", "done_e", "done_forever"):
        await store.settle(task_id, TaskStatus.COMPLETED, now_ms=1_050)

    assert await store.expired_live(1_099) == []
    assert [record.task_id for record in await store.expired_live(1_100)] == ["live_a"]
    assert [record.task_id for record in await store.expired_live(1_200)] == ["live_a", "live_c"]
    assert [record.task_id for record in await store.expired_live(10**15)] == ["live_a", "live_c"]
    assert sorted(record.task_id for record in await store.live()) == ["live_a", "live_c", "live_forever"]

    assert await store.purge_expired(1_099) == 0
    assert await store.purge_expired(1_100) == 1
    assert await store.get("done_d") is None
    assert await store.get("live_a") is not None  # expired but live: the runner settles it, purge never deletes it
    assert await store.purge_expired(10**15) == 1
    assert await store.get("done_e") is None
    assert await store.get("done_forever") is not None
    assert (await store.stats())["records"] == 4

    # Both range queries walk the expires_at_ms index, not every record of a status.
    for sql in (store_module._EXPIRED_LIVE_SQL, store_module._PURGE_SQL):
        plan = " ".join(str(row[-1]) for row in raw_rows(db_path, f"EXPLAIN QUERY PLAN {sql}", (0,)))
        assert "idx_tasks_expires_at_ms" in plan


async def test_delete(store: SqliteTaskStore) -> None:
    await store.create(make_record("task_a"))
    assert await store.delete("task_a") is True
    assert await store.get("task_a") is None
    assert await store.delete("task_a") is False
    assert (await store.stats())["records"] == 0


async def test_stats_counts_by_status(store: SqliteTaskStore) -> None:
    assert await store.stats() == {
        "working": 0,
        "input_required": 0,
        "completed": 0,
        "failed": 0,
        "cancelled": 0,
        "records": 0,
    }
    for index in range(3):
        await store.create(make_record(f"working_{index}"))
    await store.create(make_record("input_0", status=TaskStatus.INPUT_REQUIRED))
    for index, status in enumerate((TaskStatus.COMPLETED, TaskStatus.COMPLETED, TaskStatus.CANCELLED)):
        await store.create(make_record(f"settled_{index}"))
        await store.settle(f"settled_{index}", status, now_ms=2_000)
    assert await store.stats() == {
        "working": 3,
        "input_required": 1,
        "completed": 2,
        "failed": 0,
        "cancelled": 1,
        "records": 7,
    }


async def test_durable_across_reopen(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=10)
    assert db_path.parent.is_dir()  # created on open
    record = make_record("task_a", input_requests={"k": {"x": 1}})
    await store.create(record)
    settled = await store.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000, result={"content": []})
    await store.create(make_record("task_b"))
    await store.close()
    assert not await asyncio.to_thread(Path(f"{db_path}-wal").exists)  # checkpointed and removed on close

    migrations = raw_rows(db_path, "SELECT migration_set, name, applied_at FROM _sqlite_migrations")
    assert [row[:2] for row in migrations] == [
        ("mcp-tasks-proxy", "0001_create_tasks"),
        ("mcp-tasks-proxy", "0002_create_health"),
        ("mcp-tasks-proxy", "0003_add_client_capabilities"),
    ]
    assert raw_rows(db_path, "PRAGMA journal_mode") == [("wal",)]
    indexes = {row[0] for row in raw_rows(db_path, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"idx_tasks_status", "idx_tasks_expires_at_ms", "idx_tasks_status_updated_at_ms"} <= indexes

    reopened = await SqliteTaskStore.open(db_path, max_records=10)
    try:
        assert await reopened.get("task_a") == settled
        assert await reopened.get("task_b") == make_record("task_b")
        assert [record.task_id for record in await reopened.live()] == ["task_b"]
    finally:
        await reopened.close()
    assert raw_rows(db_path, "SELECT migration_set, name, applied_at FROM _sqlite_migrations") == migrations
    assert raw_rows(db_path, "PRAGMA integrity_check") == [("ok",)]


@pytest.mark.parametrize(("synchronous", "expected"), [("normal", 1), ("full", 2)])
async def test_connection_pragmas(db_path: Path, synchronous: Any, expected: int) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=10, synchronous=synchronous)
    try:
        writer = store._writer
        assert writer is not None

        def pragmas() -> tuple[Any, ...]:
            conn = store._writer_conn().conn
            return tuple(
                conn.execute(f"PRAGMA {name}").fetchone()[0] for name in ("synchronous", "journal_mode", "busy_timeout")
            )

        assert await asyncio.get_running_loop().run_in_executor(writer, pragmas) == (expected, "wal", 5000)
    finally:
        await store.close()


async def test_close_is_idempotent_and_closed_store_refuses_work(store: SqliteTaskStore) -> None:
    await store.create(make_record("task_a"))
    await asyncio.gather(store.close(), store.close())
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.get("task_a")
    with pytest.raises(StoreError, match="closed"):
        await store.create(make_record("task_b"))


async def test_second_open_in_process_is_locked_out(store: SqliteTaskStore, db_path: Path) -> None:
    with pytest.raises(StoreLockedError, match="is in use by another mcp-tasks-proxy process") as caught:
        await SqliteTaskStore.open(db_path, max_records=10)
    assert str(db_path) in str(caught.value)
    await store.close()
    again = await SqliteTaskStore.open(db_path, max_records=10)
    await again.close()


async def test_lock_excludes_other_processes(store: SqliteTaskStore, db_path: Path) -> None:
    # Both children start together (their imports dominate the run time); the holder waits for "go".
    child, holder = await run_child(db_path, "close"), await run_child(db_path, "hold")
    try:
        out, _ = await child.communicate()
        assert out.decode().strip() == "StoreLockedError"
        await store.close()

        # A process killed while holding the store leaves no stale lock behind.
        assert holder.stdin is not None
        assert holder.stdout is not None
        holder.stdin.write(b"go\n")
        await holder.stdin.drain()
        assert (await holder.stdout.readline()).decode().strip() == "opened"
        with pytest.raises(StoreLockedError):
            await SqliteTaskStore.open(db_path, max_records=10)
    finally:
        if holder.returncode is None:
            holder.send_signal(signal.SIGKILL)
        await holder.wait()
    after = await SqliteTaskStore.open(db_path, max_records=10)
    await after.close()


async def test_failed_open_releases_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not a sqlite database, just some bytes " * 100)
    with pytest.raises(StoreError, match=r"garbage\.db"):
        await SqliteTaskStore.open(path, max_records=10)
    fd = os.open(f"{path}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the failed open still held it
    finally:
        os.close(fd)


async def test_read_only_sees_commits_and_refuses_writes(store: SqliteTaskStore, db_path: Path) -> None:
    await store.create(make_record("task_a"))
    reader = await SqliteTaskStore.open(db_path, max_records=10, read_only=True)  # no lock taken
    try:
        assert await reader.get("task_a") == make_record("task_a")
        await store.create(make_record("task_b"))
        assert await reader.get("task_b") == make_record("task_b")
        assert (await reader.stats())["working"] == 2
        with pytest.raises(StoreError, match="read-only"):
            await reader.create(make_record("task_c"))
        with pytest.raises(StoreError, match="read-only"):
            await reader.set_status_message("task_a", "x", now_ms=2_000)
        with pytest.raises(StoreError, match="read-only"):
            await reader.settle("task_a", TaskStatus.CANCELLED, now_ms=2_000)
        with pytest.raises(StoreError, match="read-only"):
            await reader.delete("task_a")
        with pytest.raises(StoreError, match="read-only"):
            await reader.purge_expired(10**15)
        got = await store.get("task_a")
        assert got is not None
        assert got.status is TaskStatus.WORKING
    finally:
        await reader.close()


async def test_read_only_rejects_a_foreign_or_missing_database(tmp_path: Path) -> None:
    foreign = tmp_path / "other.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="not a task database"):
        await SqliteTaskStore.open(foreign, max_records=10, read_only=True)
    with pytest.raises(StoreError, match=r"missing\.db"):
        await SqliteTaskStore.open(tmp_path / "missing.db", max_records=10, read_only=True)
    assert not await asyncio.to_thread((tmp_path / "missing.db").exists)


async def test_sqlite_work_never_runs_on_the_event_loop_thread(store: SqliteTaskStore) -> None:
    seen: list[tuple[str, str]] = []
    await store.set_trace_callback(lambda sql: seen.append((threading.current_thread().name, sql)))
    await store.create(make_record("task_a", ttl_ms=10))
    await store.create(make_record("task_b"))
    await store.get("task_a")
    await store.set_status_message("task_a", "x", now_ms=2_000)
    await store.live()
    await store.expired_live(5_000)
    await store.settle("task_a", TaskStatus.COMPLETED, now_ms=3_000)
    await store.purge_expired(5_000)
    await store.delete("task_b")
    await store.stats()
    await store.set_trace_callback(None)

    assert threading.current_thread().name not in {name for name, _ in seen}
    writes = [name for name, sql in seen if sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))]
    reads = [name for name, sql in seen if sql.lstrip().upper().startswith("SELECT")]
    assert len(writes) >= 5
    assert len(reads) >= 4
    assert all(name.startswith("task-store-writer") for name in writes)
    assert all(name.startswith("task-store-reader") for name in reads)
