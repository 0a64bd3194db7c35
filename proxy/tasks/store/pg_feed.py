"""The PostgreSQL change feed: LISTEN on the store's channel, one connection per subscription, a RESYNC first
and after every reconnection. Runs in the subscriber's coroutine. Depends on psycopg and `base`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Final, Protocol

import psycopg
from psycopg import sql

from proxy.tasks.store.base import RESYNC, Change, StoreError

# A subscription LISTENs before it is handed out (so nothing committed after `changes()` returned is missed while the
# connection holds), yields RESYNC first and again after every reconnection (notifications sent while it was away are
# lost: the subscriber re-reads what it follows, e.g. `take_messages`). It runs in the subscriber's own coroutine: no
# background task. Depends on psycopg and `base`; used by `postgres.py` only.

WAKE_SECONDS: Final = 1.0  # a waiting listener looks up this often (store closed?)
HEARTBEAT_SECONDS: Final = 30.0  # a quiet listener checks its connection this often
RETRY_FIRST_SECONDS: Final = 0.05  # reconnection back-off: doubles from here...
RETRY_MAX_SECONDS: Final = 2.0  # ...up to this


class FeedSource(Protocol):
    """What the feed needs of its store (`PostgresTaskStore`): where to connect, and the channel to LISTEN on."""

    url: str

    @property
    def channel(self) -> str: ...

    def connect_kwargs(self, *, application: str = ...) -> dict[str, Any]: ...


class PgFeed:
    """The listeners of one store."""

    def __init__(self, store: FeedSource) -> None:
        self._store = store
        self._connections: set[psycopg.AsyncConnection[Any]] = set()
        self._closed = False

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        kwargs = self._store.connect_kwargs(application="mcp-tasks-proxy-listen")
        conn = await psycopg.AsyncConnection.connect(self._store.url, **kwargs)
        self._connections.add(conn)
        try:
            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._store.channel)))
        except BaseException:
            await self._drop(conn)
            raise
        return conn

    async def _drop(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._connections.discard(conn)
        await conn.close()

    async def _reconnect(self) -> psycopg.AsyncConnection[Any] | None:
        """A listening connection again, retrying with back-off; None once the store closes."""
        delay = RETRY_FIRST_SECONDS
        while not self._closed:
            try:
                return await self._connect()
            except (psycopg.Error, StoreError):
                await asyncio.sleep(delay)  # the database is away: try again a little later
                delay = min(delay * 2, RETRY_MAX_SECONDS)
        return None

    @contextlib.asynccontextmanager
    async def subscribe(self, for_replica: str | None) -> AsyncIterator[AsyncIterator[Change]]:
        if self._closed:
            raise StoreError(f"changes: the task store {self._store.url} is closed")
        try:
            first = await self._connect()
        except psycopg.Error as exc:
            raise StoreError(f"task store {self._store.url}: LISTEN failed: {exc}") from exc
        stream = self._stream(first, for_replica)
        try:
            yield stream
        finally:
            await stream.aclose()
            if not first.closed:  # the stream never started
                await self._drop(first)

    async def _stream(
        self, first: psycopg.AsyncConnection[Any], for_replica: str | None
    ) -> AsyncGenerator[Change, None]:
        conn: psycopg.AsyncConnection[Any] | None = first
        while not self._closed:
            if conn is None:
                conn = await self._reconnect()
                if conn is None:
                    return
            try:
                yield Change(RESYNC)
                checked = time.monotonic()
                while not self._closed:
                    async for notify in conn.notifies(timeout=WAKE_SECONDS):
                        change = _parse(notify.payload)
                        if change is not None and change.wanted_by(for_replica):
                            yield change
                    if time.monotonic() - checked > HEARTBEAT_SECONDS:
                        await conn.execute("SELECT 1")  # a dead connection raises here
                        checked = time.monotonic()
            except psycopg.Error:
                pass  # the connection was lost: reconnect (RESYNC tells the subscriber)
            finally:
                await self._drop(conn)
            conn = None

    async def close(self) -> None:
        """Stop every listener: each ends within WAKE_SECONDS, its connection closed."""
        self._closed = True


def _parse(payload: str) -> Change | None:
    """A notification of ours, or None for anything else sent on the channel."""
    try:
        return Change.from_json(payload)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
