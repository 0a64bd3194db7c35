"""Where what an upstream session receives unasked goes: the call it is lent to, its listen streams, or a
refusal. Both kinds of session hold one `Lending` and one `Subscribers`.

- `Lending`: the pool lends a session to one call (`lend`: its sink, and where notifications go besides) and
  takes it back (`take_back`); `keep` marks a session whose upstream work outlives this process. `route`
  sends something the server sent naming no request to its place: a ping is answered; everything goes to the
  lessee while a call holds the session; a question nobody holds is refused at once (an elicitation is
  declined), so the upstream never waits; notifications also reach the listen streams.
- `Subscribers`: the session's listen-stream inboxes, and the upstream resource subscriptions they hold
  (reference-counted, renewed on a new upstream session).

Imports the event types; no session, no kind, no aiohttp.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from proxy.errors import RequestId, UpstreamError
from proxy.wire.jsonrpc import JSON
from proxy.wire.upstream_events import UpstreamEvent, UpstreamNotification, UpstreamServerRequest, refusal

log = structlog.get_logger(__name__)

Sink = Callable[[UpstreamEvent], Awaitable[None]]  # where a lent session's unsolicited traffic goes
Notifications = Callable[[UpstreamNotification], None]
Request = Callable[[str, JSON | None], Awaitable[JSON]]


class Respond(Protocol):
    async def __call__(
        self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None
    ) -> None: ...


class Subscription(Protocol):
    """A listen stream's inbox for a session's notifications. `None` means: the proxy is shutting down, end
    the stream gracefully. `offer` must not block."""

    def offer(self, message: JSON | None) -> None: ...


class Subscribers:
    """The listen streams reading one session, and the resource subscriptions they hold upstream."""

    def __init__(self, request: Request, tools_changed: Callable[[], None]) -> None:
        self._request = request
        self._tools_changed = tools_changed
        self.subscriptions: set[Subscription] = set()
        self._resources: Counter[str] = Counter()

    def deliver(self, notification: UpstreamNotification) -> None:
        """A notification for the listen streams; a tool list change also drops the cached x-mcp-header
        annotations (of every session: they share one catalog)."""
        if notification.method == "notifications/tools/list_changed":
            self._tools_changed()
        for subscription in self.subscriptions:
            subscription.offer(notification.message)

    def subscribe(self, subscription: Subscription) -> None:
        self.subscriptions.add(subscription)

    def unsubscribe(self, subscription: Subscription) -> None:
        self.subscriptions.discard(subscription)

    def end(self) -> None:
        """Shutdown: every listen stream ends with its graceful result."""
        for subscription in self.subscriptions:
            subscription.offer(None)

    async def subscribe_resource(self, uri: str) -> None:
        """Reference-counted upstream `resources/subscribe` on behalf of listen streams."""
        if self._resources[uri] == 0:
            await self._request("resources/subscribe", {"uri": uri})
        self._resources[uri] += 1

    async def unsubscribe_resource(self, uri: str) -> None:
        if self._resources[uri] <= 0:
            return
        self._resources[uri] -= 1
        if self._resources[uri] == 0:
            del self._resources[uri]
            await self._request("resources/unsubscribe", {"uri": uri})

    @property
    def resources(self) -> list[str]:
        return list(self._resources)

    async def resubscribe(self) -> None:
        """A new upstream session knows none of the resource subscriptions listen streams still hold."""
        for uri in list(self._resources):
            try:
                await self._request("resources/subscribe", {"uri": uri})
            except UpstreamError as exc:
                log.warning("upstream_resource_resubscribe_failed", error=exc.message)


class Lending:
    """Who holds a session and where its unsolicited traffic goes (see the module doc)."""

    def __init__(self, subscribers: Subscribers) -> None:
        self._subscribers = subscribers
        self.lessee: Sink | None = None  # the call that holds the session alone, if any
        self._notifications: Notifications = subscribers.deliver
        self.kept = False  # holds upstream work a later proxy process resumes: let go without ending it

    def lend(self, sink: Sink, notifications: Notifications) -> None:
        """The session serves one call alone: what arrives unasked goes to `sink`, notifications also to
        `notifications` (the principal's listen streams, which read its shared session)."""
        self.lessee = sink
        self._notifications = notifications

    def take_back(self) -> None:
        """The call is done with the session: questions naming no request are refused again. Notifications
        still go where the lease sent them, so a list change seen later reaches the principal's streams."""
        self.lessee = None

    @property
    def lent(self) -> bool:
        """A call holds the session alone right now."""
        return self.lessee is not None

    def keep(self) -> None:
        self.kept = True

    async def route(self, event: UpstreamEvent, respond: Respond, refused_because: str) -> None:
        if isinstance(event, UpstreamServerRequest) and event.method == "ping":
            await respond(event.id, result={})
            return
        if self.lessee is not None:
            await self.lessee(event)
        elif isinstance(event, UpstreamServerRequest):
            log.info("upstream_standalone_request_refused", input_method=event.method)
            result, error = refusal(event.method, f"{event.method} {refused_because}")
            await respond(event.id, result=result, error=error)
        if isinstance(event, UpstreamNotification):
            self._notifications(event)
