"""The task operations the front and the listen streams use, which need no call: `tasks/get` (the caller's
own unexpired task, paced; a listen stream's quieter read), `tasks/update` (answers to its call, here or
through its owner) and `tasks/cancel` (settled `cancelled`, its call stopped here or by its owner through the
feed). A live task seen past its TTL is failed then and there. The span of each of these requests links to
the span that created the task, as its record keeps it. Imports the store, the record writes (settlements),
the table, the replica link and tracing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import structlog

from proxy import tracing
from proxy.errors import InvalidParamsError
from proxy.principals import Principals
from proxy.tasks import machine, remote
from proxy.tasks.commands import Answered, Stop
from proxy.tasks.effects.records import RecordWrites
from proxy.tasks.ports import Feed
from proxy.tasks.replicas import ReplicaLink
from proxy.tasks.store import TaskStore
from proxy.tasks.table import CallTable
from proxy.wire import tasks as wire_tasks
from proxy.wire.envelope import Caller
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

CANCELLED_BY_CLIENT: Final = "cancelled by the client"


class TaskOperations:
    def __init__(
        self,
        store: TaskStore,
        principals: Principals,
        table: CallTable,
        records: RecordWrites,
        feed: Feed,
        replicas: ReplicaLink,
        clock: Callable[[], int],
        paced: Callable[[TaskRecord], TaskRecord],
    ) -> None:
        self.store = store
        self.principals = principals
        self.table = table
        self.records = records
        self.feed = feed
        self.replicas = replicas
        self.clock = clock
        self.paced = paced

    def owner(self, caller: Caller) -> str:
        """Whose tasks the caller may see: its principal, as a keyed hash."""
        return self.principals.key_of(caller.principal)

    async def peek(self, task_id: str, owner: str) -> TaskRecord | None:
        """The owner's own unexpired task as stored, or None; nothing is written (listen streams read this way
        at every change)."""
        record = await self.store.get(task_id, principal=owner)
        if record is None or record.expired(self.clock()):
            return None
        return record

    async def observe(self, task_id: str, caller: Caller) -> TaskRecord:
        """The caller's own, unexpired task, or -32602 (the same for an unknown, foreign or expired id, so
        ids cannot be probed). A live task seen past its TTL is failed now (and its call stopped)."""
        record = await self.store.get(task_id, principal=self.principals.key_of(caller.principal))
        if record is None:
            raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
        tracing.task_read(record.traceparent)  # the request's span links to the one that created the task
        if record.expired(self.clock()):
            if record.status.terminal:
                await self.store.delete(task_id)  # past its TTL a settled record goes (the sweep would drop it too)
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            expired = await self.expire(record) or await self.store.get(task_id)
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
        call = self.table.task(task_id)
        if call is None:
            answers = remote.check_answers(record.input_requests, responses)
            if answers:
                await self.replicas.post_answers(task_id, answers)
            return
        answers = machine.answers(call.state, responses)
        if answers:
            await self.feed.submit(call, Answered(answers))

    async def cancel(self, task_id: str, caller: Caller) -> None:
        """Ack even on a settled task; a live one is settled `cancelled` (unless it settles first) and its
        call stopped (`notifications/cancelled` upstream): here, or by its owner when the feed tells it."""
        record = await self.observe(task_id, caller)
        if record.status.terminal:
            return
        await self.records.settle_outside(task_id, TaskStatus.CANCELLED, CANCELLED_BY_CLIENT)
        call = self.table.task(task_id)
        if call is not None:
            await self.feed.submit(call, Stop(CANCELLED_BY_CLIENT))

    async def expire(self, record: TaskRecord) -> TaskRecord | None:
        settled = await self.records.fail(record.task_id, wire_tasks.EXPIRED_MESSAGE)
        call = self.table.task(record.task_id)
        if call is not None:
            error = wire_tasks.internal_error(wire_tasks.EXPIRED_MESSAGE)
            await self.feed.submit(call, Stop(wire_tasks.EXPIRED_MESSAGE, error))
        if settled is not None:
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
        return settled
