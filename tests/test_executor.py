"""tasks/executor.py and tasks/effects/: what carries out the call machine's commands, on a real SQLite store
and, where the upstream must misbehave in ways a real server will not (a pump that crashes), a stand-in pool.

Each effect is driven alone with a recording `Feed`; the playbooks through the whole executor check what the
machine is answered with (`Committed` / `CommitRefused`, `Parked` / `ParkRefused`) and how a crash ends a
call: a plain message for the client, the exception only in the log-only detail.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast, get_args

import pytest

from proxy.background import Background
from proxy.config.schema import Config
from proxy.errors import CallerLimitError, InvalidParamsError, ProxyError, TaskLimitError
from proxy.observe.metrics import Metrics
from proxy.policy import SYNC_CALL, Decision, Outcome, Policy
from proxy.principals import Principals
from proxy.tasks.context import TasksContext
from proxy.tasks.effects import Effects, Followers
from proxy.tasks.effects.client import ClientSide
from proxy.tasks.effects.job import JobFollower
from proxy.tasks.effects.outbox import Outbox
from proxy.tasks.effects.pump import CRASHED
from proxy.tasks.effects.records import RecordWrites
from proxy.tasks.effects.slots import Parking, RunningSlots, WaitingPlaces
from proxy.tasks.effects.timers import Timers
from proxy.tasks.effects.upstream_task import UpstreamTaskFollower
from proxy.tasks.executor import Executor, ReentryError
from proxy.tasks.live_call import CallTable, LiveCall, known, new_call, wall_clock_ms
from proxy.tasks.machine import commands, inputs
from proxy.tasks.machine.commands import (
    CancelCall,
    ClearTimer,
    ClientLeft,
    Command,
    CommitRefused,
    Committed,
    CreateRecord,
    Ended,
    Event,
    HoldSlot,
    Park,
    Parked,
    ParkRefused,
    Relay,
    RemoteCancel,
    Reply,
    ReplyOutcome,
    ReplyTask,
    SetTimer,
    Start,
    StartCall,
    Timer,
    TimerFired,
)
from proxy.tasks.machine.state import CallState
from proxy.tasks.runner import TaskRunner
from proxy.tasks.services.operations import TaskOperations
from proxy.tasks.services.pacing import Durations
from proxy.tasks.services.recovery import Recovery
from proxy.tasks.services.replica_inbox import ReplicaInbox
from proxy.tasks.services.replicas import ReplicaLink
from proxy.tasks.services.starting import CallStarter
from proxy.tasks.store import Fence, SqliteTaskStore
from proxy.upstream.credentials import Forward
from proxy.upstream.pool import SessionPool
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus
from proxy.wire.upstream_events import UpstreamEvent, UpstreamResult
from tests.support.processes import proxy_config
from tests.support.waiting import until

KEY = os.urandom(32)
TASK_POLICY = Policy("required", 0, 60_000, 1000, "fail")
A_TASK = Decision(Outcome.TASK, TASK_POLICY)
UPSTREAM_RUN = Decision(Outcome.TASK, TASK_POLICY, upstream_task=True)
CRASH = "boom: <internal state of the proxy>"


class RecordingFeed:
    """A `Feed` that only records what the effect under test feeds back."""

    def __init__(self) -> None:
        self.events: list[tuple[LiveCall, Event]] = []

    async def dispatch(self, call: LiveCall, event: Event) -> None:
        self.events.append((call, event))

    async def submit(self, call: LiveCall, event: Event) -> None:
        self.events.append((call, event))

    def of(self, call: LiveCall) -> list[Event]:
        return [event for fed, event in self.events if fed is call]


def make_call(decision: Decision = A_TASK, caller: str = "caller-a", name: str = "tool") -> LiveCall:
    state = CallState(decision=decision, capabilities={}, gather_ms=0, park_ttl_ms=60_000)
    params = {"name": name, "arguments": {}}
    return new_call(
        state, method="tools/call", name=name, principal=None, caller=caller, digest_of=known("digest"), params=params
    )


def config(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    return proxy_config("http://127.0.0.1:9/mcp", tmp_path, **sections)


DEFAULTS = proxy_config("http://127.0.0.1:9/mcp", Path("."))


def defaults() -> Config:
    """The config getter the client side reads its backlog cap through."""
    return DEFAULTS


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteTaskStore]:
    opened = await SqliteTaskStore.open(tmp_path / "executor.db", max_records=2, synchronous="normal")
    yield opened
    await opened.close()


class Parts:
    """The record-writing side as the runner builds it, with a recording feed and no upstream."""

    def __init__(self, store: SqliteTaskStore, tmp_path: Path, max_running: int = 1, per_caller: int = 1) -> None:
        self.store = store
        self.background = Background()
        self.table = CallTable()
        self.durations = Durations(store.usage, wall_clock_ms, self.background)
        self.feed = RecordingFeed()
        self.context = TasksContext(
            store=store,
            table=self.table,
            principals=Principals(KEY),
            credentials=Forward("authorization"),
            feed=self.feed,
            spawner=self.background,
            clock=wall_clock_ms,
            process_id="replica-1",
            durations=self.durations,
        )
        settings = config(
            tmp_path, tasks={"max_running": max_running}, limits={"max_running_per_principal": per_caller}
        )
        self.slots = RunningSlots(lambda: settings)
        self.link: ReplicaLink | None = None
        self.outbox = Outbox(8, None)
        self.records = RecordWrites(self.context, lambda: settings, self.slots, self.outbox, self.fence, self.reclaim)

    def followers(self, settings: Callable[[], Config]) -> Followers:
        """Followers of upstream tasks and jobs that could never reach an upstream (none is asked here)."""
        pool = cast(SessionPool, None)
        tasks = UpstreamTaskFollower(self.feed, self.background, pool, wall_clock_ms)
        return Followers(tasks, JobFollower(self.feed, self.background, pool, wall_clock_ms, settings))

    async def fence(self) -> Fence:
        return Fence("replica-1", 0) if self.link is None else await self.link.held_fence()

    async def reclaim(self, task_id: str) -> Fence | None:
        return None if self.link is None else await self.link.reclaim(task_id)

    async def committed(self, call: LiveCall) -> str:
        answer = await self.records.create(call, CreateRecord(TaskStatus.WORKING, {}, 0))
        assert isinstance(answer, Committed), answer
        call.state.task_id = answer.task_id
        return answer.task_id


# --- records and slots: Committed / CommitRefused ----------------------------------------------------------


async def test_a_working_task_beyond_max_running_is_refused_before_anything_is_written(
    store: SqliteTaskStore,
    tmp_path: Path,
) -> None:
    parts = Parts(store, tmp_path, max_running=1, per_caller=5)
    first, second = make_call(), make_call()
    task_id = await parts.committed(first)
    await parts.slots.hold(first, HoldSlot(True))

    refused = await parts.records.create(second, CreateRecord(TaskStatus.WORKING, {}, 0))

    assert isinstance(refused, CommitRefused)
    assert isinstance(refused.error, TaskLimitError)
    assert (await store.operators.stats())["working"] == 1  # only the first record was written
    assert parts.table.task(task_id) is first
    parts.slots.forget(first)  # the first call finished: its slot is free again
    assert isinstance(await parts.records.create(second, CreateRecord(TaskStatus.WORKING, {}, 0)), Committed)


async def test_the_callers_share_of_running_slots_is_counted_per_caller(store: SqliteTaskStore, tmp_path: Path) -> None:
    parts = Parts(store, tmp_path, max_running=10, per_caller=1)
    mine, also_mine = make_call(caller="a"), make_call(caller="a")
    theirs = make_call(caller="b")
    await parts.slots.hold(mine, HoldSlot(True))

    refused = await parts.records.create(also_mine, CreateRecord(TaskStatus.WORKING, {}, 0))

    assert isinstance(refused, CommitRefused)
    assert isinstance(refused.error, CallerLimitError)
    assert isinstance(await parts.records.create(theirs, CreateRecord(TaskStatus.WORKING, {}, 0)), Committed)
    assert parts.slots.count == 1


async def test_while_the_outbox_is_at_its_limit_a_new_task_is_refused_before_anything_is_written(
    store: SqliteTaskStore, tmp_path: Path
) -> None:
    parts = Parts(store, tmp_path, max_running=10, per_caller=10)
    parts.outbox.limit = 1
    waiting = make_call()
    await parts.committed(waiting)

    async def never_written(fence: Fence | None) -> TaskRecord | None:
        raise AssertionError("not tried in this test")

    parts.outbox.keep("task-x", "settle", lambda: None, never_written, lambda record: None, "disk full")

    refused = await parts.records.create(make_call(), CreateRecord(TaskStatus.WORKING, {}, 0))

    assert isinstance(refused, CommitRefused)
    assert refused.error.status == 503
    assert refused.error.data == {"limit": "store.max_pending_settlements", "max": 1}
    assert (await store.operators.stats())["records"] == 1
    assert parts.outbox.holds(waiting.state.task_id or "") is False  # a task with nothing waiting writes directly


async def test_a_full_store_refuses_the_commit_and_forgets_the_task_id(store: SqliteTaskStore, tmp_path: Path) -> None:
    parts = Parts(store, tmp_path, max_running=10, per_caller=10)
    await parts.committed(make_call())
    await parts.committed(make_call())  # max_records = 2, both live: nothing can be evicted
    third = make_call()

    refused = await parts.records.create(third, CreateRecord(TaskStatus.WORKING, {}, 0))

    assert isinstance(refused, CommitRefused)
    assert refused.error.data == {"limit": "max_records", "max": parts.records.tasks_config.max_records}
    assert len(parts.table.tasks()) == 2  # the refused task's id was taken out again
    assert third.stored.record is None


# --- parking: Parked / ParkRefused -------------------------------------------------------------------------


def parking(tmp_path: Path, max_parked: int, per_caller: int) -> Parking:
    settings = config(tmp_path, inputs={"max_parked": max_parked}, limits={"max_parked_per_principal": per_caller})
    signer = inputs.RequestStateSigner(inputs.load_secret(None))
    return Parking(lambda: settings, signer, wall_clock_ms, "replica-1")


async def test_a_parked_call_gets_a_request_state_that_takes_it_back_exactly_once(tmp_path: Path) -> None:
    parked = parking(tmp_path, max_parked=1, per_caller=1)
    call, other = make_call(caller="a"), make_call(caller="b")

    assert await parked.park(call, Park(1)) == Parked()
    refused = await parked.park(other, Park(1))

    assert isinstance(refused, ParkRefused)
    assert isinstance(refused.error, TaskLimitError)
    claims = parked.signer.verify(call.request_state, wall_clock_ms())
    assert (claims.call_id, claims.round, claims.owner) == (call.call_id, 1, "replica-1")
    call.state.mode = call.state.mode.PARKED  # as the machine leaves a parked call
    call.state.round = 1
    taken, answers = parked.take(claims, {})
    assert (taken, answers, parked.count) == (call, {}, 0)
    with pytest.raises(InvalidParamsError):
        parked.take(claims, {})  # a requestState is good for one retry


async def test_a_callers_share_of_parked_calls_refuses_that_caller_only(tmp_path: Path) -> None:
    parked = parking(tmp_path, max_parked=10, per_caller=1)
    assert await parked.park(make_call(caller="a"), Park(1)) == Parked()

    refused = await parked.park(make_call(caller="a"), Park(1))

    assert isinstance(refused, ParkRefused)
    assert isinstance(refused.error, CallerLimitError)
    assert await parked.park(make_call(caller="b"), Park(1)) == Parked()
    assert parked.count == 2


# --- waiting places: taken at a call's start, refused beyond the caller's share or the total ------------------


def waiting(tmp_path: Path, total: int, per_caller: int) -> tuple[WaitingPlaces, Config]:
    settings = config(tmp_path, inputs={"max_waiting": total}, limits={"max_waiting_per_principal": per_caller})
    return WaitingPlaces(), settings


def test_a_call_can_wait_only_when_its_client_could_answer_a_question() -> None:
    assert WaitingPlaces.needs_one({"elicitation": {}})
    assert WaitingPlaces.needs_one({"sampling": {}, "roots": {"listChanged": True}})
    assert not WaitingPlaces.needs_one({})
    assert not WaitingPlaces.needs_one({"extensions": {"io.modelcontextprotocol/tasks": {}}})


def test_a_callers_waiting_places_refuse_that_caller_with_429_until_one_ends(tmp_path: Path) -> None:
    places, settings = waiting(tmp_path, total=10, per_caller=2)
    first, second = make_call(caller="a"), make_call(caller="a")
    places.take(first)
    assert places.refusal("a", settings) is None
    places.take(second)

    refused = places.refusal("a", settings)

    assert isinstance(refused, CallerLimitError)
    assert (refused.status, refused.data) == (429, {"limit": "max_waiting_per_principal", "max": 2})
    assert refused.response_headers() == {"Retry-After": "1"}
    assert places.refusal("b", settings) is None  # the others go on
    places.forget(first)
    places.forget(first)  # forgetting twice frees one place, not two
    assert places.refusal("a", settings) is None
    assert (places.count, places.held_by("a")) == (1, 1)


def test_the_total_of_waiting_places_refuses_every_caller_with_503(tmp_path: Path) -> None:
    places, settings = waiting(tmp_path, total=2, per_caller=2)
    places.take(make_call(caller="a"))
    places.take(make_call(caller="b"))

    refused = places.refusal("c", settings)

    assert isinstance(refused, TaskLimitError)
    assert not isinstance(refused, CallerLimitError)
    assert (refused.status, refused.data) == (503, {"limit": "max_waiting", "max": 2})
    assert refused.response_headers() == {"Retry-After": "1"}


# --- timers and the client's side, each with a recording feed ------------------------------------------------


async def test_a_timer_fires_into_the_feed_and_a_cleared_one_never_does() -> None:
    feed, background = RecordingFeed(), Background()
    timers = Timers(feed, background)
    call = make_call()

    await timers.set(call, SetTimer(Timer.PARK, 1))
    await timers.clear(call, ClearTimer(Timer.PARK))
    await timers.set(call, SetTimer(Timer.GATHER, 30))
    await until(lambda: bool(feed.of(call)), "the gather timer to fire")

    assert feed.of(call) == [TimerFired(Timer.GATHER)]
    assert call.timers == {}
    await background.close(1)


async def test_a_task_reply_carries_its_record_as_the_client_sees_it(store: SqliteTaskStore, tmp_path: Path) -> None:
    parts = Parts(store, tmp_path)
    call = make_call()
    await parts.committed(call)
    call.client.reply = asyncio.get_running_loop().create_future()
    shown: list[TaskRecord] = []

    def paced(record: TaskRecord) -> TaskRecord:
        shown.append(record)
        return record

    await ClientSide(paced, RecordingFeed(), Background(), defaults).reply(call, Reply(ReplyTask()))

    assert call.client.reply.result() == ReplyTask(call.stored.record)
    assert shown == [call.stored.record]


async def test_a_relay_to_a_broken_stream_tells_the_call_its_client_left() -> None:
    class Broken:
        async def notify(self, message: JSON, *, required: bool = False) -> None:
            raise ConnectionResetError

        async def keepalive(self, *, open_stream: bool = False) -> None:
            return None

    feed, background = RecordingFeed(), Background()
    call = make_call()
    call.client.channel = Broken()

    await ClientSide(lambda record: record, feed, background, defaults).relay(
        call, Relay({"method": "notifications/progress"})
    )
    await until(lambda: bool(feed.events), "the writer to find the stream broken")
    assert feed.events == [(call, ClientLeft())]
    assert call.client.channel is None
    await background.close(1)


class HeldStream:
    """A client's stream that holds each notification until `reading` is set: `steps` says when each write
    began and ended (by the message's `n`), `written` what was written, in order."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.steps: list[str] = []
        self.written: list[JSON] = []

    async def notify(self, message: JSON, *, required: bool = False) -> None:
        self.steps.append(f"begun {message.get('n')}")
        await self.reading.wait()
        self.steps.append(f"done {message.get('n')}")
        self.written.append(message)

    async def keepalive(self, *, open_stream: bool = False) -> None:
        return None


async def test_notifications_and_the_reply_leave_in_order_through_one_writer_that_never_holds_up_the_call() -> None:
    """A client that does not read yet: the relays and the reply return at once (nothing waits on the socket
    under the call's lock), and the reply reaches the waiting request only after both notifications were
    written, in the order given."""
    stream = HeldStream()
    background = Background()
    client = ClientSide(lambda record: record, RecordingFeed(), background, defaults)
    call = make_call()
    call.client.channel = stream
    call.client.reply = asyncio.get_running_loop().create_future()
    first, second = {"method": "notifications/progress", "n": 1}, {"method": "notifications/progress", "n": 2}

    async with asyncio.timeout(1):  # none of these waits for the client
        await client.relay(call, Relay(first))
        await client.relay(call, Relay(second))
        await client.reply(call, Reply(ReplyTask()))
    await asyncio.sleep(0.05)
    assert not call.client.reply.done()
    assert stream.written == []

    stream.reading.set()
    assert await asyncio.wait_for(call.client.reply, 5) == ReplyTask()
    assert stream.written == [first, second]
    await background.close(1)


async def test_what_waits_for_a_client_that_reads_nothing_stays_under_the_cap_and_the_reply_is_kept(
    tmp_path: Path,
) -> None:
    """A client stuck on its first notification: newer progress replaces the progress still waiting, other
    notifications wait until the backlog cap, then are dropped (counted, logged once), and the final reply is
    queued all the same and reaches the client once it reads again."""
    cap = 4096
    capped = config(tmp_path, limits={"max_client_backlog_bytes": cap})
    metrics = Metrics()
    stream, background = HeldStream(), Background()
    client = ClientSide(lambda record: record, RecordingFeed(), background, lambda: capped, metrics)
    call = make_call()
    waiting = client.wait(call, stream)
    await client.relay(call, Relay({"method": "notifications/message", "n": 0}))
    await until(lambda: stream.steps == ["begun 0"], "the writer stuck on the first write")
    line = {"method": "notifications/message", "params": {"data": "x" * 100}}
    for number in range(1, 200):  # about 22 KB of log lines, and a progress notification after each
        await client.relay(call, Relay({**line, "n": number}))
        await client.relay(call, Relay({"method": "notifications/progress", "params": {"progress": number}}))
        assert call.client.backlog_bytes <= cap
    await client.reply(call, Reply(ReplyOutcome(UpstreamResult({"content": []}))))

    def dropped(reason: str) -> float:
        value = metrics.registry.get_sample_value(
            "mcp_tasks_proxy_client_notifications_dropped_total", {"reason": reason}
        )
        return value or 0.0

    assert dropped("backlog_full") == call.client.dropped > 0
    assert dropped("coalesced") > 100  # nearly every progress replaced the one before
    stream.reading.set()
    assert await asyncio.wait_for(waiting, 5) == ReplyOutcome(UpstreamResult({"content": []}))
    progress = [message for message in stream.written if message["method"] == "notifications/progress"]
    assert len(progress) == 1  # only the newest one waiting was written
    assert call.client.backlog_bytes == 0
    await background.close(1)


async def test_a_forwarded_retrys_notes_wait_behind_what_the_writer_still_writes() -> None:
    """A note from the replica that holds a forwarded MRTR retry's call goes out through the stand-in's one
    writer: queued at once behind a notification still being written, never written beside it."""
    stream = HeldStream()
    background = Background()
    client = ClientSide(lambda record: record, RecordingFeed(), background, defaults)
    call = make_call()
    call.client.channel = stream
    await client.relay(call, Relay({"method": "notifications/progress", "n": 1}))
    await until(lambda: stream.steps == ["begun 1"], "the writer to begin the first notification")
    async with asyncio.timeout(1):  # queued, not written: the note does not wait for the client
        await client.note(call, {"method": "notifications/message", "n": 2})
    assert stream.steps == ["begun 1"]
    stream.reading.set()
    await until(lambda: len(stream.steps) == 4, "both notifications written")
    assert stream.steps == ["begun 1", "done 1", "begun 2", "done 2"]
    call.client.channel = None
    await client.note(call, {"method": "notifications/message", "n": 3})  # the client gone: nothing is queued
    assert not call.client.queued()
    await background.close(1)


async def test_keep_alives_are_written_by_the_calls_one_writer_after_what_it_still_writes() -> None:
    """A keep-alive asked for while a notification is being written waits behind it (never two writes on the
    stream at once); a stream broken at a keep-alive is the client leaving, as at a notification, and then no
    keep-alive is queued any more."""
    written: list[str] = []
    reading = asyncio.Event()
    broken = False

    class Slow:
        async def notify(self, message: JSON, *, required: bool = False) -> None:
            written.append("notify: begun")
            await reading.wait()
            written.append("notify: done")

        async def keepalive(self, *, open_stream: bool = False) -> None:
            assert open_stream
            if broken:
                raise ConnectionResetError
            written.append("keep-alive")

    feed, background = RecordingFeed(), Background()
    client = ClientSide(lambda record: record, feed, background, defaults)
    call = make_call()
    call.client.channel = Slow()
    call.client.reply = asyncio.get_running_loop().create_future()

    await client.relay(call, Relay({"method": "notifications/progress"}))
    await until(lambda: written == ["notify: begun"], "the writer to begin the notification")
    client.keep_alive(call)
    await asyncio.sleep(0.05)
    assert written == ["notify: begun"]  # not written beside the notification
    reading.set()
    await until(lambda: len(written) == 3, "the keep-alive after the notification")
    assert written == ["notify: begun", "notify: done", "keep-alive"]

    broken = True
    client.keep_alive(call)
    await until(lambda: bool(feed.events), "the writer to find the stream broken")
    assert feed.events == [(call, ClientLeft())]
    assert call.client.channel is None
    client.keep_alive(call)  # the client is gone: nothing is queued, no writer is started
    assert not call.client.queued()
    assert call.client.writer is not None
    assert call.client.writer.done()
    await background.close(1)


# --- the replica inbox: its own settlements come back on the feed and are dropped --------------------------


async def test_a_replica_ignores_its_own_settlement_on_the_feed_but_not_another_replicas(
    store: SqliteTaskStore,
    tmp_path: Path,
) -> None:
    parts = Parts(store, tmp_path, max_running=10, per_caller=10)
    feed = parts.feed
    signer = inputs.RequestStateSigner(inputs.load_secret(None))
    limits = config(tmp_path)
    parked = Parking(lambda: limits, signer, wall_clock_ms, "replica-1")
    parts.link = link = ReplicaLink(store, "replica-1", 30)
    notes = ClientSide(lambda record: record, feed, parts.context.spawner, defaults)
    follow = parts.followers(lambda: limits)
    waiting = WaitingPlaces()
    starter = CallStarter(parts.context, lambda: limits, parked, waiting, link, notes, follow)
    recovery = Recovery(parts.context, link, parts.records, starter.state, follow, lambda: False, waiting)
    await link.start(ReplicaInbox(parts.context, parked, parts.records, link, recovery, starter))
    own, elsewhere = make_call(), make_call()
    own_task, elsewhere_task = await parts.committed(own), await parts.committed(elsewhere)

    await parts.records.settle_outside(own_task, TaskStatus.CANCELLED, "cancelled here")
    await store.records.settle(elsewhere_task, TaskStatus.CANCELLED, now_ms=wall_clock_ms(), status_message="there")
    await until(lambda: bool(feed.of(elsewhere)), "the other replica's settlement to reach its call")

    assert feed.of(elsewhere) == [RemoteCancel("cancelled by the client")]
    assert feed.of(own) == []  # its change came first on the feed, and was dropped
    await parts.link.close()
    await parts.background.close(1)


# --- a pump that crashes, through the whole executor ---------------------------------------------------------


class FakeUpstreamCall:
    def __init__(self, events: list[UpstreamEvent]) -> None:
        self._events = events

    async def events(self) -> AsyncIterator[UpstreamEvent]:
        for event in self._events:
            yield event

    async def cancel(self, reason: str) -> None:
        return None


class CrashingSession:
    """Answers a task-augmented tools/call with a CreateTaskResult; crashes (a bug, not an upstream failure)
    on `crash_on`."""

    session_id = "session-1"

    def __init__(self, crash_on: str) -> None:
        self.crash_on = crash_on
        self.methods: list[str] = []

    @asynccontextmanager
    async def call(
        self, method: str, params: JSON, headers: dict[str, str], *, tool: str | None = None
    ) -> AsyncIterator[FakeUpstreamCall]:
        self.methods.append(method)
        if method == self.crash_on:
            raise RuntimeError(CRASH)
        yield FakeUpstreamCall([UpstreamResult({"task": {"taskId": "up-1", "status": "working"}})])

    async def respond(self, upstream_id: int | str, *, result: JSON | None, error: JSON | None = None) -> None:
        return None


class FakePool:
    def __init__(self, session: CrashingSession) -> None:
        self.session = session

    @asynccontextmanager
    async def lease(self, principal: str | None, sink: Any, **options: Any) -> AsyncIterator[CrashingSession]:
        yield self.session

    def keep(self, session: Any) -> None:
        return None


@asynccontextmanager
async def runner_on(tmp_path: Path, store: SqliteTaskStore, session: CrashingSession) -> AsyncIterator[TaskRunner]:
    pool = cast(SessionPool, FakePool(session))
    settings = config(tmp_path)
    runner = TaskRunner(lambda: settings, store, pool, Principals(KEY))
    await runner.start()
    try:
        yield runner
    finally:
        await runner.close()


async def started(runner: TaskRunner, decision: Decision) -> LiveCall:
    call = make_call(decision, caller=runner.principals.key_of(None))
    call.state = runner.starter.state(decision, {}, None, None)
    call.upstream.follower = runner.followers.of(decision)
    call.client.reply = asyncio.get_running_loop().create_future()
    runner.table.add(call)
    await runner.executor.submit(call, Start())
    return call


async def test_a_crashing_held_request_ends_the_call_with_a_plain_message(
    tmp_path: Path, store: SqliteTaskStore
) -> None:
    session = CrashingSession(crash_on="tools/call")
    async with runner_on(tmp_path, store, session) as runner:
        call = await started(runner, SYNC_CALL)
        assert call.client.reply is not None
        reply = await asyncio.wait_for(call.client.reply, 10)

    assert isinstance(reply, ReplyOutcome)
    assert isinstance(reply.outcome, ProxyError)
    assert reply.outcome.message == CRASHED
    assert CRASH in str(reply.outcome.detail)  # the exception is for the log only


async def test_a_crashing_pump_of_an_upstream_run_task_fails_it_without_a_python_repr(
    tmp_path: Path, store: SqliteTaskStore
) -> None:
    session = CrashingSession(crash_on="tasks/result")  # the task is created, following it crashes
    async with runner_on(tmp_path, store, session) as runner:
        call = await started(runner, UPSTREAM_RUN)
        assert call.client.reply is not None
        reply = await asyncio.wait_for(call.client.reply, 10)
        assert isinstance(reply, ReplyTask)
        assert reply.record is not None
        task_id = reply.record.task_id

        async def failed() -> bool:
            record = await store.records.get(task_id)
            return record is not None and record.status is TaskStatus.FAILED

        await until(failed, "the task to fail")
        record = await store.records.get(task_id)

    assert record is not None
    assert record.error is not None
    assert session.methods[:2] == ["tools/call", "tasks/result"]
    assert record.error["message"] == CRASHED
    assert record.status_message is not None
    for shown in (record.status_message, record.error["message"]):
        assert "RuntimeError" not in shown
        assert CRASH not in shown


class Recorder:
    """Stands in for every effect and follower: records which of its methods a command reached."""

    def __init__(self, name: str, reached: list[tuple[str, type]]) -> None:
        self.name, self.reached = name, reached

    def __getattr__(self, method: str) -> Callable[[LiveCall, Command], Awaitable[None]]:
        async def carry_out(call: LiveCall, command: Command) -> None:
            self.reached.append((f"{self.name}.{method}", type(command)))

        return carry_out


async def test_every_command_the_machine_can_give_reaches_one_effect() -> None:
    """The command → effect table: every command type reaches exactly one effect's method, and those about a
    task the upstream runs reach the follower the call was built with."""
    reached: list[tuple[str, type]] = []
    parts = [Recorder(name, reached) for name in ("held", "records", "client", "timers", "parking", "slots")]
    effects = Effects(*cast(Any, parts))
    call = make_call()
    call.upstream.follower = cast(Any, Recorder("follower", reached))
    for kind in get_args(Command):
        await effects.carry_out(call, object.__new__(kind))  # the table reads the type alone
    assert [kind for _, kind in reached] == list(get_args(Command))
    assert len({method for method, _ in reached}) == len(reached)
    followed = {kind.__name__ for method, kind in reached if method.startswith("follower.")}
    assert followed == {
        "StartUpstreamTask",
        "FollowUpstreamTask",
        "PollUpstreamTask",
        "CancelUpstreamTask",
        "ReleaseCall",
    }


async def test_a_command_about_an_upstream_task_of_a_call_built_without_a_follower_is_an_error() -> None:
    effects = Effects(*cast(Any, [Recorder("effect", []) for _ in range(6)]))
    with pytest.raises(RuntimeError, match="built without a follower"):
        await effects.carry_out(make_call(), commands.PollUpstreamTask())


async def test_an_effect_that_feeds_its_own_call_raises_instead_of_waiting_for_itself() -> None:
    """The call's lock is held while its commands are carried out: an effect feeding that same call (by
    `dispatch` or `submit`) is refused at once; another call is fed as usual, and so is the same call after."""
    background = Background()
    executor = Executor(background)
    own, other = make_call(SYNC_CALL), make_call(SYNC_CALL)
    seen: list[str] = []

    async def carry_out(call: LiveCall, command: Command) -> None:
        if isinstance(command, StartCall) and call is own:
            for feed in (executor.dispatch, executor.submit):
                with pytest.raises(ReentryError):
                    await feed(own, ClientLeft())
                seen.append(feed.__name__)
            await executor.dispatch(other, Start())
        elif isinstance(command, CancelCall):
            seen.append(command.reason)

    executor.use(carry_out)
    await executor.dispatch(own, Start())
    assert seen == ["dispatch", "submit"]
    assert other.state.started
    assert own.state.started
    await executor.dispatch(own, ClientLeft())  # the lock is free again: carried out, no refusal, no wait
    assert seen == ["dispatch", "submit", "client disconnected"]
    await background.close(1)


async def test_a_finished_call_is_dropped_by_every_owner_that_registered_once_in_order() -> None:
    """`when_finished`: each owner that keeps something of a call (timers, slots, parking, the table) drops it
    when the machine says the call is finished, in the order they registered, and not before."""
    background = Background()
    executor = Executor(background)
    dropped: list[tuple[str, LiveCall]] = []

    def dropping(owner: str) -> Callable[[LiveCall], None]:
        return lambda call: dropped.append((owner, call))

    for owner in ("timers", "slots", "parking", "table"):
        executor.when_finished(dropping(owner))

    async def nothing(call: LiveCall, command: Command) -> None:
        return None

    executor.use(nothing)
    call = make_call(SYNC_CALL)
    await executor.dispatch(call, Start())
    assert dropped == []  # running: kept
    await executor.dispatch(call, Ended(UpstreamResult({"content": []})))
    assert dropped == [("timers", call), ("slots", call), ("parking", call), ("table", call)]
    await background.close(1)


def test_the_executor_is_given_its_table_once() -> None:
    executor = Executor(Background())

    async def nothing(call: LiveCall, command: Command) -> None:
        return None

    executor.use(nothing)
    with pytest.raises(ValueError, match="already"):
        executor.use(nothing)


def test_call_ids_are_unique_url_safe_and_as_long_as_before() -> None:
    """Call ids are drawn from the OS's random source a block at a time: across several blocks none repeats,
    and each is the 22 URL-safe characters of 16 random bytes."""
    from proxy.tasks.live_call import new_call_id

    ids = [new_call_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    alphabet = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert all(len(call_id) == 22 and set(call_id) <= alphabet for call_id in ids)


def test_the_services_compare_and_hash_by_identity_and_take_no_unknown_attribute() -> None:
    """The services are dataclasses of what they are built with, yet two built alike are two services (each
    its own key in a set or a dict), and an attribute they do not declare cannot be set on them by mistake."""

    def settings() -> Config:
        return proxy_config("http://127.0.0.1:9/mcp", Path("."))

    first, second = RunningSlots(settings), RunningSlots(settings)
    assert first != second
    assert len({first, second}) == 2
    with pytest.raises(AttributeError):
        first.confg = settings  # type: ignore[attr-defined]
    for service in (RunningSlots, Parking, CallStarter, TaskOperations, Recovery, ReplicaInbox, JobFollower):
        assert service.__eq__ is object.__eq__, service
        assert service.__hash__ is object.__hash__, service
        assert "__slots__" in vars(service), service
