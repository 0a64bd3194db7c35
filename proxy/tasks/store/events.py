"""The Events extension's store values (log entries and pages, webhook subscriptions, deliveries, watches) and
the SQL both backends run for the events port (`contract.Events`); a task's event is logged by a trigger of each
backend's migrations in the transaction that changes its status. Depends on the wire only."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from proxy.wire.jsonrpc import JSON

TASK_STATUS: Final = "task.status"  # the event name of a task's status (the only one the database writes)
PREFERRED_WATCHES: Final = 256  # upstream watches one replica holds at most
EVENT_STATUSES_SQL: Final = "'input_required', 'cancelled', 'completed', 'failed'"  # statuses a task's event has


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One event of the log: `seq` orders the log (a cursor is a position in it); `subject` is what the event is
    about (a task id), matched by a subscription's arguments; `data` as the log keeps it (`proxy.events` renders
    the payload)."""

    seq: int
    event_id: str
    name: str
    principal: str
    subject: str
    data: JSON
    occurred_at_ms: int


@dataclass(frozen=True, slots=True)
class EventPage:
    """What one read of the log found for one subscription: its events in order, the position it checked up to
    (the next read starts after it), whether events were skipped (a cursor behind what the log keeps, or before
    the age floor), and whether more are waiting beyond the page."""

    events: list[StoredEvent]
    position: int
    truncated: bool
    has_more: bool


@dataclass(frozen=True, slots=True)
class WebhookSubscription:
    """A webhook subscription as stored. `secret` and `previous_secret` are sealed with the deployment key;
    `secret_digest` tells a refresh whether the secret changed (the sealed text differs at every sealing)."""

    subscription_id: str
    principal: str
    name: str
    subject: str  # "" for every event of the principal of that name
    arguments: str  # canonical JSON
    url: str
    secret: str
    secret_digest: str
    previous_secret: str | None
    previous_until_ms: int | None
    created_at_ms: int
    refreshed_at_ms: int
    expires_at_ms: int | None
    last_delivery_at_ms: int | None = None
    last_error: str | None = None
    failed_since_ms: int | None = None
    pending: int = 0  # deliveries waiting (listings only)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One claimed delivery: the event (a copy: the outbox does not depend on the log's retention), where it goes
    and with which secrets, and the subscription's watermark (every event of it at or before that position was
    acknowledged or abandoned: the `cursor` of the webhook body)."""

    delivery_id: int
    subscription_id: str
    event_id: str
    seq: int | None
    name: str
    data: JSON
    occurred_at_ms: int
    created_at_ms: int
    attempts: int  # this one included
    url: str
    secret: str
    previous_secret: str | None
    previous_until_ms: int | None
    watermark: int


@dataclass(frozen=True, slots=True)
class Watch:
    """Interest in the legacy server's changes of one kind (`name`, about `subject`: a resource's URI, or "")
    for one principal: whoever wants it keeps `wanted_until_ms` ahead; one replica at a time holds it (the
    upstream subscription and the stream that carries the notifications), until `held_until_ms`. `credential`
    is the principal's credential, sealed with the deployment key (the upstream session is opened with it)."""

    principal: str
    name: str
    subject: str
    credential: str | None
    wanted_until_ms: int
    holder: str | None = None
    held_until_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Outbox:
    pending: int
    oldest_created_at_ms: int | None


# --- the SQL both backends run (`:name` parameters; `pg()` turns them into psycopg's) ------------------------

SETTINGS_SQL: Final = "SELECT enabled, epoch, trimmed_through FROM event_settings WHERE id = 1"
CONFIGURE_SQL: Final = "UPDATE event_settings SET enabled = :enabled WHERE id = 1"
HEAD_SQL: Final = (
    "SELECT COALESCE(MAX(seq), 0) AS head, (SELECT trimmed_through FROM event_settings WHERE id = 1) AS trimmed"
    " FROM event_log"
)
_EVENT_COLUMNS: Final = "seq, event_id, name, principal, subject, data, occurred_at_ms"
_MATCH: Final = "seq > :after AND seq <= :head AND principal = :principal AND name = :name"


def read_sql(subject: bool, floor: bool) -> str:
    return (
        f"SELECT {_EVENT_COLUMNS} FROM event_log WHERE {_MATCH}{' AND subject = :subject' if subject else ''}"
        f"{' AND occurred_at_ms >= :floor_ms' if floor else ''} ORDER BY seq LIMIT :limit"
    )


def skipped_sql(subject: bool) -> str:
    """Is a matching event older than the floor there (skipped: `truncated`)?"""
    where = f"{_MATCH}{' AND subject = :subject' if subject else ''} AND occurred_at_ms < :floor_ms"
    return f"SELECT 1 AS skipped FROM event_log WHERE {where} LIMIT 1"


