"""The process's serve loop: the listener, the signals (SIGTERM/SIGINT drain, `_drain.py`; SIGHUP reloads the
config, `config/live.py`), the config file's watch, the collector settled once started, and the stop in order.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import signal
from collections.abc import Mapping
from typing import Final

import structlog
from aiohttp import web

from proxy.background import Background
from proxy.config.live import SIGHUP_TRIGGER
from proxy.edge._drain import DRAIN
from proxy.edge.startup import EXIT_CANNOT_LISTEN, StartFailure

log = structlog.get_logger(__name__)

# Connections accepted just before the listener closed get this long for their request to arrive, so it is
# answered (a new call with 503 and Retry-After) rather than cut as an idle connection.
SETTLE_SECONDS: Final = 0.1
YOUNG_COLLECTION: Final = 10_000  # allocations between collections of the youngest generation (CPython: 700)


def settle_collector() -> None:
    """Once started: what the start made (modules, schemas, the config, pools) lives as long as the process, so it
    is frozen out of the cyclic collector's way (its full passes walked all of it), and the youngest generation
    is collected every YOUNG_COLLECTION allocations instead of 700 (a modern call makes hundreds of objects, and
    most are gone before a collection comes). Together they took the collector from about a tenth of a modern
    call's CPU to a few per cent (`python -m benchmarks.instructions`)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION, middle, old)


async def serve(
    app: web.Application,
    host: str,
    port: int,
    shutdown_seconds: float,
    start_line: Mapping[str, object] | None = None,
) -> None:
    """Serve `app` until its drain ends: SIGTERM/SIGINT drain, SIGHUP reloads the config. Then requests still
    open get `shutdown_seconds`, listen streams end, and the app's cleanup stops the runner, the store and
    (last) stdio servers. Once it listens, the `started` line: `start_line`'s fields and the endpoint. An address
    that cannot be bound is a StartFailure (exit code 3)."""
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        handler_cancellation=True,  # A client that closes its stream cancels its request (2026-07-28 cancellation).
        shutdown_timeout=shutdown_seconds,
    )
    drain = app[DRAIN]
    loop = asyncio.get_running_loop()
    # From the start: a SIGTERM during start-up (store, recovery) is a drain with nothing to wait for.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, drain.begin, signum)
    loop.add_signal_handler(signal.SIGHUP, drain.live.reload, SIGHUP_TRIGGER)
    background = Background("config_watch_failed")
    background.spawn(drain.live.watch(), "config-watch")
    try:
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            try:
                await site.start()
            except OSError as exc:
                raise StartFailure(EXIT_CANNOT_LISTEN, _bind_reason(exc), _bind_message(host, port, exc)) from None
            settle_collector()
            log.info("started", **(start_line or {}), endpoint=endpoint(runner, host, port, drain.mcp_path))
            await drain.stopped.wait()
            await site.stop()  # no new connections: a balancer that still sends here gets a refusal it may retry
            await asyncio.sleep(SETTLE_SECONDS)
        finally:
            await runner.cleanup()
    finally:
        await background.close()
        await drain.close()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)


def endpoint(runner: web.AppRunner, host: str, port: int, path: str) -> str:
    """The URL the proxy listens on (the bound port, also when `listen.port` is 0 and the system picked one)."""
    bound = next((address[1] for address in runner.addresses if isinstance(address, tuple)), port)
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{bound}{path}"


def _bind_reason(exc: OSError) -> str:
    return {errno.EADDRINUSE: "port_in_use", errno.EACCES: "permission_denied"}.get(exc.errno or 0, "cannot_bind")


def _bind_message(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use by another process (set listen.port or --port)"
    if exc.errno == errno.EACCES:
        return f"no permission to listen on {host}:{port} (ports below 1024 need privileges; set listen.port)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc} (set listen.host or --host)"
