"""The HTTP/1.1 client's protocol core, sans-IO in the manner of h11: a request (method, target, headers, body)
becomes bytes, every name and value checked by `proxy.wire.fields` before anything is written; bytes read back
become a response's events (its head, body data, its end), each part of the head bounded as h11's
`max_incomplete_event_size` bounds it. Parsing is llhttp's (httptools: bytes fed, callbacks), the caps are
enforced here. No sockets, no event loop, no aiohttp: `lean.py` does the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, NoReturn, Protocol

import httptools

from proxy.wire.fields import FieldError, check_name, check_target, check_value

# --- errors: the client's own -----------------------------------------------------------------------------------


class H1Error(Exception):
    """Anything that ends an exchange on the HTTP/1.1 client: the connection cannot carry another request."""


class H1RequestError(H1Error):
    """A request this client refuses to write (a header name or value, the Host or the target fails the wire
    checks of RFC 9110 §5 and RFC 9112 §3.2): nothing of it was written. Its message names the header, never the
    value."""


class H1ProtocolError(H1Error):
    """The answer is not valid HTTP/1.1 (RFC 9112), or came when no request was waiting for one."""


class H1LimitError(H1ProtocolError):
    """A part of the answer's head (status line, a header line, the count of headers, the whole head, a chunk-size
    line or the trailers) is larger than the client's limit: refused before it is held whole."""

    def __init__(self, limit: str, maximum: int) -> None:
        super().__init__(f"the upstream's answer is over the client's limit {limit} = {maximum}")
        self.limit = limit
        self.maximum = maximum


class H1ConnectionError(H1Error):
    """The connection could not be made, or ended before the answer did (closed or reset before the head, in
    it, or in a body framed by Content-Length or chunked; reset in a body that ends with the connection).
    `answered` says whether the answer's head had arrived."""

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class H1TimeoutError(H1Error):
    """The exchange's deadline passed (connect, or the whole answer)."""


# --- limits -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    """How large each incomplete part of an answer may grow (bytes, CRLF included) before it is refused: the
    same bounds as aiohttp's client (8 KiB lines) and h11 (64 KiB heads), with room for large cookies."""

    max_status_line_bytes: int = 8 * 1024
    max_header_line_bytes: int = 16 * 1024  # a Set-Cookie or WWW-Authenticate may be long; 16 KiB is ample
    max_headers: int = 256  # aiohttp's client allows far more; no MCP server sends a tenth of this
    max_head_bytes: int = 64 * 1024  # every head of one exchange, interim (1xx) answers included
    max_chunk_line_bytes: int = 4 * 1024  # a chunk-size line with its extensions, or the trailer section


DEFAULT_LIMITS: Final = Limits()

# --- requests -------------------------------------------------------------------------------------------------

_FRAMING: Final = frozenset({"content-length", "transfer-encoding"})  # the body's length is the client's to say
_METHODS: Final = frozenset({"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"})
_NAMES_KEPT: Final = 512  # header names seen valid, kept with their kind so that each is checked once
_WRITTEN, _DROPPED, _HOST = 0, 1, 2  # what the writer does with a header of a name: writes, drops, takes as Host


def _kind(name: str) -> int:
    lowered = name.lower()
    return _DROPPED if lowered in _FRAMING else _HOST if lowered == "host" else _WRITTEN


