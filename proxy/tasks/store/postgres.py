"""The PostgreSQL task store: several replicas on one database, each owning the tasks whose calls it runs. On
psycopg 3 (why not asyncpg: below); creations through `pg_create.py`, the rest through the pool of
`pg_connections.py`, most operations one statement with its change notification. Must not import aiohttp."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

from psycopg.rows import DictRow

from proxy.tasks.store import base
from proxy.tasks.store import pg_schema as schema
from proxy.tasks.store.base import (
    EXPIRED,
    PURGED,
    Change,
    Fence,
    FencedError,
    Message,
    StoreHealth,
    TaskQuery,
    Tombstone,
    check_kind,
)
from proxy.tasks.store.grants import GrantsTable
from proxy.tasks.store.grants import pg as pg_grants
from proxy.tasks.store.pg_connections import Conn, PgConnections
from proxy.tasks.store.pg_create import PgCreator
from proxy.tasks.store.pg_feed import PgFeed
from proxy.tasks.store.pg_keys import PgKeys
from proxy.tasks.store.rows import (
    LIVE_SQL,
    MESSAGE_RETENTION_MS,
    STATUS_KEYS,
    LiveWrites,
    decode,
    encode,
    query_sql,
    records_from_rows,
)
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import LIVE, TaskRecord, TaskStatus

# Driver: psycopg 3 (`psycopg[binary,pool]`), not asyncpg. Its pipeline mode sends a batch of creations with its lock,
# checks, eviction and COMMIT in two round trips; `AsyncConnection.notifies()` is a plain async iterator for LISTEN
# (no callbacks on a pooled connection), with notifications received between reads kept; psycopg_pool gives a bounded
# async pool whose connection settings may be a callable (a rotated password file is read again for each new
# connection); it ships type hints (mypy --strict, no stub package) and is the PostgreSQL project's maintained
# adapter, on libpq, so every libpq setting (`PGPASSWORD`, `~/.pgpass`, TLS options in the URL) works as operators
# expect. asyncpg is faster on raw row decoding, which this store barely does (a few rows per call), and needs a
# separate stub package and its own LISTEN callbacks.
#
# Creations go through one thread with its own connection (`pg_create.py`); everything else runs on the loop through
# the pool, mostly one statement (one implicit transaction) per call, with its change notification in the same
# statement; the pool, the connections' settings and every operation's deadline are `pg_connections.py`'s, the
# idempotency keys `pg_keys.py`'s. Depends on psycopg and the store's `base`, `rows`, `pg_connections`, `pg_create`,
# `pg_schema`, `pg_feed`, `pg_keys`; it must not import aiohttp, the runner or the front.

# A renewal that comes more than this share of the lease after any replica's latest one marks the store's return:
# above the renewal period (a third of the lease) of a lone replica, below the shortest outage that can make a
# lease lapse (a replica retries a failed renewal every tenth of the lease, so only an outage of more than half
# of it leaves a lease unrenewed for a whole lease).
RETURN_GAP_SHARE: Final = 0.5
PURGE_CHUNK: Final = 1000  # settled records deleted per transaction (creations wait for the count lock meanwhile)


def _messages(rows: list[DictRow]) -> list[Message]:
    rows = sorted(rows, key=lambda row: int(row["message_id"]))
    return [
        Message(row["message_id"], row["recipient"], row["kind"], row["key"], decode(row["payload"])) for row in rows
    ]


class PgRecords:
    """The records port: a task's record in the shared database; creations through the creator's thread, every
    other write one statement with its change notification."""

    def __init__(self, db: PgConnections, creator: PgCreator) -> None:
        self.db = db
        self.creator = creator
        live = LiveWrites(self.update)  # the writes of a live task, alike on every backend
        self.set_inputs = live.set_inputs
        self.set_status_message = live.set_status_message
        self.claim = live.claim
        self.set_queued = live.set_queued
        self.settle = live.settle

    async def create(self, record: TaskRecord) -> None:
        """Returns once the record is committed, so any replica's `get` finds it. Group commit, as in SQLite."""
        self.db.check_open(f"create {record.task_id}", write=True)
        await self.creator.create(record)

    async def get(self, task_id: str, *, principal: str | None = None) -> TaskRecord | None:
        if principal is None:
            sql, params = "SELECT * FROM tasks WHERE task_id = %s", [task_id]
        else:  # the owner is checked in the database: another caller's row (and its result) is never sent
            sql, params = "SELECT * FROM tasks WHERE task_id = %s AND principal = %s", [task_id, principal]
        rows = await self.db.rows(f"get {task_id}", sql, params, write=False)
        records = records_from_rows(rows)
        return records[0] if records else None

    async def update(
        self, task_id: str, values: Mapping[str, Any], now_ms: int, fence: Fence | None
    ) -> TaskRecord | None:
        """Change a live task and notify the change, in one statement; the record as it is now, or None."""
        assignments = ", ".join([*(f"{name} = %({name})s" for name in values), "updated_at_ms = %(now_ms)s"])
        fenced = schema.FENCE_SQL if fence is not None else ""
        sql = (
            f"WITH changed AS (UPDATE tasks SET {assignments} WHERE task_id = %(task_id)s"
            f" AND status IN ({LIVE_SQL}){fenced} RETURNING *) SELECT changed.*, {schema.NOTIFY_STATUS} FROM changed"
        )
        params = {**values, "now_ms": now_ms, "task_id": task_id, "channel": self.db.channel}
        if fence is not None:
            params.update(fence_owner=fence.owner, fence_epoch=fence.epoch)

        async def run(conn: Conn) -> list[DictRow]:
            rows = await (await conn.execute(sql, params)).fetchall()
            if not rows and fence is not None:
                cursor = await conn.execute("SELECT owner, status FROM tasks WHERE task_id = %s", [task_id])
                row = await cursor.fetchone()
                if row is not None and TaskStatus(row["status"]) in LIVE:
                    raise FencedError(
                        f"task {task_id} is owned by {row['owner']}, not {fence.owner} (epoch {fence.epoch})"
                    )
            return rows

        records = records_from_rows(await self.db.run(f"update {task_id}", run))
        return records[0] if records else None

    async def live(self, owner: str | None = None) -> list[TaskRecord]:
        mine = "" if owner is None else " AND owner = %s"
        sql = f"SELECT * FROM tasks WHERE status IN ({LIVE_SQL}){mine} ORDER BY created_at_ms, task_id"
        return records_from_rows(await self.db.rows("live", sql, None if owner is None else [owner], write=False))

    async def expired_live(self, now_ms: int) -> list[TaskRecord]:
        sql = (
            f"SELECT * FROM tasks WHERE expires_at_ms <= %s AND status IN ({LIVE_SQL}) ORDER BY expires_at_ms, task_id"
        )
        return records_from_rows(await self.db.rows("expired_live", sql, [now_ms], write=False))

    async def settle_expired(self, now_ms: int, *, error: JSON, status_message: str) -> list[TaskRecord]:
        """Live tasks past their TTL settled `failed`; replicas sweeping at once settle disjoint sets (SKIP LOCKED)."""
        params = {
            "now_ms": now_ms,
            "error": encode(error),
            "status_message": status_message,
            "channel": self.db.channel,
        }
        settled: list[TaskRecord] = []
        while True:
            chunk = records_from_rows(await self.db.rows("settle_expired", schema.SETTLE_EXPIRED_SQL, params))
            settled.extend(chunk)
            if len(chunk) < 1000:
                return sorted(settled, key=lambda record: (record.expires_at_ms or 0, record.task_id))

    async def purge_expired(self, now_ms: int, *, tombstones: bool = False) -> int:
        """Settled records past their TTL, in chunks; also stale messages and forgotten tools. One replica at a
        time sweeps (an advisory lock): another one finding it taken returns 0 at once."""
        total = 0
        params = {"now_ms": now_ms, "chunk": PURGE_CHUNK, "reason": EXPIRED}
        sql = schema.bury_sql(schema.EXPIRED_WHERE, tombstones)
        while True:  # each chunk within the deadline

            async def chunk(conn: Conn, first: bool = total == 0) -> int | None:
                async with conn.transaction():
                    cursor = await conn.execute(
                        f"SELECT pg_try_advisory_xact_lock({schema.LOCK_SPACE}, {schema.PURGE_LOCK}) AS got"
                    )
                    if not (await cursor.fetchone() or {}).get("got"):
                        return None
                    await conn.execute(schema.LOCK_COUNT_SQL)
                    purged = (await conn.execute(sql, params)).rowcount
                    if first:
                        await conn.execute(schema.PURGE_MESSAGES_SQL, [MESSAGE_RETENTION_MS / 1000])
                        await conn.execute(schema.TRIM_DURATIONS_SQL, [base.MAX_DURATION_TOOLS])
                return purged

            purged = await self.db.run("purge_expired", chunk)
            if purged is None:
                return total
            total += purged
            if purged < PURGE_CHUNK:
                return total

    async def delete(self, task_id: str, *, tombstone_at_ms: int | None = None) -> bool:
        sql = schema.bury_sql(schema.ONE_WHERE, tombstone_at_ms is not None)
        params = {"task_id": task_id, "reason": EXPIRED, "now_ms": tombstone_at_ms}

        async def run(conn: Conn) -> bool:
            async with conn.transaction():
                await conn.execute(schema.LOCK_COUNT_SQL)
                return (await conn.execute(sql, params)).rowcount > 0

        return await self.db.run(f"delete {task_id}", run)

    async def tombstone(self, task_id: str, principal: str) -> Tombstone | None:
        rows = await self.db.rows(f"tombstone {task_id}", schema.TOMBSTONE_SQL, [task_id, principal], write=False)
        if not rows:
            return None
        row = rows[0]
        return Tombstone(row["task_id"], row["reason"], int(row["gone_at_ms"]), row["expired_at_ms"])

    async def trim_tombstones(self, gone_before_ms: int, keep: int) -> int:
        """Tombstones gone before `gone_before_ms`, then the oldest beyond `keep`, in chunks of PURGE_CHUNK (one
        transaction each, none holding a lock a creation needs)."""

        async def chunk(conn: Conn) -> int:
            async with conn.transaction():
                trimmed = (await conn.execute(schema.TRIM_OLD_TOMBSTONES_SQL, [gone_before_ms, PURGE_CHUNK])).rowcount
                if trimmed < PURGE_CHUNK:
                    count = (await (await conn.execute(schema.COUNT_TOMBSTONES_SQL)).fetchone() or {}).get("n", 0)
                    excess = min(PURGE_CHUNK - trimmed, int(count) - keep)
                    if excess > 0:
                        trimmed += (await conn.execute(schema.TRIM_OLDEST_TOMBSTONES_SQL, [excess])).rowcount
                return trimmed

        total = 0
        while True:
            trimmed = await self.db.run("trim_tombstones", chunk)
            total += trimmed
            if trimmed < PURGE_CHUNK:
                return total


