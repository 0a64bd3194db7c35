"""The call machine, driven by scripted playbooks: events in, commands out, no event loop and no I/O.

Each playbook starts from a fresh call state and feeds its rows in order; every row names the event and exactly
the commands that must come out. The rows cover the common paths (a task, a window call, an MRTR round) and
every event that comes from other replicas of a shared store: a cancel or a TTL expiry settled on another
replica, answers relayed from another replica, and the loss of the lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from proxy.policy import Decision, Outcome, Policy
from proxy.tasks.commands import (
    STORE_WRITES,
    Answer,
    Answered,
    Asked,
    CancelCall,
    ClearTimer,
    ClientLeft,
    Command,
    Committed,
    CreateRecord,
    Ended,
    Event,
    HoldSlot,
    LeaseLost,
    Notified,
    Park,
    Parked,
    Refuse,
    RemoteAnswers,
    RemoteCancel,
    Reply,
    ReplyInputRequired,
    ReplyOutcome,
    ReplyTask,
    Resumed,
    SetTimer,
    Settle,
    Start,
    StartCall,
    Stop,
    Timer,
    TimerFired,
    Unpark,
    WriteInputs,
    WriteProgress,
)
from proxy.tasks.machine import LEASE_LOST, CallState, finished, handle
from proxy.upstream.events import UpstreamErrorResponse, UpstreamResult, UpstreamServerRequest
from proxy.wire.tasks import TaskStatus, internal_error

GATHER_MS = 100
PARK_TTL_MS = 5_000
TASK = Decision(Outcome.TASK, Policy("required", 0, 60_000, 1000, "fail"))
WINDOW = Decision(Outcome.WINDOW, Policy("optional", 1000, 60_000, 1000, "fail"))
WAIT = Decision(Outcome.WAIT, Policy("required", 0, 60_000, 1000, "fail"))
SYNC = Decision(Outcome.SYNC, None)
ELICIT: dict[str, Any] = {"elicitation": {}}

QUESTION = UpstreamServerRequest(
    7, "elicitation/create", {"message": "Name?", "requestedSchema": {"type": "object", "properties": {}}}
)
ASKED_AS = {"method": "elicitation/create", "params": QUESTION.params | {"mode": "form"}}  # type: ignore[operator]
ACCEPT = {"action": "accept", "content": {"name": "Ada"}}
RESULT = UpstreamResult({"content": [{"type": "text", "text": "done"}], "isError": False})
DONE = Settle(
    TaskStatus.COMPLETED,
    result={"content": [{"type": "text", "text": "done"}], "isError": False, "resultType": "complete"},
)
PROGRESS = {"method": "notifications/progress", "params": {"progressToken": "t", "progress": 1, "total": 2}}
LOST_REPLY = Reply(ReplyOutcome(UpstreamErrorResponse(internal_error(LEASE_LOST))))


@dataclass(frozen=True)
class Row:
    event: Event
    commands: list[Command]


def state_for(decision: Decision, capabilities: dict[str, Any] | None = None) -> CallState:
    return CallState(decision, capabilities or {}, gather_ms=GATHER_MS, park_ttl_ms=PARK_TTL_MS)


def play(state: CallState, rows: list[Row]) -> CallState:
    for number, row in enumerate(rows, 1):
        assert handle(state, row.event) == row.commands, f"row {number}: {row.event}"
    return state


# A task that runs: committed first, then the call starts and the client gets the CreateTaskResult.
TASK_STARTED = [
    Row(Start(), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
    Row(Committed("task_1"), [StartCall(), ClearTimer(Timer.WINDOW), Reply(ReplyTask()), HoldSlot(True)]),
]
# ... that asks one question, published to its record after the gather window.
TASK_ASKING = [
    *TASK_STARTED,
    Row(Asked(QUESTION), [SetTimer(Timer.GATHER, GATHER_MS), HoldSlot(False)]),
    Row(TimerFired(Timer.GATHER), [WriteInputs({"elicitation-1": ASKED_AS}, 1)]),
]

PLAYBOOKS: dict[str, tuple[Decision, list[Row]]] = {
    "a task settles with its call's result": (
        TASK,
        [*TASK_STARTED, Row(Ended(RESULT), [ClearTimer(Timer.WINDOW), DONE, HoldSlot(False)])],
    ),
    "a window call still running after its window becomes a task continuing the same call": (
        WINDOW,
        [
            Row(Start(), [StartCall(), SetTimer(Timer.WINDOW, 1000)]),
            Row(TimerFired(Timer.WINDOW), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            Row(Committed("task_1"), [ClearTimer(Timer.WINDOW), Reply(ReplyTask()), HoldSlot(True)]),
        ],
    ),
    "a task's answers from tasks/update on this replica go upstream": (
        TASK,
        [
            *TASK_ASKING,
            Row(Answered({"elicitation-1": ACCEPT}), [Answer(7, ACCEPT), WriteInputs({}, 1), HoldSlot(True)]),
        ],
    ),
    "a synchronous question is an MRTR round, and the retry resumes the parked call": (
        SYNC,
        [
            Row(Start(), [StartCall()]),
            Row(Asked(QUESTION), [SetTimer(Timer.GATHER, GATHER_MS)]),
            Row(TimerFired(Timer.GATHER), [ClearTimer(Timer.WINDOW), Park(1)]),
            Row(
                Parked(),
                [
                    ClearTimer(Timer.WINDOW),
                    Reply(ReplyInputRequired({"elicitation-1": ASKED_AS}, 1)),
                    SetTimer(Timer.PARK, PARK_TTL_MS),
                ],
            ),
            Row(Resumed({"elicitation-1": ACCEPT}), [Unpark(), ClearTimer(Timer.PARK), Answer(7, ACCEPT)]),
            Row(Ended(RESULT), [ClearTimer(Timer.WINDOW), ClearTimer(Timer.WINDOW), Reply(ReplyOutcome(RESULT))]),
        ],
    ),
    # --- from other replicas --------------------------------------------------------------------------------
    "a cancel settled on another replica stops the call and tells the upstream, writing nothing": (
        TASK,
        [
            *TASK_STARTED,
            Row(RemoteCancel("cancelled by the client"), [CancelCall("cancelled by the client"), HoldSlot(False)]),
            Row(Ended(RESULT), []),  # the upstream's late answer changes nothing
            Row(RemoteCancel("cancelled by the client"), []),
        ],
    ),
    "a remote cancel of a task waiting for input refuses nothing and cancels the call": (
        TASK,
        [*TASK_ASKING, Row(RemoteCancel("expired"), [CancelCall("expired")])],
    ),
    "a remote cancel after the call settled by itself is ignored": (
        TASK,
        [
            *TASK_STARTED,
            Row(Ended(RESULT), [ClearTimer(Timer.WINDOW), DONE, HoldSlot(False)]),
            Row(RemoteCancel("cancelled by the client"), []),
        ],
    ),
    "a remote expiry of a poll-to-sync task answers the waiting client with the expiry": (
        WAIT,
        [
            Row(Start(), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            Row(Committed("task_1"), [StartCall(), HoldSlot(True)]),
            Row(
                RemoteCancel("expired", {"code": -32603, "message": "expired"}),
                [
                    ClearTimer(Timer.WINDOW),
                    Reply(ReplyOutcome(UpstreamErrorResponse({"code": -32603, "message": "expired"}))),
                    CancelCall("expired"),
                    HoldSlot(False),
                ],
            ),
        ],
    ),
    "answers relayed from another replica go upstream; keys not outstanding are ignored": (
        TASK,
        [
            *TASK_ASKING,
            Row(
                RemoteAnswers({"elicitation-1": ACCEPT, "elicitation-9": ACCEPT}),
                [Answer(7, ACCEPT), WriteInputs({}, 1), HoldSlot(True)],
            ),
            Row(RemoteAnswers({"elicitation-1": ACCEPT}), []),  # answered already: a second relay is dropped
        ],
    ),
    "a relayed answer that does not fit its question is dropped and the question stays open": (
        TASK,
        [
            *TASK_ASKING,
            Row(RemoteAnswers({"elicitation-1": {"action": "maybe"}}), []),
            Row(RemoteAnswers({"elicitation-1": ACCEPT}), [Answer(7, ACCEPT), WriteInputs({}, 1), HoldSlot(True)]),
        ],
    ),
    "relayed answers for a call that ended are dropped": (
        TASK,
        [
            *TASK_ASKING,
            Row(Ended(RESULT), [ClearTimer(Timer.WINDOW), DONE]),  # a task waiting for input held no slot
            Row(RemoteAnswers({"elicitation-1": ACCEPT}), []),
        ],
    ),
    "a lost lease stops the call and nothing more is written for it": (
        TASK,
        [
            *TASK_STARTED,
            Row(LeaseLost(), [CancelCall(LEASE_LOST), HoldSlot(False)]),
            Row(Notified(PROGRESS, at_ms=10_000.0), []),
            Row(Asked(QUESTION), [Refuse(7, "elicitation/create", "ended")]),
            Row(Ended(RESULT), []),
            Row(LeaseLost(), []),
        ],
    ),
    "a lost lease while waiting for input drops the questions without writing them": (
        TASK,
        [*TASK_ASKING, Row(LeaseLost(), [CancelCall(LEASE_LOST)]), Row(Answered({"elicitation-1": ACCEPT}), [])],
    ),
    "a lease lost while the record is committed: the client is told and the call never starts": (
        TASK,
        [
            Row(Start(), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            Row(LeaseLost(), [ClearTimer(Timer.WINDOW), LOST_REPLY]),
            Row(Committed("task_1"), []),
        ],
    ),
    "a poll-to-sync client waiting on a task whose lease is lost gets the interruption": (
        WAIT,
        [
            Row(Start(), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            Row(Committed("task_1"), [StartCall(), HoldSlot(True)]),
            Row(LeaseLost(), [ClearTimer(Timer.WINDOW), LOST_REPLY, CancelCall(LEASE_LOST), HoldSlot(False)]),
        ],
    ),
}


@pytest.mark.parametrize("name", list(PLAYBOOKS))
def test_playbook(name: str) -> None:
    decision, rows = PLAYBOOKS[name]
    play(state_for(decision, ELICIT), rows)


def test_a_finished_call_is_forgotten_after_a_remote_cancel() -> None:
    decision, rows = PLAYBOOKS[
        "a cancel settled on another replica stops the call and tells the upstream, writing nothing"
    ]
    state = play(state_for(decision, ELICIT), rows[:3])
    assert finished(state)


LATER_EVENTS: list[Event] = [
    Asked(QUESTION),
    TimerFired(Timer.GATHER),
    TimerFired(Timer.WINDOW),
    TimerFired(Timer.PARK),
    Notified(PROGRESS, at_ms=1e9),
    Answered({"elicitation-1": ACCEPT}),
    RemoteAnswers({"elicitation-1": ACCEPT}),
    RemoteCancel("cancelled"),
    ClientLeft(),
    Stop("shutdown"),
    Ended(RESULT),
    Ended(UpstreamErrorResponse({"code": -32000, "message": "boom"})),
]


@pytest.mark.parametrize("start", ["running", "asking", "gathering"])
def test_no_event_after_a_lost_lease_writes_the_record(start: str) -> None:
    """Whatever happens to a call after it lost its lease (its question was being gathered, its answers
    arrive, it ends, it is cancelled), not one store write comes out: another replica may own the task."""
    state = state_for(TASK, ELICIT)
    rows = {"running": TASK_STARTED, "asking": TASK_ASKING, "gathering": TASK_ASKING[:-1]}[start]
    play(state, rows)
    handle(state, LeaseLost())
    for event in LATER_EVENTS * 2:
        commands = handle(state, event)
        assert not [command for command in commands if isinstance(command, STORE_WRITES)], event
    assert not [
        command for command in handle(state, Notified(PROGRESS, at_ms=2e9)) if isinstance(command, WriteProgress)
    ]
