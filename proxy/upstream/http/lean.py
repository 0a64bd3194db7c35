"""The upstream client of the hot path (legacy POSTs relayed, and the POSTs of the proxy's own sessions): POSTs
to one plain-HTTP origin over pooled keep-alive connections, each request written in one `write` and each
answer framed by httptools (llhttp, the C parser uvicorn uses). Imports no other part of the proxy.

Why these do not go through aiohttp's client, which the proxy uses for everything else: a POST costs 171 to 196
µs of CPU in aiohttp's client against 77 to 88 µs in this one (`python -m benchmarks.clients`, two runs), the
largest single share of the hop (README, Benchmarks). A relayed request needs little of what aiohttp's client
does: no cookie jar (a shared one would hand one client's cookies to the next), no redirects, no decompression,
no proxies, no TLS (an `https` upstream keeps aiohttp's client), and the body is already in hand. What it does
need is here:
- the answer's status, reason and headers as sent (repeated names kept), 1xx interim answers skipped;
- the body handed on chunk by chunk as it arrives, whatever its framing (Content-Length, chunked, or up to the
  connection's end), with flow control: past HIGH_WATER_BYTES unread, the upstream socket is not read;
- the connect timeout, and one deadline for the whole exchange (headers and body), as aiohttp's `total`;
- connections reused only after a complete answer the upstream let stay open, given up after KEEPALIVE_SECONDS
  idle (under common servers' own keep-alive), closed when the reader gives up (the upstream sees its client
  leave, as it would directly);
- errors as aiohttp's client raises them (`ClientError` subclasses, `TimeoutError`), so the relay maps both
  clients' failures by the same rules.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any, Final, Protocol, cast

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

# Idle upstream connections are kept this long for the next request (here and in the proxy's aiohttp clients):
# under the keep-alive of common servers (uvicorn and Node close idle connections after 5 s), so the proxy gives
# one up before the server does and never sends a request on a connection the server is closing.
KEEPALIVE_SECONDS: Final = 4.0
# Unread body bytes past which the upstream socket stops being read until the relay has caught up.
HIGH_WATER_BYTES: Final = 1 << 20
LOW_WATER_BYTES: Final = HIGH_WATER_BYTES // 4
_FRAMING: Final = frozenset({"content-length", "transfer-encoding"})
_NO_HEADERS: Final[CIMultiDictProxy[str]] = CIMultiDictProxy(CIMultiDict())  # until the answer's are in


class AnswerBody(Protocol):
    def read_nowait(self) -> bytes: ...
    async def readany(self) -> bytes: ...
    def at_eof(self) -> bool: ...
    def iter_any(self) -> AsyncIterator[bytes]: ...


class HttpAnswer(Protocol):
    """An upstream's answer as both of the proxy's HTTP clients give it (aiohttp's `ClientResponse`, and
    `LeanResponse` below): what the relay and the upstream sessions read of it."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> CIMultiDictProxy[str]: ...
    @property
    def content_type(self) -> str: ...
    @property
    def content_length(self) -> int | None: ...
    @property
    def connection(self) -> object | None: ...
    @property
    def content(self) -> AnswerBody: ...
    async def read(self) -> bytes: ...
    async def text(self) -> str: ...
    def release(self) -> Any: ...
    def close(self) -> None: ...


