"""The Events extension as the front serves it (`events/list`, `poll`, `stream`, `subscribe`, `unsubscribe`) and
what runs beside it while it is on: the delivery worker, the log's housekeeping, one watch of the change feed.
Imports the tasks' facade, the store's events and replicas ports, the model, the webhook client and the
delivery worker; never aiohttp's server side."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Final

import structlog

from proxy.background import Background
from proxy.config.schema import Config, EventsConfig
from proxy.errors import InvalidParamsError
from proxy.events import model
from proxy.events.delivery import Deliveries
from proxy.events.errors import CallbackEndpointError, EventsForbiddenError, EventsNotFoundError, ResourceExhaustedError
from proxy.events.watches import Watches
from proxy.events.webhook import WebhookClient, challenge
from proxy.observe.audit import AuditLog
from proxy.observe.audit import subject as audit_subject
from proxy.observe.metrics import Metrics
from proxy.principals import Principals
from proxy.tasks.runner import Tasks
from proxy.tasks.store import EVENTS, RESYNC, STATUS, Replicas, StoreError, contract
from proxy.tasks.store.events import TASK_STATUS, EventPage, StoredEvent, Watch, WebhookSubscription
from proxy.upstream.pool import SessionPool
from proxy.wire.envelope import Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON, notification_message, result_message
from proxy.wire.tasks import TaskRecord, iso_timestamp

log = structlog.get_logger(__name__)

TASK_NOT_FOUND: Final = "Not found: no task with that id"  # unknown, expired and other callers' ids alike
PULSE_SECONDS: Final = 1.0  # the log's head is looked at this often at least (what the feed did not say)
HOUSEKEEPING_SECONDS: Final = 30.0
OUTBOX_METRICS_SECONDS: Final = 5.0
VERIFIED_FOR_MS: Final = 86_400_000  # a callback verified for a principal stays so this long (then challenged again)
RESOLVE_SECONDS: Final = 5.0
POLL_INTEREST_MS: Final = 300_000  # a poll of the legacy server's changes keeps its watch wanted this long
STREAM_INTEREST_MS: Final = 60_000  # a stream keeps its watch wanted this far ahead, renewed as it runs


class Events:
    """Every request is the caller's own: events are read with the caller's keyed principal in the store's query, and a
    task id that is not the caller's is refused exactly like one that never existed. Built by the lifecycle only
    when `events.enabled`."""

    def __init__(
        self,
        current: Callable[[], Config],
        store: contract.Events,
        feed: Replicas,
        tasks: Tasks,
        principals: Principals,
        *,
        process_id: str,
        clock: Callable[[], int],
        audit: AuditLog | None,
        pool: SessionPool,
        metrics: Metrics | None,
    ) -> None:
        self._current = current
        self.pool = pool
        self.store = store  # the events port
        self.feed = feed  # the replicas port, for its change feed
        self.tasks = tasks
        self.principals = principals
        self.process_id = process_id  # this replica: who claims deliveries and holds watches
        self._clock = clock
        self.audit = audit
        self.metrics = metrics
        self.background = Background("events_background_failed")
        self.client = WebhookClient(
            lambda: self.config.webhooks.allow_private_callbacks, lambda: self.config.webhooks.timeout_seconds
        )
        self.epoch = ""
        self.deliveries: Deliveries | None = None
        self.watches: Watches | None = None
        self.closing = False
        self._changed = asyncio.Event()
        self._streams: Counter[str] = Counter()
        self._head = 0

    @property
    def config(self) -> EventsConfig:
        return self._current().events

    @property
    def open_streams(self) -> int:
        return sum(self._streams.values())

    def clock(self) -> int:
        return int(self._clock())

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Switch the store's event logging on, then the feed watch, the delivery worker and the housekeeping."""
        self.epoch = await self.store.configure(True)
        self._head = await self.store.head()
        self.deliveries = Deliveries(
            self.store,
            self.client,
            self.principals,
            lambda: self.config,
            self.process_id,
            self.epoch,
            self.metrics,
            self.background,
            self.clock,
        )
        self.background.spawn(self._watch_feed(), "events-feed")
        self.background.spawn(self._pulse(), "events-pulse")
        self.background.spawn(self.deliveries.run_forever(), "event-deliveries")
        self.background.spawn(self._housekeep(), "events-housekeeping")
        self.watches = Watches(self.store, self.pool, self.principals, self.process_id, self.clock, self.background)
        self.background.spawn(self.watches.run_forever(), "event-watches")

    def end_streams(self) -> None:
        """Shutdown: every `events/stream` ends with its result; the watches' holders end with their sessions."""
        self.closing = True
        if self.watches is not None:
            self.watches.stopping = True
        self._wake()

    async def close(self) -> None:
        self.end_streams()
        await self.background.close(1.0)
        await self.client.close()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        if self.deliveries is not None:
            self.deliveries.wake()

    async def _watch_feed(self) -> None:
        """Task status changes that carry an event, and the store's own wake-ups, wake streams and the worker."""
        statuses = {status.value for status in model.EVENT_STATUSES}
        while True:
            try:
                async with self.feed.changes() as changes:
                    async for change in changes:
                        if change.kind in (EVENTS, RESYNC) or (
                            change.kind == STATUS and change.status is not None and change.status.value in statuses
                        ):
                            self._wake()
            except StoreError as exc:
                log.warning("events_feed_lost", error=str(exc))
            await asyncio.sleep(PULSE_SECONDS)

    async def _pulse(self) -> None:
        while True:
            await asyncio.sleep(PULSE_SECONDS)
            try:
                head = await self.store.head()
            except StoreError:
                continue
            if head != self._head:
                self._head = head
                self._wake()

    async def _housekeep(self) -> None:
        rounds = 0
        while True:
            try:
                outbox = await self.store.outbox()
                if self.metrics is not None:
                    self.metrics.event_outbox.set(outbox.pending)
                    oldest = outbox.oldest_created_at_ms
                    self.metrics.event_outbox_age.set(0 if oldest is None else max(0, self.clock() - oldest) / 1000)
                if rounds % round(HOUSEKEEPING_SECONDS / OUTBOX_METRICS_SECONDS) == 0:
                    config = self.config
                    aged = await self.store.housekeep(
                        self.clock(),
                        int(config.retention_seconds * 1000),
                        config.max_events,
                        int(config.webhooks.max_delivery_age_seconds * 1000),
                    )
                    if aged and self.metrics is not None:
                        self.metrics.event_deliveries.labels("expired").inc(aged)
            except StoreError as exc:
                log.warning("events_housekeeping_failed", error=str(exc))
            rounds += 1
            await asyncio.sleep(OUTBOX_METRICS_SECONDS)

    # --- discover and list -----------------------------------------------------------------------------------

    def advertise(self, capabilities: JSON) -> None:
        """The extension under `capabilities.extensions` (and the top-level `events` key some clients read, when
        `events.compat.top_level_capability`)."""
        extensions = capabilities.setdefault("extensions", {})
        extensions[model.EXTENSION] = {}
        if self.config.compat.top_level_capability:
            capabilities["events"] = {}

    async def _offered(self, caller: Caller) -> dict[str, model.EventType]:
        """The event types for the legacy server's capabilities (as `server/discover` reads them)."""
        cache_ms = self._current().discovery.cache_ttl_ms
        initialize_result = await self.pool.facts.initialize_result(caller.principal, cache_ms)
        capabilities = initialize_result.get("capabilities")
        return model.catalog(capabilities if isinstance(capabilities, dict) else {})

    async def _subscription(self, request: ModernRequest, caller: Caller, mode: str) -> model.Subscription:
        """What the request subscribes to; a task's status needs no word from the upstream."""
        if request.params.get("name") == TASK_STATUS:
            return model.subscription_of(request.params, mode)
        return model.subscription_of(request.params, mode, await self._offered(caller))

    async def _want(self, subscription: model.Subscription, owner: str, caller: Caller, until_ms: int) -> None:
        """Keep the legacy server's changes of this kind watched for the caller until `until_ms`."""
        if subscription.type.name == TASK_STATUS:
            return
        # What the watch keeps of the caller to act for it upstream: its sealed credential, or its verified owner
        # where the proxy makes upstream credentials itself (`upstream.credentials`: its token will have expired).
        credential = None if caller.principal is None else self.principals.keep(caller.principal)
        watch = Watch(owner, subscription.type.name, subscription.subject or "", credential, until_ms)
        await self.store.want(watch)

    async def list(self, request: ModernRequest, caller: Caller) -> JSON:
        cursor = request.params.get("cursor")
        if cursor not in (None, ""):
            raise InvalidParamsError("Invalid params: events/list has one page; this cursor is not one of it")
        events = [event_type.descriptor() for event_type in (await self._offered(caller)).values()]
        return result_message(request.id, {"resultType": "complete", "events": events})

    # --- poll and stream -------------------------------------------------------------------------------------

    async def _authorized(self, subscription: model.Subscription, owner: str) -> TaskRecord | None:
        """The task the subscription names, when it is the caller's (else NotFound, as for an unknown id)."""
        if subscription.subject is None or subscription.type.name != TASK_STATUS:
            return None
        record = await self.tasks.peek(subscription.subject, owner)
        if record is None:
            raise EventsNotFoundError(TASK_NOT_FOUND)
        return record

    def _cursor(self, position: int) -> str:
        return model.encode_cursor(self.epoch, position)

    async def poll(self, request: ModernRequest, caller: Caller) -> JSON:
        config = self.config
        subscription = await self._subscription(request, caller, model.POLL)
        owner = self.tasks.owner(caller)
        record = await self._authorized(subscription, owner)  # read before the head: its end is at or before it
        await self._want(subscription, owner, caller, self.clock() + max(POLL_INTEREST_MS, 3 * config.poll_interval_ms))
        cursor = model.decode_cursor(request.params.get("cursor"), self.epoch)
        max_age = model.non_negative_int(request.params, "maxAgeMs")
        wanted = model.non_negative_int(request.params, "maxEvents")
        limit = max(1, min(wanted or config.max_poll_events, config.max_poll_events))
        result: JSON = {"resultType": "complete", "nextPollMs": config.poll_interval_ms}
        if cursor is None or cursor < 0:
            events = [model.task_event(record)] if record is not None and record.status.terminal else []
            head = await self.store.head()
            result.update(
                events=[model.occurrence(event) for event in events],
                cursor=self._cursor(head),
                truncated=cursor is not None,
                hasMore=False,
            )
            return result_message(request.id, result)
        floor = None if max_age is None else self.clock() - max_age
        page = await self.store.read(owner, subscription.type.name, subscription.subject, cursor, limit, floor)
        result.update(
            events=[model.occurrence(event) for event in page.events],
            cursor=self._cursor(page.position),
            truncated=page.truncated,
            hasMore=page.has_more,
        )
        return result_message(request.id, result)

    async def stream(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        config = self.config
        subscription = await self._subscription(request, caller, model.PUSH)
        owner = self.tasks.owner(caller)
        record = await self._authorized(subscription, owner)
        cursor = model.decode_cursor(request.params.get("cursor"), self.epoch)
        max_age = model.non_negative_int(request.params, "maxAgeMs")
        if self._streams[owner] >= config.max_streams_per_principal:
            raise ResourceExhaustedError("streams", config.max_streams_per_principal)
        self._streams[owner] += 1
        try:
            await _Stream(self, request, channel, subscription, owner, caller).run(record, cursor, max_age)
        finally:
            self._streams[owner] -= 1
            if not self._streams[owner]:
                del self._streams[owner]
        tag = {model.SUBSCRIPTION_ID_META: request.id}
        return result_message(request.id, {"resultType": "complete", "_meta": tag})

    # --- webhooks --------------------------------------------------------------------------------------------

    def _webhook_principal(self, caller: Caller, method: str) -> str:
        if caller.principal is None:
            raise EventsForbiddenError(f"Forbidden: {method} needs an authenticated caller")
        return self.tasks.owner(caller)

    async def subscribe(self, request: ModernRequest, caller: Caller) -> JSON:
        webhooks = self.config.webhooks
        subscription = await self._subscription(request, caller, model.WEBHOOK)
        owner = self._webhook_principal(caller, "events/subscribe")
        record = await self._authorized(subscription, owner)
        delivery = request.params.get("delivery")
        if not isinstance(delivery, dict):
            raise InvalidParamsError("Invalid params: delivery must be an object with url and secret")
        if delivery.get("mode", model.WEBHOOK) != model.WEBHOOK:
            raise InvalidParamsError("Invalid params: delivery.mode must be webhook")
        url = delivery.get("url")
        parts = model.check_callback(
            url, allow_insecure=webhooks.allow_insecure_callbacks, allow_private=webhooks.allow_private_callbacks
        )
        assert isinstance(url, str)
        secret = model.check_secret(delivery.get("secret"))
        cursor = model.decode_cursor(request.params.get("cursor"), self.epoch)
        max_age = model.non_negative_int(request.params, "maxAgeMs")
        ttl_ms = self._granted_ttl_ms(request.params)
        subscription_id = model.subscription_id(owner, url, subscription.type.name, subscription.canonical)
        now = self.clock()
        existing = await self.store.subscription(subscription_id)
        live = existing is not None and (existing.expires_at_ms is None or existing.expires_at_ms > now)
        if not live:
            held = await self.store.count_subscriptions(owner) - (existing is not None)
            if held >= webhooks.max_subscriptions_per_principal:
                raise ResourceExhaustedError("subscriptions", webhooks.max_subscriptions_per_principal)
            if (await self.store.outbox()).pending >= webhooks.max_pending_deliveries:
                raise ResourceExhaustedError("pending_deliveries", webhooks.max_pending_deliveries, http_status=503)
        if not webhooks.allow_private_callbacks:
            await _check_host(parts.hostname or "", parts.port)
        if not await self.store.verified(owner, url, now - VERIFIED_FOR_MS):
            failure = await challenge(
                self.client, url, subscription_id, [secret], secrets.token_urlsafe(24), now // 1000
            )
            if failure is not None:
                raise CallbackEndpointError(failure)
            await self.store.mark_verified(owner, url, self.clock())
        digest = hashlib.sha256(secret.encode()).hexdigest()
        previous, previous_until = None, None
        if existing is not None and live and existing.secret_digest != digest:
            previous, previous_until = existing.secret, now + int(webhooks.secret_grace_seconds * 1000)
        elif existing is not None and (existing.previous_until_ms or 0) > now:
            previous, previous_until = existing.previous_secret, existing.previous_until_ms
        stored = WebhookSubscription(
            subscription_id=subscription_id,
            principal=owner,
            name=subscription.type.name,
            subject=subscription.subject or "",
            arguments=subscription.canonical,
            url=url,
            secret=existing.secret
            if existing is not None and existing.secret_digest == digest
            else self.principals.seal_callback_secret(secret),
            secret_digest=digest,
            previous_secret=previous,
            previous_until_ms=previous_until,
            created_at_ms=existing.created_at_ms if existing is not None and live else now,
            refreshed_at_ms=now,
            expires_at_ms=now + ttl_ms,
        )
        await self.store.put_subscription(stored)
        await self._want(subscription, owner, caller, now + ttl_ms)
        truncated = False
        if not live:
            if cursor is not None:
                floor = None if max_age is None else now - max_age
                truncated = await self.store.replay(stored, max(cursor, 0), floor, now) or cursor < 0
            elif record is not None and record.status.terminal:
                await self.store.enqueue(subscription_id, model.task_event(record), now)
        self._audit(caller, owner, "events/subscribe", subscription_id, "created" if not live else "refreshed")
        result: JSON = {
            "resultType": "complete",
            "id": subscription_id,
            "refreshBefore": iso_timestamp(now + ttl_ms),
            "cursor": self._cursor(await self.store.watermark(subscription_id)),
            "truncated": truncated,
        }
        if existing is not None and live:
            status: JSON = {
                "active": True,
                "lastDeliveryAt": None
                if existing.last_delivery_at_ms is None
                else iso_timestamp(existing.last_delivery_at_ms),
                "lastError": existing.last_error,
            }
            if existing.failed_since_ms is not None:
                status["failedSince"] = iso_timestamp(existing.failed_since_ms)
            result["deliveryStatus"] = status
        return result_message(request.id, result)

    def _granted_ttl_ms(self, params: JSON) -> int:
        """The client suggests, the server grants: the default when omitted, clamped into [min, max]; a request
        for no expiry (`ttlMs: null`) gets the longest finite grant."""
        webhooks = self.config.webhooks
        lowest, highest = int(webhooks.min_ttl_seconds * 1000), int(webhooks.max_ttl_seconds * 1000)
        if "ttlMs" not in params:
            return int(webhooks.default_ttl_seconds * 1000)
        suggested = params["ttlMs"]
        if suggested is None:
            return highest
        if not isinstance(suggested, int) or isinstance(suggested, bool) or suggested <= 0:
            raise InvalidParamsError("Invalid params: ttlMs must be a positive integer or null")
        return max(lowest, min(suggested, highest))

    async def unsubscribe(self, request: ModernRequest, caller: Caller) -> JSON:
        subscription = model.subscription_of(request.params, model.WEBHOOK)  # every type: it may have been offered
        owner = self._webhook_principal(caller, "events/unsubscribe")
        delivery = request.params.get("delivery")
        url = delivery.get("url") if isinstance(delivery, dict) else None
        if not isinstance(url, str):
            raise InvalidParamsError("Invalid params: delivery.url must be a string")
        subscription_id = model.subscription_id(owner, url, subscription.type.name, subscription.canonical)
        if not await self.store.delete_subscription(subscription_id, owner):
            raise EventsNotFoundError("Not found: no such subscription", data={"kind": "subscription"})
        self._audit(caller, owner, "events/unsubscribe", subscription_id, "removed")
        return result_message(request.id, {"resultType": "complete"})

    def _audit(self, caller: Caller, owner: str, method: str, subscription_id: str, outcome: str) -> None:
        """One audit line per subscribe and unsubscribe: who, which subscription, what became of it. Never the
        callback URL (it may carry a token) or the secret."""
        log.info("event_subscription", method=method, subscription_id=subscription_id, outcome=outcome)
        audit = self.audit
        if audit is not None:
            audit.write(
                {
                    "method": method,
                    "subject": audit_subject(caller.principal),
                    "principal": owner or None,
                    "subscription_id": subscription_id,
                    "outcome": outcome,
                }
            )


async def _check_host(host: str, port: int | None) -> None:
    """A callback host whose name resolves to an address that is not globally routable is refused at subscribe
    (each delivery checks again, on the connection it makes); a name that does not resolve now is left to the
    challenge to report."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        return  # `check_callback` judged it
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_SECONDS):
            found = await loop.getaddrinfo(host, port or 443)
    except (OSError, TimeoutError):
        return
    for entry in found:
        address = ipaddress.ip_address(entry[4][0])
        if not model.routable(address):
            raise InvalidParamsError("Invalid params: delivery.url names a host that is not globally routable")


class _Stream:
    """One `events/stream`: the confirmation, then each event as it is logged, a heartbeat with the cursor when
    nothing came for a while, and the result when the proxy shuts down."""

    def __init__(
        self,
        events: Events,
        request: ModernRequest,
        channel: Channel,
        subscription: model.Subscription,
        owner: str,
        caller: Caller,
    ) -> None:
        self.caller = caller
        self.wanted_until = 0
        self.events = events
        self.request = request
        self.channel = channel
        self.subscription = subscription
        self.owner = owner
        self.tag = {model.SUBSCRIPTION_ID_META: request.id}

    async def _notify(self, method: str, params: JSON) -> None:
        await self.channel.notify(notification_message(method, {**params, "_meta": self.tag}), required=True)

    async def _read(self, after: int, floor: int | None = None) -> EventPage:
        return await self.events.store.read(
            self.owner, self.subscription.type.name, self.subscription.subject, after, 100, floor
        )

    async def run(self, record: TaskRecord | None, cursor: int | None, max_age: int | None) -> None:
        events = self.events
        changed = events._changed  # taken before each read: a change after it wakes the wait below
        page: EventPage | None = None
        if cursor is None or cursor < 0:
            position = await events.store.head()
            await self._active(position, truncated=cursor is not None)
            if cursor is None and record is not None and record.status.terminal:
                await self._send(model.task_event(record), position)
        else:
            floor = None if max_age is None else events.clock() - max_age
            page = await self._read(cursor, floor)
            position = cursor
            if page.truncated:
                position = page.events[0].seq - 1 if page.events else page.position
            await self._active(position, truncated=page.truncated)
        quiet_since = time.monotonic()
        while not events.closing:
            if self.wanted_until - events.clock() < STREAM_INTEREST_MS // 2:
                self.wanted_until = events.clock() + STREAM_INTEREST_MS
                await events._want(self.subscription, self.owner, self.caller, self.wanted_until)
            if page is None:
                changed = events._changed
                page = await self._read(position)
                if page.truncated:  # fallen behind what the log keeps: a fresh confirmation, then on
                    position = page.events[0].seq - 1 if page.events else page.position
                    await self._active(position, truncated=True)
            for event in page.events:
                await self._send(event, event.seq)
                quiet_since = time.monotonic()
            position, more, page = page.position, page.has_more, None
            if more:
                continue
            remaining = events.config.heartbeat_seconds - (time.monotonic() - quiet_since)
            if remaining <= 0:
                await self._notify("notifications/events/heartbeat", {"cursor": events._cursor(position)})
                quiet_since = time.monotonic()
                continue
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass

    async def _active(self, position: int, *, truncated: bool) -> None:
        cursor = self.events._cursor(position)
        await self._notify("notifications/events/active", {"cursor": cursor, "truncated": truncated})

    async def _send(self, event: StoredEvent, position: int) -> None:
        params = model.occurrence(event, self.events._cursor(position), with_cursor=True)
        await self._notify("notifications/events/event", params)
