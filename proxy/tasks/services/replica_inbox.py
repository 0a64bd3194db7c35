"""What the replica link reports, turned into work on the calls here: take-overs and a lapsed lease, tasks
settled or answered elsewhere, MRTR retries forwarded here. Decisions stay with the call machine. Imports the
table, the parking, the record writes, `remote.py` and tracing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from proxy.errors import InvalidParamsError, ProxyError
from proxy.observe import tracing
from proxy.tasks.context import TasksContext
from proxy.tasks.effects.records import RecordWrites
from proxy.tasks.effects.slots import Parking
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import RemoteAnswers, RemoteCancel, ReplyError, Resumed
from proxy.tasks.services import remote
from proxy.tasks.services.operations import CANCELLED_BY_CLIENT
from proxy.tasks.services.recovery import Recovery
from proxy.tasks.services.replicas import RemoteChannel, ReplicaLink
from proxy.tasks.services.starting import CallStarter
from proxy.tasks.store import Fence, StoreError
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


@dataclass(eq=False, slots=True)
class ReplicaInbox:
    """The link's `ReplicaOwner`: built last, from the link and the services it turns reports into work for,
    and handed to the link when it starts (`ReplicaLink.start`)."""

    context: TasksContext
    parking: Parking
    records: RecordWrites
    link: ReplicaLink
    recovery: Recovery
    starter: CallStarter
    # MRTR retries forwarded by another replica, by their message key
    _served: dict[str, LiveCall] = field(default_factory=dict, init=False)

    def spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        return self.context.spawner.spawn(coroutine, name)

    # --- the lease, take-overs -----------------------------------------------------------------------------

    def lease_changed(self, fence: Fence) -> None:
        self.context.spawner.spawn(self.recovery.lease_lapsed(), "lease-lapsed")

    async def taken_over(self, records: list[TaskRecord]) -> None:
        await self.recovery.taken_over(records)

    # --- what other replicas did to tasks whose call runs here -------------------------------------------------

    def settled_elsewhere(self, task_id: str, status: TaskStatus) -> None:
        """A task whose call runs here was settled by another replica (this replica's own settlement, coming
        back on the feed, is dropped: its call knows already)."""
        if self.records.own_settlement(task_id):
            return
        call = self.context.table.task(task_id)
        if call is not None:
            work = tracing.linked(
                self._stop_settled(call, task_id, status), "task settled elsewhere", task_id, _traceparent(call)
            )
            self.context.spawner.spawn(work, f"settled-{call.call_id}")

    async def _stop_settled(self, call: LiveCall, task_id: str, status: TaskStatus) -> None:
        """The call stopped, and the settlement logged here too (`task_settled_elsewhere`: an operator's cancel
        from the command line or the admin page, another replica's client), as this replica's own are."""
        reason, error = (CANCELLED_BY_CLIENT if status is TaskStatus.CANCELLED else f"settled {status.value}"), None
        record = None
        with contextlib.suppress(StoreError):
            record = await self.context.store.records.get(task_id)
        if record is not None:
            log.info(
                "task_settled_elsewhere",
                task_id=task_id,
                tool=record.tool,
                status=record.status.value,
                reason=record.status_message if record.status is not TaskStatus.COMPLETED else None,
            )
            if status is TaskStatus.FAILED:  # an expiry, say: a client still waiting is told why
                reason, error = record.status_message or reason, record.error
        await self.context.feed.dispatch(call, RemoteCancel(reason, error))

    def answers_arrived(self, task_id: str, answers: JSON) -> None:
        call = self.context.table.task(task_id)
        if call is None:
            log.info("task_answers_dropped", task_id=task_id, keys=sorted(answers))
            return
        work = tracing.linked(
            self.context.feed.dispatch(call, RemoteAnswers(answers)),
            "task answers relayed",
            task_id,
            _traceparent(call),
        )
        self.context.spawner.spawn(work, f"answers-{call.call_id}")

    def resync(self) -> None:
        """The feed may have missed changes: every task whose call runs here is read again."""
        task_ids = list(self.context.table.tasks())
        if task_ids:
            self.context.spawner.spawn(self._resync(task_ids), "resync")

    async def _resync(self, task_ids: list[str]) -> None:
        for task_id in task_ids:
            try:
                record = await self.context.store.records.get(task_id)
            except StoreError:
                return
            if record is not None and record.status.terminal:
                self.settled_elsewhere(task_id, record.status)

    # --- MRTR rounds across replicas ---------------------------------------------------------------------------

    def resume_arrived(self, key: str, payload: JSON) -> None:
        self.context.spawner.spawn(self._serve_forwarded(key, payload), f"serve-{key}")

    async def _serve_forwarded(self, key: str, payload: JSON) -> None:
        """Another replica forwarded an MRTR retry for a call parked here: resume it as a local retry would, and
        send back what the call answers (its notifications on the way)."""
        reply_to = payload.get("replyTo")
        if not isinstance(reply_to, str):
            return
        call: LiveCall | None = None
        try:
            state, responses, progress_token, log_level, reply_to = remote.check_resume(payload)
            claims = self.parking.signer.verify(state, self.context.clock())
            if claims.owner != self.parking.process_id:
                raise InvalidParamsError("Invalid params: requestState belongs to a call held by another proxy process")
            call, answers = self.parking.take(claims, responses)
            waiting = self.starter.client.wait(call, RemoteChannel(self.link, reply_to, key))
            self._served[key] = call
            log.info("mrtr_resumed", method=call.method, name=call.name, round=call.state.round, forwarded_by=reply_to)
            await self.context.feed.submit(call, Resumed(answers, progress_token, log_level))
            reply = await waiting
        except ProxyError as exc:
            reply = ReplyError(exc)
        finally:
            self._served.pop(key, None)
        request_state = call.request_state if call is not None else ""
        task_id = call.state.task_id if call is not None else None
        try:
            await self.link.send(
                reply_to, remote.REPLY, key, remote.encode_reply(reply, request_state=request_state, task_id=task_id)
            )
        except StoreError as exc:
            log.warning("forwarded_reply_not_sent", to=reply_to, error=str(exc))

    def waiting_client_gone(self, key: str) -> None:
        """The client waiting on another replica for a call resumed here went away."""
        call = self._served.pop(key, None)
        if call is not None:
            self.starter.client.gone(call)  # nobody waits for the answer any more
            self.starter.client_left(call)


def _traceparent(call: LiveCall) -> str | None:
    """The trace context the task of `call` was created under, as its record keeps it."""
    return None if call.stored.record is None else call.stored.record.traceparent
