"""tasks/machine.py: the lifecycle of one call, driven by event sequences (playbooks), with no event loop and
no I/O. Each row feeds events one at a time and names exactly the commands each one must produce, in order.

The rows follow the flows the end-to-end tests cover (test_flow_tasks.py, test_flow_inputs.py,
test_flow_get_stream.py, test_flow_replicas.py): a synchronous call and its MRTR rounds, a task at once, a sync
window that becomes a task, poll-to-sync, resolve-input-first, a re-run after a restart; and every refusal: a
question the client did not declare, one asked after the call ended or once nobody listens, one too many, a
limit on parking or creating, an expired park, a client that leaves. Then what other replicas of a shared store
bring: a cancel or expiry settled there, answers relayed from there, and the loss of the lease.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.errors import ProxyError, QueueTimeoutError, TaskLimitError, UpstreamError
from proxy.policy import SYNC_CALL, Decision, Outcome, Policy
from proxy.tasks import machine
from proxy.tasks.machine import _steps as steps
from proxy.tasks.machine.commands import (
    STORE_WRITES,
    Admitted,
    Answer,
    Answered,
    Asked,
    CancelCall,
    CancelUpstreamTask,
    ClearTimer,
    ClientLeft,
    Command,
    CommitRefused,
    Committed,
    CreateRecord,
    Ended,
    Event,
    FollowUpstreamTask,
    HoldSlot,
    LeaseLost,
    Mode,
    Notified,
    Park,
    Parked,
    ParkRefused,
    PollUpstreamTask,
    Queued,
    QueueMoved,
    Reclaimed,
    Refuse,
    Relay,
    ReleaseCall,
    RemoteAnswers,
    RemoteCancel,
    Reply,
    ReplyError,
    ReplyInputRequired,
    ReplyMissing,
    ReplyOutcome,
    ReplyTask,
    Resumed,
    SetTimer,
    Settle,
    ShutDown,
    Start,
    StartCall,
    StartUpstreamTask,
    Stop,
    Timer,
    TimerFired,
    Unpark,
    UpstreamTaskCreated,
    UpstreamTaskPolled,
    WriteInputs,
    WriteProgress,
    WriteQueue,
)
from proxy.tasks.machine.inputs import PendingInput
from proxy.tasks.machine.state import (
    CLIENT_LEFT,
    LEASE_LOST,
    MAX_OUTSTANDING_INPUTS,
    PARKED_EXPIRED,
    QUEUE_TIMED_OUT,
    RECLAIMED,
    STARTED,
    TASK_REFUSED,
    CallState,
)
from proxy.tasks.machine.upstream_task import UPSTREAM_CANCELLED, UpstreamTask
from proxy.wire.legacy_tasks import LegacyTask
from proxy.wire.tasks import TaskStatus, internal_error
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult, UpstreamServerRequest
from tests.support.records import make_record

EVERY_INPUT: dict[str, Any] = {"elicitation": {}, "sampling": {}, "roots": {}}
WINDOW_MS = 700
GATHER_MS = 100
PARK_TTL_MS = 600_000

OK = UpstreamResult({"content": [{"type": "text", "text": "done"}]})
DONE = {"content": [{"type": "text", "text": "done"}], "resultType": "complete"}
SETTLED_OK = Settle(TaskStatus.COMPLETED, result=DONE)
EXPIRED_ERROR = {"code": -32603, "message": "expired"}
RPC_ERROR = UpstreamErrorResponse({"code": -32000, "message": "no such thing"})
LOST = UpstreamError("Upstream connection lost during tools/call")
ELICIT = UpstreamServerRequest(7, "elicitation/create", {"message": "Name?", "requestedSchema": {"type": "object"}})
ROOTS = UpstreamServerRequest("r1", "roots/list", None)
ELICIT_REQUEST = {
    "method": "elicitation/create",
    "params": {"message": "Name?", "requestedSchema": {"type": "object"}, "mode": "form"},
}
ANSWER = {"action": "accept", "content": {"name": "Ada"}}
LIMIT = TaskLimitError("max_parked", 1)
FULL = TaskLimitError("max_running", 1)
BROKEN = ProxyError("Internal error: the task could not be stored")
PROGRESS = {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": "p", "progress": 1}}


def policy(mode: str = "optional", *, resolve_input_first: bool = False) -> Policy:
    return Policy(mode, WINDOW_MS, 60_000, 1000, "fail", resolve_input_first)  # type: ignore[arg-type]


SYNC = Decision(Outcome.SYNC, policy("forbidden"))
TASK = Decision(Outcome.TASK, policy("required"))
WINDOW = Decision(Outcome.WINDOW, policy())
WAIT = Decision(Outcome.WAIT, policy("required"))
INPUT_FIRST = Decision(Outcome.INPUT_FIRST, policy("required", resolve_input_first=True))


@dataclass
class Playbook:
    name: str
    decision: Decision
    steps: list[tuple[Event, list[Command]]]
    mode: Mode  # the mode at the end
    finished: bool  # nothing more can happen to the call
    capabilities: dict[str, Any] = field(default_factory=lambda: dict(EVERY_INPUT))
    task_id: str | None = None  # a task re-run after a restart starts with its id


def settled(status: TaskStatus, **fields: Any) -> Settle:
    return Settle(status, **fields)


# --- preludes: the steps that bring a call to a state, named once and shared by the rows ----------------------

Steps = list[tuple[Event, list[Command]]]

SYNC_STARTED: Steps = [(Start(), [StartCall()])]
SYNC_ASKED: Steps = [*SYNC_STARTED, (Asked(ELICIT), [SetTimer(Timer.GATHER, GATHER_MS)])]  # a question gathered
SYNC_PARKING: Steps = [*SYNC_ASKED, (TimerFired(Timer.GATHER), [Park(1)])]  # its round is being parked
SYNC_PARKED: Steps = [  # the client got the round (input_required) and the call waits for its retry
    *SYNC_PARKING,
    (
        Parked(),
        [Reply(ReplyInputRequired({"elicitation-1": ELICIT_REQUEST}, 1)), SetTimer(Timer.PARK, PARK_TTL_MS)],
    ),
]
STORING: Steps = [(Start(), [CreateRecord(TaskStatus.WORKING, {}, 0)])]  # a task's record being written first
TASK_STARTED: Steps = [*STORING, (Committed("t1"), [StartCall(), Reply(ReplyTask()), HoldSlot(True)])]
TASK_ASKING: Steps = [  # a running task whose question is written to its record (input_required)
    *TASK_STARTED,
    (Asked(ELICIT), [SetTimer(Timer.GATHER, GATHER_MS), HoldSlot(False)]),
    (TimerFired(Timer.GATHER), [WriteInputs({"elicitation-1": ELICIT_REQUEST}, 1)]),
]
WAIT_STARTED: Steps = [*STORING, (Committed("t1"), [StartCall(), HoldSlot(True)])]  # poll-to-sync, running
WINDOW_STARTED: Steps = [(Start(), [StartCall(), SetTimer(Timer.WINDOW, WINDOW_MS)])]
WINDOW_OVER: Steps = [  # still running when the window closed: its record is being written
    *WINDOW_STARTED,
    (TimerFired(Timer.WINDOW), [CreateRecord(TaskStatus.WORKING, {}, 0)]),
]


PLAYBOOKS = [
    # --- synchronous calls -------------------------------------------------------------------------------
    Playbook(
        "a synchronous call answers with its result",
        SYNC_CALL,
        [
            *SYNC_STARTED,
            (Ended(OK), [Reply(ReplyOutcome(OK))]),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a JSON-RPC error and a lost upstream are the waiting client's answer too",
        SYNC,
        [
            *SYNC_STARTED,
            (Ended(LOST), [Reply(ReplyOutcome(LOST))]),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a question is an MRTR round; the retry's answer goes upstream and the call goes on",
        SYNC,
        [
            *SYNC_PARKED,
            (Resumed({"elicitation-1": ANSWER}), [Unpark(), ClearTimer(Timer.PARK), Answer(7, ANSWER)]),
            (Ended(OK), [Reply(ReplyOutcome(OK))]),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "questions a retry left unanswered are asked again in the next round",
        SYNC,
        [
            *SYNC_ASKED,
            (Asked(ROOTS), []),  # gathered with the first
            (TimerFired(Timer.GATHER), [Park(1)]),
            (
                Parked(),
                [
                    Reply(
                        ReplyInputRequired({"elicitation-1": ELICIT_REQUEST, "roots-2": {"method": "roots/list"}}, 1)
                    ),
                    SetTimer(Timer.PARK, PARK_TTL_MS),
                ],
            ),
            (
                Resumed({"elicitation-1": ANSWER}),
                [Unpark(), ClearTimer(Timer.PARK), Answer(7, ANSWER), Park(2)],
            ),
        ],
        Mode.WAITING,
        finished=False,
    ),
    Playbook(
        "a call that ended while parked answers the retry with its outcome",
        SYNC,
        [
            *SYNC_PARKED,
            (Ended(OK), []),  # still parked: the retry gets the outcome
            (
                Resumed({"elicitation-1": ANSWER}),
                [Unpark(), ClearTimer(Timer.PARK), Reply(ReplyOutcome(OK))],
            ),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a question the client did not declare is refused upstream and the client gets -32021",
        SYNC,
        [
            *SYNC_STARTED,
            (Asked(ROOTS), [Refuse("r1", "roots/list", "undeclared"), SetTimer(Timer.GATHER, GATHER_MS)]),
            (TimerFired(Timer.GATHER), [Reply(ReplyMissing({"roots": {}}))]),
            (Ended(OK), []),
        ],
        Mode.DETACHED,
        finished=True,
        capabilities={"elicitation": {}},
    ),
    Playbook(
        "a request that is not a question (an unknown method) is refused as not found",
        SYNC,
        [
            *SYNC_STARTED,
            (
                Asked(UpstreamServerRequest(3, "experimental/thing", None)),
                [Refuse(3, "experimental/thing", "not_input")],
            ),
        ],
        Mode.WAITING,
        finished=False,
    ),
    Playbook(
        "a question asked after the call ended is refused",
        SYNC,
        [
            *SYNC_STARTED,
            (Ended(OK), [Reply(ReplyOutcome(OK))]),
            (Asked(ELICIT), [Refuse(7, "elicitation/create", "ended")]),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a client that leaves stops the call upstream",
        SYNC,
        [
            *SYNC_STARTED,
            (ClientLeft(), [CancelCall(CLIENT_LEFT)]),
            (Asked(ELICIT), [Refuse(7, "elicitation/create", "ended")]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "beyond inputs.max_parked the questions are declined and the client gets the limit error",
        SYNC,
        [
            *SYNC_PARKING,
            (
                ParkRefused(LIMIT),
                [Reply(ReplyError(LIMIT)), Refuse(7, "elicitation/create", "detached")],
            ),
            (Asked(ROOTS), [Refuse("r1", "roots/list", "detached")]),
        ],
        Mode.DETACHED,
        finished=False,  # the upstream ends the call by itself
    ),
    Playbook(
        "a parked call nobody resumes is cancelled upstream when its state expires",
        SYNC,
        [
            *SYNC_PARKED,
            (TimerFired(Timer.PARK), [Unpark(), CancelCall(PARKED_EXPIRED)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a parked call whose upstream session the pool takes back ends as if nobody retried, saying why",
        SYNC,
        [
            *SYNC_PARKED,
            (Reclaimed(), [Unpark(), CancelCall(RECLAIMED)]),
            (TimerFired(Timer.PARK), []),  # the park timer of a call no longer parked does nothing
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a call that is not parked (its client retried meanwhile) is not ended by a late reclaim",
        SYNC,
        [*SYNC_STARTED, (Reclaimed(), [])],
        Mode.WAITING,
        finished=False,
    ),
    Playbook(
        "progress reaches a waiting client that asked for it",
        SYNC,
        [
            *SYNC_STARTED,
            (Notified(PROGRESS, 0), [Relay({**PROGRESS, "params": {"progressToken": "mine", "progress": 1}})]),
        ],
        Mode.WAITING,
        finished=False,
    ),
    # --- a task at once ----------------------------------------------------------------------------------
    Playbook(
        "a task is committed before its call starts, and its result settles it",
        TASK,
        [
            *TASK_STARTED,
            (Notified(PROGRESS, 1_000), [WriteProgress("1")]),
            (Notified(PROGRESS, 1_100), []),  # within 200 ms of the last write
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a JSON-RPC error fails the task with that error",
        TASK,
        [
            *TASK_STARTED,
            (
                Ended(RPC_ERROR),
                [
                    settled(
                        TaskStatus.FAILED,
                        error={"code": -32000, "message": "no such thing"},
                        status_message="no such thing (JSON-RPC error -32000)",
                    ),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a task refused by a limit never reaches the upstream",
        TASK,
        [
            *STORING,
            (
                CommitRefused(FULL),
                [Reply(ReplyError(FULL))],
            ),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a task's questions go to its record, the slot is freed, and answers bring it back",
        TASK,
        [
            *TASK_ASKING,
            (Answered({"elicitation-1": ANSWER}), [Answer(7, ANSWER), WriteInputs({}, 1), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "an upstream asking more than MAX_OUTSTANDING_INPUTS at once is refused beyond it",
        TASK,
        [
            *TASK_STARTED,
            (Asked(UpstreamServerRequest(0, "roots/list", None)), [SetTimer(Timer.GATHER, GATHER_MS), HoldSlot(False)]),
            *[(Asked(UpstreamServerRequest(n, "roots/list", None)), []) for n in range(1, MAX_OUTSTANDING_INPUTS)],
            (Asked(UpstreamServerRequest(99, "roots/list", None)), [Refuse(99, "roots/list", "too_many")]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a client's tasks/cancel settles the running task here, fenced, and abandons its call upstream",
        TASK,
        [
            *TASK_STARTED,
            (
                Stop("cancelled by the client", status=TaskStatus.CANCELLED),
                [
                    Settle(TaskStatus.CANCELLED, status_message="cancelled by the client"),
                    CancelCall("cancelled by the client"),
                    HoldSlot(False),
                ],
            ),
            (Ended(OK), []),  # abandoned: how its stream ended changes nothing
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a task seen past its TTL fails here with the expiry's error, and its call is abandoned",
        TASK,
        [
            *TASK_STARTED,
            (
                Stop("expired", EXPIRED_ERROR, status=TaskStatus.FAILED),
                [
                    Settle(TaskStatus.FAILED, error=EXPIRED_ERROR, status_message="expired"),
                    CancelCall("expired"),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a settled call is not settled again by a late cancel (its own settlement came first)",
        TASK,
        [
            *TASK_STARTED,
            (Ended(OK), [SETTLED_OK, HoldSlot(False)]),
            (Stop("cancelled by the client", status=TaskStatus.CANCELLED), []),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a task stopped from outside (cancel, expiry, shutdown) is abandoned upstream",
        TASK,
        [
            *TASK_STARTED,
            (Stop("cancelled by the client"), [CancelCall("cancelled by the client"), HoldSlot(False)]),
            (Ended(OK), []),  # abandoned: how its stream ended changes nothing
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a client that leaves while its task is stored does not stop the task",
        TASK,
        [
            *STORING,
            (ClientLeft(), []),
            (Committed("t1"), [StartCall(), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a task re-run after a restart starts its call again and holds a slot",
        TASK,
        [(Start(), [StartCall(), HoldSlot(True)])],
        Mode.TASK,
        finished=False,
        task_id="t1",
    ),
    # --- the sync window ---------------------------------------------------------------------------------
    Playbook(
        "a call that ends within the window is an ordinary result",
        WINDOW,
        [
            *WINDOW_STARTED,
            (Ended(OK), [ClearTimer(Timer.WINDOW), Reply(ReplyOutcome(OK))]),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a call still running after the window becomes a task continuing the same call",
        WINDOW,
        [
            *WINDOW_OVER,
            (Committed("t1"), [Reply(ReplyTask()), HoldSlot(True)]),
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a question during the window makes the call a task at once, carrying the question",
        WINDOW,
        [
            *WINDOW_STARTED,
            (Asked(ELICIT), [SetTimer(Timer.GATHER, GATHER_MS)]),
            (
                TimerFired(Timer.GATHER),
                [
                    ClearTimer(Timer.WINDOW),
                    CreateRecord(TaskStatus.INPUT_REQUIRED, {"elicitation-1": ELICIT_REQUEST}, 1),
                ],
            ),
            (Committed("t1"), [Reply(ReplyTask())]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a call that ends while its record is written settles the new task at once",
        WINDOW,
        [
            *WINDOW_OVER,
            (Ended(OK), []),
            (
                Committed("t1"),
                [Reply(ReplyTask()), settled(TaskStatus.COMPLETED, result=DONE)],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a window call whose task cannot be created is stopped and the client gets the error",
        WINDOW,
        [
            *WINDOW_OVER,
            (
                CommitRefused(BROKEN),
                [Reply(ReplyError(BROKEN)), CancelCall(TASK_REFUSED)],
            ),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    # --- poll-to-sync ------------------------------------------------------------------------------------
    Playbook(
        "poll-to-sync runs an internal task and answers the waiting client with its outcome",
        WAIT,
        [
            *WAIT_STARTED,
            (Notified(PROGRESS, 0), [Relay({**PROGRESS, "params": {"progressToken": "mine", "progress": 1}})]),
            (
                Ended(OK),
                [
                    settled(TaskStatus.COMPLETED, result=DONE),
                    Reply(ReplyOutcome(OK)),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a poll-to-sync client that leaves while its task is stored leaves nobody to read it: cancelled",
        WAIT,
        [
            *STORING,
            (ClientLeft(), []),
            (Committed("t1"), [settled(TaskStatus.CANCELLED, status_message=CLIENT_LEFT)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a poll-to-sync client told it lacks a capability leaves its task cancelled",
        WAIT,
        [
            *WAIT_STARTED,
            (Asked(ROOTS), [Refuse("r1", "roots/list", "undeclared"), SetTimer(Timer.GATHER, GATHER_MS)]),
            (
                TimerFired(Timer.GATHER),
                [
                    Reply(ReplyMissing({"roots": {}})),
                    settled(TaskStatus.CANCELLED, status_message=CLIENT_LEFT),
                    CancelCall(CLIENT_LEFT),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.DETACHED,
        finished=True,
        capabilities={},
    ),
    Playbook(
        "a poll-to-sync task expired from outside tells its waiting client why",
        WAIT,
        [
            *WAIT_STARTED,
            (
                Stop("expired", {"code": -32603, "message": "expired"}),
                [
                    Reply(ReplyOutcome(UpstreamErrorResponse({"code": -32603, "message": "expired"}))),
                    CancelCall("expired"),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    # --- resolve input first ---------------------------------------------------------------------------------
    Playbook(
        "resolve-input-first asks in MRTR rounds, then the resumed call becomes a task after a window",
        INPUT_FIRST,
        [
            *WINDOW_STARTED,
            (Asked(ELICIT), [SetTimer(Timer.GATHER, GATHER_MS)]),
            (TimerFired(Timer.GATHER), [ClearTimer(Timer.WINDOW), Park(1)]),
            (
                Parked(),
                [
                    Reply(ReplyInputRequired({"elicitation-1": ELICIT_REQUEST}, 1)),
                    SetTimer(Timer.PARK, PARK_TTL_MS),
                ],
            ),
            (
                Resumed({"elicitation-1": ANSWER}),
                [Unpark(), ClearTimer(Timer.PARK), Answer(7, ANSWER), SetTimer(Timer.WINDOW, WINDOW_MS)],
            ),
            (TimerFired(Timer.WINDOW), [CreateRecord(TaskStatus.WORKING, {}, 1)]),
            (Committed("t1"), [Reply(ReplyTask()), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a required tool that resolved its input and ended within the window still answers with a task",
        INPUT_FIRST,
        [
            *WINDOW_STARTED,
            (Ended(OK), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            (
                Committed("t1"),
                [Reply(ReplyTask()), settled(TaskStatus.COMPLETED, result=DONE)],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
]


# --- from other replicas of a shared store ---------------------------------------------------------------------

CANCELLED = "cancelled by the client"
EXPIRED = {"code": -32603, "message": "expired"}

PLAYBOOKS += [
    Playbook(
        "a cancel settled on another replica stops the call and tells the upstream, writing nothing",
        TASK,
        [
            *TASK_STARTED,
            (RemoteCancel(CANCELLED), [CancelCall(CANCELLED), HoldSlot(False)]),
            (Ended(OK), []),  # the upstream's late answer changes nothing
            (RemoteCancel(CANCELLED), []),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a remote cancel of a task waiting for input cancels its call",
        TASK,
        [*TASK_ASKING, (RemoteCancel("expired"), [CancelCall("expired")])],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a remote cancel after the call settled by itself is ignored (its own settle, seen on the feed)",
        TASK,
        [
            *TASK_STARTED,
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
            (RemoteCancel(CANCELLED), []),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a remote expiry of a poll-to-sync task answers the waiting client with the expiry",
        WAIT,
        [
            *WAIT_STARTED,
            (
                RemoteCancel("expired", EXPIRED),
                [Reply(ReplyOutcome(UpstreamErrorResponse(EXPIRED))), CancelCall("expired"), HoldSlot(False)],
            ),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "answers relayed from another replica go upstream; keys not outstanding are ignored",
        TASK,
        [
            *TASK_ASKING,
            (
                RemoteAnswers({"elicitation-1": ANSWER, "elicitation-9": ANSWER}),
                [Answer(7, ANSWER), WriteInputs({}, 1), HoldSlot(True)],
            ),
            (RemoteAnswers({"elicitation-1": ANSWER}), []),  # answered already: a second relay is dropped
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a relayed answer that does not fit its question is dropped and the question stays open",
        TASK,
        [
            *TASK_ASKING,
            (RemoteAnswers({"elicitation-1": {"action": "maybe"}}), []),
            (RemoteAnswers({"elicitation-1": ANSWER}), [Answer(7, ANSWER), WriteInputs({}, 1), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "relayed answers for a call that ended are dropped",
        TASK,
        [
            *TASK_ASKING,
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE)]),  # waiting for input, it held no slot
            (RemoteAnswers({"elicitation-1": ANSWER}), []),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a lost lease stops the call, tells the upstream, and nothing more is written for it",
        TASK,
        [
            *TASK_STARTED,
            (LeaseLost(), [CancelCall(LEASE_LOST), HoldSlot(False)]),
            (Notified(PROGRESS, 10_000), []),
            (Asked(ELICIT), [Refuse(7, "elicitation/create", "ended")]),
            (Ended(OK), []),
            (LeaseLost(), []),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a lease lost while waiting for input drops the questions without writing them",
        TASK,
        [*TASK_ASKING, (LeaseLost(), [CancelCall(LEASE_LOST)]), (Answered({"elicitation-1": ANSWER}), [])],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a lease lost while the record is committed: the client is told and the call never starts",
        TASK,
        [
            *STORING,
            (LeaseLost(), [Reply(ReplyOutcome(UpstreamErrorResponse(internal_error(LEASE_LOST))))]),
            (Committed("t1"), []),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a poll-to-sync client waiting on a task whose lease is lost gets the interruption",
        WAIT,
        [
            *WAIT_STARTED,
            (
                LeaseLost(),
                [
                    Reply(ReplyOutcome(UpstreamErrorResponse(internal_error(LEASE_LOST)))),
                    CancelCall(LEASE_LOST),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.DETACHED,
        finished=True,
    ),
]


def run_playbook(playbook: Playbook) -> None:
    """Feed the playbook's events to a fresh call; each step must give exactly its commands."""
    state = CallState(
        decision=playbook.decision,
        capabilities=playbook.capabilities,
        gather_ms=GATHER_MS,
        park_ttl_ms=PARK_TTL_MS,
        progress_token="mine",
        task_id=playbook.task_id,
    )
    for number, (event, expected) in enumerate(playbook.steps, 1):
        assert machine.handle(state, event) == expected, f"step {number}: {event}"
    assert state.mode is playbook.mode
    assert machine.finished(state) is playbook.finished


