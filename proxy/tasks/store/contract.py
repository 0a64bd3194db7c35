"""The store's contract, one port per kind of consumer: a task's records, the replicas' leases and mailbox,
idempotency keys, usage (quotas and durations), operators' queries, the Events extension's log and outbox;
`TaskStore` is a backend composing them. Protocols only; the contract tests run per port. Depends on the
store's value types and the wire."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from proxy.tasks.store.base import Change, Fence, Message, StoreHealth, TaskQuery, Tombstone
from proxy.tasks.store.events import Delivery, EventPage, Outbox, StoredEvent, Watch, WebhookSubscription
from proxy.tasks.store.keys import KeyRecord
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus


class Records(Protocol):
    """A task's records: the record effect's writes, the operations' reads, recovery and the sweep.

    Writes of a live task take an optional `fence`: given, the write happens only while the task is owned by
    `fence.owner` under a lease of that epoch, else FencedError. Without one (a cancel from any replica, the
    TTL sweep) the write is unconditional, and the first settle still wins.
    """

    async def create(self, record: TaskRecord) -> None: ...

    async def get(self, task_id: str, *, principal: str | None = None) -> TaskRecord | None:
        """The record, or None; with `principal`, only when it is that caller's (checked before anything of the
        record, its result included, is read out of the database)."""
        ...

    async def set_inputs(
        self,
        task_id: str,
        input_requests: JSON,
        inputs_issued: int,
        *,
        now_ms: int,
        fence: Fence | None = None,
        upstream_input_ids: JSON | None = None,
    ) -> TaskRecord | None: ...

    async def set_status_message(
        self, task_id: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None: ...

    async def claim(
        self, task_id: str, owner: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None: ...

    async def set_queued(
        self,
        task_id: str,
        queued_at_ms: int | None,
        status_message: str,
        *,
        rerun_principal: str | None,
        now_ms: int,
        fence: Fence | None = None,
    ) -> TaskRecord | None: ...

    async def settle(
        self,
        task_id: str,
        status: TaskStatus,
        *,
        now_ms: int,
        result: JSON | None = None,
        error: JSON | None = None,
        status_message: str | None = None,
        fence: Fence | None = None,
    ) -> TaskRecord | None: ...

    async def live(self, owner: str | None = None) -> list[TaskRecord]: ...

    async def expired_live(self, now_ms: int) -> list[TaskRecord]: ...

    async def settle_expired(self, now_ms: int, *, error: JSON, status_message: str) -> list[TaskRecord]: ...

    async def purge_expired(self, now_ms: int, *, tombstones: bool = False) -> int:
        """Settled records past their TTL (with `tombstones`, each leaves an EXPIRED tombstone)."""
        ...

    async def delete(self, task_id: str, *, tombstone_at_ms: int | None = None) -> bool:
        """The record gone; with `tombstone_at_ms`, an EXPIRED tombstone of that time left in its place."""
        ...

    async def tombstone(self, task_id: str, principal: str) -> Tombstone | None:
        """The tombstone of `principal`'s deleted task `task_id`, or None (never another principal's)."""
        ...

    async def trim_tombstones(self, gone_before_ms: int, keep: int) -> int:
        """Tombstones older than `gone_before_ms` deleted, and the oldest beyond the newest `keep`; how many."""
        ...


class Replicas(Protocol):
    """This process among the replicas of a store: its lease, the take-over of dead replicas' tasks, messages to
    other replicas, and the change feed."""

    @property
    def shared(self) -> bool:
        """Several processes may use this store at once (PostgreSQL): a restart takes over the tasks of dead
        replicas (`expired_replicas`, `take_over`) instead of every live task."""
        ...

    async def renew_lease(self, replica_id: str, lease_seconds: float) -> Fence: ...

    async def replica_alive(self, replica_id: str) -> bool: ...

    async def release_lease(self, fence: Fence) -> None: ...

    async def expired_replicas(self) -> list[str]: ...

    async def take_over(self, dead_replica: str, fence: Fence) -> list[TaskRecord]: ...

    async def notify_owner(self, task_id: str, kind: str, payload: JSON) -> Message | None: ...

    async def notify_replica(self, replica_id: str, kind: str, key: str, payload: JSON) -> Message: ...

    async def take_messages(self, replica_id: str) -> list[Message]: ...

    async def pending_messages(self, replica_id: str) -> bool:
        """Are messages waiting for `replica_id`? (A read; on SQLite the proxy asks this to notice what the CLI,
        another process, posted.)"""
        ...

    def changes(self, for_replica: str | None = None) -> AbstractAsyncContextManager[AsyncIterator[Change]]: ...


class Keys(Protocol):
    """Idempotency keys (draft-ietf-httpapi-idempotency-key-header)."""

    async def claim_key(self, record: KeyRecord) -> KeyRecord | None:
        """Claim `record.key` in `record.scope` for `record.owner`, running: None when this claim won it (at
        once, across replicas: the primary key decides), else the record that holds it. A record past its
        retention counts as free and is replaced."""
        ...

    async def get_key(self, scope: str, key: str) -> KeyRecord | None: ...

    async def settle_key(self, record: KeyRecord, outcome: str) -> bool:
        """Record the outcome of a running key held by `record.owner`; False when it is not (any more)."""
        ...

    async def release_key(self, record: KeyRecord) -> None:
        """Forget a running key held by `record.owner` (its request was refused before the upstream saw it)."""
        ...

    async def purge_keys(self, now_ms: int) -> int:
        """Keys past their retention; how many."""
        ...


class Usage(Protocol):
    """What callers and tools use, counted for every replica: quota windows and the tools' usual durations."""

    async def count_call(self, key: str, window_start_ms: int) -> int: ...

    async def observe_duration(self, tool: str, duration_ms: float) -> float: ...

    async def duration_estimates(self) -> dict[str, float]: ...


