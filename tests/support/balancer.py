"""A round-robin HTTP load balancer for tests: each request goes to the next backend, with no stickiness of any
kind (no cookies, no session or task affinity), as an ordinary Kubernetes Service may route them.

    python -m tests.support.balancer --port 0 http://127.0.0.1:8081 http://127.0.0.1:8082
    # prints "ready http://127.0.0.1:<port>" once listening; SIGTERM/SIGINT -> exit 0

The request (method, path, headers, body) is relayed as it came, the response streamed back as it arrives (SSE
included). Hop-by-hop headers are dropped. Used by the conformance run against replicas (conformance/run.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator
from typing import Final

import aiohttp
from aiohttp import web

HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "content-length"}
)


class Backends:
    """The backends in turn."""

    def __init__(self, urls: list[str]) -> None:
        self._turns = itertools.cycle([url.rstrip("/") for url in urls])

    def next(self) -> str:
        return next(self._turns)


BACKENDS: Final = web.AppKey("backends", Backends)
CLIENT: Final = web.AppKey("client", aiohttp.ClientSession)


async def relay(request: web.Request) -> web.StreamResponse:
    backend = request.app[BACKENDS].next()
    headers = {name: value for name, value in request.headers.items() if name.lower() not in HOP_BY_HOP}
    body = await request.read()
    try:
        async with request.app[CLIENT].request(
            request.method, backend + request.path_qs, headers=headers, data=body, allow_redirects=False
        ) as answer:
            response = web.StreamResponse(
                status=answer.status,
                headers={name: value for name, value in answer.headers.items() if name.lower() not in HOP_BY_HOP},
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except aiohttp.ClientError as exc:
        return web.Response(status=502, text=f"balancer: {backend} failed: {exc}")


async def client_ctx(app: web.Application) -> AsyncIterator[None]:
    connector = aiohttp.TCPConnector(limit=0)
    app[CLIENT] = aiohttp.ClientSession(
        connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"), timeout=None
    )
    yield
    await app[CLIENT].close()


def create_app(backends: list[str]) -> web.Application:
    app = web.Application(client_max_size=64 * 2**20)
    app[BACKENDS] = Backends(backends)
    app.cleanup_ctx.append(client_ctx)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


async def serve(port: int, backends: list[str]) -> None:
    runner = web.AppRunner(create_app(backends), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"ready http://127.0.0.1:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("backends", nargs="+", help="base URLs, e.g. http://127.0.0.1:8081")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.backends))


if __name__ == "__main__":
    main()