class LeanResponse:
    """One answer: status, reason and headers once they are in, then the body as it arrives (`read_nowait`,
    `readany`, `iter_any`, `at_eof`, `read`, as aiohttp's `ClientResponse.content`). `release()` after the whole
    body hands the connection back for reuse; `close()` gives it up."""

    def __init__(self, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.reason: str | None = None
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS
        self.content = self  # the body is read off the response itself
        self._connection = connection
        self._loop = loop
        self._headers_in: asyncio.Future[None] = loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._let_go = False  # released or closed

    # --- fed by the connection ---

    def _got_headers(self) -> None:
        if not self._headers_in.done():
            self._headers_in.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > HIGH_WATER_BYTES:
            self._connection.pause_reading()
        self._wake()

    def _feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if self._eof or self._error is not None:
            return
        self._error = error
        if not self._headers_in.done():
            self._headers_in.set_exception(error)
            self._headers_in.exception()  # retrieved: nobody may be waiting any more
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- read by the relay ---

    def read_nowait(self) -> bytes:
        """What has arrived and not been read (b"" if nothing); raises what ended the answer once that is read."""
        if not self._chunks:
            if self._error is not None:
                raise self._error
            return b""
        chunk = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > LOW_WATER_BYTES:
            self._connection.resume_reading()
        self._buffered = 0
        return chunk

    async def readany(self) -> bytes:
        """The next bytes of the body, waiting for some; b"" at its end."""
        while not self._chunks and not self._eof and self._error is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.read_nowait()

    def at_eof(self) -> bool:
        return self._eof and not self._chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk

    @property
    def content_type(self) -> str:
        """The media type, lowercased, without parameters (aiohttp's default when there is none)."""
        value = self.headers.get("Content-Type")
        return value.partition(";")[0].strip().lower() if value else "application/octet-stream"

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def connection(self) -> object | None:
        """The connection while the body is still coming; None once it has all arrived."""
        return None if self._eof else self._connection

    async def text(self) -> str:
        return (await self.read()).decode("utf-8", "replace")

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool once it is in."""
        parts = []
        try:
            while chunk := await self.readany():
                parts.append(chunk)
        except BaseException:
            self.close()  # cut short or given up: the connection cannot carry another request
            raise
        self.release()
        return b"".join(parts)

    def release(self) -> None:
        """The connection goes back to the pool if the body was read whole (closed otherwise); once only: after
        that the connection may be carrying another request, which `release` and `close` leave alone."""
        if not self._let_go:
            self._let_go = True
            self._connection.finished(self)

    def close(self) -> None:
        if not self._let_go:
            self._let_go = True
            self._connection.abort()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to the upstream and the httptools parser of the answers on it."""

    def __init__(self, client: LeanClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: LeanResponse | None = None  # the answer being parsed; None between answers
        self.closed = False
        self.reusable = False
        self.idle_since = 0.0
        self._deadline: asyncio.TimerHandle | None = None
        self._reason = bytearray()
        self._headers: list[tuple[str, str]] = []
        self._until_close = False  # no Content-Length, not chunked: the body ends with the connection

    def start(self, response: LeanResponse, request: bytes, deadline: float) -> None:
        assert self.transport is not None
        self.response = response
        self.reusable = False
        self._reason.clear()
        self._headers.clear()
        self._deadline = response._loop.call_at(deadline, self._timed_out)
        self.transport.write(request)

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports do not subclass asyncio's)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection cannot carry another request
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._end(aiohttp.ClientPayloadError(f"the upstream's answer is not valid HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client.forget(self)
        if self.response is not None:
            if self._until_close and self.response.status:
                self._complete()  # the connection's end is the body's end; nothing is reused
            elif self.response.status:
                self._end(aiohttp.ClientPayloadError("the upstream closed the connection mid-answer"))
            else:
                self._end(aiohttp.ServerDisconnectedError("the upstream closed the connection before answering"))

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.response is None:  # an answer to no request: the connection is not reused
            self.reusable = False

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        response = self.response
        status = self.parser.get_status_code()
        if response is None:
            return
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the final one follows
            self._reason.clear()
            self._headers.clear()
            return
        headers: CIMultiDict[str] = CIMultiDict(self._headers)
        self._headers = []
        response.status = status
        response.reason = self._reason.decode("latin-1") or None
        response.headers = CIMultiDictProxy(headers)
        self.reusable = self.parser.should_keep_alive()
        self._until_close = (
            "Content-Length" not in headers
            and "chunked" not in headers.get("Transfer-Encoding", "").lower()
            and status not in (204, 304)
        )
        response._got_headers()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None and self.response.status:  # not the end of an interim answer
            self._complete()

    # --- ends ---

    def _complete(self) -> None:
        response = self.response
        assert response is not None
        self.response = None
        self._cancel_deadline()
        self._reason.clear()
        response._feed_eof()

    def _end(self, error: BaseException) -> None:
        """The answer cannot complete: its reader gets `error`, and the connection is closed."""
        response = self.response
        self.response = None
        self._cancel_deadline()
        if response is not None:
            response._fail(error)
        self.abort()

    def _timed_out(self) -> None:
        self._deadline = None
        self._end(TimeoutError())

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def finished(self, response: LeanResponse) -> None:
        """`response` was read whole (or not, then the connection cannot be reused)."""
        if self.response is response or not response.at_eof() or not self.reusable or self.closed:
            self.abort()
        else:
            self.client.check_in(self)

    def abort(self) -> None:
        self._cancel_deadline()
        self.reusable = False
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()
            self.client.forget(self)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()


class LeanClient:
    """POSTs to the origin of one `http://` URL over a pool of keep-alive connections (no count limit: the
    proxy's own limits bound what is in flight). `close()` closes every connection."""

    def __init__(self, url: URL, connect_timeout_seconds: float, total_timeout_seconds: float) -> None:
        if url.scheme != "http" or url.host is None or url.port is None:
            raise ValueError(f"the lean client sends to plain http:// URLs only, not {url}")
        self.host, self.port = url.host, url.port
        self.host_header = url.raw_host if url.is_default_port() else f"{url.raw_host}:{url.port}"
        self.connect_timeout = connect_timeout_seconds
        self.total_timeout = total_timeout_seconds
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._reaper: asyncio.TimerHandle | None = None
        self._closed = False

    @classmethod
    def of(cls, url: URL, connect_timeout_seconds: float, total_timeout_seconds: float) -> LeanClient | None:
        """The client for `url`, or None when it is not plain HTTP (an https upstream stays on aiohttp's)."""
        try:
            return cls(url, connect_timeout_seconds, total_timeout_seconds)
        except ValueError:
            return None

    async def post(self, target: str, headers: Iterable[tuple[str, str]], body: bytes) -> LeanResponse:
        """POSTs `body` to `target` (path and query, encoded) with `headers` (Host: the URL's unless they name
        one; Content-Length: set here); returns once the answer's headers are in. Raises aiohttp's `ClientError`s
        or `TimeoutError`."""
        if self._closed:
            raise aiohttp.ClientConnectionError("the proxy's upstream client is closed")
        loop = asyncio.get_running_loop()
        now = loop.time()
        connection = self._checkout(now) or await self._connect(loop)
        host = self.host_header
        head = [""]
        for name, value in headers:
            lowered = name.lower()
            if lowered in _FRAMING:  # the body's length is this client's to say
                continue
            if lowered == "host":  # a Host of the caller's (an operator's `upstream.headers`) replaces the URL's
                host = value
                continue
            head.append(f"{name}: {value}\r\n")
        head[0] = f"POST {target} HTTP/1.1\r\nHost: {host}\r\n"
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        response = LeanResponse(connection, loop)
        connection.start(response, "".join(head).encode("utf-8", "surrogateescape") + body, now + self.total_timeout)
        try:
            await response._headers_in
        except BaseException:
            connection.abort()  # cancelled or failed: the upstream sees its client leave
            raise
        return response

    def _checkout(self, now: float) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()  # the most recently used: the least likely to be timed out
            if not connection.closed and now - connection.idle_since < KEEPALIVE_SECONDS:
                return connection
            connection.abort()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError as exc:
            raise aiohttp.ClientConnectionError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        self._open.add(connection)
        return connection

    def check_in(self, connection: _Connection) -> None:
        if self._closed:
            connection.abort()
            return
        loop = asyncio.get_running_loop()
        connection.idle_since = loop.time()
        self._idle.append(connection)
        if self._reaper is None:
            self._reaper = loop.call_later(KEEPALIVE_SECONDS, self._reap)

    def forget(self, connection: _Connection) -> None:
        self._open.discard(connection)

    def _reap(self) -> None:
        """Idle connections past KEEPALIVE_SECONDS are closed; the check comes back while any stay idle."""
        self._reaper = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        kept = []
        for connection in self._idle:
            if connection.closed or now - connection.idle_since >= KEEPALIVE_SECONDS:
                connection.abort()
            else:
                kept.append(connection)
        self._idle = kept
        if kept:
            self._reaper = loop.call_at(min(c.idle_since for c in kept) + KEEPALIVE_SECONDS, self._reap)

    async def close(self) -> None:
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        self._idle.clear()
        for connection in list(self._open):
            connection.abort()
