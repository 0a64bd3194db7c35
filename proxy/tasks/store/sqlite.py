"""The SQLite task store: one file, one process (the embedded default): its ports (records, replicas, keys,
usage, operators) composed over one `SqliteDb` (the writer and reader threads, every call off the event loop);
the lease never lapses and the feed is in-process. Depends on sqlite-utils and the store's own modules."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

from proxy.tasks.store import keys
from proxy.tasks.store import sqlite_schema as schema
from proxy.tasks.store.base import (
    EXPIRED,
    PURGED,
    STATUS,
    Change,
    Fence,
    Message,
    StoreError,
    StoreHealth,
    TaskQuery,
    Tombstone,
    check_kind,
)
from proxy.tasks.store.batching import CreationBatcher
from proxy.tasks.store.feed import LocalFeed
from proxy.tasks.store.grants import GrantsTable
from proxy.tasks.store.rows import (
    LIVE_SQL,
    STATUS_KEYS,
    TERMINAL_SQL,
    LiveWrites,
    WindowCounts,
    encode,
    query_sql,
    settle_values,
)
from proxy.tasks.store.sqlite_threads import SqliteDb
from proxy.tasks.store.sqlite_writer import SqliteWriter, rows, wall_ms
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

_EPOCH: Final = 1  # the one process holds the file lock: its lease never lapses
# Rows the purge and the tombstones' trim delete per transaction: about 30 ms of the writer thread each (a row
# and its tombstone take about 30 us), so a creation waits for one batch at most (`benchmarks.housekeeping`).
HOUSEKEEPING_BATCH: Final = 1000


def _live_update(
    task_id: str, values: Mapping[str, Any], now_ms: int, fence: Fence | None
) -> tuple[str, dict[str, Any]]:
    """The conditional UPDATE ... RETURNING of a live task (a settled one never changes), and its parameters."""
    assignments = ", ".join([*(f"{name} = :{name}" for name in values), "updated_at_ms = :now_ms"])
    fenced = " AND owner = :fence_owner" if fence is not None else ""
    sql = f"UPDATE tasks SET {assignments} WHERE task_id = :task_id AND status IN ({LIVE_SQL}){fenced} RETURNING *"
    return sql, {**values, "now_ms": now_ms, "task_id": task_id, "fence_owner": fence and fence.owner}


class SqliteRecords:
    """The records port: a task's record in the file, every write through the writer thread."""

    def __init__(self, db: SqliteDb, writer: SqliteWriter, feed: LocalFeed) -> None:
        self.db = db
        self.writer = writer
        self.feed = feed
        self._batcher = CreationBatcher(writer.create_all, str(db.path))
        live = LiveWrites(self.update)  # the writes of a live task, alike on every backend
        self.set_inputs = live.set_inputs
        self.set_status_message = live.set_status_message
        self.claim = live.claim
        self.set_queued = live.set_queued
        self.settle = live.settle

    async def create(self, record: TaskRecord) -> None:
        """Returns once the record is committed.

        Group commit: creations that arrive while the writer thread is busy are committed together, in one
        transaction and one fsync, when it gets to them. Each record still fails on its own (its own
        savepoint): a full store refuses the records that do not fit, not the whole group.
        """
        await self._batcher.create(self.db.writer_thread(f"create {record.task_id}"), record)

    async def get(self, task_id: str, *, principal: str | None = None) -> TaskRecord | None:
        if principal is None:
            sql, params = "SELECT * FROM tasks WHERE task_id = ?", [task_id]
        else:  # the owner is checked inside SQLite: another caller's row (and its result) never leaves it
            sql, params = "SELECT * FROM tasks WHERE task_id = ? AND principal = ?", [task_id, principal]
        records = await self.db.read(f"get {task_id}", lambda: self.db.select(sql, params))
        return records[0] if records else None

    async def update(
        self, task_id: str, values: Mapping[str, Any], now_ms: int, fence: Fence | None
    ) -> TaskRecord | None:
        """Change a live task (a settled one never changes); the record as it is now, or None."""
        sql, params = _live_update(task_id, values, now_ms, fence)
        record = await self.db.write(f"update {task_id}", lambda: self.writer.change(sql, params, task_id, fence))
        if record is not None:
            self.feed.publish(Change(STATUS, record.task_id, record.owner, record.status))
        return record

    async def live(self, owner: str | None = None) -> list[TaskRecord]:
        mine = "" if owner is None else " AND owner = ?"
        sql = f"SELECT * FROM tasks WHERE status IN ({LIVE_SQL}){mine} ORDER BY created_at_ms, task_id"
        return await self.db.read("live", lambda: self.db.select(sql, [] if owner is None else [owner]))

    async def expired_live(self, now_ms: int) -> list[TaskRecord]:
        return await self.db.read("expired_live", lambda: self.db.select(schema.EXPIRED_LIVE_SQL, [now_ms]))

    async def settle_expired(self, now_ms: int, *, error: JSON, status_message: str) -> list[TaskRecord]:
        """Every live task past its TTL settled `failed` with `error`; the records settled here."""
        settled = []
        for record in await self.expired_live(now_ms):
            done = await self.settle(
                record.task_id, TaskStatus.FAILED, now_ms=now_ms, error=error, status_message=status_message
            )
            if done is not None:
                settled.append(done)
        return settled

    async def purge_expired(self, now_ms: int, *, tombstones: bool = False) -> int:
        """Settled records past their TTL; also messages nobody took within an hour, and forgotten tools. In
        batches of HOUSEKEEPING_BATCH, each its own job on the writer thread: creations and updates that came
        meanwhile are committed between two batches, so none waits for more than one."""
        reason = EXPIRED if tombstones else None
        writer = self.writer
        await self.db.write("purge_expired", writer.purge_aside)
        return await self._in_batches("purge_expired", lambda batch: writer.purge(now_ms, reason, batch))

    async def _in_batches(self, what: str, batch: Callable[[int], int]) -> int:
        """`batch(HOUSEKEEPING_BATCH)` on the writer thread until it does less than that; the rows it did."""
        total = 0
        while True:
            done = await self.db.write(what, lambda: batch(HOUSEKEEPING_BATCH))
            total += done
            if done < HOUSEKEEPING_BATCH:
                return total

    async def delete(self, task_id: str, *, tombstone_at_ms: int | None = None) -> bool:
        reason = None if tombstone_at_ms is None else EXPIRED
        deleted = await self.db.write(
            f"delete {task_id}",
            lambda: self.writer.bury("FROM tasks WHERE task_id = ?", [task_id], reason, tombstone_at_ms or 0),
        )
        return deleted > 0

    async def tombstone(self, task_id: str, principal: str) -> Tombstone | None:
        def run() -> Tombstone | None:
            row = self.db.reader_conn().execute(schema.TOMBSTONE_SQL, [task_id, principal]).fetchone()
            return None if row is None else Tombstone(*row)

        return await self.db.read(f"tombstone {task_id}", run)

    async def trim_tombstones(self, gone_before_ms: int, keep: int) -> int:
        """In batches, as the purge (`_in_batches`)."""
        writer = self.writer
        return await self._in_batches(
            "trim_tombstones", lambda batch: writer.trim_tombstones(gone_before_ms, keep, batch)
        )


