"""The executor's observers: what a call's events and commands tell the audit log and the trace, said after the
machine decided, never from inside an effect. Names, methods and counts only: never arguments, answers or
results. Imports the audit sink, tracing, the command vocabulary and the live call."""

from __future__ import annotations

import time

from proxy.observe import tracing
from proxy.observe.audit import AuditLog, subject
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import (
    Answer,
    Asked,
    Command,
    Committed,
    Event,
    Parked,
    Refuse,
    RemoteCancel,
    Resumed,
    Settle,
    Stop,
    WriteInputs,
)
from proxy.wire.tasks import TaskStatus
from proxy.wire.upstream_events import refusal


class AuditTrail:
    """The audit lines of task transitions: a task created, its questions outstanding or answered, settled, or
    stopped from outside (a cancel, its TTL); each names the task, its tool, its principal (JWT subject, else
    hash) and the time since the call began."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def __call__(self, call: LiveCall, event: Event, commands: list[Command]) -> None:
        if isinstance(event, Committed):
            self._line(call, event.task_id, "created", None)
        elif isinstance(event, Stop | RemoteCancel) and call.state.task_id is not None:
            self._line(call, call.state.task_id, "stopped", event.reason)
        task_id = call.state.task_id
        if task_id is None:
            return
        for command in commands:
            if isinstance(command, Settle):
                self._line(call, task_id, TaskStatus(command.status).value, command.status_message)
            elif isinstance(command, WriteInputs):
                status = TaskStatus.INPUT_REQUIRED if command.input_requests else TaskStatus.WORKING
                self._line(call, task_id, status.value, None)

    def _line(self, call: LiveCall, task_id: str, outcome: str, reason: str | None) -> None:
        self.audit.write(
            {
                "kind": "task",
                "subject": subject(call.principal),
                "principal": call.caller or None,
                "method": call.method,
                "tool": call.name,
                "task_id": task_id,
                "outcome": outcome,
                "reason": reason,
                "duration_ms": round((time.perf_counter() - call.created_at) * 1000, 2),
            }
        )


class SpanEvents:
    """The span events of a call's questions: one the upstream asked (`input_requested`: its method, whether it
    was refused at once), an answer or refusal sent back (`input_answered`), an MRTR round handed to the client
    (`mrtr_input_required`: its round, how many questions), a retry that took it back (`mrtr_resumed`)."""

    def __call__(self, call: LiveCall, event: Event, commands: list[Command]) -> None:
        if isinstance(event, Asked):
            question = event.question
            refused = any(isinstance(command, Refuse) and command.upstream_id == question.id for command in commands)
            tracing.event("input_requested", {"mcp.method.name": question.method, "refused": refused})
        elif isinstance(event, Parked):
            tracing.event("mrtr_input_required", {"round": call.state.round, "questions": len(call.state.inputs)})
        elif isinstance(event, Resumed):
            tracing.event("mrtr_resumed", {"round": call.state.round, "answers": len(event.answers)})
        for command in commands:
            if isinstance(command, Answer) and call.upstream.session is not None:
                tracing.event("input_answered", {"refused": False})
            elif isinstance(command, Refuse) and call.upstream.session is not None:
                _, error = refusal(command.method)
                tracing.event("input_answered", {"refused": error is not None})
