"""Drain on SIGTERM: the state readiness, admission and `/drainz` read. The replica turns unready, refuses new
work (503 + Retry-After), serves what it holds and stops once nothing of its own runs (at most
`tasks.drain_seconds`). Imports aiohttp's web side, the config holder, the errors and the wire; nothing of tasks."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from typing import Final

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Gauge

from proxy.background import Background
from proxy.config.live import LiveConfig
from proxy.edge._error_edge import MCP_METHOD, Handler
from proxy.errors import DrainingError
from proxy.wire.envelope import ModernRequest

log = structlog.get_logger(__name__)

CHECK_SECONDS: Final = 0.05  # how often a drain looks whether anything of its own still runs
DRAINZ_MARGIN_SECONDS: Final = 5.0  # /drainz waits this much for a drain to begin (SIGTERM may reach it later)
NEW_WORK: Final = frozenset({"tools/call", "prompts/get", "resources/read"})  # without requestState: a new call
STREAMS: Final = frozenset({"subscriptions/listen"})  # long-lived: a drain does not wait for them
SESSION_HEADER: Final = "Mcp-Session-Id"
REPORT_SECONDS: Final = 5.0  # a drain logs what it still waits for this often
WAITS_FOR: Final = "open calls (tasks, synchronous calls, parked MRTR rounds) and requests in flight"
SECOND_SIGNAL_HINT: Final = "a second SIGINT (Ctrl-C) or SIGTERM stops now"


class Drain:
    """Whether this replica drains, and what a drain still waits for: the runner's open calls (tasks,
    synchronous calls, parked MRTR rounds) and requests in flight that are not long-lived streams."""

    def __init__(self, live: LiveConfig, mcp_path: str) -> None:
        self.live = live
        self.mcp_path = mcp_path
        self.draining = False
        self._counts: list[Callable[[], int]] = []  # what else a drain waits for (`wait_for`)
        self.requests: dict[int, web.Request] = {}  # by id(): a request is not hashable
        self._began = 0.0
        self._background = Background("drain_watch_failed")  # the drain's watch, cancelled by `close`
        self.began = asyncio.Event()  # the first SIGTERM or SIGINT came
        self.drained = asyncio.Event()  # nothing of its own runs any more, or the drain ran out
        self.stopped = asyncio.Event()  # the serve loop stops the app

    def register_metrics(self, registry: CollectorRegistry) -> None:
        Gauge(
            "mcp_tasks_proxy_draining", "1 while this replica drains after SIGTERM, else 0", registry=registry
        ).set_function(lambda: 1.0 if self.draining else 0.0)
        Gauge(
            "mcp_tasks_proxy_drain_calls_left",
            "What a drain waits for: open calls (tasks, synchronous calls, parked MRTR rounds) plus requests in "
            "flight that are not listen or legacy GET streams (a synchronous call counts in both)",
            registry=registry,
        ).set_function(self.left)

    def is_draining(self) -> bool:
        return self.draining

    def wait_for(self, count: Callable[[], int]) -> None:
        """A drain also waits until `count()` is 0 (the runner's open calls, once the runner exists: a SIGTERM
        during start-up, while the store opens and recovery runs, has nothing of it to wait for)."""
        self._counts.append(count)

    def left(self) -> int:
        streams = sum(
            1 for request in self.requests.values() if request.method == "GET" or request.get(MCP_METHOD) in STREAMS
        )
        return sum(count() for count in self._counts) + len(self.requests) - streams

    # --- the drain itself -------------------------------------------------------------------------------

    def begin(self, signum: int) -> None:
        """The first signal starts the drain; a second one ends it now."""
        if self.draining:
            log.warning("drain_cut_short", signal=signal.Signals(signum).name, calls_left=self.left())
            self._finish("signal")
            return
        self.draining = True
        self.began.set()
        self._began = time.monotonic()
        seconds = self.live.current.tasks.drain_seconds
        left = self.left()
        log.info(
            "drain_started",
            signal=signal.Signals(signum).name,
            drain_seconds=seconds,
            calls_left=left,
            waits_for=WAITS_FOR,
            hint=SECOND_SIGNAL_HINT,
        )
        if left > 0 and sys.stderr.isatty():  # a person pressed Ctrl-C: say why nothing seems to happen
            print(
                f"mcp-tasks-proxy: draining: waiting for {left} call(s) to finish (at most {seconds:g} s); "
                "press Ctrl-C again to stop now",
                file=sys.stderr,
                flush=True,
            )
        self._background.spawn(self._watch(seconds), "drain")

    async def close(self) -> None:
        """The serve loop stops: a drain still watching is cancelled."""
        await self._background.close()

    async def _watch(self, seconds: float) -> None:
        deadline = self._began + seconds
        next_report = self._began + REPORT_SECONDS
        while (left := self.left()) > 0:
            now = time.monotonic()
            if now >= deadline:
                log.warning("drain_timed_out", drain_seconds=seconds, calls_left=left)
                self._finish("timeout")
                return
            if now >= next_report:  # a long drain is not silent: what it still waits for, and how to cut it short
                log.info(
                    "drain_waiting", calls_left=left, seconds_left=round(deadline - now, 1), hint=SECOND_SIGNAL_HINT
                )
                next_report = now + REPORT_SECONDS
            await asyncio.sleep(CHECK_SECONDS)
        self._finish("idle")

    def _finish(self, why: str) -> None:
        if not self.drained.is_set():
            log.info("drain_finished", reason=why, seconds=round(time.monotonic() - self._began, 3))
            self.drained.set()
        self.stopped.set()

    # --- admission while draining -----------------------------------------------------------------------

    def check_modern(self, request: ModernRequest) -> None:
        """A new call (tools/call, prompts/get, resources/read without requestState) starts work this replica
        could not finish: refused so the client or the balancer sends it to another replica. Lookups, task
        operations, MRTR retries and listen streams are served."""
        if self.draining and request.method in NEW_WORK and "requestState" not in request.params:
            raise DrainingError(request_id=request.id)

    def check_legacy(self, request: web.Request, decoded: object) -> None:
        """A legacy request without `Mcp-Session-Id` opens a new session (or is sessionless): refused while
        draining. A request of an existing session goes on to the legacy server as before."""
        if not self.draining or request.method != "POST" or request.headers.get(SESSION_HEADER):
            return
        request_id = decoded.get("id") if isinstance(decoded, dict) else None
        raise DrainingError(request_id=request_id if isinstance(request_id, int | str) else None)


def track(drain: Drain) -> Middleware:
    """A middleware counting this replica's requests in flight to the MCP endpoint (what a drain waits for)."""

    @web.middleware
    async def tracked(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != drain.mcp_path:
            return await handler(request)
        drain.requests[id(request)] = request
        try:
            return await handler(request)
        finally:
            del drain.requests[id(request)]

    return tracked


# --- /drainz: what the legacy container's preStop waits on ------------------------------------------------


async def drainz(request: web.Request) -> web.Response:
    """Reports; never starts a drain (only SIGTERM or SIGINT do). Answers 200 once this replica's drain is over
    (nothing of its own runs any more, or the drain ran out). Until then it waits, up to `?wait=SECONDS`
    (default: `tasks.drain_seconds` + 5 s), then answers 503 with the state. A replica that is not draining
    is given DRAINZ_MARGIN_SECONDS of that for a drain to begin (the preStop hook may call just before SIGTERM
    reaches the proxy), then it answers 503 `serving` at once: a GET from a browser, or a legacy container
    restarted on its own, does not wait for a drain that is not coming."""
    drain: Drain = request.app[DRAIN]
    default = drain.live.current.tasks.drain_seconds + DRAINZ_MARGIN_SECONDS
    try:
        wait = max(0.0, float(request.query.get("wait", default)))
    except ValueError:
        wait = default
    deadline = time.monotonic() + wait
    try:
        if not drain.draining:
            async with asyncio.timeout(min(wait, DRAINZ_MARGIN_SECONDS)):
                await drain.began.wait()
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            await drain.drained.wait()
    except TimeoutError:
        state = "draining" if drain.draining else "serving"
        return web.json_response({"status": state, "callsLeft": drain.left()}, status=503)
    return web.json_response({"status": "drained", "callsLeft": drain.left()})


DRAIN: Final = web.AppKey("drain", Drain)
