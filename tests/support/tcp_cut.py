"""A TCP forwarder on loopback that can cut what goes through it: one replica's road to PostgreSQL, so that the
replica alone loses its store while the others keep theirs (a network partition, as far as one pod sees it).

`cut()` closes every connection that goes through (both ends, at once) and refuses new ones (accepted and
closed); `heal()` forwards again. It runs on the test's event loop. Imports nothing of the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

CHUNK_BYTES: Final = 65536


class TcpCut:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.cut_off = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen on a free loopback port; that port."""
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def cut(self) -> None:
        self.cut_off = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def heal(self) -> None:
        self.cut_off = False

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            target_reader, target_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, target_writer))
        loop = asyncio.get_running_loop()
        pipes = [
            loop.create_task(self._pipe(reader, target_writer, writer)),
            loop.create_task(self._pipe(target_reader, writer, target_writer)),
        ]
        self._pipes.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._pipes.difference_update(pipes)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, other: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await source.read(CHUNK_BYTES):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            for writer in (sink, other):
                self._writers.discard(writer)
                with contextlib.suppress(RuntimeError):
                    writer.transport.abort()
