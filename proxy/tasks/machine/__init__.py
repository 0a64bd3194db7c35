"""The lifecycle of one call, as a sans-IO state machine: `handle(state, event) -> [command]`, one handler per
event in `_HANDLERS`. Sync calls, windows, tasks, poll-to-sync, MRTR rounds, upstream-run tasks and jobs,
queued calls, other replicas and a lost lease all change the call's mode here, and only here. No asyncio, no
I/O, no clock: times arrive with the events."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar, get_args

from proxy.tasks.machine import _following as following
from proxy.tasks.machine import _queueing as queueing
from proxy.tasks.machine import _steps as steps
from proxy.tasks.machine import inputs
from proxy.tasks.machine.commands import (
    STORE_WRITES,
    Admitted,
    Answered,
    Asked,
    ClearTimer,
    ClientLeft,
    Command,
    CommitRefused,
    Committed,
    Ended,
    Event,
    HoldSlot,
    LeaseLost,
    Mode,
    Notified,
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
    ReplyError,
    ReplyInputRequired,
    ReplyOutcome,
    ReplyTask,
    Resumed,
    SetTimer,
    Settle,
    ShutDown,
    Start,
    Stop,
    Timer,
    TimerFired,
    Unpark,
    UpstreamTaskCreated,
    UpstreamTaskPolled,
    WriteProgress,
)
from proxy.tasks.machine.inputs import PendingInput
from proxy.tasks.machine.state import (
    CLIENT_LEFT,
    LEASE_LOST,
    MAX_OUTSTANDING_INPUTS,
    PARKED_EXPIRED,
    PROGRESS_WRITE_INTERVAL_MS,
    RECLAIMED,
    TASK_REFUSED,
    CallState,
)
from proxy.tasks.machine.upstream_task import UpstreamTask
from proxy.wire import legacy_tasks, translate
from proxy.wire import tasks as wire_tasks
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord
from proxy.wire.upstream_events import UpstreamErrorResponse

# A call is a `tools/call`, `prompts/get` or `resources/read` whose upstream request runs in the background, so that
# it can outlive the HTTP request that started it: a synchronous call, a sync window that turns into a task, a task, a
# poll-to-sync call, or a synchronous call parked between MRTR rounds. Every change of mode happens here, from the
# policy's `Decision`; the executor (`executor.py`) carries out the commands and feeds back what came of them
# (`Committed`, `Parked`, ...). No asyncio, no I/O, no clock: times arrive with the events. With several replicas on
# one store, a task's call runs on the replica that owns it; what other replicas learn reaches it as events too
# (`RemoteCancel`, `RemoteAnswers`), and so does the loss of its lease (`LeaseLost`).
#
# When the upstream runs the call as its own 2025-11-25 task (`Decision.upstream_task`), the call follows that task
# instead of a held request: the `tools/call` carries `params.task`, the upstream's `CreateTaskResult`
# (`UpstreamTaskCreated`) makes the proxy's record (with the upstream's id, within its ttl), its `tasks/result` stream
# brings the questions (`Asked`) and the outcome (`Ended`), its status comes from `notifications/tasks/status` or,
# when it is silent for its pollInterval, from `tasks/get` (`UpstreamTaskPolled`); a cancel is `tasks/cancel`, and a
# shutdown leaves it running for the next start.
#
# With a concurrency cap (`upstream.max_concurrent_calls`) the upstream request may wait for a slot (`Queued`): a call
# that may become a task becomes one at once and its record says it is queued; a synchronous call waits up to the
# queue's budget (`Timer.QUEUE`), then gets the queue's refusal (503); `QueueMoved` brings its new place (a task's
# record says it), and `Admitted` says it goes.
#
# The state it keeps is `state.py`; the steps its handlers share are `_steps.py`; the handlers of a call that follows
# the upstream's task are `_following.py`, those of a queued call `_queueing.py`. Imports those, the policy, the
# input-bridging rules (`inputs.py`), the upstream task (`upstream_task.py`), the upstream event types and the wire;
# nothing that does I/O.


def handle(state: CallState, event: Event) -> list[Command]:
    """Feed one event to the call; returns what the executor must carry out, in order."""
    commands = _HANDLERS[type(event)](state, event)
    if state.fenced:  # whatever a later event would write, a call that lost its lease writes nothing
        commands = [command for command in commands if not isinstance(command, STORE_WRITES)]
    holds = state.task_id is not None and state.running and not state.inputs and state.mode is not Mode.DETACHED
    if holds != state.holds_slot:  # a task holds a `max_running` slot while its call runs and asks nothing
        state.holds_slot = holds
        commands.append(HoldSlot(holds))
    return commands


def answers(state: CallState, responses: Mapping[str, Any]) -> dict[str, JSON]:
    """The client's answers to the call's outstanding questions, checked before any is delivered (-32602 names
    the key); keys that are not outstanding are ignored."""
    return inputs.check_answers(state.questions(), responses)


def resumable(state: CallState, round_: int) -> bool:
    """May an MRTR retry carrying the requestState of round `round_` take this call? (Exactly once.)"""
    return state.mode is Mode.PARKED and state.round == round_


def restored(
    fresh: CallState,
    record: TaskRecord,
    *,
    upstream_task: UpstreamTask | None = None,
    asked: TaskRecord | None = None,
) -> CallState:
    """The state of a call that takes up a task a previous process (or a dead replica) left live, from a
    `fresh` state of its decision and the task's `record`: the task id, the question keys issued so far (never
    reused), the upstream's task or job it follows again, and the questions still answerable as `asked` (the
    record as it was) shows them. The only way a call's state is rebuilt from a record."""
    fresh.task_id = record.task_id
    fresh.issued = record.inputs_issued
    fresh.upstream_task = upstream_task
    if asked is not None:
        for key, request in asked.input_requests.items():
            upstream_id = asked.upstream_input_ids.get(key)
            if isinstance(request, dict) and isinstance(upstream_id, int | str):
                fresh.inputs[key] = PendingInput(upstream_id, str(request.get("method")), request)
        fresh.inputs_written = not fresh.inputs
    return fresh


