"""The task operations that need no call: `tasks/get` (the caller's own unexpired task, paced), `tasks/update`
(answers to its call, here or through its owner) and `tasks/cancel` (through the call's machine here, else
settled in the store). Imports the store, the record writes, the table, the replica link and tracing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog

from proxy.errors import InvalidParamsError
from proxy.observe import tracing
from proxy.tasks import machine
from proxy.tasks.context import TasksContext
from proxy.tasks.effects.records import RecordWrites
from proxy.tasks.machine.commands import Answered, Stop
from proxy.tasks.services import remote
from proxy.tasks.services.replicas import ReplicaLink
from proxy.tasks.store import EXPIRED
from proxy.wire import tasks as wire_tasks
from proxy.wire.envelope import Caller
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

CANCELLED_BY_CLIENT: Final = "cancelled by the client"


@dataclass(eq=False, slots=True)
class TaskOperations:
    """`tasks/get`, `tasks/update` and `tasks/cancel` for the front and the listen streams (no call needed)."""

    context: TasksContext
    records: RecordWrites
    replicas: ReplicaLink

    def paced(self, record: TaskRecord) -> TaskRecord:
        """The record as a client sees it (its pacing estimate applied)."""
        return self.context.durations.paced(record)

    def owner(self, caller: Caller) -> str:
        """Whose tasks the caller may see: its principal, as a keyed hash."""
        return self.context.principals.key_of(caller.principal)

    async def peek(self, task_id: str, owner: str) -> TaskRecord | None:
        """The owner's own unexpired task as stored, or None; nothing is written (listen streams read this way
        at every change)."""
        record = await self.context.store.records.get(task_id, principal=owner)
        if record is None or record.expired(self.context.clock()):
            return None
        return record

    async def observe(self, task_id: str, caller: Caller) -> TaskRecord:
        """The caller's own, unexpired task, or -32602 (the same "not found" for an unknown or a foreign id, so
        ids cannot be probed; "expired" for the caller's own task whose record is gone, while its tombstone
        lasts). A live task seen past its TTL is failed now (and its call stopped)."""
        owner = self.context.principals.key_of(caller.principal)
        record = await self.context.store.records.get(task_id, principal=owner)
        if record is None:
            raise await self._gone(task_id, owner)
        tracing.task_read(record.traceparent)  # the request's span links to the one that created the task
        now = self.context.clock()
        if record.expired(now):
            if record.status.terminal:
                # Past its TTL a settled record goes (the sweep would drop it too), leaving its tombstone.
                tombstones = self.records.tasks_config.tombstone_seconds > 0
                await self.context.store.records.delete(task_id, tombstone_at_ms=now if tombstones else None)
                if not tombstones:
                    raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
                message, data = wire_tasks.gone_error(task_id, EXPIRED, now, record.expires_at_ms)
                raise InvalidParamsError(message, data=data)
            expired = await self.expire(record)
            if expired is None:
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            return expired
        return self.context.durations.paced(record)

    async def _gone(self, task_id: str, owner: str) -> InvalidParamsError:
        """-32602 for an id the caller has no record of: "expired" (or "deleted by an operator") when the caller's
        own task left a tombstone within `tasks.tombstone_seconds`, else "not found" (unknown, or another
        principal's: the tombstone is looked up by id and principal, so nothing of others' tasks shows)."""
        if self.records.tasks_config.tombstone_seconds <= 0:
            return InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
        tombstone = await self.context.store.records.tombstone(task_id, owner)
        if (
            tombstone is None
            or self.context.clock() - tombstone.gone_at_ms > self.records.tasks_config.tombstone_seconds * 1000
        ):
            return InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
        message, data = wire_tasks.gone_error(task_id, tombstone.reason, tombstone.gone_at_ms, tombstone.expired_at_ms)
        return InvalidParamsError(message, data=data)

    async def update(self, task_id: str, caller: Caller, responses: Mapping[str, Any]) -> None:
        """Answers for the task's outstanding questions go upstream; the ack does not wait for the state change.
        For a task whose call runs on another replica they are checked against the questions its record shows
        (-32602 naming the key) and stored as a message to its owner, which the feed wakes."""
        record = await self.observe(task_id, caller)
        if record.status.terminal:
            return
        call = self.context.table.task(task_id)
        if call is None:
            answers = remote.check_answers(record.input_requests, responses)
            if answers:
                await self.replicas.post_answers(task_id, answers)
            return
        answers = machine.answers(call.state, responses)
        if answers:
            await self.context.feed.submit(call, Answered(answers))

    async def cancel(self, task_id: str, caller: Caller) -> None:
        """Ack even on a settled task. A live one whose call runs here is settled `cancelled` by its machine,
        under the lease's fence, and its call stopped (`notifications/cancelled` upstream); one whose call runs
        elsewhere (or here no more, its lease lost) is settled in the store, first settlement wins, and its
        owner stops the call when the feed tells it."""
        record = await self.observe(task_id, caller)
        if record.status.terminal:
            return
        call = self.context.table.task(task_id)
        if call is not None:
            await self.context.feed.submit(call, Stop(CANCELLED_BY_CLIENT, status=TaskStatus.CANCELLED))
        if call is None or call.state.fenced:
            await self.records.settle_outside(task_id, TaskStatus.CANCELLED, CANCELLED_BY_CLIENT)

    async def expire(self, record: TaskRecord) -> TaskRecord | None:
        """A live task seen past its TTL fails now: by its machine when its call runs here, else in the store;
        the record as it is then."""
        message = wire_tasks.EXPIRED_MESSAGE
        call = self.context.table.task(record.task_id)
        if call is not None:
            error = wire_tasks.internal_error(message)
            await self.context.feed.submit(call, Stop(message, error, status=TaskStatus.FAILED))
        if call is None or call.state.fenced:
            await self.records.fail(record.task_id, message)
        settled = await self.context.store.records.get(record.task_id)
        if settled is not None and settled.status is TaskStatus.FAILED and settled.status_message == message:
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
        return settled
