"""Follows a task the upstream runs itself (2025-11-25 Tasks): the task-augmented `tools/call`, one `tasks/result`
at a time, `tasks/get` and `tasks/cancel`, its session adopted after a restart. Decides nothing; imports the
pump, the upstream pool and the wire; not the store."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Final

import structlog

from proxy.errors import CALLER_CREDENTIAL_ERRORS, ResultTooLargeError, UpstreamError
from proxy.tasks.effects import pump
from proxy.tasks.effects.held import stop_pump
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import (
    CancelUpstreamTask,
    Ended,
    FollowUpstreamTask,
    PollUpstreamTask,
    ReleaseCall,
    StartUpstreamTask,
    UpstreamTaskCreated,
    UpstreamTaskPolled,
)
from proxy.tasks.ports import Feed, Spawner
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import Session, answer
from proxy.wire import legacy_tasks
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult

log = structlog.get_logger(__name__)

RETRY_DELAYS_SECONDS: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # a dropped tasks/result is opened again after


class UpstreamTaskFollower:
    """Follows the upstream's own 2025-11-25 task; a `Follower`.

    - `StartUpstreamTask`: a `tools/call` with `params.task` on a session of the call's own, whose
      `CreateTaskResult` becomes `UpstreamTaskCreated`; then one `tasks/result` at a time (the mcp 1.x SDK wakes
      only one waiter per task), whose questions and outcome go to the machine, opened again when it drops or
      times out. A task resumed after a restart adopts its stored upstream session (no `initialize`) and goes
      straight to `tasks/result` (`FollowUpstreamTask`).
    - `PollUpstreamTask`: `tasks/get`, answered with `UpstreamTaskPolled`; `CancelUpstreamTask`: `tasks/cancel`;
      `ReleaseCall`: letting go of the task without cancelling it (at shutdown its session is kept, not ended).

    An upstream that no longer knows the session or task (`pump.gone`) is `known=False`. An outcome over
    `limits.max_result_bytes` fails the task. Any other failure is passing: asked again later. Decides nothing;
    feeds events through the `Feed`. Imports the pump, the upstream pool and event types, the wire; not the store."""

    def __init__(self, feed: Feed, spawner: Spawner, pool: SessionPool, clock_ms: pump.Clock) -> None:
        self.feed = feed
        self.spawner = spawner
        self.pool = pool
        self.clock_ms = clock_ms

    # --- the commands ------------------------------------------------------------------------------------

    async def start(self, call: LiveCall, command: StartUpstreamTask) -> None:
        self._start_pump(call, command.ttl_ms)

    async def follow(self, call: LiveCall, command: FollowUpstreamTask) -> None:
        if (
            call.upstream.pump is None or call.upstream.pump.done()
        ):  # after a restart; otherwise the pump goes on by itself
            self._start_pump(call, None)

    async def poll(self, call: LiveCall, command: PollUpstreamTask) -> None:
        self.spawner.spawn(self._poll(call), f"upstream-task-poll-{call.call_id}")

    async def cancel(self, call: LiveCall, command: CancelUpstreamTask) -> None:
        await self._cancel(call)
        stop_pump(call)

    async def release(self, call: LiveCall, command: ReleaseCall) -> None:
        if command.keep_session and call.upstream.session is not None:
            self.pool.keep(call.upstream.session)
        stop_pump(call)

    # --- the pump ------------------------------------------------------------------------------------------

    def _start_pump(self, call: LiveCall, ttl_ms: int | None) -> None:
        """Create the upstream's task (unless it exists: a resumed task), then follow it to its outcome."""

        async def drive(session: Session) -> None:
            if call.state.upstream_task is None and not await self._create(call, session, ttl_ms):
                return
            await self._follow(call, session)

        pump.start(self.spawner, self.feed, call, self._session(call), drive, f"upstream-task-{call.call_id}")

    def _session(self, call: LiveCall) -> AbstractAsyncContextManager[Session]:
        """A session of the call's own, whatever its client declared: the upstream scopes its task to the
        session, and tells the task's status on that session's GET stream. After a restart, the one stored with
        the task, taken over."""
        on_stream = pump.sink(self.feed, call)
        if call.state.upstream_task is not None and call.stored.record is not None:
            return self.pool.adopt(call.principal, call.stored.record.upstream_session_id, on_stream)
        return self.pool.lease(call.principal, on_stream, asks=True)

    async def _create(self, call: LiveCall, session: Session, ttl_ms: int | None) -> bool:
        """The task-augmented tools/call. True when the machine now follows the upstream's task; False when the
        upstream answered it like a plain call (that was its outcome) or the call was abandoned."""
        params = legacy_tasks.with_task(call.params, ttl_ms)
        async with session.call(call.method, params, call.headers) as upstream:
            pump.sending(call, upstream)
            async for event in upstream.events():
                task = legacy_tasks.created_task(event.result) if isinstance(event, UpstreamResult) else None
                if task is not None:
                    await self._created(call, session, task)
                    break
                await self.feed.dispatch(call, pump.call_event(event))
                if not call.state.running:
                    return False
        pump.sending(call, None)  # answered: nothing to cancel with notifications/cancelled any more
        return call.state.running and call.state.upstream_task is not None

    async def _created(self, call: LiveCall, session: Session, task: legacy_tasks.LegacyTask) -> None:
        try:
            await self.feed.dispatch(call, UpstreamTaskCreated(task, self.clock_ms()))
        except asyncio.CancelledError:
            if call.state.upstream_task is None:  # never taken in (the call was stopped meanwhile): cancel it
                self.spawner.spawn(self._request(session, call, "tasks/cancel", task.task_id), "upstream-task-orphan")
            raise

    async def _follow(self, call: LiveCall, session: Session) -> None:
        """One tasks/result at a time until the outcome came (or the call stopped following)."""
        upstream_task = call.state.upstream_task
        assert upstream_task is not None
        attempt = 0

        def done() -> bool:
            return not (call.state.running and upstream_task.following)

        while not done():
            try:
                params = {"taskId": upstream_task.task_id}
                async with session.call("tasks/result", params, call.headers, tool=call.name) as upstream:
                    async for event in upstream.events():
                        attempt = 0
                        await self.feed.dispatch(call, pump.call_event(event))
                        if done():
                            return
            except (ResultTooLargeError, *CALLER_CREDENTIAL_ERRORS) as exc:  # fails with the limit, or with a
                await self.feed.dispatch(call, Ended(exc))  # credential that can no longer be made for its caller
                return
            except UpstreamError as exc:
                if pump.gone(exc):
                    await self.feed.dispatch(call, UpstreamTaskPolled(None, known=False))
                    return
                log.info("upstream_task_result_dropped", task_id=call.state.task_id, error=exc.message)
            await asyncio.sleep(RETRY_DELAYS_SECONDS[min(attempt, len(RETRY_DELAYS_SECONDS) - 1)])
            attempt += 1

    # --- tasks/get, tasks/cancel -----------------------------------------------------------------------------

    async def _poll(self, call: LiveCall) -> None:
        upstream_task = call.state.upstream_task
        session = call.upstream.session
        if upstream_task is None:
            return
        polled = UpstreamTaskPolled(None)
        if session is not None:
            try:
                answer = await self._request(session, call, "tasks/get", upstream_task.task_id)
            except CALLER_CREDENTIAL_ERRORS as exc:
                await self.feed.dispatch(call, Ended(exc))
                return
            except UpstreamError as exc:
                if pump.gone(exc):
                    polled = UpstreamTaskPolled(None, known=False)
                else:
                    log.info("upstream_task_poll_failed", task_id=call.state.task_id, error=exc.message)
            else:
                if isinstance(answer, UpstreamResult):
                    polled = UpstreamTaskPolled(legacy_tasks.parse_task(answer.result))
                elif answer.error.get("code") == legacy_tasks.NOT_FOUND_CODE:
                    polled = UpstreamTaskPolled(None, known=False)
        await self.feed.dispatch(call, polled)

    async def _cancel(self, call: LiveCall) -> None:
        upstream_task = call.state.upstream_task
        if call.upstream.session is None or upstream_task is None:
            return
        try:
            answer = await self._request(call.upstream.session, call, "tasks/cancel", upstream_task.task_id)
        except (UpstreamError, *CALLER_CREDENTIAL_ERRORS) as exc:
            log.warning("upstream_task_cancel_failed", task_id=call.state.task_id, error=exc.message)
            return
        if isinstance(answer, UpstreamErrorResponse):  # e.g. already terminal there: nothing left to stop
            log.info("upstream_task_cancel_refused", task_id=call.state.task_id, error=answer.error.get("message"))

    async def _request(
        self, session: Session, call: LiveCall, method: str, task_id: str
    ) -> UpstreamResult | UpstreamErrorResponse:
        """One tasks/* request about the task, for its answer (a cancel runs while the call's events wait: what
        else its stream carries is not fed to the call)."""
        async with session.call(method, {"taskId": task_id}, call.headers, tool=call.name) as upstream:
            return await answer(upstream)