class PgReplicas:
    """The replicas port: leases by the database's clock, take-over of dead replicas' tasks, messages, the
    change feed over LISTEN/NOTIFY."""

    def __init__(self, db: PgConnections, feed: PgFeed) -> None:
        self.db = db
        self.feed = feed

    async def renew_lease(self, replica_id: str, lease_seconds: float) -> Fence:
        """Extend this replica's lease by `lease_seconds` of the database's clock. The epoch stays while the lease
        is held; a lease that lapsed (or was taken over) comes back with a new epoch."""
        params = {"replica": replica_id, "seconds": lease_seconds, "gap": lease_seconds * RETURN_GAP_SHARE}
        rows = await self.db.rows("renew_lease", schema.RENEW_SQL, params)
        return Fence(replica_id, int(rows[0]["epoch"]))

    @property
    def shared(self) -> bool:
        return True

    async def replica_alive(self, replica_id: str) -> bool:
        """Does `replica_id` hold its lease, or may it still renew it (its lease lapsed while the store was away
        and the store came back less than a lease period ago)? By the database's clock."""
        return bool(await self.db.rows("replica_alive", schema.REPLICA_ALIVE_SQL, [replica_id], write=False))

    async def release_lease(self, fence: Fence) -> None:
        """End the lease now (a clean shutdown), so a survivor takes over at its next sweep instead of waiting."""
        await self.db.rows("release_lease", schema.RELEASE_SQL, [fence.owner, fence.epoch])

    async def expired_replicas(self) -> list[str]:
        """Replicas that are gone (their lease ran out and, since the store's latest return, they had a lease
        period to renew it), and owners of live tasks that hold no lease at all."""
        rows = await self.db.rows("expired_replicas", schema.EXPIRED_REPLICAS_SQL, write=False)
        return [row["replica_id"] for row in rows]

    async def take_over(self, dead_replica: str, fence: Fence) -> list[TaskRecord]:
        """The live tasks of `dead_replica` (its lease expired or missing) now owned by `fence.owner`, with their
        pending messages; its lease row goes. Exactly one caller gets them; the others get []. FencedError when
        the caller's own lease does not hold."""

        async def run(conn: Conn) -> list[TaskRecord]:
            async with conn.transaction():
                if await (await conn.execute(schema.LEASE_HELD_SQL, [fence.owner, fence.epoch])).fetchone() is None:
                    raise FencedError(f"{fence.owner} holds no lease of epoch {fence.epoch}: it cannot take over")
                lock = f"SELECT pg_try_advisory_xact_lock({schema.REPLICA_LOCK_SPACE}, hashtext(%s)) AS got"
                if not (await (await conn.execute(lock, [dead_replica])).fetchone() or {}).get("got"):
                    return []  # another survivor is taking it over right now
                row = await (await conn.execute(schema.REPLICA_SPARED_SQL, [dead_replica])).fetchone()
                if row is not None and row["spared"]:
                    return []  # it renewed in time, or may still: the store came back less than a lease ago
                params = {"owner": fence.owner, "dead": dead_replica, "channel": self.db.channel}
                moved = records_from_rows(await (await conn.execute(schema.TAKE_OVER_SQL, params)).fetchall())
                ids = [record.task_id for record in moved]
                await conn.execute(
                    "UPDATE messages SET recipient = %s WHERE recipient = %s AND key = ANY(%s)",
                    [fence.owner, dead_replica, ids],
                )
                await conn.execute("DELETE FROM messages WHERE recipient = %s", [dead_replica])
                await conn.execute("DELETE FROM replicas WHERE replica_id = %s", [dead_replica])
            return moved

        moved = await self.db.run(f"take_over {dead_replica}", run)
        return sorted(moved, key=lambda record: (record.created_at_ms, record.task_id))

    async def notify_owner(self, task_id: str, kind: str, payload: JSON) -> Message | None:
        """A durable message for the owner of a live task, and its notification, in one transaction (None when
        the task is settled or unknown). The owner reads it with `take_messages`."""
        check_kind(kind)
        params = {"kind": kind, "key": task_id, "payload": encode(payload), "channel": self.db.channel}
        messages = _messages(await self.db.rows(f"message {task_id}", schema.NOTIFY_OWNER_SQL, params))
        return messages[0] if messages else None

    async def notify_replica(self, replica_id: str, kind: str, key: str, payload: JSON) -> Message:
        check_kind(kind)
        params = {
            "recipient": replica_id,
            "kind": kind,
            "key": key,
            "payload": encode(payload),
            "channel": self.db.channel,
        }
        return _messages(await self.db.rows(f"message {key}", schema.NOTIFY_REPLICA_SQL, params))[0]

    async def take_messages(self, replica_id: str) -> list[Message]:
        sql = "DELETE FROM messages WHERE recipient = %s RETURNING message_id, recipient, kind, key, payload"
        return _messages(await self.db.rows("take_messages", sql, [replica_id]))

    def changes(self, for_replica: str | None = None) -> contextlib.AbstractAsyncContextManager[AsyncIterator[Change]]:
        """Every replica's changes, from now on (a RESYNC first, and after each reconnection)."""
        self.db.check_open("changes", write=False)
        return self.feed.subscribe(for_replica)

    async def pending_messages(self, replica_id: str) -> bool:
        sql = "SELECT 1 FROM messages WHERE recipient = %s LIMIT 1"
        return bool(await self.db.rows("pending_messages", sql, [replica_id], write=False))


