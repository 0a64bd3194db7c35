"""The one place where failures become HTTP answers (`error_edge`, with the request's one log line), and how a
modern request's answer is written (`HttpChannel`, never waiting forever on a client that does not read).
Imports aiohttp's web side, the errors and the wire; nothing of the front or the tasks."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import structlog
from aiohttp import web

from proxy.errors import ProxyError, RequestId, http_status
from proxy.observe.audit import AuditLog
from proxy.observe.logs import logs_at
from proxy.observe.metrics import Metrics, method_label
from proxy.wire import jsonrpc
from proxy.wire.jsonrpc import JSON
from proxy.wire.sse import KEEPALIVE, frame

# `error_edge` (a middleware) turns any ProxyError raised below it into the JSON-RPC error answer with the request's
# id (bound once, when the message is read: `RPC_ID`) and the status of `errors.http_status`, also as the last event
# of an SSE stream that is already open; it also writes the one log line of each request. `HttpChannel` writes
# notifications and the final message, never waiting forever on a client that does not read. Imports aiohttp's web
# side, the errors and the wire; nothing of the front or the tasks.

log = structlog.get_logger(__name__)

METRICS: Final = web.AppKey("metrics", Metrics)
ERA: Final = web.RequestKey("era", str)
MCP_METHOD: Final = web.RequestKey("mcp_method", str)
JSONRPC_ERROR: Final = web.RequestKey("jsonrpc_error", bool)
RPC_ID: Final = web.RequestKey[RequestId]("rpc_id")  # the JSON-RPC id of a modern request, once read
AUDIT: Final = web.AppKey("audit", AuditLog)  # set only when `audit.path` is
# What a modern request's audit line says, gathered while it is served (only with an audit log).
AUDITED: Final = web.RequestKey("audited", dict[str, object])

# Probes and scrapes come from kubelet and Prometheus with the pod IP as Host: these GETs skip the Host/Origin
# allow-list (they carry no MCP traffic and reveal no tokens or arguments). Everything else is checked.
HEALTHZ: Final = "/healthz"
READYZ: Final = "/readyz"
METRICS_PATH: Final = "/metrics"
DRAINZ: Final = "/drainz"  # answers once a drain is over: what the legacy container's preStop hook waits on
OPS_PATHS: Final = frozenset({HEALTHZ, READYZ, METRICS_PATH, DRAINZ})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The `request_id` of log lines: unique per process (counter) and across processes (random prefix).
REQUEST_ID_PREFIX: Final = secrets.token_hex(4) + "-"
HEADERS_ALLOWANCE: Final = 8192  # bytes: more than the headers of any answer the proxy writes
_request_numbers = itertools.count(1)


@web.middleware
async def error_edge(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where failures become HTTP responses (`_error_answer`); also the one request log line,
    whose `request_id` is bound here for every line the request causes."""
    log_id = f"{REQUEST_ID_PREFIX}{next(_request_numbers):x}"
    structlog.contextvars.bind_contextvars(request_id=log_id)
    started = time.perf_counter()
    status = 500
    refusal: int | None = None  # the JSON-RPC code of a ProxyError answered here
    try:
        response = await handler(request)
        status = response.status
        return response
    except ProxyError as error:
        log.info("request_rejected", code=error.code, reason=error.message, detail=error.detail)
        refusal = error.code
        _count_limit(request, error)
        response = await _error_answer(request, error)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except ConnectionResetError:
        status = 499  # the client closed the connection before its answer was written (nginx's convention)
        log.info("client_disconnected")
        return web.Response(status=status)
    except Exception:
        log.exception("request_failed")
        response = await _error_answer(request, ProxyError("Internal error"))
        status = response.status
        return response
    finally:
        duration = time.perf_counter() - started
        ops = request.path in OPS_PATHS  # a probe every few seconds would drown the useful lines: debug
        if logs_at(logging.DEBUG if ops else logging.INFO):
            (log.debug if ops else log.info)(
                "request",
                http_method=request.method,
                path=request.path,
                era=request.get(ERA, "-"),
                mcp_method=request.get(MCP_METHOD, "-"),
                status=status,
                duration_ms=round(duration * 1000, 2),
            )
        if not ops:
            _count(request, status, duration)
        audit = request.app.get(AUDIT)
        if audit is not None and request.get(ERA) == "modern":
            _audit(audit, request, status, refusal, duration)
        # Ids bound by tracing, and how an Idempotency-Key answered (tasks/services/idempotency.py):
        structlog.contextvars.unbind_contextvars("request_id", "trace_id", "span_id", "idempotency")


async def _error_answer(request: web.Request, error: ProxyError) -> web.StreamResponse:
    """A ProxyError as the request's answer: the JSON-RPC error with the request's id (bound once, when the
    message was read), with the status `errors.http_status` gives it. On a stream that is already open
    (notifications went out) the error is the stream's last event instead."""
    request_id = error.request_id if error.request_id is not None else request.get(RPC_ID)
    request[JSONRPC_ERROR] = True
    channel: HttpChannel | None = request.get(CHANNEL)
    if channel is not None and channel.stream is not None:
        return await channel.finish(jsonrpc.error_message(request_id, error.error_object()))
    return error_response(error, request_id)