def replay_params(
    subscription: WebhookSubscription, after: int, trimmed: int, floor_ms: int | None, now_ms: int, head: int
) -> dict[str, Any]:
    """The parameters of `replay_sql` (and `skipped_sql`) for a subscription created with a cursor: its events
    after `after`, or after what the log trimmed when that is later, up to `head`."""
    return {
        "subscription_id": subscription.subscription_id,
        "after": max(after, trimmed),
        "principal": subscription.principal,
        "name": subscription.name,
        "subject": subscription.subject or None,
        "floor_ms": floor_ms,
        "now_ms": now_ms,
        "head": head,
    }


@dataclass(frozen=True, slots=True)
class PageRead:
    """One read of the log as both backends run it, from the head row (`HEAD_SQL`) read in the same snapshot:
    the statements and their parameters, then the page built from what they found."""

    params: dict[str, Any]
    head: int
    limit: int
    behind: bool  # the cursor is older than what the log keeps (its events were trimmed)

    @classmethod
    def of(
        cls,
        head_row: Mapping[str, Any],
        principal: str,
        name: str,
        subject: str | None,
        after: int,
        limit: int,
        floor_ms: int | None,
    ) -> PageRead:
        trimmed = int(head_row["trimmed"])
        head = max(int(head_row["head"]), trimmed)
        params = {
            "after": max(after, trimmed),
            "head": head,
            "principal": principal,
            "name": name,
            "subject": subject,
            "floor_ms": floor_ms,
            "limit": limit + 1,  # one more than the page: whether more are waiting
        }
        return cls(params, head, limit, after < trimmed)

    @property
    def read_sql(self) -> str:
        return read_sql(self.params["subject"] is not None, self.params["floor_ms"] is not None)

    @property
    def skipped_sql(self) -> str | None:
        """The check for events older than the floor, when there is a floor."""
        return None if self.params["floor_ms"] is None else skipped_sql(self.params["subject"] is not None)

    def page(self, found: list[StoredEvent], skipped: bool) -> EventPage:
        """The page of what `read_sql` found (`skipped`: what `skipped_sql` found)."""
        has_more = len(found) > self.limit
        found = found[: self.limit]
        return EventPage(found, found[-1].seq if has_more else self.head, self.behind or skipped, has_more)


COUNT_SUBSCRIPTIONS_SQL: Final = "SELECT COUNT(*) AS n FROM event_subscriptions WHERE principal = :principal"
SUBSCRIPTION_COLUMNS: Final = (
    "subscription_id",
    "principal",
    "name",
    "subject",
    "arguments",
    "url",
    "secret",
    "secret_digest",
    "previous_secret",
    "previous_until_ms",
    "created_at_ms",
    "refreshed_at_ms",
    "expires_at_ms",
)
_MUTABLE: Final = (
    "secret",
    "secret_digest",
    "previous_secret",
    "previous_until_ms",
    "refreshed_at_ms",
    "expires_at_ms",
)
GET_SUBSCRIPTION_SQL: Final = "SELECT * FROM event_subscriptions WHERE subscription_id = :subscription_id"
PUT_SUBSCRIPTION_SQL: Final = (
    f"INSERT INTO event_subscriptions ({', '.join(SUBSCRIPTION_COLUMNS)}) VALUES"
    f" ({', '.join(':' + column for column in SUBSCRIPTION_COLUMNS)}) ON CONFLICT (subscription_id) DO UPDATE SET"
    f" {', '.join(f'{column} = excluded.{column}' for column in _MUTABLE)}"
)
DELETE_SUBSCRIPTION_SQL: Final = (
    "DELETE FROM event_subscriptions WHERE subscription_id = :subscription_id AND principal = :principal"
)
DELETE_DELIVERIES_SQL: Final = "DELETE FROM event_deliveries WHERE subscription_id = :subscription_id"
LIST_SUBSCRIPTIONS_SQL: Final = (
    "SELECT s.*, (SELECT COUNT(*) FROM event_deliveries d WHERE d.subscription_id = s.subscription_id) AS pending"
    " FROM event_subscriptions s{where} ORDER BY created_at_ms DESC, subscription_id LIMIT :limit"
)
_DELIVERY_COLUMNS: Final = "subscription_id, event_id, seq, name, data, occurred_at_ms, created_at_ms, next_at_ms"
ENQUEUE_SQL: Final = (
    f"INSERT INTO event_deliveries ({_DELIVERY_COLUMNS}) VALUES (:subscription_id, :event_id, :seq, :name, :data,"
    " :occurred_at_ms, :now_ms, 0) ON CONFLICT (subscription_id, event_id) DO NOTHING"
)


