"""What the call machine and the executor say to each other: the events that go into `handle` and the
commands that come out, some answered by an event the executor feeds back (`CreateRecord` → `Committed`).
Plain frozen data; imports only the upstream event types, errors and the wire."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from proxy.errors import ProxyError
from proxy.wire.jsonrpc import JSON
from proxy.wire.legacy_tasks import LegacyTask
from proxy.wire.tasks import TaskRecord, TaskStatus
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult, UpstreamServerRequest

# Events go into `machine.handle`; commands come out, and the executor carries them out in order. Some commands are
# answered by an event it feeds back (`CreateRecord` → `Committed` / `CommitRefused`, `Park` → `Parked` /
# `ParkRefused`, `PollUpstreamTask` → `UpstreamTaskPolled`). `Reply` answers the request a client is waiting on. A
# call the upstream runs as its own 2025-11-25 task (`StartUpstreamTask`) follows that task instead of a held request:
# `UpstreamTaskCreated`, then `FollowUpstreamTask` (its `tasks/result` stream brings the questions and the outcome),
# `PollUpstreamTask` (`tasks/get`) and `CancelUpstreamTask`. Three events come from other replicas of a shared store
# (`RemoteCancel`, `RemoteAnswers`) or from losing the right to write (`LeaseLost`). With
# `upstream.max_concurrent_calls`, a call whose upstream request waits for a slot learns so (`Queued`, its place;
# `QueueMoved`, a new place) and when it goes (`Admitted`); a task's record says it is queued (`WriteQueue`). Plain
# frozen data; imports only the upstream event types, errors and the wire.

# How the upstream call ended: its result, its JSON-RPC error, or lost (the ProxyError says how).
CallOutcome = UpstreamResult | UpstreamErrorResponse | ProxyError


class Mode(StrEnum):
    WAITING = "waiting"  # a client's request waits for the call (sync, window, poll-to-sync, an MRTR round)
    PARKED = "parked"  # an InputRequiredResult went out; the call waits for the client's retry
    TASK = "task"  # a task the client polls; questions go to its record as `inputRequests`
    DETACHED = "detached"  # nobody reads the outcome any more; further questions are refused


class Timer(StrEnum):
    GATHER = "gather"  # questions asked together (within `inputs.gather_ms`) reach the client together
    WINDOW = "window"  # the sync window: a call still running then becomes a task
    PARK = "park"  # a parked call nobody resumes in time is cancelled
    POLL = "poll"  # an upstream-owned task silent for its pollInterval is asked for its status (tasks/get)
    QUEUE = "queue"  # a synchronous call queued for an upstream slot waits this long, then gets 503


# --- events ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """The call begins (a new request, or a task re-run after a restart when `task_id` is set)."""


@dataclass(frozen=True, slots=True)
class Asked:
    question: UpstreamServerRequest


@dataclass(frozen=True, slots=True)
class Notified:
    message: JSON
    at_ms: float  # monotonic


@dataclass(frozen=True, slots=True)
class Ended:
    outcome: CallOutcome


@dataclass(frozen=True, slots=True)
class TimerFired:
    timer: Timer


@dataclass(frozen=True, slots=True)
class Committed:
    task_id: str


@dataclass(frozen=True, slots=True)
class CommitRefused:
    error: ProxyError


@dataclass(frozen=True, slots=True)
class Parked:
    """The parked call was registered; its requestState can go out."""


@dataclass(frozen=True, slots=True)
class ParkRefused:
    error: ProxyError


@dataclass(frozen=True, slots=True)
class Resumed:
    """An MRTR retry took the parked call, with answers already checked by `answers()`."""

    answers: Mapping[str, JSON]
    progress_token: str | int | None = None
    log_level: str | None = None


@dataclass(frozen=True, slots=True)
class Answered:
    """`tasks/update`: answers already checked by `answers()`."""

    answers: Mapping[str, JSON]


@dataclass(frozen=True, slots=True)
class ClientLeft:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the call: with `status`, its task settles so first, under the lease's fence (a client's
    `tasks/cancel`, a task seen past its TTL); without, it was settled already (the TTL sweep)."""

    reason: str
    error: JSON | None = None  # what a client still waiting for the task is told (and a failed task's error)
    status: TaskStatus | None = None  # how the call's task settles, if it is still live here


