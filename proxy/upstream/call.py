"""One in-flight upstream request as an async stream of events.

`UpstreamCall.events()` yields what the legacy server sends on the request's stream: notifications,
server→client requests (which the consumer must answer with `answer()` before reading on) and, last, the
final result or JSON-RPC error. The upstream's `ping` is answered here. aiohttp errors become UpstreamError.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from mcp_types import jsonrpc as codes

from proxy.errors import InvalidRequestError, UpstreamError, UpstreamTimeoutError
from proxy.upstream.sse import SSEParser
from proxy.wire.jsonrpc import JSON, Notification, Request, Response, classify
from proxy.wire.translate import INPUT_METHODS

if TYPE_CHECKING:
    from proxy.upstream.session import UpstreamSession

# How often a closed upstream SSE stream is resumed with GET + Last-Event-ID before the call counts as lost.
MAX_RESUMPTIONS = 5


@dataclass(frozen=True, slots=True)
class UpstreamNotification:
    message: JSON


@dataclass(frozen=True, slots=True)
class UpstreamServerRequest:
    id: int | str
    method: str
    params: JSON | None


@dataclass(frozen=True, slots=True)
class UpstreamResult:
    result: JSON


@dataclass(frozen=True, slots=True)
class UpstreamErrorResponse:
    error: JSON


UpstreamEvent = UpstreamNotification | UpstreamServerRequest | UpstreamResult | UpstreamErrorResponse


class UpstreamCall:
    def __init__(
        self,
        session: UpstreamSession,
        request_id: int,
        method: str,
        response: aiohttp.ClientResponse,
    ) -> None:
        self.session = session
        self.request_id = request_id
        self.method = method
        self._response = response
        self.finished = False

    async def events(self) -> AsyncIterator[UpstreamEvent]:
        """Everything the upstream says about this request, the final result or error last."""
        try:
            async for event in self._events():
                yield event
                if isinstance(event, UpstreamResult | UpstreamErrorResponse):
                    self.finished = True
                    return
        except TimeoutError:
            raise UpstreamTimeoutError(f"Upstream {self.method} timed out") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"Upstream connection lost during {self.method}: {exc}") from None
        finally:
            self._response.release()
        raise UpstreamError(f"Upstream closed the stream of {self.method} without answering")

    async def _events(self) -> AsyncIterator[UpstreamEvent]:
        response = self._response
        content_type = response.content_type
        if content_type == "application/json":
            body = await response.read()
            event = self._message(body.decode("utf-8", errors="replace"))
            if event is not None:
                yield event
            return
        if content_type != "text/event-stream":
            raise UpstreamError(f"Upstream answered {self.method} with unexpected content type {content_type!r}")
        resumptions = 0
        last_event_id: str | None = None  # kept across resumptions: a resumed stream may carry no new id
        retry_ms = 0
        while True:
            parser = SSEParser()
            async for chunk in response.content.iter_any():
                for sse in parser.feed(chunk):
                    if sse.id is not None:
                        last_event_id = sse.id
                    if sse.retry_ms is not None:
                        retry_ms = sse.retry_ms
                    if not sse.data.strip():
                        continue
                    event = self._message(sse.data)
                    if event is None:
                        continue
                    if isinstance(event, UpstreamServerRequest) and event.method == "ping":
                        await self.session.respond(event.id, result={})
                        continue
                    yield event
                    if isinstance(event, UpstreamResult | UpstreamErrorResponse):
                        return
            # K-29 / L-3: a 2025-11-25 server may close the stream early and expect GET + Last-Event-ID.
            if last_event_id is None or resumptions >= MAX_RESUMPTIONS:
                return
            resumptions += 1
            response.release()
            await asyncio.sleep(min(retry_ms, 10_000) / 1000)
            response = self._response = await self.session.resume(last_event_id)

    def _message(self, data: str) -> UpstreamEvent | None:
        try:
            message = classify(json.loads(data))
        except ValueError:
            raise UpstreamError(f"Upstream sent a malformed message during {self.method}") from None
        except InvalidRequestError as exc:
            raise UpstreamError(f"Upstream sent an invalid JSON-RPC message during {self.method}: {exc}") from None
        if isinstance(message, Response):
            if message.id != self.request_id:
                return None
            if message.error is not None:
                return UpstreamErrorResponse(message.error)
            return UpstreamResult(message.result or {})
        if isinstance(message, Request):
            return UpstreamServerRequest(message.id, message.method, message.params)
        if isinstance(message, Notification):
            return UpstreamNotification(message.raw)
        return None

    async def answer(
        self, server_request_id: int | str, *, result: JSON | None = None, error: JSON | None = None
    ) -> None:
        """Answer a server→client request the upstream sent on this call's stream."""
        await self.session.respond(server_request_id, result=result, error=error)

    async def refuse(self, server_request: UpstreamServerRequest) -> bool:
        """Answer a server→client request no client will see, so the upstream never waits on it: an input
        request (elicitation, sampling, roots) is refused (an elicitation declined); anything else is not
        found. Returns whether it was an input request."""
        if server_request.method in INPUT_METHODS:
            await self.session.refuse(
                server_request.id,
                server_request.method,
                {"code": codes.INVALID_REQUEST, "message": "The client cannot answer this request"},
            )
            return True
        await self.answer(
            server_request.id,
            error={"code": codes.METHOD_NOT_FOUND, "message": f"Method not found: {server_request.method}"},
        )
        return False

    async def cancel(self, reason: str) -> None:
        """L-5: disconnect is not cancellation for a legacy server; tell it with notifications/cancelled."""
        if self.finished:
            return
        self.finished = True
        try:
            await self.session.notify("notifications/cancelled", {"requestId": self.request_id, "reason": reason})
        finally:
            self._response.close()
