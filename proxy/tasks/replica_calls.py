"""The task runner's side of running as one replica of a shared store (a mixin of `TaskRunner`).

What the replica link (`replicas.py`) reports becomes work on the calls here: the tasks of a dead replica are
adopted (failed, or re-run per `on_restart`); a lapsed lease stops the calls started under it (`LeaseLost`)
and recovers what is still this replica's; a task settled elsewhere stops its call (`RemoteCancel`); answers
relayed from elsewhere reach it (`RemoteAnswers`); an MRTR retry forwarded by another replica resumes a call
parked here, and its answer goes back; the shared pacing estimates are read and written. Decisions stay with
the call machine. Imports the machine's event types, the store, `remote.py` and `replicas.py`; the runner only
for type checking (it mixes this class in).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

import structlog

from proxy import tracing
from proxy.errors import InvalidParamsError, ProxyError
from proxy.tasks import inputs, remote
from proxy.tasks.calls import Call, RunnerParts
from proxy.tasks.commands import LeaseLost, RemoteAnswers, RemoteCancel, ReplyError, Resumed
from proxy.tasks.replicas import (
    LEASE_LAPSED,
    LEASE_LAPSED_RERUN,
    TAKEN_OVER,
    TAKEN_OVER_RERUN,
    Ask,
    RemoteChannel,
)
from proxy.tasks.store import Fence, FencedError, StoreError
from proxy.wire import tasks as wire_tasks
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

CANCELLED_BY_CLIENT: Final = "cancelled by the client"
STORE_FAILED: Final = "Internal error: the task store failed"

_T = TypeVar("_T")


class ReplicaCalls(RunnerParts):
    """Mixed into `TaskRunner`, which provides the state and the methods declared here."""

    signer: inputs.RequestStateSigner
    _served: dict[str, Call]

    if TYPE_CHECKING:  # provided by TaskRunner and the other mixins; declared here for the type checker

        def client_left(self, call: Call) -> None:
            raise NotImplementedError

        def _take_parked(
            self, claims: inputs.StateClaims, responses: Mapping[str, Any]
        ) -> tuple[Call, dict[str, JSON]]:
            raise NotImplementedError

        async def _rerun(self, record: TaskRecord, fence: Fence) -> None:
            raise NotImplementedError

        async def _follow_again(self, record: TaskRecord, before: TaskRecord, fence: Fence) -> None:
            raise NotImplementedError

        async def _fail(self, task_id: str, message: str, fence: Fence | None = None) -> TaskRecord | None:
            raise NotImplementedError

    # --- taking over tasks whose call runs nowhere -------------------------------------------------------------

    async def _adopt(
        self, records: list[TaskRecord], interrupted: str, rerun: str, fence: Fence | None, *, follow: bool
    ) -> None:
        """Live tasks whose call runs nowhere: failed with `interrupted`, or re-run here when their policy says
        `on_restart: rerun` (claimed with `rerun` as their statusMessage). With `follow` (this replica's own
        upstream ran them), a task the upstream runs itself is followed again instead; another replica's
        upstream is out of reach, so its tasks are failed or re-run. `fence`: the tasks are this replica's
        already (taken over); None: an earlier process's (SQLite), claimed without one."""
        now = self.clock()
        for record in records:
            try:
                if record.expired(now):
                    await self._fail(record.task_id, wire_tasks.EXPIRED_MESSAGE, fence)
                    continue
                if follow and record.upstream_task_id is not None:
                    message = record.status_message or wire_tasks.RESUMED_MESSAGE
                    claimed = await self.store.claim(record.task_id, self.process_id, message, now_ms=now, fence=fence)
                    if claimed is not None:
                        await self._follow_again(claimed, record, fence or self.replicas.fence)
                        continue
                if record.on_restart == "rerun":
                    claimed = await self.store.claim(record.task_id, self.process_id, rerun, now_ms=now, fence=fence)
                    if claimed is not None:
                        await self._rerun(claimed, fence or self.replicas.fence)
                        continue
                await self._fail(record.task_id, interrupted, fence)
            except FencedError:
                return  # our own lease lapsed meanwhile: its recovery takes what is still ours
            log.info("task_interrupted", task_id=record.task_id, tool=record.tool, reason=interrupted)

    async def taken_over(self, records: list[TaskRecord]) -> None:
        """A dead replica's live tasks, now this replica's."""
        async with self._adopting:
            await self._adopt(records, TAKEN_OVER, TAKEN_OVER_RERUN, self.replicas.fence, follow=False)

    def lease_changed(self, fence: Fence) -> None:
        self.spawn(self._lease_lapsed(), "lease-lapsed")

    async def _lease_lapsed(self) -> None:
        """The lease ran out and was taken again under a new epoch: every call started under the old one stops
        without writing (another replica may have taken its task over), then what is still this replica's and
        runs nowhere is recovered like a dead replica's task."""
        async with self._adopting:
            fence = self.replicas.fence
            stale = [call for call in list(self._calls) if call.fence is not None and call.fence != fence]
            for call in stale:  # each waits for its call's current event (a record being committed, say)
                await self.dispatch(call, LeaseLost())
            running = {task_id for task_id, call in self._tasks.items() if call.fence == fence}
            orphans = [record for record in await self.store.live(self.process_id) if record.task_id not in running]
            log.warning("lease_lapsed_recovery", stopped=len(stale), recovered=len(orphans))
            await self._adopt(orphans, LEASE_LAPSED, LEASE_LAPSED_RERUN, fence, follow=True)

    # --- what other replicas did to tasks whose call runs here -------------------------------------------------

    def settled_elsewhere(self, task_id: str, status: TaskStatus) -> None:
        """A task whose call runs here was settled (by another replica, or by this one: the call then has
        ended already and the machine ignores it)."""
        call = self._tasks.get(task_id)
        if call is not None:
            work = tracing.linked(self._stop_settled(call, task_id, status), "task settled elsewhere", task_id)
            self.spawn(work, f"settled-{call.call_id}")

    async def _stop_settled(self, call: Call, task_id: str, status: TaskStatus) -> None:
        reason, error = (CANCELLED_BY_CLIENT if status is TaskStatus.CANCELLED else f"settled {status.value}"), None
        if status is TaskStatus.FAILED:  # an expiry, say: a client still waiting is told why
            with contextlib.suppress(StoreError):
                record = await self.store.get(task_id)
                if record is not None:
                    reason, error = record.status_message or reason, record.error
        await self.dispatch(call, RemoteCancel(reason, error))

    def answers_arrived(self, task_id: str, answers: JSON) -> None:
        call = self._tasks.get(task_id)
        if call is None:
            log.info("task_answers_dropped", task_id=task_id, keys=sorted(answers))
            return
        work = tracing.linked(self.dispatch(call, RemoteAnswers(answers)), "task answers relayed", task_id)
        self.spawn(work, f"answers-{call.call_id}")

    def resync(self) -> None:
        """The feed may have missed changes: every task whose call runs here is read again."""
        if self._tasks:
            self.spawn(self._resync(list(self._tasks)), "resync")

    async def _resync(self, task_ids: list[str]) -> None:
        for task_id in task_ids:
            try:
                record = await self.store.get(task_id)
            except StoreError:
                return
            if record is not None and record.status.terminal:
                self.settled_elsewhere(task_id, record.status)

    # --- MRTR rounds across replicas ---------------------------------------------------------------------------

    def resume_arrived(self, key: str, payload: JSON) -> None:
        self.spawn(self._serve_forwarded(key, payload), f"serve-{key}")

    async def _serve_forwarded(self, key: str, payload: JSON) -> None:
        """Another replica forwarded an MRTR retry for a call parked here: resume it as a local retry would, and
        send back what the call answers (its notifications on the way)."""
        reply_to = payload.get("replyTo")
        if not isinstance(reply_to, str):
            return
        call: Call | None = None
        try:
            state, responses, progress_token, log_level, reply_to = remote.check_resume(payload)
            claims = self.signer.verify(state, self.clock())
            if claims.owner != self.process_id:
                raise InvalidParamsError("Invalid params: requestState belongs to a call held by another proxy process")
            call, answers = self._take_parked(claims, responses)
            call.reply = asyncio.get_running_loop().create_future()
            call.channel = RemoteChannel(self.replicas, reply_to, key)
            self._served[key] = call
            log.info("mrtr_resumed", method=call.method, name=call.name, round=call.state.round, forwarded_by=reply_to)
            await self.submit(call, Resumed(answers, progress_token, log_level))
            reply = await call.reply
        except ProxyError as exc:
            reply = ReplyError(exc)
        finally:
            self._served.pop(key, None)
        request_state = call.request_state if call is not None else ""
        task_id = call.state.task_id if call is not None else None
        try:
            await self.replicas.send(
                reply_to, remote.REPLY, key, remote.encode_reply(reply, request_state=request_state, task_id=task_id)
            )
        except StoreError as exc:
            log.warning("forwarded_reply_not_sent", to=reply_to, error=str(exc))

    def waiting_client_gone(self, key: str) -> None:
        """The client waiting on another replica for a call resumed here went away."""
        call = self._served.pop(key, None)
        if call is not None:
            if call.reply is not None and not call.reply.done():
                call.reply.cancel()  # nobody waits for the answer any more
            self.client_left(call)

    async def _await_forwarded(self, call: Call, ask: Ask) -> None:
        try:
            reply, call.request_state, task_id = remote.decode_reply(await ask.reply)
            if task_id is not None:
                call.record = await self.store.get(task_id)
                if call.record is None:
                    reply = ReplyError(ProxyError("Internal error: the task the call became is gone"))
        except (ProxyError, StoreError) as exc:
            reply = ReplyError(exc if isinstance(exc, ProxyError) else ProxyError(STORE_FAILED, detail=str(exc)))
        if call.reply is not None and not call.reply.done():
            call.reply.set_result(reply)

    # --- shared pacing, readiness ------------------------------------------------------------------------------

    async def _load_durations(self) -> None:
        """The tools' duration estimates as the store keeps them (every replica's completions, across restarts)."""
        self._durations_loaded_at = time.monotonic()
        try:
            self.durations.load(await self.store.duration_estimates())
        except StoreError as exc:
            log.warning("durations_not_loaded", error=str(exc))

    async def _share_duration(self, tool: str, duration_ms: float) -> None:
        try:
            self.durations.load({tool: await self.store.observe_duration(tool, duration_ms)})
        except StoreError as exc:
            log.warning("duration_not_stored", tool=tool, error=str(exc))

    def lease_problem(self) -> str | None:
        return self.replicas.lease_problem()
