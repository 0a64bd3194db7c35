"""Command line entry point: ``python -m tests.upstream --host H --port P [--stateless] [--json-response]
[--legacy-tasks] [--auth JWKS_FILE ISSUER RESOURCE_URL]``.

Binds the listening socket itself (so ``--port 0`` works), serves the fixture with uvicorn at
``/mcp``, prints ``ready http://HOST:PORT/mcp`` once listening, and exits 0 on SIGTERM/SIGINT.
``--stdio`` serves the same fixture over the stdio transport instead (stdout carries only protocol
messages; it exits 0 when stdin closes).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
from collections.abc import Iterator, Sequence

import anyio
import uvicorn

from tests.upstream.server import DEFAULT_RETRY_INTERVAL_MS, build_app, build_server

_GRACEFUL_SHUTDOWN_S = 1


class _Server(uvicorn.Server):
    """uvicorn server that turns SIGTERM/SIGINT into a plain graceful exit (stock uvicorn re-raises
    the captured signal after shutdown, which would end the process with a signal status)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = anyio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.upstream", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000, help="0 picks a free port")
    parser.add_argument("--stateless", action="store_true", help="SDK stateless_http=True (no sessions)")
    parser.add_argument("--json-response", action="store_true", help="answer POSTs with JSON, not SSE")
    parser.add_argument(
        "--retry-ms",
        type=int,
        default=DEFAULT_RETRY_INTERVAL_MS,
        help="SSE retry hint sent in priming events (default %(default)s)",
    )
    parser.add_argument("--no-resumability", action="store_true", help="no event store: no priming events")
    parser.add_argument(
        "--legacy-tasks",
        action="store_true",
        help="enable the SDK's experimental 2025-11-25 Tasks and the legacy_task_* tools",
    )
    parser.add_argument(
        "--auth",
        nargs=3,
        metavar=("JWKS_FILE", "ISSUER", "RESOURCE_URL"),
        help="an OAuth resource server: JWTs of ISSUER signed by a key of JWKS_FILE, metadata naming RESOURCE_URL",
    )
    parser.add_argument("--stdio", action="store_true", help="serve over stdin/stdout instead of HTTP")
    return parser.parse_args(argv)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (accepted ones inherit it).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def _serve(server: _Server, sock: socket.socket, url: str) -> bool:
    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:
            server.ready.set()  # also wakes the waiter when startup failed

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await server.ready.wait()
        if server.started:
            print(f"ready {url}", flush=True)
    return server.started


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.stdio:
        anyio.run(build_server(legacy_tasks=args.legacy_tasks).run_stdio_async)
        return 0
    host: str = args.host.strip("[]")
    sock = _bind(host, args.port)
    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    app = build_app(
        host=host,
        stateless=args.stateless,
        json_response=args.json_response,
        retry_interval_ms=args.retry_ms,
        resumable=not args.no_resumability,
        legacy_tasks=args.legacy_tasks,
        auth=tuple(args.auth) if args.auth else None,
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )
    with sock:
        started = anyio.run(_serve, _Server(config), sock, f"http://{url_host}:{port}/mcp")
    return 0 if started else 1


if __name__ == "__main__":
    sys.exit(main())
