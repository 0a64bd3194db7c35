"""The stdio kind of upstream: one server process is one session. `StdioKind` starts the processes (bounded by
`upstream.max_processes`, idle ones stopped, a crashing server backed off with a 503 saying when) and keeps
what they share; `StdioSession` multiplexes calls on its process by JSON-RPC id and progress token, and routes
what the server sends unasked (`Lending`). Imports the process layer and the rates; never aiohttp, the store
or tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import structlog
from mcp_types import jsonrpc as codes

from proxy.background import Background
from proxy.config.schema import StdioUpstreamConfig
from proxy.errors import (
    InvalidRequestError,
    RequestId,
    ResultTooLargeError,
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from proxy.observe import tracing
from proxy.observe.metrics import Metrics
from proxy.principals import Identity
from proxy.upstream.auth import UpstreamAuth
from proxy.upstream.credentials import Credentials, Forward
from proxy.upstream.credentials._secrets import check_environment_value
from proxy.upstream.session import (
    CLIENT_CAPABILITIES,
    CLIENT_INFO,
    Learned,
    Lending,
    PoolLimits,
    Session,
    Subscribers,
    answer,
    measured,
    read_param_headers,
    read_task_support,
    request,
)
from proxy.upstream.stdio.process import ProcessExit, SizeLimit, StdioProcess, child_environment
from proxy.upstream.stdio.rates import Backoff
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
_T = TypeVar("_T")

CRASHING: Final = "keeps crashing"
STILL_STARTING_EVERY_SECONDS: Final = 10.0  # a start still waiting for `initialize` is logged this often


def not_initialized(timeout_seconds: float) -> str:
    return f"did not answer initialize within {timeout_seconds:g} s"


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


class StdioKind:
    """What every process of one server command shares (the command and its environment, request ids, the crash
    backoff, background work, what the server said most recently) and how the pool bounds them: processes are
    costly, so they are bounded by `upstream.max_processes`, idle ones stopped after
    `upstream.process_idle_seconds`, and calls that cannot ask share one. Readiness asks for a `ping`."""

    def __init__(
        self,
        config: StdioUpstreamConfig,
        metrics: Metrics | None = None,
        environ: Mapping[str, str] = os.environ,
        max_result_bytes: int | None = None,
        principal_header: str = "authorization",
        legacy_replay_bytes: int = 0,
        credentials: Credentials | None = None,
    ) -> None:
        self.config = config
        # A caller's server processes are its own when it has credentials of its own (`secrets`): their
        # environment holds its variables over `env`, never another caller's, never the inbound token.
        self.credentials = credentials if credentials is not None else Forward(principal_header)
        self.metrics = metrics
        self.max_result_bytes = max_result_bytes  # a longer message is refused (the line is read: max_line_bytes)
        self.principal_header = principal_header  # binds a legacy client's session to the caller that opened it
        self.legacy_replay_bytes = legacy_replay_bytes  # what a legacy client's session keeps for a resume
        self.env = child_environment(config.env, environ)
        self.program = Path(config.command[0]).name
        self.backoff = Backoff()
        self.retry_at = 0.0  # monotonic: while crashing, no process is started before this
        self.failure = CRASHING  # how the latest processes failed, as the backoff's 503 says it
        self.learned = Learned()
        self.auth = UpstreamAuth()  # a process sees no credentials: what it says serves every caller
        self.limits = PoolLimits(
            max_idle=config.max_processes,
            max_open=config.max_processes,
            idle_seconds=config.process_idle_seconds,
            share_quiet_calls=True,
            keep_warm=True,
            wait_seconds=config.connect_timeout_seconds,
            limit_name="upstream.max_processes",
        )
        self._ids = itertools.count(1)
        self._numbers = itertools.count(1)
        self._background = Background("upstream_background_task_failed")
        self._probe_lock = asyncio.Lock()

    def new(self, principal: Identity | None) -> Session:
        return StdioSession(self, principal)

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._background.spawn(coroutine, name)

    async def close(self) -> None:
        await self._background.close()
        await self.credentials.close()

    def next_id(self) -> int:
        return next(self._ids)

    async def start(
        self,
        on_message: Callable[[dict[str, Any]], None],
        on_exit: Callable[[ProcessExit], None],
        on_oversized: Callable[[dict[str, Any]], None] | None = None,
        variables: Mapping[str, str] | None = None,
    ) -> StdioProcess:
        """A new server process, unless the server keeps crashing (then a 503 saying when it is retried).
        Messages over `max_result_bytes` go to `on_oversized` when given; `variables` (a caller's own, from
        the credential source) are set over `upstream.env`, each checked here, where it is written."""
        wait = self.retry_at - time.monotonic()
        if wait > 0:
            # Rounded up: a wait is never said to be "0.0 s".
            raise UpstreamUnreachableError(
                f"Upstream stdio server {self.program} {self.failure} ({self.backoff.crashes} times in a row); "
                f"it is started again in {math.ceil(wait * 10) / 10:.1f} s",
                http_status=503,
            )
        config = self.config
        env = self.env
        if variables:
            for name, value in variables.items():
                try:
                    check_environment_value(name, value)
                except ValueError:
                    raise UpstreamError(
                        f"Upstream stdio server {self.program} not started: a credential variable cannot be set"
                    ) from None
            env = {**env, **variables}
        return await StdioProcess.start(
            config.command,
            env,
            config.cwd,
            max_line_bytes=config.max_line_bytes,
            on_message=on_message,
            on_exit=on_exit,
            name=f"{self.program}#{next(self._numbers)}",
            stop_grace_seconds=config.stop_grace_seconds,
            oversized=(
                None
                if on_oversized is None or self.max_result_bytes is None
                else SizeLimit(self.max_result_bytes, on_oversized)
            ),
        )

    def crashed(self, lived_seconds: float, failure: str = CRASHING) -> None:
        """A process ended without the proxy asking (or never became a session: `failure` says how, for the
        503 of the backoff). The first is restarted at once; each further quick one waits longer (`Backoff`)."""
        self.failure = failure
        delay = self.backoff.crashed(lived_seconds)
        if self.backoff.crashes > 1:
            self.retry_at = time.monotonic() + delay

    def answered(self) -> None:
        self.learned.last_answer_at = time.monotonic()

    async def initialized_within(self, initialize: Awaitable[_T], name: str) -> _T:
        """`initialize` awaited for at most `upstream.start_timeout_seconds` (then TimeoutError). A slow start
        is said to be one: `upstream_process_still_starting` is logged every STILL_STARTING_EVERY_SECONDS (a
        quarter of the timeout when that is shorter) until the server answers."""
        timeout = self.config.start_timeout_seconds
        every = min(STILL_STARTING_EVERY_SECONDS, timeout / 4)

        loop = asyncio.get_running_loop()
        started = loop.time()
        timer: asyncio.TimerHandle | None = None

        def still_starting() -> None:
            nonlocal timer
            seconds = round(loop.time() - started, 1)
            log.info("upstream_process_still_starting", upstream=name, seconds=seconds, start_timeout_seconds=timeout)
            timer = loop.call_later(every, still_starting)

        timer = loop.call_later(every, still_starting)
        try:
            return await asyncio.wait_for(initialize, timeout)
        finally:
            timer.cancel()

    async def probe(self, max_age_seconds: float, shared: Callable[[], AbstractAsyncContextManager[Session]]) -> None:
        """Readiness: fine when a process spoke within `max_age_seconds`; otherwise the anonymous shared
        process (started if need be) must answer `ping` within `upstream.connect_timeout_seconds`."""
        async with self._probe_lock:
            last = self.learned.last_answer_at
            if last is not None and time.monotonic() - last <= max_age_seconds:
                return
            timeout = self.config.connect_timeout_seconds
            async with shared() as session:
                try:
                    await asyncio.wait_for(session.request("ping", None), timeout)
                except TimeoutError:
                    raise UpstreamTimeoutError(
                        f"Upstream stdio server {self.program} did not answer ping within {timeout:g} s"
                    ) from None


class StdioSession:
    """One server process at a time (a fresh one after a crash), initialized by the proxy; a `Session`.

    The stdio transport has exactly one client per process and carries no association between messages: the
    session multiplexes its calls by JSON-RPC id (responses go to their call), routes `notifications/progress` by
    the progress token it put on the call (each call gets a token of its own, so calls sharing a process never see
    each other's progress), and treats everything else the server sends unasked as unsolicited: a question goes
    to the call the process is lent to, else it is refused at once; `ping` is answered; notifications go to that
    call and to the listen streams (`Lending`). A process that dies fails its open calls with an UpstreamError
    naming how it ended; the next request starts a fresh one, unless it keeps crashing (then `StdioKind.start`
    refuses with a 503 saying when it is tried again)."""

    def __init__(self, kind: StdioKind, principal: Identity | None) -> None:
        self.kind = kind
        self.principal = principal  # keys the pool only: a stdio server sees no HTTP headers
        self.session_id: str | None = None  # the running process's name
        self.protocol_version: str = kind.config.protocol_version
        self.initialize_result: JSON | None = None
        self.in_flight = 0
        self.subscribers = Subscribers(self.request, kind.learned.tools_changed)
        self.lending = Lending(self.subscribers)  # a process cannot outlive the proxy: a kept one is stopped too
        self.process: StdioProcess | None = None
        self._calls: dict[int, StdioRequestStream] = {}  # request id (also the progress token it carries) → call
        self._asked: set[RequestId] = set()  # the running process's questions not answered yet
        self._unsolicited: asyncio.Queue[UpstreamEvent | None] = asyncio.Queue()
        self._lock = asyncio.Lock()
        self._closed = False
        self._generation = 0  # which process callbacks still count: only the latest one's
        self._variables: Mapping[str, str] = {}  # the caller's credential variables its process started with

    async def request(self, method: str, params: JSON | None) -> JSON:
        return await request(self, method, params)

    async def param_headers(self, tool: str) -> tuple[ParamHeader, ...]:
        return await read_param_headers(self, self.kind.learned, tool)

    async def task_support(self, tool: str) -> legacy_tasks.TaskSupport | None:
        return await read_task_support(self, self.kind.learned, tool)

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

        variables = self.kind.credentials.environment(self.principal)  # a refused caller starts nothing
        process = await self.kind.start(on_message, on_exit, on_oversized, variables)
        self._variables = variables
        self.process = process
        self.kind.spawn(self._answer_unsolicited(queue), f"stdio-unsolicited-{process.name}")
        started = time.monotonic()
        try:
            result = await self.kind.initialized_within(self._initialize(), process.name)
        except TimeoutError:
            failure = not_initialized(self.kind.config.start_timeout_seconds)
            await self._abandon(process, failure)
            raise UpstreamTimeoutError(f"Upstream stdio server {process.name} {failure}") from None
        except BaseException:
            await self._abandon(process)
            raise
        self.session_id = process.name
        self.protocol_version = result["protocolVersion"]
        self.initialize_result = result
        self.kind.learned.initialized(result)
        self.kind.backoff.reset()
        log.info(
            "upstream_session_initialized",
            protocol_version=self.protocol_version,
            upstream=process.name,
            start_seconds=round(time.monotonic() - started, 2),
        )
        if self.subscribers.resources:
            self.kind.spawn(self.subscribers.resubscribe(), "upstream-resubscribe")

    async def _initialize(self) -> JSON:
        params = {
            "protocolVersion": self.kind.config.protocol_version,
            "capabilities": CLIENT_CAPABILITIES,
            "clientInfo": CLIENT_INFO,
        }
        async with self._open("initialize", params) as call:
            final = await answer(call)
            if isinstance(final, UpstreamErrorResponse):
                raise UpstreamError(f"Upstream refused initialize: {final.error.get('message')}")
            if not isinstance(final.result.get("protocolVersion"), str):
                raise UpstreamError("Upstream sent an invalid InitializeResult")
            await self._send(notification_message("notifications/initialized", None))
            return final.result

    async def _abandon(self, process: StdioProcess, failure: str = CRASHING) -> None:
        """A process that failed its start is stopped at once (no grace: it never became a session). Unless it
        died by itself (already counted), that counts for the backoff, as `failure`."""
        if process.exited is None:
            self.kind.crashed(0.0, failure)
        await asyncio.shield(process.stop(0))

    async def adopt(self, session_id: str) -> None:
        """A task the server ran itself cannot be taken over: its process stopped with the proxy before."""
        raise UpstreamError(f"Upstream stdio server process {session_id} is gone (the proxy restarted)")

    def detach(self) -> None:
        """Nothing of a stdio server outlives its process: letting go means stopping it."""
        self.kind.spawn(self.close(), "upstream-session-close")

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
        name = process.name if process is not None else self.kind.program
        self.initialize_result = None
        self.session_id = None
        self._asked.clear()
        gone = _Gone(f"Upstream stdio server {name} {exited}")
        for call in list(self._calls.values()):
            call.offer(gone)
        self._calls.clear()
        if exited.requested:
            return
        self.kind.crashed(exited.lived_seconds)
        if self.subscribers.subscriptions and not self._closed:
            self.kind.spawn(self._revive(), "upstream-session-revive")

    async def _revive(self) -> None:
        """Listen streams keep receiving: start a new process now (after the backoff), not at the next call."""
        await asyncio.sleep(max(0.0, self.kind.retry_at - time.monotonic()))
        try:
            await self.ensure_initialized()
        except UpstreamError as exc:
            log.warning("upstream_session_revive_failed", error=exc.message)

    # --- what the server writes -------------------------------------------------------------------------

    def _on_message(self, message: dict[str, Any]) -> None:
        """Called by the process for each line, in order; must not block."""
        self.kind.answered()
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
        """A message longer than `limits.max_result_bytes` is not passed on, as over HTTP: an answer fails its call
        with that limit's error (the server has answered: there is nothing to cancel), a question is refused, a
        notification dropped. The line itself is read whole, so what it may hold is bounded by
        `upstream.max_line_bytes`."""
        self.kind.answered()
        maximum = self.kind.max_result_bytes or 0
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
            self.kind.spawn(self._refuse(parsed.id, refusal), "stdio-refuse-oversized")
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
        request_id = self.kind.next_id()
        call = StdioRequestStream(self, request_id, method, time.monotonic() + self.kind.config.call_timeout_seconds)
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
        self,
        method: str,
        params: JSON | None,
        extra_headers: Mapping[str, str] | None = None,
        *,
        tool: str | None = None,
    ) -> AsyncIterator[StdioRequestStream]:
        """Send one request; the StdioRequestStream streams what comes back. HTTP headers (trace context, the principal)
        have no place on stdio and are not sent. With credentials of the caller's own (`secrets`), its entry is
        looked up again for each request: a caller whose entry is gone is refused, and a process started with an
        entry since changed is started anew first, when no request of it is open."""
        if not self.kind.credentials.forwards:
            await self._current_credential()
        await self.ensure_initialized()
        span = tracing.client_span(method, params, transport="pipe", protocol_version=self.protocol_version)
        with measured(self.kind.metrics, method), span as traced:
            async with self._open(method, traced.params(params, always=True)) as call:
                traced.request(call.request_id)
                self.in_flight += 1  # the caller's requests only, not the proxy's own initialize
                try:
                    yield call
                finally:
                    self.in_flight -= 1

    async def _current_credential(self) -> None:
        variables = self.kind.credentials.environment(self.principal)  # NoCredentialError once it is gone
        if self.initialize_result is None or variables == self._variables or self.in_flight:
            return
        async with self._lock:
            process = self.process
            if self.initialize_result is None or process is None or self.in_flight:
                return
            log.info("upstream_process_credential_changed", upstream=process.name)
            self._generation += 1  # the old process's exit is no crash, and fails no call of the new one
            self.initialize_result = None
            self.session_id = None
            await process.stop()

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
