"""The SQLite store's writer thread: the file lock, the write connection and every write, synchronously.

Every method runs in the store's one writer thread (the store dispatches to it); nothing here touches the
event loop. Depends on sqlite-utils and the store's `base`, `rows` and `sqlite_schema`; used by
`sqlite.py` and `sqlite_threads.py` only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from sqlite_utils import Database

from proxy.tasks.store import base
from proxy.tasks.store import sqlite_schema as schema
from proxy.tasks.store.base import (
    CANCEL,
    Fence,
    FencedError,
    Message,
    StoreError,
    StoreFullError,
    StoreLockedError,
    StoreUnavailableError,
)
from proxy.tasks.store.batching import caused
from proxy.tasks.store.rows import MESSAGE_RETENTION_MS, decode, records_from_rows, row_from_record
from proxy.wire.tasks import LIVE, TaskRecord, TaskStatus

_MIN_SQLITE_VERSION: Final = (3, 35, 0)  # UPDATE ... RETURNING

# SQLite's primary result codes (the low byte of an extended one) that mean the file cannot take a commit right
# now, though nothing is wrong with it: they pass when space returns or the file system is writable again. The
# transaction is rolled back and the connection stays usable (https://www.sqlite.org/rescode.html).
_UNAVAILABLE: Final = {
    sqlite3.SQLITE_FULL: "disk full",
    sqlite3.SQLITE_READONLY: "read-only file system",
    sqlite3.SQLITE_IOERR: "I/O error",
}


def translated(exc: sqlite3.Error, message: str) -> StoreError:
    """A driver error as the store's: StoreUnavailableError for a full disk, a read-only file system or an I/O
    error (transient: retried, answered 503), else StoreError with `message`."""
    code = getattr(exc, "sqlite_errorcode", None)
    reason = None if code is None else _UNAVAILABLE.get(code & 0xFF)
    error = StoreError(message) if reason is None else StoreUnavailableError("sqlite", reason, detail=message)
    return caused(error, exc)


# The database holds tool arguments and results, and the files are the proxy's alone: owner-only modes whatever the
# umask. SQLite creates `-wal` and `-shm` with the mode of the database file, so creating that file 0600 (and
# narrowing one left wider by an earlier version) is what makes them 0600 too.
_FILE_MODE: Final = 0o600
_DIRECTORY_MODE: Final = 0o700
_GROUP_AND_OTHER: Final = 0o077


def _private_directory(directory: Path) -> None:
    """Create the missing directories down to `directory`, each 0700; existing ones (a volume) are left alone."""
    missing: list[Path] = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=_DIRECTORY_MODE)
        except FileExistsError:
            continue  # created meanwhile by someone else: theirs
        os.chmod(path, _DIRECTORY_MODE)  # exactly, whatever the umask took away


def _owner_only(path: Path) -> None:
    """Take group and other access away from an existing file."""
    with contextlib.suppress(FileNotFoundError):
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & _GROUP_AND_OTHER:
            os.chmod(path, mode & ~_GROUP_AND_OTHER)


def _private_database(path: Path) -> None:
    """The database file exists and is owner-only before SQLite opens it; so are -wal and -shm if a crash left
    them (SQLite creates new ones with the database file's mode)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, _FILE_MODE))
    except FileExistsError:
        pass
    else:
        os.chmod(path, _FILE_MODE)  # an empty file is a new database to SQLite
    for suffix in ("", "-wal", "-shm"):
        _owner_only(path.with_name(path.name + suffix))


def connect(path: Path, *, read_only: bool, existing: bool = False) -> Database:
    # A URI, so that `?` or `#` in a path cannot be read as URI syntax; mode=ro makes the reader read-only, and
    # mode=rw opens only a file that exists.
    mode = "?mode=ro" if read_only else "?mode=rw" if existing else ""
    conn = sqlite3.connect(f"file:{quote(str(path))}{mode}", uri=True)
    db = Database(conn, execute_plugins=False)
    db.execute("PRAGMA busy_timeout=5000")
    return db


def rows(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def wall_ms() -> int:
    return int(time.time() * 1000)


class SqliteWriter:
    """The writer thread's state: the lock file descriptor, the write connection, the record count."""

    def __init__(self, path: Path, *, max_records: int, synchronous: str) -> None:
        self.path = path
        self._max_records = max_records
        self._synchronous = synchronous
        self._db: Database | None = None
        self._lock_fd: int | None = None
        self._record_count = 0
        self._data_version = 0  # PRAGMA data_version when the count was last read

    def db(self) -> Database:
        if self._db is None:
            raise StoreError(f"the task store {self.path} is not open")
        return self._db

    def open(self) -> None:
        if sqlite3.sqlite_version_info < _MIN_SQLITE_VERSION:
            raise StoreError(
                f"the task store needs SQLite >= 3.35 (RETURNING), this Python has {sqlite3.sqlite_version}"
            )
        try:
            _private_directory(self.path.parent)
            lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            _owner_only(Path(f"{self.path}.lock"))
            _private_database(self.path)
        except OSError as exc:
            raise StoreError(f"cannot open the task store {self.path}: {exc}") from exc
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            raise StoreLockedError(f"{self.path} is in use by another mcp-tasks-proxy process") from exc
        self._lock_fd = lock_fd
        db = self._db = connect(self.path, read_only=False)
        db.enable_wal()
        db.execute(f"PRAGMA synchronous={self._synchronous.upper()}")
        schema.MIGRATIONS.apply(db)
        (self._record_count,) = db.execute("SELECT COUNT(*) FROM tasks").fetchone()
        self._written_elsewhere()

    def _written_elsewhere(self) -> bool:
        """Has another connection (an operator's `tasks purge`, beside this proxy) committed since the count was
        read? SQLite's `data_version` changes only then; asked only at the `max_records` boundary."""
        (version,) = self.db().execute("PRAGMA data_version").fetchone()
        changed: bool = version != self._data_version
        self._data_version = version
        return changed

    def open_beside(self) -> None:
        """An operator's connection (the CLI's cancel and purge): to an existing database, without the file lock,
        so it works beside the proxy that holds it (SQLite's own locking orders the two writers). No migration:
        the proxy owns the schema."""
        if not self.path.is_file():
            raise StoreError(f"cannot open the task store {self.path}: no such file")
        self._db = connect(self.path, read_only=False, existing=True)

    def close(self, checkpoint: bool) -> None:
        db, self._db = self._db, None
        try:
            if db is not None:
                try:
                    if checkpoint:
                        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                except sqlite3.Error as exc:
                    # A full disk or a read-only file system cannot take the checkpoint: the WAL stays and the
                    # next open replays it, as after a crash. Anything else is the error to report.
                    if not isinstance(translated(exc, ""), StoreUnavailableError):
                        raise
                finally:
                    db.close()
        finally:
            if self._lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._lock_fd)  # closing the descriptor releases the flock
                self._lock_fd = None

    def trace(self, callback: Callable[[str], object] | None) -> None:
        self.db().conn.set_trace_callback(callback)

    def create_all(self, records: list[TaskRecord]) -> list[StoreError | None]:
        """One group commit; each record in its own savepoint, so a record that fails takes back only itself."""
        try:
            return self._create_all(records)
        except sqlite3.Error as exc:  # the group's COMMIT (a full disk...): every record of it failed
            raise translated(exc, f"task store {self.path}: create failed: {exc}") from exc

    def _create_all(self, records: list[TaskRecord]) -> list[StoreError | None]:
        db = self.db()
        errors: list[StoreError | None] = []
        count = self._record_count
        with db.atomic():
            for record in records:
                try:
                    with db.atomic():
                        evicted = 0
                        if count >= self._max_records and self._written_elsewhere():
                            (count,) = db.execute("SELECT COUNT(*) FROM tasks").fetchone()  # an operator purged
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

    def change(self, sql: str, params: dict[str, Any], task_id: str, fence: Fence | None) -> TaskRecord | None:
        """One conditional UPDATE ... RETURNING; with a fence, a live task of another owner is FencedError."""
        db = self.db()
        with db.atomic():
            # All rows are fetched before COMMIT: a RETURNING statement still stepping would block it.
            records = records_from_rows(rows(db.execute(sql, params)))
        if not records and fence is not None:
            row = db.execute("SELECT owner, status FROM tasks WHERE task_id = ?", [task_id]).fetchone()
            if row is not None and TaskStatus(row[1]) in LIVE:
                raise FencedError(f"task {task_id} is owned by {row[0]}, not {fence.owner}")
        return records[0] if records else None

    def bury(self, where: str, params: list[Any], reason: str | None, now_ms: int) -> int:
        """`DELETE {where}`; with a `reason`, each deleted record leaves a tombstone, in the same transaction."""
        db = self.db()
        with db.atomic():
            if reason is not None:
                db.execute(schema.BURY_SQL + where, [reason, now_ms, *params])
            deleted = db.execute(f"DELETE {where}", params).rowcount
        self._record_count -= deleted
        return deleted

    def purge(self, now_ms: int, reason: str | None, batch: int) -> int:
        """At most `batch` settled records past their TTL, the oldest first, in one transaction."""
        return self.bury(schema.PURGE_BATCH_WHERE, [now_ms, batch], reason, now_ms)

    def purge_aside(self) -> None:
        """Messages nobody took within an hour, and forgotten tools (a few rows: one transaction)."""
        db = self.db()
        with db.atomic():
            db.execute(schema.PURGE_MESSAGES_SQL, [wall_ms() - MESSAGE_RETENTION_MS])
            db.execute(schema.TRIM_DURATIONS_SQL, [base.MAX_DURATION_TOOLS])

    def trim_tombstones(self, gone_before_ms: int, keep: int, batch: int) -> int:
        """At most `batch` tombstones: those gone before `gone_before_ms` first, then the oldest beyond `keep`."""
        db = self.db()
        with db.atomic():
            trimmed = int(db.execute(schema.TRIM_OLD_TOMBSTONES_SQL, [gone_before_ms, batch]).rowcount)
            if trimmed < batch:
                (count,) = db.execute(schema.COUNT_TOMBSTONES_SQL).fetchone()
                excess = min(batch - trimmed, int(count) - keep)
                if excess > 0:
                    trimmed += int(db.execute(schema.TRIM_OLDEST_TOMBSTONES_SQL, [excess]).rowcount)
            return trimmed

    def cancel(self, sql: str, params: dict[str, Any], task_id: str, tell_owner: bool) -> TaskRecord | None:
        """Settle a live task `cancelled` and, with `tell_owner`, leave its owner a CANCEL message, in one
        transaction (the owner is another process: it polls for its messages)."""
        db = self.db()
        with db.atomic():
            if tell_owner:
                message = {"kind": CANCEL, "key": task_id, "payload": "{}", "now_ms": wall_ms()}
                db.execute(schema.NOTIFY_OWNER_SQL, message).fetchall()
            records = records_from_rows(rows(db.execute(sql, params)))
        return records[0] if records else None

    def messages(self, sql: str, params: dict[str, Any] | list[Any]) -> list[Message]:
        """Messages inserted or taken by one statement, oldest first."""
        db = self.db()
        with db.atomic():
            found = sorted(db.execute(sql, params).fetchall())
        return [Message(row[0], row[1], row[2], row[3], decode(row[4])) for row in found]

    def health(self, now_ms: int) -> None:
        db = self.db()
        with db.atomic():
            db.execute(schema.HEALTH_SQL, [now_ms])

    def observe(self, tool: str, duration_ms: float) -> float:
        params = {"tool": tool, "ms": duration_ms, "now_ms": wall_ms(), "smoothing": base.DURATION_SMOOTHING}
        db = self.db()
        with db.atomic():
            (estimate,) = db.execute(schema.OBSERVE_SQL, params).fetchone()
        return float(estimate)