class PgUsage:
    """The usage port: quota windows and the tools' duration estimates, shared by every replica."""

    def __init__(self, db: PgConnections) -> None:
        self.db = db
        self._window_ms: int | None = None  # the latest quota window counted here

    async def observe_duration(self, tool: str, duration_ms: float) -> float:
        params = {"tool": tool, "ms": float(duration_ms), "smoothing": base.DURATION_SMOOTHING}
        rows = await self.db.rows(f"observe {tool}", schema.OBSERVE_SQL, params)
        return float(rows[0]["estimate_ms"])

    async def duration_estimates(self) -> dict[str, float]:
        rows = await self.db.rows("duration_estimates", "SELECT tool, estimate_ms FROM tool_durations", write=False)
        return {row["tool"]: float(row["estimate_ms"]) for row in rows}

    async def count_call(self, key: str, window_start_ms: int) -> int:
        """One more call of `key` in the quota window starting at `window_start_ms`, counted in the database so
        that every replica shares the count; the calls so far. The first count of a new window here also drops
        the windows before it (one statement a minute per replica)."""
        if window_start_ms != self._window_ms:
            self._window_ms = window_start_ms
            await self.db.rows("purge quota windows", schema.PURGE_QUOTA_SQL, [window_start_ms])
        params = {"key": key, "window_start_ms": window_start_ms}
        rows = await self.db.rows(f"count_call {key}", schema.COUNT_CALL_SQL, params)
        return int(rows[0]["calls"])


