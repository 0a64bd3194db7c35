"""The PostgreSQL store's connections: each new one's settings, the open (schema migrated, channel named), and
every operation on a pooled connection within the store's deadline (`StoreUnavailableError` past it). Depends
on psycopg and the store's base, health and schema; must not import aiohttp or tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Final, TypeVar

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg_pool import AsyncConnectionPool

from proxy.config.keyfiles import read_password
from proxy.tasks.store import pg_schema as schema
from proxy.tasks.store.base import StoreError, StoreHealth
from proxy.tasks.store.pg_health import KIND, Watchdog, deadline_seconds, operation_of, quiet, unavailable_reason

# Every operation has a deadline (`store.timeout_seconds`: the pooled connection, the connection itself and the
# statement); past it, or when the database cannot be reached or takes no writes (a standby), it raises
# `StoreUnavailableError`. A pooled connection that the server closed or wrote to while idle (a restart's notice, a
# cut) is checked before it is handed out, and a read that met a connection broken in a cut is tried once more on a
# fresh one; a multi-host URL (`host=a,b` with `target_session_attrs=read-write`) follows a failover, since libpq
# picks the primary for each new connection. Depends on psycopg, psycopg_pool and the store's `base`, `pg_health`,
# `pg_schema`; used by `postgres.py` (and `pg_keys.py`, for its connection type); it must not import aiohttp, the
# runner or the front.

_KEEPALIVE: Final = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
_T = TypeVar("_T")
Conn = psycopg.AsyncConnection[DictRow]


async def _usable(conn: Conn) -> bool:
    """Is a pooled connection fit for use? One the server wrote to or closed while it sat idle (a shutdown's
    notice, a connection cut) is checked with a round trip; a quiet one (the normal case) costs one poll. One
    that fails is broken now: the pool drops it when it is given back and opens another at once."""
    if conn.closed or conn.broken:
        return False
    if quiet(conn.fileno()):
        return True
    try:
        await AsyncConnectionPool.check_connection(conn)
    except psycopg.Error:
        return False
    return True


@dataclass(eq=False, slots=True)
class PgConnections:
    """The pool of a PostgreSQL store and the runs on it (`run`, `rows`), composed by the store as its `db`."""

    url: str
    _: KW_ONLY
    password_file: str | None
    pool_size: InitVar[int]
    connect_timeout_seconds: float
    timeout_seconds: float
    read_only: bool
    migrate: bool  # the schema is migrated at open (never when read-only)
    health: StoreHealth = field(default_factory=lambda: StoreHealth(KIND), init=False)
    closed: bool = field(default=False, init=False)
    _channel: str = field(default="", init=False)  # set at open: one NOTIFY channel per schema
    _pool: AsyncConnectionPool[Conn] = field(init=False)

    def __post_init__(self, pool_size: int) -> None:
        self.migrate = self.migrate and not self.read_only
        self._pool = AsyncConnectionPool(
            self.url,
            connection_class=Conn,
            kwargs=self.connect_kwargs,
            min_size=1,
            max_size=pool_size,
            open=False,
            timeout=self.timeout_seconds,
            # A connection slot that cannot reconnect for this long is given up, and the next request that finds
            # the pool empty starts a fresh attempt at once: the pool's back-off (1, 2, 4, ... s) never keeps a
            # replica waiting long after its database is back.
            reconnect_timeout=self.timeout_seconds,
            name="mcp-tasks-proxy",
        )

    def connect_kwargs(self, *, application: str = "mcp-tasks-proxy") -> dict[str, Any]:
        """Settings of every new connection (the password file is read again each time)."""
        kwargs: dict[str, Any] = {
            "autocommit": True,
            "row_factory": dict_row,
            "application_name": application,
            "connect_timeout": max(1, round(self.connect_timeout_seconds)),
            # Data the server does not acknowledge for this long (a partition, a host gone) breaks the
            # connection, so that nothing waits on it past the store's deadline for long.
            "tcp_user_timeout": round(1000 * max(self.connect_timeout_seconds, self.timeout_seconds)),
            **_KEEPALIVE,
        }
        if self.password_file is not None:
            try:
                kwargs["password"] = read_password(self.password_file)
            except ValueError as exc:
                raise StoreError(f"task store {self.url}: {exc}") from None
        if self.read_only:
            kwargs["options"] = "-c default_transaction_read_only=on"
        return kwargs

    async def open(self) -> None:
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, **self.connect_kwargs())
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to the task store {self.url}: {exc}") from exc
        try:
            async with conn:
                if self.migrate:
                    await schema.migrate(conn)
                cursor = await conn.execute("SELECT current_schema() AS name, to_regclass('tasks') AS tasks")
                row = await cursor.fetchone()
        except psycopg.Error as exc:
            raise StoreError(f"task store {self.url}: open failed: {exc}") from exc
        if row is None or row["tasks"] is None:
            raise StoreError(f"{self.url} is not a task database (it has no tasks table)")
        self._channel = f"mcp_tasks_proxy.{row['name']}"[:63]
        try:
            await self._pool.open(wait=True, timeout=self.connect_timeout_seconds)
        except psycopg.Error as exc:  # psycopg_pool.PoolTimeout is one
            raise StoreError(f"cannot open connections to the task store {self.url}: {exc}") from exc

    @property
    def channel(self) -> str:
        return self._channel

    # -- plumbing --------------------------------------------------------------------------------------------

    def check_open(self, what: str, *, write: bool) -> None:
        if self.closed:
            raise StoreError(f"{what}: the task store {self.url} is closed")
        if write and self.read_only:
            raise StoreError(f"{what}: the task store {self.url} is open read-only")

    async def run(self, what: str, work: Callable[[Conn], Awaitable[_T]], *, write: bool = True) -> _T:
        """`work` on a pooled connection, within the store's deadline (the wait for a connection and the work
        together). psycopg's errors become StoreError naming `what`: StoreUnavailableError when the database is
        away or the deadline passed. A read (`write=False`) whose connection broke under it is done once more."""
        self.check_open(what, write=write)
        timeout = deadline_seconds(self.timeout_seconds, self.health.available)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            result = await self._on_connection(work, retry=not write, deadline=deadline)
        except TimeoutError:
            detail = f"no answer within {timeout:g} s (store.timeout_seconds, shorter while it is away)"
            raise self.health.failed(operation_of(what), "timeout", detail) from None
        except psycopg.Error as exc:
            reason = unavailable_reason(exc)
            if reason is None:
                raise StoreError(f"task store {self.url}: {what} failed: {exc}") from exc
            raise self.health.failed(operation_of(what), reason, str(exc)) from exc
        self.health.available = True
        return result

    async def _on_connection(self, work: Callable[[Conn], Awaitable[_T]], *, retry: bool, deadline: float) -> _T:
        """`work` on the first usable pooled connection (each unusable one is replaced by the pool at once),
        cut by the watchdog at the deadline; a read whose connection broke under it goes once more on another."""
        loop = asyncio.get_running_loop()
        tries = 2 if retry else 1
        while True:
            async with self._pool.connection(timeout=max(0.0, deadline - loop.time())) as conn:
                watchdog = Watchdog(loop, deadline, conn.fileno())
                try:
                    if not await _usable(conn):
                        continue
                    return await work(conn)
                except psycopg.errors.ReadOnlySqlTransaction:
                    await conn.close()  # a primary demoted by a failover: never handed out again
                    raise
                except psycopg.OperationalError:
                    if watchdog.fired:
                        raise TimeoutError from None
                    tries -= 1
                    if tries == 0 or not conn.broken:
                        raise
                finally:
                    watchdog.cancel()

    async def rows(self, what: str, sql: str, params: Any = None, *, write: bool = True) -> list[DictRow]:
        async def run(conn: Conn) -> list[DictRow]:
            cursor = await conn.execute(sql, params)
            return await cursor.fetchall() if cursor.description is not None else []

        return await self.run(what, run, write=write)

    async def close(self) -> None:
        self.closed = True
        await self._pool.close()
