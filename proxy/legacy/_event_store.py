"""The SSE event store of the proxy's own 2025-11-25 server for a stdio upstream's legacy clients, one per
session: ids unique across the session's streams, events kept up to `max_bytes` for a `Last-Event-ID` resume.
Pure bookkeeping and framing; imports the JSON helpers and the SSE frame format only."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from proxy.errors import RequestId
from proxy.wire.jsonrpc import JSON, dumps, loads
from proxy.wire.sse import frame

# Spec: https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#resumability-and-redelivery
#
# Every stream of a session (each POST's answer stream, and the GET stream) has a number; every event sent on it gets
# the id `<stream>-<seq>`, with one sequence per session, so ids are unique across the session's streams and name the
# stream they belong to. The messages are kept, oldest first out, while their JSON totals at most `max_bytes`, so a
# client whose stream broke can resume it (GET with `Last-Event-ID`) and get what came after on that stream only,
# never another's. Pure bookkeeping and framing: no I/O, no aiohttp, no process; imports the JSON helpers and the SSE
# frame format only.

GET_STREAM: Final = 0  # the number of the session's GET stream (it keeps it across reconnections)
RETRY_MS: Final = 1000  # the `retry` field of a priming event: how long a client waits before it reconnects
FIRST_PRIMED_VERSION: Final = "2025-11-25"  # older clients cannot read a priming event (empty data)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    event_id: str
    stream: int
    seq: int
    data: bytes  # the message as sent


def position(event_id: str) -> tuple[int, int] | None:
    """The stream and sequence number an event id names, or None when it is none of ours."""
    stream, _, seq = event_id.partition("-")
    if not (stream.isdigit() and seq.isdigit()):
        return None
    return int(stream), int(seq)


def primes(protocol_version: object) -> bool:
    """Whether a client of this protocol version gets priming events (none sent: a version before 2025-06-18)."""
    return isinstance(protocol_version, str) and protocol_version >= FIRST_PRIMED_VERSION


def priming_frame(event_id: str) -> bytes:
    """The event a stream opens with: an id to resume from, empty data, and how long to wait before that."""
    return f"retry: {RETRY_MS}\n".encode() + frame("", None, event_id)


def frame_of(event: StoredEvent) -> bytes:
    return frame(event.data.decode(), event_id=event.event_id)


def answers(event: StoredEvent, request_id: RequestId) -> bool:
    """Whether the event is the answer to `request_id` (which ends a POST's stream)."""
    message = loads(event.data)
    return isinstance(message, dict) and "method" not in message and message.get("id") == request_id


class SessionEvents:
    """The events of one legacy session's streams, bounded by the bytes of the messages they hold."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._streams = 0  # the last stream number given out (GET_STREAM is never given out)
        self._seq = 0
        self._events: deque[StoredEvent] = deque()
        self._bytes = 0

    def new_stream(self) -> int:
        self._streams += 1
        return self._streams

    def known_stream(self, stream: int) -> bool:
        return 0 <= stream <= self._streams

    def next_id(self, stream: int) -> str:
        """An id for an event that is not kept (a priming event): later ones of the stream follow it."""
        self._seq += 1
        return f"{stream}-{self._seq}"

    def add(self, stream: int, message: JSON) -> StoredEvent:
        """Store one message sent (or to be sent) on `stream`; the oldest events go beyond `max_bytes`."""
        event_id = self.next_id(stream)
        event = StoredEvent(event_id, stream, self._seq, dumps(message))
        self._events.append(event)
        self._bytes += len(event.data)
        while self._bytes > self.max_bytes and self._events:
            self._bytes -= len(self._events.popleft().data)
        return event

    def after(self, stream: int, seq: int) -> list[StoredEvent]:
        """The events of `stream` after `seq` still held, oldest first."""
        return [event for event in self._events if event.stream == stream and event.seq > seq]

    @property
    def held_bytes(self) -> int:
        return self._bytes
