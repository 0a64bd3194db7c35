"""The task runner: every background coroutine of a call that may outlive its HTTP request.

Owns the upstream calls of `tools/call` (all of them), `prompts/get` and `resources/read`: the sync window,
task creation (commit before the handle is returned, T-14), the call's events (progress → statusMessage or the
client's stream; upstream questions → a task's `inputRequests` or an MRTR round; final → settled record or
response), cancel, limits, TTL/retention sweeps and restart recovery. The only creator of background tasks
outside `upstream/`. Imports the store, the upstream client, policy and wire; never aiohttp's web side or the
front. Questions and answers are handled by its `InputBridge` (`bridge.py`); the requests that wait for a
call (and MRTR) are in `waiting.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any, Final, TypeVar

import structlog

from proxy.config import Config
from proxy.errors import InvalidParamsError, ProxyError, TaskLimitError, UpstreamError
from proxy.observability import Metrics
from proxy.policy import Outcome, Policy
from proxy.tasks import pacing
from proxy.tasks.bridge import InputBridge
from proxy.tasks.job import Job, JobMode
from proxy.tasks.store import StoreError, StoreFullError, TaskStore
from proxy.upstream.call import (
    UpstreamErrorResponse,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
)
from proxy.upstream.session import UpstreamClient, principal_key
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.envelope import Caller, ModernRequest
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_SECONDS: Final = 1.0  # how often expired tasks and parked calls are ended, old records purged
SHUTDOWN_GRACE_SECONDS: Final = 5.0  # how long close() waits for cancelled calls to tell the upstream
PROGRESS_WRITE_INTERVAL_SECONDS: Final = 0.2  # at most this often is a task's statusMessage rewritten
CANCELLED_BY_CLIENT: Final = "cancelled by the client"
PARKED_EXPIRED: Final = "the client did not retry within inputs.request_state_ttl_ms"
# Outcomes whose call may become a task: the proxy asks the upstream for progress (statusMessage) even when
# the client did not.
_TASK_CAPABLE: Final = frozenset({Outcome.TASK, Outcome.WINDOW, Outcome.WAIT, Outcome.INPUT_FIRST})

_T = TypeVar("_T")


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class TaskRunner:
    def __init__(
        self,
        config: Config,
        store: TaskStore,
        upstream: UpstreamClient,
        clock: Callable[[], int] = wall_clock_ms,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config.tasks
        self.cache = (config.discovery.cache_ttl_ms, config.discovery.cache_scope)
        self.metrics = metrics
        self.store = store
        self.upstream = upstream
        self.clock = clock
        self.process_id = uuid.uuid4().hex  # the `owner` of every task this process runs
        self._jobs: dict[str, Job] = {}  # task id → its job, for tasks whose upstream call runs here
        self._running: set[Job] = set()  # jobs that hold a `max_running` slot
        self._background: set[asyncio.Task[Any]] = set()
        self._progress_tokens = 0
        self.durations = pacing.DurationEstimates()  # how long each tool's tasks usually take
        self._closing = False  # set by close(): cancelled calls then leave their records live
        self.bridge = InputBridge(config.inputs, store, clock, metrics, self._spawn, self._running, self.process_id)

    # --- lifecycle -----------------------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        """The one place tasks/ starts background work: named, referenced until done."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._background.add(task)
        task.add_done_callback(self._reap)
        return task

    async def shielded(self, coroutine: Coroutine[Any, Any, _T], name: str) -> _T:
        """Run `coroutine` to its end even if the caller is cancelled meanwhile (the caller still sees the
        cancellation); the work is a referenced background task, not an orphan."""
        return await asyncio.shield(self._spawn(coroutine, name))

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_background_failed", coroutine=task.get_name(), error=repr(task.exception()))

    async def start(self) -> None:
        """Restart recovery (before the first request is served), then the periodic sweep."""
        await self._recover()
        self._spawn(self._sweep_forever(), "task-sweeper")

    async def close(self) -> None:
        """Shutdown: running calls are cancelled upstream; their records stay live and are failed or re-run
        per `on_restart` at the next start (nothing committed is lost or rewritten here)."""
        self._closing = True
        for job in list(self._jobs.values()):
            job.cancel_reason = "the proxy is shutting down"
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=SHUTDOWN_GRACE_SECONDS)

    async def _recover(self) -> None:
        """Tasks a previous process left working / input_required: failed with a clear message, or re-run
        when their policy says `on_restart: rerun` (and the call can be sent again)."""
        now = self.clock()
        for record in await self.store.live():
            if record.expired(now):
                await self._fail(record.task_id, wire_tasks.EXPIRED_MESSAGE)
                continue
            if record.on_restart == "rerun":
                updated = await self.store.update(
                    record.task_id,
                    {
                        "status": TaskStatus.WORKING,
                        "status_message": wire_tasks.RERUN_MESSAGE,
                        "input_requests": {},
                        "owner": self.process_id,
                    },
                    now_ms=now,
                )
                if updated is not None:
                    self._rerun(updated)
                    continue
            await self._fail(record.task_id, wire_tasks.RESTART_MESSAGE)
            log.info("task_interrupted", task_id=record.task_id, tool=record.tool)

    def _rerun(self, record: TaskRecord) -> None:
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, "rerun")
        job = Job(
            method="tools/call",
            tool=record.tool,
            outcome_kind=Outcome.TASK,
            policy=policy,
            principal=record.rerun_principal,
            params=dict(record.request),
            headers={},
            capabilities=record.client_capabilities,
            mode=JobMode.TASK,
            task_id=record.task_id,
            issued=record.inputs_issued,  # K-39: keys stay unique across the re-run too
        )
        self._jobs[record.task_id] = job
        self._running.add(job)
        self.start_call(job)
        log.info("task_rerun", task_id=record.task_id, tool=record.tool)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_SECONDS)
            try:
                await self.sweep()
            except StoreError as exc:
                log.error("task_sweep_failed", error=str(exc))

    async def sweep(self) -> None:
        """T-38: fail live tasks past their TTL (and stop their calls); drop settled records past their TTL;
        cancel parked MRTR calls nobody resumed in time (C-13)."""
        now = self.clock()
        for job in self.bridge.expired(now):
            await self.end_parked(job)
        for record in await self.store.expired_live(now):
            await self._expire(record)
        purged = await self.store.purge_expired(now)
        if purged:
            log.info("tasks_purged", count=purged)

    async def end_parked(self, job: Job) -> None:
        self.bridge.unpark(job)
        log.info("mrtr_call_expired", method=job.method, name=job.tool, round=job.round)
        if job.task_id is not None:
            await self.cancel_task(job.task_id, PARKED_EXPIRED)
        else:
            self.cancel_job(job, PARKED_EXPIRED)

    # --- jobs and their records --------------------------------------------------------------------------

    def new_job(self, request: ModernRequest, caller: Caller, outcome: Outcome, policy: Policy | None) -> Job:
        params = translate.upstream_params(request.params)
        if outcome in _TASK_CAPABLE:
            meta = dict(params.get("_meta") or {})
            if "progressToken" not in meta:
                # Ask the upstream for progress even when the client did not: it becomes the statusMessage.
                self._progress_tokens += 1
                meta["progressToken"] = f"mcp-tasks-proxy-{self._progress_tokens}"
            params["_meta"] = meta
        name = request.params.get("uri") if request.method == "resources/read" else request.params.get("name")
        return Job(
            method=request.method,
            tool=str(name),
            outcome_kind=outcome,
            policy=policy,
            principal=caller.principal,
            params=params,
            headers=translate.trace_headers(request.meta, caller.headers),
            capabilities=request.client_capabilities,
            progress_token=request.progress_token,
            log_level=request.log_level,
        )

    def start_call(self, job: Job) -> None:
        job.coroutine = self._spawn(self._run(job), f"call-{job.task_id or job.call_id}")

    async def open_task(self, job: Job, caller: Caller, request: ModernRequest) -> TaskRecord:
        """Commit the record, then start its call: run shielded, so a client that leaves meanwhile cannot
        leave a committed record without a call behind (the task runs; its id was just not delivered)."""
        record = await self.create_task(job, caller, request)
        self.start_call(job)
        return record

    async def create_task(self, job: Job, caller: Caller, request: ModernRequest) -> TaskRecord:
        """Limits first (nothing is written when refused), then the committed record (T-14), with the questions
        already asked (a window call that asked, T-22). Publishing waits for the record (the job's lock)."""
        if not job.inputs and len(self._running) >= self.config.max_running:  # one waiting for input takes none
            raise TaskLimitError("max_running", self.config.max_running, request_id=request.id)
        async with job.lock:
            now = self.clock()
            policy = job.policy
            assert policy is not None
            record = TaskRecord(
                task_id=wire_tasks.new_task_id(),
                principal=principal_key(caller.principal),
                tool=job.tool,
                status=TaskStatus.INPUT_REQUIRED if job.inputs else TaskStatus.WORKING,
                created_at_ms=now,
                updated_at_ms=now,
                ttl_ms=policy.ttl_ms,
                poll_interval_ms=policy.poll_interval_ms,
                owner=self.process_id,
                on_restart=policy.on_restart,
                request=job.params,
                input_requests=job.input_requests(),
                inputs_issued=job.issued,
                rerun_principal=caller.principal if policy.on_restart == "rerun" else None,
                client_capabilities=job.capabilities,
            )
            try:
                await self.store.create(record)
            except StoreFullError:
                raise TaskLimitError("max_records", self.config.max_records, request_id=request.id) from None
            except StoreError as exc:
                raise ProxyError(
                    f"Internal error: the task could not be stored: {exc}", request_id=request.id
                ) from None
            job.task_id = record.task_id
            if job.mode is not JobMode.DETACHED and job.outcome_kind is not Outcome.WAIT:
                job.mode = JobMode.TASK
                job.channel = None  # T-43 / K-31: no request-scoped notifications once the call is a task
            self._jobs[record.task_id] = job
            if not job.finished.is_set() and not job.inputs:
                self._running.add(job)
        log.info("task_created", task_id=record.task_id, tool=job.tool, ttl_ms=record.ttl_ms)
        if job.inputs:
            self.bridge.log_input_required(job)
        if self.metrics is not None:
            self.metrics.tasks_created.labels(self.metrics.tool_label(job.tool)).inc()
        if job.finished.is_set():
            await self._settle(job)  # a window call that ended (or was stopped) while the record was committed
        return self.paced(record)

    def paced(self, record: TaskRecord) -> TaskRecord:
        """The record as the client sees it: a working task's `pollIntervalMs` follows its tool's usual
        duration (`pacing.py`); the stored value is the policy's."""
        if record.status is not TaskStatus.WORKING or record.poll_interval_ms is None:
            return record
        interval = pacing.poll_interval_ms(
            record.poll_interval_ms,
            created_at_ms=record.created_at_ms,
            now_ms=self.clock(),
            expected_ms=self.durations.expected_ms(record.tool),
        )
        return record if interval == record.poll_interval_ms else replace(record, poll_interval_ms=interval)

    def observe_create(self, path: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.create_seconds.labels(path).observe(time.perf_counter() - started)

    # --- the background coroutine ---------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        """The coroutine wrapper (one of the two `except Exception` edges): the call's outcome is data."""
        try:
            job.outcome = await self._drive(job)
        except asyncio.CancelledError:
            self._finish(job)
            await self.shielded(self._abandon(job), "call-abandon")
            if job.task_id is not None and not self._closing:
                # `cancelled`, unless tasks/cancel or the TTL settled it first (T-21).
                await self.shielded(self._settle(job), "task-settle")
            raise
        except ProxyError as exc:  # UpstreamError and friends: a lost upstream
            job.outcome = exc
        except Exception as exc:
            log.exception("task_call_crashed", task_id=job.task_id, tool=job.tool)
            job.outcome = ProxyError(f"Internal error: {exc!r}")
        finally:
            self._finish(job)
        if job.task_id is not None:
            await self._settle(job)

    def _finish(self, job: Job) -> None:
        job.finished.set()
        job.attention.set()
        self._running.discard(job)
        if job.publish_timer is not None:
            job.publish_timer.cancel()

    async def _drive(self, job: Job) -> UpstreamResult | UpstreamErrorResponse:
        session = self.upstream.session(job.principal)
        async with session.call(job.method, job.params, job.headers) as call:
            job.call = call

            async def ask(question: UpstreamServerRequest) -> None:  # a question on the GET stream (K-12)
                await self.bridge.on_question(job, call, question)

            session.askers[call.request_id] = ask
            try:
                async for event in call.events():
                    if isinstance(event, UpstreamNotification):
                        await self._on_notification(job, event.message)
                    elif isinstance(event, UpstreamServerRequest):
                        await self.bridge.on_question(job, call, event)
                    else:
                        return event
            finally:
                session.askers.pop(call.request_id, None)
        raise UpstreamError(f"Upstream closed the stream of {job.method} without answering")  # pragma: no cover

    async def _on_notification(self, job: Job, message: JSON) -> None:
        if job.channel is not None:
            relayed = translate.relay_notification(message, job.progress_token, job.log_level)
            if relayed is not None:
                try:
                    await job.channel.notify(relayed)
                except ConnectionResetError:
                    job.channel = None  # the client left; its handler's cancellation stops the call
            return
        if job.mode is not JobMode.TASK or message.get("method") != "notifications/progress":
            return
        assert job.task_id is not None
        status_message = wire_tasks.progress_status_message(message.get("params"))
        now = time.monotonic()
        if status_message is None or now - job.progress_written_at < PROGRESS_WRITE_INTERVAL_SECONDS:
            return  # a chatty upstream does not turn into a write per notification; the next one catches up
        job.progress_written_at = now
        try:
            await self.store.update(job.task_id, {"status_message": status_message}, now_ms=self.clock())
        except StoreError as exc:  # a lost progress line is not worth failing the task for
            log.warning("task_progress_not_stored", task_id=job.task_id, error=str(exc))

    # --- settling ------------------------------------------------------------------------------------------

    async def _abandon(self, job: Job) -> None:
        """L-5: the call is being abandoned; a legacy server needs an explicit notifications/cancelled."""
        if job.call is None:
            return
        try:
            await job.call.cancel(job.cancel_reason)
        except UpstreamError as exc:
            log.warning("upstream_cancel_failed", task_id=job.task_id, error=exc.message)

    async def _settle(self, job: Job) -> None:
        """The call's outcome settles the record (T-18, T-19); a record settled first (cancel) stays (T-21)."""
        assert job.task_id is not None
        outcome = job.outcome
        now = self.clock()
        if outcome is None:  # the call was stopped before it ended
            settled = await self.store.settle(
                job.task_id, TaskStatus.CANCELLED, now_ms=now, status_message=job.cancel_reason
            )
        elif isinstance(outcome, UpstreamResult):
            result = translate.complete_result("tools/call", outcome.result, None, None)
            settled = await self.store.settle(job.task_id, TaskStatus.COMPLETED, now_ms=now, result=result)
        else:
            if isinstance(outcome, UpstreamErrorResponse):
                error = translate.error_object(outcome.error)
            else:
                error = wire_tasks.internal_error(outcome.message)
            settled = await self.store.settle(
                job.task_id,
                TaskStatus.FAILED,
                now_ms=now,
                error=error,
                status_message=wire_tasks.failure_status_message(error),
            )
        self._jobs.pop(job.task_id, None)
        self._settled(settled)

    def _settled(self, record: TaskRecord | None, **context: Any) -> None:
        """Every settlement that won (T-21) is logged and counted here, whoever settled it."""
        if record is None:
            return
        log.info("task_settled", task_id=record.task_id, tool=record.tool, status=record.status.value, **context)
        if record.status is TaskStatus.COMPLETED:
            self.durations.observe(record.tool, record.updated_at_ms - record.created_at_ms)
        if self.metrics is not None:
            tool = self.metrics.tool_label(record.tool)
            self.metrics.tasks_settled.labels(tool, record.status.value).inc()
            lifetime_seconds = max(0, record.updated_at_ms - record.created_at_ms) / 1000
            self.metrics.task_seconds.labels(tool, record.status.value).observe(lifetime_seconds)

    # --- cancel, expiry ----------------------------------------------------------------------------------

    async def stop_call(self, job: Job, reason: str) -> None:
        """Cancel the call and wait until the upstream was told (run shielded by a handler that is itself being
        cancelled, so shutdown does not cut the notifications/cancelled short)."""
        self.cancel_job(job, reason)
        if job.coroutine is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await job.coroutine

    def cancel_job(self, job: Job, reason: str) -> None:
        job.cancel_reason = reason
        self._running.discard(job)  # the slot is free at once; telling the upstream may take a moment
        if job.coroutine is not None and not job.coroutine.done():
            job.coroutine.cancel()

    def _stop(self, task_id: str, reason: str) -> None:
        """The task's record was settled from outside its call (cancel, expiry): stop the call if it runs here."""
        job = self._jobs.pop(task_id, None)
        if job is not None:
            self.bridge.unpark(job)
            self.cancel_job(job, reason)

    async def cancel_task(self, task_id: str, reason: str) -> None:
        settled = await self.store.settle(task_id, TaskStatus.CANCELLED, now_ms=self.clock(), status_message=reason)
        self._stop(task_id, reason)
        self._settled(settled, reason=reason)

    async def _fail(self, task_id: str, message: str) -> TaskRecord | None:
        settled = await self.store.settle(
            task_id,
            TaskStatus.FAILED,
            now_ms=self.clock(),
            error=wire_tasks.internal_error(message),
            status_message=message,
        )
        self._settled(settled, reason=message)
        return settled

    async def _expire(self, record: TaskRecord) -> TaskRecord | None:
        settled = await self._fail(record.task_id, wire_tasks.EXPIRED_MESSAGE)
        self._stop(record.task_id, wire_tasks.EXPIRED_MESSAGE)
        if settled is not None:
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
        return settled

    # --- tasks/get, tasks/update, tasks/cancel ---------------------------------------------------------

    async def observe(self, task_id: str, caller: Caller) -> TaskRecord:
        """T-25 / T-47 / K-18: the caller's own, unexpired task, or -32602 (the same for all three misses).
        A live task seen past its TTL is failed now (and its call stopped)."""
        record = await self.store.get(task_id)
        if record is None or record.principal != principal_key(caller.principal):
            raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
        if record.expired(self.clock()):
            if record.status.terminal:
                await self.store.delete(task_id)  # past its TTL a settled record goes (the sweep would drop it too)
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            expired = await self._expire(record)
            if expired is None:
                expired = await self.store.get(task_id)
            if expired is None:
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            return expired
        return self.paced(record)

    async def update(self, task_id: str, caller: Caller, responses: Mapping[str, Any]) -> None:
        """T-26…T-31: answers for the task's outstanding questions go upstream; the ack does not wait for the
        state change (eventually consistent). A task whose call does not run here has nothing to deliver."""
        record = await self.observe(task_id, caller)
        job = self._jobs.get(task_id)
        if job is None or record.status.terminal or job.mode is not JobMode.TASK:
            return
        answers = self.bridge.answers(job, responses)
        if answers:
            await self.bridge.deliver(job, answers)

    async def cancel(self, task_id: str, caller: Caller) -> None:
        """T-33 / T-34: ack even on terminal tasks; settle `cancelled` unless already settled, stop the call
        (notifications/cancelled upstream)."""
        record = await self.observe(task_id, caller)
        if not record.status.terminal:
            await self.cancel_task(task_id, CANCELLED_BY_CLIENT)

    @property
    def running(self) -> int:
        return len(self._running)
