"""One in-flight upstream request as an async stream of events (notifications, questions, then the final
result or error); the upstream's `ping` answered, a stream closed early resumed. Depends on its session only
through `StreamTransport`; either HTTP client's failures become UpstreamErrors (`answers.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog

from proxy.errors import RequestId, ResultTooLargeError, UpstreamError
from proxy.upstream.http.answers import CLIENT_FAILURES, Answer, chunks, failure
from proxy.wire.jsonrpc import JSON
from proxy.wire.sse import EventTooLargeError, SSEParser
from proxy.wire.upstream_events import (
    UpstreamErrorResponse,
    UpstreamEvent,
    UpstreamResult,
    UpstreamServerRequest,
    decode,
)

log = structlog.get_logger(__name__)

# How often a closed upstream SSE stream is resumed with GET + Last-Event-ID before the call counts as lost.
MAX_RESUMPTIONS: Final = 5

# After its answer, an SSE stream's end is read in the background (servers close it right after the answer)
# so that its connection goes back to the pool instead of being closed: at most this long and this much.
DRAIN_SECONDS: Final = 5.0
DRAIN_MAX_BYTES: Final = 1 << 16


class StreamTransport(Protocol):
    """What a call needs from the session it runs on."""

    async def respond(
        self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None
    ) -> None: ...

    async def notify(self, method: str, params: JSON | None) -> None: ...

    async def resume(self, last_event_id: str) -> Answer: ...

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Background work the session's kind owns (cancelled when it closes)."""
        ...


@dataclass(eq=False, slots=True)
class HttpRequestStream:
    transport: StreamTransport
    request_id: int
    method: str
    response: Answer  # the one being read (a resumed stream's, after a resumption)
    max_bytes: int | None = None  # the largest answer (or stream message) read; larger ones are refused
    body: bytes | None = None  # the JSON answer, when it was read already (under an HTTP error status)
    finished: bool = field(default=False, init=False)
    _let_go_of: Answer | None = field(default=None, init=False)  # the response given back (or to the drain)
    # the response is the background drain's now: `close` leaves it alone
    _handed_off: bool = field(default=False, init=False)

    async def events(self) -> AsyncIterator[UpstreamEvent]:
        """Everything the upstream says about this request, the final result or error last."""
        try:
            async for event in self._events():
                if isinstance(event, UpstreamResult | UpstreamErrorResponse):
                    self.finished = True
                    self._let_go()  # before the answer is handed on: its reader may never ask for more
                    yield event
                    return
                yield event
        except EventTooLargeError:
            assert self.max_bytes is not None
            await self._abandon("the answer is larger than the proxy's limit")
            raise ResultTooLargeError(self.max_bytes) from None
        except CLIENT_FAILURES as exc:
            raise failure(exc, self.method) from None
        finally:
            self._let_go()
        raise UpstreamError(f"Upstream closed the stream of {self.method} without answering")

    def _let_go(self) -> None:
        """Give the connection back to the pool: at once when the body was read to its end, after a background
        read of the rest when an answered SSE stream is still open, closed otherwise."""
        response = self.response
        if self._let_go_of is response:
            return
        self._let_go_of = response
        if response.received:
            response.release()
        elif self.finished and response.media_type == "text/event-stream":
            self._handed_off = True
            self.transport.spawn(_drain(response), "upstream-stream-drain")
        else:
            response.close()  # an unread body: the connection cannot carry another request

    def close(self) -> None:
        """The call is over: its connection is closed unless it went back to the pool (or is on its way)."""
        if not self._handed_off:
            self.response.close()

    async def _events(self) -> AsyncIterator[UpstreamEvent]:
        response = self.response
        content_type = response.media_type
        if self.body is not None or content_type == "application/json":
            body = self.body if self.body is not None else await read_body(response, self.max_bytes)
            event = decode(body, self.request_id, self.method)  # bytes that are not UTF-8 read as U+FFFD
            if event is not None:
                yield event
            return
        if content_type != "text/event-stream":
            raise UpstreamError(f"Upstream answered {self.method} with unexpected content type {content_type!r}")
        resumptions = 0
        last_event_id: str | None = None  # kept across resumptions: a resumed stream may carry no new id
        retry_ms = 0
        while True:
            parser = SSEParser(self.max_bytes)
            async for chunk in chunks(response):
                for sse in parser.feed(chunk):
                    if sse.id is not None:
                        last_event_id = sse.id
                    if sse.retry_ms is not None:
                        retry_ms = sse.retry_ms
                    if not sse.data.strip():
                        continue
                    event = decode(sse.data, self.request_id, self.method)
                    if event is None:
                        continue
                    if isinstance(event, UpstreamServerRequest) and event.method == "ping":
                        await self.transport.respond(event.id, result={})
                        continue
                    yield event
                    if isinstance(event, UpstreamResult | UpstreamErrorResponse):
                        return
            # A 2025-11-25 server may close the stream early and expect GET + Last-Event-ID.
            if last_event_id is None or resumptions >= MAX_RESUMPTIONS:
                return
            resumptions += 1
            response.release()
            await asyncio.sleep(min(retry_ms, 10_000) / 1000)
            response = self.response = await self.transport.resume(last_event_id)

    async def _abandon(self, reason: str) -> None:
        try:
            await self.cancel(reason)
        except UpstreamError as exc:  # best effort: the call is refused either way
            log.info("upstream_cancel_failed", error=exc.message)

    async def cancel(self, reason: str) -> None:
        """For a legacy server a disconnect is not a cancellation: tell it with `notifications/cancelled`."""
        if self.finished:
            return
        self.finished = True
        try:
            await self.transport.notify("notifications/cancelled", {"requestId": self.request_id, "reason": reason})
        finally:
            self.response.close()


async def _drain(response: Answer) -> None:
    """Read an answered SSE stream to its end (bounded in time and bytes), then release its connection."""
    size = 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            while size <= DRAIN_MAX_BYTES:
                chunk = await response.next_chunk()
                if not chunk:
                    response.release()
                    return
                size += len(chunk)
    except CLIENT_FAILURES:
        pass
    response.close()


async def read_body(response: Answer, max_bytes: int | None) -> bytes:
    """A plain answer's body, read whole only when it fits `max_bytes` (checked as it arrives, whatever
    Content-Length says); EventTooLargeError otherwise."""
    if max_bytes is None:
        return await response.read()
    if response.length is not None and response.length > max_bytes:
        raise EventTooLargeError(f"Content-Length {response.length}")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks(response):
        size += len(chunk)
        if size > max_bytes:
            raise EventTooLargeError(f"over {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)