class SqliteReplicas:
    """The replicas port of a file one process holds alone: its lease is the file lock, the feed in-process."""

    def __init__(self, db: SqliteDb, writer: SqliteWriter, feed: LocalFeed) -> None:
        self.db = db
        self.writer = writer
        self.feed = feed
        self._leases: set[str] = set()  # replicas of this process holding a lease

    @property
    def shared(self) -> bool:
        return False

    async def renew_lease(self, replica_id: str, lease_seconds: float) -> Fence:
        self.db.writer_thread("renew_lease")
        self._leases.add(replica_id)
        return Fence(replica_id, _EPOCH)

    async def release_lease(self, fence: Fence) -> None:
        self._leases.discard(fence.owner)

    async def replica_alive(self, replica_id: str) -> bool:
        """Only replicas of this process (which holds the file) can be alive."""
        return replica_id in self._leases

    async def expired_replicas(self) -> list[str]:
        return []

    async def take_over(self, dead_replica: str, fence: Fence) -> list[TaskRecord]:
        return []  # no other process can hold this file: a restart recovers with `live()` and `claim`

    async def notify_owner(self, task_id: str, kind: str, payload: JSON) -> Message | None:
        """A durable message for the owner of a live task (None when it is settled or unknown)."""
        check_kind(kind)
        params = {"kind": kind, "key": task_id, "payload": encode(payload), "now_ms": wall_ms()}
        return await self._post(task_id, schema.NOTIFY_OWNER_SQL, params)

    async def notify_replica(self, replica_id: str, kind: str, key: str, payload: JSON) -> Message:
        check_kind(kind)
        params = {"recipient": replica_id, "kind": kind, "key": key, "payload": encode(payload), "now_ms": wall_ms()}
        message = await self._post(key, schema.NOTIFY_REPLICA_SQL, params)
        assert message is not None  # an INSERT ... VALUES always returns its row
        return message

    async def _post(self, key: str, sql: str, params: dict[str, Any]) -> Message | None:
        messages = await self.db.write(f"message {key}", lambda: self.writer.messages(sql, params))
        for message in messages:
            self.feed.publish(Change(message.kind, message.key, message.recipient))
        return messages[0] if messages else None

    async def take_messages(self, replica_id: str) -> list[Message]:
        """Every message addressed to `replica_id`, oldest first, removed from the store."""
        return await self.db.write(
            "take_messages", lambda: self.writer.messages(schema.TAKE_MESSAGES_SQL, [replica_id])
        )

    async def pending_messages(self, replica_id: str) -> bool:
        sql = "SELECT 1 FROM messages WHERE recipient = ? LIMIT 1"
        return await self.db.read(
            "pending_messages", lambda: bool(self.db.reader_conn().execute(sql, [replica_id]).fetchall())
        )

    def changes(self, for_replica: str | None = None) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Change]]:
        """This process's changes, from now on (a RESYNC first); see `LocalFeed.subscribe`."""
        return self.feed.subscribe(for_replica)