@dataclass(frozen=True, slots=True)
class ShutDown:
    """The proxy stops. Like `Stop`, except that a task the upstream runs itself is left running there: the
    next start follows it again."""

    reason: str


@dataclass(frozen=True, slots=True)
class UpstreamTaskCreated:
    """A task-augmented `tools/call` was answered with the upstream's `CreateTaskResult`."""

    task: LegacyTask
    at_ms: int  # wall clock (epoch milliseconds): the upstream's ttl counts from about now


@dataclass(frozen=True, slots=True)
class UpstreamTaskPolled:
    """The upstream's `tasks/get` answer: the task; None when the upstream could not be asked this time; with
    `known` False the upstream does not know the task (or its session) any more."""

    task: LegacyTask | None
    known: bool = True


@dataclass(frozen=True, slots=True)
class RemoteCancel:
    """The task was settled by another replica (a client's `tasks/cancel` there, or its TTL sweep): the call
    stops and the upstream is told. Nothing is written: the record is settled already."""

    reason: str
    error: JSON | None = None  # what a client still waiting for the task is told


@dataclass(frozen=True, slots=True)
class RemoteAnswers:
    """`tasks/update` answers that arrived on another replica (checked there against the questions the record
    showed), relayed over the change feed. They are checked again against the questions still outstanding
    here: a key answered meanwhile, or asked no more, is ignored (that client was acked already)."""

    responses: Mapping[str, JSON]


@dataclass(frozen=True, slots=True)
class LeaseLost:
    """This replica may no longer write the task (its lease lapsed, or another replica took the task over):
    the call stops, the upstream is told, and nothing more is written for it."""


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """The pool took back the upstream session of a call parked for an MRTR retry (bounded sessions ran out):
    the call ends as if nobody had retried in time."""


@dataclass(frozen=True, slots=True)
class Queued:
    """The call's upstream request waits for a slot (`upstream.max_concurrent_calls`): `ahead` calls are before
    it in the fair queue. A synchronous caller waits up to `wait_ms`, then gets `refusal` (503 with the
    queue's own estimate of when to come back)."""

    ahead: int
    wait_ms: int
    refusal: ProxyError


@dataclass(frozen=True, slots=True)
class QueueMoved:
    """The queue moved while the call waits: `ahead` calls are before it now."""

    ahead: int


@dataclass(frozen=True, slots=True)
class Admitted:
    """The queued call got its upstream slot: its request is being sent."""


Event = (
    Start
    | Asked
    | Notified
    | Ended
    | TimerFired
    | Committed
    | CommitRefused
    | Parked
    | ParkRefused
    | Resumed
    | Answered
    | ClientLeft
    | Stop
    | ShutDown
    | UpstreamTaskCreated
    | UpstreamTaskPolled
    | RemoteCancel
    | RemoteAnswers
    | LeaseLost
    | Reclaimed
    | Queued
    | QueueMoved
    | Admitted
)

# --- commands ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartCall:
    """Send the upstream request and hold it open until its answer (on a leased session when the client can
    answer questions)."""


@dataclass(frozen=True, slots=True)
class StartUpstreamTask:
    """Send the upstream request with `params.task` (kept `ttl_ms`): the upstream runs it as its own task (a
    `jobs:` call starts its job instead)."""

    ttl_ms: int | None = None


@dataclass(frozen=True, slots=True)
class CreateRecord:
    """Commit the task record (limits first); answered with `Committed` or `CommitRefused`. For a task the
    upstream runs itself, its id (the session it lives in is the call's), when the upstream drops it (the
    record's ttl never goes beyond), the upstream ids of the questions, and its latest statusMessage."""

    status: TaskStatus
    input_requests: JSON
    issued: int
    upstream_task_id: str | None = None
    upstream_expires_at_ms: int | None = None
    upstream_input_ids: JSON | None = None
    status_message: str | None = None
    job_id: str | None = None  # a legacy job's id (`jobs:`), in place of an upstream task id


@dataclass(frozen=True, slots=True)
class WriteInputs:
    """The record shows these outstanding questions (`input_required`), or none (`working`); for a task the
    upstream runs itself, also their upstream ids (answers can reach the upstream after a restart)."""

    input_requests: JSON
    issued: int
    upstream_input_ids: JSON | None = None


