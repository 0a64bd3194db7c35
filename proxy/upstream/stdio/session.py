"""The proxy as a legacy MCP client over stdio: one server process is one upstream session.

The stdio transport has exactly one client per process and carries no association between messages: the
session multiplexes its calls by JSON-RPC id (responses go to their call), routes `notifications/progress` by
the progress token it put on the call (each call gets a token of its own, so calls sharing a process never
see each other's progress), and treats everything else the server sends unasked as unsolicited: a question
goes to the call the process is lent to, else it is refused at once (never left waiting); `ping` is answered;
notifications go to that call and to the listen streams (`lending.py`).

A message longer than `limits.max_result_bytes` is not passed on, as over HTTP: an answer fails its call with
that limit's error (the server has answered: there is nothing to cancel), a question is refused, a
notification dropped. The line itself is read whole, so what it may hold is bounded by `upstream.max_line_bytes`.

A process that dies fails its open calls with an UpstreamError naming how it ended; the next request starts
a fresh one, unless it keeps crashing (then `StdioShared.start` refuses with a 503 saying when it is
tried again). What all sessions of one server command share is the `StdioShared` (`shared.py`). Imports the
shared state, the process layer (`process.py`) and the lending; never the kind, aiohttp, the store or tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog
from mcp_types import jsonrpc as codes

from proxy.errors import InvalidRequestError, RequestId, ResultTooLargeError, UpstreamError, UpstreamTimeoutError
from proxy.observe import tracing
from proxy.principals import Identity
from proxy.upstream.lending import Lending, Subscribers
from proxy.upstream.session import CLIENT_CAPABILITIES, CLIENT_INFO, read_param_headers, read_task_support, request
from proxy.upstream.stdio.process import ProcessExit, StdioProcess
from proxy.upstream.stdio.shared import CRASHING, StdioShared, not_initialized
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader
from proxy.wire.jsonrpc import (
    JSON,
    Notification,
    Request,
    Response,
    classify,
    error_message,
    notification_message,
    request_message,
    result_message,
)
from proxy.wire.upstream_events import (
    UpstreamErrorResponse,
    UpstreamEvent,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
)

log = structlog.get_logger(__name__)

UNSOLICITED_REFUSED: Final = "cannot be relayed to 2026-07-28 clients: no call of theirs holds this stdio server alone"
MAX_QUEUED_EVENTS: Final = 1024  # per call and per process: notifications beyond it are dropped, not buffered


@dataclass(frozen=True, slots=True)
class _Gone:
    """The end of a call's inbox that is not an answer: the process died, or the call was cancelled."""

    message: str


@dataclass(frozen=True, slots=True)
class _TooLarge:
    """The call's answer came, longer than `limits.max_result_bytes`: dropped, and the caller told so."""

    maximum: int


Inbox = asyncio.Queue[UpstreamEvent | _Gone | _TooLarge]


class StdioRequestStream:
    """One request open on a stdio session: its inbox, filled by the session as lines arrive."""

    def __init__(self, session: StdioSession, request_id: int, method: str, deadline: float) -> None:
        self.session = session
        self.request_id = request_id
        self.method = method
        self.inbox: Inbox = asyncio.Queue()
        self.deadline = deadline
        self.progress_token: str | int | None = None  # the caller's own token, put back on relayed progress
        self.finished = False

    def offer(self, event: UpstreamEvent | _Gone | _TooLarge) -> None:
        if isinstance(event, UpstreamNotification) and self.inbox.qsize() >= MAX_QUEUED_EVENTS:
            return  # a reader that fell this far behind loses notifications, never the answer
        self.inbox.put_nowait(event)

    async def events(self) -> AsyncIterator[UpstreamEvent]:
        """Everything the server says about this request, the final result or error last."""
        while True:
            remaining = self.deadline - time.monotonic()
            try:
                event = await asyncio.wait_for(self.inbox.get(), max(remaining, 0))
            except TimeoutError:
                raise UpstreamTimeoutError(f"Upstream {self.method} timed out") from None
            if isinstance(event, _Gone):
                raise UpstreamError(f"{event.message} during {self.method}")
            if isinstance(event, _TooLarge):
                self.finished = True
                raise ResultTooLargeError(event.maximum, "it was dropped")
            yield event
            if isinstance(event, UpstreamResult | UpstreamErrorResponse):
                self.finished = True
                return

    async def cancel(self, reason: str) -> None:
        """Tell the server (`notifications/cancelled` on its stdin); whoever still reads gets an error."""
        if self.finished:
            return
        self.finished = True
        self.inbox.put_nowait(_Gone(f"Upstream {self.method} was cancelled: {reason}"))
        await self.session.notify("notifications/cancelled", {"requestId": self.request_id, "reason": reason})


