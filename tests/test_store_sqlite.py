"""SqliteTaskStore specifics, against real SQLite files under tmp_path: the file lock (also across real
processes), WAL and pragmas, migrations, query plans, the threads that run SQLite. The contract both stores
share is in test_store.py."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.tasks.store import SqliteTaskStore, StoreError, StoreLockedError, StoreUnavailableError
from proxy.tasks.store import sqlite_schema as schema
from proxy.tasks.store.sqlite import HOUSEKEEPING_BATCH
from proxy.tasks.store.sqlite_writer import translated
from proxy.wire.tasks import TaskStatus
from tests.support.disks import ext4_on_loop, fail_file_system, fill, remount_checked, small_tmpfs
from tests.support.records import check_trace_context_migrated, hold_creations, make_record

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


def executed(traced: list[str]) -> list[str]:
    """The statements a trace saw, each once: SQLite traces a statement again at the start of each trigger it
    fires (the counts by status are kept by triggers), with the same text."""
    return [sql for index, sql in enumerate(traced) if index == 0 or traced[index - 1] != sql]


async def test_a_group_commit_is_one_transaction_and_one_fsync(store: SqliteTaskStore) -> None:
    statements: list[str] = []
    await store.set_trace_callback(statements.append)
    release, held = await hold_creations(store)
    creations = [asyncio.ensure_future(store.records.create(make_record(f"task_{n}"))) for n in range(40)]  # noqa: TID251
    await asyncio.sleep(0.05)
    release.set()
    await held
    await asyncio.gather(*creations)
    await store.set_trace_callback(None)
    assert len([sql for sql in executed(statements) if sql.startswith("INSERT")]) == 40
    assert [sql for sql in statements if sql == "COMMIT"] == ["COMMIT"]


async def test_a_duplicate_id_carries_sqlites_integrity_error(store: SqliteTaskStore) -> None:
    await store.records.create(make_record("task_a"))
    with pytest.raises(StoreError, match="create task_a failed") as caught:
        await store.records.create(make_record("task_a", owner="someone-else"))
    assert isinstance(caught.value.__cause__, sqlite3.IntegrityError)


async def test_expiry_queries_walk_the_expiry_index(store: SqliteTaskStore, db_path: Path) -> None:
    purge = f"DELETE {schema.PURGE_BATCH_WHERE}"
    bury = schema.BURY_SQL + schema.PURGE_BATCH_WHERE  # with tombstones: bury
    for sql, params in ((schema.EXPIRED_LIVE_SQL, (0,)), (purge, (0, 10)), (bury, ("expired", 0, 0, 10))):
        plan = " ".join(str(row[-1]) for row in raw_rows(db_path, f"EXPLAIN QUERY PLAN {sql}", params))
        assert "idx_tasks_expires_at_ms" in plan
    trim = schema.TRIM_OLDEST_TOMBSTONES_SQL
    plan = " ".join(str(row[-1]) for row in raw_rows(db_path, f"EXPLAIN QUERY PLAN {trim}", (10,)))
    assert "idx_tombstones_gone_at_ms" in plan  # the oldest, by the index: no sort of every tombstone
    assert "TEMP B-TREE" not in plan


async def test_the_purge_goes_in_batches_and_a_creation_is_committed_between_two(db_path: Path) -> None:
    """Expired records two and a bit batches' worth: a creation asked for while the first batch holds the writer
    thread is committed before the second batch begins (shown by the order of the statements on that thread,
    not by timing), and every expired record is gone, each leaving its tombstone."""
    store = await SqliteTaskStore.open(db_path, max_records=10_000)
    try:
        expired = 2 * HOUSEKEEPING_BATCH + 10
        await asyncio.gather(
            *(
                store.records.create(
                    make_record(f"task_{n}", status=TaskStatus.COMPLETED, created_at_ms=1_000, ttl_ms=1_000)
                )
                for n in range(expired)
            )
        )
        statements: list[str] = []
        first_batch, go_on = threading.Event(), threading.Event()

        def trace(sql: str) -> None:
            statements.append(sql)
            if sql.startswith("DELETE FROM tasks") and not first_batch.is_set():
                first_batch.set()
                go_on.wait(10)  # the writer thread stays in the first batch until the creation is queued

        await store.set_trace_callback(trace)
        purge = asyncio.ensure_future(store.records.purge_expired(5_000, tombstones=True))  # noqa: TID251
        await asyncio.to_thread(first_batch.wait, 10)
        creation = asyncio.ensure_future(store.records.create(make_record("task_new")))  # noqa: TID251
        await asyncio.sleep(0)  # it is queued on the writer thread now, behind the first batch
        go_on.set()
        assert await purge == expired
        await creation
        await store.set_trace_callback(None)
    finally:
        await store.close()
    statements = executed(statements)
    deletes = [index for index, sql in enumerate(statements) if sql.startswith("DELETE FROM tasks")]
    insert = next(index for index, sql in enumerate(statements) if sql.startswith("INSERT INTO tasks"))
    assert len(deletes) == 3  # 1000, 1000, 10
    assert deletes[0] < insert < deletes[1]
    remaining = raw_rows(db_path, "SELECT task_id FROM tasks")
    assert remaining == [("task_new",)]
    assert raw_rows(db_path, "SELECT COUNT(*) FROM tombstones") == [(expired,)]


async def test_the_tombstones_trim_goes_in_batches_and_keeps_the_newest(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=10_000)
    try:
        count = 2 * HOUSEKEEPING_BATCH + 500
        for n in range(count):  # each gone at its own time: task_{n} at n
            await store.records.create(make_record(f"task_{n}", status=TaskStatus.COMPLETED, created_at_ms=1_000))
        for n in range(count):
            await store.records.delete(f"task_{n}", tombstone_at_ms=n)
        statements: list[str] = []
        await store.set_trace_callback(statements.append)
        assert await store.records.trim_tombstones(100, keep=1_000) == count - 1_000
        await store.set_trace_callback(None)
    finally:
        await store.close()
    kept = sorted(
        int(task_id.removeprefix("task_")) for (task_id,) in raw_rows(db_path, "SELECT task_id FROM tombstones")
    )
    assert kept == list(range(count - 1_000, count))  # the newest 1000
    assert len([sql for sql in executed(statements) if sql.startswith("DELETE FROM tombstones")]) >= 3


async def test_durable_across_reopen(db_path: Path) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=10)
    assert db_path.parent.is_dir()  # created on open
    record = make_record("task_a", input_requests={"k": {"x": 1}})
    await store.records.create(record)
    settled = await store.records.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000, result={"content": []})
    await store.records.create(make_record("task_b"))
    await store.close()
    assert not await asyncio.to_thread(Path(f"{db_path}-wal").exists)  # checkpointed and removed on close

    migrations = raw_rows(db_path, "SELECT migration_set, name, applied_at FROM _sqlite_migrations")
    assert [row[:2] for row in migrations] == [
        ("mcp-tasks-proxy", "0001_create_tasks"),
        ("mcp-tasks-proxy", "0002_create_health"),
        ("mcp-tasks-proxy", "0003_add_client_capabilities"),
        ("mcp-tasks-proxy", "0004_create_messages_and_tool_durations"),
        ("mcp-tasks-proxy", "0005_add_upstream_task"),
        ("mcp-tasks-proxy", "0006_add_traceparent"),
        ("mcp-tasks-proxy", "0007_add_jobs"),
        ("mcp-tasks-proxy", "0008_create_tombstones"),
        ("mcp-tasks-proxy", "0009_add_admission_queue"),
        ("mcp-tasks-proxy", "0010_create_idempotency_keys"),
        ("mcp-tasks-proxy", "0011_count_tasks_by_status"),
        ("mcp-tasks-proxy", "0012_create_grants"),
    ]
    assert raw_rows(db_path, "PRAGMA journal_mode") == [("wal",)]
    indexes = {row[0] for row in raw_rows(db_path, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"idx_tasks_status", "idx_tasks_expires_at_ms", "idx_tasks_status_updated_at_ms"} <= indexes

    reopened = await SqliteTaskStore.open(db_path, max_records=10)
    try:
        assert await reopened.records.get("task_a") == settled
        assert await reopened.records.get("task_b") == make_record("task_b")
        assert [record.task_id for record in await reopened.records.live()] == ["task_b"]
    finally:
        await reopened.close()
    assert raw_rows(db_path, "SELECT migration_set, name, applied_at FROM _sqlite_migrations") == migrations
    assert raw_rows(db_path, "PRAGMA integrity_check") == [("ok",)]


@pytest.mark.parametrize(("synchronous", "expected"), [("normal", 1), ("full", 2)])
async def test_connection_pragmas(db_path: Path, synchronous: Any, expected: int) -> None:
    store = await SqliteTaskStore.open(db_path, max_records=10, synchronous=synchronous)
    try:
        writer = store.db.writer_thread("pragmas")

        def pragmas() -> tuple[Any, ...]:
            conn = store._writer.db().conn
            return tuple(
                conn.execute(f"PRAGMA {name}").fetchone()[0] for name in ("synchronous", "journal_mode", "busy_timeout")
            )

        assert await asyncio.get_running_loop().run_in_executor(writer, pragmas) == (expected, "wal", 5000)
    finally:
        await store.close()


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
    await store.records.create(make_record("task_a", ttl_ms=10))
    await store.records.create(make_record("task_b"))
    await store.records.get("task_a")
    await store.records.set_status_message("task_a", "x", now_ms=2_000)
    await store.records.live()
    await store.records.expired_live(5_000)
    await store.records.settle("task_a", TaskStatus.COMPLETED, now_ms=3_000)
    await store.records.purge_expired(5_000)
    await store.records.delete("task_b")
    await store.operators.stats()
    await store.set_trace_callback(None)

    assert threading.current_thread().name not in {name for name, _ in seen}
    writes = [name for name, sql in seen if sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))]
    reads = [name for name, sql in seen if sql.lstrip().upper().startswith("SELECT")]
    assert len(writes) >= 5
    assert len(reads) >= 4
    assert all(name.startswith("task-store-writer") for name in writes)
    assert all(name.startswith("task-store-reader") for name in reads)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask a container may run with: modes must not depend on the umask being strict."""
    previous = os.umask(0o000)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("open_umask")
