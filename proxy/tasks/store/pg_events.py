"""The PostgreSQL store's events port: `events.py`'s SQL on the store's pooled connections (`PgConnections`). A
read takes the log's head first, then what lies at or before it: every writer of the log holds the events lock to
its commit, so nothing at or before a visible head can appear later. Claims skip rows another replica has locked,
so replicas claiming at once share the outbox out. Used by `postgres.py` only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from psycopg.rows import DictRow

from proxy.tasks.store import events as sql
from proxy.tasks.store import pg_schema as schema
from proxy.tasks.store.events import Delivery, EventPage, Outbox, StoredEvent, Watch, WebhookSubscription
from proxy.tasks.store.pg_connections import Conn, PgConnections

_T = TypeVar("_T")
_NOTIFY: Final = schema.notify_sql("'events'", "''", "''")
_DUE: Final = sql.DUE_SQL + " FOR UPDATE SKIP LOCKED"
_LOCK_LOG: Final = f"SELECT pg_advisory_xact_lock({schema.LOCK_SPACE}, {schema.EVENTS_LOCK})"


class PgEvents:
    """The events port, on the store's pooled connections."""

    def __init__(self, db: PgConnections) -> None:
        self.db = db

    async def _one(self, what: str, statement: str, params: dict[str, Any], *, write: bool = False) -> DictRow:
        found = await self.db.rows(what, sql.pg(statement), params, write=write)
        return found[0]

    async def _in_transaction(self, what: str, work: Callable[[Conn], Awaitable[_T]]) -> _T:
        async def run(conn: Conn) -> _T:
            async with conn.transaction():
                return await work(conn)

        result: _T = await self.db.run(what, run)
        return result

    async def _wake(self, conn: Conn) -> None:
        await conn.execute(f"SELECT {_NOTIFY}", {"channel": self.db.channel})

    # -- the log ---------------------------------------------------------------------------------------------

    async def configure(self, enabled: bool) -> str:
        await self.db.rows("events configure", sql.pg(sql.CONFIGURE_SQL), {"enabled": enabled})
        return str((await self._one("events settings", sql.SETTINGS_SQL, {}))["epoch"])

    async def head(self) -> int:
        found = await self._one("events head", sql.HEAD_SQL, {})
        return max(int(found["head"]), int(found["trimmed"]))

    async def read(
        self, principal: str, name: str, subject: str | None, after: int, limit: int, floor_ms: int | None = None
    ) -> EventPage:
        async def run(conn: Conn) -> EventPage:
            head_row = await (await conn.execute(sql.pg(sql.HEAD_SQL))).fetchone()
            assert head_row is not None
            read = sql.PageRead.of(head_row, principal, name, subject, after, limit, floor_ms)
            found = [
                sql.stored_event(row)
                for row in await (await conn.execute(sql.pg(read.read_sql), read.params)).fetchall()
            ]
            skipped = read.skipped_sql is not None and (
                await (await conn.execute(sql.pg(read.skipped_sql), read.params)).fetchone() is not None
            )
            return read.page(found, skipped)

        page: EventPage = await self.db.run("events read", run, write=False)
        return page

    # -- subscriptions ---------------------------------------------------------------------------------------

    async def count_subscriptions(self, principal: str) -> int:
        return int((await self._one("events count", sql.COUNT_SUBSCRIPTIONS_SQL, {"principal": principal}))["n"])

    async def subscription(self, subscription_id: str) -> WebhookSubscription | None:
        found = await self.db.rows(
            "events subscription", sql.pg(sql.GET_SUBSCRIPTION_SQL), {"subscription_id": subscription_id}, write=False
        )
        return sql.subscription_of(found[0]) if found else None

    async def put_subscription(self, subscription: WebhookSubscription) -> None:
        await self.db.rows("events subscribe", sql.pg(sql.PUT_SUBSCRIPTION_SQL), sql.subscription_params(subscription))

    async def delete_subscription(self, subscription_id: str, principal: str) -> bool:
        params = {"subscription_id": subscription_id, "principal": principal}

        async def work(conn: Conn) -> bool:
            if (await conn.execute(sql.pg(sql.DELETE_SUBSCRIPTION_SQL), params)).rowcount == 0:
                return False
            await conn.execute(sql.pg(sql.DELETE_DELIVERIES_SQL), params)
            return True

        return await self._in_transaction("events unsubscribe", work)

    async def subscriptions(self, principal: str | None = None, limit: int = 100) -> list[WebhookSubscription]:
        where = "" if principal is None else " WHERE principal = :principal"
        found = await self.db.rows(
            "events subscriptions",
            sql.pg(sql.LIST_SUBSCRIPTIONS_SQL.format(where=where)),
            {"principal": principal, "limit": limit},
            write=False,
        )
        return [sql.subscription_of(row) for row in found]

    async def enqueue(self, subscription_id: str, event: StoredEvent, now_ms: int) -> None:
        params = {**sql.event_params(event), "subscription_id": subscription_id, "now_ms": now_ms}

        async def work(conn: Conn) -> None:
            await conn.execute(sql.pg(sql.ENQUEUE_SQL), params)
            await self._wake(conn)

        await self._in_transaction("events enqueue", work)

    async def replay(self, subscription: WebhookSubscription, after: int, floor_ms: int | None, now_ms: int) -> bool:
        async def work(conn: Conn) -> bool:
            settings = await (await conn.execute(sql.pg(sql.SETTINGS_SQL))).fetchone()
            assert settings is not None
            trimmed = int(settings["trimmed_through"])
            params = sql.replay_params(subscription, after, trimmed, floor_ms, now_ms, head=2**62)
            statement = sql.replay_sql(bool(subscription.subject), floor_ms is not None)
            await conn.execute(sql.pg(statement), params)
            await self._wake(conn)
            skipped = False
            if floor_ms is not None:
                cursor = await conn.execute(sql.pg(sql.skipped_sql(bool(subscription.subject))), params)
                skipped = await cursor.fetchone() is not None
            return after < trimmed or skipped

        return await self._in_transaction("events replay", work)

    async def verified(self, principal: str, url: str, since_ms: int) -> bool:
        params = {"principal": principal, "url": url, "since_ms": since_ms}
        return bool(await self.db.rows("events verified", sql.pg(sql.VERIFIED_SQL), params, write=False))

    async def mark_verified(self, principal: str, url: str, now_ms: int) -> None:
        params = {"principal": principal, "url": url, "now_ms": now_ms}
        await self.db.rows("events verify", sql.pg(sql.MARK_VERIFIED_SQL), params)

    # -- the outbox ------------------------------------------------------------------------------------------

    async def claim(self, owner: str, now_ms: int, claim_ms: int, limit: int) -> list[Delivery]:
        params = {"owner": owner, "now_ms": now_ms, "until_ms": now_ms + claim_ms, "limit": limit}

        async def work(conn: Conn) -> list[Delivery]:
            cursor = await conn.execute(sql.pg(sql.CLAIM_SQL.format(due=_DUE)), params)
            claimed = [int(row["delivery_id"]) for row in await cursor.fetchall()]
            if not claimed:
                return []
            head_row = await (await conn.execute(sql.pg(sql.HEAD_SQL))).fetchone()
            assert head_row is not None
            head = max(int(head_row["head"]), int(head_row["trimmed"]))
            ids = ", ".join(str(delivery_id) for delivery_id in claimed)
            found = await (await conn.execute(sql.pg(sql.CLAIMED_SQL.format(ids=ids)), {"owner": owner})).fetchall()
            return [sql.delivery_of(row, head) for row in found]

        return await self._in_transaction("events claim", work)

    async def delivered(self, delivery: Delivery, owner: str, now_ms: int) -> None:
        async def work(conn: Conn) -> None:
            await conn.execute(sql.pg(sql.FINISH_SQL), {"delivery_id": delivery.delivery_id, "owner": owner})
            params = {"subscription_id": delivery.subscription_id, "now_ms": now_ms}
            await conn.execute(sql.pg(sql.DELIVERED_SUBSCRIPTION_SQL), params)

        await self._in_transaction("events delivered", work)

    async def retry(self, delivery: Delivery, owner: str, next_at_ms: int, error: str, now_ms: int) -> None:
        async def work(conn: Conn) -> None:
            params = {"delivery_id": delivery.delivery_id, "owner": owner, "next_at_ms": next_at_ms}
            await conn.execute(sql.pg(sql.RETRY_SQL), params)
            failed = {"subscription_id": delivery.subscription_id, "error": error, "now_ms": now_ms}
            await conn.execute(sql.pg(sql.FAILED_SUBSCRIPTION_SQL), failed)

        await self._in_transaction("events retry", work)

    async def abandon(self, delivery: Delivery, owner: str, error: str | None, now_ms: int) -> None:
        async def work(conn: Conn) -> None:
            if error is not None:
                failed = {"subscription_id": delivery.subscription_id, "error": error, "now_ms": now_ms}
                await conn.execute(sql.pg(sql.FAILED_SUBSCRIPTION_SQL), failed)
            await conn.execute(sql.pg(sql.FINISH_SQL), {"delivery_id": delivery.delivery_id, "owner": owner})

        await self._in_transaction("events abandon", work)

    async def next_due_ms(self) -> int | None:
        due = (await self._one("events next due", sql.NEXT_DUE_SQL, {}))["due"]
        return None if due is None else int(due)

    async def outbox(self) -> Outbox:
        found = await self._one("events outbox", sql.OUTBOX_SQL, {})
        oldest = found["oldest"]
        return Outbox(int(found["pending"]), None if oldest is None else int(oldest))

    async def watermark(self, subscription_id: str) -> int:
        first = (await self._one("events watermark", sql.WATERMARK_SQL, {"subscription_id": subscription_id}))[
            "first_pending"
        ]
        return await self.head() if first is None else int(first) - 1

    async def housekeep(self, now_ms: int, retention_ms: int, max_events: int, max_delivery_age_ms: int) -> int:
        async def work(conn: Conn) -> int:
            await conn.execute(
                sql.pg(sql.trim_sql("GREATEST")), {"before_ms": now_ms - retention_ms, "keep": max_events}
            )
            await conn.execute(sql.DELETE_TRIMMED_SQL)
            await conn.execute(sql.pg(sql.EXPIRE_SUBSCRIPTIONS_SQL), {"now_ms": now_ms})
            await conn.execute(sql.ORPHAN_DELIVERIES_SQL)
            await conn.execute(sql.pg(sql.TRIM_VERIFICATIONS_SQL), {"before_ms": now_ms - 86_400_000})
            aged = await conn.execute(
                sql.pg(sql.AGED_DELIVERIES_SQL), {"before_ms": now_ms - max_delivery_age_ms, "now_ms": now_ms}
            )
            return int(aged.rowcount)

        return await self._in_transaction("events housekeeping", work)

    # -- the legacy server's changes -------------------------------------------------------------------------

    async def append(self, event: StoredEvent) -> None:
        async def work(conn: Conn) -> None:
            await conn.execute(_LOCK_LOG)  # positions in commit order, as the task trigger does
            await conn.execute(sql.pg(sql.APPEND_SQL), sql.append_params(event))
            await self._wake(conn)

        await self._in_transaction("events append", work)

    async def want(self, watch: Watch) -> None:
        params = {column: getattr(watch, column) for column in sql.WATCH_COLUMNS}
        await self.db.rows("events want", sql.pg(sql.WANT_SQL.format(greatest="GREATEST")), params)

    async def hold_watches(self, owner: str, now_ms: int, hold_ms: int, limit: int) -> list[Watch]:
        params = {"owner": owner, "now_ms": now_ms, "until_ms": now_ms + hold_ms, "limit": limit}
        found = await self.db.rows("events hold", sql.pg(sql.holdable_sql(" FOR UPDATE SKIP LOCKED")), params)
        return [sql.watch_of(row) for row in found]

    async def drop_watches(self, now_ms: int) -> None:
        await self.db.rows("events drop watches", sql.pg(sql.DROP_WATCHES_SQL), {"now_ms": now_ms})
