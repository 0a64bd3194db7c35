"""Task creations on PostgreSQL: one thread with its own connection commits them in batches (group commit, two
round trips in pipeline mode), the count row's lock serializing creators across replicas. Depends on psycopg
and the store's base, rows, batching and schema."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg

from proxy.tasks.store import pg_schema as schema
from proxy.tasks.store.base import StoreError, StoreFullError, StoreHealth
from proxy.tasks.store.batching import CreationBatcher
from proxy.tasks.store.pg_health import cut, deadline_seconds, quiet, unavailable_reason
from proxy.tasks.store.rows import row_from_record
from proxy.wire.tasks import TaskRecord


@dataclass(eq=False, slots=True)
class PgCreator:
    """The creator thread, its connection (opened on first use, again after it broke) and its batches.

    A batch is one transaction in two round trips (pipeline mode): lock the count row, find duplicate ids and
    evictable records; then evict, insert and COMMIT. The count row's lock serializes creators across replicas, so
    at `max_records` each record evicts exactly one settled record or is refused. The batch never runs in a caller's
    coroutine (see `batching.py`), so a caller that leaves cannot cut it short; a caller waits for it at most the
    store's deadline (StoreUnavailableError). A connection the server closed or wrote to since the last batch (a
    restart, a cut) is replaced before the next one. Depends on psycopg and the store's `base`, `rows`, `batching`
    and `pg_schema`; used by `postgres.py` only."""

    url: str
    connect_kwargs: Callable[[], dict[str, Any]]
    max_records: int
    timeout_seconds: float
    health: StoreHealth
    executor: ThreadPoolExecutor = field(init=False)
    _batcher: CreationBatcher = field(init=False)
    _closed: bool = field(default=False, init=False)
    _conn: psycopg.Connection[Any] | None = field(default=None, init=False)  # owned by the thread

    def __post_init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-store-creator")
        self._batcher = CreationBatcher(self._commit_all, self.url)

    async def create(self, record: TaskRecord) -> None:
        timeout = deadline_seconds(self.timeout_seconds, self.health.available)
        try:
            async with asyncio.timeout(timeout):
                await self._batcher.create(self.executor, record)
        except TimeoutError:
            conn = self._conn
            if conn is not None and not conn.closed:
                cut(conn.fileno())  # the thread's statement fails now, and the batches queued behind it can go
            # The batch may still commit once the database answers: the record then runs nowhere, and the
            # lease's recovery or its TTL ends it (nobody was told its id).
            detail = f"not committed within {timeout:g} s (store.timeout_seconds, shorter while it is away)"
            raise self.health.failed("create", "timeout", detail) from None
        self.health.available = True

    async def close(self) -> None:
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self.executor, self._close_connection)
        self.executor.shutdown(wait=False)

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed and (conn.broken or not quiet(conn.fileno())):
            conn.close()  # the server closed it or said something while it sat idle: a restart, a cut
            conn = None
        if conn is None or conn.closed:
            conn = self._conn = psycopg.Connection.connect(self.url, **self.connect_kwargs())
        return conn

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _commit_all(self, records: list[TaskRecord]) -> list[StoreError | None]:
        """One batch: each record committed, or refused on its own (a duplicate id, no room), as in SQLite."""
        if self._closed:
            raise StoreError("the store is closed")
        try:
            conn = self._connection()
        except psycopg.Error as exc:
            raise self._failed(exc) from exc
        try:
            with conn.pipeline(), conn.transaction():
                counted = conn.execute(schema.LOCK_COUNT_SQL)
                existing = conn.execute(schema.EXISTING_SQL, [[record.task_id for record in records]])
                evictable = conn.execute(schema.EVICTABLE_SQL, {"batch": len(records), "max_records": self.max_records})
                count = int(counted.fetchone()["records"])  # type: ignore[index]
                taken = {row["task_id"] for row in existing.fetchall()}
                can_evict = int(evictable.fetchone()["count"])  # type: ignore[index]
                errors, accepted, evict = self._admit(records, count, taken, can_evict)
                if evict:
                    conn.execute(schema.EVICT_SQL, [evict])
                if accepted:
                    rows = [row_from_record(record) for record in accepted]
                    conn.execute(schema.INSERT_SQL, {name: [row[name] for row in rows] for name in rows[0]})
        except psycopg.Error as exc:
            if conn.broken or isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):  # dead, or demoted
                self._close_connection()
            raise self._failed(exc) from exc
        return errors

    def _failed(self, exc: psycopg.Error) -> StoreError:
        reason = unavailable_reason(exc)
        if reason is None:
            return StoreError(f"task store {self.url}: create failed: {exc}")
        return self.health.failed("create", reason, str(exc))

    def _admit(
        self, records: list[TaskRecord], count: int, taken: set[str], can_evict: int
    ) -> tuple[list[StoreError | None], list[TaskRecord], int]:
        """Which records go in, in order: each one at capacity evicts the oldest settled record, or is refused."""
        errors: list[StoreError | None] = []
        accepted: list[TaskRecord] = []
        evict = 0
        for record in records:
            if record.task_id in taken:
                errors.append(StoreError(f"task store {self.url}: create {record.task_id} failed: duplicate task id"))
                continue
            needed = max(0, count - self.max_records + 1)
            if needed > can_evict - evict:
                errors.append(StoreFullError(f"task store full: {self.max_records} live tasks"))
                continue
            taken.add(record.task_id)
            accepted.append(record)
            evict += needed
            count += 1 - needed
            errors.append(None)
        return errors, accepted, evict