def finished(state: CallState) -> bool:
    """Nothing more can happen to the call: the executor may forget it."""
    return not state.running and not state.committing and state.mode is not Mode.PARKED and not state.client_waiting


# --- the handlers, one per event ---------------------------------------------------------------------------


def _start(state: CallState, event: Start) -> list[Command]:
    if state.task_id is not None:  # a task re-run (or, if the upstream runs it, resumed) after a restart
        state.mode = Mode.TASK
        state.client_waiting = False
        if state.upstream_task is not None:
            return following.follow_again(state)
        return steps.start_call(state)
    if state.decision.upstream_task:
        return steps.start_call(state)  # the record, or the window, once the upstream said it runs the task
    if state.decision.task_first:
        return steps.create_record(state)
    commands = steps.start_call(state)
    window_ms = state.decision.window_ms
    if window_ms is not None:
        commands += steps.set_window(state, window_ms)
    return commands


def _asked(state: CallState, event: Asked) -> list[Command]:
    """An upstream question mid-call. One the client declared gets a fresh key and waits in the batch being
    gathered; anything else is answered at once, so the upstream never hangs (an elicitation is declined)."""
    question = event.question
    if question.method not in translate.INPUT_METHODS:
        return [Refuse(question.id, question.method, "not_input")]
    if not state.running:
        return [Refuse(question.id, question.method, "ended")]
    if state.mode is Mode.DETACHED:
        return [Refuse(question.id, question.method, "detached")]
    if not inputs.declared(state.capabilities, question.method, question.params):
        commands: list[Command] = [Refuse(question.id, question.method, "undeclared")]
        upstream_task = state.decision.upstream_task
        if state.mode is Mode.WAITING and state.client_waiting and state.decision.asks_by_mrtr and not upstream_task:
            # The waiting client gets -32021 naming what it lacks, unless it can answer something else. (A task
            # the upstream runs goes on with the refusal, as any task does.)
            state.missing.append(translate.required_capability(question.method, question.params))
            commands += steps.gather(state)
        return commands
    if len(state.inputs) >= MAX_OUTSTANDING_INPUTS:
        return [Refuse(question.id, question.method, "too_many")]
    state.issued += 1
    key = inputs.mint_key(question.method, state.issued)
    state.inputs[key] = PendingInput(
        question.id, question.method, inputs.input_request(question.method, question.params)
    )
    state.inputs_written = False
    return steps.gather(state)


def _notified(state: CallState, event: Notified) -> list[Command]:
    """Progress and log messages reach a waiting client that asked for them; a task's progress becomes its
    statusMessage (at most every PROGRESS_WRITE_INTERVAL_MS: the next one catches up). The status of the
    upstream task the call follows comes from its `notifications/tasks/status`."""
    if state.upstream_task is not None:
        reported = legacy_tasks.status_notification(event.message, state.upstream_task.task_id)
        if reported is not None:
            return following.upstream_status(state, reported)
    if event.message.get("method") == legacy_tasks.STATUS_NOTIFICATION:
        return []  # about a task this call does not follow (or not yet)
    if state.mode is Mode.WAITING and state.client_waiting:
        relayed = translate.relay_notification(event.message, state.progress_token, state.log_level)
        return [Relay(relayed)] if relayed is not None else []
    if state.mode is not Mode.TASK or state.task_id is None or event.message.get("method") != "notifications/progress":
        return []
    if state.upstream_task is not None and state.upstream_task.status_message is not None:
        return []  # the upstream's own statusMessage says more than its progress
    text = wire_tasks.progress_status_message(event.message.get("params"))
    if text is None or event.at_ms - state.progress_written_at_ms < PROGRESS_WRITE_INTERVAL_MS:
        return []
    state.progress_written_at_ms = event.at_ms
    return [WriteProgress(text)]


