"""The legacy front for a stdio upstream: the 2025-11-25 Streamable HTTP server the proxy serves itself, one
server process per client session, its messages relayed to and from the process's stdio. Imports aiohttp's web
side, the stdio kind and process layer, the principals and the pool's `Room`; never tasks."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from typing import Final

import structlog
from aiohttp import web

from proxy.config.schema import StdioUpstreamConfig
from proxy.errors import InvalidRequestError, RequestId, UpstreamError, UpstreamTimeoutError
from proxy.legacy import Rewrite
from proxy.legacy import _event_store as legacy_events
from proxy.legacy._event_store import SessionEvents
from proxy.legacy._stdio_sessions import (
    KEEPALIVE_SECONDS,
    SESSION_HEADER,
    SSE_HEADERS,
    VERSION_HEADER,
    LegacySession,
    SessionNotFoundError,
    Stream,
)
from proxy.principals import Identity, identity_of, principal_key
from proxy.upstream.session import Room
from proxy.upstream.stdio.process import ProcessExit
from proxy.upstream.stdio.session import StdioKind
from proxy.wire.jsonrpc import JSON, Request, classify, dumps, error_message, loads
from proxy.wire.sse import KEEPALIVE, frame

log = structlog.get_logger(__name__)

CALLER: Final = "mcp_tasks_proxy.legacy_caller"  # the request's verified caller (`upstream.credentials`)


class StdioLegacyServer:
    """Serves legacy clients on the proxy's endpoint when the upstream is a stdio server (`relay()`, as the
        pass-through does for an HTTP upstream).

    Spec: https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#streamable-http

    A legacy client (`initialize`, `Mcp-Session-Id`) cannot be relayed byte for byte to a server that speaks only
    stdio, so the proxy serves the transport. `initialize` starts a server process of the client's own (counted
    against `upstream.max_processes`) and mints the session id; the client's own `initialize` goes to it, so the
    server sees the client's capabilities and version. Every message of the client goes to the process's stdin
    unchanged, ids included (the process has no other client), and what the process writes comes back:

    - a response, to the POST that waits for it: as the last event of an SSE stream when the client accepts one
      (as JSON without an event store, when nothing came before it);
    - `notifications/progress`, to the POST whose request carries its token;
    - anything else (server→client requests, log messages, list changes; stdio says nothing of what they belong
      to): to the only POST open, else the GET stream, else the oldest POST open; with no stream open, a few are
      held for the next stream to open.

    With `limits.legacy_replay_bytes` (the default) the streams are resumable (`proxy/legacy/_event_store.py`):
    every event has an id, an SSE stream opens with a priming event (an id, empty data, `retry`) for a 2025-11-25
    client, and a client whose stream broke resumes it with GET and `Last-Event-ID`: the events of that stream it
    missed, then the rest of it (a POST's answer stream ends with the answer; the GET stream goes on).

    DELETE ends the session (the process is stopped: it was initialized for that client and cannot serve another);
    so does `upstream.process_idle_seconds` with no stream open, and the process ending. A request naming an ended
    session gets 404, which tells the client to initialize again. A session is bound to the principal header that
    opened it (its session key, `principals.principal_key`). Imports aiohttp's web side, the stdio kind and process
    layer, the principals, and the pool's `Room`; never tasks."""

    def __init__(
        self,
        shared: StdioKind,
        room: Room,
        config: StdioUpstreamConfig,
        principal_header: str,
        replay_bytes: int = 0,
    ) -> None:
        self.shared = shared
        self.pool = room  # each session's process counts against upstream.max_processes, as the pool's own do
        self.config = config
        self.principal_header = principal_header
        self.replay_bytes = replay_bytes  # per session, for resumable streams; 0: none
        self.sessions: dict[str, LegacySession] = {}  # by id: the sessions clients may still use
        self.live: set[LegacySession] = set()  # sessions whose process has not exited yet (ended ones too)

    async def relay(
        self,
        request: web.Request,
        body: bytes | None,
        rewrite: Rewrite | None = None,
        *,
        identity: Identity | None = None,
        tool: str | None = None,
    ) -> web.StreamResponse:
        if not self.shared.credentials.forwards:
            request[CALLER] = identity  # the verified caller: its own process, with its own environment
        if request.method == "POST":
            return await self._post(request, body or b"", rewrite)
        if request.method == "GET":
            return await self._get(request)
        if request.method == "DELETE":
            await self.end(self._session(request), "the client ended the session")
            return web.Response(status=200)
        return web.Response(status=405, headers={"Allow": "GET, POST, DELETE"})

    def _principal_key(self, request: web.Request) -> str:
        """The key of the caller's upstream sessions (`principals.principal_key`): a session answers only the
        principal header that opened it; with credentials of the proxy's making, only its verified caller."""
        credentials = self.shared.credentials
        if not credentials.forwards:
            return credentials.session_key(request.get(CALLER))
        return principal_key(identity_of(request.headers.get(self.principal_header)))

    def _session(self, request: web.Request) -> LegacySession:
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is None:
            raise InvalidRequestError(f"Bad Request: the {SESSION_HEADER} header is required")
        session = self.sessions.get(session_id)
        if session is None or session.principal != self._principal_key(request):
            raise SessionNotFoundError()
        return session

    # --- POST ----------------------------------------------------------------------------------------------

    async def _post(self, request: web.Request, body: bytes, rewrite: Rewrite | None) -> web.StreamResponse:
        message = classify(loads(body))
        sse = "text/event-stream" in request.headers.get("Accept", "")
        if isinstance(message, Request) and message.method == "initialize":
            if SESSION_HEADER in request.headers:
                raise InvalidRequestError("Invalid Request: this session is initialized already", request_id=message.id)
            return await self._initialize(request, message, sse)
        session = self._session(request)
        if not isinstance(message, Request):
            await self._send(session, message.raw)
            return web.Response(status=202)
        meta = (message.params or {}).get("_meta")
        token = meta.get("progressToken") if isinstance(meta, dict) else None
        stream = session.open(message.id, sse, token, rewrite=rewrite)
        self._busy(session)
        version = request.headers.get(VERSION_HEADER)
        try:
            await self._send(session, message.raw)
            return await self._answer(request, stream, message.id, self.config.call_timeout_seconds, {}, version)
        finally:
            session.let_go(stream)
            self._idle(session)

    async def _initialize(self, request: web.Request, message: Request, sse: bool) -> web.StreamResponse:
        await self.pool.reserve(self._make_room)
        events = SessionEvents(self.replay_bytes) if self.replay_bytes else None
        principal = self._principal_key(request)
        session = LegacySession(secrets.token_urlsafe(24), principal, events)
        try:
            variables = self.shared.credentials.environment(request.get(CALLER))  # a caller without any: refused
            session.process = await self.shared.start(
                session.route, lambda exited: self._exited(session, exited), variables=variables
            )
        except BaseException:
            self.pool.unreserve()
            raise
        self.sessions[session.id] = session
        self.live.add(session)
        log.info("legacy_session_started", upstream=session.process.name)
        # Answered whole, as before any stream: the session exists for the client only once it has the answer.
        stream = session.open(message.id, sse, resumable=False)
        timeout = self.config.start_timeout_seconds
        version = (message.params or {}).get("protocolVersion")
        headers = {SESSION_HEADER: session.id}
        try:
            await self._send(session, message.raw)
            response = await self._answer(request, stream, message.id, timeout, headers, version)
        except BaseException:
            self.shared.spawn(self.end(session, "initialize did not succeed"), "legacy-session-end")
            raise
        finally:
            session.close(stream)
        self._idle(session)
        return response

    async def _send(self, session: LegacySession, message: JSON) -> None:
        if session.ended is not None or session.process is None:
            raise SessionNotFoundError()
        try:
            await session.process.send(message)
        except UpstreamError:
            raise SessionNotFoundError() from None  # the process is gone: the session with it

    async def _answer(
        self,
        request: web.Request,
        stream: Stream,
        request_id: RequestId,
        wait_seconds: float,
        headers: Mapping[str, str],
        version: object,
    ) -> web.StreamResponse:
        """The answer to one POST: an SSE stream ending with it when the session keeps events (opened at once,
        with a priming event), else JSON when nothing came before it, else an SSE stream ending with it."""
        response: web.StreamResponse | None = None
        if stream.resumable:
            response = await self._open_sse(request, headers, stream, version)
        return await self._write(request, stream, request_id, wait_seconds, headers, response)

    async def _write(
        self,
        request: web.Request,
        stream: Stream,
        request_id: RequestId,
        wait_seconds: float,
        headers: Mapping[str, str],
        response: web.StreamResponse | None,
        seen: int = 0,
    ) -> web.StreamResponse:
        """What comes on `stream` until the answer to `request_id` (events up to `seen` were sent already)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        stream.writer = asyncio.current_task()
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                timed_out = UpstreamTimeoutError(
                    f"Upstream did not answer within {wait_seconds:g} s", request_id=request_id
                )
                if response is None:
                    raise timed_out
                await response.write(frame(dumps(error_message(request_id, timed_out.error_object())).decode()))
                stream.answered = True
                await response.write_eof()
                return response
            try:
                queued = await asyncio.wait_for(stream.queue.get(), min(KEEPALIVE_SECONDS, remaining))
            except TimeoutError:
                if remaining > KEEPALIVE_SECONDS and stream.sse:
                    response = response or await self._open_sse(request, headers)
                    await response.write(KEEPALIVE)
                continue
            assert queued is not None  # only the GET stream is ended with None
            event, message = queued
            if event is not None and event.seq <= seen:
                continue  # replayed already
            final = "method" not in message and message.get("id") == request_id
            if final and response is None:
                stream.answered = True
                return web.Response(body=dumps(message), content_type="application/json", headers=headers)
            response = response or await self._open_sse(request, headers)
            await response.write(legacy_events.frame_of(event) if event else frame(dumps(message).decode()))
            if final:
                stream.answered = True
                await response.write_eof()
                return response

    async def _open_sse(
        self,
        request: web.Request,
        headers: Mapping[str, str],
        stream: Stream | None = None,
        version: object = None,
    ) -> web.StreamResponse:
        """An SSE response; for a resumable stream of a 2025-11-25 client it opens with a priming event."""
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
        await response.prepare(request)
        if stream is not None and stream.events is not None and legacy_events.primes(version):
            await response.write(legacy_events.priming_frame(stream.events.next_id(stream.number)))
        return response

    # --- GET -----------------------------------------------------------------------------------------------

    async def _get(self, request: web.Request) -> web.StreamResponse:
        """The standalone stream: what the process sends that no open POST takes, until the session ends. With
        `Last-Event-ID` naming one of this session's streams: that stream resumed."""
        if "text/event-stream" not in request.headers.get("Accept", ""):
            raise InvalidRequestError("Not Acceptable: the GET stream is text/event-stream", http_status=406)
        session = self._session(request)
        last = request.headers.get("Last-Event-ID")
        resumed = legacy_events.position(last) if last is not None and session.events is not None else None
        if resumed is not None and session.events is not None and session.events.known_stream(resumed[0]):
            number, seq = resumed
            if number != legacy_events.GET_STREAM:
                return await self._resume_post(request, session, number, seq)
            await _stop_writer(session.get)  # back before its old GET was seen to break: it stops first
            replay = session.events.after(number, seq)
        else:
            replay = []
        stream = session.open(None, True)
        stream.writer = asyncio.current_task()
        self._busy(session)
        version = request.headers.get(VERSION_HEADER)
        try:
            response = await self._open_sse(request, {SESSION_HEADER: session.id}, stream, version)
            for stored in replay:
                await response.write(legacy_events.frame_of(stored))
            while True:
                try:
                    queued = await asyncio.wait_for(stream.queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    await response.write(KEEPALIVE)
                    continue
                if queued is None:
                    break
                event, message = queued
                await response.write(legacy_events.frame_of(event) if event else frame(dumps(message).decode()))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away
        finally:
            session.close(stream)
            self._idle(session)
        return response

    async def _resume_post(
        self, request: web.Request, session: LegacySession, number: int, seq: int
    ) -> web.StreamResponse:
        """A POST's answer stream again, from after event `seq`: what it missed, then the rest until the answer
        (at once when the answer came already: then only what is still held)."""
        assert session.events is not None
        stream = session.post_stream(number)
        if stream is not None and stream.attached:
            await _stop_writer(stream)  # back before its old connection was seen to break: that one stops first
            stream = session.post_stream(number)
        replay = session.events.after(number, seq)
        headers = {SESSION_HEADER: session.id}
        if stream is None:  # answered (or given up) already: what is held of it, and the stream ends
            response = await self._open_sse(request, headers)
            for event in replay:
                await response.write(legacy_events.frame_of(event))
            await response.write_eof()
            return response
        assert stream.request_id is not None
        stream.attached = True
        self._busy(session)
        try:
            response = await self._open_sse(request, headers, stream, request.headers.get(VERSION_HEADER))
            for event in replay:
                await response.write(legacy_events.frame_of(event))
            if any(
                legacy_events.answers(event, stream.request_id) for event in replay
            ):  # taken, not delivered, by the old one
                stream.answered = True
                await response.write_eof()
                return response
            seen = replay[-1].seq if replay else seq
            wait = self.config.call_timeout_seconds
            return await self._write(request, stream, stream.request_id, wait, headers, response, seen)
        finally:
            session.let_go(stream)
            self._idle(session)

    # --- the end of a session ----------------------------------------------------------------------------

    def _make_room(self) -> None:
        """At `upstream.max_processes`, a new session ends the least recently active one with no stream open
        (its client gets 404 next time and initializes again), unless one is already ending."""
        if any(session.ended is not None for session in self.live):
            return
        idle = [session for session in self.sessions.values() if not session.busy]
        if idle:
            oldest = min(idle, key=lambda session: session.active_at)
            reason = "ended to make room for a new session (upstream.max_processes)"
            self.shared.spawn(self.end(oldest, reason), "legacy-session-evict")

    def _busy(self, session: LegacySession) -> None:
        if session.idle_timer is not None:
            session.idle_timer.cancel()
            session.idle_timer = None

    def _idle(self, session: LegacySession) -> None:
        """With no stream open, the session ends after `upstream.process_idle_seconds`."""
        session.active_at = asyncio.get_running_loop().time()
        if session.busy or session.ended is not None:
            return
        self._busy(session)
        session.idle_timer = asyncio.get_running_loop().call_later(
            self.config.process_idle_seconds,
            lambda: self.shared.spawn(self.end(session, "the session was idle too long"), "legacy-session-idle"),
        )

    async def end(self, session: LegacySession, reason: str) -> None:
        """End the session and stop its process (close stdin, SIGTERM, SIGKILL); idempotent."""
        self.sessions.pop(session.id, None)
        session.end(reason)
        if session.process is not None:
            await session.process.stop()

    def _exited(self, session: LegacySession, exited: ProcessExit) -> None:
        """The process is gone (stopped, or by itself): its room in the pool is free again."""
        self.sessions.pop(session.id, None)
        self.live.discard(session)
        name = session.process.name if session.process is not None else self.shared.program
        session.end(f"Upstream stdio server {name} {exited}")
        self.pool.unreserve()
        if not exited.requested:
            self.shared.crashed(exited.lived_seconds)

    async def close(self) -> None:
        """Shutdown: every legacy session ends and its process is stopped (awaited)."""
        sessions = list(self.live)
        await asyncio.gather(*(self.end(session, "the proxy is shutting down") for session in sessions))


async def _stop_writer(stream: Stream | None) -> None:
    """End the request that writes `stream` to a client, and wait until it has let go of it: a resumed stream
    has one reader, and what the old one took and did not deliver is in the store."""
    writer = stream.writer if stream is not None else None
    if writer is None or writer is asyncio.current_task() or writer.done():
        return
    writer.cancel()
    await asyncio.wait({writer})