def replay_sql(subject: bool, floor: bool) -> str:
    return (
        f"INSERT INTO event_deliveries ({_DELIVERY_COLUMNS}) SELECT :subscription_id, event_id, seq, name, data,"
        f" occurred_at_ms, :now_ms, 0 FROM event_log WHERE seq > :after AND principal = :principal AND name = :name"
        f"{' AND subject = :subject' if subject else ''}{' AND occurred_at_ms >= :floor_ms' if floor else ''}"
        " ON CONFLICT (subscription_id, event_id) DO NOTHING"
    )


VERIFIED_SQL: Final = (
    "SELECT 1 AS verified FROM event_verifications WHERE principal = :principal AND url = :url"
    " AND verified_at_ms >= :since_ms"
)
MARK_VERIFIED_SQL: Final = (
    "INSERT INTO event_verifications (principal, url, verified_at_ms) VALUES (:principal, :url, :now_ms)"
    " ON CONFLICT (principal, url) DO UPDATE SET verified_at_ms = excluded.verified_at_ms"
)
DUE_SQL: Final = (
    "SELECT delivery_id FROM event_deliveries WHERE next_at_ms <= :now_ms AND (claimed_until_ms IS NULL OR"
    " claimed_until_ms <= :now_ms) ORDER BY next_at_ms, delivery_id LIMIT :limit"
)
CLAIM_SQL: Final = (
    "UPDATE event_deliveries SET claimed_by = :owner, claimed_until_ms = :until_ms, attempts = attempts + 1"
    " WHERE delivery_id IN ({due}) RETURNING delivery_id"
)
CLAIMED_SQL: Final = (
    "SELECT d.delivery_id, d.subscription_id, d.event_id, d.seq, d.name, d.data, d.occurred_at_ms,"
    " d.created_at_ms, d.attempts, s.url, s.secret, s.previous_secret, s.previous_until_ms,"
    " (SELECT MIN(p.seq) FROM event_deliveries p WHERE p.subscription_id = d.subscription_id) AS first_pending"
    " FROM event_deliveries d JOIN event_subscriptions s ON s.subscription_id = d.subscription_id"
    " WHERE d.delivery_id IN ({ids}) AND d.claimed_by = :owner ORDER BY d.next_at_ms, d.delivery_id"
)
FINISH_SQL: Final = "DELETE FROM event_deliveries WHERE delivery_id = :delivery_id AND claimed_by = :owner"
RETRY_SQL: Final = (
    "UPDATE event_deliveries SET next_at_ms = :next_at_ms, claimed_by = NULL, claimed_until_ms = NULL"
    " WHERE delivery_id = :delivery_id AND claimed_by = :owner"
)
DELIVERED_SUBSCRIPTION_SQL: Final = (
    "UPDATE event_subscriptions SET last_delivery_at_ms = :now_ms, last_error = NULL, failed_since_ms = NULL"
    " WHERE subscription_id = :subscription_id"
)
FAILED_SUBSCRIPTION_SQL: Final = (
    "UPDATE event_subscriptions SET last_error = :error, failed_since_ms = COALESCE(failed_since_ms, :now_ms)"
    " WHERE subscription_id = :subscription_id"
)
NEXT_DUE_SQL: Final = (
    "SELECT MIN(CASE WHEN claimed_until_ms IS NOT NULL AND claimed_until_ms > next_at_ms THEN claimed_until_ms"
    " ELSE next_at_ms END) AS due FROM event_deliveries"
)
OUTBOX_SQL: Final = "SELECT COUNT(*) AS pending, MIN(created_at_ms) AS oldest FROM event_deliveries"
WATERMARK_SQL: Final = (
    "SELECT (SELECT MIN(seq) FROM event_deliveries WHERE subscription_id = :subscription_id) AS first_pending"
)
EXPIRE_SUBSCRIPTIONS_SQL: Final = (
    "DELETE FROM event_subscriptions WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= :now_ms"
)
ORPHAN_DELIVERIES_SQL: Final = (
    "DELETE FROM event_deliveries WHERE NOT EXISTS (SELECT 1 FROM event_subscriptions s"
    " WHERE s.subscription_id = event_deliveries.subscription_id)"
)
AGED_DELIVERIES_SQL: Final = (
    "DELETE FROM event_deliveries WHERE created_at_ms < :before_ms AND (claimed_until_ms IS NULL OR"
    " claimed_until_ms <= :now_ms)"
)
TRIM_VERIFICATIONS_SQL: Final = "DELETE FROM event_verifications WHERE verified_at_ms < :before_ms"
DELETE_TRIMMED_SQL: Final = (
    "DELETE FROM event_log WHERE seq <= (SELECT trimmed_through FROM event_settings WHERE id = 1)"
)


def holdable_sql(locking: str = "") -> str:
    return HOLD_SQL.format(holdable=_HOLDABLE + locking)


