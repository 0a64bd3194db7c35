"""A task the upstream runs itself (2025-11-25 Tasks), as the machine follows it: what is known of it, and how
its outcome maps to the 2026-07-28 rules. Sans-IO and pure: imports the call's outcome types and the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from proxy.errors import UpstreamError
from proxy.tasks.machine.commands import CallOutcome
from proxy.wire import legacy_tasks
from proxy.wire import tasks as wire_tasks
from proxy.wire.legacy_tasks import LegacyTask
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult

# A legacy `failed` also covers a tool result with `isError: true`; in 2026-07-28 that is a `completed` task whose
# result says `isError`, and `failed` is only for a JSON-RPC error (or a task the upstream lost). The mcp 1.x SDK
# answers `tasks/result` of a failed or cancelled task with an empty result, so the task's status decides what such an
# answer means. SANS-IO and pure: imports the call's outcome types and the wire only.

UPSTREAM_CANCELLED: Final = "cancelled by the upstream"
UPSTREAM_FAILED: Final = "the upstream task failed"
UPSTREAM_FORGOT: Final = "the upstream no longer knows this task (or the session it ran in)"


@dataclass(slots=True)
class UpstreamTask:
    task_id: str  # the upstream's id (never shown to the client)
    status: str = "working"  # the latest legacy status seen
    status_message: str | None = None
    poll_interval_ms: int = legacy_tasks.DEFAULT_POLL_INTERVAL_MS
    expires_at_ms: int | None = None  # wall clock: when the upstream may drop it (None: not said)
    following: bool = True  # its tasks/result is open (or opened again): the outcome is still to come
    final: CallOutcome | None = None  # tasks/result answered with no tool result: kept until the status is known
    cancelled: bool = False  # the upstream cancelled it (not this proxy's client)

    @classmethod
    def created(cls, task: LegacyTask, at_ms: int) -> UpstreamTask:
        expires = None if task.ttl_ms is None else at_ms + task.ttl_ms
        return cls(
            task.task_id,
            task.status,
            task.status_message,
            task.poll_interval_ms or legacy_tasks.DEFAULT_POLL_INTERVAL_MS,
            expires,
        )

    def seen(self, task: LegacyTask) -> bool:
        """Take a status report in; True when it brings a new statusMessage."""
        self.status = task.status
        if task.poll_interval_ms:
            self.poll_interval_ms = task.poll_interval_ms
        if task.status_message is None or task.status_message == self.status_message:
            return False
        self.status_message = task.status_message
        return True

    def outcome(self, answer: CallOutcome) -> CallOutcome | None:
        """The call's outcome from `tasks/result`'s answer; None while the status needed to read it is unknown.

        A tool result (`isError` included) is the outcome as it is. Anything else reads as the task's status
        says: a task the upstream cancelled is cancelled; a JSON-RPC error of a `failed` task is the outcome;
        an answer that is no tool result (the mcp 1.x SDK's) is an error with the upstream's statusMessage for
        a `failed` task, an empty result for a `completed` one. A JSON-RPC error for a task not known to have
        ended may only say that the upstream lost it: its status is asked first."""
        if not isinstance(answer, UpstreamResult | UpstreamErrorResponse):
            return answer  # lost (a ProxyError): failed, whatever the status
        if isinstance(answer, UpstreamResult) and legacy_tasks.is_tool_result(answer.result):
            return answer
        if self.status not in legacy_tasks.LEGACY_TERMINAL:
            return None
        if self.status == "cancelled":
            self.cancelled = True
            return UpstreamErrorResponse(wire_tasks.internal_error(f"The task was {UPSTREAM_CANCELLED}"))
        if isinstance(answer, UpstreamErrorResponse):
            return answer
        if self.status == "failed":
            return UpstreamErrorResponse(wire_tasks.internal_error(self.status_message or UPSTREAM_FAILED))
        return UpstreamResult({**answer.result, "content": []})

    def forgotten(self) -> CallOutcome:
        """The outcome once the upstream no longer knows the task: a `tasks/result` answer without a status to
        read it by is an empty result, if it was a result; otherwise the task is lost."""
        answer = self.final
        self.final = None
        if isinstance(answer, UpstreamResult):
            return UpstreamResult({**answer.result, "content": []})
        return UpstreamError(f"Upstream task lost: {UPSTREAM_FORGOT}")
