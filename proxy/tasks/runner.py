"""The composition root of tasks/: builds the executor, its effects and the services from the config, starts
and closes them, and hands the front one small facade (`Tasks`). Carries out nothing itself. Imports all of
tasks/, the store and the upstream pool; never aiohttp's web side or the front."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

import structlog

from proxy.background import Background
from proxy.config.schema import Config
from proxy.observe.audit import AuditLog
from proxy.observe.metrics import Metrics
from proxy.policy import Policy
from proxy.principals import Identity, Principals
from proxy.tasks.context import TasksContext
from proxy.tasks.effects import Effects, Followers
from proxy.tasks.effects.call_queue import Admission, Caps
from proxy.tasks.effects.client import ClientSide
from proxy.tasks.effects.held import HeldRequest, QuestionCounter
from proxy.tasks.effects.job import JobFollower
from proxy.tasks.effects.outbox import Outbox
from proxy.tasks.effects.records import RecordWrites
from proxy.tasks.effects.slots import Parking, RunningSlots, WaitingPlaces
from proxy.tasks.effects.timers import Timers
from proxy.tasks.effects.upstream_task import UpstreamTaskFollower
from proxy.tasks.executor import Executor, Observer
from proxy.tasks.live_call import CallTable, wall_clock_ms
from proxy.tasks.machine import inputs
from proxy.tasks.ports import CredentialBindings
from proxy.tasks.services.idempotency import IdempotencyKeys
from proxy.tasks.services.observers import AuditTrail, SpanEvents
from proxy.tasks.services.operations import TaskOperations
from proxy.tasks.services.pacing import Durations
from proxy.tasks.services.quotas import Quotas
from proxy.tasks.services.recovery import Recovery
from proxy.tasks.services.replica_inbox import ReplicaInbox
from proxy.tasks.services.replicas import ReplicaLink
from proxy.tasks.services.starting import CallStarter, WaitingRequests
from proxy.tasks.services.tool_names import check_named_tools
from proxy.tasks.store import TaskStore
from proxy.upstream.credentials import Forward
from proxy.upstream.pool import SessionPool
from proxy.wire.envelope import Caller

log = structlog.get_logger(__name__)

SHUTDOWN_GRACE_SECONDS: Final = 5.0  # how long close() waits for cancelled calls to tell the upstream

_T = TypeVar("_T")


class Tasks:
    """What the front and the edge's handlers use of tasks, and nothing of the runner's internals: start and
    resume calls for waiting requests (`call`, `resume`), the task operations (`get`, `update`, `cancel`, and
    what listen streams read), a caller's quotas and idempotency keys, and whose tasks a caller owns."""

    def __init__(
        self,
        waiting: WaitingRequests,
        operations: TaskOperations,
        quotas: Quotas,
        keys: IdempotencyKeys,
        principals: Principals,
        metrics: Metrics | None,
    ) -> None:
        self.call = waiting.call  # a fresh call for a waiting request; its JSON-RPC answer
        self.resume = waiting.resume  # an MRTR retry
        self.keyed = keys.serve  # a tools/call with an Idempotency-Key
        self.get = operations.observe  # tasks/get
        self.update = operations.update  # tasks/update
        self.cancel = operations.cancel  # tasks/cancel
        self.owner = operations.owner  # whose tasks a caller sees (its keyed principal)
        self.peek = operations.peek  # a listen stream's read: nothing written
        self.paced = operations.paced  # a record as a client sees it
        self._quotas = quotas
        self._principals = principals
        self._metrics = metrics

    async def charge(self, caller: Caller, per_minute: int, tool: str, policy: Policy | None) -> None:
        """One call of `caller` against its quotas (RateLimitedError beyond one)."""
        await self._quotas.charge(self._principals.key_of(caller.principal), per_minute, tool, policy)

    def owner_of(self, principal: Identity | None) -> str:
        """A principal's keyed hash (its tasks' owner), as the audit log names it."""
        return self._principals.key_of(principal)

    def pushed(self, status: str) -> None:
        """A listen stream sent a task's change."""
        if self._metrics is not None:
            self._metrics.task_notifications.labels(status).inc()


