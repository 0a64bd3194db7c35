"""Kept grants of `upstream.credentials: exchange`: the SQL both backends run on their `grants` table and the
port composed on a backend's own statements (`GrantsTable`, no mixin). Imports the wire's task statuses; no
database driver, aiohttp, runner or front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol

from proxy.wire.tasks import LIVE

CREATE_SQL: Final = (
    "CREATE TABLE grants (principal TEXT NOT NULL, target TEXT NOT NULL, sealed TEXT NOT NULL, holder TEXT,"
    " held_until_ms BIGINT, updated_at_ms BIGINT NOT NULL, PRIMARY KEY (principal, target))"
)
_ONE: Final = "principal = :principal AND target = :target"
READ_SQL: Final = f"SELECT sealed FROM grants WHERE {_ONE}"
HOLD_SQL: Final = (
    "UPDATE grants SET holder = :holder, held_until_ms = :until_ms WHERE"
    f" {_ONE} AND (holder IS NULL OR held_until_ms <= :now_ms OR holder = :holder) RETURNING sealed"
)
# Kept as it comes (an exchange for a fresh inbound token, or a grant kept when its caller's first task starts):
# the newest wins, and a hold in force stays (its holder's write, newer still, comes after).
PUT_SQL: Final = (
    "INSERT INTO grants (principal, target, sealed, holder, held_until_ms, updated_at_ms)"
    " VALUES (:principal, :target, :sealed, NULL, NULL, :now_ms) ON CONFLICT (principal, target)"
    " DO UPDATE SET sealed = excluded.sealed, updated_at_ms = excluded.updated_at_ms"
)
RENEWED_SQL: Final = (
    "UPDATE grants SET sealed = :sealed, holder = NULL, held_until_ms = NULL, updated_at_ms = :now_ms"
    f" WHERE {_ONE} AND holder = :holder"
)
UNHOLD_SQL: Final = f"UPDATE grants SET holder = NULL, held_until_ms = NULL WHERE {_ONE} AND holder = :holder"
DROP_SQL: Final = f"DELETE FROM grants WHERE {_ONE}"
_LIVE_SQL: Final = ", ".join(f"'{status.value}'" for status in sorted(LIVE))  # as `rows.LIVE_SQL`
_NO_LIVE_TASK: Final = (
    f"NOT EXISTS (SELECT 1 FROM tasks WHERE tasks.principal = grants.principal AND status IN ({_LIVE_SQL}))"
)
DROP_UNLESS_LIVE_SQL: Final = f"DELETE FROM grants WHERE principal = :principal AND {_NO_LIVE_TASK}"
PURGE_SQL: Final = f"DELETE FROM grants WHERE {_NO_LIVE_TASK}"
_NAMES: Final = ("principal", "target", "sealed", "holder", "until_ms", "now_ms")


def pg(sql: str) -> str:
    """`:name` parameters as psycopg's `%(name)s`."""
    for name in _NAMES:
        sql = sql.replace(f":{name}", f"%({name})s")
    return sql


class Statements(Protocol):
    """How a backend runs one statement: its rows (the first column of each), or how many rows it changed."""

    async def rows(self, what: str, sql: str, params: dict[str, Any], *, write: bool) -> list[Any]: ...

    async def changed(self, what: str, sql: str, params: dict[str, Any]) -> int: ...


class GrantsTable:
    """The grants port of one store (`contract.Grants`; see the module doc), on its `Statements`; `pg` rewrites
    the SQL for psycopg. Failures are the store's own errors (StoreError, StoreUnavailableError).

    One row per caller (its keyed principal hash, as tasks keep it) and target holds the exchanged token and its
    refresh token sealed with the deployment key as one value, and the hold of the replica refreshing it. A grant
    lives while a live task of its caller does: the caller's last settlement asks for its erasure, the sweep
    erases the rest. A hold makes one refresh at a time across replicas: taken when free or lapsed, let go by
    the write of the renewed grant."""

    def __init__(self, statements: Statements, rewrite: Callable[[str], str] = lambda sql: sql) -> None:
        self._run = statements
        self._sql = {name: rewrite(sql) for name, sql in _STATEMENTS.items()}

    async def read_grant(self, principal: str, target: str) -> str | None:
        found = await self._run.rows("read_grant", self._sql["read"], _key(principal, target), write=False)
        return str(found[0]) if found else None

    async def lock_grant(self, principal: str, target: str, holder: str, until_ms: int, now_ms: int) -> str | None:
        params = {**_key(principal, target), "holder": holder, "until_ms": until_ms, "now_ms": now_ms}
        found = await self._run.rows("lock_grant", self._sql["hold"], params, write=True)
        return str(found[0]) if found else None

    async def write_grant(self, principal: str, target: str, sealed: str, now_ms: int, holder: str | None) -> bool:
        params = {**_key(principal, target), "sealed": sealed, "now_ms": now_ms}
        if holder is None:
            return await self._run.changed("write_grant", self._sql["put"], params) > 0
        return await self._run.changed("write_grant", self._sql["renewed"], {**params, "holder": holder}) > 0

    async def unlock_grant(self, principal: str, target: str, holder: str) -> None:
        await self._run.changed("unlock_grant", self._sql["unhold"], {**_key(principal, target), "holder": holder})

    async def drop_grant(self, principal: str, target: str) -> None:
        await self._run.changed("drop_grant", self._sql["drop"], _key(principal, target))

    async def drop_grants(self, principal: str) -> int:
        return await self._run.changed("drop_grants", self._sql["drop_unless_live"], {"principal": principal})

    async def purge_grants(self) -> int:
        return await self._run.changed("purge_grants", self._sql["purge"], {})


def _key(principal: str, target: str) -> dict[str, Any]:
    return {"principal": principal, "target": target}


_STATEMENTS: Final = {
    "read": READ_SQL,
    "hold": HOLD_SQL,
    "put": PUT_SQL,
    "renewed": RENEWED_SQL,
    "unhold": UNHOLD_SQL,
    "drop": DROP_SQL,
    "drop_unless_live": DROP_UNLESS_LIVE_SQL,
    "purge": PURGE_SQL,
}