@pytest.mark.parametrize("playbook", PLAYBOOKS, ids=[playbook.name for playbook in PLAYBOOKS])
def test_playbook(playbook: Playbook) -> None:
    run_playbook(playbook)


def test_answers_are_checked_before_any_is_delivered() -> None:
    """-32602 names the key of an answer that does not fit its question; keys not outstanding are ignored."""
    state = CallState(SYNC, EVERY_INPUT, GATHER_MS, PARK_TTL_MS)
    machine.handle(state, Start())
    machine.handle(state, Asked(ELICIT))
    assert machine.answers(state, {"elicitation-1": ANSWER, "sampling-9": {}}) == {"elicitation-1": ANSWER}
    with pytest.raises(ProxyError, match=r"inputResponses\.elicitation-1"):
        machine.answers(state, {"elicitation-1": {"action": "maybe"}})


def test_a_request_state_resumes_exactly_its_round_of_a_parked_call() -> None:
    state = CallState(SYNC, EVERY_INPUT, GATHER_MS, PARK_TTL_MS)
    for event in (Start(), Asked(ELICIT), TimerFired(Timer.GATHER)):
        machine.handle(state, event)
    assert not machine.resumable(state, 1)  # not parked until the runner registered it
    machine.handle(state, Parked())
    assert machine.resumable(state, 1)
    assert not machine.resumable(state, 2)
    machine.handle(state, Resumed({}))
    assert not machine.resumable(state, 1)  # used


