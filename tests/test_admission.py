"""tasks/effects/admission.py: the upstream's concurrency cap and its fair queue, driven alone with a recording
`Feed` and a stand-in for the call's upstream session (an async context manager that records who holds it).
The slots are never more than the cap; they go round the waiting callers (round robin), first come first
served within one; a call's place counts the calls admitted before it; a call that leaves the queue frees its
place, and one granted a slot as it is cancelled gives it back. A queued call learns its new place as the queue
moves (coalesced), and caps changed by a reload apply to the calls waiting and running."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from proxy.background import Background
from proxy.config.schema import TasksConfig
from proxy.policy import SYNC_CALL, Decision, Outcome, Policy
from proxy.principals import Identity
from proxy.tasks.effects.call_queue import POSITION_SECONDS, POSITIONS_TOLD, Admission, Caps
from proxy.tasks.live_call import LiveCall, known, new_call
from proxy.tasks.machine.commands import Admitted, Event, Queued, QueueMoved
from proxy.tasks.machine.state import CallState
from tests.support.waiting import until

BACKGROUND = Background()  # owns the calls each test runs at once


class RecordingFeed:
    def __init__(self, stall_admitted: str | None = None) -> None:
        self.events: list[tuple[str, Event]] = []
        self.stall_admitted = stall_admitted  # this call's `Admitted` is never done being carried out
        self.stalled = asyncio.Event()

    async def dispatch(self, call: LiveCall, event: Event) -> None:
        self.events.append((call.name, event))
        if isinstance(event, Admitted) and call.name == self.stall_admitted:
            self.stalled.set()
            await asyncio.Event().wait()

    async def submit(self, call: LiveCall, event: Event) -> None:
        await self.dispatch(call, event)


def a_call(caller: str, name: str, *, tool_cap: int | None = None, tool: str | None = None) -> LiveCall:
    decision = SYNC_CALL
    if tool_cap is not None:  # the tool's own cap, `tasks.tools.<name>.max_concurrent`
        decision = Decision(Outcome.SYNC, Policy("forbidden", 0, None, 1000, "fail", max_concurrent=tool_cap))
    state = CallState(decision=decision, capabilities={}, gather_ms=0, park_ttl_ms=1)
    state.started = state.running = True  # as the machine left it when it asked for the upstream request
    return new_call(
        state, method="tools/call", name=tool or name, principal=Identity(caller), caller=caller, digest_of=known("")
    )


class Upstream:
    """Who holds the upstream now, the most at once, and the order calls got there."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.order: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    @asynccontextmanager
    async def session(self, name: str) -> AsyncIterator[str]:
        self.now += 1
        self.most = max(self.most, self.now)
        self.order.append(name)
        try:
            yield name
        finally:
            self.now -= 1


async def run(admission: Admission, upstream: Upstream, call: LiveCall, done: asyncio.Event) -> None:
    async with admission.slot(call, upstream.session(call.name)):
        await done.wait()


async def test_slots_go_round_the_callers_and_never_exceed_the_cap() -> None:
    feed = RecordingFeed()
    admission = Admission(caps(2, 1000), feed)
    upstream = Upstream()
    done = asyncio.Event()
    calls = [a_call("heavy", f"heavy-{n}") for n in range(6)] + [a_call("light", f"light-{n}") for n in range(2)]
    runs = [BACKGROUND.spawn(run(admission, upstream, call, done), call.name) for call in calls]
    await until(lambda: admission.depth() == 6, "the calls never queued", 5)
    assert admission.held == 2
    ahead = {name: event.ahead for name, event in feed.events if isinstance(event, Queued)}
    # heavy-2..5 queued one behind the other; light-0 gets the turn after heavy-2, light-1 after heavy-3
    assert ahead == {"heavy-2": 0, "heavy-3": 1, "heavy-4": 2, "heavy-5": 3, "light-0": 1, "light-1": 3}
    done.set()
    await asyncio.gather(*runs)
    assert upstream.most == 2
    assert upstream.order == ["heavy-0", "heavy-1", "heavy-2", "light-0", "heavy-3", "light-1", "heavy-4", "heavy-5"]
    admitted = [name for name, event in feed.events if isinstance(event, Admitted)]
    assert admitted == upstream.order[2:]
    assert admission.held == 0


async def test_a_call_that_leaves_the_queue_frees_its_place() -> None:
    feed = RecordingFeed()
    admission = Admission(caps(1, 1000), feed)
    upstream = Upstream()
    done = asyncio.Event()
    first, gone, last = a_call("a", "first"), a_call("b", "gone"), a_call("c", "last")
    runs = [BACKGROUND.spawn(run(admission, upstream, call, done), call.name) for call in (first, gone, last)]
    await until(lambda: admission.depth() == 2, "the calls never queued", 5)
    runs[1].cancel()
    await asyncio.gather(runs[1], return_exceptions=True)
    assert admission.depth() == 1
    done.set()
    await asyncio.gather(runs[0], runs[2])
    assert upstream.order == ["first", "last"]  # the cancelled call never reached the upstream
    assert admission.held == 0