class OperatorQueries(Protocol):
    """What operators ask of the records (the CLI, the admin listener, the metrics)."""

    async def list_tasks(self, query: TaskQuery) -> list[TaskRecord]:
        """One page of the records `query` selects, newest first, without their request and result."""
        ...

    async def cancel_task(self, task_id: str, status_message: str, *, now_ms: int) -> TaskRecord | None:
        """An operator's cancel: the live task settled `cancelled`, and its owner told to stop the call (on
        PostgreSQL by the settlement's own notification, on SQLite by a CANCEL message the running proxy
        polls for); the settled record, or None when the task is not live."""
        ...

    async def purge_settled(self, updated_before_ms: int, *, dry_run: bool, tombstone_at_ms: int | None = None) -> int:
        """Settled records last changed before `updated_before_ms`: how many there are, deleted unless
        `dry_run` (with `tombstone_at_ms`, each leaves a PURGED tombstone). Live tasks are never touched."""
        ...

    async def stats(self) -> dict[str, int]: ...

    async def size_bytes(self) -> int: ...


class Events(Protocol):
    """The Events extension's log, webhook subscriptions, delivery outbox and watches of the legacy server's
    changes (values and shared SQL: `events.py`). A task's event is logged by the database in the transaction
    that changes the task's status, whichever port wrote it; this port reads it and everything after."""

    async def configure(self, enabled: bool) -> str:
        """Switch the database's event logging on or off (every replica of one store must agree); the log's
        epoch (a random word fixed at the migration: a cursor of another database is told apart)."""
        ...

    async def head(self) -> int:
        """The position of the latest event logged (never less than what was trimmed)."""
        ...

    async def read(
        self, principal: str, name: str, subject: str | None, after: int, limit: int, floor_ms: int | None = None
    ) -> EventPage:
        """The principal's events of `name` (about `subject`, or all when None) after position `after`, oldest
        first, at most `limit`; none older than `floor_ms`."""
        ...

    async def count_subscriptions(self, principal: str) -> int: ...

    async def subscription(self, subscription_id: str) -> WebhookSubscription | None: ...

    async def put_subscription(self, subscription: WebhookSubscription) -> None:
        """Insert it, or update the mutable fields of the one with its id (secret, TTL)."""
        ...

    async def delete_subscription(self, subscription_id: str, principal: str) -> bool:
        """The principal's subscription gone, with its pending deliveries; whether there was one."""
        ...

    async def subscriptions(self, principal: str | None = None, limit: int = 100) -> list[WebhookSubscription]:
        """Operators' listing, newest first (sealed secrets left out)."""
        ...

    async def enqueue(self, subscription_id: str, event: StoredEvent, now_ms: int) -> None:
        """A delivery of `event` to one subscription (a task that had ended before it subscribed)."""
        ...

    async def replay(self, subscription: WebhookSubscription, after: int, floor_ms: int | None, now_ms: int) -> bool:
        """Deliveries of the logged events after `after` for a subscription created with a cursor; whether the
        log no longer holds everything after it."""
        ...

    async def verified(self, principal: str, url: str, since_ms: int) -> bool: ...

    async def mark_verified(self, principal: str, url: str, now_ms: int) -> None: ...

    async def claim(self, owner: str, now_ms: int, claim_ms: int, limit: int) -> list[Delivery]:
        """Deliveries due now that no replica holds, claimed by `owner` until `now_ms + claim_ms`."""
        ...

    async def delivered(self, delivery: Delivery, owner: str, now_ms: int) -> None: ...

    async def retry(self, delivery: Delivery, owner: str, next_at_ms: int, error: str, now_ms: int) -> None: ...

    async def abandon(self, delivery: Delivery, owner: str, error: str | None, now_ms: int) -> None: ...

    async def next_due_ms(self) -> int | None:
        """When the earliest delivery not claimed now is due (None: none waits)."""
        ...

    async def outbox(self) -> Outbox: ...

    async def watermark(self, subscription_id: str) -> int:
        """Every event of the subscription at or before this position was acknowledged or abandoned."""
        ...

    async def housekeep(self, now_ms: int, retention_ms: int, max_events: int, max_delivery_age_ms: int) -> int:
        """Old events trimmed from the log, lapsed subscriptions and deliveries past their age dropped; how many
        deliveries were dropped for their age."""
        ...

    async def append(self, event: StoredEvent) -> None:
        """Log an event the proxy saw (the legacy server's change), fanned out like a task's."""
        ...

    async def want(self, watch: Watch) -> None:
        """Keep a watch wanted until at least `watch.wanted_until_ms` (with the latest sealed credential)."""
        ...

    async def hold_watches(self, owner: str, now_ms: int, hold_ms: int, limit: int) -> list[Watch]:
        """The wanted watches `owner` holds now: its own renewed, and free ones (never held, or whose holder
        let its hold lapse) taken, until `now_ms + hold_ms`."""
        ...

    async def drop_watches(self, now_ms: int) -> None:
        """Watches nobody wants any more, and whose hold lapsed, forgotten."""
        ...


