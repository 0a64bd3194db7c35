"""The SQLite store's two threads, composed by the store as its `db`: the writer thread owns the write
connection, the reader thread a read-only one; every SQLite call is sent to one of them off the event loop, its
sqlite3 error translated and its outcome noted in the store's health. Used by `sqlite.py` only."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from sqlite_utils import Database

from proxy.tasks.store.base import StoreError, StoreHealth, StoreUnavailableError
from proxy.tasks.store.rows import records_from_rows
from proxy.tasks.store.sqlite_writer import connect, rows, translated
from proxy.wire.tasks import TaskRecord

_T = TypeVar("_T")


class SqliteDb:
    """The threads of one SQLite file and the dispatch to them (`write`, `read`)."""

    def __init__(self, path: Path, *, read_only: bool) -> None:
        self.path = path
        self.read_only = read_only
        self.closed = False
        self.health = StoreHealth("sqlite")
        self.writer: ThreadPoolExecutor | None = (
            None if read_only else ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-store-writer")
        )
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-store-reader")
        # Owned by the reader thread:
        self._reader_db: Database | None = None

    # -- thread dispatch -----------------------------------------------------------------------------------

    def writer_thread(self, what: str) -> ThreadPoolExecutor:
        """The writer thread, for `what`, unless the store is closed or read-only."""
        if self.closed:
            raise StoreError(f"{what}: the task store {self.path} is closed")
        if self.writer is None:
            raise StoreError(f"{what}: the task store {self.path} is open read-only")
        return self.writer

    async def write(self, what: str, work: Callable[[], _T]) -> _T:
        writer = self.writer_thread(what)
        return await self._noted(what, asyncio.get_running_loop().run_in_executor(writer, self.guarded, what, work))

    async def read(self, what: str, work: Callable[[], _T]) -> _T:
        if self.closed:
            raise StoreError(f"{what}: the task store {self.path} is closed")
        return await self._noted(
            what, asyncio.get_running_loop().run_in_executor(self.reader, self.guarded, what, work)
        )

    async def _noted(self, what: str, work: Awaitable[_T]) -> _T:
        """The outcome of an operation in the store's health (readiness, metrics)."""
        try:
            result = await work
        except StoreUnavailableError as exc:
            self.health.failed(what.split(" ", 1)[0], "unavailable", exc.reason)
            raise
        self.health.available = True
        return result

    def guarded(self, what: str, work: Callable[[], _T]) -> _T:
        try:
            return work()
        except sqlite3.Error as exc:
            raise translated(exc, f"task store {self.path}: {what} failed: {exc}") from exc

    # -- reader thread ---------------------------------------------------------------------------------------

    def reader_conn(self) -> Database:
        if self._reader_db is None:
            raise StoreError(f"the task store {self.path} is not open")
        return self._reader_db

    def open_reader(self) -> None:
        db = self._reader_db = connect(self.path, read_only=True)
        if not db.table("tasks").exists():
            raise StoreError(f"{self.path} is not a task database (it has no tasks table)")

    def select(self, sql: str, params: list[Any]) -> list[TaskRecord]:
        """Reader thread: the task records a query selects."""
        return records_from_rows(rows(self.reader_conn().execute(sql, params)))

    def close_reader(self) -> None:
        db, self._reader_db = self._reader_db, None
        if db is not None:
            db.close()