def json_response(message: JSON, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    """`message` as a JSON body, encoded once (a spliced-in stored result is not decoded and encoded again)."""
    return web.Response(
        body=jsonrpc.dumps(message), status=status, headers=headers, content_type="application/json", charset="utf-8"
    )


def error_response(error: ProxyError, request_id: RequestId | None = None) -> web.Response:
    """The JSON-RPC error body of `error` (with `request_id`, else the error's own) and its HTTP status."""
    message = jsonrpc.error_message(request_id if request_id is not None else error.request_id, error.error_object())
    response = json_response(message, http_status(error), error.response_headers())
    if error.headers.get("Connection") == "close":
        response.force_close()  # aiohttp's own state too, not only the header
    return response


def _count(request: web.Request, status: int, duration_seconds: float) -> None:
    metrics = request.app.get(METRICS)
    if metrics is None:
        return
    era = request.get(ERA, "-")
    method = method_label(request.get(MCP_METHOD))
    if status == 499:
        outcome = "disconnected"
    elif status >= 500:
        outcome = "server_error"
    elif status >= 400:
        outcome = "client_error"
    elif request.get(JSONRPC_ERROR, False):
        outcome = "jsonrpc_error"
    else:
        outcome = "ok"
    metrics.request_done(era, method, outcome, duration_seconds)


def _audit(audit: AuditLog, request: web.Request, status: int, refusal: int | None, duration_seconds: float) -> None:
    """The request's audit line: what serving it gathered (`AUDITED`), and how it ended."""
    gathered = request.get(AUDITED, {})
    outcome = gathered.get("outcome") or (
        "refused" if refusal is not None else "disconnected" if status == 499 else "-"
    )
    audit.write(
        {
            "kind": "request",
            "request_id": structlog.contextvars.get_contextvars().get("request_id"),
            "subject": gathered.get("subject"),
            "principal": gathered.get("principal"),
            "method": request.get(MCP_METHOD, "-"),
            "tool": gathered.get("tool"),
            "task_id": gathered.get("task_id"),
            "outcome": outcome,
            "code": refusal if refusal is not None else gathered.get("code"),
            "status": status,
            "duration_ms": round(duration_seconds * 1000, 2),
        }
    )


def _count_limit(request: web.Request, error: ProxyError) -> None:
    metrics = request.app.get(METRICS)
    limit = error.data.get("limit") if isinstance(error.data, dict) else None
    if metrics is not None and isinstance(limit, str):
        metrics.limit_refusals.labels(limit).inc()


class HttpChannel:
    """A modern request's answer: notifications before the final message turn it into an SSE stream at the
    first one. Every write waits at most `write_timeout_seconds` for a client that does not read; then the
    connection is closed and its buffers are freed (ConnectionResetError, as for a client that left)."""

    def __init__(self, request: web.Request, write_timeout_seconds: float) -> None:
        self.request = request
        self.write_timeout_seconds = write_timeout_seconds
        self.sse_allowed = "text/event-stream" in request.headers.get("Accept", "")
        self.stream: web.StreamResponse | None = None

    async def notify(self, message: JSON, *, required: bool = False) -> None:
        if not (self.sse_allowed or required):
            return
        stream = await self._open()
        await self._bounded(stream.write(frame(jsonrpc.dumps(message).decode())))

    async def keepalive(self, *, open_stream: bool = False) -> None:
        if self.stream is None and open_stream and self.sse_allowed:
            await self._open()
        if self.stream is not None:
            await self._bounded(self.stream.write(KEEPALIVE))

    async def _bounded(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_seconds):
                await write
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()  # drops what it still buffers for this client
            log.info("client_not_reading", timeout_seconds=self.write_timeout_seconds)
            raise ConnectionResetError("the client did not read its answer in time") from None
        except ConnectionResetError:
            raise
        except ConnectionError as exc:  # gone while the write waited for it (aiohttp: "Connection lost")
            raise ConnectionResetError(str(exc)) from exc

    def _fits(self, size: int) -> bool:
        """Whether a write of `size` bytes (and the headers) can never pause for the client: nothing is buffered
        for it yet (so its transport is not paused) and they stay under the high-water mark, so they go to the
        socket or its buffer at once and there is nothing to bound (the common small answer)."""
        transport = self.request.transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() > 0:
            return False
        _, high = transport.get_write_buffer_limits()
        return size + HEADERS_ALLOWANCE < high

    async def _open(self) -> web.StreamResponse:
        if self.stream is None:
            self.stream = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",  # keeps reverse proxies from buffering the stream (Streamable HTTP)
                },
            )
            await self.stream.prepare(self.request)
        return self.stream

    async def finish(self, message: JSON) -> web.StreamResponse:
        """The final message: a JSON answer (written here, bounded, not after the handler returns), or the
        last event of the stream."""
        if self.stream is None:
            status = http_status(message.get("error"))
            response = json_response(message, status)
            await response.prepare(self.request)
            if self._fits(response.content_length or 0):
                await response.write_eof()  # cannot wait for the client (below): no timer to set and cancel
            else:
                await self._bounded(response.write_eof())
            return response
        await self._bounded(self.stream.write(frame(jsonrpc.dumps(message).decode())))
        await self._bounded(self.stream.write_eof())
        return self.stream


CHANNEL: Final = web.RequestKey("channel", HttpChannel)  # a modern request's answer stream
