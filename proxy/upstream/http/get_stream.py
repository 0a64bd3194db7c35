"""The standalone GET stream of one upstream session, read for as long as the session lives (list changes,
resource updates, questions naming no request), reconnected with `Last-Event-ID`; everything goes to the one
callback its session gives it. Knows nothing of the session."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import structlog

from proxy.errors import ProxyError, UpstreamError
from proxy.wire.sse import EventTooLargeError, SSEParser
from proxy.wire.upstream_events import UpstreamEvent, decode

log = structlog.get_logger(__name__)

RECONNECT_DELAYS_SECONDS: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class SessionGone:
    """The upstream answered the GET with 404: it no longer knows the session `session_id`."""

    session_id: str


StreamEvent = UpstreamEvent | SessionGone
OpenStream = Callable[[str | None], Awaitable[aiohttp.ClientResponse]]  # GET with Last-Event-ID (or none)
Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class GetStream:
    def __init__(
        self,
        session_id: str,
        open_stream: OpenStream,
        on_event: Callable[[StreamEvent], Awaitable[None]],
        max_message_bytes: int | None = None,
    ) -> None:
        self.session_id = session_id
        self._max = max_message_bytes
        self._open_stream = open_stream
        self._on_event = on_event
        self._task: asyncio.Task[None] | None = None
        self._answered = asyncio.Event()

    async def start(self, spawn: Spawn, wait_seconds: float) -> None:
        """Start reading, and wait (bounded) until the upstream answered the GET: a request it sends there right
        after initialize must find the stream open."""
        self._task = spawn(self._run(), "upstream-get-stream")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answered.wait(), wait_seconds)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        attempt = 0
        last_event_id: str | None = None
        while True:
            try:
                status, last_event_id = await self._read(last_event_id)
            except EventTooLargeError:
                status = 0  # dropped, never held whole; the stream is read again from the next event on
                log.warning("upstream_get_stream_message_too_large", max_bytes=self._max)
            except (aiohttp.ClientError, TimeoutError, ProxyError) as exc:  # (a credential not made now, too)
                status = 0
                log.info("upstream_get_stream_lost", error=str(exc))
            finally:
                self._answered.set()
            if status == 404:
                await self._on_event(SessionGone(self.session_id))
                return
            if status in (405, 409):
                return  # no standalone stream on this server (or someone else holds it): nothing to read
            delay = RECONNECT_DELAYS_SECONDS[min(attempt, len(RECONNECT_DELAYS_SECONDS) - 1)]
            attempt = 0 if status == 200 else attempt + 1
            await asyncio.sleep(delay)

    async def _read(self, last_event_id: str | None) -> tuple[int, str | None]:
        async with await self._open_stream(last_event_id) as response:
            if response.status != 200 or response.content_type != "text/event-stream":
                return response.status, last_event_id
            self._answered.set()
            parser = SSEParser(self._max)
            async for chunk in response.content.iter_any():
                for sse in parser.feed(chunk):
                    if sse.id is not None:
                        last_event_id = sse.id
                    if not sse.data.strip():
                        continue
                    try:
                        event = decode(sse.data, None, "the GET stream")
                    except UpstreamError:
                        log.warning("upstream_get_stream_malformed_message")
                        continue
                    if event is not None:
                        await self._on_event(event)
            return 200, last_event_id
