"""A recording TCP relay in front of a real upstream: every byte a client (the proxy) sends is passed on and
kept, per connection, and read back by h11 (a strict HTTP/1.1 parser independent of the proxy's and of
aiohttp's) as the requests an upstream would see: their request line, headers and body. An injected header or
a smuggled second request shows as one more header or one more request. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import h11


@dataclass(frozen=True)
class SeenRequest:
    method: str
    target: str
    headers: list[tuple[str, str]]  # lowercased names, in the order sent
    body: bytes

    def names(self) -> list[str]:
        return [name for name, _ in self.headers]


class RecordingRelay:
    """Listens on 127.0.0.1; each connection is piped to `upstream_port` and what came in is recorded."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sent: list[bytearray] = []  # per connection, what the client sent
        self.url = ""  # the relay's own, once started
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/mcp"
        return self.url

    async def close(self) -> None:
        """Stop listening and close every connection (both sides), so that every pipe ends."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        recorded = bytearray()
        self.sent.append(recorded)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers.update((writer, up_writer))
        try:
            async with asyncio.TaskGroup() as pipes:
                pipes.create_task(_pipe(reader, up_writer, recorded))
                pipes.create_task(_pipe(up_reader, writer, None))
        finally:
            self._writers.difference_update((writer, up_writer))
            for stream in (writer, up_writer):
                stream.close()

    def requests(self) -> list[SeenRequest]:
        """Every complete request on every connection, as h11 reads them (raises h11's error on bytes that are
        not HTTP/1.1 requests)."""
        return [request for data in self.sent for request in parse_requests(bytes(data))]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, recorded: bytearray | None) -> None:
    """Bytes from `reader` to `writer` until either side ends; then `writer` is closed, which ends the other
    direction's pipe too."""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            if recorded is not None:
                recorded.extend(chunk)
            writer.write(chunk)
            await writer.drain()
    writer.close()


def parse_requests(data: bytes) -> list[SeenRequest]:
    """The complete requests in `data`, the bytes of one connection, as an HTTP/1.1 server reads them."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(data)
    found: list[SeenRequest] = []
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            return found
        if isinstance(event, h11.Request):
            request, body = event, bytearray()
        elif isinstance(event, h11.Data):
            body.extend(event.data)
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in request.headers]
            found.append(SeenRequest(request.method.decode(), request.target.decode(), headers, bytes(body)))
            # Answer it (to no one) so that h11 reads the next request of the connection.
            connection.send(h11.Response(status_code=204, headers=[]))
            connection.send(h11.EndOfMessage())
            if connection.our_state is h11.MUST_CLOSE:
                return found  # the request said `Connection: close`: nothing may follow it
            connection.start_next_cycle()
