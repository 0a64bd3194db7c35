"""Carries out what a call's machine says about a task the upstream runs itself (2025-11-25 Tasks).

- The pump: a `tools/call` with `params.task` on the call's leased session, whose `CreateTaskResult` becomes
  `UpstreamTaskCreated`; then one `tasks/result` at a time (the mcp 1.x SDK wakes only one waiter per task),
  whose questions and outcome go to the machine, opened again when it drops or times out. A task resumed
  after a restart adopts its stored upstream session (no `initialize`) and goes straight to `tasks/result`.
- `tasks/get` for `PollUpstreamTask`, answered with `UpstreamTaskPolled`; `tasks/cancel`; letting go of the
  task at shutdown without cancelling it (its session is kept, not ended with DELETE).

`UpstreamSessionGoneError` (upstream/ raises it) means the upstream no longer knows the session (or task):
server-everything answers 400 for an unknown session, the mcp 1.x SDK 404 (and a new session then answers
`-32602` for the task). An outcome over `limits.max_result_bytes` fails the task. Any other failure is
passing: asked again later. Decides nothing; feeds events to the
runner's `dispatch`. Imports the upstream client and event types, the commands and the wire; not the front.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final, Protocol

import structlog

from proxy.errors import ProxyError, ResultTooLargeError, UpstreamError, UpstreamSessionGoneError
from proxy.tasks.commands import (
    Asked,
    CancelUpstreamTask,
    Ended,
    Event,
    FollowUpstreamTask,
    Notified,
    PollUpstreamTask,
    ReleaseCall,
    UpstreamTaskCreated,
    UpstreamTaskPolled,
)
from proxy.upstream.events import (
    UpstreamErrorResponse,
    UpstreamEvent,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
)
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import Session
from proxy.wire import legacy_tasks

if TYPE_CHECKING:
    from proxy.tasks.calls import Call

log = structlog.get_logger(__name__)

RETRY_DELAYS_SECONDS: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # a dropped tasks/result is opened again after
UpstreamTaskCommand = FollowUpstreamTask | PollUpstreamTask | CancelUpstreamTask | ReleaseCall


class Driver(Protocol):
    """What carrying out these commands needs from the runner."""

    upstream: SessionPool
    clock: Callable[[], int]  # wall clock, epoch milliseconds

    async def dispatch(self, call: Call, event: Event) -> None: ...

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]: ...


def call_event(event: UpstreamEvent) -> Event:
    if isinstance(event, UpstreamServerRequest):
        return Asked(event)
    if isinstance(event, UpstreamNotification):
        return Notified(event.message, time.monotonic() * 1000)
    return Ended(event)


class UpstreamTasks:
    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    async def execute(self, call: Call, command: UpstreamTaskCommand) -> None:
        if isinstance(command, FollowUpstreamTask):
            if call.pump is None or call.pump.done():  # after a restart; otherwise the pump goes on by itself
                call.pump = self.driver.spawn(self.pump(call, None), f"upstream-task-{call.call_id}")
        elif isinstance(command, PollUpstreamTask):
            self.driver.spawn(self._poll(call), f"upstream-task-poll-{call.call_id}")
        elif isinstance(command, CancelUpstreamTask):
            await self._cancel(call)
            self._stop_pump(call)
        else:
            if command.keep_session and call.session is not None:
                self.driver.upstream.keep(call.session)
            self._stop_pump(call)

    # --- the pump ------------------------------------------------------------------------------------------

    async def pump(self, call: Call, ttl_ms: int | None) -> None:
        """Create the upstream's task (unless it exists: a resumed task), then follow it to its outcome."""
        try:
            async with self._session(call) as session:
                call.session = session
                if call.state.upstream_task is None and not await self._create(call, session, ttl_ms):
                    return
                await self._follow(call, session)
        except ProxyError as exc:  # UpstreamError and friends: a lost upstream
            await self.driver.dispatch(call, Ended(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the coroutine wrapper: a crash is the call's outcome, never silence
            log.exception("call_crashed", task_id=call.state.task_id, name=call.name)
            await self.driver.dispatch(call, Ended(ProxyError(f"Internal error: {exc!r}")))

    def _session(self, call: Call) -> AbstractAsyncContextManager[Session]:
        """A session of the call's own, whatever its client declared: the upstream scopes its task to the
        session, and tells the task's status on that session's GET stream. After a restart, the one stored with
        the task, taken over."""

        async def on_stream(event: UpstreamEvent) -> None:
            await self.driver.dispatch(call, call_event(event))

        pool = self.driver.upstream
        if call.state.upstream_task is not None and call.record is not None:
            return pool.adopt(call.principal, call.record.upstream_session_id, on_stream)
        return pool.lease(call.principal, on_stream, asks=True)

    async def _create(self, call: Call, session: Session, ttl_ms: int | None) -> bool:
        """The task-augmented tools/call. True when the machine now follows the upstream's task; False when the
        upstream answered it like a plain call (that was its outcome) or the call was abandoned."""
        params = legacy_tasks.with_task(call.params, ttl_ms)
        async with session.call(call.method, params, call.headers) as upstream:
            call.upstream = upstream
            async for event in upstream.events():
                task = legacy_tasks.created_task(event.result) if isinstance(event, UpstreamResult) else None
                if task is not None:
                    await self._created(call, session, task)
                    break
                await self.driver.dispatch(call, call_event(event))
                if not call.state.running:
                    return False
        call.upstream = None  # answered: nothing to cancel with notifications/cancelled any more
        return call.state.running and call.state.upstream_task is not None

    async def _created(self, call: Call, session: Session, task: legacy_tasks.LegacyTask) -> None:
        try:
            await self.driver.dispatch(call, UpstreamTaskCreated(task, self.driver.clock()))
        except asyncio.CancelledError:
            if call.state.upstream_task is None:  # never taken in (the call was stopped meanwhile): cancel it
                self.driver.spawn(self._request(session, call, "tasks/cancel", task.task_id), "upstream-task-orphan")
            raise

    async def _follow(self, call: Call, session: Session) -> None:
        """One tasks/result at a time until the outcome came (or the call stopped following)."""
        followed = call.state.upstream_task
        assert followed is not None
        attempt = 0
        while call.state.running and followed.following:
            try:
                async with session.call("tasks/result", {"taskId": followed.task_id}, call.headers) as upstream:
                    async for event in upstream.events():
                        attempt = 0
                        await self.driver.dispatch(call, call_event(event))
                        if not (call.state.running and followed.following):
                            return
            except ResultTooLargeError as exc:  # the outcome cannot be taken: the task fails with the limit
                await self.driver.dispatch(call, Ended(exc))
                return
            except UpstreamError as exc:
                if isinstance(exc, UpstreamSessionGoneError):
                    await self.driver.dispatch(call, UpstreamTaskPolled(None, known=False))
                    return
                log.info("upstream_task_result_dropped", task_id=call.state.task_id, error=exc.message)
            await asyncio.sleep(RETRY_DELAYS_SECONDS[min(attempt, len(RETRY_DELAYS_SECONDS) - 1)])
            attempt += 1

    # --- tasks/get, tasks/cancel -----------------------------------------------------------------------------

    async def _poll(self, call: Call) -> None:
        followed = call.state.upstream_task
        session = call.session
        if followed is None:
            return
        polled = UpstreamTaskPolled(None)
        if session is not None:
            try:
                answer = await self._request(session, call, "tasks/get", followed.task_id)
            except UpstreamError as exc:
                if isinstance(exc, UpstreamSessionGoneError):
                    polled = UpstreamTaskPolled(None, known=False)
                else:
                    log.info("upstream_task_poll_failed", task_id=call.state.task_id, error=exc.message)
            else:
                if isinstance(answer, UpstreamResult):
                    polled = UpstreamTaskPolled(legacy_tasks.parse_task(answer.result))
                elif answer.error.get("code") == legacy_tasks.NOT_FOUND_CODE:
                    polled = UpstreamTaskPolled(None, known=False)
        await self.driver.dispatch(call, polled)

    async def _cancel(self, call: Call) -> None:
        followed = call.state.upstream_task
        if call.session is None or followed is None:
            return
        try:
            answer = await self._request(call.session, call, "tasks/cancel", followed.task_id)
        except UpstreamError as exc:
            log.warning("upstream_task_cancel_failed", task_id=call.state.task_id, error=exc.message)
            return
        if isinstance(answer, UpstreamErrorResponse):  # e.g. already terminal there: nothing left to stop
            log.info("upstream_task_cancel_refused", task_id=call.state.task_id, error=answer.error.get("message"))

    async def _request(
        self, session: Session, call: Call, method: str, task_id: str
    ) -> UpstreamResult | UpstreamErrorResponse:
        """One tasks/* request about the task, for its answer (a cancel runs while the call's events wait: what
        else its stream carries is not fed to the call)."""
        async with session.call(method, {"taskId": task_id}, call.headers) as upstream:
            async for event in upstream.events():
                if isinstance(event, UpstreamResult | UpstreamErrorResponse):
                    return event
        raise UpstreamError(f"Upstream did not answer {method}")  # pragma: no cover - events() raises first

    def _stop_pump(self, call: Call) -> None:
        if call.pump is not None and call.pump is not asyncio.current_task():
            call.pump.cancel()
