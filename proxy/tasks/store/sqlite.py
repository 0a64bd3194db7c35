"""The SQLite task store: one file, one process (the embedded default, one replica).

Every SQLite call runs off the event loop: one writer thread owns the write connection, one reader thread owns
a read-only connection. One process is the only replica: its lease never lapses, a fence checks the owner
only, and the change feed is in-process. Depends on sqlite-utils and the store's `base`, `batching`, `feed`
and `sqlite_schema`; it must not import aiohttp, the runner or the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Literal, TypeVar
from urllib.parse import quote

from sqlite_utils import Database

from proxy.tasks import pacing
from proxy.tasks.store import sqlite_schema as schema
from proxy.tasks.store.base import (
    LIVE_SQL,
    MESSAGE_RETENTION_MS,
    STATUS,
    STATUS_KEYS,
    Change,
    Fence,
    FencedError,
    Message,
    StoreError,
    StoreFullError,
    StoreLockedError,
    check_kind,
    claim_values,
    decode,
    encode,
    inputs_values,
    records_from_rows,
    row_from_record,
    settle_values,
)
from proxy.tasks.store.batching import CreationBatcher, caused
from proxy.tasks.store.feed import LocalFeed
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import LIVE, TaskRecord, TaskStatus

_T = TypeVar("_T")
_MIN_SQLITE_VERSION: Final = (3, 35, 0)  # UPDATE ... RETURNING
_EPOCH: Final = 1  # the one process holds the file lock: its lease never lapses


def _rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _messages(cursor: sqlite3.Cursor) -> list[Message]:
    rows = sorted(cursor.fetchall())
    return [Message(row[0], row[1], row[2], row[3], decode(row[4])) for row in rows]


def _connect(path: Path, *, read_only: bool) -> Database:
    # A URI, so that `?` or `#` in a path cannot be read as URI syntax; mode=ro makes the reader read-only.
    conn = sqlite3.connect(f"file:{quote(str(path))}{'?mode=ro' if read_only else ''}", uri=True)
    db = Database(conn, execute_plugins=False)
    db.execute("PRAGMA busy_timeout=5000")
    return db


def _wall_ms() -> int:
    return int(time.time() * 1000)


class SqliteTaskStore:
    """Task records in one SQLite file. Methods are coroutines; the SQLite work runs in the store's two threads.

    Not safe to call from several event loops or threads at once; one store object per database file.
    """

    path: Path

    def __init__(
        self, path: Path, *, max_records: int, synchronous: Literal["normal", "full"], read_only: bool
    ) -> None:
        """Use `await SqliteTaskStore.open(...)`; this only sets up the threads."""
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        if synchronous not in ("normal", "full"):
            raise ValueError(f"synchronous must be 'normal' or 'full', got {synchronous!r}")
        self.path = path
        self.read_only = read_only
        self._max_records = max_records
        self._synchronous = synchronous
        self._closed = False
        self._close_done = asyncio.Event()
        self._writer: ThreadPoolExecutor | None = (
            None if read_only else ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-store-writer")
        )
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-store-reader")
        self._batcher = CreationBatcher(self._create_all, str(path))
        self._feed = LocalFeed()
        # Owned by the writer thread:
        self._writer_db: Database | None = None
        self._lock_fd: int | None = None
        self._record_count = 0
        # Owned by the reader thread:
        self._reader_db: Database | None = None

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        max_records: int,
        synchronous: Literal["normal", "full"] = "full",
        read_only: bool = False,
    ) -> SqliteTaskStore:
        store = cls(Path(path), max_records=max_records, synchronous=synchronous, read_only=read_only)
        try:
            if not read_only:
                await store._write("open", store._open_writer)
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

    async def get(self, task_id: str) -> TaskRecord | None:
        records = await self._read(
            f"get {task_id}", lambda: self._select("SELECT * FROM tasks WHERE task_id = ?", [task_id])
        )
        return records[0] if records else None

    async def set_inputs(
        self, task_id: str, input_requests: JSON, inputs_issued: int, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None:
        """The live task's outstanding questions: `input_required` with them, `working` without any."""
        return await self._update(task_id, inputs_values(input_requests, inputs_issued), now_ms, fence)

    async def set_status_message(
        self, task_id: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None:
        return await self._update(task_id, {"status_message": status_message}, now_ms, fence)

    async def claim(
        self, task_id: str, owner: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None:
        """A live task taken over by `owner` to be run again from the start: `working`, no questions."""
        return await self._update(task_id, claim_values(owner, status_message), now_ms, fence)

    async def settle(
        self,
        task_id: str,
        status: TaskStatus,
        *,
        now_ms: int,
        result: JSON | None = None,
        error: JSON | None = None,
        status_message: str | None = None,
        fence: Fence | None = None,
    ) -> TaskRecord | None:
        """Only a live task settles, so the first settle wins and a terminal state never changes."""
        return await self._update(task_id, settle_values(status, result, error, status_message), now_ms, fence)

    async def _update(
        self, task_id: str, values: Mapping[str, Any], now_ms: int, fence: Fence | None
    ) -> TaskRecord | None:
        """Change a live task (a settled one never changes); the record as it is now, or None."""
        assignments = ", ".join([*(f"{name} = :{name}" for name in values), "updated_at_ms = :now_ms"])
        fenced = " AND owner = :fence_owner" if fence is not None else ""
        sql = f"UPDATE tasks SET {assignments} WHERE task_id = :task_id AND status IN ({LIVE_SQL}){fenced} RETURNING *"
        params = {**values, "now_ms": now_ms, "task_id": task_id, "fence_owner": fence and fence.owner}

        def run() -> TaskRecord | None:
            changed = self._change(sql, params)
            if changed is None and fence is not None:
                self._check_fence(task_id, fence)
            return changed

        record = await self._write(f"update {task_id}", run)
        if record is not None:
            self._feed.publish(Change(STATUS, record.task_id, record.owner, record.status))
        return record

    def _check_fence(self, task_id: str, fence: Fence) -> None:
        row = self._writer_conn().execute("SELECT owner, status FROM tasks WHERE task_id = ?", [task_id]).fetchone()
        if row is not None and TaskStatus(row[1]) in LIVE:
            raise FencedError(f"task {task_id} is owned by {row[0]}, not {fence.owner}")

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

    async def purge_expired(self, now_ms: int) -> int:
        """Settled records past their TTL; also messages nobody took within an hour, and forgotten tools."""

        def run() -> int:
            purged = self._delete(schema.PURGE_SQL, [now_ms])
            db = self._writer_conn()
            with db.atomic():
                db.execute(schema.PURGE_MESSAGES_SQL, [_wall_ms() - MESSAGE_RETENTION_MS])
                db.execute(schema.TRIM_DURATIONS_SQL, [pacing.MAX_TOOLS])
            return purged

        return await self._write("purge_expired", run)

    async def delete(self, task_id: str) -> bool:
        deleted = await self._write(
            f"delete {task_id}", lambda: self._delete("DELETE FROM tasks WHERE task_id = ?", [task_id])
        )
        return deleted > 0

    async def stats(self) -> dict[str, int]:
        def run() -> dict[str, int]:
            counts = dict.fromkeys(STATUS_KEYS, 0)
            for status, count in self._reader_conn().execute("SELECT status, COUNT(*) FROM tasks GROUP BY status"):
                counts[status] = count
            counts["records"] = sum(counts.values())
            return counts

        return await self._read("stats", run)

    async def check_writable(self, now_ms: int) -> None:
        """Commit one tiny write (readiness): raises StoreError when the file no longer takes writes."""

        def run() -> None:
            db = self._writer_conn()
            with db.atomic():
                db.execute(schema.HEALTH_SQL, [now_ms])

        await self._write("health check", run)

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
            await self._write("trace", lambda: self._writer_conn().conn.set_trace_callback(callback))
        await self._read("trace", lambda: self._reader_conn().conn.set_trace_callback(callback))

    # -- one process, one replica: the lease is the file lock ----------------------------------------------------

    async def renew_lease(self, replica_id: str, lease_seconds: float) -> Fence:
        self._open_writer_thread("renew_lease")
        return Fence(replica_id, _EPOCH)

    async def release_lease(self, fence: Fence) -> None:
        return None

    async def expired_replicas(self) -> list[str]:
        return []

    async def take_over(self, dead_replica: str, fence: Fence) -> list[TaskRecord]:
        return []  # no other process can hold this file: a restart recovers with `live()` and `claim`

    # -- messages and the in-process change feed ---------------------------------------------------------------

    async def notify_owner(self, task_id: str, kind: str, payload: JSON) -> Message | None:
        """A durable message for the owner of a live task (None when it is settled or unknown)."""
        check_kind(kind)
        params = {"kind": kind, "key": task_id, "payload": encode(payload), "now_ms": _wall_ms()}
        return await self._post(task_id, schema.NOTIFY_OWNER_SQL, params)

    async def notify_replica(self, replica_id: str, kind: str, key: str, payload: JSON) -> Message:
        check_kind(kind)
        params = {"recipient": replica_id, "kind": kind, "key": key, "payload": encode(payload), "now_ms": _wall_ms()}
        message = await self._post(key, schema.NOTIFY_REPLICA_SQL, params)
        assert message is not None  # an INSERT ... VALUES always returns its row
        return message

    async def _post(self, key: str, sql: str, params: dict[str, Any]) -> Message | None:
        def run() -> list[Message]:
            db = self._writer_conn()
            with db.atomic():
                return _messages(db.execute(sql, params))

        messages = await self._write(f"message {key}", run)
        for message in messages:
            self._feed.publish(Change(message.kind, message.key, message.recipient))
        return messages[0] if messages else None

    async def take_messages(self, replica_id: str) -> list[Message]:
        """Every message addressed to `replica_id`, oldest first, removed from the store."""

        def run() -> list[Message]:
            db = self._writer_conn()
            with db.atomic():
                return _messages(db.execute(schema.TAKE_MESSAGES_SQL, [replica_id]))

        return await self._write("take_messages", run)

    def changes(self, for_replica: str | None = None) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Change]]:
        """This process's changes, from now on (a RESYNC first); see `LocalFeed.subscribe`."""
        return self._feed.subscribe(for_replica)

    # -- shared pacing -------------------------------------------------------------------------------------------

    async def observe_duration(self, tool: str, duration_ms: float) -> float:
        """Fold one completed task's duration into its tool's running estimate; the new estimate."""
        params = {"tool": tool, "ms": float(duration_ms), "now_ms": _wall_ms(), "smoothing": pacing.SMOOTHING}

        def run() -> float:
            db = self._writer_conn()
            with db.atomic():
                (estimate,) = db.execute(schema.OBSERVE_SQL, params).fetchone()
            return float(estimate)

        return await self._write(f"observe {tool}", run)

    async def duration_estimates(self) -> dict[str, float]:
        def run() -> dict[str, float]:
            rows = self._reader_conn().execute("SELECT tool, estimate_ms FROM tool_durations")
            return {tool: float(estimate) for tool, estimate in rows}

        return await self._read("duration_estimates", run)

    # -- thread dispatch -----------------------------------------------------------------------------------

    def _open_writer_thread(self, what: str) -> ThreadPoolExecutor:
        """The writer thread, for `what`, unless the store is closed or read-only."""
        if self._closed:
            raise StoreError(f"{what}: the task store {self.path} is closed")
        if self._writer is None:
            raise StoreError(f"{what}: the task store {self.path} is open read-only")
        return self._writer

    async def _write(self, what: str, work: Callable[[], _T]) -> _T:
        writer = self._open_writer_thread(what)
        return await asyncio.get_running_loop().run_in_executor(writer, self._guarded, what, work)

    async def _read(self, what: str, work: Callable[[], _T]) -> _T:
        if self._closed:
            raise StoreError(f"{what}: the task store {self.path} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._reader, self._guarded, what, work)

    def _guarded(self, what: str, work: Callable[[], _T]) -> _T:
        try:
            return work()
        except sqlite3.Error as exc:
            raise StoreError(f"task store {self.path}: {what} failed: {exc}") from exc

    async def _shutdown(self, *, checkpoint: bool) -> None:
        self._closed = True
        self._feed.close()
        loop = asyncio.get_running_loop()
        errors: list[BaseException] = []
        # Reader first, so the writer's connection is the last one and SQLite can remove the -wal/-shm files.
        for executor, work in (
            (self._reader, self._close_reader),
            (self._writer, lambda: self._close_writer(checkpoint)),
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

    # -- writer thread ---------------------------------------------------------------------------------------

    def _writer_conn(self) -> Database:
        if self._writer_db is None:
            raise StoreError(f"the task store {self.path} is not open")
        return self._writer_db

    def _open_writer(self) -> None:
        if sqlite3.sqlite_version_info < _MIN_SQLITE_VERSION:
            raise StoreError(
                f"the task store needs SQLite >= 3.35 (RETURNING), this Python has {sqlite3.sqlite_version}"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot open the task store {self.path}: {exc}") from exc
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            raise StoreLockedError(f"{self.path} is in use by another mcp-tasks-proxy process") from exc
        self._lock_fd = lock_fd
        db = self._writer_db = _connect(self.path, read_only=False)
        db.enable_wal()
        db.execute(f"PRAGMA synchronous={self._synchronous.upper()}")
        schema.MIGRATIONS.apply(db)
        (self._record_count,) = db.execute("SELECT COUNT(*) FROM tasks").fetchone()

    def _create_all(self, records: list[TaskRecord]) -> list[StoreError | None]:
        db = self._writer_conn()
        errors: list[StoreError | None] = []
        count = self._record_count
        with db.atomic():
            for record in records:
                try:
                    with db.atomic():  # a savepoint: a record that fails takes back only itself
                        evicted = 0
                        if count >= self._max_records:
                            needed = count - self._max_records + 1
                            evicted = db.execute(schema.EVICT_SQL, {"count": needed}).rowcount
                            if evicted < needed:
                                raise StoreFullError(f"task store full: {self._max_records} live tasks")
                        db.execute(schema.INSERT_SQL, row_from_record(record))
                except StoreFullError as exc:
                    errors.append(exc)
                except sqlite3.IntegrityError as exc:
                    message = f"task store {self.path}: create {record.task_id} failed: {exc}"
                    errors.append(caused(StoreError(message), exc))
                else:
                    count += 1 - evicted
                    errors.append(None)
        self._record_count = count  # COMMIT succeeded
        return errors

    def _change(self, sql: str, params: dict[str, Any]) -> TaskRecord | None:
        db = self._writer_conn()
        with db.atomic():
            # All rows are fetched before COMMIT: a RETURNING statement still stepping would block it.
            records = records_from_rows(_rows(db.execute(sql, params)))
        return records[0] if records else None

    def _delete(self, sql: str, params: list[Any]) -> int:
        db = self._writer_conn()
        with db.atomic():
            deleted = db.execute(sql, params).rowcount
        self._record_count -= deleted
        return deleted

    def _close_writer(self, checkpoint: bool) -> None:
        db, self._writer_db = self._writer_db, None
        try:
            if db is not None:
                try:
                    if checkpoint:
                        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                finally:
                    db.close()
        finally:
            if self._lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)  # closing the descriptor releases the flock
                self._lock_fd = None

    # -- reader thread ---------------------------------------------------------------------------------------

    def _reader_conn(self) -> Database:
        if self._reader_db is None:
            raise StoreError(f"the task store {self.path} is not open")
        return self._reader_db

    def _open_reader(self) -> None:
        db = self._reader_db = _connect(self.path, read_only=True)
        if not db.table("tasks").exists():
            raise StoreError(f"{self.path} is not a task database (it has no tasks table)")

    def _select(self, sql: str, params: list[Any]) -> list[TaskRecord]:
        return records_from_rows(_rows(self._reader_conn().execute(sql, params)))

    def _close_reader(self) -> None:
        db, self._reader_db = self._reader_db, None
        if db is not None:
            db.close()
