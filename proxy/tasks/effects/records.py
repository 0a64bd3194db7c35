"""Task record writes for the calls run here (`CreateRecord`, `WriteInputs`, `WriteProgress`, `WriteQueue`,
`Settle`), each under the lease's fence through one helper, kept in the outbox while the store is away; a
settlement the store refuses is logged and counted; the bookkeeping of every settlement this replica won.
Imports the store, slots, outbox, table and wire."""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final

import structlog

from proxy.config.schema import Config, TasksConfig
from proxy.errors import ProxyError, TaskLimitError, TaskStoreUnavailableError
from proxy.observe import tracing
from proxy.tasks.context import TasksContext
from proxy.tasks.effects.outbox import Kind, Outbox, Refused, Written
from proxy.tasks.effects.slots import RunningSlots
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import (
    CommitRefused,
    Committed,
    CreateRecord,
    LeaseLost,
    Settle,
    WriteInputs,
    WriteProgress,
    WriteQueue,
)
from proxy.tasks.store import Fence, FencedError, StoreError, StoreFullError, StoreUnavailableError
from proxy.wire import legacy_tasks
from proxy.wire import tasks as wire_tasks
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

OwnerWrite = WriteInputs | WriteProgress | WriteQueue | Settle
_KINDS: Final[dict[type, Kind]] = {
    Settle: "settle",
    WriteInputs: "inputs",
    WriteProgress: "progress",
    WriteQueue: "queue",  # a queued mark or its end: never dropped (a started task must not look queued)
}
OWN_SETTLEMENTS_KEPT: Final = 4096  # settlements remembered until the feed brings them back (a bound, not a need)
FENCED: Final = "fenced"  # a settlement refused: another replica owns the task now (it was taken over)
SETTLED: Final = "settled"  # ... or the task had ended otherwise (a cancel, its TTL) before it was written


class Unwritten(enum.Enum):
    """What an owner write that the store did not take became (`RecordWrites._fenced`)."""

    KEPT = "kept"  # it waits in the outbox for the store
    FAILED = "failed"  # the store failed for good (logged)