class TaskRunner:
    def __init__(
        self,
        current: Callable[[], Config],
        store: TaskStore,
        pool: SessionPool,
        principals: Principals,
        clock: Callable[[], int] = wall_clock_ms,
        metrics: Metrics | None = None,
        draining: Callable[[], bool] = lambda: False,
        credentials: CredentialBindings | None = None,
    ) -> None:
        # `current()` is the config in force: what a live reload may change is read through it, at each call;
        # the rest is bound here, at start.
        self.current = current
        config = current()
        self.store = store
        self.principals = principals
        self._pool = pool
        self.clock = clock
        self.metrics = metrics  # also counted outside tasks/ (the listen streams' pushes)
        self.secret_file = config.inputs.secret_file
        self.process_id = uuid.uuid4().hex  # the `owner` of every task this process runs
        self.closing = False  # close() began: what calls answer now is the shutdown's, not their upstream's
        self.background = Background()
        self.table = CallTable()
        self.durations = Durations(store.usage, clock, self.background)
        self.quotas = Quotas(store.usage, clock)
        signer = inputs.RequestStateSigner(inputs.load_secret(config.inputs.secret_file))
        self.slots = RunningSlots(current)
        self.parking = Parking(current, signer, clock, self.process_id)
        self.waiting = WaitingPlaces()
        observers: list[Observer] = [QuestionCounter(metrics), SpanEvents()]  # counted when metrics are on; traced
        self.audit = None if config.audit.path is None else AuditLog(config.audit.path, self.process_id)
        if self.audit is not None:
            observers.append(AuditTrail(self.audit))
        self.executor = feed = Executor(self.background, observers)
        # Built in dependency order: each service gets what it needs, built before it, at construction.
        self.replicas = ReplicaLink(store, self.process_id, config.store.lease_seconds)
        context = TasksContext(
            store=store,
            table=self.table,
            principals=principals,
            feed=feed,
            spawner=self.background,
            clock=clock,
            process_id=self.process_id,
            durations=self.durations,
            credentials=credentials if credentials is not None else Forward(config.security.principal_header),
            metrics=metrics,
        )
        self.outbox = Outbox(config.store.max_pending_settlements, metrics, self.replicas.reclaim)
        self._outbox_worker: asyncio.Task[None] | None = None
        self.records = RecordWrites(
            context, current, self.slots, self.outbox, self.replicas.held_fence, self.replicas.reclaim
        )
        self.timers = Timers(feed, self.background)
        shares = (self.slots.forget, self.parking.forget, self.waiting.forget)
        for forget in (self.timers.forget, *shares, self.table.forget):
            feed.when_finished(forget)  # a finished call: nothing of it is kept
        self._feed = feed
        self.held = held = HeldRequest(feed, self.background, pool, self.parking, self._caps, metrics)
        self.config_swapped()
        self.jobs = jobs = JobFollower(feed, self.background, pool, clock, current)
        self.followers = followers = Followers(UpstreamTaskFollower(feed, self.background, pool, clock), jobs)
        self.client = client = ClientSide(self.durations.paced, feed, self.background, current, metrics)
        feed.use(Effects(held, self.records, client, self.timers, self.parking, self.slots).carry_out)
        self.starter = CallStarter(context, current, self.parking, self.waiting, self.replicas, client, followers)
        self.operations = TaskOperations(context, self.records, self.replicas)
        self.recovery = Recovery(
            context, self.replicas, self.records, self.starter.state, followers, draining, self.waiting
        )
        self.inbox = ReplicaInbox(context, self.parking, self.records, self.replicas, self.recovery, self.starter)
        cache = (config.discovery.cache_ttl_ms, config.discovery.cache_scope)
        self.keys = keys = IdempotencyKeys(
            store, principals, self.process_id, self.spawn, clock, metrics, lambda: self.closing
        )
        requests = WaitingRequests(self.starter, client.keep_alive, cache)
        self.tasks = Tasks(requests, self.operations, self.quotas, keys, principals, metrics)  # the front's

    # --- lifecycle -----------------------------------------------------------------------------------

    def spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        return self.background.spawn(coroutine, name)

    async def start(self) -> None:
        """The lease and the change feed first (every owner write carries the lease's fence), the shared pacing
        estimates, restart recovery (before the first request is served), then the periodic sweep."""
        await self.replicas.start(self.inbox)
        if self.store.replicas.shared and self.secret_file is None:
            log.warning(
                "request_state_key_not_shared",
                detail="inputs.secret_file is unset: an MRTR retry that reaches another replica is refused",
            )
        await self.durations.load()
        await self.recovery.recover()
        self.spawn(self.recovery.sweep_forever(), "task-sweeper")
        self._outbox_worker = self.spawn(self.outbox.run_forever(), "settlement-outbox")
        if self.current().tasks.tools or self.jobs.specs:  # at start: do the tools they name exist upstream?
            self.spawn(check_named_tools(self._pool, self.current, self.jobs), "named-tools-check")

    async def close(self) -> None:
        """Shutdown: running calls are cancelled upstream; their records stay live and are failed or re-run
        per `on_restart` at the next start, or by another replica at once (the lease is released); nothing
        committed is lost or rewritten here. Settlements still waiting for the store are tried once more, under
        the lease, and those it does not take are logged by task id."""
        self.closing = True
        await self.starter.shut_down()
        worker, self._outbox_worker = self._outbox_worker, None
        if worker is not None:  # stopped first: the last round must be the only one writing
            worker.cancel()
            await asyncio.wait([worker])
        await self.outbox.close()
        await self.replicas.close()
        await self.background.close(SHUTDOWN_GRACE_SECONDS)
        await self.keys.close()  # idempotency-key writes the store did not take yet: tried once more
        if self.audit is not None:
            self.audit.close()

    def config_swapped(self) -> None:
        """At start and after a live reload (the services read the config in force through `current`; a call in
        flight keeps the Decision and the timings it started with, its CallState): whether the upstream's cap
        or a tool's cap is in force, for the held requests' admission queue (`HeldRequest.caps_swapped`)."""
        config = self.current()
        self.held.caps_swapped(
            bool(config.upstream.max_concurrent_calls)
            or any(entry.max_concurrent for entry in config.tasks.tools.values())
        )

    @property
    def admission(self) -> Admission | None:
        """The held requests' admission queue, once a cap was in force."""
        return self.held.admission

    def _caps(self) -> Caps:
        config = self.current()
        return Caps(
            config.upstream.max_concurrent_calls or sys.maxsize, config.upstream.max_queue_wait_ms, config.tasks
        )

    def lease_problem(self) -> str | None:
        return self.replicas.lease_problem()

    @property
    def running(self) -> int:
        return self.slots.count

    @property
    def open_calls(self) -> int:
        """Calls not finished yet (tasks, synchronous calls, parked MRTR rounds) and tasks whose settlement
        waits for the store: what a drain waits for."""
        return self.table.count + self.outbox.tasks

    @property
    def parked(self) -> int:
        return self.parking.count

    @property
    def waiting_places(self) -> int:
        """Calls that wait, or may come to wait, for their client (`inputs.max_waiting`)."""
        return self.waiting.count
