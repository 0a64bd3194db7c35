"""The SQLite store's events port: `events.py`'s SQL on the file's reader and writer threads (`SqliteDb`), and a
wake-up on the in-process feed when something new waits. The triggers of `sqlite_schema.py` write a task's event
and its deliveries in the transaction that changes the task; `configure` creates them, or drops them when events
are off. Used by `sqlite.py` only."""

from __future__ import annotations

from typing import Any

from proxy.tasks.store import events as sql
from proxy.tasks.store import sqlite_schema as schema
from proxy.tasks.store.base import EVENTS, Change
from proxy.tasks.store.events import Delivery, EventPage, Outbox, StoredEvent, Watch, WebhookSubscription
from proxy.tasks.store.feed import LocalFeed
from proxy.tasks.store.sqlite_threads import SqliteDb
from proxy.tasks.store.sqlite_writer import SqliteWriter, rows


class SqliteEvents:
    """The events port, every write through the writer thread."""

    def __init__(self, db: SqliteDb, writer: SqliteWriter, feed: LocalFeed) -> None:
        self.db = db
        self.writer = writer
        self.feed = feed

    # -- plumbing --------------------------------------------------------------------------------------------

    async def _select(self, what: str, statement: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return await self.db.read(what, lambda: rows(self.db.reader_conn().execute(statement, params)))

    async def _change(self, what: str, *statements: tuple[str, dict[str, Any]]) -> int:
        """The statements in one transaction on the writer thread; the rows the last one changed."""

        def run() -> int:
            db = self.writer.db()
            changed = 0
            with db.atomic():
                for statement, params in statements:
                    changed = db.execute(statement, params).rowcount
            return changed

        return await self.db.write(what, run)

    def _wake(self) -> None:
        self.feed.publish(Change(EVENTS))

    # -- the log ---------------------------------------------------------------------------------------------

    async def configure(self, enabled: bool) -> str:
        triggers = schema.EVENT_TRIGGERS if enabled else schema.DROP_EVENT_TRIGGERS
        await self._change(
            "events configure",
            (sql.CONFIGURE_SQL, {"enabled": int(enabled)}),
            *((statement, {}) for statement in triggers),
        )
        found = await self._select("events settings", sql.SETTINGS_SQL, {})
        return str(found[0]["epoch"])

    async def head(self) -> int:
        found = (await self._select("events head", sql.HEAD_SQL, {}))[0]
        return max(int(found["head"]), int(found["trimmed"]))

    async def read(
        self, principal: str, name: str, subject: str | None, after: int, limit: int, floor_ms: int | None = None
    ) -> EventPage:
        def run() -> EventPage:
            conn = self.db.reader_conn()
            read = sql.PageRead.of(
                rows(conn.execute(sql.HEAD_SQL))[0], principal, name, subject, after, limit, floor_ms
            )
            found = [sql.stored_event(row) for row in rows(conn.execute(read.read_sql, read.params))]
            skipped = read.skipped_sql is not None and bool(rows(conn.execute(read.skipped_sql, read.params)))
            return read.page(found, skipped)

        return await self.db.read("events read", run)

    # -- subscriptions ---------------------------------------------------------------------------------------

    async def count_subscriptions(self, principal: str) -> int:
        found = await self._select("events count", sql.COUNT_SUBSCRIPTIONS_SQL, {"principal": principal})
        return int(found[0]["n"])

    async def subscription(self, subscription_id: str) -> WebhookSubscription | None:
        found = await self._select(
            "events subscription", sql.GET_SUBSCRIPTION_SQL, {"subscription_id": subscription_id}
        )
        return sql.subscription_of(found[0]) if found else None

    async def put_subscription(self, subscription: WebhookSubscription) -> None:
        await self._change("events subscribe", (sql.PUT_SUBSCRIPTION_SQL, sql.subscription_params(subscription)))

    async def delete_subscription(self, subscription_id: str, principal: str) -> bool:
        params = {"subscription_id": subscription_id, "principal": principal}

        def run() -> bool:
            db = self.writer.db()
            with db.atomic():
                if db.execute(sql.DELETE_SUBSCRIPTION_SQL, params).rowcount == 0:
                    return False
                db.execute(sql.DELETE_DELIVERIES_SQL, params)
            return True

        return await self.db.write("events unsubscribe", run)

    async def subscriptions(self, principal: str | None = None, limit: int = 100) -> list[WebhookSubscription]:
        where = "" if principal is None else " WHERE principal = :principal"
        found = await self._select(
            "events subscriptions",
            sql.LIST_SUBSCRIPTIONS_SQL.format(where=where),
            {"principal": principal, "limit": limit},
        )
        return [sql.subscription_of(row) for row in found]

    async def enqueue(self, subscription_id: str, event: StoredEvent, now_ms: int) -> None:
        params = {**sql.event_params(event), "subscription_id": subscription_id, "now_ms": now_ms}
        await self._change("events enqueue", (sql.ENQUEUE_SQL, params))
        self._wake()

    async def replay(self, subscription: WebhookSubscription, after: int, floor_ms: int | None, now_ms: int) -> bool:
        head = await self.head()
        found = (await self._select("events settings", sql.SETTINGS_SQL, {}))[0]
        trimmed = int(found["trimmed_through"])
        params = sql.replay_params(subscription, after, trimmed, floor_ms, now_ms, head)
        statement = sql.replay_sql(bool(subscription.subject), floor_ms is not None)
        await self._change("events replay", (statement, params))
        self._wake()
        skipped = floor_ms is not None and bool(
            await self._select("events skipped", sql.skipped_sql(bool(subscription.subject)), params)
        )
        return after < trimmed or skipped

    async def verified(self, principal: str, url: str, since_ms: int) -> bool:
        params = {"principal": principal, "url": url, "since_ms": since_ms}
        return bool(await self._select("events verified", sql.VERIFIED_SQL, params))

    async def mark_verified(self, principal: str, url: str, now_ms: int) -> None:
        await self._change(
            "events verify", (sql.MARK_VERIFIED_SQL, {"principal": principal, "url": url, "now_ms": now_ms})
        )

    # -- the outbox ------------------------------------------------------------------------------------------

    async def claim(self, owner: str, now_ms: int, claim_ms: int, limit: int) -> list[Delivery]:
        def run() -> list[Delivery]:
            db = self.writer.db()
            params = {"owner": owner, "now_ms": now_ms, "until_ms": now_ms + claim_ms, "limit": limit}
            with db.atomic():
                claimed = [row[0] for row in db.execute(sql.CLAIM_SQL.format(due=sql.DUE_SQL), params).fetchall()]
                if not claimed:
                    return []
                head_row = rows(db.execute(sql.HEAD_SQL))[0]
                head = max(int(head_row["head"]), int(head_row["trimmed"]))
                ids = ", ".join(str(int(delivery_id)) for delivery_id in claimed)
                found = rows(db.execute(sql.CLAIMED_SQL.format(ids=ids), {"owner": owner}))
            return [sql.delivery_of(row, head) for row in found]

        return await self.db.write("events claim", run)

    async def delivered(self, delivery: Delivery, owner: str, now_ms: int) -> None:
        await self._change(
            "events delivered",
            (sql.FINISH_SQL, {"delivery_id": delivery.delivery_id, "owner": owner}),
            (sql.DELIVERED_SUBSCRIPTION_SQL, {"subscription_id": delivery.subscription_id, "now_ms": now_ms}),
        )

    async def retry(self, delivery: Delivery, owner: str, next_at_ms: int, error: str, now_ms: int) -> None:
        failed = {"subscription_id": delivery.subscription_id, "error": error, "now_ms": now_ms}
        await self._change(
            "events retry",
            (sql.RETRY_SQL, {"delivery_id": delivery.delivery_id, "owner": owner, "next_at_ms": next_at_ms}),
            (sql.FAILED_SUBSCRIPTION_SQL, failed),
        )

    async def abandon(self, delivery: Delivery, owner: str, error: str | None, now_ms: int) -> None:
        statements: list[tuple[str, dict[str, Any]]] = [
            (sql.FINISH_SQL, {"delivery_id": delivery.delivery_id, "owner": owner})
        ]
        if error is not None:
            failed = {"subscription_id": delivery.subscription_id, "error": error, "now_ms": now_ms}
            statements.insert(0, (sql.FAILED_SUBSCRIPTION_SQL, failed))
        await self._change("events abandon", *statements)

    async def next_due_ms(self) -> int | None:
        found = await self._select("events next due", sql.NEXT_DUE_SQL, {})
        due = found[0]["due"]
        return None if due is None else int(due)

    async def outbox(self) -> Outbox:
        found = (await self._select("events outbox", sql.OUTBOX_SQL, {}))[0]
        oldest = found["oldest"]
        return Outbox(int(found["pending"]), None if oldest is None else int(oldest))

    async def watermark(self, subscription_id: str) -> int:
        found = await self._select("events watermark", sql.WATERMARK_SQL, {"subscription_id": subscription_id})
        first = found[0]["first_pending"]
        return await self.head() if first is None else int(first) - 1

    async def housekeep(self, now_ms: int, retention_ms: int, max_events: int, max_delivery_age_ms: int) -> int:
        def run() -> int:
            db = self.writer.db()
            with db.atomic():
                db.execute(sql.trim_sql("MAX"), {"before_ms": now_ms - retention_ms, "keep": max_events})
                db.execute(sql.DELETE_TRIMMED_SQL)
                db.execute(sql.EXPIRE_SUBSCRIPTIONS_SQL, {"now_ms": now_ms})
                db.execute(sql.ORPHAN_DELIVERIES_SQL)
                db.execute(sql.TRIM_VERIFICATIONS_SQL, {"before_ms": now_ms - 86_400_000})
                aged = db.execute(
                    sql.AGED_DELIVERIES_SQL, {"before_ms": now_ms - max_delivery_age_ms, "now_ms": now_ms}
                ).rowcount
            return int(aged)

        return await self.db.write("events housekeeping", run)

    # -- the legacy server's changes -------------------------------------------------------------------------

    async def append(self, event: StoredEvent) -> None:
        await self._change("events append", (sql.APPEND_SQL, sql.append_params(event)))
        self._wake()

    async def want(self, watch: Watch) -> None:
        params = {column: getattr(watch, column) for column in sql.WATCH_COLUMNS}
        await self._change("events want", (sql.WANT_SQL.format(greatest="MAX"), params))

    async def hold_watches(self, owner: str, now_ms: int, hold_ms: int, limit: int) -> list[Watch]:
        def run() -> list[Watch]:
            db = self.writer.db()
            params = {"owner": owner, "now_ms": now_ms, "until_ms": now_ms + hold_ms, "limit": limit}
            with db.atomic():
                found = rows(db.execute(sql.holdable_sql(), params))
            return [sql.watch_of(row) for row in found]

        return await self.db.write("events hold", run)

    async def drop_watches(self, now_ms: int) -> None:
        await self._change("events drop watches", (sql.DROP_WATCHES_SQL, {"now_ms": now_ms}))
