"""The app's lifecycle: what opens before the first request is served (the store, the upstream pool, the
composition of tasks services, the front, the operators' listener) and closes after the last, and what
shutdown does first (listen streams end, readiness turns 503)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import structlog
from aiohttp import web

from proxy.edge._app_keys import ADMIN, CONFIG, FRONT, LIVE, PASSTHROUGH, POOL, RELAY, RUNNER, STOPPING, STORE
from proxy.edge._descriptors import DescriptorBudget, open_descriptors
from proxy.edge._drain import DRAIN
from proxy.edge._error_edge import AUDIT, METRICS
from proxy.edge._relay import OriginRelay
from proxy.front.dispatch import Front
from proxy.legacy.serving import legacy_front
from proxy.operators.admin import Admin
from proxy.principals import Principals, deployment_key
from proxy.tasks.runner import TaskRunner
from proxy.tasks.services.grants import StoreGrants
from proxy.tasks.services.push import TaskWatchers
from proxy.tasks.store import open_store
from proxy.upstream.http.session import upstream_connector
from proxy.upstream.kinds import session_kind
from proxy.upstream.pool import SessionPool

log = structlog.get_logger(__name__)


async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    # The store first: a database in use by another process stops the start before anything else is opened.
    store = await open_store(config.store, max_records=config.tasks.max_records)
    app[STORE] = store
    if config.store.url is None:
        log.info("store_opened", backend="sqlite", path=config.store.path)  # absolute (`parse_config`)
    else:
        log.info("store_opened", backend="postgresql")
    # No shared cookie jar: what the upstream sets is kept per upstream session (`upstream/http/session.py`).
    http = aiohttp.ClientSession(
        connector=upstream_connector(), auto_decompress=True, cookie_jar=aiohttp.DummyCookieJar()
    )
    metrics = app.get(METRICS)
    # Where the proxy makes upstream credentials itself, a task keeps its caller's verified owner, not the token.
    principals = Principals(deployment_key(config), keep_owner=not config.upstream.credentials.forwards)
    pool = SessionPool(session_kind(config, http, metrics, principals, StoreGrants(store)))
    app[POOL] = pool
    live = app[LIVE]
    drain = app[DRAIN]
    credentials = pool.kind.credentials
    runner = TaskRunner(
        live.config, store, pool, principals, metrics=metrics, draining=drain.is_draining, credentials=credentials
    )
    credentials.start()  # (a secrets map watched for changes, as the config file is)

    def reload_credentials() -> None:
        runner.spawn(credentials.reload("sighup"), "credential-reload")

    live.on_sighup(reload_credentials)
    app[RUNNER] = runner
    audit = runner.audit
    if audit is not None:
        app[AUDIT] = audit
        live.on_sighup(audit.reopen)  # a new file after a rotation
    if metrics is not None:
        metrics.tasks_running.set_function(lambda: runner.running)
        metrics.calls_parked.set_function(lambda: runner.parked)
        metrics.waiting_places.set_function(lambda: runner.waiting_places)
        metrics.upstream_sessions.set_function(lambda: pool.open_sessions)
        metrics.upstream_sessions_idle.set_function(lambda: pool.idle_sessions)
        if pool.limits.max_open is not None:
            metrics.upstream_sessions_max.set(pool.limits.max_open)
        metrics.upstream_calls_in_flight.set_function(lambda: pool.calls_in_flight)
        metrics.lease_held.set_function(lambda: runner.lease_problem() is None)
        metrics.store_available.set_function(lambda: store.health.available)
        store.health.on_failure(metrics.store_operation_failed)
    watchers = TaskWatchers(store.replicas)
    runner.spawn(watchers.run(), "task-feed")
    descriptors = DescriptorBudget.of_process()
    front = app[FRONT] = Front(live.config, pool, runner.tasks, watchers, descriptors.refusal)
    if metrics is not None:
        metrics.listen_streams.set_function(lambda: front.listens.open_streams)
        metrics.descriptors_open.set_function(open_descriptors)
        metrics.descriptors_limit.set(descriptors.limit)
    drain.wait_for(lambda: runner.open_calls)  # the drain is the app's, built before the runner
    live.subscribe(lambda new: runner.config_swapped())  # the queue admits by the caps now in force
    legacy = app[PASSTHROUGH] = legacy_front(pool)  # relayed, or served by the proxy (the kind decides)
    app[RELAY] = OriginRelay.of(config.relay, legacy)  # other paths: to the upstream's origin, when it has one
    admin = Admin(config.admin, store, runner.clock) if config.admin.port is not None else None
    try:
        await runner.start()  # restart recovery happens before the first request is served
        if admin is not None:
            await admin.start()
            app[ADMIN] = admin
        pool.warm_up()
        yield
    finally:
        if admin is not None:
            await admin.stop()
        await runner.close()
        await store.close()
        await legacy.close()
        await pool.close()
        await http.close()


async def end_listen_streams(app: web.Application) -> None:
    """on_shutdown runs before aiohttp waits for handlers: listen streams end with their graceful result, and
    readiness turns 503 so no new traffic is routed here while synchronous calls finish."""
    app[STOPPING].append(True)
    if POOL in app:
        app[POOL].end_subscriptions()
