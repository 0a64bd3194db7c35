"""The legacy front for a stdio upstream: a 2025-11-25 Streamable HTTP server that the proxy serves itself.

Spec: https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#streamable-http

A legacy client (`initialize`, `Mcp-Session-Id`) cannot be relayed byte for byte to a server that speaks only
stdio, so the proxy serves the transport. `initialize` starts a server process of the client's own (counted
against `upstream.max_processes`) and mints the session id; the client's own `initialize` goes to it, so the
server sees the client's capabilities and version. Every message of the client goes to the process's stdin
unchanged, ids included (the process has no other client), and what the process writes comes back:

- a response, to the POST that waits for it: as JSON when nothing came before it, else as the last event of
  an SSE stream;
- `notifications/progress`, to the POST whose request carries its token;
- anything else (server→client requests, log messages, list changes; stdio says nothing of what they belong
  to): to the only POST open, else the GET stream, else the oldest POST open; with no stream open, a few are
  held for the next stream to open.

DELETE ends the session (the process is stopped: it was initialized for that client and cannot serve
another); so does `upstream.process_idle_seconds` with no stream open, and the process ending. A request
naming an ended session gets 404, which tells the client to initialize again. A session is bound to the
principal header that opened it. Imports aiohttp's web side, the stdio link and process layer, and the pool's
`Room`; never tasks.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from aiohttp import web
from mcp_types import jsonrpc as codes

from proxy.config import StdioUpstreamConfig
from proxy.errors import InvalidRequestError, RequestId, UpstreamError, UpstreamTimeoutError
from proxy.upstream.session import Room, principal_key
from proxy.upstream.stdio.link import StdioLink
from proxy.upstream.stdio.process import ProcessExit, StdioProcess
from proxy.upstream.stdio.session import MAX_QUEUED_EVENTS
from proxy.wire.jsonrpc import JSON, Request, classify, dumps, error_message, loads
from proxy.wire.sse import KEEPALIVE, frame

log = structlog.get_logger(__name__)

SESSION_HEADER: Final = "Mcp-Session-Id"
KEEPALIVE_SECONDS: Final = 15.0  # SSE comment on a quiet stream, so intermediaries keep it open
HELD_MESSAGES: Final = 64  # messages for a client with no stream open, kept until one opens (oldest dropped)
SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SessionNotFoundError(InvalidRequestError):
    http_status = 404
    default_message = "Session not found: initialize a new session"


@dataclass(eq=False)
class _Stream:
    """Where messages for the client go: a POST waiting for the answer to `request_id`, or the GET stream."""

    request_id: RequestId | None  # None: the GET stream
    sse: bool  # the client accepts an SSE stream here
    queue: asyncio.Queue[JSON | None] = field(default_factory=asyncio.Queue)

    def offer(self, message: JSON | None) -> None:
        if message is not None and "id" not in message and self.queue.qsize() >= MAX_QUEUED_EVENTS:
            return  # a client that fell this far behind loses notifications, never answers or questions
        self.queue.put_nowait(message)


class LegacySession:
    """One legacy client's session: its server process and the client's open streams."""

    def __init__(self, session_id: str, principal: str) -> None:
        self.id = session_id
        self.principal = principal  # hashed
        self.process: StdioProcess | None = None
        self.posts: dict[RequestId, _Stream] = {}  # open POSTs by request id, oldest first
        self.get: _Stream | None = None
        self.progress: dict[str | int, RequestId] = {}  # progress token → the request that carries it
        self.held: deque[JSON] = deque(maxlen=HELD_MESSAGES)
        self.ended: str | None = None  # why the session ended
        self.idle_timer: asyncio.TimerHandle | None = None
        self.active_at = 0.0  # loop time the client last had a stream open

    @property
    def busy(self) -> bool:
        return bool(self.posts) or self.get is not None

    def open(self, request_id: RequestId | None, sse: bool, progress_token: Any = None) -> _Stream:
        stream = _Stream(request_id, sse)
        if request_id is None:
            if self.get is not None:
                raise InvalidRequestError("Conflict: this session's GET stream is already open", http_status=409)
            self.get = stream
        else:
            if request_id in self.posts:
                raise InvalidRequestError(
                    "Invalid Request: a request with this id is still open", request_id=request_id
                )
            self.posts[request_id] = stream
            if isinstance(progress_token, str | int) and not isinstance(progress_token, bool):
                self.progress[progress_token] = request_id
        if sse:
            while self.held:
                stream.offer(self.held.popleft())
        return stream

    def close(self, stream: _Stream) -> None:
        if stream is self.get:
            self.get = None
        elif stream.request_id is not None and self.posts.get(stream.request_id) is stream:
            del self.posts[stream.request_id]
            for token, request_id in list(self.progress.items()):
                if request_id == stream.request_id:
                    del self.progress[token]

    def route(self, message: JSON) -> None:
        """One message the process wrote: to the stream it belongs to (see the module doc)."""
        if "method" not in message:
            request_id = message.get("id")
            stream = self.posts.get(request_id) if isinstance(request_id, str | int) else None
            if stream is not None:
                stream.offer(message)
            return  # an answer nobody waits for any more (the client left): dropped
        params = message.get("params")
        if message["method"] == "notifications/progress" and isinstance(params, dict):
            token = params.get("progressToken")
            progressed = self.progress.get(token) if isinstance(token, str | int) else None
            if progressed is not None and self.posts[progressed].sse:
                self.posts[progressed].offer(message)
                return
        sse_posts = [stream for stream in self.posts.values() if stream.sse]
        if len(sse_posts) == 1:
            sse_posts[0].offer(message)
        elif self.get is not None:
            self.get.offer(message)
        elif sse_posts:
            sse_posts[0].offer(message)
        else:
            self.held.append(message)

    def end(self, reason: str) -> None:
        """Every open POST gets an error answer saying why; the GET stream ends."""
        if self.ended is not None:
            return
        self.ended = reason
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        for request_id, stream in self.posts.items():
            stream.offer(error_message(request_id, {"code": codes.INTERNAL_ERROR, "message": reason}))
        if self.get is not None:
            self.get.offer(None)


class StdioLegacyServer:
    """Serves legacy clients on the proxy's endpoint when the upstream is a stdio server (`relay()`, as the
    pass-through does for an HTTP upstream)."""

    def __init__(self, link: StdioLink, room: Room, config: StdioUpstreamConfig, principal_header: str) -> None:
        self.link = link
        self.pool = room  # each session's process counts against upstream.max_processes, as the pool's own do
        self.config = config
        self.principal_header = principal_header
        self.sessions: dict[str, LegacySession] = {}  # by id: the sessions clients may still use
        self.live: set[LegacySession] = set()  # sessions whose process has not exited yet (ended ones too)

    async def relay(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        if request.method == "POST":
            return await self._post(request, body or b"")
        if request.method == "GET":
            return await self._get(request)
        if request.method == "DELETE":
            await self.end(self._session(request), "the client ended the session")
            return web.Response(status=200)
        return web.Response(status=405, headers={"Allow": "GET, POST, DELETE"})

    def _session(self, request: web.Request) -> LegacySession:
        session_id = request.headers.get(SESSION_HEADER)
        if session_id is None:
            raise InvalidRequestError(f"Bad Request: the {SESSION_HEADER} header is required")
        session = self.sessions.get(session_id)
        if session is None or session.principal != principal_key(request.headers.get(self.principal_header)):
            raise SessionNotFoundError()
        return session

    # --- POST ----------------------------------------------------------------------------------------------

    async def _post(self, request: web.Request, body: bytes) -> web.StreamResponse:
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
        stream = session.open(message.id, sse, token)
        self._busy(session)
        try:
            await self._send(session, message.raw)
            return await self._answer(request, stream, message.id, self.config.call_timeout_seconds, {})
        finally:
            session.close(stream)
            self._idle(session)

    async def _initialize(self, request: web.Request, message: Request, sse: bool) -> web.StreamResponse:
        await self.pool.reserve(self._make_room)
        session = LegacySession(secrets.token_urlsafe(24), principal_key(request.headers.get(self.principal_header)))
        try:
            session.process = await self.link.start(session.route, lambda exited: self._exited(session, exited))
        except BaseException:
            self.pool.unreserve()
            raise
        self.sessions[session.id] = session
        self.live.add(session)
        log.info("legacy_session_started", upstream=session.process.name)
        stream = session.open(message.id, sse)
        timeout = self.config.connect_timeout_seconds
        try:
            await self._send(session, message.raw)
            response = await self._answer(request, stream, message.id, timeout, {SESSION_HEADER: session.id})
        except BaseException:
            self.link.spawn(self.end(session, "initialize did not succeed"), "legacy-session-end")
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
        stream: _Stream,
        request_id: RequestId,
        wait_seconds: float,
        headers: Mapping[str, str],
    ) -> web.StreamResponse:
        """The answer to one POST: JSON when nothing came before it, else an SSE stream ending with it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        response: web.StreamResponse | None = None
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                timed_out = UpstreamTimeoutError(
                    f"Upstream did not answer within {wait_seconds:g} s", request_id=request_id
                )
                if response is None:
                    raise timed_out
                await response.write(frame(dumps(error_message(request_id, timed_out.error_object())).decode()))
                await response.write_eof()
                return response
            try:
                message = await asyncio.wait_for(stream.queue.get(), min(KEEPALIVE_SECONDS, remaining))
            except TimeoutError:
                if remaining > KEEPALIVE_SECONDS and stream.sse:
                    response = response or await self._open_sse(request, headers)
                    await response.write(KEEPALIVE)
                continue
            assert message is not None  # only the GET stream is ended with None
            final = "method" not in message and message.get("id") == request_id
            if final and response is None:
                return web.Response(body=dumps(message), content_type="application/json", headers=headers)
            response = response or await self._open_sse(request, headers)
            await response.write(frame(dumps(message).decode()))
            if final:
                await response.write_eof()
                return response

    async def _open_sse(self, request: web.Request, headers: Mapping[str, str]) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **headers})
        await response.prepare(request)
        return response

    # --- GET -----------------------------------------------------------------------------------------------

    async def _get(self, request: web.Request) -> web.StreamResponse:
        """The standalone stream: what the process sends that no open POST takes, until the session ends."""
        if "text/event-stream" not in request.headers.get("Accept", ""):
            raise InvalidRequestError("Not Acceptable: the GET stream is text/event-stream", http_status=406)
        session = self._session(request)
        stream = session.open(None, True)
        self._busy(session)
        response = await self._open_sse(request, {SESSION_HEADER: session.id})
        try:
            while True:
                try:
                    message = await asyncio.wait_for(stream.queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    await response.write(KEEPALIVE)
                    continue
                if message is None:
                    break
                await response.write(frame(dumps(message).decode()))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away
        finally:
            session.close(stream)
            self._idle(session)
        return response

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
            self.link.spawn(self.end(oldest, reason), "legacy-session-evict")

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
            lambda: self.link.spawn(self.end(session, "the session was idle too long"), "legacy-session-idle"),
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
        name = session.process.name if session.process is not None else self.link.program
        session.end(f"Upstream stdio server {name} {exited}")
        self.pool.unreserve()
        if not exited.requested:
            self.link.crashed(exited.lived_seconds)

    async def close(self) -> None:
        """Shutdown: every legacy session ends and its process is stopped (awaited)."""
        sessions = list(self.live)
        await asyncio.gather(*(self.end(session, "the proxy is shutting down") for session in sessions))
