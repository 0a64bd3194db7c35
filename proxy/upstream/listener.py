"""The standalone GET stream of one upstream session: notifications for listen subscribers; requests relayed
to the one open call that can take them, else refused.

A legacy server sends what is not tied to a request (`notifications/*/list_changed`, resource updates, and
server→client requests made without a related request, e.g. the mcp 1.x SDK's `list_roots()`) on the GET
stream. The proxy keeps it open for each stateful upstream session so such requests are never left hanging
and list/resource notifications reach `subscriptions/listen` streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Final

import aiohttp
import structlog
from mcp_types import jsonrpc as codes

from proxy.errors import InvalidRequestError, UpstreamError
from proxy.upstream.call import UpstreamServerRequest
from proxy.upstream.sse import SSEParser
from proxy.wire.jsonrpc import JSON, Notification, Request, classify
from proxy.wire.translate import INPUT_METHODS

if TYPE_CHECKING:
    from proxy.upstream.session import UpstreamSession

log = structlog.get_logger(__name__)

RECONNECT_DELAYS_SECONDS: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
SUBSCRIBER_QUEUE_SIZE: Final = 256  # list/resource notifications are idempotent; a slow reader loses extras


class Subscription:
    """One listen stream's inbox. `None` means: the proxy is shutting down, end the stream gracefully."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[JSON | None] = asyncio.Queue(SUBSCRIBER_QUEUE_SIZE)

    def offer(self, message: JSON | None) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(message)


class UpstreamListener:
    def __init__(self, session: UpstreamSession) -> None:
        self.session = session
        self.subscriptions: set[Subscription] = set()
        self._task: asyncio.Task[None] | None = None
        self._settled = asyncio.Event()

    async def start(self) -> None:
        """(Re)start reading the GET stream of the session's current id, and wait (bounded) until the upstream
        answered the GET: a request it sends there right after initialize must find the stream open."""
        self.stop()
        if self.session.session_id is None:
            return  # a stateless upstream has no standalone stream
        self._settled = asyncio.Event()
        self._task = self.session.client.spawn(self._run(self.session.session_id), "upstream-get-stream")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), self.session.client.config.connect_timeout_seconds)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def subscribe(self) -> Subscription:
        subscription = Subscription()
        self.subscriptions.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self.subscriptions.discard(subscription)

    def end_subscriptions(self) -> None:
        for subscription in self.subscriptions:
            subscription.offer(None)

    async def _run(self, session_id: str) -> None:
        attempt = 0
        last_event_id: str | None = None
        while self.session.session_id == session_id:
            try:
                status, last_event_id = await self._read(last_event_id)
            except (aiohttp.ClientError, TimeoutError, UpstreamError) as exc:
                status = 0
                log.info("upstream_get_stream_lost", error=str(exc))
            finally:
                self._settled.set()
            if status == 404:
                # The session is gone. With listen streams waiting, start a new one now; otherwise the next
                # request does. (Not from this task: initializing restarts the listener, i.e. cancels us.)
                self.session.forget(session_id)
                if self.subscriptions:
                    self.session.client.spawn(self.session.revive(), "upstream-session-revive")
                return
            if status in (405, 409):
                return  # no standalone stream on this server (or someone else holds it): nothing to read
            delay = RECONNECT_DELAYS_SECONDS[min(attempt, len(RECONNECT_DELAYS_SECONDS) - 1)]
            attempt = 0 if status == 200 else attempt + 1
            await asyncio.sleep(delay)

    async def _read(self, last_event_id: str | None) -> tuple[int, str | None]:
        headers = self.session.stream_headers(last_event_id)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.session.client.config.connect_timeout_seconds)
        async with self.session.client.http.get(self.session.client.url, headers=headers, timeout=timeout) as response:
            content_type = response.content_type
            if response.status != 200 or content_type != "text/event-stream":
                return response.status, last_event_id
            self._settled.set()
            parser = SSEParser()
            async for chunk in response.content.iter_any():
                for event in parser.feed(chunk):
                    if event.id is not None:
                        last_event_id = event.id
                    if event.data.strip():
                        await self._dispatch(event.data)
            return 200, last_event_id

    async def _dispatch(self, data: str) -> None:
        try:
            message = classify(json.loads(data))
        except (ValueError, InvalidRequestError):
            log.warning("upstream_get_stream_malformed_message")
            return
        if isinstance(message, Request):
            if message.method == "ping":
                await self.session.respond(message.id, result={})
                return
            asker = self.session.sole_asker() if message.method in INPUT_METHODS else None
            if asker is not None:
                await asker(UpstreamServerRequest(message.id, message.method, message.params))
                return
            # K-20 / C-21: a standalone server→client request has no modern client to go to.
            log.info("upstream_standalone_request_refused", input_method=message.method)
            await self.session.refuse(
                message.id,
                message.method,
                {
                    "code": codes.METHOD_NOT_FOUND,
                    "message": f"{message.method} outside a request cannot be relayed to 2026-07-28 clients",
                },
            )
            return
        if isinstance(message, Notification):
            if message.method == "notifications/tools/list_changed":
                self.session.tools_changed()
            for subscription in self.subscriptions:
                subscription.offer(message.raw)
