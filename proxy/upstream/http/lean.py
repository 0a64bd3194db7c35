"""The upstream client of the hot path (relayed legacy POSTs, and the sessions' own POSTs to a plain-HTTP
upstream): the I/O layer around the sans-IO core of `h1.py`, pooled keep-alive connections, each request
written once it passed the wire checks. Raises the core's own errors; imports the core only."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Final, cast

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from proxy.upstream.http.h1 import (
    DEFAULT_LIMITS,
    H1ConnectionError,
    H1Error,
    H1TimeoutError,
    Limits,
    RequestWriter,
    ResponseReader,
)

# Why these do not go through aiohttp's client, which the proxy uses for everything else: a POST costs 171 to 196
# µs of CPU in aiohttp's client against 77 to 88 µs in this one (`python -m benchmarks.clients`, two runs), the
# largest single share of the hop (docs/benchmarks.md). A relayed request needs little of what aiohttp's client
# does: no cookie jar (a shared one would hand one client's cookies to the next), no redirects, no decompression,
# no proxies, no TLS (an `https` upstream keeps aiohttp's client), and the body is already in hand. What it does
# need is here:
# - the answer's status, reason and headers as sent (repeated names kept), 1xx interim answers skipped, each part
#   of the head bounded (`h1.Limits`);
# - the body handed on chunk by chunk as it arrives, whatever its framing (Content-Length, chunked, or up to the
#   connection's end, where a reset is an error, never the end), with flow control: past HIGH_WATER_BYTES
#   unread, the upstream socket is not read;
# - the connect timeout, and one deadline for the whole exchange (headers and body), as aiohttp's `total`;
# - connections reused only after a complete answer the upstream let stay open, given up after KEEPALIVE_SECONDS
#   idle (under common servers' own keep-alive), closed when the reader gives up (the upstream sees its client
#   leave, as it would directly).

# Idle upstream connections are kept this long for the next request (here and in the proxy's aiohttp clients):
# under the keep-alive of common servers (uvicorn and Node close idle connections after 5 s), so the proxy gives
# one up before the server does and never sends a request on a connection the server is closing.
KEEPALIVE_SECONDS: Final = 4.0
# Unread body bytes past which the upstream socket stops being read until the relay has caught up.
HIGH_WATER_BYTES: Final = 1 << 20
LOW_WATER_BYTES: Final = HIGH_WATER_BYTES // 4
_NO_HEADERS: Final[CIMultiDictProxy[str]] = CIMultiDictProxy(CIMultiDict())  # until the answer's are in


class LeanAnswer:
    """One answer: status, reason and headers once they are in, then the body as it arrives (`ready`,
    `next_chunk`, `read`). `release()` after the whole body hands the connection back for reuse; `close()`
    gives it up. Reads raise what ended the answer (an `H1Error`) once what arrived before it is read."""

    def __init__(self, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.reason: str | None = None
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS
        self._connection = connection
        self._loop = loop
        self._head_in: asyncio.Future[None] = loop.create_future()
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._eof = False
        self._error: H1Error | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._let_go = False  # released or closed

    # --- the reader's events (h1.Sink: the reader hands them here, not through the connection) ---

    def on_head(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        self.status = status
        self.reason = reason or None
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        if not self._head_in.done():
            self._head_in.set_result(None)

    def on_data(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER_BYTES:
            self._connection.pause_reading()
        self._wake()

    def on_end(self) -> None:
        self._eof = True
        self._connection.answered()
        self._wake()

    # --- told by the connection ---

    def _fail(self, error: H1Error) -> None:
        if self._eof or self._error is not None:
            return
        self._error = error
        if not self._head_in.done():
            self._head_in.set_exception(error)
            self._head_in.exception()  # retrieved: nobody may be waiting any more
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- read by the relay ---

    @property
    def media_type(self) -> str:
        """The media type, lowercased, without parameters (application/octet-stream when none is given, RFC
        9110 §8.3)."""
        value = self.headers.get("Content-Type")
        return value.partition(";")[0].strip().lower() if value else "application/octet-stream"

    @property
    def length(self) -> int | None:
        """The Content-Length the upstream announced, if any."""
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def received(self) -> bool:
        """Whether the whole body has arrived (some of it may be unread)."""
        return self._eof

    @property
    def ended(self) -> bool:
        """Whether the whole body has arrived and been read."""
        return self._eof and not self._chunks

    def ready(self) -> bytes:
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

    async def next_chunk(self) -> bytes:
        """The next bytes of the body, waiting for some; b"" at its end."""
        while not self._chunks and not self._eof and self._error is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.ready()

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool once it is in."""
        parts = []
        try:
            while chunk := await self.next_chunk():
                parts.append(chunk)
        except BaseException:
            self.close()  # cut short or given up: the connection cannot carry another request
            raise
        self.release()
        return b"".join(parts)

    def release(self) -> None:
        """The connection goes back to the pool if the answer arrived whole (closed otherwise); once only: after
        that the connection may be carrying another request, which `release` and `close` leave alone."""
        if not self._let_go:
            self._let_go = True
            self._connection.finished(self)

    def close(self) -> None:
        if not self._let_go:
            self._let_go = True
            self._connection.abort()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to the upstream: the transport, the core's reader of the answers on it (whose
    events go to the answer being read, its sink), the exchange's deadline."""

    def __init__(self, client: LeanClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.reader = ResponseReader(_DISCARDED, client.limits)
        self.answer: LeanAnswer | None = None  # the answer being read; None between answers
        self.closed = False
        self.idle_since = 0.0
        self._deadline: asyncio.TimerHandle | None = None

    def start(self, answer: LeanAnswer, request: bytes, deadline: float) -> None:
        assert self.transport is not None
        self.answer = answer
        self.reader.expect(answer)
        self._deadline = answer._loop.call_at(deadline, self._timed_out)
        self.transport.write(request)

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's transports do not subclass asyncio's)

    def data_received(self, data: bytes) -> None:
        try:
            self.reader.feed(data)
        except H1Error as exc:
            self._end(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client.forget(self)
        if self.answer is not None:
            try:  # an abortive close (ECONNRESET) never ends an answer, whatever its framing
                self.reader.closed(reset=exc is not None)
            except H1Error as error:
                self._end(error)

    def answered(self) -> None:
        """The answer being read arrived whole: its deadline is over."""
        self.answer = None
        deadline = self._deadline
        if deadline is not None:
            deadline.cancel()
            self._deadline = None

    # --- ends ---

    def _end(self, error: H1Error) -> None:
        """The answer cannot complete: its reader gets `error`, and the connection is closed."""
        answer = self.answer
        self.answer = None
        if answer is not None:
            answer._fail(error)
        self.abort()

    def _timed_out(self) -> None:
        self._deadline = None
        self._end(H1TimeoutError("the upstream did not answer within the call timeout"))

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def finished(self, answer: LeanAnswer) -> None:
        """`answer`'s reader is done with it: the connection is reused when it arrived whole on a connection
        the upstream keeps open, closed otherwise."""
        if self.answer is answer or not answer.received or not self.reader.keep_alive or self.closed:
            self.abort()
        else:
            self.client.check_in(self)

    def abort(self) -> None:
        self._cancel_deadline()
        self.answer = None
        self.reader.sink = _DISCARDED  # nothing more reaches the answer, whatever the reader still holds
        self.reader.keep_alive = False
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


class _Discarded:
    """The reader's sink while no answer is being read (events there would be a bug: the reader refuses bytes
    no request asked for)."""

    def on_head(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        pass

    def on_data(self, data: bytes) -> None:
        pass

    def on_end(self) -> None:
        pass


_DISCARDED: Final = _Discarded()


class LeanClient:
    """POSTs to the origin of one `http://` URL over a pool of keep-alive connections (no count limit: the
    proxy's own limits bound what is in flight). `close()` closes every connection."""

    def __init__(
        self,
        url: URL,
        connect_timeout_seconds: float,
        total_timeout_seconds: float,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        if url.scheme != "http" or url.host is None or url.raw_host is None or url.port is None:
            raise ValueError(f"the lean client sends to plain http:// URLs only, not {url}")
        self.host, self.port = url.host, url.port
        self.writer = RequestWriter(url.raw_host if url.is_default_port() else f"{url.raw_host}:{url.port}")
        self.limits = limits
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

    async def post(self, target: str, headers: Iterable[tuple[str, str]], body: bytes) -> LeanAnswer:
        """POSTs `body` to `target` (path and query, encoded) with `headers` (Host: the URL's unless they name
        one; Content-Length: set here); returns once the answer's head is in. Raises `H1RequestError` (before
        anything is sent or connected), `H1ConnectionError`, `H1ProtocolError`, `H1LimitError`,
        `H1TimeoutError`."""
        request = self.writer.request("POST", target, headers, body)
        if self._closed:
            raise H1ConnectionError("the proxy's upstream client is closed")
        loop = asyncio.get_running_loop()
        now = loop.time()
        connection = self._checkout(now) or await self._connect(loop)
        answer = LeanAnswer(connection, loop)
        connection.start(answer, request, now + self.total_timeout)
        try:
            await answer._head_in
        except BaseException:
            connection.abort()  # cancelled or failed: the upstream sees its client leave
            raise
        return answer

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
        except TimeoutError:
            raise H1TimeoutError(f"no connection to {self.host}:{self.port} within the connect timeout") from None
        except OSError as exc:
            raise H1ConnectionError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
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
