"""The operators' endpoints on the MCP listener: liveness, readiness, Prometheus metrics (the drain's
`/drainz` is `_drain.py`'s). They are exempt from the Host check (`_admission.py`)."""

from __future__ import annotations

import asyncio
import time
from typing import Final

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.edge._app_keys import LIVE, POOL, RUNNER, STOPPING, STORE
from proxy.edge._drain import DRAIN
from proxy.edge._error_edge import METRICS
from proxy.errors import UpstreamError
from proxy.tasks.store import StoreError

log = structlog.get_logger(__name__)

READY_STORE_SECONDS: Final = 2.0  # /readyz: a store that takes longer to commit a write counts as down


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the task store takes a committed write, this replica holds its lease on the store, and the
    upstream answered recently (else a fresh `initialize` must succeed). 503 with the reasons otherwise."""
    app = request.app
    reasons: list[str] = []
    if app[DRAIN].draining:
        reasons.append("draining")
    elif app[STOPPING]:
        reasons.append("shutting down")
    else:
        try:
            async with asyncio.timeout(READY_STORE_SECONDS):
                await app[STORE].check_writable(app[RUNNER].clock())
        except StoreError as exc:
            reasons.append(f"store: {exc}")
        except TimeoutError:
            reasons.append(f"store: no committed write within {READY_STORE_SECONDS:g} s")
        lease = app[RUNNER].lease_problem()
        if lease is not None:
            reasons.append(f"lease: {lease}")
        try:
            await app[POOL].probe(app[LIVE].current.observability.readiness_max_age_seconds)
        except UpstreamError as exc:
            reasons.append(f"upstream: {exc.message}")
    if reasons:
        log.warning("not_ready", reasons=reasons)
        return web.json_response({"status": "unavailable", "reasons": reasons}, status=503)
    return web.json_response({"status": "ready"})


async def metrics_endpoint(request: web.Request) -> web.Response:
    """Prometheus text; the store-derived gauges are read at scrape time."""
    metrics = request.app[METRICS]
    store = request.app[STORE]
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