def test_keys_are_never_reused_over_a_calls_life() -> None:
    state = CallState(TASK, EVERY_INPUT, GATHER_MS, PARK_TTL_MS, task_id="t1")
    machine.handle(state, Start())
    machine.handle(state, Asked(ELICIT))
    machine.handle(state, Answered({"elicitation-1": ANSWER}))
    machine.handle(state, Asked(UpstreamServerRequest(8, "elicitation/create", {"message": "Again?"})))
    assert list(state.inputs) == ["elicitation-2"]
    assert state.issued == 2


def test_settlement_maps_outcomes_to_task_statuses() -> None:
    assert steps.settlement(OK) == Settle(TaskStatus.COMPLETED, result=DONE)
    tool_error = UpstreamResult({"content": [], "isError": True})
    assert steps.settlement(tool_error).status is TaskStatus.COMPLETED  # a tool error is a result
    lost = steps.settlement(LOST)
    assert (lost.status, lost.error) == (TaskStatus.FAILED, {"code": -32603, "message": LOST.message})
    assert steps.settlement(None, "stopped") == Settle(TaskStatus.CANCELLED, status_message="stopped")


LATER_EVENTS: list[Event] = [
    Asked(ELICIT),
    TimerFired(Timer.GATHER),
    TimerFired(Timer.WINDOW),
    TimerFired(Timer.PARK),
    Notified(PROGRESS, 1e9),
    Answered({"elicitation-1": ANSWER}),
    RemoteAnswers({"elicitation-1": ANSWER}),
    RemoteCancel(CANCELLED),
    ClientLeft(),
    Stop("shutdown"),
    Ended(OK),
    Ended(RPC_ERROR),
    Committed("t2"),
]


