"""The state of one call and the words its lifecycle uses: what the machine (`__init__.py`) keeps between
events, and the reasons it gives when it stops a call. Plain data; imports the policy, the input rules, the
upstream task it follows, the command vocabulary and the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from proxy.errors import ProxyError
from proxy.policy import Decision
from proxy.tasks.machine.commands import CallOutcome, Mode
from proxy.tasks.machine.inputs import PendingInput
from proxy.tasks.machine.upstream_task import UpstreamTask
from proxy.wire.jsonrpc import JSON

MAX_OUTSTANDING_INPUTS: Final = 64  # open questions per call; an upstream asking more at once is refused
PROGRESS_WRITE_INTERVAL_MS: Final = 200  # at most this often is a task's statusMessage rewritten
CLIENT_LEFT: Final = "client disconnected"
PARKED_EXPIRED: Final = "the client did not retry within inputs.request_state_ttl_ms"
RECLAIMED: Final = "its upstream session was needed elsewhere while it waited for the client's retry"
TASK_REFUSED: Final = "the task could not be created"
LEASE_LOST: Final = "interrupted: this replica lost its lease on the task"
QUEUE_TIMED_OUT: Final = "the call waited too long for an upstream slot"
STARTED: Final = "started"  # the statusMessage of a queued task once it got its upstream slot


@dataclass(slots=True)
class CallState:
    decision: Decision
    capabilities: JSON  # the starting request's ClientCapabilities: which questions may reach the client
    gather_ms: int
    park_ttl_ms: int
    progress_token: str | int | None = None  # the waiting request's, for relayed progress
    log_level: str | None = None  # the waiting request's, for relayed log messages
    mode: Mode = Mode.WAITING
    client_waiting: bool = True  # a request waits for a reply (it leaves with the reply or when it goes away)
    task_id: str | None = None
    committing: bool = False  # a task record is being written
    started: bool = False  # the upstream call was sent
    running: bool = False  # ... and has not ended or been abandoned
    outcome: CallOutcome | None = None
    inputs: dict[str, PendingInput] = field(default_factory=dict)  # outstanding questions by minted key
    issued: int = 0  # keys minted over the call's (or task's) whole life: keys are never reused
    inputs_written: bool = True  # the task record shows the current questions
    missing: list[JSON] = field(default_factory=list)  # capabilities of questions refused while a client waited
    gathering: bool = False
    window_set: bool = False  # the sync window's timer is running
    round: int = 0  # MRTR rounds so far; a requestState is good for exactly one round
    holds_slot: bool = False  # counts against `tasks.max_running`
    progress_written_at_ms: float = float("-inf")
    upstream_task: UpstreamTask | None = None  # the upstream's own task this call follows, once created
    fenced: bool = False  # the lease on the task was lost: nothing more is written for it
    queued: bool = False  # the upstream request waits for a slot (`upstream.max_concurrent_calls`)
    queued_ahead: int = 0  # calls before it in the queue when it was queued
    queue_written: bool = False  # the task record says it is queued
    queue_timer_set: bool = False
    queue_refusal: ProxyError | None = None  # what a synchronous caller that waited too long is told

    def input_requests(self) -> JSON:
        return {key: pending.request for key, pending in self.inputs.items()}

    def questions(self) -> dict[str, str]:
        """The outstanding questions, key → method (what answers are checked against)."""
        return {key: pending.method for key, pending in self.inputs.items()}

    def upstream_input_ids(self) -> JSON | None:
        """For a task the upstream runs itself: each outstanding question's upstream JSON-RPC id, by key."""
        if not self.decision.upstream_task:
            return None
        return {key: pending.upstream_id for key, pending in self.inputs.items()}