class PgOperators:
    """The operators' queries; a cancel is an unfenced settlement, whose notification tells the owner."""

    def __init__(self, db: PgConnections, records: PgRecords) -> None:
        self.db = db
        self.records = records

    async def list_tasks(self, query: TaskQuery) -> list[TaskRecord]:
        sql, params = query_sql(query, "%s")
        return records_from_rows(await self.db.rows("list", sql, params, write=False))

    async def cancel_task(self, task_id: str, status_message: str, *, now_ms: int) -> TaskRecord | None:
        """An unfenced settlement, as a client's cancel on another replica: its notification tells the owner."""
        return await self.records.settle(task_id, TaskStatus.CANCELLED, now_ms=now_ms, status_message=status_message)

    async def purge_settled(self, updated_before_ms: int, *, dry_run: bool, tombstone_at_ms: int | None = None) -> int:
        params = {"before_ms": updated_before_ms, "chunk": PURGE_CHUNK, "reason": PURGED, "now_ms": tombstone_at_ms}
        if dry_run:
            return int(
                (await self.db.rows("purge count", schema.COUNT_SETTLED_BEFORE_SQL, params, write=False))[0]["n"]
            )
        sql = schema.bury_sql(schema.SETTLED_BEFORE_WHERE, tombstone_at_ms is not None)
        total = 0

        async def chunk(conn: Conn) -> int:
            async with conn.transaction():
                await conn.execute(schema.LOCK_COUNT_SQL)
                return (await conn.execute(sql, params)).rowcount

        while True:  # each chunk within the deadline
            purged = await self.db.run("purge", chunk)
            total += purged
            if purged < PURGE_CHUNK:
                return total

    async def stats(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUS_KEYS, 0)
        rows = await self.db.rows("stats", schema.STATUS_COUNTS_SQL, write=False)  # kept by triggers: no count
        for row in rows:
            counts[row["status"]] = int(row["n"])
        counts["records"] = sum(counts.values())
        return counts

    async def size_bytes(self) -> int:
        sql = "SELECT pg_total_relation_size('tasks') + pg_total_relation_size('messages') AS size"
        rows = await self.db.rows("size", sql, write=False)
        return int(rows[0]["size"]) if rows else 0


