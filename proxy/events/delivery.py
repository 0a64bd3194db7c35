"""The delivery worker: claims due deliveries from the store's outbox (any replica may; a claim lapses, so a dead
replica's deliveries are claimed again) and POSTs each, signed, to its callback. Imports the store's events
port, the webhook client, the model and the metrics; nothing of the front."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Final

import structlog

from proxy.background import Background
from proxy.config.schema import EventsConfig
from proxy.events import model
from proxy.events.webhook import WebhookClient, signed_headers
from proxy.observe.metrics import Metrics
from proxy.principals import Principals, SealError
from proxy.tasks.store import StoreError, contract
from proxy.tasks.store.events import Delivery, StoredEvent

log = structlog.get_logger(__name__)

IDLE_SECONDS: Final = 1.0  # the outbox is looked at this often at least (what another replica enqueued)


class Deliveries:
    """A delivery keeps its `webhook-id` (the event id) across every try and every replica; each try signs afresh (a new
    `webhook-timestamp`). A 2xx ends it; `410` and `413` end it unretried (the subscription stays); other answers,
    timeouts and refused connections are retried after the configured waits, then given up."""

    def __init__(
        self,
        store: contract.Events,
        client: WebhookClient,
        principals: Principals,
        config: Callable[[], EventsConfig],
        owner: str,
        epoch: str,
        metrics: Metrics | None,
        background: Background,
        clock: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.store = store
        self.client = client
        self.principals = principals
        self.config = config
        self.owner = owner  # this replica's process id: who holds a claim
        self.epoch = epoch
        self.metrics = metrics
        self.background = background
        self.clock = clock
        self._wake = asyncio.Event()
        self._sending: set[int] = set()

    def wake(self) -> None:
        """Something new may wait in the outbox."""
        self._wake.set()

    async def run_forever(self) -> None:
        while True:
            try:
                await self._round()
            except StoreError as exc:  # the store is away: try again at the next round
                log.warning("event_deliveries_store_error", error=str(exc))
            await self._sleep()

    async def _round(self) -> None:
        webhooks = self.config().webhooks
        free = webhooks.max_concurrent_deliveries - len(self._sending)
        if free <= 0:
            return
        claim_ms = int(webhooks.claim_seconds * 1000)
        for delivery in await self.store.claim(self.owner, self.clock(), claim_ms, free):
            self._sending.add(delivery.delivery_id)
            self.background.spawn(self._send(delivery), "event-delivery")

    async def _sleep(self) -> None:
        wait = IDLE_SECONDS
        if len(self._sending) < self.config().webhooks.max_concurrent_deliveries:
            try:
                due = await self.store.next_due_ms()
            except StoreError:
                due = None
            if due is not None:
                wait = min(wait, max(0.0, (due - self.clock()) / 1000))
        self._wake.clear()
        try:
            async with asyncio.timeout(wait):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _send(self, delivery: Delivery) -> None:
        try:
            await self._attempt(delivery)
        except StoreError as exc:  # its claim lapses and a replica sends it again: at least once
            log.warning("event_delivery_store_error", delivery=delivery.delivery_id, error=str(exc))
        finally:
            self._sending.discard(delivery.delivery_id)
            self._wake.set()

    async def _attempt(self, delivery: Delivery) -> None:
        webhooks = self.config().webhooks
        now = self.clock()
        if now - delivery.created_at_ms > webhooks.max_delivery_age_seconds * 1000:
            await self._end(delivery, "expired", None)
            return
        event = StoredEvent(
            delivery.seq or 0,
            delivery.event_id,
            delivery.name,
            "",
            "",
            delivery.data,
            delivery.occurred_at_ms,
        )
        cursor = model.encode_cursor(self.epoch, delivery.watermark)
        body = model.canonical_json(model.occurrence(event, cursor, with_cursor=True))
        if len(body.encode()) > model.MAX_BODY_BYTES:
            await self._end(delivery, "too_large", None)
            return
        try:
            keys = [self.principals.unseal_callback_secret(delivery.secret)]
            if delivery.previous_secret is not None and (delivery.previous_until_ms or 0) > now:
                keys.append(self.principals.unseal_callback_secret(delivery.previous_secret))
        except SealError:
            log.warning("event_delivery_secret_unreadable", subscription_id=delivery.subscription_id)
            await self._end(delivery, "failed", model.CHALLENGE_FAILED)
            return
        try:
            model.check_callback(
                delivery.url,
                allow_insecure=webhooks.allow_insecure_callbacks,
                allow_private=webhooks.allow_private_callbacks,
            )
            headers = signed_headers(keys, delivery.event_id, delivery.subscription_id, now // 1000, body)
        except ValueError:  # InvalidParamsError or FieldError: nothing is written
            await self._end(delivery, "failed", model.CONNECTION_REFUSED)
            return
        answer = await self.client.post(delivery.url, body.encode(), headers)
        log.info(
            "event_delivery",
            subscription_id=delivery.subscription_id,
            event_id=delivery.event_id,
            attempt=delivery.attempts,
            status=answer.status,
            failure=answer.failure,
        )
        if answer.accepted:
            await self.store.delivered(delivery, self.owner, self.clock())
            self._count("delivered", delivery, latency=True)
        elif answer.status == 410:
            await self._end(delivery, "gone", model.HTTP_4XX)
        elif answer.status == 413:
            await self._end(delivery, "too_large", model.HTTP_4XX)
        else:
            failure = answer.failure or model.HTTP_4XX
            delay = model.retry_delay(delivery.attempts, webhooks.retry_seconds)
            if delay is None:
                await self._end(delivery, "failed", failure)
                return
            next_at = self.clock() + int(delay * 1000)
            await self.store.retry(delivery, self.owner, next_at, failure, self.clock())
            if self.metrics is not None:
                self.metrics.event_deliveries.labels("retried").inc()

    async def _end(self, delivery: Delivery, outcome: str, failure: str | None) -> None:
        await self.store.abandon(delivery, self.owner, failure, self.clock())
        self._count(outcome, delivery)

    def _count(self, outcome: str, delivery: Delivery, *, latency: bool = False) -> None:
        if self.metrics is None:
            return
        self.metrics.event_deliveries.labels(outcome).inc()
        self.metrics.event_delivery_attempts.observe(delivery.attempts)
        if latency:
            self.metrics.event_delivery_seconds.observe(max(0.0, (self.clock() - delivery.occurred_at_ms) / 1000))
