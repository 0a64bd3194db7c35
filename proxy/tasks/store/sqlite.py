"""The SQLite task store: one file, one process (the embedded default, one replica).

Every SQLite call runs off the event loop: one writer thread owns the write connection, one reader thread owns
a read-only connection (`sqlite_threads.py`). One process is the only replica: its lease never lapses, a fence
checks the owner only, and the change feed is in-process. Depends on sqlite-utils and the store's `base`,
`rows`, `batching`, `feed`, `sqlite_schema`, `sqlite_threads` and `sqlite_writer` (the writer thread's work); it
must not import aiohttp, the runner or the front.
"""

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
from proxy.tasks.store.grants import Grants
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
from proxy.tasks.store.sqlite_threads import SqliteThreads
from proxy.tasks.store.sqlite_writer import SqliteWriter, rows, wall_ms
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

_MIN_SQLITE_VERSION: Final = (3, 35, 0)  # UPDATE ... RETURNING
_EPOCH: Final = 1  # the one process holds the file lock: its lease never lapses


def _live_update(
    task_id: str, values: Mapping[str, Any], now_ms: int, fence: Fence | None
) -> tuple[str, dict[str, Any]]:
    """The conditional UPDATE ... RETURNING of a live task (a settled one never changes), and its parameters."""
    assignments = ", ".join([*(f"{name} = :{name}" for name in values), "updated_at_ms = :now_ms"])
    fenced = " AND owner = :fence_owner" if fence is not None else ""
    sql = f"UPDATE tasks SET {assignments} WHERE task_id = :task_id AND status IN ({LIVE_SQL}){fenced} RETURNING *"
    return sql, {**values, "now_ms": now_ms, "task_id": task_id, "fence_owner": fence and fence.owner}


