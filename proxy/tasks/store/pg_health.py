"""What tells that PostgreSQL is away for now, shared by the pool's side (`pg_connections.py`) and the creator thread
(`pg_create.py`): which of psycopg's errors are transient (StoreUnavailableError, with a reason label), whether
an idle connection's socket stayed quiet, and the deadline's watchdog, which ends a connection that a statement
holds past it. Depends on psycopg only; no store, no aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
from typing import Final

import psycopg
from psycopg_pool import PoolTimeout

KIND: Final = "postgres"
# While the store is known to be away (its latest operation failed), an operation waits this long at most: a
# request during an outage is answered at once rather than after the whole deadline each time, and a healthy
# database answers the first one after its return well within it (then the full deadline applies again).
AWAY_TIMEOUT_SECONDS: Final = 1.0


def unavailable_reason(exc: psycopg.Error) -> str | None:
    """The reason label when `exc` says the database is away for now (down, cut off, a standby, a pool that
    found no live connection in time); None for a lasting error (bad SQL, a constraint)."""
    if isinstance(exc, PoolTimeout):
        return "timeout"
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return "read_only"  # a standby, or a primary demoted by a failover
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return "connection"
    return None


def operation_of(what: str) -> str:
    """The operation named by an error's `what` ("get <task id>" → "get"): a metric label of bounded values."""
    return what.split(" ", 1)[0]


def quiet(fileno: int) -> bool:
    """Nothing arrived on an idle connection's socket (one poll, no round trip: the normal case). Anything there
    (a shutdown's notice, the end of a connection cut) means the connection must be checked before use."""
    poller = select.poll()
    poller.register(fileno, select.POLLIN | select.POLLERR | select.POLLHUP)
    return not poller.poll(0)


def cut(fileno: int) -> None:
    """End a connection's TCP stream at once, both ways: a read waiting on it returns, the connection breaks
    (psycopg raises OperationalError at once, no cancel request sent to a server that cannot answer it)."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fileno))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


class Watchdog:
    """Cuts a connection still in use at the deadline (a frozen or vanished server): the statement fails at once
    instead of the caller waiting, or cancelling into psycopg's own clean-up (a cancel request and a wait, 10 s).
    On the normal path it costs one timer, cancelled."""

    __slots__ = ("_handle", "fired")

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float, fileno: int) -> None:
        self.fired = False
        self._handle = loop.call_at(deadline, self._fire, fileno)

    def _fire(self, fileno: int) -> None:
        self.fired = True
        cut(fileno)

    def cancel(self) -> None:
        self._handle.cancel()


def deadline_seconds(timeout_seconds: float, available: bool) -> float:
    """The deadline of the next operation: the configured one, shorter while the store is known away."""
    return timeout_seconds if available else min(timeout_seconds, AWAY_TIMEOUT_SECONDS)