class SqliteKeys:
    """The idempotency keys port: one writer thread, so a claim and the read of the holder see one state."""

    def __init__(self, db: SqliteDb, writer: SqliteWriter) -> None:
        self.db = db
        self.writer = writer

    async def claim_key(self, record: keys.KeyRecord) -> keys.KeyRecord | None:
        def run() -> keys.KeyRecord | None:
            db = self.writer.db()
            with db.atomic():  # the one writer thread: the claim and the read of the holder see one state
                if db.execute(keys.CLAIM_SQL, keys.key_params(record)).fetchall():
                    return None
                found = rows(db.execute(keys.GET_SQL, {"scope": record.scope, "key": record.key}))
            return keys.key_from_row(found[0])

        return await self.db.write("claim_key", run)

    async def get_key(self, scope: str, key: str) -> keys.KeyRecord | None:
        def run() -> keys.KeyRecord | None:
            found = rows(self.db.reader_conn().execute(keys.GET_SQL, {"scope": scope, "key": key}))
            return keys.key_from_row(found[0]) if found else None

        return await self.db.read("get_key", run)

    async def settle_key(self, record: keys.KeyRecord, outcome: str) -> bool:
        params = {**keys.key_params(record), "outcome": outcome}
        return await self.db.write("settle_key", lambda: self._changed(keys.SETTLE_SQL, params)) > 0

    async def release_key(self, record: keys.KeyRecord) -> None:
        await self.db.write("release_key", lambda: self._changed(keys.RELEASE_SQL, keys.key_params(record)))

    async def purge_keys(self, now_ms: int) -> int:
        return await self.db.write("purge_keys", lambda: self._changed(keys.PURGE_SQL, {"now_ms": now_ms}))

    def _changed(self, sql: str, params: dict[str, Any]) -> int:
        """Writer thread: one statement on the keys table, committed; the rows it changed."""
        db = self.writer.db()
        with db.atomic():
            return db.execute(sql, params).rowcount


