"""Tasks whose call runs nowhere (at start, taken over, after a lapsed lease): failed, re-run, followed or
polled again; and the periodic sweep (TTLs, purges, take-over). Imports the store, the record writes, the
table, the replica link, the machine's vocabulary and tracing; no upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Final

import structlog

from proxy.config.schema import RestartAction
from proxy.observe import tracing
from proxy.policy import Decision, Outcome, Policy
from proxy.principals import SealError
from proxy.tasks import machine
from proxy.tasks.context import TasksContext
from proxy.tasks.effects import Followers
from proxy.tasks.effects.records import RecordWrites
from proxy.tasks.effects.slots import WaitingPlaces
from proxy.tasks.live_call import known, new_call
from proxy.tasks.machine.commands import LeaseLost, Start, Stop
from proxy.tasks.machine.state import CallState
from proxy.tasks.machine.upstream_task import UpstreamTask
from proxy.tasks.services.replicas import LEASE_LAPSED, LEASE_LAPSED_RERUN, TAKEN_OVER, TAKEN_OVER_RERUN, ReplicaLink
from proxy.tasks.store import Fence, FencedError, StoreError
from proxy.wire import tasks as wire_tasks
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord

log = structlog.get_logger(__name__)

TOMBSTONE_TRIM_MS: Final = 60_000  # tombstones past tasks.tombstone_seconds or max_tombstones go this often
GRANTS_PURGE_MS: Final = 10_000  # kept grants whose caller has no live task (settled elsewhere) go this often
SWEEP_INTERVAL_SECONDS: Final = 1.0  # how often expired tasks are ended and old records purged
REQUEUED: Final = "queued again after a restart: it had not reached the upstream"

StateOf = Callable[[Decision, JSON, str | int | None, str | None], CallState]


def _queue_order(record: TaskRecord) -> tuple[bool, int]:
    """Calls that had started first (as created), then those still queued, in the order they were queued."""
    queued = record.queued_at_ms is not None
    return queued, record.queued_at_ms if record.queued_at_ms is not None else record.created_at_ms


@dataclass(eq=False, slots=True)
class Recovery:
    """Live tasks whose call runs nowhere (at start, taken over, after a lapsed lease), and the sweep."""

    context: TasksContext
    replicas: ReplicaLink
    records: RecordWrites
    state_of: StateOf
    followers: Followers  # how a call follows a task the upstream runs (its own, or a legacy job)
    draining: Callable[[], bool]  # whether this replica drains after SIGTERM: then its sweep takes nothing over
    waiting: WaitingPlaces  # a call taken up that could wait for its client counts there too
    _tombstones_trimmed_ms: int = field(default=0, init=False)  # the clock when the sweep last trimmed the tombstones
    _grants_purged_ms: int = field(default=0, init=False)  # ... and last erased kept grants no live task needs
    # take-overs and a lapsed lease's recovery, one at a time
    _adopting: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    async def recover(self) -> None:
        """Tasks no running process owns any more. On a shared store (PostgreSQL), those of replicas whose lease
        ran out, an earlier run of this one included once its lease lapsed or was released: taken over, so the
        tasks of live replicas are never touched. On SQLite, every live task: the process that ran it is gone
        (the file lock says so); a task the upstream runs itself is followed again."""
        if self.context.store.replicas.shared:
            await self.replicas.sweep(take_over=not self.draining())
            return
        async with self._adopting:
            live = await self.context.store.records.live()
            await self._adopt(live, wire_tasks.RESTART_MESSAGE, wire_tasks.RERUN_MESSAGE, None, follow=True)

    async def taken_over(self, records: list[TaskRecord]) -> None:
        """A dead replica's live tasks, now this replica's."""
        async with self._adopting:
            await self._adopt(records, TAKEN_OVER, TAKEN_OVER_RERUN, self.replicas.fence, follow=False)

    async def lease_lapsed(self) -> None:
        """The lease ran out and was taken again under a new epoch (the store was away, or this replica was
        paused or cut off). The store tells what changed: a call whose task it still shows as this replica's
        (nobody took it over, and nobody can while the new lease holds) is resumed under the new fence; a call
        whose task another replica took, or that ended meanwhile, stops without writing. Then what is still
        this replica's and runs nowhere is recovered like a dead replica's task."""
        async with self._adopting:
            fence = self.replicas.fence
            try:
                live = await self.context.store.records.live(self.context.process_id)
            except StoreError as exc:  # away again: each call's next write asks the fence itself
                log.warning("lease_lapsed_recovery_deferred", error=str(exc))
                return
            mine = {record.task_id for record in live}
            stale = [
                call
                for call in self.context.table.calls()
                if call.stored.fence is not None and call.stored.fence != fence
            ]
            resumed = 0
            for call in stale:
                task_id = call.state.task_id
                if task_id is None or task_id in mine:  # no record yet (its creation is not fenced), or still ours
                    self.records.refence(call, fence)
                    resumed += 1
                else:  # each waits for its call's current event (a record being committed, say)
                    await self.context.feed.dispatch(call, LeaseLost())
            outbox = self.records.outbox
            for task_id in outbox.task_ids():  # calls that ended, their writes waiting for the store: the same rule
                if task_id in mine:
                    outbox.refence(task_id, fence)
            running = {task_id for task_id, call in self.context.table.tasks().items() if call.stored.fence == fence}
            orphans = [
                record
                for record in live
                if record.task_id not in running and not self.records.still_writing(record.task_id)
            ]
            log.warning("lease_lapsed_recovery", resumed=resumed, stopped=len(stale) - resumed, recovered=len(orphans))
            await self._adopt(orphans, LEASE_LAPSED, LEASE_LAPSED_RERUN, fence, follow=True)

    async def _adopt(
        self, records: list[TaskRecord], interrupted: str, rerun: str, fence: Fence | None, *, follow: bool
    ) -> None:
        """Live tasks whose call runs nowhere: failed with `interrupted`, or re-run here when their policy says
        `on_restart: rerun` (claimed with `rerun` as their statusMessage). With `follow` (this replica's own
        upstream ran them), a task the upstream runs itself is followed again instead; another replica's
        upstream is out of reach, so its tasks are failed or re-run. A task whose call was still queued for an
        upstream slot never reached the upstream: it runs again whatever its `on_restart`, after the re-runs of
        calls that had started, in the order it was queued. `fence`: the tasks are this replica's already (taken
        over); None: an earlier process's (SQLite), claimed without one."""
        now = self.context.clock()
        for record in sorted(records, key=_queue_order):
            try:
                if record.expired(now):
                    await self.records.fail(record.task_id, wire_tasks.EXPIRED_MESSAGE, fence)
                    continue
                if record.job_id is not None:
                    if not await self._poll_again(record, fence, follow=follow):
                        await self.records.fail(record.task_id, interrupted, fence)  # never started twice
                        log.info("task_interrupted", task_id=record.task_id, tool=record.tool, reason=interrupted)
                    continue
                if follow and record.upstream_task_id is not None:
                    message = record.status_message or wire_tasks.RESUMED_MESSAGE
                    claimed = await self.context.store.records.claim(
                        record.task_id, self.context.process_id, message, now_ms=now, fence=fence
                    )
                    if claimed is not None:
                        await self._follow_again(claimed, record, fence or self.replicas.fence)
                        continue
                if record.queued_at_ms is not None:
                    claimed = await self._requeue(record, now, fence)
                    if claimed is not None:
                        await self._rerun(claimed, fence or self.replicas.fence)
                        continue
                if record.on_restart == "rerun":
                    claimed = await self.context.store.records.claim(
                        record.task_id, self.context.process_id, rerun, now_ms=now, fence=fence
                    )
                    if claimed is not None:
                        await self._rerun(claimed, fence or self.replicas.fence)
                        continue
                await self.records.fail(record.task_id, interrupted, fence)
            except FencedError:
                return  # our own lease lapsed meanwhile: its recovery takes what is still ours
            log.info("task_interrupted", task_id=record.task_id, tool=record.tool, reason=interrupted)

    async def _requeue(self, record: TaskRecord, now: int, fence: Fence | None) -> TaskRecord | None:
        """A task claimed to run here that was queued and never reached the upstream; its mark goes (it is put
        again when its call waits for a slot here), and its sealed principal stays only if its policy re-runs."""
        claimed = await self.context.store.records.claim(
            record.task_id, self.context.process_id, REQUEUED, now_ms=now, fence=fence
        )
        if claimed is None:
            return None
        kept = claimed.rerun_principal if claimed.on_restart == "rerun" else None
        cleared = await self.context.store.records.set_queued(
            record.task_id, None, REQUEUED, rerun_principal=kept, now_ms=now, fence=fence or self.replicas.fence
        )
        if cleared is None:
            return None
        log.info("task_requeued", task_id=record.task_id, tool=record.tool)
        return replace(cleared, rerun_principal=claimed.rerun_principal)

    async def _rerun(self, record: TaskRecord, fence: Fence) -> None:
        on_restart: RestartAction = "rerun" if record.on_restart == "rerun" else "fail"
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, on_restart)
        fresh = self.state_of(Decision(Outcome.TASK, policy), record.client_capabilities, None, None)
        state = machine.restored(fresh, record)  # question keys stay unique across the re-run too
        if await self._restart(record, state, fence, "not re-run", "task re-run"):
            log.info("task_rerun", task_id=record.task_id, tool=record.tool)

    async def _poll_again(self, record: TaskRecord, fence: Fence | None, *, follow: bool) -> bool:
        """A legacy job (`jobs:`) left live: polled again here when this replica's upstream ran it (`follow`)
        or every replica's upstream shares it (`shared: true`); False when it is not (or its entry is gone)."""
        assert record.job_id is not None
        spec = self.followers.jobs.specs.get(record.tool)
        if spec is None or not (follow or spec.config.shared):
            return False
        message = record.status_message or wire_tasks.RESUMED_MESSAGE
        now = self.context.clock()
        claimed = await self.context.store.records.claim(
            record.task_id, self.context.process_id, message, now_ms=now, fence=fence
        )
        if claimed is None:
            return True  # settled meanwhile: nothing to poll
        on_restart: RestartAction = "rerun" if record.on_restart == "rerun" else "fail"
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, on_restart)
        fresh = self.state_of(Decision(Outcome.TASK, policy, upstream_task=True, job=True), {}, None, None)
        job = UpstreamTask(record.job_id, status_message=record.status_message, poll_interval_ms=spec.poll_interval_ms)
        state = machine.restored(fresh, record, upstream_task=job)
        if await self._restart(claimed, state, fence or self.replicas.fence, "not polled again", "job polled again"):
            log.info("job_resumed", task_id=record.task_id, tool=record.tool)
        return True

    async def _follow_again(self, record: TaskRecord, before: TaskRecord, fence: Fence) -> None:
        """A task the upstream runs itself, left live by a previous process: followed again on its upstream
        session, with the questions it had asked (`before`, as the record was) still answerable."""
        assert record.upstream_task_id is not None
        on_restart: RestartAction = "rerun" if record.on_restart == "rerun" else "fail"
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, on_restart)
        decision = Decision(Outcome.TASK, policy, upstream_task=True)
        fresh = self.state_of(decision, record.client_capabilities, None, None)
        followed = UpstreamTask(
            record.upstream_task_id, status_message=record.status_message, expires_at_ms=record.expires_at_ms
        )
        state = machine.restored(fresh, record, upstream_task=followed, asked=before)
        if await self._restart(record, state, fence, "not followed again", "task followed again"):
            log.info("task_resumed", task_id=record.task_id, tool=record.tool)

    async def _restart(self, record: TaskRecord, state: CallState, fence: Fence, refused: str, span: str) -> bool:
        """Start the call of a task a previous process left live, with the caller's credential kept sealed in
        the record; a credential that no longer opens (another deployment key) fails the task instead. Its work
        goes on in the trace that created the task, below a span named `span`."""
        try:  # the credential (or, where the proxy mints upstream credentials, the verified owner) it kept
            principal = (
                None if record.rerun_principal is None else self.context.principals.restore(record.rerun_principal)
            )
        except SealError as exc:
            await self.records.fail(record.task_id, f"{wire_tasks.RESTART_MESSAGE}; {refused}: {exc}", fence)
            return False
        params = dict(record.request)
        call = new_call(
            state,
            method="tools/call",
            name=record.tool,
            principal=principal,
            caller=record.principal,
            digest_of=known(""),
            params=params,
            record=record,
            fence=fence,
            follower=self.followers.of(state.decision),
        )
        self.context.table.add(call)
        self.context.table.add_task(record.task_id, call)
        self.context.credentials.bind(principal, record.task_id)
        if not state.decision.job and self.waiting.needs_one(state.capabilities):
            self.waiting.take(call)
        with tracing.resumed(span, record.task_id, record.traceparent):
            await self.context.feed.dispatch(call, Start())  # the call's work starts in the span's context
        return True

    # --- the sweep ---------------------------------------------------------------------------------------------

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_SECONDS)
            try:
                await self.sweep()
            except StoreError as exc:
                log.error("task_sweep_failed", error=str(exc))

    async def sweep(self) -> None:
        """Live tasks past their TTL fail (their calls stop, here or, through the feed, on their owner); settled
        records past their TTL are dropped; dead replicas' tasks are taken over. On a shared store each of these
        is done once across replicas (the store hands each expired task, and the purge, to one of them). A draining
        replica takes no dead replica's tasks over: they would outlive its drain and be left again (failed, or re-run
        twice); a replica that serves on takes them."""
        now = self.context.clock()
        error = wire_tasks.internal_error(wire_tasks.EXPIRED_MESSAGE)
        for record in await self.context.store.records.settle_expired(
            now, error=error, status_message=wire_tasks.EXPIRED_MESSAGE
        ):
            self.records.settled(record, reason=wire_tasks.EXPIRED_MESSAGE)
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
            call = self.context.table.task(record.task_id)
            if call is not None:
                await self.context.feed.submit(call, Stop(wire_tasks.EXPIRED_MESSAGE, error))
        config = self.records.tasks_config
        purged = await self.context.store.records.purge_expired(now, tombstones=config.tombstone_seconds > 0)
        if purged:
            log.info("tasks_purged", count=purged)
        if now - self._tombstones_trimmed_ms >= TOMBSTONE_TRIM_MS:
            self._tombstones_trimmed_ms = now
            cut_off = now - int(config.tombstone_seconds * 1000)
            trimmed = await self.context.store.records.trim_tombstones(cut_off, config.max_tombstones)
            if trimmed:
                log.info("tombstones_trimmed", count=trimmed)
        keys = await self.context.store.keys.purge_keys(
            now
        )  # Idempotency-Key records past idempotency.retention_seconds
        if keys:
            log.info("idempotency_keys_purged", count=keys)
        if self.context.credentials.keeps_grants and now - self._grants_purged_ms >= GRANTS_PURGE_MS:
            self._grants_purged_ms = now
            grants = await self.context.store.grants.purge_grants()  # kept credentials no live task needs
            if grants:
                log.info("credential_grants_erased", grants=grants)
        await self.replicas.sweep(take_over=not self.draining())
        await self.context.durations.reload_if_due()
