"""The PostgreSQL store's idempotency keys: `keys.py`'s SQL in psycopg's placeholders on a pooled connection (of
two replicas claiming one key at once exactly one wins). A claim's COMMIT is sent only once its INSERT came back
within the deadline, so a claim the request gave up on is rolled back, never committed with nobody behind it.
Depends on psycopg and the store's `keys`, `pg_connections`; no aiohttp, runner or front."""

from __future__ import annotations

from typing import Final, TypeVar

from proxy.tasks.store import keys
from proxy.tasks.store.pg_connections import Conn, PgConnections

_T = TypeVar("_T")
_CLAIM_SQL: Final = keys.pg(keys.CLAIM_SQL)
_GET_SQL: Final = keys.pg(keys.GET_SQL)
_SETTLE_SQL: Final = keys.pg(keys.SETTLE_SQL)
_RELEASE_SQL: Final = keys.pg(keys.RELEASE_SQL)
_PURGE_SQL: Final = keys.pg(keys.PURGE_SQL)


class PgKeys:
    """The idempotency keys port of `PostgresTaskStore`, on the runs of its connections (`PgConnections`)."""

    def __init__(self, db: PgConnections) -> None:
        self.db = db

    async def claim_key(self, record: keys.KeyRecord) -> keys.KeyRecord | None:
        """One INSERT ... ON CONFLICT in a transaction (BEGIN, the INSERT and a read of the holder in one round
        trip, the COMMIT in a second): of two replicas claiming at once, exactly one wins (the other waits for its
        commit and reads the winner's record). The server ends the transaction of a client that vanished once it
        has been idle in it past the deadline, so a lost claimer never holds a key's row lock for long."""
        params = keys.key_params(record)
        idle = f"SET LOCAL idle_in_transaction_session_timeout = {max(1, round(self.db.timeout_seconds * 1000))}"

        async def run(conn: Conn) -> keys.KeyRecord | bool | None:
            async with conn.pipeline(), conn.transaction():
                await conn.execute(idle)
                claimed = await conn.execute(_CLAIM_SQL, params)
                holder = await conn.execute(_GET_SQL, {"scope": record.scope, "key": record.key})
                if await claimed.fetchall():
                    return None
                found = await holder.fetchall()
                return keys.key_from_row(found[0]) if found else False

        while True:
            holder = await self.db.run("claim_key", run)
            if holder is not False:
                assert not isinstance(holder, bool)
                return holder  # else swept between the two statements: claim again

    async def get_key(self, scope: str, key: str) -> keys.KeyRecord | None:
        found = await self.db.rows("get_key", _GET_SQL, {"scope": scope, "key": key}, write=False)
        return keys.key_from_row(found[0]) if found else None

    async def settle_key(self, record: keys.KeyRecord, outcome: str) -> bool:
        params = {**keys.key_params(record), "outcome": outcome}

        async def run(conn: Conn) -> bool:
            return (await conn.execute(_SETTLE_SQL, params)).rowcount > 0

        return await self.db.run("settle_key", run)

    async def release_key(self, record: keys.KeyRecord) -> None:
        await self.db.rows("release_key", _RELEASE_SQL, keys.key_params(record))

    async def purge_keys(self, now_ms: int) -> int:
        async def run(conn: Conn) -> int:
            return (await conn.execute(_PURGE_SQL, {"now_ms": now_ms})).rowcount

        return await self.db.run("purge_keys", run)