@pytest.mark.parametrize("start", ["running", "asking", "gathering", "waiting"])
def test_no_event_after_a_lost_lease_writes_the_record(start: str) -> None:
    """Whatever reaches a call after it lost its lease (a question being gathered, answers, its end, a cancel),
    not one store write comes out: another replica may own the task now."""
    steps = {
        "running": TASK_STARTED,
        "asking": TASK_ASKING,
        "gathering": TASK_ASKING[:-1],
        "waiting": WAIT_STARTED,
    }[start]
    state = CallState(WAIT if start == "waiting" else TASK, EVERY_INPUT, GATHER_MS, PARK_TTL_MS)
    for event, _ in steps:
        machine.handle(state, event)
    machine.handle(state, LeaseLost())
    for event in LATER_EVENTS * 2:
        commands = machine.handle(state, event)
        assert not [command for command in commands if isinstance(command, STORE_WRITES)], event


# --- a task the upstream runs itself (2025-11-25 Tasks) ----------------------------------------------------------

UP_TASK = Decision(Outcome.TASK, policy("required"), upstream_task=True)
UP_WINDOW = Decision(Outcome.WINDOW, policy(), upstream_task=True)
UP_WAIT = Decision(Outcome.WAIT, policy("required"), upstream_task=True)
START_UPSTREAM = StartUpstreamTask(ttl_ms=60_000)
POLL_MS = 500
CREATED = UpstreamTaskCreated(
    LegacyTask("up-1", "working", "Gathering", ttl_ms=30_000, poll_interval_ms=POLL_MS), 1_000
)
FOLLOWING: list[Command] = [FollowUpstreamTask(), SetTimer(Timer.POLL, POLL_MS)]
ELICIT_IN_TASK = UpstreamServerRequest("q-1", "elicitation/create", ELICIT.params)