class SqliteUsage:
    """The usage port: quota windows counted in this process's memory (it holds the file alone, nothing is
    written per call), the tools' duration estimates in the file."""

    def __init__(self, db: SqliteDb, writer: SqliteWriter) -> None:
        self.db = db
        self.writer = writer
        self._windows = WindowCounts()

    async def count_call(self, key: str, window_start_ms: int) -> int:
        """One more call of `key` in the quota window starting at `window_start_ms`; the calls so far."""
        if self.db.closed:
            raise StoreError(f"count_call: the task store {self.db.path} is closed")
        return self._windows.count(key, window_start_ms)

    async def observe_duration(self, tool: str, duration_ms: float) -> float:
        """Fold one completed task's duration into its tool's running estimate; the new estimate."""
        return await self.db.write(f"observe {tool}", lambda: self.writer.observe(tool, float(duration_ms)))

    async def duration_estimates(self) -> dict[str, float]:
        def run() -> dict[str, float]:
            found = self.db.reader_conn().execute("SELECT tool, estimate_ms FROM tool_durations")
            return {tool: float(estimate) for tool, estimate in found}

        return await self.db.read("duration_estimates", run)


class SqliteOperators:
    """The operators' queries; `operator`: a CLI's store beside a running proxy, whose cancel leaves the proxy a
    CANCEL message to find."""

    def __init__(self, db: SqliteDb, writer: SqliteWriter, feed: LocalFeed, *, operator: bool) -> None:
        self.db = db
        self.writer = writer
        self.feed = feed
        self.operator = operator

    async def list_tasks(self, query: TaskQuery) -> list[TaskRecord]:
        sql, params = query_sql(query, "?")
        return await self.db.read("list", lambda: self.db.select(sql, params))

    async def cancel_task(self, task_id: str, status_message: str, *, now_ms: int) -> TaskRecord | None:
        """Settled here; the proxy that runs the call (another process when this is an operator's store) finds
        the CANCEL message at its next poll. In the proxy itself the settlement's change tells the owner."""
        values = settle_values(TaskStatus.CANCELLED, None, None, status_message)
        sql, params = _live_update(task_id, values, now_ms, None)
        record = await self.db.write(
            f"cancel {task_id}", lambda: self.writer.cancel(sql, params, task_id, tell_owner=self.operator)
        )
        if record is not None:
            self.feed.publish(Change(STATUS, record.task_id, record.owner, record.status))
        return record

    async def purge_settled(self, updated_before_ms: int, *, dry_run: bool, tombstone_at_ms: int | None = None) -> int:
        where = f"FROM tasks WHERE status IN ({TERMINAL_SQL}) AND updated_at_ms < ?"
        if dry_run:
            return await self.db.read("purge count", lambda: self._count(f"SELECT COUNT(*) {where}", updated_before_ms))
        reason = None if tombstone_at_ms is None else PURGED
        return await self.db.write(
            "purge", lambda: self.writer.bury(where, [updated_before_ms], reason, tombstone_at_ms or 0)
        )

    def _count(self, sql: str, value: int) -> int:
        (found,) = self.db.reader_conn().execute(sql, [value]).fetchone()
        return int(found)

    async def stats(self) -> dict[str, int]:
        def run() -> dict[str, int]:
            counts = dict.fromkeys(STATUS_KEYS, 0)
            for status, count in self.db.reader_conn().execute(schema.STATUS_COUNTS_SQL):  # kept by triggers
                counts[status] = count
            counts["records"] = sum(counts.values())
            return counts

        return await self.db.read("stats", run)

    async def size_bytes(self) -> int:
        """The database file and its WAL on disk (metrics); 0 for a file that is not there."""

        def run() -> int:
            total = 0
            for path in (self.db.path, self.db.path.with_name(self.db.path.name + "-wal")):
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
            return total

        return await self.db.read("size", run)


