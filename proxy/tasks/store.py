"""The durable task store: the only module that touches SQLite (one file, one `tasks` table, its migrations).

Every SQLite call runs off the event loop: one writer thread owns the write connection, one reader thread owns a
read-only connection. Depends on `proxy.wire` and sqlite-utils only; it must not import aiohttp, the runner or
the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, Literal, Protocol, TypeVar
from urllib.parse import quote

from sqlite_utils import Database, Migrations

from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import LIVE, TERMINAL, TaskRecord, TaskStatus

_T = TypeVar("_T")


class StoreError(Exception):
    """The task store could not do what was asked (SQLite failed, the file is wrong, the store is closed)."""


class StoreFullError(StoreError):
    """`max_records` reached and no settled record can be evicted."""


class StoreLockedError(StoreError):
    """Another mcp-tasks-proxy process (or another open store in this one) holds the database file."""


MIGRATIONS: Final = Migrations("mcp-tasks-proxy")


@MIGRATIONS(name="0001_create_tasks")
def _create_tasks(db: Database) -> None:
    tasks = db.table("tasks")
    tasks.create(
        {
            "task_id": str,
            "principal": str,
            "tool": str,
            "status": str,
            "status_message": str,
            "created_at_ms": int,
            "updated_at_ms": int,
            "ttl_ms": int,
            "expires_at_ms": int,
            "poll_interval_ms": int,
            "owner": str,
            "on_restart": str,
            "request": str,
            "result": str,
            "error": str,
            "input_requests": str,
            "inputs_issued": int,
            "rerun_principal": str,
        },
        pk="task_id",
        not_null=[
            "principal",
            "tool",
            "status",
            "created_at_ms",
            "updated_at_ms",
            "owner",
            "on_restart",
            "request",
            "input_requests",
            "inputs_issued",
        ],
    )
    tasks.create_index(["status"], index_name="idx_tasks_status")
    tasks.create_index(["expires_at_ms"], index_name="idx_tasks_expires_at_ms")
    tasks.create_index(["status", "updated_at_ms"], index_name="idx_tasks_status_updated_at_ms")


@MIGRATIONS(name="0002_create_health")
def _create_health(db: Database) -> None:
    """One row the readiness probe rewrites: proof that the file still takes a committed write."""
    db.table("health").create({"id": int, "checked_at_ms": int}, pk="id")


@MIGRATIONS(name="0003_add_client_capabilities")
def _add_client_capabilities(db: Database) -> None:
    """The creating request's ClientCapabilities: which upstream questions may become `inputRequests` (K-19),
    also for a task re-run after a restart."""
    db.table("tasks").add_column("client_capabilities", str, not_null_default="{}")


_COLUMNS: Final = (
    "task_id",
    "principal",
    "tool",
    "status",
    "status_message",
    "created_at_ms",
    "updated_at_ms",
    "ttl_ms",
    "expires_at_ms",
    "poll_interval_ms",
    "owner",
    "on_restart",
    "request",
    "result",
    "error",
    "input_requests",
    "inputs_issued",
    "rerun_principal",
    "client_capabilities",
)
_JSON_FIELDS: Final = frozenset({"request", "result", "error", "input_requests", "client_capabilities"})
STATUS_KEYS: Final = tuple(status.value for status in TaskStatus)

_LIVE_SQL: Final = ", ".join(f"'{status.value}'" for status in sorted(LIVE))
_TERMINAL_SQL: Final = ", ".join(f"'{status.value}'" for status in sorted(TERMINAL))
_INSERT_SQL: Final = (
    f"INSERT INTO tasks ({', '.join(_COLUMNS)}) VALUES ({', '.join(':' + column for column in _COLUMNS)})"
)
# One indexed walk per settled status, then the oldest of those few candidates: a single
# `status IN (...) ORDER BY updated_at_ms` would sort every settled record on each create at capacity.
_OLDEST_SETTLED_SQL: Final = " UNION ALL ".join(
    f"SELECT * FROM (SELECT task_id, updated_at_ms, created_at_ms FROM tasks WHERE status = '{status.value}'"
    " ORDER BY updated_at_ms, created_at_ms LIMIT :count)"
    for status in sorted(TERMINAL)
)
_EVICT_SQL: Final = (
    "DELETE FROM tasks WHERE task_id IN (SELECT task_id FROM"
    f" ({_OLDEST_SETTLED_SQL}) ORDER BY updated_at_ms, created_at_ms LIMIT :count)"
)
_SETTLE_SQL: Final = (
    "UPDATE tasks SET status = :status, result = :result, error = :error, status_message = :status_message,"
    " input_requests = '{}', rerun_principal = NULL, updated_at_ms = :now_ms"
    f" WHERE task_id = :task_id AND status IN ({_LIVE_SQL}) RETURNING *"
)
# `+status` keeps the planner on the expires_at_ms index (few rows are past expiry; many share a status).
_EXPIRED_LIVE_SQL: Final = (
    f"SELECT * FROM tasks WHERE expires_at_ms <= ? AND +status IN ({_LIVE_SQL}) ORDER BY expires_at_ms, task_id"
)
_PURGE_SQL: Final = f"DELETE FROM tasks WHERE expires_at_ms <= ? AND +status IN ({_TERMINAL_SQL})"
_HEALTH_SQL: Final = "INSERT OR REPLACE INTO health (id, checked_at_ms) VALUES (1, ?)"
_MIN_SQLITE_VERSION: Final = (3, 35, 0)  # UPDATE ... RETURNING


def _encode(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _decode(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def record_from_row(row: Mapping[str, Any]) -> TaskRecord:
    """A `tasks` row (column name → value) as a `TaskRecord`; JSON columns decoded."""
    return TaskRecord(
        task_id=row["task_id"],
        principal=row["principal"],
        tool=row["tool"],
        status=TaskStatus(row["status"]),
        created_at_ms=row["created_at_ms"],
        updated_at_ms=row["updated_at_ms"],
        ttl_ms=row["ttl_ms"],
        poll_interval_ms=row["poll_interval_ms"],
        owner=row["owner"],
        on_restart=row["on_restart"],
        request=_decode(row["request"]),
        status_message=row["status_message"],
        result=_decode(row["result"]),
        error=_decode(row["error"]),
        input_requests=_decode(row["input_requests"]),
        inputs_issued=row["inputs_issued"],
        rerun_principal=row["rerun_principal"],
        client_capabilities=_decode(row["client_capabilities"]),
    )


def _row_from_record(record: TaskRecord) -> dict[str, Any]:
    return {
        "task_id": record.task_id,
        "principal": record.principal,
        "tool": record.tool,
        "status": TaskStatus(record.status).value,
        "status_message": record.status_message,
        "created_at_ms": record.created_at_ms,
        "updated_at_ms": record.updated_at_ms,
        "ttl_ms": record.ttl_ms,
        "expires_at_ms": record.expires_at_ms,
        "poll_interval_ms": record.poll_interval_ms,
        "owner": record.owner,
        "on_restart": record.on_restart,
        "request": _encode(record.request),
        "result": None if record.result is None else _encode(record.result),
        "error": None if record.error is None else _encode(record.error),
        "input_requests": _encode(record.input_requests),
        "inputs_issued": record.inputs_issued,
        "rerun_principal": record.rerun_principal,
        "client_capabilities": _encode(record.client_capabilities),
    }


def _rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _records(cursor: sqlite3.Cursor) -> list[TaskRecord]:
    records = []
    for row in _rows(cursor):
        try:
            records.append(record_from_row(row))
        except (ValueError, TypeError) as exc:
            raise StoreError(f"corrupt task record {row.get('task_id')!r}: {exc}") from exc
    return records


def _connect(path: Path, *, read_only: bool) -> Database:
    # A URI, so that `?` or `#` in a path cannot be read as URI syntax; mode=ro makes the reader read-only.
    conn = sqlite3.connect(f"file:{quote(str(path))}{'?mode=ro' if read_only else ''}", uri=True)
    db = Database(conn, execute_plugins=False)
    db.execute("PRAGMA busy_timeout=5000")
    return db


class TaskStore(Protocol):
    """What the runner and the app need from a task store (SqliteTaskStore is the one implementation)."""

    async def create(self, record: TaskRecord) -> None: ...

    async def get(self, task_id: str) -> TaskRecord | None: ...

    async def set_inputs(
        self, task_id: str, input_requests: JSON, inputs_issued: int, *, now_ms: int
    ) -> TaskRecord | None: ...

    async def set_status_message(self, task_id: str, status_message: str, *, now_ms: int) -> TaskRecord | None: ...

    async def claim(self, task_id: str, owner: str, status_message: str, *, now_ms: int) -> TaskRecord | None: ...

    async def settle(
        self,
        task_id: str,
        status: TaskStatus,
        *,
        now_ms: int,
        result: JSON | None = None,
        error: JSON | None = None,
        status_message: str | None = None,
    ) -> TaskRecord | None: ...

    async def live(self) -> list[TaskRecord]: ...

    async def expired_live(self, now_ms: int) -> list[TaskRecord]: ...

    async def purge_expired(self, now_ms: int) -> int: ...

    async def delete(self, task_id: str) -> bool: ...

    async def stats(self) -> dict[str, int]: ...

    async def check_writable(self, now_ms: int) -> None: ...

    async def size_bytes(self) -> int: ...

    async def close(self) -> None: ...


def _caused(error: StoreError, cause: BaseException) -> StoreError:
    error.__cause__ = cause
    return error


def _answer_creations(commit: asyncio.Future[list[tuple[asyncio.Future[None], StoreError | None]]]) -> None:
    """On the loop: each creation of a group commit gets its own outcome (unless its caller left)."""
    for committed, error in commit.result():
        if committed.cancelled():
            continue
        if error is None:
            committed.set_result(None)
        else:
            committed.set_exception(error)


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
        # Creations waiting for the writer (group commit): appended on the loop, taken by the writer thread.
        self._creating: list[tuple[TaskRecord, asyncio.Future[None]]] = []
        self._creating_lock = threading.Lock()
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

    # -- the public API ------------------------------------------------------------------------------------

    async def create(self, record: TaskRecord) -> None:
        """Returns once the record is committed (T-14).

        Group commit: creations that arrive while the writer thread is busy are committed together, in one
        transaction and one fsync, when it gets to them. Each record still fails on its own (its own
        savepoint): a full store refuses the records that do not fit, not the whole group.
        """
        writer = self._open_writer_thread(f"create {record.task_id}")
        loop = asyncio.get_running_loop()
        committed: asyncio.Future[None] = loop.create_future()
        with self._creating_lock:
            self._creating.append((record, committed))
            first = len(self._creating) == 1
        if first:  # the writer takes every creation queued by the time it starts, this one included
            loop.run_in_executor(writer, self._create_queued).add_done_callback(_answer_creations)
        await committed

    async def get(self, task_id: str) -> TaskRecord | None:
        records = await self._read(
            f"get {task_id}", lambda: self._select("SELECT * FROM tasks WHERE task_id = ?", [task_id])
        )
        return records[0] if records else None

    async def set_inputs(
        self, task_id: str, input_requests: JSON, inputs_issued: int, *, now_ms: int
    ) -> TaskRecord | None:
        """The live task's outstanding questions: `input_required` with them, `working` without any."""
        status = TaskStatus.INPUT_REQUIRED if input_requests else TaskStatus.WORKING
        values = {"status": status.value, "input_requests": _encode(input_requests), "inputs_issued": inputs_issued}
        return await self._update(task_id, values, now_ms)

    async def set_status_message(self, task_id: str, status_message: str, *, now_ms: int) -> TaskRecord | None:
        return await self._update(task_id, {"status_message": status_message}, now_ms)

    async def claim(self, task_id: str, owner: str, status_message: str, *, now_ms: int) -> TaskRecord | None:
        """A live task taken over by `owner` to be run again from the start: `working`, no questions."""
        values = {
            "owner": owner,
            "status": TaskStatus.WORKING.value,
            "status_message": status_message,
            "input_requests": "{}",
        }
        return await self._update(task_id, values, now_ms)

    async def _update(self, task_id: str, values: Mapping[str, Any], now_ms: int) -> TaskRecord | None:
        """Change a live task (a settled one never changes); the record as it is now, or None."""
        assignments = ", ".join([*(f"{name} = :{name}" for name in values), "updated_at_ms = :now_ms"])
        sql = f"UPDATE tasks SET {assignments} WHERE task_id = :task_id AND status IN ({_LIVE_SQL}) RETURNING *"
        params = {**values, "now_ms": now_ms, "task_id": task_id}
        return await self._write(f"update {task_id}", lambda: self._change(sql, params))

    async def settle(
        self,
        task_id: str,
        status: TaskStatus,
        *,
        now_ms: int,
        result: JSON | None = None,
        error: JSON | None = None,
        status_message: str | None = None,
    ) -> TaskRecord | None:
        """T-21: only a live task settles, so the first settle wins and a terminal state never changes."""
        if TaskStatus(status) not in TERMINAL:
            raise ValueError(f"settle() needs a terminal status, not {status!r}")

        def run() -> TaskRecord | None:
            params = {
                "status": TaskStatus(status).value,
                "result": None if result is None else _encode(result),
                "error": None if error is None else _encode(error),
                "status_message": status_message,
                "now_ms": now_ms,
                "task_id": task_id,
            }
            return self._change(_SETTLE_SQL, params)

        return await self._write(f"settle {task_id}", run)

    async def live(self) -> list[TaskRecord]:
        sql = f"SELECT * FROM tasks WHERE status IN ({_LIVE_SQL}) ORDER BY created_at_ms, task_id"
        return await self._read("live", lambda: self._select(sql, []))

    async def expired_live(self, now_ms: int) -> list[TaskRecord]:
        return await self._read("expired_live", lambda: self._select(_EXPIRED_LIVE_SQL, [now_ms]))

    async def purge_expired(self, now_ms: int) -> int:
        return await self._write("purge_expired", lambda: self._delete(_PURGE_SQL, [now_ms]))

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
                db.execute(_HEALTH_SQL, [now_ms])

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
        MIGRATIONS.apply(db)
        (self._record_count,) = db.execute("SELECT COUNT(*) FROM tasks").fetchone()

    def _create_queued(self) -> list[tuple[asyncio.Future[None], StoreError | None]]:
        """One group commit: every creation queued so far, each answered (never raises: nobody may wait forever)."""
        with self._creating_lock:
            queued, self._creating = self._creating, []
        try:
            errors = self._create_all([record for record, _ in queued])
        # The whole group is rolled back and each caller gets its error. Anything at all, not only SQLite's
        # errors: the callers wait on this answer and nothing else would ever give them one.
        except Exception as exc:  # noqa: BLE001
            errors = [_caused(StoreError(f"task store {self.path}: create failed: {exc}"), exc) for _ in queued]
        return [(committed, error) for (_, committed), error in zip(queued, errors, strict=True)]

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
                            evicted = db.execute(_EVICT_SQL, {"count": needed}).rowcount
                            if evicted < needed:
                                raise StoreFullError(f"task store full: {self._max_records} live tasks")
                        db.execute(_INSERT_SQL, _row_from_record(record))
                except StoreFullError as exc:
                    errors.append(exc)
                except sqlite3.IntegrityError as exc:
                    message = f"task store {self.path}: create {record.task_id} failed: {exc}"
                    errors.append(_caused(StoreError(message), exc))
                else:
                    count += 1 - evicted
                    errors.append(None)
        self._record_count = count  # COMMIT succeeded
        return errors

    def _change(self, sql: str, params: dict[str, Any]) -> TaskRecord | None:
        db = self._writer_conn()
        with db.atomic():
            # All rows are fetched before COMMIT: a RETURNING statement still stepping would block it.
            records = _records(db.execute(sql, params))
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
        return _records(self._reader_conn().execute(sql, params))

    def _close_reader(self) -> None:
        db, self._reader_db = self._reader_db, None
        if db is not None:
            db.close()