class SqliteTaskStore(SqliteThreads, LiveWrites):
    """Task records in one SQLite file. Methods are coroutines; the SQLite work runs in the store's two threads.

    Not safe to call from several event loops or threads at once; one store object per database file.
    """

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
        super().__init__(path, read_only=read_only)
        self.operator = operator
        self._close_done = asyncio.Event()
        self._writer_state = SqliteWriter(path, max_records=max_records, synchronous=synchronous)  # writer thread
        self._batcher = CreationBatcher(self._writer_state.create_all, str(path))
        self._feed = LocalFeed()
        self._leases: set[str] = set()  # replicas of this process holding a lease
        self._quota_windows = WindowCounts()  # this process holds the file alone: counted in its memory
        self.grants = Grants(_SqliteStatements(self))  # kept grants of `upstream.credentials: exchange`

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
                await store._write("open", store._writer_state.open_beside if operator else store._writer_state.open)
            await store._read("open", store._open_reader)
        except BaseException:
            with contextlib.suppress(StoreError):  # the open failure is the error to report
                await store._shutdown(checkpoint=False)
            raise
        return store

    # -- records ---------------------------------------------------------------------------------------------

    async def create(self, record: TaskRecord) -> None:
        """Returns once the record is committed.

        Group commit: creations that arrive while the writer thread is busy are committed together, in one
        transaction and one fsync, when it gets to them. Each record still fails on its own (its own
        savepoint): a full store refuses the records that do not fit, not the whole group.
        """
        await self._batcher.create(self._open_writer_thread(f"create {record.task_id}"), record)

    async def get(self, task_id: str, *, principal: str | None = None) -> TaskRecord | None:
        if principal is None:
            sql, params = "SELECT * FROM tasks WHERE task_id = ?", [task_id]
        else:  # the owner is checked inside SQLite: another caller's row (and its result) never leaves it
            sql, params = "SELECT * FROM tasks WHERE task_id = ? AND principal = ?", [task_id, principal]
        records = await self._read(f"get {task_id}", lambda: self._select(sql, params))
        return records[0] if records else None

    async def _update(
        self, task_id: str, values: Mapping[str, Any], now_ms: int, fence: Fence | None
    ) -> TaskRecord | None:
        """Change a live task (a settled one never changes); the record as it is now, or None."""
        sql, params = _live_update(task_id, values, now_ms, fence)
        record = await self._write(f"update {task_id}", lambda: self._writer_state.change(sql, params, task_id, fence))
        if record is not None:
            self._feed.publish(Change(STATUS, record.task_id, record.owner, record.status))
        return record

    async def live(self, owner: str | None = None) -> list[TaskRecord]:
        mine = "" if owner is None else " AND owner = ?"
        sql = f"SELECT * FROM tasks WHERE status IN ({LIVE_SQL}){mine} ORDER BY created_at_ms, task_id"
        return await self._read("live", lambda: self._select(sql, [] if owner is None else [owner]))

    async def expired_live(self, now_ms: int) -> list[TaskRecord]:
        return await self._read("expired_live", lambda: self._select(schema.EXPIRED_LIVE_SQL, [now_ms]))

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
        """Settled records past their TTL; also messages nobody took within an hour, and forgotten tools."""
        reason = EXPIRED if tombstones else None
        return await self._write("purge_expired", lambda: self._writer_state.purge(now_ms, reason))

    async def delete(self, task_id: str, *, tombstone_at_ms: int | None = None) -> bool:
        reason = None if tombstone_at_ms is None else EXPIRED
        deleted = await self._write(
            f"delete {task_id}",
            lambda: self._writer_state.bury("FROM tasks WHERE task_id = ?", [task_id], reason, tombstone_at_ms or 0),
        )
        return deleted > 0

    async def tombstone(self, task_id: str, principal: str) -> Tombstone | None:
        def run() -> Tombstone | None:
            row = self._reader_conn().execute(schema.TOMBSTONE_SQL, [task_id, principal]).fetchone()
            return None if row is None else Tombstone(*row)

        return await self._read(f"tombstone {task_id}", run)

    async def trim_tombstones(self, gone_before_ms: int, keep: int) -> int:
        return await self._write(
            "trim_tombstones",
            lambda: self._writer_state.execute_count(schema.TRIM_TOMBSTONES_SQL, [gone_before_ms, keep]),
        )

    async def stats(self) -> dict[str, int]:
        def run() -> dict[str, int]:
            counts = dict.fromkeys(STATUS_KEYS, 0)
            for status, count in self._reader_conn().execute("SELECT status, COUNT(*) FROM tasks GROUP BY status"):
                counts[status] = count
            counts["records"] = sum(counts.values())
            return counts

        return await self._read("stats", run)

    # -- operators -------------------------------------------------------------------------------------------

    async def list_tasks(self, query: TaskQuery) -> list[TaskRecord]:
        sql, params = query_sql(query, "?")
        return await self._read("list", lambda: self._select(sql, params))

    async def cancel_task(self, task_id: str, status_message: str, *, now_ms: int) -> TaskRecord | None:
        """Settled here; the proxy that runs the call (another process when this is an operator's store) finds
        the CANCEL message at its next poll. In the proxy itself the settlement's change tells the owner."""
        values = settle_values(TaskStatus.CANCELLED, None, None, status_message)
        sql, params = _live_update(task_id, values, now_ms, None)
        record = await self._write(
            f"cancel {task_id}", lambda: self._writer_state.cancel(sql, params, task_id, tell_owner=self.operator)
        )
        if record is not None:
            self._feed.publish(Change(STATUS, record.task_id, record.owner, record.status))
        return record

    async def purge_settled(self, updated_before_ms: int, *, dry_run: bool, tombstone_at_ms: int | None = None) -> int:
        where = f"FROM tasks WHERE status IN ({TERMINAL_SQL}) AND updated_at_ms < ?"
        if dry_run:
            return await self._read("purge count", lambda: self._count(f"SELECT COUNT(*) {where}", updated_before_ms))
        reason = None if tombstone_at_ms is None else PURGED
        return await self._write(
            "purge", lambda: self._writer_state.bury(where, [updated_before_ms], reason, tombstone_at_ms or 0)
        )

    def _count(self, sql: str, value: int) -> int:
        (found,) = self._reader_conn().execute(sql, [value]).fetchone()
        return int(found)

    async def pending_messages(self, replica_id: str) -> bool:
        sql = "SELECT 1 FROM messages WHERE recipient = ? LIMIT 1"
        return await self._read(
            "pending_messages", lambda: bool(self._reader_conn().execute(sql, [replica_id]).fetchall())
        )

    async def check_writable(self, now_ms: int) -> None:
        """Commit one tiny write (readiness): raises StoreError when the file no longer takes writes."""
        await self._write("health check", lambda: self._writer_state.health(now_ms))

    @property
    def health(self) -> StoreHealth:
        return self._health

    async def size_bytes(self) -> int:
        """The database file and its WAL on disk (metrics); 0 for a file that is not there."""

        def run() -> int:
            total = 0
            for path in (self.path, self.path.with_name(self.path.name + "-wal")):
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
            return total

        return await self._read("size", run)

    async def close(self) -> None:
        """Finish the queued work, checkpoint the WAL, close both connections and release the file lock."""
        if self._closed:
            await self._close_done.wait()
            return
        await self._shutdown(checkpoint=not self.read_only)

    async def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        """Debugging and tests: `callback(sql)` runs for every statement, in the thread that executes it."""
        if self._writer is not None:
            await self._write("trace", lambda: self._writer_state.trace(callback))
        await self._read("trace", lambda: self._reader_conn().conn.set_trace_callback(callback))

    # -- one process, one replica: the lease is the file lock ----------------------------------------------------

    @property
    def shared(self) -> bool:
        return False

    async def renew_lease(self, replica_id: str, lease_seconds: float) -> Fence:
        self._open_writer_thread("renew_lease")
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

    # -- messages and the in-process change feed ---------------------------------------------------------------

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
        messages = await self._write(f"message {key}", lambda: self._writer_state.messages(sql, params))
        for message in messages:
            self._feed.publish(Change(message.kind, message.key, message.recipient))
        return messages[0] if messages else None

    async def take_messages(self, replica_id: str) -> list[Message]:
        """Every message addressed to `replica_id`, oldest first, removed from the store."""

        return await self._write(
            "take_messages", lambda: self._writer_state.messages(schema.TAKE_MESSAGES_SQL, [replica_id])
        )

    def changes(self, for_replica: str | None = None) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Change]]:
        """This process's changes, from now on (a RESYNC first); see `LocalFeed.subscribe`."""
        return self._feed.subscribe(for_replica)

    # -- shared pacing -------------------------------------------------------------------------------------------

    async def observe_duration(self, tool: str, duration_ms: float) -> float:
        """Fold one completed task's duration into its tool's running estimate; the new estimate."""
        return await self._write(f"observe {tool}", lambda: self._writer_state.observe(tool, float(duration_ms)))

    async def duration_estimates(self) -> dict[str, float]:
        def run() -> dict[str, float]:
            rows = self._reader_conn().execute("SELECT tool, estimate_ms FROM tool_durations")
            return {tool: float(estimate) for tool, estimate in rows}

        return await self._read("duration_estimates", run)

    async def count_call(self, key: str, window_start_ms: int) -> int:
        """One more call of `key` in the quota window starting at `window_start_ms`; the calls so far. Kept in
        this process (the only one that may open the file), never written."""
        if self._closed:
            raise StoreError(f"count_call: the task store {self.path} is closed")
        return self._quota_windows.count(key, window_start_ms)

    # -- idempotency keys ----------------------------------------------------------------------------------------

    async def claim_key(self, record: keys.KeyRecord) -> keys.KeyRecord | None:
        def run() -> keys.KeyRecord | None:
            db = self._writer_state.db()
            with db.atomic():  # the one writer thread: the claim and the read of the holder see one state
                if db.execute(keys.CLAIM_SQL, keys.key_params(record)).fetchall():
                    return None
                found = rows(db.execute(keys.GET_SQL, {"scope": record.scope, "key": record.key}))
            return keys.key_from_row(found[0])

        return await self._write("claim_key", run)

    async def get_key(self, scope: str, key: str) -> keys.KeyRecord | None:
        def run() -> keys.KeyRecord | None:
            found = rows(self._reader_conn().execute(keys.GET_SQL, {"scope": scope, "key": key}))
            return keys.key_from_row(found[0]) if found else None

        return await self._read("get_key", run)

    async def settle_key(self, record: keys.KeyRecord, outcome: str) -> bool:
        params = {**keys.key_params(record), "outcome": outcome}
        return await self._write("settle_key", lambda: self._keys_changed(keys.SETTLE_SQL, params)) > 0

    async def release_key(self, record: keys.KeyRecord) -> None:
        await self._write("release_key", lambda: self._keys_changed(keys.RELEASE_SQL, keys.key_params(record)))

    async def purge_keys(self, now_ms: int) -> int:
        return await self._write("purge_keys", lambda: self._keys_changed(keys.PURGE_SQL, {"now_ms": now_ms}))

    def _rows_of(self, sql: str, params: dict[str, Any], *, write: bool) -> list[Any]:
        """The first column of what one statement returns: on the writer thread, committed (`write`), else read."""
        if not write:
            return [row[0] for row in self._reader_conn().execute(sql, params).fetchall()]
        db = self._writer_state.db()
        with db.atomic():
            return [row[0] for row in db.execute(sql, params).fetchall()]

    def _keys_changed(self, sql: str, params: dict[str, Any]) -> int:
        """Writer thread: one statement on the keys table, committed; the rows it changed."""
        db = self._writer_state.db()
        with db.atomic():
            return db.execute(sql, params).rowcount

    # -- closing the threads ----------------------------------------------------------------------------------

    async def _shutdown(self, *, checkpoint: bool) -> None:
        self._closed = True
        self._feed.close()
        loop = asyncio.get_running_loop()
        errors: list[BaseException] = []
        # Reader first, so the writer's connection is the last one and SQLite can remove the -wal/-shm files.
        for executor, work in (
            (self._reader, self._close_reader),
            (self._writer, lambda: self._writer_state.close(checkpoint)),
        ):
            if executor is None:
                continue
            try:
                await loop.run_in_executor(executor, self._guarded, "close", work)
            except StoreError as exc:
                errors.append(exc)
            finally:
                executor.shutdown(wait=False)  # the queue is drained and nothing new is accepted
        self._close_done.set()
        if errors:
            raise errors[0]


class _SqliteStatements:
    """The grants' statements on the store's threads (`grants.Statements`)."""

    def __init__(self, store: SqliteTaskStore) -> None:
        self._store = store

    async def rows(self, what: str, sql: str, params: dict[str, Any], *, write: bool) -> list[Any]:
        run = self._store._write if write else self._store._read
        return await run(what, lambda: self._store._rows_of(sql, params, write=write))

    async def changed(self, what: str, sql: str, params: dict[str, Any]) -> int:
        return await self._store._write(what, lambda: self._store._keys_changed(sql, params))