def record_of_upstream(status: TaskStatus = TaskStatus.WORKING, **fields: Any) -> CreateRecord:
    defaults: dict[str, Any] = {
        "input_requests": {},
        "issued": 0,
        "upstream_task_id": "up-1",
        "upstream_expires_at_ms": 31_000,  # the upstream keeps it 30 s from its creation
        "upstream_input_ids": {},
        "status_message": "Gathering",
    }
    return CreateRecord(status, **{**defaults, **fields})


def status(state: str, message: str | None = None) -> Notified:
    params: dict[str, Any] = {"taskId": "up-1", "status": state, "createdAt": "", "lastUpdatedAt": "", "ttl": 30_000}
    if message is not None:
        params["statusMessage"] = message
    return Notified({"jsonrpc": "2.0", "method": "notifications/tasks/status", "params": params}, 0.0)


UP_STARTED: Steps = [(Start(), [START_UPSTREAM])]  # the call sent to the upstream as a task
UP_TASK_STARTED: Steps = [  # the upstream created its task, then the proxy's record
    *UP_STARTED,
    (CREATED, [*FOLLOWING, record_of_upstream()]),
    (Committed("t1"), [Reply(ReplyTask()), HoldSlot(True)]),
]
UP_WAIT_STARTED: Steps = [  # poll-to-sync on the upstream's task, its record written
    *UP_STARTED,
    (CREATED, [*FOLLOWING, record_of_upstream()]),
    (Committed("t1"), [HoldSlot(True)]),
]
UP_WINDOW_STARTED: Steps = [*UP_STARTED, (CREATED, [*FOLLOWING, SetTimer(Timer.WINDOW, WINDOW_MS)])]

LOST_TASK = {
    "code": -32603,
    "message": "Upstream task lost: the upstream no longer knows this task (or the session it ran in)",
}
TOOL_ERROR = UpstreamResult({"content": [{"type": "text", "text": "tool failed"}], "isError": True})
EMPTY = UpstreamResult({"_meta": {"io.modelcontextprotocol/related-task": {"taskId": "up-1"}}})
FAILED_ERROR = {"code": -32603, "message": "boom"}


def failed_with(error: dict[str, Any]) -> Settle:
    return settled(
        TaskStatus.FAILED, error=error, status_message=f"{error['message']} (JSON-RPC error {error['code']})"
    )


