"""Server-Sent Events framing: an incremental parser (WHATWG rules, linear in the bytes fed, events bounded in
size) for upstream streams, and the writer's frame format. Sans-IO."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from proxy.wire.fields import is_safe_value


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry_ms: int | None = None


class EventTooLargeError(ValueError):
    """An event (its data, or one unfinished line) grew past the parser's `max_event_chars`."""


class SSEParser:
    """Linear in what it is fed: each chunk is scanned once, and an unfinished line is kept as pieces joined
    only when it ends. With `max_event_chars`, an event whose data (or a single line) grows past it raises
    EventTooLargeError as soon as that happens, so a huge event is never held whole."""

    def __init__(self, max_event_chars: int | None = None) -> None:
        self._max = max_event_chars
        self._partial: list[str] = []  # the pieces of a line not ended yet
        self._partial_chars = 0
        self._data_chars = 0  # characters of the current event's data lines
        self._decoder_tail = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        text = self._decode(chunk)
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = False
        events: list[SSEEvent] = []
        start = 0
        next_cr = text.find("\r")
        next_lf = text.find("\n")
        while True:
            if 0 <= next_cr < start:
                next_cr = text.find("\r", start)
            if 0 <= next_lf < start:
                next_lf = text.find("\n", start)
            index = next_lf if next_cr < 0 else next_cr if next_lf < 0 else min(next_cr, next_lf)
            if index < 0:
                break
            line = text[start:index]
            if self._partial:
                self._partial.append(line)
                line = "".join(self._partial)
                self._partial = []
                self._partial_chars = 0
            if text[index] == "\r":
                if index + 1 < len(text):
                    skip = 2 if text[index + 1] == "\n" else 1
                else:
                    self._pending_cr = True
                    skip = 1
            else:
                skip = 1
            start = index + skip
            event = self._line(line)
            if event is not None:
                events.append(event)
        if start < len(text):
            rest = text[start:]
            self._partial.append(rest)
            self._partial_chars += len(rest)
            self._check()
        return events

    def _decode(self, chunk: bytes) -> str:
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
        return text

    def _check(self) -> None:
        if self._max is not None and self._data_chars + self._partial_chars > self._max:
            raise EventTooLargeError(f"an event over {self._max} characters")

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
            self._data_chars += len(value)
            self._check()
        elif field == "event":
            self._event = value
        elif field == "id" and is_safe_value(value):
            # The spec ignores an id holding NUL; the proxy also one it could not send back as `Last-Event-ID`
            # (RFC 9110 §5.5: no control character, no surrounding whitespace) when it resumes the stream.
            self._id = value
        elif field == "retry" and value.isdigit():
            self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        self._data_chars = 0
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


_LINE_END: Final = re.compile(r"\r\n|\r|\n")


def frame(data: str, event: str | None = "message", event_id: str | None = None) -> bytes:
    """One SSE event; multi-line data becomes several `data:` lines. A CR is a line end to an SSE reader as
    much as LF or CR LF (HTML Living Standard §9.2.5 "Parsing an event stream"), so it splits data lines too:
    no text in `data` can end the event or start a field of its own. `event` and `event_id` are the proxy's own."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event:
        lines.append(f"event: {event}")
    parts = _LINE_END.split(data) if "\r" in data else data.split("\n")  # JSON has no raw CR: the usual path
    lines.extend(f"data: {part}" for part in parts)
    return ("\n".join(lines) + "\n\n").encode()


KEEPALIVE = b": keep-alive\n\n"