async def test_a_call_cancelled_as_it_is_granted_gives_its_slot_back() -> None:
    feed = RecordingFeed(stall_admitted="second")
    admission = Admission(caps(1, 1000), feed)
    upstream = Upstream()
    hold = asyncio.Event()
    first, second, third = a_call("a", "first"), a_call("b", "second"), a_call("c", "third")
    running = BACKGROUND.spawn(run(admission, upstream, first, hold), "first")
    granted = BACKGROUND.spawn(run(admission, upstream, second, asyncio.Event()), "second")
    await until(lambda: admission.depth() == 1, "the second call never queued", 5)
    hold.set()
    await running
    await feed.stalled.wait()  # the slot went to the second call, which is cancelled before it runs
    assert admission.held == 1
    granted.cancel()
    await asyncio.gather(granted, return_exceptions=True)
    assert admission.held == 0
    done = asyncio.Event()
    done.set()
    await run(admission, upstream, third, done)  # the slot is free again: no wait
    assert not any(name == "third" for name, _ in feed.events)  # never queued
    assert upstream.order == ["first", "third"]


async def test_a_synchronous_caller_is_told_when_to_come_back() -> None:
    feed = RecordingFeed()
    admission = Admission(caps(1, 250), feed)
    upstream = Upstream()
    done = asyncio.Event()
    runs = [BACKGROUND.spawn(run(admission, upstream, a_call("a", name), done), name) for name in ("one", "two")]
    await until(lambda: admission.depth() == 1, "the second call never queued", 5)
    (queued,) = [event for _, event in feed.events if isinstance(event, Queued)]
    assert queued.wait_ms == 250
    assert queued.refusal.status == 503
    assert queued.refusal.response_headers() == {"Retry-After": "1"}  # one call ahead of ~1 s, one slot
    assert queued.refusal.data == {"limit": "max_concurrent_calls", "max": 1, "retryAfterMs": 1000}
    done.set()
    await asyncio.gather(*runs)


async def test_a_tool_with_a_cap_of_its_own_waits_while_other_tools_go_on() -> None:
    feed = RecordingFeed()
    admission = Admission(caps(3, 1000), feed)
    upstream = Upstream()
    done = asyncio.Event()
    first = a_call("a", "slow-1", tool_cap=1, tool="slow")
    second = a_call("a", "slow-2", tool_cap=1, tool="slow")
    other = a_call("b", "fast")
    runs = [
        BACKGROUND.spawn(run(admission, upstream, call, done), f"run-{n}") for n, call in enumerate((first, second))
    ]
    await until(lambda: admission.depth() == 1, "the second call of the slow tool never queued", 5)
    assert admission.held == 1  # two slots are free, but not for the slow tool
    runs.append(BACKGROUND.spawn(run(admission, upstream, other, done), "run-other"))
    await until(lambda: admission.held == 2, "the other tool's call never got a free slot", 5)
    assert [name for name, event in feed.events if isinstance(event, Queued)] == ["slow"]  # only the slow one
    done.set()
    await asyncio.gather(*runs)
    assert upstream.order == ["slow", "fast", "slow"]  # the other tool did not wait behind the slow one
    assert admission.held == 0


async def test_a_call_abandoned_by_its_own_queued_event_leaves_the_queue_and_never_runs() -> None:
    """E.g. a window call whose task could not be created (`CommitRefused` within the `Queued` event): the
    machine abandons it, and it must not take a slot later."""

    class AbandoningFeed(RecordingFeed):
        async def dispatch(self, call: LiveCall, event: Event) -> None:
            await super().dispatch(call, event)
            if isinstance(event, Queued):
                call.state.running = False

    feed = AbandoningFeed()
    admission = Admission(caps(1, 1000), feed)
    upstream = Upstream()
    done = asyncio.Event()
    first, abandoned = a_call("a", "first"), a_call("b", "abandoned")
    running = BACKGROUND.spawn(run(admission, upstream, first, done), "first")
    await until(lambda: admission.held == 1, "the first call never took its slot", 5)
    with pytest.raises(asyncio.CancelledError):
        await run(admission, upstream, abandoned, done)
    assert admission.depth() == 0
    done.set()
    await running
    assert upstream.order == ["first"]
    assert admission.held == 0


async def test_queued_calls_learn_their_new_place_once_per_interval_and_only_when_it_changed() -> None:
    feed = RecordingFeed()
    admission = Admission(caps(1, 1000), feed)
    upstream = Upstream()
    done = {name: asyncio.Event() for name in ("first", "b-0", "b-1", "b-2")}
    runs = [BACKGROUND.spawn(run(admission, upstream, a_call("b", name), done[name]), name) for name in done]
    await until(lambda: admission.depth() == 3, "the calls never queued", 5)
    ahead = {name: event.ahead for name, event in feed.events if isinstance(event, Queued)}
    assert ahead == {"b-0": 0, "b-1": 1, "b-2": 2}
    done["b-0"].set()  # b-0 ends as soon as it goes: two moves at once, so b-2 is told 0, not 1 then 0
    done["first"].set()
    await until(lambda: upstream.order[-1:] == ["b-1"], "b-1 never went", 5)
    await until(
        lambda: [event for _, event in feed.events if isinstance(event, QueueMoved)],
        "no new place told",
        2 * POSITION_SECONDS + 1,
    )
    await asyncio.sleep(POSITION_SECONDS * 2)
    moved = [(name, event.ahead) for name, event in feed.events if isinstance(event, QueueMoved)]
    assert moved == [("b-2", 0)]
    for event in done.values():
        event.set()
    await asyncio.gather(*runs)


