"""The process's serve loop: the listeners (the MCP port, the operations port, the admin port, bound before
anything else starts), the signals (SIGTERM/SIGINT drain, `_drain.py`; SIGHUP reloads the
config, `config/live.py`), the config file's watch, the collector settled once started, and the stop in order.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import signal
import socket
from collections.abc import Mapping
from typing import Final, NamedTuple

import structlog
from aiohttp import web

from proxy.background import Background
from proxy.config.live import SIGHUP_TRIGGER
from proxy.config.schema import Config
from proxy.edge._app_keys import ADMIN_SOCKETS
from proxy.edge._drain import DRAIN
from proxy.edge._ops import ops_app
from proxy.edge.startup import EXIT_CANNOT_LISTEN, StartFailure

log = structlog.get_logger(__name__)

# Connections accepted just before the listener closed get this long for their request to arrive, so it is
# answered (a new call with 503 and Retry-After) rather than cut as an idle connection.
SETTLE_SECONDS: Final = 0.1
BACKLOG: Final = 128  # connections the kernel holds before they are accepted (asyncio's default)
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


class Listener(NamedTuple):
    """A listener's config field (named in a failure), its address, and the sockets bound for it."""

    field: str
    host: str
    sockets: list[socket.socket]

    @property
    def port(self) -> int:
        port: int = self.sockets[0].getsockname()[1]
        return port

    def url(self, path: str = "") -> str:
        shown = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{shown}:{self.port}{path}"


async def bind(field: str, host: str, port: int) -> Listener:
    """Sockets bound to every address `host` names, on `port` (0: one free port, the same for every address),
    before anything else of the start happens: a port in use stops the start before a file is created or the
    upstream is contacted. A StartFailure (exit code 3) names `field`."""
    loop = asyncio.get_running_loop()
    bound: list[socket.socket] = []
    try:
        infos = await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's own servers do
            if port == 0 and len(bound) > 1:
                address = (address[0], bound[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(BACKLOG)  # claimed now: on Linux another socket may bind a port nobody listens on yet
            sock.setblocking(False)
    except OSError as exc:
        for sock in bound:
            sock.close()
        raise StartFailure(EXIT_CANNOT_LISTEN, _bind_reason(exc), _bind_message(field, host, port, exc)) from None
    return Listener(field, host, bound)


async def serve(
    app: web.Application,
    config: Config,
    start_line: Mapping[str, object] | None = None,
) -> None:
    """Serve `app` until its drain ends: SIGTERM/SIGINT drain, SIGHUP reloads the config. The listeners are
    bound first (`bind`), then the app starts (store, upstream, recovery), then they serve. At the stop,
    requests still open get `listen.shutdown_grace_seconds`, listen streams end, and the app's cleanup stops the
    runner, the store and (last) stdio servers. Once it serves, the `started` line: `start_line`'s fields, the
    endpoint and the operations listener."""
    listen = config.listen
    mcp = await bind("listen.port", listen.host, listen.port)
    listeners = [mcp]
    observability = config.observability
    try:
        if observability.port is not None:
            listeners.append(await bind("observability.port", observability.host, observability.port))
        if config.admin.port is not None:
            app[ADMIN_SOCKETS] = (await bind("admin.port", config.admin.host, config.admin.port)).sockets
        await _serve(app, config, listeners, start_line or {})
    finally:
        for listener in listeners:
            for sock in listener.sockets:
                sock.close()
        for sock in app.get(ADMIN_SOCKETS, []):
            sock.close()


async def _serve(
    app: web.Application, config: Config, listeners: list[Listener], start_line: Mapping[str, object]
) -> None:
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        handler_cancellation=True,  # A client that closes its stream cancels its request (2026-07-28 cancellation).
        shutdown_timeout=config.listen.shutdown_grace_seconds,
    )
    ops_runner = web.AppRunner(ops_app(app), handle_signals=False, access_log=None)
    drain = app[DRAIN]
    loop = asyncio.get_running_loop()
    # From the start: a SIGTERM during start-up (store, recovery) is a drain with nothing to wait for.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, drain.begin, signum)
    loop.add_signal_handler(signal.SIGHUP, drain.live.reload, SIGHUP_TRIGGER)
    background = Background("config_watch_failed")
    background.spawn(drain.live.watch(), "config-watch")
    mcp, *ops = listeners
    try:
        await runner.setup()
        await ops_runner.setup()
        try:
            sites = [web.SockSite(runner, sock) for sock in mcp.sockets]
            sites += [web.SockSite(ops_runner, sock) for listener in ops for sock in listener.sockets]
            for site in sites:
                await site.start()
            settle_collector()
            served = {"endpoint": mcp.url(drain.mcp_path)}
            if ops:
                served["operations"] = ops[0].url()
            log.info("started", **start_line, **served)
            await drain.stopped.wait()
            for site in sites:  # no new connections: a balancer that still sends here gets a refusal it may retry
                await site.stop()
            await asyncio.sleep(SETTLE_SECONDS)
        finally:
            await ops_runner.cleanup()
            await runner.cleanup()
    finally:
        await background.close()
        await drain.close()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)


def _bind_reason(exc: OSError) -> str:
    return {errno.EADDRINUSE: "port_in_use", errno.EACCES: "permission_denied"}.get(exc.errno or 0, "cannot_bind")


def _bind_message(field: str, host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use by another process (set {field})"
    if exc.errno == errno.EACCES:
        return f"no permission to listen on {host}:{port} (ports below 1024 need privileges; set {field})"
    host_field = field.replace(".port", ".host")
    return f"cannot listen on {host}:{port}: {exc.strerror or exc} (set {host_field} or {field})"