class Grants(Protocol):
    """Kept grants of `upstream.credentials: exchange` (`grants.py`): one sealed value per caller (its keyed
    principal hash) and target, and the hold of the replica refreshing it. The credential source's port (through
    `tasks/services/grants.py`) and the sweep's."""

    async def read_grant(self, principal: str, target: str) -> str | None: ...

    async def lock_grant(self, principal: str, target: str, holder: str, until_ms: int, now_ms: int) -> str | None:
        """Hold the grant for `holder` until `until_ms` (when free, lapsed or its own): its sealed value; None when
        it does not exist or another hold is in force."""
        ...

    async def write_grant(self, principal: str, target: str, sealed: str, now_ms: int, holder: str | None) -> bool:
        """Keep `sealed` (with `holder`: only while that hold is in force, and it ends)."""
        ...

    async def unlock_grant(self, principal: str, target: str, holder: str) -> None: ...

    async def drop_grant(self, principal: str, target: str) -> None: ...

    async def drop_grants(self, principal: str) -> int:
        """Erase the caller's grants unless a live task of the caller remains; how many."""
        ...

    async def purge_grants(self) -> int:
        """Erase every grant whose caller has no live task; how many."""
        ...


class TaskStore(Protocol):
    """A task store, composed of its ports (`SqliteTaskStore`: one process; `PostgresTaskStore`: several
    replicas on one database); each consumer takes the ports it uses."""

    @property
    def records(self) -> Records: ...

    @property
    def replicas(self) -> Replicas: ...

    @property
    def keys(self) -> Keys: ...

    @property
    def usage(self) -> Usage: ...

    @property
    def operators(self) -> OperatorQueries: ...

    @property
    def events(self) -> Events: ...

    @property
    def grants(self) -> Grants: ...

    @property
    def health(self) -> StoreHealth:
        """Whether the store took its latest operation, and who hears of each failure (metrics)."""
        ...

    async def check_writable(self, now_ms: int) -> None: ...

    async def close(self) -> None: ...
