"""The transitions of a call the upstream runs as its own 2025-11-25 task (`Decision.upstream_task`): its
`CreateTaskResult` (`UpstreamTaskCreated`), its status from `notifications/tasks/status` or `tasks/get`
(`UpstreamTaskPolled`), and following it again after a restart. Handlers of the call machine (`__init__.py`),
SANS-IO like it: imports the state, the command vocabulary, the steps and the upstream task."""

from __future__ import annotations

from proxy.tasks.machine import _steps as steps
from proxy.tasks.machine.commands import (
    CancelUpstreamTask,
    Command,
    FollowUpstreamTask,
    Mode,
    PollUpstreamTask,
    ReleaseCall,
    SetTimer,
    Timer,
    UpstreamTaskCreated,
    UpstreamTaskPolled,
    WriteProgress,
)
from proxy.tasks.machine.state import CLIENT_LEFT, CallState
from proxy.tasks.machine.upstream_task import UpstreamTask
from proxy.wire.legacy_tasks import LegacyTask


def follow_again(state: CallState) -> list[Command]:
    """After a restart: the upstream's task, on its stored session, is followed again and asked for its status
    at once; the questions it asked before are shown again (their upstream ids were stored)."""
    assert state.upstream_task is not None
    state.started = True
    state.running = True
    state.upstream_task.following = True
    commands: list[Command] = [FollowUpstreamTask(), PollUpstreamTask()]
    if state.inputs:
        commands += steps.write_inputs(state)
    return commands


def upstream_task_created(state: CallState, event: UpstreamTaskCreated) -> list[Command]:
    """The upstream runs the call as its own task: follow it (its tasks/result, and tasks/get when it is silent).
    A task at once (or poll-to-sync) gets its record now; a window starts now; questions already gathered for a
    window call make it a task now."""
    upstream_task = state.upstream_task = UpstreamTask.created(event.task, event.at_ms)
    if not state.running:  # abandoned while the upstream was creating it: nobody will follow it
        upstream_task.following = False
        return [CancelUpstreamTask(CLIENT_LEFT)]
    commands: list[Command] = [FollowUpstreamTask(), SetTimer(Timer.POLL, upstream_task.poll_interval_ms)]
    if state.mode is not Mode.WAITING or not state.client_waiting or state.committing or state.task_id is not None:
        return commands
    decision = state.decision
    if decision.task_first or (state.inputs and not decision.asks_by_mrtr and not state.gathering):
        return [*commands, *steps.create_record(state)]
    if decision.window_ms is not None:
        commands += steps.set_window(state, decision.window_ms)
    return commands


def upstream_task_polled(state: CallState, event: UpstreamTaskPolled) -> list[Command]:
    upstream_task = state.upstream_task
    if upstream_task is None or not state.running:
        return []
    if not event.known:  # the upstream dropped the task (or its whole session)
        if upstream_task.final is not None:
            return steps.end(state, upstream_task.forgotten())  # tasks/result answered: nothing left to stop
        upstream_task.following = False
        return [ReleaseCall(), *steps.end(state, upstream_task.forgotten())]
    if event.task is None:  # not reachable this time: ask again later
        return [SetTimer(Timer.POLL, upstream_task.poll_interval_ms)]
    return upstream_status(state, event.task)


def upstream_status(state: CallState, task: LegacyTask) -> list[Command]:
    """A status report of the upstream task: a new statusMessage reaches the record; the outcome still comes
    from tasks/result (unless it already came and waited for this status). Silence for the upstream's
    pollInterval is met with tasks/get."""
    upstream_task = state.upstream_task
    if upstream_task is None or not state.running:
        return []
    changed = upstream_task.seen(task)
    if upstream_task.final is not None:
        outcome = upstream_task.outcome(upstream_task.final)
        if outcome is not None:
            upstream_task.final = None
            return steps.end(state, outcome)
        return [SetTimer(Timer.POLL, upstream_task.poll_interval_ms)]
    commands: list[Command] = []
    if changed and state.task_id is not None and state.mode is not Mode.DETACHED and upstream_task.status_message:
        commands.append(WriteProgress(upstream_task.status_message))
    if not task.terminal:
        commands.append(SetTimer(Timer.POLL, upstream_task.poll_interval_ms))
    return commands
