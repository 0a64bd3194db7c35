"""The steps the call machine's handlers share (`__init__.py`, `_following.py`, `_queueing.py`): each changes the
state and returns the commands it takes, so every handler reads as a short sequence of them. SANS-IO, like the
machine: imports the state, the command vocabulary, the input rules and the wire."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.tasks.machine.commands import (
    Answer,
    CallOutcome,
    CancelCall,
    CancelUpstreamTask,
    ClearTimer,
    Command,
    CreateRecord,
    Mode,
    Park,
    Refuse,
    Reply,
    ReplyInputRequired,
    ReplyKind,
    ReplyMissing,
    ReplyOutcome,
    SetTimer,
    Settle,
    StartCall,
    StartUpstreamTask,
    Timer,
    WriteInputs,
)
from proxy.tasks.machine.state import (
    CLIENT_LEFT,
    CallState,
)
from proxy.tasks.machine.upstream_task import UPSTREAM_CANCELLED
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskStatus
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult


def task_settlement(state: CallState, outcome: CallOutcome | None) -> Settle:
    """The call's own task settles from its outcome, or `cancelled` when the upstream cancelled its task."""
    if state.upstream_task is not None and state.upstream_task.cancelled:
        return settlement(None, UPSTREAM_CANCELLED)
    return settlement(outcome)


def settlement(outcome: CallOutcome | None, reason: str = CLIENT_LEFT) -> Settle:
    """How a task settles from its call's outcome: a result (`isError` included) is `completed`; a JSON-RPC
    error, or a lost upstream, is `failed` with that error; no outcome (the call was stopped) is `cancelled`."""
    if outcome is None:
        return Settle(TaskStatus.CANCELLED, status_message=reason)
    if isinstance(outcome, UpstreamResult):
        return Settle(TaskStatus.COMPLETED, result=translate.complete_result("tools/call", outcome.result, None, None))
    error = (
        translate.error_object(outcome.error) if isinstance(outcome, UpstreamErrorResponse) else outcome.error_object()
    )
    return Settle(TaskStatus.FAILED, error=error, status_message=wire_tasks.failure_status_message(error))


def start_call(state: CallState) -> list[Command]:
    state.started = True
    state.running = True
    policy = state.decision.policy
    if state.decision.upstream_task and policy is not None:
        return [StartUpstreamTask(ttl_ms=policy.ttl_ms)]
    return [StartCall()]


def create_record(state: CallState) -> list[Command]:
    """The call becomes a task: the record (with the questions already asked) is committed first."""
    state.committing = True
    state.inputs_written = True
    status = TaskStatus.INPUT_REQUIRED if state.inputs else TaskStatus.WORKING
    upstream_task = state.upstream_task
    if upstream_task is None:
        return [*clear_window(state), CreateRecord(status, state.input_requests(), state.issued)]
    if state.decision.job:  # a legacy job: its id is kept, to poll it again after a restart
        job = CreateRecord(
            status, {}, state.issued, status_message=upstream_task.status_message, job_id=upstream_task.task_id
        )
        return [*clear_window(state), job]
    record = CreateRecord(
        status,
        state.input_requests(),
        state.issued,
        upstream_task_id=upstream_task.task_id,
        upstream_expires_at_ms=upstream_task.expires_at_ms,
        upstream_input_ids=state.upstream_input_ids(),
        status_message=upstream_task.status_message,
    )
    return [*clear_window(state), record]


def set_window(state: CallState, window_ms: int) -> list[Command]:
    state.window_set = True
    return [SetTimer(Timer.WINDOW, window_ms)]


def clear_poll(state: CallState) -> list[Command]:
    return [ClearTimer(Timer.POLL)] if state.upstream_task is not None else []


def clear_window(state: CallState) -> list[Command]:
    if not state.window_set:
        return []
    state.window_set = False
    return [ClearTimer(Timer.WINDOW)]


def gather(state: CallState) -> list[Command]:
    if state.gathering:
        return []
    state.gathering = True
    return [SetTimer(Timer.GATHER, state.gather_ms)]