class _PgStatements:
    """The grants port's statements (`grants.Statements`) on the pool, each one statement, one transaction."""

    def __init__(self, db: PgConnections) -> None:
        self.db = db

    async def rows(self, what: str, sql: str, params: dict[str, Any], *, write: bool) -> list[Any]:
        return [next(iter(row.values())) for row in await self.db.rows(what, sql, params, write=write)]

    async def changed(self, what: str, sql: str, params: dict[str, Any]) -> int:
        async def run(conn: Conn) -> int:
            return (await conn.execute(sql, params)).rowcount

        return await self.db.run(what, run)


class PostgresTaskStore:
    """Task records in a PostgreSQL database shared by the replicas, its ports composed over one pool of
    connections (`db`). Open with `await PostgresTaskStore.open(...)`."""

    def __init__(
        self,
        url: str,
        *,
        max_records: int,
        password_file: str | None,
        pool_size: int,
        connect_timeout_seconds: float,
        timeout_seconds: float,
        read_only: bool,
        migrate: bool = True,
    ) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        self.db = db = PgConnections(
            url,
            password_file=password_file,
            pool_size=pool_size,
            connect_timeout_seconds=connect_timeout_seconds,
            timeout_seconds=timeout_seconds,
            read_only=read_only,
            migrate=migrate,
        )
        self._creator = PgCreator(
            url,
            lambda: db.connect_kwargs(application="mcp-tasks-proxy-creator"),
            max_records,
            timeout_seconds,
            db.health,
        )
        self._feed = PgFeed(db)
        self.records = PgRecords(db, self._creator)
        self.replicas = PgReplicas(db, self._feed)
        self.keys = PgKeys(db)
        self.usage = PgUsage(db)
        self.operators = PgOperators(db, self.records)
        self.grants = GrantsTable(_PgStatements(db), pg_grants)

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        max_records: int,
        password_file: str | None = None,
        pool_size: int = 10,
        connect_timeout_seconds: float = 5.0,
        timeout_seconds: float = 5.0,
        read_only: bool = False,
        migrate: bool = True,
    ) -> PostgresTaskStore:
        """Connect, migrate the schema (unless read-only, or `migrate` is False: an operator's CLI leaves the
        schema to the proxies), open the pool; StoreError if the database is unusable."""
        store = cls(
            url,
            max_records=max_records,
            password_file=password_file,
            pool_size=pool_size,
            connect_timeout_seconds=connect_timeout_seconds,
            timeout_seconds=timeout_seconds,
            read_only=read_only,
            migrate=migrate,
        )
        try:
            await store.db.open()
        except BaseException:
            await store._shutdown()
            raise
        return store

    @property
    def health(self) -> StoreHealth:
        return self.db.health

    async def check_writable(self, now_ms: int) -> None:
        """Commit one tiny write (readiness): StoreUnavailableError when the database does not take writes now
        (down, frozen, a standby)."""
        await self.db.rows("check_writable", schema.HEALTH_SQL, [now_ms])

    async def close(self) -> None:
        """Close the pool, the creator's connection and every change-feed listener."""
        if self.db.closed:
            return
        await self._shutdown()

    async def _shutdown(self) -> None:
        await self._feed.close()
        await self.db.close()
        await self._creator.close()
