"""The app's lifecycle: what opens before the first request is served (the store, the upstream pool, the
composition of tasks services, the front, the operators' listener) and closes after the last, and what
shutdown does first (listen streams end, readiness turns 503)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import structlog
from aiohttp import web

from proxy.config.schema import StdioUpstreamConfig
from proxy.config.warnings import raw_token_binding
from proxy.edge import startup
from proxy.edge._app_keys import (
    ADMIN,
    ADMIN_SOCKETS,
    CONFIG,
    FRONT,
    JWT,
    LEGACY_HANDLES,
    LIVE,
    PASSTHROUGH,
    POOL,
    RELAY,
    RUNNER,
    STOPPING,
    STORE,
)
from proxy.edge._descriptors import DescriptorBudget, open_descriptors
from proxy.edge._drain import DRAIN
from proxy.edge._error_edge import AUDIT, METRICS
from proxy.edge._legacy_handles import LegacyHandles
from proxy.edge._relay import OriginRelay
from proxy.edge.startup import EXIT_CONFIG_ERROR, StartFailure
from proxy.events.service import Events
from proxy.front.dispatch import Front
from proxy.front.handles import tools as handle_tools
from proxy.front.handles.service import ToolNameTakenError, check_tool_names
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
    # Nothing is created before what the start needs is checked (the listeners are bound already, `serve.py`).
    startup.check_files(config)
    # No shared cookie jar: what the upstream sets is kept per upstream session (`upstream/http/session.py`).
    http = aiohttp.ClientSession(
        connector=upstream_connector(), auto_decompress=True, cookie_jar=aiohttp.DummyCookieJar()
    )
    metrics = app.get(METRICS)
    # A token exchange seals the grants it keeps with the deployment key (read, or made, now: an exchange is for
    # a url upstream, which starts no process first); the store's grants table is opened below.
    credentials_mode = config.upstream.credentials.mode
    sealing = Principals(deployment_key(config), keep_owner=True) if credentials_mode == "exchange" else None
    pool = SessionPool(session_kind(config, http, metrics, sealing, StoreGrants(lambda: app[STORE])))
    app[POOL] = pool
    binding = raw_token_binding(config)
    if binding is not None:  # said at start for `required` (`start_warnings`); `detect` says it when it finds out
        pool.kind.auth.when_found_required(lambda: startup.warn([binding]))
    try:
        if isinstance(config.upstream, StdioUpstreamConfig):  # one that cannot start stops the start here
            await startup.first_stdio_process(pool, config.upstream)
        # Then the store: a database in use by another process stops the start before the rest is opened.
        store = await open_store(config.store, max_records=config.tasks.max_records)
    except BaseException:
        await pool.close()
        await http.close()
        raise
    app[STORE] = store
    if config.store.url is None:
        log.info("store_opened", backend="sqlite", path=config.store.path)  # absolute (`parse_config`)
    else:
        log.info("store_opened", backend="postgresql")
    live = app[LIVE]
    drain = app[DRAIN]
    credentials = pool.kind.credentials
    # Where the proxy makes upstream credentials itself, a task keeps its caller's verified owner, not the token.
    principals = Principals(deployment_key(config), keep_owner=credentials_mode != "forward")
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
    events = None
    if config.events.enabled:
        events = Events(
            live.config,
            store.events,
            store.replicas,
            runner.tasks,
            runner.principals,
            process_id=runner.process_id,
            clock=runner.clock,
            audit=runner.audit,
            pool=pool,
            metrics=metrics,
        )
    descriptors = DescriptorBudget.of_process()
    front = app[FRONT] = Front(
        live.config, pool, runner.tasks, watchers, events=events, new_work_refusal=descriptors.refusal
    )
    if metrics is not None:
        metrics.listen_streams.set_function(lambda: front.listens.open_streams)
        metrics.descriptors_open.set_function(open_descriptors)
        metrics.descriptors_limit.set(descriptors.limit)
        if events is not None:
            metrics.event_streams.set_function(lambda: events.open_streams)
    drain.wait_for(lambda: runner.open_calls)  # the drain is the app's, built before the runner
    live.subscribe(lambda new: runner.config_swapped())  # the queue admits by the caps now in force
    legacy = app[PASSTHROUGH] = legacy_front(pool)  # relayed, or served by the proxy (the kind decides)
    app[LEGACY_HANDLES] = LegacyHandles(
        front.handles, legacy, pool, app.get(JWT), drain.is_draining, front.admit_legacy_call
    )

    async def requires_auth() -> bool:
        return not await pool.kind.auth.shared()

    # Other paths: to the upstream's origin, when it has one and they are relayed.
    app[RELAY] = OriginRelay.of(config.relay, legacy, requires_auth)
    admin = Admin(config.admin, store, runner.clock) if config.admin.port is not None else None
    try:
        await runner.start()  # restart recovery happens before the first request is served
        if events is not None:
            await events.start()
        else:
            await store.events.configure(False)  # no replica logs events for a deployment that serves none
        if live.current.tasks.has_handles:  # a synthesised task tool's name the upstream lists stops the start
            try:
                await check_tool_names(pool, handle_tools.names(live.current.handles.tool_prefix))
            except ToolNameTakenError as exc:
                raise StartFailure(EXIT_CONFIG_ERROR, "task_tool_name_taken", str(exc)) from None
        if admin is not None:
            await admin.start(app.get(ADMIN_SOCKETS))
            app[ADMIN] = admin
        pool.warm_up()
        yield
    finally:
        if admin is not None:
            await admin.stop()
        if events is not None:
            await events.close()
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
    events = app[FRONT].events if FRONT in app else None
    if events is not None:
        events.end_streams()