class RecordWrites:
    def __init__(
        self,
        context: TasksContext,
        config: Callable[[], Config],
        slots: RunningSlots,
        outbox: Outbox,
        fence: Callable[[], Awaitable[Fence]],
        reclaim: Callable[[str], Awaitable[Fence | None]],
    ) -> None:
        self.context = context
        self._config = config  # the config in force, read at each write: a live reload swaps what it returns
        self.outbox = outbox
        self.slots = slots
        self.fence = fence  # the lease's fence for a new task, renewed first when it may have lapsed
        self.reclaim = reclaim  # a refused write: is the task still ours under a renewed lease? (`ReplicaLink`)
        self._own: OrderedDict[str, None] = OrderedDict()  # task ids whose settlement this replica is writing

    @property
    def tasks_config(self) -> TasksConfig:
        """The `tasks` section in force (the services' `config` getters give the whole config)."""
        return self._config().tasks

    # --- the commands ------------------------------------------------------------------------------------

    async def create(self, call: LiveCall, command: CreateRecord) -> Committed | CommitRefused:
        """Limits first (nothing is written when refused), then the committed record."""
        if command.status is TaskStatus.WORKING:
            refused = self.slots.refusal(call)
            if refused is not None:
                return CommitRefused(refused)
        if self.outbox.full:  # a new task would add its writes to the ones the store has not taken yet
            full = TaskLimitError("store.max_pending_settlements", self.outbox.limit, retry_after_seconds=2)
            return CommitRefused(full)
        decision = call.state.decision
        policy = decision.policy
        assert policy is not None
        now = self.context.clock()
        try:  # taken before the commit: a lease lost meanwhile stops the call
            call.stored.fence = await self.fence()
        except StoreUnavailableError as exc:
            return CommitRefused(TaskStoreUnavailableError(exc.kind, exc.reason, detail=str(exc)))
        record = TaskRecord(
            task_id=wire_tasks.new_task_id(),
            principal=call.caller,
            tool=call.name,
            status=command.status,
            created_at_ms=now,
            updated_at_ms=now,
            ttl_ms=legacy_tasks.bounded_ttl_ms(policy.ttl_ms, command.upstream_expires_at_ms, now),
            poll_interval_ms=policy.poll_interval_ms,
            owner=self.context.process_id,
            on_restart=policy.on_restart,
            request=call.params,
            status_message=command.status_message,
            input_requests=command.input_requests,
            inputs_issued=command.issued,
            # A re-run, and following an upstream task after a restart, present the principal again: it is kept
            # sealed with the deployment key until the task settles.
            rerun_principal=self.context.principals.keep(call.principal)
            if call.principal and (policy.on_restart == "rerun" or command.upstream_task_id or command.job_id)
            else None,
            client_capabilities=call.state.capabilities,
            upstream_task_id=command.upstream_task_id,
            upstream_session_id=call.upstream.session.session_id
            if command.upstream_task_id and call.upstream.session
            else None,
            upstream_input_ids=command.upstream_input_ids or {},
            traceparent=tracing.creating_context(),  # later spans about the task link to it, on any replica
            job_id=command.job_id,
        )
        started = time.perf_counter()
        self.context.table.add_task(record.task_id, call)  # before the commit: a committed task is never an orphan
        try:
            await self.context.store.records.create(record)
        except StoreError as exc:
            self.context.table.drop_task(record.task_id)
            if isinstance(exc, StoreUnavailableError):
                return CommitRefused(TaskStoreUnavailableError(exc.kind, exc.reason, detail=str(exc)))
            if isinstance(exc, StoreFullError):
                return CommitRefused(TaskLimitError("max_records", self.tasks_config.max_records))
            return CommitRefused(ProxyError("Internal error: the task could not be stored", detail=str(exc)))
        call.stored.record = record
        self.context.credentials.bind(call.principal, record.task_id)
        log.info("task_created", task_id=record.task_id, tool=call.name, ttl_ms=record.ttl_ms)
        tracing.task_created(record.task_id)
        if command.input_requests:
            _log_input_required(record.task_id, call.name, command.input_requests)
        if self.context.metrics is not None:
            path = "task" if decision.task_first else "window"
            self.context.metrics.task_created(call.name, path, time.perf_counter() - started)
        return Committed(record.task_id)

    async def write_inputs(self, call: LiveCall, command: WriteInputs) -> LeaseLost | None:
        task_id = self._task_id(call)
        updated = await self._fenced(
            call,
            "task_inputs_not_stored",
            lambda fence: self.context.store.records.set_inputs(
                task_id,
                command.input_requests,
                command.issued,
                now_ms=self.context.clock(),
                fence=fence,
                upstream_input_ids=command.upstream_input_ids,
            ),
            command,
        )
        if isinstance(updated, TaskRecord) and command.input_requests:
            _log_input_required(task_id, call.name, command.input_requests)
        return updated if isinstance(updated, LeaseLost) else None

    async def write_progress(self, call: LiveCall, command: WriteProgress) -> LeaseLost | None:
        task_id = self._task_id(call)
        written = await self._fenced(  # a lost progress line is not worth failing the task for: a warning
            call,
            "task_progress_not_stored",
            lambda fence: self.context.store.records.set_status_message(
                task_id, command.status_message, now_ms=self.context.clock(), fence=fence
            ),
            command,
            warn=True,
        )
        return written if isinstance(written, LeaseLost) else None

    async def write_queue(self, call: LiveCall, command: WriteQueue) -> LeaseLost | None:
        """Queued since now, or no longer; a store failure leaves it as it was (a warning): at worst a task that
        started is re-run after a restart although its `on_restart` says fail, or one queued is failed."""
        task_id = self._task_id(call)
        now_ms = self.context.clock()
        queued_at_ms = now_ms if command.queued else None
        policy = call.state.decision.policy
        keep = command.queued or (policy is not None and policy.on_restart == "rerun")
        sealed = self.context.principals.keep(call.principal) if keep and call.principal else None
        written = await self._fenced(
            call,
            "task_queue_not_stored",
            lambda fence: self.context.store.records.set_queued(
                task_id, queued_at_ms, command.status_message, rerun_principal=sealed, now_ms=now_ms, fence=fence
            ),
            command,
            warn=True,
        )
        return written if isinstance(written, LeaseLost) else None

    async def settle(self, call: LiveCall, command: Settle) -> LeaseLost | None:
        """The first settlement wins. A lost lease: another replica owns the task now, its outcome is that
        replica's to write; a store that is unavailable: the outbox writes it once the store is back; any other
        store failure leaves the record live (its TTL, or a take-over, ends it)."""
        task_id = self._task_id(call)
        self._expect_own(task_id)
        settled = await self._fenced(
            call,
            "task_not_settled",
            lambda fence: self.context.store.records.settle(
                task_id,
                command.status,
                now_ms=self.context.clock(),
                result=command.result,
                error=command.error,
                status_message=command.status_message,
                fence=fence,
            ),
            command,
            status=command.status.value,
        )
        if isinstance(settled, TaskRecord):
            self.settled(settled)
            return None
        if not self.outbox.holds(task_id):
            self._own.pop(task_id, None)
        if settled is None or isinstance(settled, LeaseLost):  # the store refused it: told, never silent
            await self.refused(task_id, command.status, fenced=isinstance(settled, LeaseLost), waited=0.0)
        return settled if isinstance(settled, LeaseLost) else None

    async def _fenced(
        self,
        call: LiveCall,
        failure: str,
        write: Callable[[Fence | None], Awaitable[TaskRecord | None]],
        command: OwnerWrite,
        *,
        warn: bool = False,
        **context: Any,
    ) -> TaskRecord | LeaseLost | Unwritten | None:
        """The one way an owner writes a task record: under the call's fence, after the writes of the task the
        outbox still holds. A write the fence refuses is tried once more when the task is still this replica's
        under its renewed lease (the lease lapsed, nobody took the task over: `ReplicaLink.reclaim`); `LeaseLost`
        when another replica owns it; None when the task is no longer live (it ended otherwise); `Unwritten`
        when the write waits in the outbox (the store is unavailable) or (logged as `failure`) when the store
        failed for good."""
        task_id = self._task_id(call)
        if self.outbox.holds(task_id):  # earlier writes of this task wait: this one goes after them
            self._keep(call, write, command, "earlier writes wait")
            return Unwritten.KEPT
        refused = call.stored.fence
        try:
            try:
                return await write(refused)
            except FencedError:
                fence = await self.reclaim(self._task_id(call))
                if fence is None or fence == refused:
                    return LeaseLost()
                log.info("task_lease_resumed", task_id=call.state.task_id, epoch=fence.epoch)
                call.stored.fence = fence
                return await write(fence)
        except FencedError:
            return LeaseLost()
        except StoreUnavailableError as exc:
            self._keep(call, write, command, exc.reason)
            return Unwritten.KEPT
        except StoreError as exc:
            (log.warning if warn else log.error)(failure, task_id=call.state.task_id, error=str(exc), **context)
            return Unwritten.FAILED

    def _keep(
        self,
        call: LiveCall,
        write: Callable[[Fence | None], Awaitable[TaskRecord | None]],
        command: OwnerWrite,
        reason: str,
    ) -> None:
        """Into the outbox, with the bookkeeping its late write needs (built only here: the normal path
        allocates nothing for it). Retried under the call's fence as it is then."""
        task_id = self._task_id(call)
        written: Written = _nothing
        refused: Refused | None = None
        if isinstance(command, Settle):
            status = command.status

            def written(record: TaskRecord | None) -> None:
                if record is None:
                    self._own.pop(task_id, None)  # settled meanwhile (a cancel, its TTL): that settlement won
                self.settled(record)

            async def refused(fenced: bool, waited: float) -> None:
                await self.refused(task_id, status, fenced=fenced, waited=waited)

        elif isinstance(command, WriteInputs) and command.input_requests:
            requests = command.input_requests

            def written(record: TaskRecord | None) -> None:
                if record is not None:
                    _log_input_required(task_id, call.name, requests)

        self.outbox.keep(task_id, _KINDS[type(command)], lambda: call.stored.fence, write, written, reason, refused)

    def refence(self, call: LiveCall, fence: Fence) -> None:
        """The call's task is still this replica's under its renewed lease: its writes carry that fence now."""
        call.stored.fence = fence

    def _task_id(self, call: LiveCall) -> str:
        task_id = call.state.task_id
        assert task_id is not None
        return task_id

    # --- settlements, whoever wrote them -----------------------------------------------------------------

    async def fail(self, task_id: str, message: str, fence: Fence | None = None) -> TaskRecord | None:
        """Settle a task `failed` with `message` (an expiry, an interrupted task), outside of its call."""
        return await self.settle_outside(
            task_id, TaskStatus.FAILED, message, error=wire_tasks.internal_error(message), fence=fence
        )

    async def settle_outside(
        self, task_id: str, status: TaskStatus, message: str, *, error: JSON | None = None, fence: Fence | None = None
    ) -> TaskRecord | None:
        """Settle a task from outside of its call (a client's cancel, a failure); the call, if any, is the
        caller's to stop."""
        self._expect_own(task_id)
        settled = await self.context.store.records.settle(
            task_id, status, now_ms=self.context.clock(), error=error, status_message=message, fence=fence
        )
        if settled is None:
            self._own.pop(task_id, None)
        self.settled(settled, reason=message)
        return settled

    def settled(self, record: TaskRecord | None, **context: Any) -> None:
        """Every settlement that won (the first) is logged and counted here, whoever settled it."""
        if record is None:
            return
        self.context.credentials.release(record.principal, record.task_id)
        log.info("task_settled", task_id=record.task_id, tool=record.tool, status=record.status.value, **context)
        if record.status is TaskStatus.COMPLETED:
            self.context.durations.completed(record)
        if self.context.metrics is not None:
            lifetime_seconds = max(0, record.updated_at_ms - record.created_at_ms) / 1000
            self.context.metrics.task_settled(record.tool, record.status.value, lifetime_seconds)

    async def refused(self, task_id: str, status: TaskStatus, *, fenced: bool, waited: float) -> None:
        """A settlement of a call run here that the store refused: its outcome is lost, so it is logged (warning,
        with why: what the record shows now) and counted, never dropped silently. `fenced`: the fence refused
        it; else the task was no longer live. `waited`: seconds it waited in the outbox (0: refused at once).
        Either way a record that another replica owns now says the task was taken over."""
        try:
            record = await self.context.store.records.get(task_id)
        except StoreError:
            record = None
        if record is not None and record.owner != self.context.process_id:
            fenced = True
        reason = FENCED if fenced else SETTLED
        if record is None:
            detail = "another replica owns the task now" if fenced else "the task is gone"
        elif fenced:
            detail = f"taken over by replica {record.owner}; the task is {record.status.value} there"
        else:
            detail = f"the task had ended {record.status.value} meanwhile"
        log.warning(
            "settlement_refused",
            task_id=task_id,
            status=status.value,
            reason=reason,
            detail=detail,
            waited_seconds=round(waited, 3),
        )
        if self.context.metrics is not None:
            self.context.metrics.settlements_refused.labels(reason).inc()

    def _expect_own(self, task_id: str) -> None:
        """Noted before the write: the feed may bring the change back before the write returns."""
        if self.context.table.task(task_id) is None:
            return  # no call runs here for it: the feed tells this replica nothing about it
        self._own[task_id] = None
        while len(self._own) > OWN_SETTLEMENTS_KEPT:
            self._own.popitem(last=False)

    def still_writing(self, task_id: str) -> bool:
        """Is a settlement of `task_id` by its call here under way, or waiting in the outbox for the store? Then
        the task is not an orphan to recover (its result would lose to an "interrupted" failure)."""
        return task_id in self._own or self.outbox.holds(task_id)

    def own_settlement(self, task_id: str) -> bool:
        """Was the settlement of `task_id` the feed reports this replica's own? (Asked once per settlement.)"""
        return self._own.pop(task_id, "missing") is None


def _nothing(record: TaskRecord | None) -> None:
    """A progress line written late needs no bookkeeping."""


def _log_input_required(task_id: str, tool: str, input_requests: JSON) -> None:
    methods = sorted({str(request.get("method")) for request in input_requests.values() if isinstance(request, dict)})
    log.info("task_input_required", task_id=task_id, tool=tool, keys=sorted(input_requests), methods=methods)