def _ended(state: CallState, event: Ended) -> list[Command]:
    upstream_task = state.upstream_task
    if upstream_task is None or not upstream_task.following or not state.running:
        return steps.end(state, event.outcome)
    upstream_task.following = False  # tasks/result answered: the upstream's task is over
    outcome = upstream_task.outcome(event.outcome)
    if outcome is None:  # an answer that is no tool result, and the task's status is not known yet
        upstream_task.final = event.outcome
        return [PollUpstreamTask()]
    return steps.end(state, outcome)


def _timer_fired(state: CallState, event: TimerFired) -> list[Command]:
    if event.timer is Timer.GATHER:
        return steps.publish(state)
    if event.timer is Timer.WINDOW:
        state.window_set = False
        if state.mode is Mode.WAITING and state.client_waiting and state.running and not state.committing:
            return steps.create_record(state)  # still running after the window: the same call continues as a task
        return []
    if event.timer is Timer.POLL:
        return [PollUpstreamTask()] if state.running and state.upstream_task is not None else []
    if event.timer is Timer.QUEUE:
        return queueing.queue_timed_out(state)
    return _give_up_parked(state, PARKED_EXPIRED)  # Timer.PARK: nobody resumed the parked call in time


def _reclaimed(state: CallState, event: Reclaimed) -> list[Command]:
    return _give_up_parked(state, RECLAIMED)


def _give_up_parked(state: CallState, reason: str) -> list[Command]:
    """A parked call ends as if nobody had retried: its requestState is refused from now on."""
    if state.mode is not Mode.PARKED:
        return []
    state.mode = Mode.DETACHED
    commands: list[Command] = [Unpark()]
    if state.task_id is not None and state.running:
        commands.append(steps.settlement(None, reason))
    return [*commands, *steps.abandon(state, reason)]


def _committed(state: CallState, event: Committed) -> list[Command]:
    state.committing = False
    state.task_id = event.task_id
    if state.fenced:
        return []  # the lease was lost while the record was written: the call never starts here
    if state.decision.holds_client and not state.client_waiting:
        # The poll-to-sync client left while its internal task was stored: nobody can read the task.
        state.mode = Mode.DETACHED
        return [steps.settlement(None, CLIENT_LEFT), *steps.abandon(state, CLIENT_LEFT)]
    commands: list[Command] = []
    if not state.started:
        commands += steps.start_call(state)
    if state.mode is Mode.WAITING and not state.decision.holds_client:
        state.mode = Mode.TASK  # no request-scoped notifications once the call is a task
        if state.client_waiting:
            commands += steps.release(state, ReplyTask())
    if not state.inputs_written and state.running:
        commands += steps.write_inputs(state)
    if state.queued and not state.queue_written and state.running:
        commands += queueing.write_queued(state)
    if state.started and not state.running and state.mode is not Mode.DETACHED:
        commands.append(
            steps.task_settlement(state, state.outcome)
        )  # the call ended (or was stopped) while it was written
    return commands


def _commit_refused(state: CallState, event: CommitRefused) -> list[Command]:
    state.committing = False
    commands: list[Command] = []
    if state.client_waiting:
        commands += steps.release(state, ReplyError(event.error))
    return [*commands, *steps.detach(state, TASK_REFUSED, cancel=True)]


def _parked(state: CallState, event: Parked) -> list[Command]:
    commands = steps.release(state, ReplyInputRequired(state.input_requests(), state.round))
    state.mode = Mode.PARKED  # after the release: parking is not leaving
    return [*commands, SetTimer(Timer.PARK, state.park_ttl_ms)]


def _park_refused(state: CallState, event: ParkRefused) -> list[Command]:
    return [*steps.release(state, ReplyError(event.error)), *steps.detach(state, CLIENT_LEFT)]


def _resumed(state: CallState, event: Resumed) -> list[Command]:
    state.mode = Mode.WAITING
    state.client_waiting = True
    state.progress_token = event.progress_token
    state.log_level = event.log_level
    commands: list[Command] = [Unpark(), ClearTimer(Timer.PARK), *steps.deliver(state, event.answers)]
    if not state.running:
        commands += steps.release(state, steps.final_reply(state))
    elif state.inputs:  # questions a retry left unanswered are asked again
        commands += steps.ask_client(state)
    elif state.decision.window_ms is not None:
        commands += steps.set_window(state, state.decision.window_ms)
    return commands


