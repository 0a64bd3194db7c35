"""Server-Sent Events framing: an incremental parser for upstream streams and the writer's frame format.

Pure (no I/O): `SSEParser.feed(bytes)` returns the events completed by those bytes, following the WHATWG
event-stream rules (CR, LF or CRLF line ends; `data` lines joined by LF; comments ignored).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


class SSEParser:
    def __init__(self) -> None:
        self._buffer = ""
        self._decoder_tail = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        raw = self._decoder_tail + chunk
        try:
            text = raw.decode("utf-8")
            self._decoder_tail = b""
        except UnicodeDecodeError as exc:
            # Keep an incomplete multi-byte sequence for the next chunk.
            if exc.start >= len(raw) - 3 and exc.reason == "unexpected end of data":
                text = raw[: exc.start].decode("utf-8")
                self._decoder_tail = raw[exc.start :]
            else:
                text = raw.decode("utf-8", errors="replace")
                self._decoder_tail = b""
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = False
        self._buffer += text
        events: list[SSEEvent] = []
        while True:
            index = _line_end(self._buffer)
            if index < 0:
                break
            line = self._buffer[:index]
            if self._buffer[index] == "\r":
                if index + 1 < len(self._buffer):
                    skip = 2 if self._buffer[index + 1] == "\n" else 1
                else:
                    self._pending_cr = True
                    skip = 1
            else:
                skip = 1
            self._buffer = self._buffer[index + skip :]
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        elif field == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = ""
            if self._retry is not None:
                # A priming event (id + retry, no data) still tells the reader where the stream stands.
                event = SSEEvent(data="", event="", id=self._id, retry_ms=self._retry)
                self._retry = None
                return event
            return None
        event = SSEEvent(data="\n".join(self._data), event=self._event or "message", id=self._id, retry_ms=self._retry)
        self._data = []
        self._event = ""
        self._retry = None
        return event


def _line_end(buffer: str) -> int:
    cr = buffer.find("\r")
    lf = buffer.find("\n")
    if cr < 0:
        return lf
    if lf < 0:
        return cr
    return min(cr, lf)


def frame(data: str, event: str | None = "message", event_id: str | None = None) -> bytes:
    """One SSE event; multi-line data becomes several `data:` lines."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event:
        lines.append(f"event: {event}")
    lines.extend(f"data: {part}" for part in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


KEEPALIVE = b": keep-alive\n\n"