@dataclass(frozen=True, slots=True)
class WriteProgress:
    status_message: str


@dataclass(frozen=True, slots=True)
class Settle:
    """Settle the task record; the first settlement wins."""

    status: TaskStatus
    result: JSON | None = None
    error: JSON | None = None
    status_message: str | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """Send an answer upstream as the JSON-RPC response to its question."""

    upstream_id: int | str
    result: JSON


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer a question no client will see (`upstream.events.refusal`), so the upstream never waits."""

    upstream_id: int | str
    method: str
    reason: str  # for the log: undeclared, detached, too_many, not_input, ended


@dataclass(frozen=True, slots=True)
class CancelCall:
    """Abandon the upstream call: `notifications/cancelled` upstream. Nothing is fed back."""

    reason: str


@dataclass(frozen=True, slots=True)
class FollowUpstreamTask:
    """Follow the upstream's task on the call's session: one `tasks/result` at a time (it streams the task's
    questions, then its outcome), opened again when it drops; a resumed task adopts its stored session."""


@dataclass(frozen=True, slots=True)
class PollUpstreamTask:
    """Ask the upstream for the task's status (`tasks/get`); answered with `UpstreamTaskPolled`."""


@dataclass(frozen=True, slots=True)
class CancelUpstreamTask:
    """`tasks/cancel` upstream, then stop following the task. Nothing is fed back."""

    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseCall:
    """Stop following the upstream's task without cancelling it: it is over for the proxy (the upstream lost
    it), or, with `keep_session`, the proxy shuts down and the upstream keeps the session and the task for the
    next start (the session is not ended with DELETE)."""

    keep_session: bool = False


@dataclass(frozen=True, slots=True)
class Relay:
    """A notification for the waiting client's stream (already filtered and re-tagged)."""

    message: JSON


@dataclass(frozen=True, slots=True)
class SetTimer:
    timer: Timer
    delay_ms: int


@dataclass(frozen=True, slots=True)
class ClearTimer:
    timer: Timer


@dataclass(frozen=True, slots=True)
class Park:
    """Register the call as parked for round `round` (limits first); answered with `Parked` or `ParkRefused`."""

    round: int


@dataclass(frozen=True, slots=True)
class Unpark:
    pass


@dataclass(frozen=True, slots=True)
class HoldSlot:
    hold: bool


@dataclass(frozen=True, slots=True)
class WriteQueue:
    """The task record says its call waits for an upstream slot (`queued`, its place in `status_message`), or
    that it got one: a task still queued when the process stopped never reached the upstream, and runs at the
    next start whatever its `on_restart`."""

    queued: bool
    status_message: str


# What the waiting client's request is answered with:
@dataclass(frozen=True, slots=True)
class ReplyOutcome:
    outcome: CallOutcome


@dataclass(frozen=True, slots=True)
class ReplyTask:
    """The `CreateTaskResult` of the record just committed. The machine leaves `record` out; the client side
    puts it in (paced) as the reply goes out, so nobody waiting reads it back."""

    record: TaskRecord | None = None


@dataclass(frozen=True, slots=True)
class ReplyInputRequired:
    """An MRTR `InputRequiredResult` with these questions and the requestState of round `round`."""

    input_requests: JSON
    round: int


@dataclass(frozen=True, slots=True)
class ReplyMissing:
    """-32021: the upstream asked what the client did not declare, and nothing the client could answer."""

    required: JSON


@dataclass(frozen=True, slots=True)
class ReplyError:
    error: ProxyError


ReplyKind = ReplyOutcome | ReplyTask | ReplyInputRequired | ReplyMissing | ReplyError


@dataclass(frozen=True, slots=True)
class Reply:
    reply: ReplyKind


# The commands that write the task record: none comes out of a call that lost its lease.
STORE_WRITES: Final = (CreateRecord, WriteInputs, WriteProgress, Settle, WriteQueue)

Command = (
    StartCall
    | StartUpstreamTask
    | CreateRecord
    | WriteInputs
    | WriteProgress
    | Settle
    | Answer
    | Refuse
    | CancelCall
    | Relay
    | SetTimer
    | ClearTimer
    | Park
    | Unpark
    | HoldSlot
    | Reply
    | FollowUpstreamTask
    | PollUpstreamTask
    | CancelUpstreamTask
    | ReleaseCall
    | WriteQueue
)
