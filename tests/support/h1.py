"""Helpers for the HTTP/1.1 client's tests: a sink that records the core's events, and a raw upstream on loopback
that answers each request with exact bytes (written in given pieces), then closes or resets as told.
Imports the client core only."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from proxy.upstream.http.h1 import ResponseReader

End = Literal["keep", "close", "reset"]


class ResponseHead(NamedTuple):
    """A final answer's head as the reader hands it to its sink."""

    status: int
    reason: str
    headers: list[tuple[str, str]]


class Recorder:
    """An `h1.Sink` that keeps every event, in order: ("head", ResponseHead), ("data", bytes), ("end", None)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def on_head(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        self.events.append(("head", ResponseHead(status, reason, headers)))

    def on_data(self, data: bytes) -> None:
        self.events.append(("data", data))

    def on_end(self) -> None:
        self.events.append(("end", None))

    def merged(self) -> list[tuple[str, object]]:
        """The events with consecutive data joined (how reads split the body is not an event of its own)."""
        merged: list[tuple[str, object]] = []
        for kind, value in self.events:
            if kind == "data" and merged and merged[-1][0] == "data":
                previous = merged[-1][1]
                assert isinstance(previous, bytes)
                assert isinstance(value, bytes)
                merged[-1] = ("data", previous + value)
            elif kind != "data" or value:
                merged.append((kind, value))
        return merged


def read(pieces: Sequence[bytes], end: End | None = "keep") -> tuple[Recorder, ResponseReader]:
    """One answer fed to a fresh reader in `pieces`, then the connection ended as `end` says (None: left open)."""
    recorder = Recorder()
    reader = ResponseReader(recorder)
    reader.expect()
    for piece in pieces:
        reader.feed(piece)
    if end == "close":
        reader.closed()
    elif end == "reset":
        reader.closed(reset=True)
    return recorder, reader


@dataclass
class RawUpstream:
    """Answers every request on loopback with `answer`'s pieces, one write (and drain) each, then (once `hold`
    is set, when there is one) keeps the connection, closes it, or resets it (RST: SO_LINGER 0). Counts the
    connections and requests it saw."""

    answer: list[bytes] = field(default_factory=list)
    end: End = "close"
    hold: asyncio.Event | None = None
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/mcp"

    async def start(self) -> RawUpstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.answer:
                    writer.write(piece)
                    await writer.drain()
                if self.hold is not None:
                    await self.hold.wait()
                if self.end == "reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if self.end == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()