class _SqliteStatements:
    """The grants port's statements (`grants.Statements`): reads on the reader thread, writes on the writer's,
    each committed alone."""

    def __init__(self, db: SqliteDb, writer: SqliteWriter) -> None:
        self.db = db
        self.writer = writer

    async def rows(self, what: str, sql: str, params: dict[str, Any], *, write: bool) -> list[Any]:
        if not write:
            return await self.db.read(what, lambda: [row[0] for row in self.db.reader_conn().execute(sql, params)])

        def run() -> list[Any]:
            db = self.writer.db()
            with db.atomic():
                return [row[0] for row in db.execute(sql, params).fetchall()]

        return await self.db.write(what, run)

    async def changed(self, what: str, sql: str, params: dict[str, Any]) -> int:
        def run() -> int:
            db = self.writer.db()
            with db.atomic():
                return db.execute(sql, params).rowcount

        return await self.db.write(what, run)


class SqliteTaskStore:
    """Task records in one SQLite file, its ports composed over one `SqliteDb`. Methods are coroutines; the
    SQLite work runs in the file's two threads. Not safe to call from several event loops or threads at once;
    one store object per database file."""

    def __init__(
        self,
        path: Path,
        *,
        max_records: int,
        synchronous: Literal["normal", "full"],
        read_only: bool,
        operator: bool = False,
    ) -> None:
        """Use `await SqliteTaskStore.open(...)`; this only sets up the threads."""
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be 'normal' or 'full', got {synchronous!r}")
        self.path = path
        self.db = SqliteDb(path, read_only=read_only)
        self._writer = SqliteWriter(path, max_records=max_records, synchronous=synchronous)  # the writer thread's
        self._feed = LocalFeed()
        self._close_done = asyncio.Event()
        self.records = SqliteRecords(self.db, self._writer, self._feed)
        self.replicas = SqliteReplicas(self.db, self._writer, self._feed)
        self.keys = SqliteKeys(self.db, self._writer)
        self.usage = SqliteUsage(self.db, self._writer)
        self.operators = SqliteOperators(self.db, self._writer, self._feed, operator=operator)
        self.grants = GrantsTable(_SqliteStatements(self.db, self._writer))

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        max_records: int,
        synchronous: Literal["normal", "full"] = "full",
        read_only: bool = False,
        operator: bool = False,
    ) -> SqliteTaskStore:
        """`operator`: the CLI's cancel and purge beside a running proxy (no file lock, no migration, an
        existing file only); `read_only`: reads only (safe while the proxy runs)."""
        store = cls(
            Path(path), max_records=max_records, synchronous=synchronous, read_only=read_only, operator=operator
        )
        try:
            if not read_only:
                await store.db.write("open", store._writer.open_beside if operator else store._writer.open)
            await store.db.read("open", store.db.open_reader)
        except BaseException:
            with contextlib.suppress(StoreError):  # the open failure is the error to report
                await store._shutdown(checkpoint=False)
            raise
        return store

    @property
    def health(self) -> StoreHealth:
        return self.db.health

    async def check_writable(self, now_ms: int) -> None:
        """Commit one tiny write (readiness): raises StoreError when the file no longer takes writes."""
        await self.db.write("health check", lambda: self._writer.health(now_ms))

    async def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        """Debugging and tests: `callback(sql)` runs for every statement, in the thread that executes it."""
        if self.db.writer is not None:
            await self.db.write("trace", lambda: self._writer.trace(callback))
        await self.db.read("trace", lambda: self.db.reader_conn().conn.set_trace_callback(callback))

    async def close(self) -> None:
        """Finish the queued work, checkpoint the WAL, close both connections and release the file lock."""
        if self.db.closed:
            await self._close_done.wait()
            return
        await self._shutdown(checkpoint=not self.db.read_only)

    async def _shutdown(self, *, checkpoint: bool) -> None:
        self.db.closed = True
        self._feed.close()
        loop = asyncio.get_running_loop()
        errors: list[BaseException] = []
        # Reader first, so the writer's connection is the last one and SQLite can remove the -wal/-shm files.
        for executor, work in (
            (self.db.reader, self.db.close_reader),
            (self.db.writer, lambda: self._writer.close(checkpoint)),
        ):
            if executor is None:
                continue
            try:
                await loop.run_in_executor(executor, self.db.guarded, "close", work)
            except StoreError as exc:
                errors.append(exc)
            finally:
                executor.shutdown(wait=False)  # the queue is drained and nothing new is accepted
        self._close_done.set()
        if errors:
            raise errors[0]