class StdioSession:
    """One server process at a time (a fresh one after a crash), initialized by the proxy; a `Session`."""

    def __init__(self, shared: StdioShared, principal: Identity | None) -> None:
        self.shared = shared
        self.principal = principal  # keys the pool only: a stdio server sees no HTTP headers
        self.session_id: str | None = None  # the running process's name
        self.protocol_version: str = shared.config.protocol_version
        self.initialize_result: JSON | None = None
        self.in_flight = 0
        self.subscribers = Subscribers(self.request, shared.tools_changed)
        self.lending = Lending(self.subscribers)  # a process cannot outlive the proxy: a kept one is stopped too
        self.process: StdioProcess | None = None
        self._calls: dict[int, StdioRequestStream] = {}  # request id (also the progress token it carries) → call
        self._asked: set[RequestId] = set()  # the running process's questions not answered yet
        self._unsolicited: asyncio.Queue[UpstreamEvent | None] = asyncio.Queue()
        self._lock = asyncio.Lock()
        self._closed = False
        self._generation = 0  # which process callbacks still count: only the latest one's

    async def request(self, method: str, params: JSON | None) -> JSON:
        return await request(self, method, params)

    async def param_headers(self, tool: str) -> tuple[ParamHeader, ...]:
        return await read_param_headers(self, self.shared, tool)

    async def task_support(self, tool: str) -> legacy_tasks.TaskSupport | None:
        return await read_task_support(self, self.shared, tool)

    @property
    def pid(self) -> int | None:
        """The running server process's id (None when none runs)."""
        process = self.process
        return process.pid if process is not None and process.exited is None else None

    # --- lifecycle --------------------------------------------------------------------------------------

    async def ensure_initialized(self) -> JSON:
        if self.initialize_result is not None:
            return self.initialize_result
        async with self._lock:
            if self.initialize_result is None:
                if self._closed:
                    raise UpstreamError("Upstream stdio session is closed")
                await self._start()
            assert self.initialize_result is not None
            return self.initialize_result

    async def _start(self) -> None:
        self._generation += 1
        generation = self._generation
        queue: asyncio.Queue[UpstreamEvent | None] = asyncio.Queue()
        self._unsolicited = queue

        def on_message(message: dict[str, Any]) -> None:
            if generation == self._generation:
                self._on_message(message)

        def on_oversized(message: dict[str, Any]) -> None:
            if generation == self._generation:
                self._on_oversized(message)

        def on_exit(exited: ProcessExit) -> None:
            queue.put_nowait(None)
            if generation == self._generation:
                self._on_exit(exited)

        process = await self.shared.start(on_message, on_exit, on_oversized)
        self.process = process
        self.shared.spawn(self._answer_unsolicited(queue), f"stdio-unsolicited-{process.name}")
        started = time.monotonic()
        try:
            result = await self.shared.initialized_within(self._initialize(), process.name)
        except TimeoutError:
            failure = not_initialized(self.shared.config.start_timeout_seconds)
            await self._abandon(process, failure)
            raise UpstreamTimeoutError(f"Upstream stdio server {process.name} {failure}") from None
        except BaseException:
            await self._abandon(process)
            raise
        self.session_id = process.name
        self.protocol_version = result["protocolVersion"]
        self.initialize_result = result
        self.shared.initialized(result)
        self.shared.backoff.reset()
        log.info(
            "upstream_session_initialized",
            protocol_version=self.protocol_version,
            upstream=process.name,
            start_seconds=round(time.monotonic() - started, 2),
        )
        if self.subscribers.resources:
            self.shared.spawn(self.subscribers.resubscribe(), "upstream-resubscribe")

    async def _initialize(self) -> JSON:
        params = {
            "protocolVersion": self.shared.config.protocol_version,
            "capabilities": CLIENT_CAPABILITIES,
            "clientInfo": CLIENT_INFO,
        }
        async with self._open("initialize", params) as call:
            async for event in call.events():
                if isinstance(event, UpstreamErrorResponse):
                    raise UpstreamError(f"Upstream refused initialize: {event.error.get('message')}")
                if isinstance(event, UpstreamResult):
                    if not isinstance(event.result.get("protocolVersion"), str):
                        raise UpstreamError("Upstream sent an invalid InitializeResult")
                    await self._send(notification_message("notifications/initialized", None))
                    return event.result
        raise UpstreamError("Upstream did not answer initialize")  # pragma: no cover - events() raises first

    async def _abandon(self, process: StdioProcess, failure: str = CRASHING) -> None:
        """A process that failed its start is stopped at once (no grace: it never became a session). Unless it
        died by itself (already counted), that counts for the backoff, as `failure`."""
        if process.exited is None:
            self.shared.crashed(0.0, failure)
        await asyncio.shield(process.stop(0))

    async def adopt(self, session_id: str) -> None:
        """A task the server ran itself cannot be taken over: its process stopped with the proxy before."""
        raise UpstreamError(f"Upstream stdio server process {session_id} is gone (the proxy restarted)")

    def detach(self) -> None:
        """Nothing of a stdio server outlives its process: letting go means stopping it."""
        self.shared.spawn(self.close(), "upstream-session-close")

    async def close(self) -> None:
        """Stop the process: close its stdin, then SIGTERM, then SIGKILL (`upstream.stop_grace_seconds`)."""
        self._closed = True
        process = self.process
        if process is not None:
            await process.stop()
        self.initialize_result = None
        self.session_id = None

    def _on_exit(self, exited: ProcessExit) -> None:
        process = self.process
        name = process.name if process is not None else self.shared.program
        self.initialize_result = None
        self.session_id = None
        self._asked.clear()
        gone = _Gone(f"Upstream stdio server {name} {exited}")
        for call in list(self._calls.values()):
            call.offer(gone)
        self._calls.clear()
        if exited.requested:
            return
        self.shared.crashed(exited.lived_seconds)
        if self.subscribers.subscriptions and not self._closed:
            self.shared.spawn(self._revive(), "upstream-session-revive")

    async def _revive(self) -> None:
        """Listen streams keep receiving: start a new process now (after the backoff), not at the next call."""
        await asyncio.sleep(max(0.0, self.shared.retry_at - time.monotonic()))
        try:
            await self.ensure_initialized()
        except UpstreamError as exc:
            log.warning("upstream_session_revive_failed", error=exc.message)

    # --- what the server writes -------------------------------------------------------------------------

    def _on_message(self, message: dict[str, Any]) -> None:
        """Called by the process for each line, in order; must not block."""
        self.shared.answered()
        try:
            parsed = classify(message)
        except InvalidRequestError:
            log.warning("upstream_stdout_invalid_message", upstream=self.session_id)
            return
        if isinstance(parsed, Request):
            self._asked.add(parsed.id)
            self._queue(UpstreamServerRequest(parsed.id, parsed.method, parsed.params))
        elif isinstance(parsed, Notification):
            self._notification(UpstreamNotification(parsed.raw))
        else:
            call = self._calls.get(parsed.id) if isinstance(parsed.id, int) else None
            if call is None:
                return  # an answer to a call already gone (cancelled, abandoned): nobody waits for it
            if parsed.error is not None:
                call.offer(UpstreamErrorResponse(parsed.error))
            else:
                call.offer(UpstreamResult(parsed.result or {}))

    def _on_oversized(self, message: dict[str, Any]) -> None:
        """A message longer than `limits.max_result_bytes` (see the module doc)."""
        self.shared.answered()
        maximum = self.shared.max_result_bytes or 0
        try:
            parsed = classify(message)
        except InvalidRequestError:
            parsed = None
        kind = type(parsed).__name__.lower() if parsed is not None else "invalid"
        log.warning("upstream_message_too_large", upstream=self.session_id, message=kind, max_result_bytes=maximum)
        if isinstance(parsed, Request):
            self._asked.add(parsed.id)
            refusal = {
                "code": codes.INTERNAL_ERROR,
                "message": f"Request larger than the client's limit ({maximum} bytes)",
            }
            self.shared.spawn(self._refuse(parsed.id, refusal), "stdio-refuse-oversized")
        elif isinstance(parsed, Response) and isinstance(parsed.id, int):
            call = self._calls.get(parsed.id)
            if call is not None:
                call.offer(_TooLarge(maximum))

    async def _refuse(self, request_id: RequestId, error: JSON) -> None:
        try:
            await self.respond(request_id, error=error)
        except UpstreamError as exc:
            log.info("upstream_answer_not_delivered", error=exc.message)

    def _notification(self, notification: UpstreamNotification) -> None:
        params = notification.message.get("params")
        token = params.get("progressToken") if isinstance(params, dict) else None
        call = (
            self._calls.get(token)
            if notification.method == "notifications/progress" and isinstance(token, int)
            else None
        )
        if call is None:
            self._queue(notification)
            return
        if call.progress_token is not None:
            assert isinstance(params, dict)
            notification = UpstreamNotification(
                {**notification.message, "params": {**params, "progressToken": call.progress_token}}
            )
        call.offer(notification)

    def _queue(self, event: UpstreamEvent) -> None:
        if self._unsolicited.qsize() >= MAX_QUEUED_EVENTS:
            log.warning("upstream_unsolicited_dropped", upstream=self.session_id)
            return
        self._unsolicited.put_nowait(event)

    async def _answer_unsolicited(self, queue: asyncio.Queue[UpstreamEvent | None]) -> None:
        """What the server sends unasked, in order: to the call that holds the process alone; questions on a
        shared process are refused (an elicitation is declined); `ping` is answered."""
        while (event := await queue.get()) is not None:
            try:
                await self.lending.route(event, self.respond, UNSOLICITED_REFUSED)
            except UpstreamError as exc:
                log.info("upstream_answer_not_delivered", error=exc.message)

    # --- towards the server -----------------------------------------------------------------------------

    async def _send(self, message: JSON) -> None:
        process = self.process
        if process is None:
            raise UpstreamError("Upstream stdio server is not running")
        await process.send(message)

    @contextlib.asynccontextmanager
    async def _open(self, method: str, params: JSON | None) -> AsyncIterator[StdioRequestStream]:
        request_id = self.shared.next_id()
        call = StdioRequestStream(self, request_id, method, time.monotonic() + self.shared.config.call_timeout_seconds)
        meta = params.get("_meta") if isinstance(params, dict) else None
        if isinstance(meta, dict) and "progressToken" in meta:
            # The server's progress names the request it belongs to: the id is the token.
            call.progress_token = meta["progressToken"]
            params = {**(params or {}), "_meta": {**meta, "progressToken": request_id}}
        self._calls[request_id] = call
        try:
            try:
                await self._send(request_message(request_id, method, params))
            except asyncio.CancelledError:
                await asyncio.shield(self._cancel_unanswered(call))
                raise
            yield call
        finally:
            self._calls.pop(request_id, None)

    async def _cancel_unanswered(self, call: StdioRequestStream) -> None:
        try:
            await call.cancel("request abandoned")
        except UpstreamError as exc:
            log.info("upstream_cancel_failed", error=exc.message)

    @contextlib.asynccontextmanager
    async def call(
        self, method: str, params: JSON | None, extra_headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[StdioRequestStream]:
        """Send one request; the StdioRequestStream streams what comes back. HTTP headers (trace context, the principal)
        have no place on stdio and are not sent."""
        await self.ensure_initialized()
        span = tracing.client_span(method, params, transport="pipe", protocol_version=self.protocol_version)
        with self.shared.measured(method), span as traced:
            async with self._open(method, traced.params(params, always=True)) as call:
                traced.request(call.request_id)
                self.in_flight += 1  # the caller's requests only, not the proxy's own initialize
                try:
                    yield call
                finally:
                    self.in_flight -= 1

    async def notify(self, method: str, params: JSON | None) -> None:
        await self._send(notification_message(method, params))

    async def respond(self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None) -> None:
        """Answer a question of the running process (not one a process that died asked: the id may mean
        something else to its successor)."""
        if request_id not in self._asked:
            raise UpstreamError("Upstream stdio server that asked is gone")
        self._asked.discard(request_id)
        message = result_message(request_id, result or {}) if error is None else error_message(request_id, error)
        await self._send(message)
