"""The audit lines of task transitions, from the executor's observer hook (never from inside an effect): a
task created, its questions outstanding or answered, settled, or stopped from outside (a cancel, its TTL).
Each names the task, its tool, its principal (JWT subject, else hash) and the time since the call began;
never the arguments, the answers or the result. Imports the audit sink, the commands and the call.
"""

from __future__ import annotations

import time

from proxy.observe.audit import AuditLog, subject
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import Command, Committed, Event, RemoteCancel, Settle, Stop, WriteInputs
from proxy.wire.tasks import TaskStatus


class AuditTrail:
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
