"""A legacy client's session with its own stdio server process, and which of its streams gets what the process
writes (`LegacySession.route`). Imports the stdio process layer and the wire; no aiohttp (the server writes)."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from mcp_types import jsonrpc as codes

from proxy.errors import InvalidRequestError, RequestId
from proxy.legacy import _event_store as legacy_events
from proxy.legacy._event_store import SessionEvents, StoredEvent
from proxy.upstream.stdio.process import StdioProcess
from proxy.upstream.stdio.session import MAX_QUEUED_EVENTS
from proxy.wire.jsonrpc import JSON, error_message

# Which stream gets what the process writes (`LegacySession.route`): a response to the POST waiting for it, progress
# to the POST whose request carries the token, anything else to the only POST open, else the GET stream, else the
# oldest POST open, else held for the next stream. Each stream's events are kept for a resume when the session has an
# event store (`_event_store.py`). Imports the stdio process layer and the wire; no aiohttp (the server,
# `_stdio_server.py`, writes the streams).

log = structlog.get_logger(__name__)

SESSION_HEADER: Final = "Mcp-Session-Id"
KEEPALIVE_SECONDS: Final = 15.0  # SSE comment on a quiet stream, so intermediaries keep it open
HELD_MESSAGES: Final = 64  # messages for a client with no stream open, kept until one opens (oldest dropped)
SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
VERSION_HEADER: Final = "MCP-Protocol-Version"


class SessionNotFoundError(InvalidRequestError):
    http_status = 404
    default_message = "Session not found: initialize a new session"


Queued = tuple[StoredEvent | None, JSON]  # a message for the client, with its event when the session keeps them


@dataclass(eq=False)
class Stream:
    """Where messages for the client go: a POST waiting for the answer to `request_id`, or the GET stream.
    With an event store, each message is stored as an event of stream `number` as it is routed here, whether
    a client reads the stream right now or not (`attached`), so that it can be resumed."""

    request_id: RequestId | None  # None: the GET stream
    sse: bool  # the client accepts an SSE stream here
    events: SessionEvents | None = None
    number: int = legacy_events.GET_STREAM
    attached: bool = True  # a client reads it (a POST left by its client stays open for a resume until answered)
    answered: bool = False  # the answer to `request_id` was written
    writer: asyncio.Task[Any] | None = None  # the request handler writing it to its client, if any
    queue: asyncio.Queue[Queued | None] = field(default_factory=asyncio.Queue)

    def offer(self, message: JSON | None) -> None:
        if message is not None and "id" not in message and self.queue.qsize() >= MAX_QUEUED_EVENTS:
            return  # a client that fell this far behind loses notifications, never answers or questions
        if message is None:
            self.queue.put_nowait(None)
            return
        event = self.events.add(self.number, message) if self.events is not None and self.sse else None
        self.queue.put_nowait((event, message))

    @property
    def resumable(self) -> bool:
        return self.events is not None and self.sse


class LegacySession:
    """One legacy client's session: its server process and the client's open streams."""

    def __init__(self, session_id: str, principal: str, events: SessionEvents | None = None) -> None:
        self.id = session_id
        self.principal = principal  # hashed
        self.events = events  # None: streams are not resumable (`limits.legacy_replay_bytes` is 0)
        self.process: StdioProcess | None = None
        self.posts: dict[RequestId, Stream] = {}  # open POSTs by request id, oldest first
        self.get: Stream | None = None
        self.progress: dict[str | int, RequestId] = {}  # progress token → the request that carries it
        self.held: deque[JSON] = deque(maxlen=HELD_MESSAGES)
        self.ended: str | None = None  # why the session ended
        self.idle_timer: asyncio.TimerHandle | None = None
        self.active_at = 0.0  # loop time the client last had a stream open

    @property
    def busy(self) -> bool:
        return any(stream.attached for stream in self.posts.values()) or self.get is not None

    def open(
        self, request_id: RequestId | None, sse: bool, progress_token: Any = None, *, resumable: bool = True
    ) -> Stream:
        stream = Stream(request_id, sse, self.events if resumable else None)
        if request_id is not None and stream.events is not None:
            stream.number = stream.events.new_stream()
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

    def let_go(self, stream: Stream) -> None:
        """The client stopped reading `stream`: a POST not answered yet stays open for a resume (its events
        are stored as they come, and it closes with its answer); anything else closes."""
        if stream.resumable and stream.request_id is not None and not stream.answered and self.ended is None:
            stream.attached = False
            return
        self.close(stream)

    def post_stream(self, number: int) -> Stream | None:
        """The open POST whose answer stream is `number` (a client may resume it)."""
        for stream in self.posts.values():
            if stream.number == number and stream.resumable:
                return stream
        return None

    def close(self, stream: Stream) -> None:
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
                if not stream.attached:  # stored for a resume; nothing more comes on that stream
                    self.close(stream)
            return  # an answer nobody waits for any more (the client left): dropped
        params = message.get("params")
        if message["method"] == "notifications/progress" and isinstance(params, dict):
            token = params.get("progressToken")
            progressed = self.progress.get(token) if isinstance(token, str | int) else None
            if progressed is not None and self.posts[progressed].sse:
                self.posts[progressed].offer(message)
                return
        sse_posts = [stream for stream in self.posts.values() if stream.sse and stream.attached]
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
