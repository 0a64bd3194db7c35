"""The operators' endpoints. On the MCP listener: liveness and a bare readiness status for probes (no reasons,
no metrics: the MCP port is the one a Service or an ingress exposes). On the operations listener
(`observability.port`, its own app, `ops_app`): readiness with its reasons, Prometheus metrics and liveness, with
no token, as Prometheus scrapes. The drain's `/drainz` is `_drain.py`'s. Reads the app's services; imports no
front, runner or store internals.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.edge._app_keys import LIVE, POOL, RUNNER, STOPPING, STORE
from proxy.edge._drain import DRAIN
from proxy.edge._error_edge import HEALTHZ, METRICS, METRICS_PATH, READYZ
from proxy.errors import UpstreamError
from proxy.tasks.store import StoreError

log = structlog.get_logger(__name__)

READY_STORE_SECONDS: Final = 2.0  # /readyz: a store that takes longer to commit a write counts as down
SERVED: Final = web.AppKey("served", web.Application)  # on the operations app: the MCP app it reports on
METRICS_MOVED: Final = (
    "Not found: metrics are served on the operations listener (observability.host and observability.port), "
    "not on the MCP port"
)


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP."""
    return web.json_response({"status": "ok"})


async def readiness(app: web.Application) -> list[str]:
    """Why this replica should get no traffic now (an empty list: it is ready): draining or shutting down; the
    task store does not take a committed write, or holds settlements it could not commit yet; this replica's
    lease on the store lapsed; the upstream neither answered recently nor answers a fresh `initialize`."""
    reasons: list[str] = []
    if app[DRAIN].draining:
        return ["draining"]
    if app[STOPPING]:
        return ["shutting down"]
    store = app[STORE]
    try:
        async with asyncio.timeout(READY_STORE_SECONDS):
            await store.check_writable(app[RUNNER].clock())
    except StoreError as exc:
        reasons.append(f"store: {exc}")
    except TimeoutError:
        reasons.append(f"store: no committed write within {READY_STORE_SECONDS:g} s")
    held = app[RUNNER].outbox
    if held.count:  # a probe write may still fit where a result did not: these wait for the store to take them
        writes = f"{held.count} task record write{'' if held.count == 1 else 's'}"
        reasons.append(f"store: {writes} of {held.tasks} task{'' if held.tasks == 1 else 's'} wait in memory for it")
    lease = app[RUNNER].lease_problem()
    if lease is not None:
        reasons.append(f"lease: {lease}")
    try:
        await app[POOL].probe(app[LIVE].current.observability.readiness_max_age_seconds)
    except UpstreamError as exc:
        reasons.append(f"upstream: {exc.message}")
    return reasons


async def readyz(request: web.Request) -> web.Response:
    """Readiness on the MCP port: 200 or 503, and nothing of why (the reasons name the upstream and the store;
    they are on the operations port, and in the `not_ready` log line)."""
    reasons = await readiness(request.app)
    if reasons:
        log.warning("not_ready", reasons=reasons)
        return web.json_response({"status": "unavailable"}, status=503)
    return web.json_response({"status": "ready"})


async def readyz_with_reasons(request: web.Request) -> web.Response:
    """Readiness on the operations port: 503 with the reasons, or 200."""
    reasons = await readiness(request.app[SERVED])
    if reasons:
        log.warning("not_ready", reasons=reasons)
        return web.json_response({"status": "unavailable", "reasons": reasons}, status=503)
    return web.json_response({"status": "ready"})


async def metrics_endpoint(request: web.Request) -> web.Response:
    """Prometheus text; the store-derived gauges are read at scrape time."""
    app = request.app[SERVED]
    metrics = app[METRICS]
    store = app[STORE]
    started = time.perf_counter()
    try:
        counts = await store.operators.stats()
        size = await store.operators.size_bytes()
    except StoreError as exc:
        log.warning("metrics_store_unreadable", error=str(exc))
        metrics.store_up.set(0)
    else:
        metrics.store_up.set(1)
        for status, count in counts.items():
            if status != "records":
                metrics.tasks_by_status.labels(status).set(count)
        metrics.store_bytes.set(size)
    metrics.store_read_seconds.set(time.perf_counter() - started)
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def metrics_moved(request: web.Request) -> web.Response:
    """`/metrics` on the MCP port: never served there, never relayed; the answer says where it went."""
    return web.json_response({"error": "not_found", "message": METRICS_MOVED}, status=404)


def ops_app(served: web.Application) -> web.Application:
    """The operations listener's app, reporting on `served` (the MCP app, started first)."""
    app = web.Application(client_max_size=1024)
    app[SERVED] = served
    app.router.add_get(HEALTHZ, healthz)
    app.router.add_get(READYZ, readyz_with_reasons)
    if METRICS in served:
        app.router.add_get(METRICS_PATH, metrics_endpoint)
    return app
