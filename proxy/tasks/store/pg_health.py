"""What tells that PostgreSQL is away for now, shared by the pool's side (`postgres.py`) and the creator thread
(`pg_create.py`): which of psycopg's errors are transient (StoreUnavailableError, with a reason label), and
whether an idle connection's socket stayed quiet. Depends on psycopg only; no store, no aiohttp.
"""

from __future__ import annotations

import select
from typing import Final

import psycopg
from psycopg_pool import PoolTimeout

KIND: Final = "postgres"


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