class RequestWriter:
    """Turns requests into bytes for one origin. Every header name is a token, every value (Host included) a
    valid field value, the target origin-form (`proxy.wire.fields`); the caller's Content-Length and
    Transfer-Encoding are dropped (the length is said here), a Host of the caller's replaces the origin's."""

    def __init__(self, host: str) -> None:
        try:
            self.host = check_value("Host", host)
        except FieldError as exc:
            raise H1RequestError(str(exc)) from None
        self._kinds: dict[str, int] = {}  # names already found valid (names are no secrets), with their kind

    def request(self, method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
        """The request's bytes; raises H1RequestError (and writes nothing) when a part fails the checks."""
        kinds = self._kinds
        host = self.host
        head = [""]
        try:
            if method not in _METHODS:
                check_name(method)
            check_target(target)
            for name, value in headers:
                kind = kinds.get(name)  # one lookup: the name's check, once, and what to do with it
                if kind is None:
                    kind = _kind(check_name(name))
                    if len(kinds) < _NAMES_KEPT:
                        kinds[name] = kind
                # `is_safe_value`'s common case, spared a call: printable text (a printable character that is
                # whitespace can only be a space) with none around it; anything else is decided there.
                if not value.isprintable() or value.strip() != value:
                    check_value(name, value)  # raises, naming the header, unless the expression accepts it
                if kind:
                    if kind == _HOST:  # a Host of the caller's (an operator's `upstream.headers`) replaces ours
                        host = value
                    continue
                head.append(f"{name}: {value}\r\n")
        except FieldError as exc:
            raise H1RequestError(str(exc)) from None
        head[0] = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        return "".join(head).encode("utf-8", "surrogateescape") + body


# --- responses ------------------------------------------------------------------------------------------------


class Sink(Protocol):
    """Where a reader's events go, in order: one head (the final answer's status, reason and headers as sent,
    repeated names kept, in order), any data, then the end."""

    def on_head(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None: ...
    def on_data(self, data: bytes) -> None: ...
    def on_end(self) -> None: ...


_IDLE, _HEAD, _BODY = 0, 1, 2  # no answer awaited; reading a head; reading a final answer's body
_FRAMING_NAME_LENGTHS: Final = frozenset({len("content-length"), len("transfer-encoding")})


class ResponseReader:
    """Reads the answers on one connection, one per request written: `expect()` after each request (naming the
    sink of that answer's events, or keeping the last one), then `feed()` the bytes as they arrive and
    `closed()` when the connection ends. Raises H1ProtocolError, H1LimitError or H1ConnectionError; after one,
    the connection must be closed. Interim (1xx) answers are skipped (RFC 9110 §15.2); the body is framed by
    chunked, Content-Length or the connection's end (RFC 9112 §6.3). `keep_alive` says, after the end, whether
    the connection may carry another request."""

    def __init__(self, sink: Sink, limits: Limits = DEFAULT_LIMITS) -> None:
        self.sink = sink
        self._limits = limits
        # (each limit read once here: the callbacks below run for every header of every answer)
        self._max_status = limits.max_status_line_bytes
        self._max_line = limits.max_header_line_bytes - 4  # the name and value, without ": " and CRLF
        self._max_headers = limits.max_headers
        self._max_head = limits.max_head_bytes
        self._max_chunk_line = limits.max_chunk_line_bytes
        self._parser = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self._error: H1Error | None = None  # raised in a callback, raised again by `feed`
        self.keep_alive = False
        self._reason = bytearray()
        # The head's headers as they arrive (their count is the count the limit bounds); after the head, a list
        # of its own for the trailers, counted against the same limits and dropped.
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._until_close = False
        self._chunked = False  # Transfer-Encoding: chunked
        self._length = False  # a Content-Length
        self._chunk_headers = 0  # chunk-size lines completed during this feed
        self._body_bytes = 0  # body bytes delivered during this feed
        self._framing_bytes = 0  # chunked framing read since the last chunk-size line ended

    def expect(self, sink: Sink | None = None) -> None:
        """A request was written: its answer comes next, its events to `sink` (the reader's last if None)."""
        if self._state != _IDLE:
            raise H1ProtocolError("a request was written while the previous answer is still being read")
        if sink is not None:
            self.sink = sink
        self._state = _HEAD
        self.keep_alive = self._chunked = self._length = False
        self._reason.clear()
        self._headers = []
        self._head_bytes = 0

    @property
    def answered(self) -> bool:
        """Whether the awaited answer's head has arrived (or no answer is awaited)."""
        return self._state != _HEAD

    def feed(self, data: bytes) -> None:
        """Bytes read from the connection."""
        state = self._state
        if state == _HEAD:
            head_bytes = self._head_bytes + len(data)
            if head_bytes > self._max_head:  # only what fits the head's budget is parsed while a head is read
                self._feed_over_budget(data)
                return
            self._head_bytes = head_bytes
        elif state == _IDLE:
            raise H1ProtocolError("the upstream sent bytes no request asked for")
        elif self._chunked:
            self._feed_chunks(data)
            return
        # (a read that ends a head is bounded by the head's budget instead of the chunk-line cap)
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._refused(exc)

    def _feed_over_budget(self, data: bytes) -> None:
        room = self._max_head - self._head_bytes
        self._head_bytes = self._max_head
        try:
            self._parser.feed_data(data[:room])
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._refused(exc)
        if self._state == _HEAD:
            raise H1LimitError("max_head_bytes", self._max_head)
        if rest := data[room:]:
            self.feed(rest)

    def _feed_chunks(self, data: bytes) -> None:
        """A read of a chunked body: what is not body (chunk-size lines, extensions, trailers) is bounded."""
        self._chunk_headers = self._body_bytes = 0
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._refused(exc)
        if self._state == _BODY:
            framing = len(data) - self._body_bytes
            self._framing_bytes = framing if self._chunk_headers else self._framing_bytes + framing
            if self._framing_bytes > self._max_chunk_line:  # to within one read
                raise H1LimitError("max_chunk_line_bytes", self._max_chunk_line)

    def _refused(self, exc: Exception) -> NoReturn:
        if isinstance(exc, httptools.HttpParserUpgrade):
            raise H1ProtocolError("the upstream switched protocols; this client speaks HTTP/1.1 only") from None
        error, self._error = self._error, None
        if error is not None:
            raise error from None
        raise H1ProtocolError(f"the upstream's answer is not valid HTTP/1.1: {exc}") from None

    def closed(self, *, reset: bool = False) -> None:
        """The connection ended, cleanly or (`reset`) abortively. Ends a body framed by the connection's end;
        anything else cut short is an H1ConnectionError, never taken as the answer's end."""
        state, self._state = self._state, _IDLE
        self.keep_alive = False
        if state == _HEAD:
            raise H1ConnectionError("the upstream closed the connection before answering")
        if state == _BODY:
            if self._until_close and not reset:
                self.sink.on_end()
                return
            how = "reset" if reset else "closed"
            raise H1ConnectionError(f"the upstream {how} the connection in the middle of its answer", answered=True)

    def _fail(self, error: H1Error) -> NoReturn:
        self._error = error
        raise error

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self._state != _HEAD:
            self._fail(H1ProtocolError("the upstream sent an answer no request asked for"))

    def on_status(self, status: bytes) -> None:
        reason = self._reason
        reason += status
        if len(reason) > self._max_status:
            self._fail(H1LimitError("max_status_line_bytes", self._max_status))

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self._headers
        if len(headers) >= self._max_headers:
            self._fail(H1LimitError("max_headers", self._max_headers))
        size = len(name)
        if size + len(value) > self._max_line:
            self._fail(H1LimitError("max_header_line_bytes", self._limits.max_header_line_bytes))
        text = value.decode("utf-8", "surrogateescape")
        if size in _FRAMING_NAME_LENGTHS:  # (a trailer's framing names change nothing: the body is chunked)
            lowered = name.lower()
            if lowered == b"content-length":
                self._length = True
            elif lowered == b"transfer-encoding" and "chunked" in text.lower():
                self._chunked = True
        headers.append((name.decode("latin-1"), text))

    def on_headers_complete(self) -> None:
        if self._state != _HEAD:
            return
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the final one follows
            self._reason.clear()
            self._headers = []
            self._chunked = self._length = False
            return
        headers = self._headers
        self._headers = []  # the trailers', if any
        self._state = _BODY
        chunked = self._chunked
        until_close = self._until_close = not chunked and not self._length and status not in (204, 304)
        # RFC 9112 §6.3: with both, chunked wins, and the connection is not reused after
        self.keep_alive = not until_close and not (chunked and self._length) and parser.should_keep_alive()
        self.sink.on_head(status, self._reason.decode("latin-1"), headers)

    def on_chunk_header(self) -> None:
        self._chunk_headers += 1

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self.sink.on_data(body)

    def on_message_complete(self) -> None:
        if self._state == _BODY:
            self._state = _IDLE
            self.sink.on_end()
