"""The transitions of a call whose upstream request waits for a slot (`upstream.max_concurrent_calls`):
`Queued`, `QueueMoved`, `Admitted` and the queue's budget running out (`Timer.QUEUE`). Handlers of the call
machine (`__init__.py`), SANS-IO like it: imports the state, the command vocabulary, the steps and the wire."""

from __future__ import annotations

from proxy.tasks.machine import _steps as steps
from proxy.tasks.machine.commands import (
    Admitted,
    ClearTimer,
    Command,
    Mode,
    Queued,
    QueueMoved,
    ReplyError,
    SetTimer,
    Timer,
    WriteProgress,
    WriteQueue,
)
from proxy.tasks.machine.state import QUEUE_TIMED_OUT, STARTED, CallState
from proxy.wire import tasks as wire_tasks


def queued(state: CallState, event: Queued) -> list[Command]:
    """The upstream request waits for a slot (`upstream.max_concurrent_calls`). A call that may become a task
    (its client declared the extension) becomes one at once, whatever its window, and its record says it is
    queued and its place; a task says so too. A synchronous caller waits its turn up to the queue's budget."""
    if not state.running:
        return []
    state.queued = True
    state.queued_ahead = event.ahead
    if state.task_id is not None:
        return write_queued(state)
    if state.committing or state.mode is not Mode.WAITING or not state.client_waiting:
        return []  # a record being written says it once it is there (`Committed`)
    if state.decision.may_become_task and not state.decision.holds_client:
        return steps.create_record(state)
    state.queue_refusal = event.refusal
    state.queue_timer_set = True
    return [SetTimer(Timer.QUEUE, event.wait_ms)]


def write_queued(state: CallState) -> list[Command]:
    if state.fenced or state.mode is Mode.DETACHED:
        return []
    state.queue_written = True
    return [WriteQueue(True, wire_tasks.queued_status_message(state.queued_ahead))]


def queue_moved(state: CallState, event: QueueMoved) -> list[Command]:
    """The call's place in the queue changed: a task's record says its new place (a record still being
    written says the latest once it is there)."""
    if not state.queued or not state.running or event.ahead == state.queued_ahead:
        return []
    state.queued_ahead = event.ahead
    if not state.queue_written or state.fenced or state.mode is Mode.DETACHED:
        return []
    return [WriteProgress(wire_tasks.queued_status_message(event.ahead))]


def admitted(state: CallState, event: Admitted) -> list[Command]:
    """The queued call got its slot and its request goes upstream now; a task's record says it started."""
    state.queued = False
    commands: list[Command] = []
    if state.queue_timer_set:
        state.queue_timer_set = False
        commands.append(ClearTimer(Timer.QUEUE))
    if state.queue_written and state.running and state.mode is not Mode.DETACHED:
        state.queue_written = False
        commands.append(WriteQueue(False, STARTED))
    return commands


def queue_timed_out(state: CallState) -> list[Command]:
    """A synchronous caller waited its whole budget: 503 with Retry-After, and its call leaves the queue (it
    never reached the upstream)."""
    state.queue_timer_set = False
    refusal = state.queue_refusal
    if not state.queued or not state.client_waiting or state.mode is not Mode.WAITING or refusal is None:
        return []
    return [*steps.release(state, ReplyError(refusal)), *steps.detach(state, QUEUE_TIMED_OUT, cancel=True)]