async def test_database_files_are_owner_only_and_a_created_directory_is_0700(tmp_path: Path) -> None:
    path = tmp_path / "new" / "deeper" / "tasks.db"
    store = await SqliteTaskStore.open(path, max_records=10)
    try:
        await store.records.create(make_record("task_modes"))
        files = {name: path.with_name(path.name + name) for name in ("", "-wal", "-shm", ".lock")}
        assert all(file.exists() for file in files.values()), sorted(os.listdir(path.parent))
        assert {name: _mode(file) for name, file in files.items()} == dict.fromkeys(files, 0o600)
        assert (_mode(path.parent), _mode(path.parent.parent)) == (0o700, 0o700)
    finally:
        await store.close()


@pytest.mark.usefixtures("open_umask")
async def test_an_existing_directory_keeps_its_mode_and_open_files_lose_group_and_other_access(
    tmp_path: Path,
) -> None:
    """A database left 0644 by an older version is narrowed at the next start; the operator's directory (a
    volume mount, say) is left as it is."""
    directory = tmp_path / "volume"
    directory.mkdir(mode=0o775)
    os.chmod(directory, 0o775)
    path = directory / "tasks.db"
    sqlite3.connect(path).close()
    os.chmod(path, 0o644)
    store = await SqliteTaskStore.open(path, max_records=10)
    try:
        await store.records.create(make_record("task_modes"))
        assert _mode(path) == 0o600
        assert _mode(path.with_name("tasks.db-wal")) == 0o600
    finally:
        await store.close()
    assert _mode(directory) == 0o775


