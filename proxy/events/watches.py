"""The legacy server's changes as events: for each watch someone wants, one replica holds the principal's upstream
session, its `resources/subscribe` and the stream that carries the notifications, and logs each matching one.
Imports the upstream pool, the store's events port, the principals and the model; nothing of the front."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Final

import structlog

from proxy.background import Background
from proxy.errors import ProxyError
from proxy.events import model
from proxy.principals import Identity, Principals, SealError
from proxy.tasks.store import StoreError, contract
from proxy.tasks.store.events import PREFERRED_WATCHES, Watch
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import Subscribers
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

HOLD_SECONDS: Final = 10.0  # a replica's hold on a watch; renewed every ROUND_SECONDS
ROUND_SECONDS: Final = 2.0
RETRY_SECONDS: Final = 2.0  # a holder whose upstream session failed tries again after this
MAX_QUEUED: Final = 256  # notifications a holder may lag behind (more are dropped, logged)

WatchKey = tuple[str, str, str]


class _Inbox:
    """What the session's subscribers hand a holder; `None`: the proxy is shutting down."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[JSON | None] = asyncio.Queue(MAX_QUEUED)

    def offer(self, message: JSON | None) -> None:
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            log.warning("event_watch_fell_behind")


class Watches:
    """Which replica holds a watch (a subscriber of a resource's updates, or of a list's changes) is the store's to
    say: a hold, renewed every few seconds; a replica that dies lets it lapse and another takes it. Holding it is
    what a `subscriptions/listen` stream does with the same session (`listen.py`): an inbox on the session's
    subscribers, a reference-counted upstream subscription."""

    def __init__(
        self,
        store: contract.Events,
        pool: SessionPool,
        principals: Principals,
        owner: str,
        clock: Callable[[], int],
        background: Background,
    ) -> None:
        self.store = store
        self.pool = pool
        self.principals = principals
        self.owner = owner
        self.clock = clock
        self.background = background
        self._holders: dict[WatchKey, asyncio.Task[None]] = {}
        self.stopping = False  # shutdown began: the holders end with their sessions, none starts again

    async def run_forever(self) -> None:
        while True:
            try:
                held = await self.store.hold_watches(
                    self.owner, self.clock(), int(HOLD_SECONDS * 1000), PREFERRED_WATCHES
                )
                await self.store.drop_watches(self.clock())
            except StoreError as exc:  # the holds lapse meanwhile: another replica may take them
                log.warning("event_watches_store_error", error=str(exc))
                held = None
            if held is not None:
                keys = {(watch.principal, watch.name, watch.subject): watch for watch in held}
                for key, task in list(self._holders.items()):
                    if key not in keys or (task.done() and not self.stopping):
                        task.cancel()
                        del self._holders[key]
                for key, watch in keys.items():
                    if key not in self._holders and not self.stopping:
                        self._holders[key] = self.background.spawn(self._hold(watch), "event-watch")
            await asyncio.sleep(ROUND_SECONDS)

    async def _hold(self, watch: Watch) -> None:
        event_type = model.CATALOG.get(watch.name)
        if event_type is None:
            return
        try:
            identity = None if watch.credential is None else self.principals.restore(watch.credential)
        except SealError:
            log.warning("event_watch_credential_unreadable", name=watch.name)
            return
        while True:
            try:
                await self._follow(watch, event_type, identity)
                return  # the proxy is shutting down
            except ProxyError as exc:
                log.warning("event_watch_upstream_failed", name=watch.name, error=exc.message)
            await asyncio.sleep(RETRY_SECONDS)

    async def _follow(self, watch: Watch, event_type: model.EventType, identity: Identity | None) -> None:
        inbox = _Inbox()
        method = model.UPSTREAM_NOTIFICATIONS[watch.name]
        async with self.pool.use(identity) as session:
            await session.ensure_initialized()
            session.subscribers.subscribe(inbox)
            subscribed = False
            try:
                if event_type.subject_argument == "uri":
                    await session.subscribers.subscribe_resource(watch.subject)
                    subscribed = True
                while True:
                    message = await inbox.queue.get()
                    if message is None:
                        return
                    if message.get("method") != method:
                        continue
                    params = message.get("params")
                    if subscribed and not (isinstance(params, dict) and params.get("uri") == watch.subject):
                        continue
                    event_id = f"evt_{secrets.token_urlsafe(18)}"
                    event = model.upstream_event(event_type, watch.principal, watch.subject, event_id, self.clock())
                    try:
                        await self.store.append(event)
                    except StoreError as exc:
                        log.warning("event_watch_append_failed", name=watch.name, error=str(exc))
            finally:
                session.subscribers.unsubscribe(inbox)
                if subscribed:
                    await asyncio.shield(self._unsubscribe(session.subscribers, watch.subject))

    @staticmethod
    async def _unsubscribe(subscribers: Subscribers, uri: str) -> None:
        try:
            await subscribers.unsubscribe_resource(uri)
        except ProxyError as exc:  # best effort: the watch ends either way
            log.info("event_watch_unsubscribe_failed", error=exc.message)