def _answered(state: CallState, event: Answered) -> list[Command]:
    if state.mode is not Mode.TASK or not state.running:
        return []
    return steps.deliver(state, event.answers)


def _client_left(state: CallState, event: ClientLeft) -> list[Command]:
    was_waiting = state.client_waiting
    state.client_waiting = False
    if not was_waiting or state.mode is not Mode.WAITING or state.committing or not state.running:
        return []  # a task being stored runs on (its id was just not delivered); an ended call has nothing to stop
    commands: list[Command] = []
    if state.task_id is not None:
        commands.append(steps.settlement(None, CLIENT_LEFT))
    return [*commands, *steps.detach(state, CLIENT_LEFT, cancel=True)]


def _stop(state: CallState, event: Stop) -> list[Command]:
    commands: list[Command] = []
    if event.status is not None and state.task_id is not None and state.running:
        commands.append(Settle(event.status, error=event.error, status_message=event.reason))
    if state.mode is Mode.PARKED:
        commands += [Unpark(), ClearTimer(Timer.PARK)]
    if state.client_waiting:
        error = event.error if event.error is not None else wire_tasks.internal_error(event.reason)
        commands += steps.release(state, ReplyOutcome(UpstreamErrorResponse(error)))
    state.mode = Mode.DETACHED
    state.inputs.clear()
    return [*commands, *steps.abandon(state, event.reason)]


def _shut_down(state: CallState, event: ShutDown) -> list[Command]:
    """A task the upstream runs itself keeps running there: the proxy only stops following it, and the next
    start follows it again on the same upstream session (the record keeps the questions and their ids).
    Anything else stops as with `Stop`; so does a poll-to-sync task, which nobody could read after a restart."""
    upstream_task = state.upstream_task
    if upstream_task is None or state.task_id is None or not state.running or state.decision.holds_client:
        return _stop(state, Stop(event.reason))
    state.running = False
    upstream_task.following = False
    state.mode = Mode.DETACHED
    state.inputs.clear()
    return [*steps.clear_poll(state), ReleaseCall(keep_session=True)]


def _remote_cancel(state: CallState, event: RemoteCancel) -> list[Command]:
    """Settled by another replica: a call still running (or parked, or with a client waiting) is stopped, as a
    local cancel stops it; one that has ended already has nothing to stop."""
    if not state.running and state.mode is not Mode.PARKED and not state.client_waiting:
        return []
    return _stop(state, Stop(event.reason, event.error))


def _remote_answers(state: CallState, event: RemoteAnswers) -> list[Command]:
    """Answers relayed from another replica, for the questions still outstanding here. One that does not fit
    its question is dropped and the question stays open (its client was acked by the other replica, which
    checked it against the same question: this happens only if the question changed meanwhile)."""
    if state.mode is not Mode.TASK or not state.running:
        return []
    return steps.deliver(state, inputs.check_answers(state.questions(), event.responses, drop_invalid=True))


def _lease_lost(state: CallState, event: LeaseLost) -> list[Command]:
    """Another replica may own the task now: stop as a shutdown does (a task the upstream runs itself keeps
    running there, to be followed again if it is still this replica's), and never write its record again."""
    if state.fenced:
        return []
    state.fenced = True
    return _shut_down(state, ShutDown(LEASE_LOST))


# The handler table: one row per event, the type checker tying each handler to the event it takes; at import,
# every event of `Event` must have exactly one.
_E = TypeVar("_E")
_HANDLERS: Final[dict[type[Any], Callable[[CallState, Any], list[Command]]]] = {}


def _on(kind: type[_E], handler: Callable[[CallState, _E], list[Command]]) -> None:
    if kind in _HANDLERS:
        raise TypeError(f"a second handler for {kind.__name__}")
    _HANDLERS[kind] = handler


_on(Start, _start)
_on(Asked, _asked)
_on(Notified, _notified)
_on(Ended, _ended)
_on(TimerFired, _timer_fired)
_on(Committed, _committed)
_on(CommitRefused, _commit_refused)
_on(Parked, _parked)
_on(ParkRefused, _park_refused)
_on(Resumed, _resumed)
_on(Answered, _answered)
_on(ClientLeft, _client_left)
_on(Stop, _stop)
_on(ShutDown, _shut_down)
_on(UpstreamTaskCreated, following.upstream_task_created)
_on(UpstreamTaskPolled, following.upstream_task_polled)
_on(RemoteCancel, _remote_cancel)
_on(RemoteAnswers, _remote_answers)
_on(LeaseLost, _lease_lost)
_on(Queued, queueing.queued)
_on(QueueMoved, queueing.queue_moved)
_on(Admitted, queueing.admitted)
_on(Reclaimed, _reclaimed)

if _missing := set(get_args(Event)) - set(_HANDLERS):
    raise TypeError(f"no handler for {sorted(kind.__name__ for kind in _missing)}")
