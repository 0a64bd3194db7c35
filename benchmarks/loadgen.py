"""The benchmarks' load generator: a lean HTTP/1.1 keep-alive client.

On a 2-core machine the client shares the CPU with the upstream and the proxy it measures. A full client
library costs as much per request as a small server (~0.7 ms of CPU per call with aiohttp here), which would
starve the process under test and blur the rows. This one writes each request in one `write` over a pooled
keep-alive connection and leaves the response framing (Content-Length, chunked SSE) to httptools, the C parser
uvicorn uses. The same client drives the direct and the proxied side of every row.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The JSON-RPC message of a JSON body, or of the last `data:` line of an SSE body."""
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            data = [line[5:].strip() for line in self.body.splitlines() if line.startswith(b"data:")]
            return json.loads(data[-1])
        return json.loads(self.body)


@dataclass
class _Parsing:
    """httptools' callback target for one response."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, chunk: bytes) -> None:
        self.body += chunk

    def on_message_complete(self) -> None:
        self.complete = True


class _Closed(ConnectionError):
    """Not a byte of an answer came: a kept-alive connection the server closed while it was idle."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def exchange(self, request: bytes) -> tuple[Response, bool]:
        self.writer.write(request)
        parsing = _Parsing()
        parser = httptools.HttpResponseParser(parsing)
        received = False
        while not parsing.complete:
            try:
                chunk = await self.reader.read(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                if not received:
                    raise _Closed("the server closed the connection before answering")
                raise ConnectionError("the server closed the connection mid-response")
            received = True
            parser.feed_data(chunk)
        response = Response(parser.get_status_code(), parsing.headers, bytes(parsing.body))
        # (llhttp has reset its state by now; HTTP/1.1 keeps the connection unless the server says close)
        keep_alive = parser.get_http_version() == "1.1" and "close" not in parsing.headers.get("connection", "").lower()
        return response, keep_alive

    def close(self) -> None:
        self.writer.close()


class HttpClient:
    """POSTs to one URL over a pool of keep-alive connections (one per concurrent request)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"the load generator needs a host and a port: {url}")
        self.host, self.port = parts.hostname, parts.port
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._idle: list[_Connection] = []

    async def post(self, body: bytes, headers: dict[str, str]) -> Response:
        lines = [f"POST {self.target} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        while True:
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._open()
            try:
                response, keep_alive = await connection.exchange(request)
                break
            except _Closed:
                connection.close()
                if not reused:  # a fresh connection closed unanswered is the server's refusal; an idle one, its
                    raise  # keep-alive running out (as HTTP clients do, the request goes on a new connection)
            except BaseException:
                connection.close()
                raise
        if keep_alive:
            self._idle.append(connection)
        else:
            connection.close()
        return response

    async def _open(self) -> _Connection:
        return _Connection(*await asyncio.open_connection(self.host, self.port))

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
