"""The task runner's record keeping (a mixin of `TaskRunner`): creating, rewriting and settling task records
for the calls it carries out, the task-level requests that need no call (`tasks/get`, `tasks/update`,
`tasks/cancel`), TTL expiry and retention sweeps, and restart recovery (a task failed, re-run, or followed
again on the upstream). Limits are checked before anything is written; every owner write carries the lease's
fence. Imports the store, the machine's vocabulary and the wire; the runner only for type checking (it mixes
this class in).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final, TypeVar

import structlog

from proxy import tracing
from proxy.config import InputsConfig, LimitsConfig, RestartAction, TasksConfig
from proxy.errors import CallerLimitError, InvalidParamsError, ProxyError, TaskLimitError
from proxy.observability import Metrics
from proxy.policy import Decision, Outcome, Policy
from proxy.principals import Principals, SealError
from proxy.tasks import machine, pacing, remote
from proxy.tasks.calls import Call, RunnerParts
from proxy.tasks.commands import (
    Answered,
    CommitRefused,
    Committed,
    CreateRecord,
    Event,
    LeaseLost,
    Settle,
    Start,
    Stop,
    WriteInputs,
    WriteProgress,
)
from proxy.tasks.followed import FollowedTask
from proxy.tasks.inputs import PendingInput
from proxy.tasks.replica_calls import CANCELLED_BY_CLIENT
from proxy.tasks.state import CallState
from proxy.tasks.store import Fence, FencedError, StoreError, StoreFullError
from proxy.wire import legacy_tasks
from proxy.wire import tasks as wire_tasks
from proxy.wire.envelope import Caller
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_SECONDS: Final = 1.0  # how often expired tasks are ended and old records purged
DURATIONS_RELOAD_SECONDS: Final = 5.0  # how often the tools' duration estimates are read again (other replicas')

_T = TypeVar("_T")


class TaskRecords(RunnerParts):
    """Mixed into `TaskRunner`, which provides the state and the methods declared here."""

    config: TasksConfig
    inputs: InputsConfig
    limits: LimitsConfig
    principals: Principals
    metrics: Metrics | None
    _running: set[Call]
    _running_by: Counter[str]

    if TYPE_CHECKING:  # provided by TaskRunner and the other mixins; declared here for the type checker

        def _state(
            self, decision: Decision, capabilities: JSON, progress_token: str | int | None, log_level: str | None
        ) -> CallState:
            raise NotImplementedError

        async def _adopt(
            self, records: list[TaskRecord], interrupted: str, rerun: str, fence: Fence | None, *, follow: bool
        ) -> None:
            raise NotImplementedError

        async def _load_durations(self) -> None:
            raise NotImplementedError

        async def _share_duration(self, tool: str, duration_ms: float) -> None:
            raise NotImplementedError

    async def _recover(self) -> None:
        """Tasks no running process owns any more. On a shared store (PostgreSQL), those of replicas whose lease
        ran out, an earlier run of this one included once its lease lapsed or was released: taken over, so the
        tasks of live replicas are never touched. On SQLite, every live task: the process that ran it is gone
        (the file lock says so); a task the upstream runs itself is followed again."""
        if self.store.shared:
            await self.replicas.sweep()
            return
        async with self._adopting:
            live = await self.store.live()
            await self._adopt(live, wire_tasks.RESTART_MESSAGE, wire_tasks.RERUN_MESSAGE, None, follow=True)

    async def _rerun(self, record: TaskRecord, fence: Fence) -> None:
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, "rerun")
        state = self._state(Decision(Outcome.TASK, policy), record.client_capabilities, None, None)
        state.task_id = record.task_id
        state.issued = record.inputs_issued  # keys stay unique across the re-run too
        if await self._restart(record, state, fence, "not re-run"):
            log.info("task_rerun", task_id=record.task_id, tool=record.tool)

    async def _follow_again(self, record: TaskRecord, before: TaskRecord, fence: Fence) -> None:
        """A task the upstream runs itself, left live by a previous process: followed again on its upstream
        session, with the questions it had asked (`before`, as the record was) still answerable."""
        assert record.upstream_task_id is not None
        on_restart: RestartAction = "rerun" if record.on_restart == "rerun" else "fail"
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, on_restart)
        decision = Decision(Outcome.TASK, policy, upstream_task=True)
        state = self._state(decision, record.client_capabilities, None, None)
        state.task_id = record.task_id
        state.issued = record.inputs_issued
        state.upstream_task = FollowedTask(
            record.upstream_task_id, status_message=record.status_message, expires_at_ms=record.expires_at_ms
        )
        for key, request in before.input_requests.items():
            upstream_id = before.upstream_input_ids.get(key)
            if isinstance(request, dict) and isinstance(upstream_id, int | str):
                state.inputs[key] = PendingInput(upstream_id, str(request.get("method")), request)
        state.inputs_written = not state.inputs
        if await self._restart(record, state, fence, "not followed again"):
            log.info("task_resumed", task_id=record.task_id, tool=record.tool)

    async def _restart(self, record: TaskRecord, state: CallState, fence: Fence, refused: str) -> bool:
        """Start the call of a task a previous process left live, with the caller's credential kept sealed in
        the record; a credential that no longer opens (another deployment key) fails the task instead."""
        try:
            principal = None if record.rerun_principal is None else self.principals.unseal(record.rerun_principal)
        except SealError as exc:
            await self._fail(record.task_id, f"{wire_tasks.RESTART_MESSAGE}; {refused}: {exc}", fence)
            return False
        call = Call(state, "tools/call", record.tool, principal, record.principal, dict(record.request), {}, "")
        call.record = record
        call.fence = fence
        self._calls.add(call)
        self._tasks[record.task_id] = call
        await self.dispatch(call, Start())
        return True

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_SECONDS)
            try:
                await self.sweep()
            except StoreError as exc:
                log.error("task_sweep_failed", error=str(exc))

    async def sweep(self) -> None:
        """Live tasks past their TTL fail (their calls stop, here or, through the feed, on their owner); settled
        records past their TTL are dropped; dead replicas' tasks are taken over. On a shared store each of these
        is done once across replicas (the store hands each expired task, and the purge, to one of them)."""
        now = self.clock()
        error = wire_tasks.internal_error(wire_tasks.EXPIRED_MESSAGE)
        for record in await self.store.settle_expired(now, error=error, status_message=wire_tasks.EXPIRED_MESSAGE):
            self._settled(record, reason=wire_tasks.EXPIRED_MESSAGE)
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
            call = self._tasks.get(record.task_id)
            if call is not None:
                await self.submit(call, Stop(wire_tasks.EXPIRED_MESSAGE, error))
        purged = await self.store.purge_expired(now)
        if purged:
            log.info("tasks_purged", count=purged)
        await self.replicas.sweep()
        if time.monotonic() - self._durations_loaded_at > DURATIONS_RELOAD_SECONDS:
            await self._load_durations()

    async def _create_record(self, call: Call, command: CreateRecord) -> Event:
        """Limits first (nothing is written when refused), then the committed record."""
        decision = call.state.decision
        if command.status is TaskStatus.WORKING:
            if len(self._running) >= self.config.max_running:
                return CommitRefused(TaskLimitError("max_running", self.config.max_running))
            share = self.limits.max_running_per_principal
            if self._running_by[call.caller] >= share:
                return CommitRefused(CallerLimitError("max_running_per_principal", share))
        policy = decision.policy
        assert policy is not None
        now = self.clock()
        call.fence = self.replicas.fence  # taken before the commit: a lease lost meanwhile stops the call
        record = TaskRecord(
            task_id=wire_tasks.new_task_id(),
            principal=call.caller,
            tool=call.name,
            status=command.status,
            created_at_ms=now,
            updated_at_ms=now,
            ttl_ms=legacy_tasks.bounded_ttl_ms(policy.ttl_ms, command.upstream_expires_at_ms, now),
            poll_interval_ms=policy.poll_interval_ms,
            owner=self.process_id,
            on_restart=policy.on_restart,
            request=call.params,
            status_message=command.status_message,
            input_requests=command.input_requests,
            inputs_issued=command.issued,
            # A re-run, and following an upstream's own task after a restart, present the principal again: it is
            # kept sealed with the deployment key until the task settles.
            rerun_principal=self.principals.seal(call.principal)
            if call.principal and (policy.on_restart == "rerun" or command.upstream_task_id)
            else None,
            client_capabilities=call.state.capabilities,
            upstream_task_id=command.upstream_task_id,
            upstream_session_id=call.session.session_id if command.upstream_task_id and call.session else None,
            upstream_input_ids=command.upstream_input_ids or {},
        )
        started = time.perf_counter()
        self._tasks[record.task_id] = call  # before the commit: a committed task is never taken for an orphan
        try:
            await self.store.create(record)
        except StoreError as exc:
            del self._tasks[record.task_id]
            if isinstance(exc, StoreFullError):
                return CommitRefused(TaskLimitError("max_records", self.config.max_records))
            return CommitRefused(ProxyError("Internal error: the task could not be stored", detail=str(exc)))
        call.record = record
        log.info("task_created", task_id=record.task_id, tool=call.name, ttl_ms=record.ttl_ms)
        tracing.task_created(record.task_id)
        if command.input_requests:
            self._log_input_required(record.task_id, call.name, command.input_requests)
        if self.metrics is not None:
            self.metrics.tasks_created.labels(self.metrics.tool_label(call.name)).inc()
            path = "task" if decision.task_first else "window"
            self.metrics.create_seconds.labels(path).observe(time.perf_counter() - started)
        return Committed(record.task_id)

    async def _write_inputs(self, call: Call, command: WriteInputs) -> Event | None:
        task_id = call.state.task_id
        assert task_id is not None
        try:
            updated = await self.store.set_inputs(
                task_id,
                command.input_requests,
                command.issued,
                now_ms=self.clock(),
                fence=call.fence,
                upstream_input_ids=command.upstream_input_ids,
            )
        except FencedError:
            return LeaseLost()
        except StoreError as exc:
            log.error("task_inputs_not_stored", task_id=task_id, error=str(exc))
            return None
        if updated is not None and command.input_requests:
            self._log_input_required(task_id, call.name, command.input_requests)
        return None

    async def _write_progress(self, call: Call, command: WriteProgress) -> Event | None:
        assert call.state.task_id is not None
        try:
            await self.store.set_status_message(
                call.state.task_id, command.status_message, now_ms=self.clock(), fence=call.fence
            )
        except FencedError:
            return LeaseLost()
        except StoreError as exc:  # a lost progress line is not worth failing the task for
            log.warning("task_progress_not_stored", task_id=call.state.task_id, error=str(exc))
        return None

    def _log_input_required(self, task_id: str, tool: str, input_requests: JSON) -> None:
        methods = sorted(
            {str(request.get("method")) for request in input_requests.values() if isinstance(request, dict)}
        )
        log.info("task_input_required", task_id=task_id, tool=tool, keys=sorted(input_requests), methods=methods)

    async def _settle(self, call: Call, command: Settle) -> Event | None:
        task_id = call.state.task_id
        assert task_id is not None
        try:
            settled = await self.store.settle(
                task_id,
                command.status,
                now_ms=self.clock(),
                result=command.result,
                error=command.error,
                status_message=command.status_message,
                fence=call.fence,
            )
        except FencedError:
            return LeaseLost()  # another replica owns the task now: its outcome is that replica's to write
        except StoreError as exc:  # the record stays live; its TTL (or a take-over) ends it
            log.error("task_not_settled", task_id=task_id, status=command.status.value, error=str(exc))
            return None
        self._settled(settled)
        return None

    def _settled(self, record: TaskRecord | None, **context: Any) -> None:
        """Every settlement that won (the first) is logged and counted here, whoever settled it."""
        if record is None:
            return
        log.info("task_settled", task_id=record.task_id, tool=record.tool, status=record.status.value, **context)
        if record.status is TaskStatus.COMPLETED:
            duration_ms = record.updated_at_ms - record.created_at_ms
            self.durations.observe(record.tool, duration_ms)  # at once here; for every replica through the store
            self.spawn(self._share_duration(record.tool, duration_ms), f"duration-{record.task_id}")
        if self.metrics is not None:
            tool = self.metrics.tool_label(record.tool)
            self.metrics.tasks_settled.labels(tool, record.status.value).inc()
            lifetime_seconds = max(0, record.updated_at_ms - record.created_at_ms) / 1000
            self.metrics.task_seconds.labels(tool, record.status.value).observe(lifetime_seconds)

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

    async def observe(self, task_id: str, caller: Caller) -> TaskRecord:
        """The caller's own, unexpired task, or -32602 (the same for an unknown, foreign or expired id, so
        ids cannot be probed). A live task seen past its TTL is failed now (and its call stopped)."""
        record = await self.store.get(task_id, principal=self.principals.key_of(caller.principal))
        if record is None:
            raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
        if record.expired(self.clock()):
            if record.status.terminal:
                await self.store.delete(task_id)  # past its TTL a settled record goes (the sweep would drop it too)
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            expired = await self._expire(record) or await self.store.get(task_id)
            if expired is None:
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            return expired
        return self.paced(record)

    async def update(self, task_id: str, caller: Caller, responses: Mapping[str, Any]) -> None:
        """Answers for the task's outstanding questions go upstream; the ack does not wait for the state change.
        For a task whose call runs on another replica they are checked against the questions its record shows
        (-32602 naming the key) and stored as a message to its owner, which the feed wakes."""
        record = await self.observe(task_id, caller)
        if record.status.terminal:
            return
        call = self._tasks.get(task_id)
        if call is None:
            answers = remote.check_answers(record.input_requests, responses)
            if answers:
                await self.replicas.post_answers(task_id, answers)
            return
        answers = machine.answers(call.state, responses)
        if answers:
            await self.submit(call, Answered(answers))

    async def cancel(self, task_id: str, caller: Caller) -> None:
        """Ack even on a settled task; a live one is settled `cancelled` (unless it settles first) and its
        call stopped (`notifications/cancelled` upstream): here, or by its owner when the feed tells it."""
        record = await self.observe(task_id, caller)
        if record.status.terminal:
            return
        settled = await self.store.settle(
            task_id, TaskStatus.CANCELLED, now_ms=self.clock(), status_message=CANCELLED_BY_CLIENT
        )
        self._settled(settled, reason=CANCELLED_BY_CLIENT)
        call = self._tasks.get(task_id)
        if call is not None:
            await self.submit(call, Stop(CANCELLED_BY_CLIENT))

    async def _fail(self, task_id: str, message: str, fence: Fence | None = None) -> TaskRecord | None:
        settled = await self.store.settle(
            task_id,
            TaskStatus.FAILED,
            now_ms=self.clock(),
            error=wire_tasks.internal_error(message),
            status_message=message,
            fence=fence,
        )
        self._settled(settled, reason=message)
        return settled

    async def _expire(self, record: TaskRecord) -> TaskRecord | None:
        settled = await self._fail(record.task_id, wire_tasks.EXPIRED_MESSAGE)
        call = self._tasks.get(record.task_id)
        if call is not None:
            error = wire_tasks.internal_error(wire_tasks.EXPIRED_MESSAGE)
            await self.submit(call, Stop(wire_tasks.EXPIRED_MESSAGE, error))
        if settled is not None:
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
        return settled