async def test_a_foreign_lookup_never_reads_the_result_out_of_sqlite(store: SqliteTaskStore) -> None:
    """The owner is part of the one statement a lookup runs: a foreign caller's lookup returns no row, so the
    stored result is never read out of SQLite nor decoded (it used to be, before the owner check)."""
    await store.records.create(make_record("task_big"))
    await store.records.settle(
        "task_big", TaskStatus.COMPLETED, now_ms=2_000, result={"content": [{"text": "x" * 100_000}]}
    )
    statements: list[str] = []
    await store.set_trace_callback(statements.append)
    assert await store.records.get("task_big", principal="another-hash") is None
    await store.set_trace_callback(None)
    assert statements == ["SELECT * FROM tasks WHERE task_id = 'task_big' AND principal = 'another-hash'"]


async def test_a_database_of_the_previous_version_gains_the_upstream_task_columns(db_path: Path) -> None:
    """A file written before tasks the upstream runs itself existed: the migration adds their columns and every
    record reads as a task of the proxy's own."""
    store = await SqliteTaskStore.open(db_path, max_records=10)
    await store.records.create(make_record("task_old", input_requests={"k": {"method": "roots/list"}}))
    await store.close()
    with sqlite3.connect(db_path) as conn:  # back to the schema before the migration
        conn.execute("DELETE FROM _sqlite_migrations WHERE name = '0005_add_upstream_task'")
        for column in ("upstream_task_id", "upstream_session_id", "upstream_input_ids"):
            conn.execute(f"ALTER TABLE tasks DROP COLUMN {column}")
    assert "upstream_task_id" not in {row[1] for row in raw_rows(db_path, "PRAGMA table_info(tasks)")}

    store = await SqliteTaskStore.open(db_path, max_records=10)
    try:
        old = await store.records.get("task_old")
        assert old is not None
        assert (old.upstream_task_id, old.upstream_session_id, old.upstream_input_ids) == (None, None, {})
        assert old.input_requests == {"k": {"method": "roots/list"}}
    finally:
        await store.close()