def caps(max_concurrent: int, max_wait_ms: int) -> Callable[[], Caps]:
    """Caps that no reload changes."""
    fixed = Caps(max_concurrent, max_wait_ms)
    return lambda: fixed


def swap(in_force: list[Caps], admission: Admission, new: Caps) -> None:
    """A live reload: the config in force is swapped, then the queue is told."""
    in_force[0] = new
    admission.changed()


def capped(**tools: int) -> TasksConfig:
    return TasksConfig.model_validate({"tools": {name: {"max_concurrent": cap} for name, cap in tools.items()}})


async def test_a_cap_raised_live_admits_queued_calls_at_once_and_one_lowered_admits_only_below_it() -> None:
    feed = RecordingFeed()
    in_force = [Caps(1, 1000, capped())]
    admission = Admission(lambda: in_force[0], feed)
    upstream = Upstream()
    done = {f"call-{n}": asyncio.Event() for n in range(5)}
    runs = [BACKGROUND.spawn(run(admission, upstream, a_call(name, name), done[name]), name) for name in list(done)[:4]]
    await until(lambda: admission.depth() == 3, "the calls never queued", 5)
    swap(in_force, admission, Caps(4, 1000, capped()))
    assert (admission.held, admission.depth()) == (4, 0)  # at once, not when a call ends
    swap(in_force, admission, Caps(2, 1000, capped()))
    runs.append(BACKGROUND.spawn(run(admission, upstream, a_call("late", "call-4"), done["call-4"]), "call-4"))
    await until(lambda: admission.depth() == 1, "the late call never queued", 5)
    done["call-0"].set()
    done["call-1"].set()
    await until(lambda: admission.held == 2, "the first calls never ended", 5)
    assert admission.depth() == 1  # two still run: not below the new cap of 2
    done["call-2"].set()
    await until(lambda: upstream.order[-1:] == ["call-4"], "the late call never went below the cap", 5)
    assert admission.held == 2
    for event in done.values():
        event.set()
    await asyncio.gather(*runs)


async def test_a_tool_cap_set_or_removed_live_applies_to_the_calls_running_and_waiting() -> None:
    feed = RecordingFeed()
    in_force = [Caps(sys.maxsize, 1000, capped())]
    admission = Admission(lambda: in_force[0], feed)
    upstream = Upstream()
    done = {f"slow-{n}": asyncio.Event() for n in range(3)}

    def slow(name: str) -> LiveCall:
        return a_call("a", name, tool_cap=99, tool="slow")  # its own policy's cap is not the one in force

    first = BACKGROUND.spawn(run(admission, upstream, slow("slow-0"), done["slow-0"]), "slow-0")
    await until(lambda: admission.held == 1, "the first call never went", 5)
    swap(in_force, admission, Caps(sys.maxsize, 1000, capped(slow=1)))  # the call running counts against the new cap
    runs = [BACKGROUND.spawn(run(admission, upstream, slow(name), done[name]), name) for name in ("slow-1", "slow-2")]
    await until(lambda: admission.depth() == 2, "the calls never queued behind the new cap", 5)
    swap(in_force, admission, Caps(sys.maxsize, 1000, capped()))  # removed: every queued call goes
    assert (admission.held, admission.depth()) == (3, 0)
    for event in done.values():
        event.set()
    await asyncio.gather(first, *runs)
    assert admission.held == 0


async def test_only_the_first_in_line_learn_their_new_place() -> None:
    feed = RecordingFeed()
    admission = Admission(caps(1, 1000), feed)
    upstream = Upstream()
    done = {name: asyncio.Event() for name in ["first", *(f"q-{n}" for n in range(POSITIONS_TOLD + 3))]}
    runs = [BACKGROUND.spawn(run(admission, upstream, a_call("a", name), done[name]), name) for name in done]
    await until(lambda: admission.depth() == POSITIONS_TOLD + 3, "the calls never queued", 5)
    done["first"].set()
    await until(lambda: upstream.order[-1:] == ["q-0"], "q-0 never went", 5)
    await until(lambda: any(isinstance(event, QueueMoved) for _, event in feed.events), "no place told", 5)
    await asyncio.sleep(POSITION_SECONDS * 2)
    moved = {name: event.ahead for name, event in feed.events if isinstance(event, QueueMoved)}
    assert moved == {f"q-{n}": n - 1 for n in range(1, POSITIONS_TOLD + 1)}  # q-101 and q-102 keep theirs
    for event in done.values():
        event.set()
    await asyncio.gather(*runs)
