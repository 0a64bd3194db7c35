"""The one pump of an upstream call, for both kinds (a held request, a task the upstream runs itself): the
session it runs on, each upstream event fed to the call as the machine's event, and the one crash wrapper (a
lost upstream ends the call with its error; any other failure ends it with a plain message for the client,
the exception only in the log-only `detail`). What an upstream failure means for a task the upstream runs
(`gone`) is read here only. Imports the ports, errors, tracing and the upstream event types; not the store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

import structlog

from proxy.errors import ProxyError, UpstreamError, UpstreamSessionGoneError
from proxy.observe import tracing
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import Asked, Ended, Event, Notified
from proxy.tasks.ports import Feed, Spawner
from proxy.upstream.session import RequestStream, Session
from proxy.wire.upstream_events import UpstreamEvent, UpstreamNotification, UpstreamServerRequest

log = structlog.get_logger(__name__)

Clock = Callable[[], int]  # wall clock, epoch milliseconds

CRASHED: Final = "Internal error: the call failed in the proxy"


def call_event(event: UpstreamEvent) -> Event:
    """What an upstream event is to the call's machine."""
    if isinstance(event, UpstreamServerRequest):
        return Asked(event)
    if isinstance(event, UpstreamNotification):
        return Notified(event.message, time.monotonic() * 1000)
    return Ended(event)


def gone(exc: UpstreamError) -> bool:
    """The upstream no longer knows the session (or the task): upstream/ says so with its own error type."""
    return isinstance(exc, UpstreamSessionGoneError)


def sink(feed: Feed, call: LiveCall) -> Callable[[UpstreamEvent], Awaitable[None]]:
    """Where what the upstream sends on the call's session stream (a question naming no request) goes."""

    async def on_stream(event: UpstreamEvent) -> None:
        await feed.dispatch(call, call_event(event))

    return on_stream


def start(
    spawner: Spawner,
    feed: Feed,
    call: LiveCall,
    session: AbstractAsyncContextManager[Session],
    body: Callable[[Session], Awaitable[None]],
    name: str,
) -> None:
    """The call's pump, in the background: `run`, kept on the call's upstream side (this module alone writes it)."""
    call.upstream.pump = spawner.spawn(run(feed, call, session, body), name)


def sending(call: LiveCall, upstream: RequestStream | None) -> None:
    """The request the call's upstream side holds open (None: answered, nothing to cancel upstream any more)."""
    call.upstream.stream = upstream


def run(
    feed: Feed,
    call: LiveCall,
    session: AbstractAsyncContextManager[Session],
    body: Callable[[Session], Awaitable[None]],
) -> Coroutine[Any, Any, None]:
    """Hold `session` for the call while `body` drives the upstream call on it; every way it ends is fed to the
    call (never silence). Run in the background, its upstream CLIENT spans stay in the trace of the request that
    started the call and carry the task id once there is one."""
    return tracing.background(_run(feed, call, session, body), lambda: call.state.task_id)


async def _run(
    feed: Feed,
    call: LiveCall,
    session: AbstractAsyncContextManager[Session],
    body: Callable[[Session], Awaitable[None]],
) -> None:
    try:
        async with session as held:
            call.upstream.session = held
            await body(held)
    except ProxyError as exc:  # UpstreamError and friends: a lost upstream
        await feed.dispatch(call, Ended(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the coroutine wrapper: a crash is the call's outcome, never silence
        log.exception("call_crashed", task_id=call.state.task_id, name=call.name)
        await feed.dispatch(call, Ended(ProxyError(CRASHED, detail=repr(exc))))


async def stream(feed: Feed, call: LiveCall, upstream: RequestStream, *, until: Callable[[], bool]) -> bool:
    """Feed the upstream call's events to the call; True when `until()` said to stop reading (after an event),
    False when the events ran out."""
    async for event in upstream.events():
        await feed.dispatch(call, call_event(event))
        if until():
            return True
    return False