def publish(state: CallState) -> list[Command]:
    """A gathered batch of questions: the task's record shows them, and a waiting client is asked."""
    state.gathering = False
    commands: list[Command] = []
    if state.task_id is not None and not state.inputs_written and state.running:
        commands += write_inputs(state)
    if state.mode is not Mode.WAITING or not state.client_waiting or not state.running or state.committing:
        return commands
    if state.inputs and not state.decision.asks_by_mrtr:
        if state.decision.upstream_task and state.upstream_task is None:
            return commands  # the record waits for the upstream's task id (`UpstreamTaskCreated`)
        return [*commands, *create_record(state)]  # a window call: its questions go to the task it becomes
    if state.inputs:
        return [*commands, *ask_client(state)]
    if state.missing:
        return [*commands, *release(state, ReplyMissing(merged(state.missing))), *detach(state, CLIENT_LEFT)]
    return commands


def write_inputs(state: CallState) -> list[Command]:
    state.inputs_written = True
    return [WriteInputs(state.input_requests(), state.issued, state.upstream_input_ids())]


def ask_client(state: CallState) -> list[Command]:
    """An MRTR round: the call is parked (limits first) and the client gets every outstanding question."""
    state.round += 1
    state.missing.clear()  # refused upstream; the client is asked what it can answer
    return [*clear_window(state), Park(state.round)]


def deliver(state: CallState, answers: Mapping[str, JSON]) -> list[Command]:
    """Each answer goes upstream as the response to its question (a subset is fine); the call continues."""
    commands: list[Command] = []
    for key, answer in answers.items():
        pending = state.inputs.pop(key, None)
        if pending is not None and state.running:
            commands.append(Answer(pending.upstream_id, answer))
            state.inputs_written = False
    if state.task_id is not None and not state.inputs_written and state.running:
        commands += write_inputs(state)
    return commands


def release(state: CallState, reply: ReplyKind) -> list[Command]:
    """Answer the waiting client. A poll-to-sync task nobody else can read is cancelled when its client is
    answered with anything but its outcome."""
    state.client_waiting = False
    commands: list[Command] = [*clear_window(state), Reply(reply)]
    answered = isinstance(reply, ReplyInputRequired | ReplyOutcome)
    if state.decision.holds_client and state.task_id is not None and state.running and not answered:
        commands.append(settlement(None, CLIENT_LEFT))
        commands += detach(state, CLIENT_LEFT, cancel=True)
    return commands


def detach(state: CallState, reason: str, *, cancel: bool = False) -> list[Command]:
    """Nobody will answer or read this call any more: its open questions are refused, and with `cancel` the
    upstream call is abandoned (otherwise the upstream ends it by itself: a cancel racing that end would break
    an mcp 1.x session)."""
    state.mode = Mode.DETACHED
    commands: list[Command] = [
        *clear_window(state),
        *(Refuse(pending.upstream_id, pending.method, "detached") for pending in state.inputs.values()),
    ]
    state.inputs.clear()
    if cancel:
        commands += abandon(state, reason)
    return commands


def abandon(state: CallState, reason: str) -> list[Command]:
    """Abandon the upstream call: `notifications/cancelled`, or `tasks/cancel` for a task the upstream runs."""
    if not state.running:
        return []
    state.running = False
    if state.upstream_task is not None:
        state.upstream_task.following = False
        return [*clear_poll(state), CancelUpstreamTask(reason)]
    return [CancelCall(reason)]


def end(state: CallState, outcome: CallOutcome) -> list[Command]:
    """The call's upstream request ended with `outcome`: settled, or answered to the waiting client."""
    if not state.running:
        return []  # the call was abandoned already: how its stream ended changes nothing
    state.running = False
    state.outcome = outcome
    state.inputs.clear()  # questions of an ended call can no longer be answered
    commands = [*clear_window(state), *clear_poll(state)]
    if state.committing:
        return commands  # settled once the record is there (`Committed`)
    if state.task_id is not None:
        commands.append(task_settlement(state, outcome))
    if state.mode is Mode.WAITING and state.client_waiting:
        decision = state.decision
        if decision.asks_by_mrtr and state.missing:
            commands += release(state, ReplyMissing(merged(state.missing)))
        elif decision.task_when_done and state.task_id is None:
            commands += create_record(state)
        else:
            commands += release(state, ReplyOutcome(outcome))
    return commands


def final_reply(state: CallState) -> ReplyKind:
    if state.decision.asks_by_mrtr and state.missing:
        return ReplyMissing(merged(state.missing))
    assert state.outcome is not None
    return ReplyOutcome(state.outcome)


def merged(capabilities: list[JSON]) -> JSON:
    required: JSON = {}
    for capability in capabilities:
        for name, sub in capability.items():
            required[name] = {**required.get(name, {}), **sub}
    return required
