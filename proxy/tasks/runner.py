"""The task runner: every background coroutine of a `tools/call` that may outlive its HTTP request.

Owns the sync window, task creation (commit before the handle is returned, T-14), the upstream call's events
(progress → statusMessage, final → settled record), cancel, limits, TTL/retention sweeps and restart
recovery. The only creator of background tasks outside `upstream/`. Imports the store, the upstream client,
policy and wire; never aiohttp's web side or the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import structlog

from proxy.config import TasksConfig
from proxy.errors import InvalidParamsError, MissingCapabilityError, ProxyError, TaskLimitError, UpstreamError
from proxy.observability import Metrics
from proxy.policy import Decision, Outcome, Policy
from proxy.tasks.store import StoreError, StoreFullError, TaskStore
from proxy.upstream.call import (
    UpstreamCall,
    UpstreamErrorResponse,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
)
from proxy.upstream.session import UpstreamClient, principal_key
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.envelope import TASKS_EXTENSION, Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON, error_message, result_message
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_SECONDS: Final = 1.0  # how often expired tasks are failed and settled ones past their TTL purged
WAIT_KEEPALIVE_SECONDS: Final = 15.0  # SSE comment while a poll-to-sync client waits for its internal task
SHUTDOWN_GRACE_SECONDS: Final = 5.0  # how long close() waits for cancelled calls to tell the upstream
PROGRESS_WRITE_INTERVAL_SECONDS: Final = 0.2  # at most this often is a task's statusMessage rewritten
CANCELLED_BY_CLIENT: Final = "cancelled by the client"

_T = TypeVar("_T")

CallOutcome = UpstreamResult | UpstreamErrorResponse | ProxyError


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(eq=False)
class Job:
    """One upstream `tools/call` run by the runner: first (maybe) inside a sync window, then as a task."""

    tool: str
    policy: Policy
    principal: str | None
    params: JSON
    headers: dict[str, str]
    progress_token: str | int | None = None
    log_level: str | None = None
    channel: Channel | None = None  # the waiting client's stream while the call is still synchronous
    task_id: str | None = None
    call: UpstreamCall | None = None
    outcome: CallOutcome | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    coroutine: asyncio.Task[None] | None = None
    cancel_reason: str = "cancelled"
    progress_written_at: float = float("-inf")  # monotonic time of the last statusMessage write


class TaskRunner:
    def __init__(
        self,
        config: TasksConfig,
        store: TaskStore,
        upstream: UpstreamClient,
        clock: Callable[[], int] = wall_clock_ms,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.store = store
        self.upstream = upstream
        self.clock = clock
        self.process_id = uuid.uuid4().hex  # the `owner` of every task this process runs
        self._jobs: dict[str, Job] = {}  # task id → its job, for tasks whose upstream call runs here
        self._running: set[Job] = set()  # jobs that hold a `max_running` slot
        self._background: set[asyncio.Task[Any]] = set()
        self._progress_tokens = 0
        self._closing = False  # set by close(): cancelled calls then leave their records live

    # --- lifecycle -----------------------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        """The one place tasks/ starts background work: named, referenced until done."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._background.add(task)
        task.add_done_callback(self._reap)
        return task

    async def _shielded(self, coroutine: Coroutine[Any, Any, _T], name: str) -> _T:
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
        job = Job(record.tool, policy, record.rerun_principal, dict(record.request), {})
        job.task_id = record.task_id
        self._jobs[record.task_id] = job
        self._running.add(job)
        job.coroutine = self._spawn(self._run(job), f"task-{record.task_id}")
        log.info("task_rerun", task_id=record.task_id, tool=record.tool)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_SECONDS)
            try:
                await self.sweep()
            except StoreError as exc:
                log.error("task_sweep_failed", error=str(exc))

    async def sweep(self) -> None:
        """T-38: fail live tasks past their TTL (and stop their calls); drop settled records past their TTL."""
        now = self.clock()
        for record in await self.store.expired_live(now):
            await self._expire(record)
        purged = await self.store.purge_expired(now)
        if purged:
            log.info("tasks_purged", count=purged)

    # --- tools/call -------------------------------------------------------------------------------------

    async def call_tool(
        self, request: ModernRequest, caller: Caller, channel: Channel, decision: Decision, server_info: JSON | None
    ) -> JSON:
        """Serve a `tools/call` the policy did not leave plain synchronous; returns the response message."""
        if decision.outcome is Outcome.REJECT:
            raise MissingCapabilityError(
                wire_tasks.REQUIRED_CAPABILITY,
                f"Missing required client capability: tool {request.params.get('name')!r} runs only as a task; "
                f"declare the {TASKS_EXTENSION} extension",
                request_id=request.id,
            )
        job = self._job(request, caller, decision.policy)
        if decision.outcome is Outcome.TASK:
            started = time.perf_counter()
            record = await self._shielded(self._open(job, caller, request), "task-create")
            self._observe_create("task", started)
            return result_message(request.id, wire_tasks.create_task_result(record, server_info))
        job.channel = channel
        if decision.outcome is Outcome.WAIT:
            return await self._wait(job, caller, request, channel, server_info)
        return await self._window(job, caller, request, server_info)

    def _job(self, request: ModernRequest, caller: Caller, policy: Policy) -> Job:
        params = translate.upstream_params(request.params)
        meta = dict(params.get("_meta") or {})
        if "progressToken" not in meta:
            # Ask the upstream for progress even when the client did not: it becomes the task's statusMessage.
            self._progress_tokens += 1
            meta["progressToken"] = f"mcp-tasks-proxy-{self._progress_tokens}"
        params["_meta"] = meta
        return Job(
            tool=str(request.params.get("name")),
            policy=policy,
            principal=caller.principal,
            params=params,
            headers=translate.trace_headers(request.meta, caller.headers),
            progress_token=request.progress_token,
            log_level=request.log_level,
        )

    def _start(self, job: Job) -> None:
        job.coroutine = self._spawn(self._run(job), f"task-{job.task_id or 'window'}")

    async def _open(self, job: Job, caller: Caller, request: ModernRequest) -> TaskRecord:
        """Commit the record, then start its call: run shielded, so a client that leaves meanwhile cannot
        leave a committed record without a call behind (the task runs; its id was just not delivered)."""
        record = await self._create(job, caller, request)
        self._start(job)
        return record

    async def _create(self, job: Job, caller: Caller, request: ModernRequest) -> TaskRecord:
        """Limits first (nothing is written when refused), then the committed record (T-14)."""
        if len(self._running) >= self.config.max_running:
            raise TaskLimitError("max_running", self.config.max_running, request_id=request.id)
        now = self.clock()
        policy = job.policy
        record = TaskRecord(
            task_id=wire_tasks.new_task_id(),
            principal=principal_key(caller.principal),
            tool=job.tool,
            status=TaskStatus.WORKING,
            created_at_ms=now,
            updated_at_ms=now,
            ttl_ms=policy.ttl_ms,
            poll_interval_ms=policy.poll_interval_ms,
            owner=self.process_id,
            on_restart=policy.on_restart,
            request=job.params,
            rerun_principal=caller.principal if policy.on_restart == "rerun" else None,
        )
        try:
            await self.store.create(record)
        except StoreFullError:
            raise TaskLimitError("max_records", self.config.max_records, request_id=request.id) from None
        except StoreError as exc:
            raise ProxyError(f"Internal error: the task could not be stored: {exc}", request_id=request.id) from None
        job.task_id = record.task_id
        self._jobs[record.task_id] = job
        if not job.finished.is_set():
            self._running.add(job)
        log.info("task_created", task_id=record.task_id, tool=job.tool, ttl_ms=record.ttl_ms)
        if self.metrics is not None:
            self.metrics.tasks_created.labels(self.metrics.tool_label(job.tool)).inc()
        if job.finished.is_set():
            await self._settle(job)  # a window call that ended (or was stopped) while the record was committed
        return record

    def _observe_create(self, path: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.create_seconds.labels(path).observe(time.perf_counter() - started)

    async def _window(self, job: Job, caller: Caller, request: ModernRequest, server_info: JSON | None) -> JSON:
        """`optional` + declaring client: synchronous if the call settles within the window, else a task that
        continues the same upstream call (no second call)."""
        self._start(job)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.finished.wait(), job.policy.sync_window_ms / 1000)
            if job.finished.is_set():
                return self._sync_reply(request, job, server_info)
            job.channel = None  # T-43 / K-31: no request-scoped notifications once the call is a task
            started = time.perf_counter()
            record = await self._shielded(self._create(job, caller, request), "task-create")
            self._observe_create("window", started)
        except BaseException:
            # The client left during the window (C-19), or the task could not be created: stop the call. A
            # record committed meanwhile is settled `cancelled` by the stopped call (or by _create).
            if job.task_id is None:
                self._cancel_job(job, "client disconnected")
            raise
        return result_message(request.id, wire_tasks.create_task_result(record, server_info))

    async def _wait(
        self, job: Job, caller: Caller, request: ModernRequest, channel: Channel, server_info: JSON | None
    ) -> JSON:
        """Poll-to-sync (§4 option A): a `required` tool for a non-declaring client with
        `undeclared_required: wait` runs as an internal task; the client's response waits for it."""
        record = await self._shielded(self._open(job, caller, request), "task-create")
        try:
            while not job.finished.is_set():
                try:
                    await asyncio.wait_for(job.finished.wait(), WAIT_KEEPALIVE_SECONDS)
                except TimeoutError:
                    await channel.keepalive(open_stream=True)
        except BaseException:
            await self._shielded(self._cancel_task(record.task_id, "client disconnected"), "task-cancel")
            raise
        settled = await self.store.get(record.task_id)
        if settled is None or settled.status is TaskStatus.CANCELLED:
            return error_message(request.id, wire_tasks.internal_error("The task was cancelled"))
        if settled.status is TaskStatus.FAILED:
            return error_message(request.id, settled.error or wire_tasks.internal_error("Task failed"))
        if settled.status is TaskStatus.COMPLETED and settled.result is not None:
            return result_message(
                request.id, translate.complete_result(request.method, settled.result, server_info, None)
            )
        return self._sync_reply(request, job, server_info)

    def _sync_reply(self, request: ModernRequest, job: Job, server_info: JSON | None) -> JSON:
        outcome = job.outcome
        if isinstance(outcome, UpstreamResult):
            return result_message(
                request.id, translate.complete_result(request.method, outcome.result, server_info, None)
            )
        if isinstance(outcome, UpstreamErrorResponse):
            return error_message(request.id, translate.error_object(outcome.error))
        if isinstance(outcome, ProxyError):
            outcome.request_id = request.id
            raise outcome
        raise ProxyError("Internal error: the call ended without an outcome", request_id=request.id)

    # --- the background coroutine ---------------------------------------------------------------------

    async def _run(self, job: Job) -> None:
        """The coroutine wrapper (one of the two `except Exception` edges): the call's outcome is data."""
        try:
            job.outcome = await self._drive(job)
        except asyncio.CancelledError:
            job.finished.set()
            self._running.discard(job)
            await self._shielded(self._abandon(job), "task-abandon")
            if job.task_id is not None and not self._closing:
                # `cancelled`, unless tasks/cancel or the TTL settled it first (T-21).
                await self._shielded(self._settle(job), "task-settle")
            raise
        except ProxyError as exc:  # UpstreamError and friends: a lost upstream
            job.outcome = exc
        except Exception as exc:
            log.exception("task_call_crashed", task_id=job.task_id, tool=job.tool)
            job.outcome = ProxyError(f"Internal error: {exc!r}")
        finally:
            job.finished.set()
            self._running.discard(job)
        if job.task_id is not None:
            await self._settle(job)

    async def _drive(self, job: Job) -> UpstreamResult | UpstreamErrorResponse:
        session = self.upstream.session(job.principal)
        async with session.call("tools/call", job.params, job.headers) as call:
            job.call = call
            async for event in call.events():
                if isinstance(event, UpstreamNotification):
                    await self._on_notification(job, event.message)
                elif isinstance(event, UpstreamServerRequest):
                    await self._refuse(job, call, event)
                else:
                    return event
        raise UpstreamError("Upstream closed the stream of tools/call without answering")  # pragma: no cover

    async def _on_notification(self, job: Job, message: JSON) -> None:
        if job.channel is not None:
            relayed = translate.relay_notification(message, job.progress_token, job.log_level)
            if relayed is not None:
                try:
                    await job.channel.notify(relayed)
                except ConnectionResetError:
                    job.channel = None  # the client left; its handler's cancellation stops the call
            return
        if job.task_id is None or message.get("method") != "notifications/progress":
            return
        status_message = wire_tasks.progress_status_message(message.get("params"))
        now = time.monotonic()
        if status_message is None or now - job.progress_written_at < PROGRESS_WRITE_INTERVAL_SECONDS:
            return  # a chatty upstream does not turn into a write per notification; the next one catches up
        job.progress_written_at = now
        try:
            await self.store.update(job.task_id, {"status_message": status_message}, now_ms=self.clock())
        except StoreError as exc:  # a lost progress line is not worth failing the task for
            log.warning("task_progress_not_stored", task_id=job.task_id, error=str(exc))

    async def _refuse(self, job: Job, call: UpstreamCall, server_request: UpstreamServerRequest) -> None:
        """Input bridging is not built yet: an upstream question is answered at once (an elicitation is
        declined), so the upstream never hangs and ends the call by itself."""
        await call.refuse(server_request)
        log.info("task_input_request_refused", task_id=job.task_id, tool=job.tool, input_method=server_request.method)

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
        if self.metrics is not None:
            tool = self.metrics.tool_label(record.tool)
            self.metrics.tasks_settled.labels(tool, record.status.value).inc()
            lifetime_seconds = max(0, record.updated_at_ms - record.created_at_ms) / 1000
            self.metrics.task_seconds.labels(tool, record.status.value).observe(lifetime_seconds)

    # --- cancel, expiry ----------------------------------------------------------------------------------

    def _cancel_job(self, job: Job, reason: str) -> None:
        job.cancel_reason = reason
        self._running.discard(job)  # the slot is free at once; telling the upstream may take a moment
        if job.coroutine is not None and not job.coroutine.done():
            job.coroutine.cancel()

    def _stop(self, task_id: str, reason: str) -> None:
        """The task's record was settled from outside its call (cancel, expiry): stop the call if it runs here."""
        job = self._jobs.pop(task_id, None)
        if job is not None:
            self._cancel_job(job, reason)

    async def _cancel_task(self, task_id: str, reason: str) -> None:
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
        return record

    async def cancel(self, task_id: str, caller: Caller) -> None:
        """T-33 / T-34: ack even on terminal tasks; settle `cancelled` unless already settled, stop the call
        (notifications/cancelled upstream)."""
        record = await self.observe(task_id, caller)
        if not record.status.terminal:
            await self._cancel_task(task_id, CANCELLED_BY_CLIENT)

    @property
    def running(self) -> int:
        return len(self._running)