def trim_sql(greatest: str) -> str:
    """Move `trimmed_through` past the events older than `:before_ms` or beyond the newest `:keep`; `greatest` is
    the backend's two-argument maximum (`MAX` on SQLite, `GREATEST` on PostgreSQL)."""
    return (
        f"UPDATE event_settings SET trimmed_through = {greatest}(trimmed_through, COALESCE((SELECT MAX(seq) FROM"
        " event_log WHERE occurred_at_ms < :before_ms OR seq <= (SELECT MAX(seq) FROM event_log) - :keep), 0))"
        " WHERE id = 1"
    )


APPEND_SQL: Final = (
    "INSERT INTO event_log (event_id, name, principal, subject, data, occurred_at_ms) VALUES (:event_id, :name,"
    " :principal, :subject, :data, :occurred_at_ms) ON CONFLICT (event_id) DO NOTHING"
)
WANT_SQL: Final = (
    "INSERT INTO event_watches (principal, name, subject, credential, wanted_until_ms) VALUES (:principal, :name,"
    " :subject, :credential, :wanted_until_ms) ON CONFLICT (principal, name, subject) DO UPDATE SET"
    " credential = excluded.credential, wanted_until_ms = {greatest}(event_watches.wanted_until_ms,"
    " excluded.wanted_until_ms)"
)
_HOLDABLE: Final = (
    "SELECT principal, name, subject FROM event_watches WHERE wanted_until_ms > :now_ms AND (holder = :owner OR"
    " holder IS NULL OR held_until_ms <= :now_ms) ORDER BY principal, name, subject LIMIT :limit"
)
HOLD_SQL: Final = (
    "UPDATE event_watches SET holder = :owner, held_until_ms = :until_ms WHERE (principal, name, subject) IN"
    " ({holdable}) RETURNING *"
)
DROP_WATCHES_SQL: Final = (
    "DELETE FROM event_watches WHERE wanted_until_ms <= :now_ms AND (holder IS NULL OR held_until_ms <= :now_ms)"
)
WATCH_COLUMNS: Final = ("principal", "name", "subject", "credential", "wanted_until_ms", "holder", "held_until_ms")

_PARAMETER: Final = re.compile(r"(?<![:\w]):([a-z_]+)")


def pg(sql: str) -> str:
    """`:name` parameters as psycopg's `%(name)s` (a `::type` cast is left alone)."""
    return _PARAMETER.sub(r"%(\1)s", sql)


def stored_event(row: Mapping[str, Any]) -> StoredEvent:
    data = row["data"]
    return StoredEvent(
        int(row["seq"]),
        row["event_id"],
        row["name"],
        row["principal"],
        row["subject"],
        json.loads(data) if isinstance(data, str) else data,
        int(row["occurred_at_ms"]),
    )


def subscription_of(row: Mapping[str, Any]) -> WebhookSubscription:
    values = {column: row[column] for column in SUBSCRIPTION_COLUMNS}
    extra = {
        key: row[key]
        for key in ("last_delivery_at_ms", "last_error", "failed_since_ms", "pending")
        if key in row and row[key] is not None
    }
    return WebhookSubscription(**values, **extra)


def subscription_params(subscription: WebhookSubscription) -> dict[str, Any]:
    return {column: getattr(subscription, column) for column in SUBSCRIPTION_COLUMNS}


def delivery_of(row: Mapping[str, Any], head: int) -> Delivery:
    data = row["data"]
    first_pending = row["first_pending"]
    return Delivery(
        delivery_id=int(row["delivery_id"]),
        subscription_id=row["subscription_id"],
        event_id=row["event_id"],
        seq=None if row["seq"] is None else int(row["seq"]),
        name=row["name"],
        data=json.loads(data) if isinstance(data, str) else data,
        occurred_at_ms=int(row["occurred_at_ms"]),
        created_at_ms=int(row["created_at_ms"]),
        attempts=int(row["attempts"]),
        url=row["url"],
        secret=row["secret"],
        previous_secret=row["previous_secret"],
        previous_until_ms=row["previous_until_ms"],
        watermark=head if first_pending is None else int(first_pending) - 1,
    )


def event_params(event: StoredEvent) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "seq": event.seq or None,
        "name": event.name,
        "data": json.dumps(event.data, separators=(",", ":")),
        "occurred_at_ms": event.occurred_at_ms,
    }


def watch_of(row: Mapping[str, Any]) -> Watch:
    return Watch(**{column: row[column] for column in WATCH_COLUMNS})


def append_params(event: StoredEvent) -> dict[str, Any]:
    return {
        "event_id": event.event_id,
        "name": event.name,
        "principal": event.principal,
        "subject": event.subject,
        "data": json.dumps(event.data, separators=(",", ":")),
        "occurred_at_ms": event.occurred_at_ms,
    }