UPSTREAM_PLAYBOOKS = [
    Playbook(
        "the upstream creates its task, then the record (within its ttl); a tool result from tasks/result completes it",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (status("working", "Analyzing"), [WriteProgress("Analyzing"), SetTimer(Timer.POLL, POLL_MS)]),
            (status("working", "Analyzing"), [SetTimer(Timer.POLL, POLL_MS)]),  # nothing new to write
            (Notified(PROGRESS, 1.0), []),  # the upstream's own statusMessage says more than its progress
            (status("completed"), []),  # the outcome comes from tasks/result
            (Ended(OK), [ClearTimer(Timer.POLL), settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "an upstream silent for its pollInterval is asked with tasks/get, again when that fails",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (TimerFired(Timer.POLL), [PollUpstreamTask()]),
            (UpstreamTaskPolled(None), [SetTimer(Timer.POLL, POLL_MS)]),
            (TimerFired(Timer.POLL), [PollUpstreamTask()]),
            (
                UpstreamTaskPolled(LegacyTask("up-1", "working", "Writing", poll_interval_ms=800)),
                [WriteProgress("Writing"), SetTimer(Timer.POLL, 800)],
            ),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a tool error is a completed task with isError, even when the upstream called it failed",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (status("failed", "tool failed"), [WriteProgress("tool failed")]),
            (
                Ended(TOOL_ERROR),
                [
                    ClearTimer(Timer.POLL),
                    settled(TaskStatus.COMPLETED, result={**TOOL_ERROR.result, "resultType": "complete"}),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a JSON-RPC error of a task not known to have ended is read after its status is asked",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (Ended(UpstreamErrorResponse(FAILED_ERROR)), [PollUpstreamTask()]),
            (
                UpstreamTaskPolled(LegacyTask("up-1", "failed", "boom")),
                [ClearTimer(Timer.POLL), failed_with(FAILED_ERROR), HoldSlot(False)],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "the mcp 1.x SDK's empty answer for a failed task is a failure with its statusMessage",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (status("failed", "boom"), [WriteProgress("boom")]),
            (Ended(EMPTY), [ClearTimer(Timer.POLL), failed_with(FAILED_ERROR), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "an empty answer for a completed task is an empty result",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (status("completed"), []),
            (
                Ended(EMPTY),
                [
                    ClearTimer(Timer.POLL),
                    settled(TaskStatus.COMPLETED, result={"content": [], "resultType": "complete"}),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a task the upstream cancelled is cancelled",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (status("cancelled"), []),
            (
                Ended(RPC_ERROR),
                [
                    ClearTimer(Timer.POLL),
                    settled(TaskStatus.CANCELLED, status_message=UPSTREAM_CANCELLED),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a task the upstream no longer knows fails, and its tasks/result is let go",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (
                UpstreamTaskPolled(None, known=False),
                [ReleaseCall(), ClearTimer(Timer.POLL), failed_with(LOST_TASK), HoldSlot(False)],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a question on tasks/result is an inputRequest; its upstream id is kept and the answer goes there",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (Asked(ELICIT_IN_TASK), [SetTimer(Timer.GATHER, GATHER_MS), HoldSlot(False)]),
            (TimerFired(Timer.GATHER), [WriteInputs({"elicitation-1": ELICIT_REQUEST}, 1, {"elicitation-1": "q-1"})]),
            (Answered({"elicitation-1": ANSWER}), [Answer("q-1", ANSWER), WriteInputs({}, 1, {}), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "tasks/cancel of the proxy's task is tasks/cancel upstream",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (Stop("cancelled"), [ClearTimer(Timer.POLL), CancelUpstreamTask("cancelled"), HoldSlot(False)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a shutdown leaves the upstream's task running (and its session open) for the next start",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (ShutDown("stopping"), [ClearTimer(Timer.POLL), ReleaseCall(keep_session=True), HoldSlot(False)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a lost lease leaves the upstream's task running, to be followed again if the task is still this replica's",
        UP_TASK,
        [
            *UP_TASK_STARTED,
            (LeaseLost(), [ClearTimer(Timer.POLL), ReleaseCall(keep_session=True), HoldSlot(False)]),
            (status("working", "Still at it"), []),  # nothing more is written for it
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a shutdown cancels a poll-to-sync task the upstream runs: nobody could read it afterwards",
        UP_WAIT,
        [
            *UP_WAIT_STARTED,
            (
                ShutDown("stopping"),
                [
                    Reply(ReplyOutcome(UpstreamErrorResponse({"code": -32603, "message": "stopping"}))),
                    ClearTimer(Timer.POLL),
                    CancelUpstreamTask("stopping"),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "poll-to-sync: the client is answered with the outcome of the upstream's task",
        UP_WAIT,
        [
            *UP_WAIT_STARTED,
            (Asked(ELICIT_IN_TASK), [Refuse("q-1", "elicitation/create", "undeclared")]),  # the task goes on
            (
                Ended(OK),
                [
                    ClearTimer(Timer.POLL),
                    settled(TaskStatus.COMPLETED, result=DONE),
                    Reply(ReplyOutcome(OK)),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.WAITING,
        finished=True,
        capabilities={},
    ),
    Playbook(
        "a window call of the upstream's task that ends within the window answers synchronously",
        UP_WINDOW,
        [
            *UP_WINDOW_STARTED,
            (Ended(OK), [ClearTimer(Timer.WINDOW), ClearTimer(Timer.POLL), Reply(ReplyOutcome(OK))]),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a window call still running after the window becomes the proxy's task, carrying the upstream's id",
        UP_WINDOW,
        [
            *UP_WINDOW_STARTED,
            (TimerFired(Timer.WINDOW), [record_of_upstream()]),
            (Committed("t1"), [Reply(ReplyTask()), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a question before the upstream's task exists waits for its id to make the record",
        UP_WINDOW,
        [
            *UP_STARTED,
            (Asked(ELICIT), [SetTimer(Timer.GATHER, GATHER_MS)]),
            (TimerFired(Timer.GATHER), []),
            (
                CREATED,
                [
                    *FOLLOWING,
                    record_of_upstream(
                        TaskStatus.INPUT_REQUIRED,
                        input_requests={"elicitation-1": ELICIT_REQUEST},
                        issued=1,
                        upstream_input_ids={"elicitation-1": 7},
                    ),
                ],
            ),
        ],
        Mode.WAITING,
        finished=False,
    ),
    Playbook(
        "an upstream that answers the task-augmented call with a plain result answers the client with it",
        UP_TASK,
        [*UP_STARTED, (Ended(OK), [Reply(ReplyOutcome(OK))])],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a task the upstream created after its call was abandoned is cancelled there",
        UP_WINDOW,
        [
            *UP_STARTED,
            (ClientLeft(), [CancelCall(CLIENT_LEFT)]),
            (CREATED, [CancelUpstreamTask(CLIENT_LEFT)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
]


@pytest.mark.parametrize("playbook", UPSTREAM_PLAYBOOKS, ids=[playbook.name for playbook in UPSTREAM_PLAYBOOKS])
def test_upstream_task_playbook(playbook: Playbook) -> None:
    run_playbook(playbook)


def test_after_a_restart_the_upstreams_task_is_followed_again_with_its_questions() -> None:
    state = CallState(UP_TASK, EVERY_INPUT, GATHER_MS, PARK_TTL_MS, task_id="t1")
    state.upstream_task = UpstreamTask("up-1")
    state.inputs = {"elicitation-1": PendingInput("q-1", "elicitation/create", ELICIT_REQUEST)}
    state.inputs_written = False
    state.issued = 1
    assert machine.handle(state, Start()) == [
        FollowUpstreamTask(),
        PollUpstreamTask(),  # at once: does the upstream still know it?
        WriteInputs({"elicitation-1": ELICIT_REQUEST}, 1, {"elicitation-1": "q-1"}),
    ]
    assert state.mode is Mode.TASK
    assert machine.handle(state, Answered({"elicitation-1": ANSWER})) == [
        Answer("q-1", ANSWER),
        WriteInputs({}, 1, {}),
        HoldSlot(True),
    ]


# --- a legacy job (`jobs:` config): started by its start tool, followed by polling its status tool -----------------

JOB_TASK = Decision(Outcome.TASK, policy("required"), upstream_task=True, job=True)
JOB_WAIT = Decision(Outcome.WAIT, policy("required"), upstream_task=True, job=True)
JOB_POLL_MS = 2000
JOB_CREATED = UpstreamTaskCreated(LegacyTask("render-1", "working", poll_interval_ms=JOB_POLL_MS), 1_000)
JOB_FOLLOWING: list[Command] = [FollowUpstreamTask(), SetTimer(Timer.POLL, JOB_POLL_MS)]
JOB_RECORD = CreateRecord(TaskStatus.WORKING, {}, 0, job_id="render-1")  # the job's id, no upstream task id
OUT_OF_MEMORY = {"code": -32603, "message": "render-1: out of memory"}


def job_polled(status: str, message: str | None = None, interval_ms: int | None = JOB_POLL_MS) -> UpstreamTaskPolled:
    return UpstreamTaskPolled(LegacyTask("render-1", status, message, poll_interval_ms=interval_ms))


JOB_STARTED: Steps = [
    (Start(), [START_UPSTREAM]),  # the start tool, which answers the job's id
    (JOB_CREATED, [*JOB_FOLLOWING, JOB_RECORD]),
    (Committed("t1"), [Reply(ReplyTask()), HoldSlot(True)]),
]

JOB_PLAYBOOKS = [
    Playbook(
        "a job's id makes the task; each poll of its status tool shows its progress; the result tool's answer "
        "completes it",
        JOB_TASK,
        [
            *JOB_STARTED,
            (TimerFired(Timer.POLL), [PollUpstreamTask()]),
            (job_polled("working", "queued: 0%"), [WriteProgress("queued: 0%"), SetTimer(Timer.POLL, JOB_POLL_MS)]),
            (TimerFired(Timer.POLL), [PollUpstreamTask()]),
            (job_polled("working", "queued: 0%"), [SetTimer(Timer.POLL, JOB_POLL_MS)]),  # nothing new to write
            (TimerFired(Timer.POLL), [PollUpstreamTask()]),
            (job_polled("completed", "100%", None), [WriteProgress("100%")]),  # no more polls
            (Ended(OK), [ClearTimer(Timer.POLL), settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a failed poll is asked again later, at the longer interval it brings",
        JOB_TASK,
        [
            *JOB_STARTED,
            (TimerFired(Timer.POLL), [PollUpstreamTask()]),
            (job_polled("working", None, 4000), [SetTimer(Timer.POLL, 4000)]),
            (TimerFired(Timer.POLL), [PollUpstreamTask()]),
            (job_polled("working", "10%"), [WriteProgress("10%"), SetTimer(Timer.POLL, JOB_POLL_MS)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a job whose state maps to failed fails the task with its error",
        JOB_TASK,
        [
            *JOB_STARTED,
            (job_polled("failed", "50%", None), [WriteProgress("50%")]),
            (
                Ended(UpstreamErrorResponse(OUT_OF_MEMORY)),
                [ClearTimer(Timer.POLL), failed_with(OUT_OF_MEMORY), HoldSlot(False)],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a job whose state maps to cancelled ends the task cancelled by the upstream",
        JOB_TASK,
        [
            *JOB_STARTED,
            (job_polled("cancelled", None, None), []),
            (
                Ended(UpstreamErrorResponse(internal_error("the job was cancelled upstream"))),
                [
                    ClearTimer(Timer.POLL),
                    settled(TaskStatus.CANCELLED, status_message=UPSTREAM_CANCELLED),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a cancelled job task calls the cancel tool; a poll answered after it changes nothing",
        JOB_TASK,
        [
            *JOB_STARTED,
            (Stop("cancelled"), [ClearTimer(Timer.POLL), CancelUpstreamTask("cancelled"), HoldSlot(False)]),
            (job_polled("working", "10%"), []),
            (Ended(OK), []),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a start tool that answers no job id answers the call with that error, and no task is made",
        JOB_TASK,
        [(Start(), [START_UPSTREAM]), (Ended(RPC_ERROR), [Reply(ReplyOutcome(RPC_ERROR))])],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a client without the extension waits for the job's result (poll-to-sync)",
        JOB_WAIT,
        [
            (Start(), [START_UPSTREAM]),
            (JOB_CREATED, [*JOB_FOLLOWING, JOB_RECORD]),
            (Committed("t1"), [HoldSlot(True)]),
            (job_polled("completed", None, None), []),
            (
                Ended(OK),
                [
                    ClearTimer(Timer.POLL),
                    settled(TaskStatus.COMPLETED, result=DONE),
                    Reply(ReplyOutcome(OK)),
                    HoldSlot(False),
                ],
            ),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a shutdown leaves the job running upstream, to be polled again by the next start",
        JOB_TASK,
        [
            *JOB_STARTED,
            (ShutDown("stopping"), [ClearTimer(Timer.POLL), ReleaseCall(keep_session=True), HoldSlot(False)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
]


@pytest.mark.parametrize("playbook", JOB_PLAYBOOKS, ids=[playbook.name for playbook in JOB_PLAYBOOKS])
def test_job_playbook(playbook: Playbook) -> None:
    run_playbook(playbook)


def test_after_a_restart_a_job_is_polled_again_at_once_and_never_started_again() -> None:
    state = CallState(JOB_TASK, {}, GATHER_MS, PARK_TTL_MS, task_id="t1")
    state.upstream_task = UpstreamTask("render-1", poll_interval_ms=JOB_POLL_MS)
    commands = machine.handle(state, Start())
    assert commands == [FollowUpstreamTask(), PollUpstreamTask(), HoldSlot(True)]
    assert not [command for command in commands if isinstance(command, StartCall)]
    assert state.mode is Mode.TASK


# --- the upstream's concurrency cap: a call whose upstream request waits for a slot ------------------------

QUEUE_WAIT_MS = 30_000
BUSY = QueueTimeoutError(2, QUEUE_WAIT_MS, 4)
CANCELLED_BY_CLIENT = "cancelled by the client"

QUEUE_PLAYBOOKS = [
    Playbook(
        "a queued task says its place, and that it started once it got its slot",
        TASK,
        [
            *TASK_STARTED,
            (Queued(3, QUEUE_WAIT_MS, BUSY), [WriteQueue(True, "queued: 3 ahead")]),
            (Admitted(), [WriteQueue(False, STARTED)]),
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a queued task's record says its new place as the queue moves, and nothing when the place is the same",
        TASK,
        [
            *TASK_STARTED,
            (Queued(3, QUEUE_WAIT_MS, BUSY), [WriteQueue(True, "queued: 3 ahead")]),
            (QueueMoved(2), [WriteProgress("queued: 2 ahead")]),
            (QueueMoved(2), []),
            (QueueMoved(0), [WriteProgress("queued: 0 ahead")]),
            (Admitted(), [WriteQueue(False, STARTED)]),
            (QueueMoved(1), []),  # late: it runs already
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
    ),
    Playbook(
        "a window call whose place changes while its record is written says the latest place once it is there",
        WINDOW,
        [
            *WINDOW_STARTED,
            (Queued(3, QUEUE_WAIT_MS, BUSY), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            (QueueMoved(1), []),
            (Committed("t1"), [Reply(ReplyTask()), WriteQueue(True, "queued: 1 ahead"), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a synchronous call's new place writes nothing",
        SYNC,
        [
            *SYNC_STARTED,
            (Queued(1, QUEUE_WAIT_MS, BUSY), [SetTimer(Timer.QUEUE, QUEUE_WAIT_MS)]),
            (QueueMoved(0), []),
            (Admitted(), [ClearTimer(Timer.QUEUE)]),
        ],
        Mode.WAITING,
        finished=False,
    ),
    Playbook(
        "a queued task cancelled leaves the queue and never reaches the upstream",
        TASK,
        [
            *TASK_STARTED,
            (Queued(0, QUEUE_WAIT_MS, BUSY), [WriteQueue(True, "queued: 0 ahead")]),
            (Stop(CANCELLED_BY_CLIENT), [CancelCall(CANCELLED_BY_CLIENT), HoldSlot(False)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a window call that has to wait becomes a task at once, whose record says it is queued",
        WINDOW,
        [
            *WINDOW_STARTED,
            (Queued(1, QUEUE_WAIT_MS, BUSY), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            (Committed("t1"), [Reply(ReplyTask()), WriteQueue(True, "queued: 1 ahead"), HoldSlot(True)]),
            (Admitted(), [WriteQueue(False, STARTED)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a window call admitted while its record is written shows no queue",
        WINDOW,
        [
            *WINDOW_STARTED,
            (Queued(1, QUEUE_WAIT_MS, BUSY), [ClearTimer(Timer.WINDOW), CreateRecord(TaskStatus.WORKING, {}, 0)]),
            (Admitted(), []),
            (Committed("t1"), [Reply(ReplyTask()), HoldSlot(True)]),
        ],
        Mode.TASK,
        finished=False,
    ),
    Playbook(
        "a synchronous call waits its turn within its budget, then runs",
        SYNC,
        [
            *SYNC_STARTED,
            (Queued(1, QUEUE_WAIT_MS, BUSY), [SetTimer(Timer.QUEUE, QUEUE_WAIT_MS)]),
            (Admitted(), [ClearTimer(Timer.QUEUE)]),
            (Ended(OK), [Reply(ReplyOutcome(OK))]),
        ],
        Mode.WAITING,
        finished=True,
    ),
    Playbook(
        "a synchronous call that waits its whole budget gets the 503 and leaves the queue",
        SYNC,
        [
            *SYNC_STARTED,
            (Queued(5, QUEUE_WAIT_MS, BUSY), [SetTimer(Timer.QUEUE, QUEUE_WAIT_MS)]),
            (TimerFired(Timer.QUEUE), [Reply(ReplyError(BUSY)), CancelCall(QUEUE_TIMED_OUT)]),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a synchronous caller that leaves takes its call out of the queue",
        SYNC,
        [
            *SYNC_STARTED,
            (Queued(0, QUEUE_WAIT_MS, BUSY), [SetTimer(Timer.QUEUE, QUEUE_WAIT_MS)]),
            (ClientLeft(), [CancelCall(CLIENT_LEFT)]),
            (TimerFired(Timer.QUEUE), []),
        ],
        Mode.DETACHED,
        finished=True,
    ),
    Playbook(
        "a poll-to-sync task queued keeps its client waiting, with no budget",
        WAIT,
        [
            *WAIT_STARTED,
            (Queued(2, QUEUE_WAIT_MS, BUSY), [WriteQueue(True, "queued: 2 ahead")]),
            (Admitted(), [WriteQueue(False, STARTED)]),
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE), Reply(ReplyOutcome(OK)), HoldSlot(False)]),
        ],
        Mode.WAITING,
        finished=True,
    ),
]


@pytest.mark.parametrize("playbook", QUEUE_PLAYBOOKS, ids=[playbook.name for playbook in QUEUE_PLAYBOOKS])
def test_queue_playbook(playbook: Playbook) -> None:
    run_playbook(playbook)


def test_a_task_queued_at_a_restart_waits_for_its_slot_again() -> None:
    """Recovery starts a task that was still queued when the process stopped (it never reached the upstream) like
    a re-run: it queues again, its record says so, and says when it started."""
    playbook = Playbook(
        "queued at restart",
        TASK,
        [
            (Start(), [StartCall(), HoldSlot(True)]),
            (Queued(4, QUEUE_WAIT_MS, BUSY), [WriteQueue(True, "queued: 4 ahead")]),
            (Admitted(), [WriteQueue(False, STARTED)]),
            (Ended(OK), [settled(TaskStatus.COMPLETED, result=DONE), HoldSlot(False)]),
        ],
        Mode.TASK,
        finished=True,
        task_id="t1",
    )
    run_playbook(playbook)


def test_a_restored_call_takes_up_its_records_task_id_issued_keys_followed_task_and_answerable_questions() -> None:
    """`machine.restored` rebuilds a left-live task's call: its task id and issued-key count from the record,
    the upstream task it follows, and only the questions the record as it was still lets it answer (one with no
    upstream id cannot be delivered upstream and is left out); with no questions the record shows none missing."""
    asked = make_record(
        "t1",
        inputs_issued=3,
        input_requests={"k2": {"method": "elicitation/create"}, "k3": {"method": "sampling/createMessage"}},
        upstream_input_ids={"k2": 7},
    )
    followed = UpstreamTask("up-1")
    fresh = CallState(UP_TASK, EVERY_INPUT, GATHER_MS, PARK_TTL_MS)
    state = machine.restored(fresh, asked, upstream_task=followed, asked=asked)
    assert (state.task_id, state.issued, state.upstream_task) == ("t1", 3, followed)
    assert state.inputs == {"k2": PendingInput(7, "elicitation/create", {"method": "elicitation/create"})}
    assert not state.inputs_written  # the record shows the outstanding questions once the call writes them
    rerun = machine.restored(CallState(TASK, EVERY_INPUT, GATHER_MS, PARK_TTL_MS), make_record("t2", inputs_issued=5))
    assert (rerun.task_id, rerun.issued, rerun.upstream_task, rerun.inputs) == ("t2", 5, None, {})
    assert rerun.inputs_written
