"""Follows a legacy job (`jobs:`): its family's start, status, result and cancel tools in place of 2025-11-25
`tasks/*`; no request or session held between polls. Decides nothing; imports the pump, the job's reading,
the upstream pool and the wire; not the store."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import structlog

from proxy.config.schema import Config, JobConfig, JobToolConfig
from proxy.config.suggest import did_you_mean
from proxy.errors import CALLER_CREDENTIAL_ERRORS, ResultTooLargeError, UpstreamError
from proxy.tasks.effects import pump
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine import commands as c
from proxy.tasks.machine.job import JOB_CANCELLED, JobReport, JobSpec, backoff_ms
from proxy.tasks.ports import Feed, Spawner
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import Session, answer
from proxy.wire import tasks as wire_tasks
from proxy.wire.legacy_tasks import LegacyTask
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult

log = structlog.get_logger(__name__)

SPEC_GONE = "Internal error: the jobs: entry of this tool is gone from the config"


def specs_of(jobs: Mapping[str, JobConfig]) -> dict[str, JobSpec]:
    return {tool: JobSpec(tool, config) for tool, config in jobs.items()}


@dataclass(eq=False, slots=True)
class JobFollower:
    """Follows a legacy job through its family's tools; a `Follower`.

    - `StartUpstreamTask` of a job call: the start tool, as a plain `tools/call`; its job id becomes
      `UpstreamTaskCreated` (a result without one, or an error, is the call's outcome).
    - `PollUpstreamTask`: one call of the status tool, read into `UpstreamTaskPolled` (a failed or unreadable poll
      doubles the interval, up to 30 s, never below the configured one); a state that maps to an end is followed by
      the result tool (or the status result itself) as `Ended`.
    - `CancelUpstreamTask`: the cancel tool, when the family has one. `FollowUpstreamTask` and `ReleaseCall`: nothing
      (no request or session is held between polls).
    Decides nothing; feeds events through the `Feed`. Imports the pump, the job spec, the upstream pool and event
    types, the wire; not the store."""

    feed: Feed
    spawner: Spawner
    pool: SessionPool
    clock_ms: pump.Clock
    config: Callable[[], Config]  # the config in force (its jobs): a live reload swaps what it returns

    @property
    def specs(self) -> dict[str, JobSpec]:
        """The jobs in force (a job running keeps polling by the entry in force after a live reload); their
        expressions come compiled from jmespath's own cache."""
        return specs_of(self.config().jobs)

    # --- the commands ------------------------------------------------------------------------------------

    async def start(self, call: LiveCall, command: c.StartUpstreamTask) -> None:
        spec = self.specs.get(call.name)

        async def send(session: Session) -> None:
            if spec is None:
                await self.feed.dispatch(call, c.Ended(UpstreamErrorResponse(wire_tasks.internal_error(SPEC_GONE))))
                return
            async with session.call(call.method, call.params, call.headers) as upstream:
                pump.sending(call, upstream)
                async for event in upstream.events():
                    if isinstance(event, UpstreamResult):
                        await self._started(call, spec, event)
                        break
                    await self.feed.dispatch(call, pump.call_event(event))
                    if not call.state.running:
                        break
            pump.sending(call, None)

        session = self.pool.lease(call.principal, pump.sink(self.feed, call), asks=False)
        pump.start(self.spawner, self.feed, call, session, send, f"job-start-{call.call_id}")

    async def _started(self, call: LiveCall, spec: JobSpec, answer: UpstreamResult) -> None:
        """The start tool's answer: the job's id starts the task; an `isError` result is the outcome as it is;
        a result without an id fails the call, carrying that result."""
        job_id = spec.job_id(answer.result)
        if job_id is None:
            failed = (
                answer if answer.result.get("isError") is True else UpstreamErrorResponse(spec.no_job_id(answer.result))
            )
            await self.feed.dispatch(call, c.Ended(failed))
            return
        log.info("job_started", tool=call.name, job_id=job_id)
        job = LegacyTask(job_id, "working", poll_interval_ms=spec.poll_interval_ms)
        await self.feed.dispatch(call, c.UpstreamTaskCreated(job, self.clock_ms()))

    async def follow(self, call: LiveCall, command: c.FollowUpstreamTask) -> None:
        """Nothing to open: the status tool is called at each poll."""

    async def poll(self, call: LiveCall, command: c.PollUpstreamTask) -> None:
        self.spawner.spawn(self._poll(call), f"job-poll-{call.call_id}")

    async def cancel(self, call: LiveCall, command: c.CancelUpstreamTask) -> None:
        spec = self.specs.get(call.name)
        job = call.state.upstream_task
        if spec is None or spec.config.cancel is None or job is None:
            return
        try:
            answer = await self._call(call, spec.config.cancel, job.task_id)
        except (UpstreamError, *CALLER_CREDENTIAL_ERRORS) as exc:
            log.warning("job_cancel_failed", task_id=call.state.task_id, tool=call.name, error=exc.message)
            return
        if isinstance(answer, UpstreamErrorResponse) or answer.result.get("isError") is True:
            log.info("job_cancel_refused", task_id=call.state.task_id, tool=call.name)

    async def release(self, call: LiveCall, command: c.ReleaseCall) -> None:
        """Nothing is held between polls; a poll in flight finds the call stopped."""

    # --- a poll ----------------------------------------------------------------------------------------------

    async def _poll(self, call: LiveCall) -> None:
        spec = self.specs.get(call.name)
        job = call.state.upstream_task
        if job is None or not call.state.running:
            return
        if spec is None:
            await self.feed.dispatch(call, c.Ended(UpstreamErrorResponse(wire_tasks.internal_error(SPEC_GONE))))
            return
        try:
            answer = await self._call(call, spec.config.status, job.task_id)
            report = spec.report(answer.result) if isinstance(answer, UpstreamResult) else None
            if report is None:
                log.info("job_status_unreadable", task_id=call.state.task_id, tool=spec.config.status.tool)
            elif report.terminal:
                await self._ended(call, spec, job.task_id, report, answer)
                return
        except (ResultTooLargeError, *CALLER_CREDENTIAL_ERRORS) as exc:  # the task fails with the limit, or with
            await self.feed.dispatch(call, c.Ended(exc))  # a credential that can no longer be made for its caller
            return
        except UpstreamError as exc:
            log.info("job_poll_failed", task_id=call.state.task_id, tool=call.name, error=exc.message)
            report = None
        if report is None:  # asked again later, less often
            interval_ms = backoff_ms(job.poll_interval_ms, spec.poll_interval_ms)
            polled = LegacyTask(job.task_id, "working", poll_interval_ms=interval_ms)
        else:
            polled = LegacyTask(job.task_id, "working", report.message, poll_interval_ms=spec.poll_interval_ms)
        await self.feed.dispatch(call, c.UpstreamTaskPolled(polled))

    async def _ended(
        self,
        call: LiveCall,
        spec: JobSpec,
        job_id: str,
        report: JobReport,
        status: UpstreamResult | UpstreamErrorResponse,
    ) -> None:
        """A state that maps to an end: a completed job's result is the result tool's answer (or the status
        result); a failed one fails with its error message; a cancelled one ends `cancelled`."""
        outcome: UpstreamResult | UpstreamErrorResponse = status
        if report.status == "completed" and spec.config.result is not None:
            outcome = await self._call(call, spec.config.result, job_id)  # an UpstreamError: polled again
        elif report.status == "failed":
            outcome = UpstreamErrorResponse(wire_tasks.internal_error(report.error or report.status))
        elif report.status == "cancelled":
            outcome = UpstreamErrorResponse(wire_tasks.internal_error(JOB_CANCELLED))
        log.info("job_ended", task_id=call.state.task_id, tool=call.name, status=report.status)
        await self.feed.dispatch(call, c.UpstreamTaskPolled(LegacyTask(job_id, report.status, report.message)))
        await self.feed.dispatch(call, c.Ended(outcome))

    async def _call(self, call: LiveCall, tool: JobToolConfig, job_id: str) -> UpstreamResult | UpstreamErrorResponse:
        """One helper tool's call on the principal's shared session, for its answer; a question it asks is
        refused at once (nobody could answer it)."""
        params = JobSpec.arguments(tool, job_id)
        async with (
            self.pool.use(call.principal) as session,
            session.call("tools/call", params, call.headers) as upstream,
        ):
            return await answer(upstream, refuse_on=session)

    # --- the check at start ------------------------------------------------------------------------------

    def missing_tools(self, listed: Collection[str]) -> list[str]:
        """Each tool a job family names that the upstream does not list (`listed`, its tools/list read once at
        start): warned about, saying what will fail."""
        missing = []
        for spec in self.specs.values():
            for role, tool in spec.tools().items():
                if tool not in listed:
                    missing.append(tool)
                    log.warning(
                        "job_tool_missing",
                        job=spec.start_tool,
                        role=role,
                        tool=tool,
                        detail=f"the upstream lists no tool {tool!r}{did_you_mean(tool, listed)}: calls of "
                        f"{spec.start_tool!r} will fail where the job's {role} tool is called",
                    )
        return missing