async def test_a_database_of_the_previous_version_gains_the_trace_context_column(db_path: Path) -> None:
    """A file written before the creating trace context was stored: the migration adds its column, every older
    record reads as created with tracing off, and new records keep their context."""
    store = await SqliteTaskStore.open(db_path, max_records=10)
    await store.records.create(make_record("task_old", upstream_task_id="up-1"))
    await store.close()
    with sqlite3.connect(db_path) as conn:  # back to the schema before the migration
        conn.execute("DELETE FROM _sqlite_migrations WHERE name = '0006_add_traceparent'")
        conn.execute("ALTER TABLE tasks DROP COLUMN traceparent")
    assert "traceparent" not in {row[1] for row in raw_rows(db_path, "PRAGMA table_info(tasks)")}

    store = await SqliteTaskStore.open(db_path, max_records=10)
    try:
        await check_trace_context_migrated(store)
    finally:
        await store.close()


async def test_a_full_disk_refuses_commits_as_unavailable_serves_reads_and_recovers_when_space_returns() -> None:
    """SQLITE_FULL (https://www.sqlite.org/rescode.html#full) is transient for the store: creation, a settlement
    and the readiness write raise StoreUnavailableError("sqlite", "disk full"); reads are still served; once
    space returns the same writer thread and connection commit again, and the file passes integrity_check."""
    with small_tmpfs("4m") as directory:
        path = directory / "tasks.db"
        store = await SqliteTaskStore.open(path, max_records=100)
        try:
            await store.records.create(make_record("task_before"))
            filler = fill(directory)
            with pytest.raises(StoreUnavailableError) as created:
                await store.records.create(make_record("task_during"))
            assert (created.value.kind, created.value.reason) == ("sqlite", "disk full")
            with pytest.raises(StoreUnavailableError):
                await store.records.settle("task_before", TaskStatus.COMPLETED, now_ms=2_000, result={"content": []})
            with pytest.raises(StoreUnavailableError):
                await store.check_writable(2_000)
            record = await store.records.get("task_before")
            assert record is not None
            assert record.status is TaskStatus.WORKING
            assert await store.records.get("task_during") is None

            filler.unlink()
            await store.check_writable(3_000)
            await store.records.create(make_record("task_after"))
            settled = await store.records.settle(
                "task_before", TaskStatus.COMPLETED, now_ms=3_000, result={"content": []}
            )
            assert settled is not None
            assert settled.status is TaskStatus.COMPLETED
            assert (await store.operators.stats())["records"] == 2
        finally:
            await store.close()
        assert raw_rows(path, "PRAGMA integrity_check") == [("ok",)]


async def test_a_file_system_turned_read_only_refuses_commits_as_unavailable_and_keeps_the_file_intact() -> None:
    """A disk error makes ext4 (`errors=remount-ro`) read-only under the open database: SQLite's writes fail
    with SQLITE_IOERR (https://www.sqlite.org/rescode.html#ioerr), which the store raises as
    StoreUnavailableError; the writer thread keeps answering (the same error, no hang), reads are served, and
    after the operator's repair and remount the file passes integrity_check with every committed record."""
    with ext4_on_loop() as (directory, image, device):
        path = directory / "tasks.db"
        store = await SqliteTaskStore.open(path, max_records=100)
        try:
            await store.records.create(make_record("task_before"))
            fail_file_system(device)
            for _ in range(2):
                with pytest.raises(StoreUnavailableError) as refused:
                    await store.check_writable(2_000)
                assert refused.value.reason in ("I/O error", "read-only file system")
            with pytest.raises(StoreUnavailableError):
                await store.records.create(make_record("task_during"))
            with pytest.raises(StoreUnavailableError):
                await store.records.settle("task_before", TaskStatus.COMPLETED, now_ms=2_000, result={"content": []})
            record = await store.records.get("task_before")
            assert record is not None
            assert record.status is TaskStatus.WORKING
        finally:
            with contextlib.suppress(StoreError):  # its last checkpoint cannot be written either
                await store.close()
        remount_checked(directory, image)
        assert raw_rows(path, "PRAGMA integrity_check") == [("ok",)]
        assert raw_rows(path, "SELECT task_id, status FROM tasks") == [("task_before", "working")]


async def test_sqlite_refusing_a_write_as_read_only_is_unavailable_not_a_failure(db_path: Path) -> None:
    """SQLITE_READONLY (https://www.sqlite.org/rescode.html#readonly), raised by a real connection that may not
    write, is translated as transient like a full disk."""
    store = await SqliteTaskStore.open(db_path, max_records=10)
    await store.close()
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA query_only = 1")
    try:
        with pytest.raises(sqlite3.Error) as raised:
            conn.execute("DELETE FROM tasks")
    finally:
        conn.close()
    error = translated(raised.value, "refused")
    assert isinstance(error, StoreUnavailableError)
    assert (error.kind, error.reason) == ("sqlite", "read-only file system")
    assert type(translated(sqlite3.OperationalError("no such table: x"), "refused")) is StoreError
