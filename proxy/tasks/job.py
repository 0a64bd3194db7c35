"""One upstream call run by the task runner, and the state it moves through.

A `Job` is a `tools/call`, `prompts/get` or `resources/read` whose upstream call runs in a runner-owned
coroutine, so that it can outlive the HTTP request that started it: a sync window that turns into a task, a
task, or a synchronous call parked between MRTR rounds. Plain data; the runner drives it.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from enum import StrEnum

from proxy.errors import ProxyError
from proxy.policy import Outcome, Policy
from proxy.tasks.inputs import PendingInput
from proxy.upstream.call import UpstreamCall, UpstreamErrorResponse, UpstreamResult
from proxy.wire.envelope import Channel
from proxy.wire.jsonrpc import JSON

CallOutcome = UpstreamResult | UpstreamErrorResponse | ProxyError

# How a waiting client may be asked for input: the outcomes that answer an upstream question with an MRTR
# `InputRequiredResult` (C-11) rather than with a task's `inputRequests`.
MRTR_OUTCOMES = frozenset({Outcome.SYNC, Outcome.WAIT, Outcome.INPUT_FIRST})


class JobMode(StrEnum):
    FOREGROUND = "foreground"  # a client's request waits for the call (sync, window, wait, an MRTR round)
    PARKED = "parked"  # MRTR: an InputRequiredResult went out; the call waits for the client's retry
    TASK = "task"  # a task the client polls; questions go to its record as `inputRequests`
    DETACHED = "detached"  # nobody reads the outcome any more; further questions are refused


class Woke(StrEnum):
    """Why a waiting client's request stopped waiting."""

    FINISHED = "finished"  # the upstream call ended
    INPUT = "input"  # the upstream asked something (a gathered batch), or asked what the client cannot answer
    WINDOW = "window"  # the sync window ran out with the call still running


@dataclass(eq=False)
class Job:
    method: str  # tools/call, prompts/get or resources/read
    tool: str  # the tool or prompt name, or the resource URI (logs; metrics labels for tools)
    outcome_kind: Outcome  # what the policy decided for the request that started the call
    policy: Policy | None  # the tool's policy (None for prompts/get and resources/read)
    principal: str | None
    params: JSON  # the upstream params
    headers: dict[str, str]
    capabilities: JSON  # the starting request's ClientCapabilities (C-14, K-19)
    progress_token: str | int | None = None
    log_level: str | None = None
    channel: Channel | None = None  # the waiting client's stream while one waits (FOREGROUND)
    mode: JobMode = JobMode.FOREGROUND
    task_id: str | None = None
    call: UpstreamCall | None = None
    outcome: CallOutcome | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    coroutine: asyncio.Task[None] | None = None
    cancel_reason: str = "cancelled"
    progress_written_at: float = float("-inf")  # monotonic time of the last statusMessage write
    # Input bridging
    inputs: dict[str, PendingInput] = field(default_factory=dict)  # outstanding questions by minted key
    issued: int = 0  # keys minted over the call's (or task's) whole life (T-30)
    missing: list[JSON] = field(default_factory=list)  # capabilities of questions refused while a client waited
    needs_client: bool = False  # a gathered batch of questions is ready for the waiting client
    publish_timer: asyncio.Task[None] | None = None  # ends the gathering of a batch
    attention: asyncio.Event = field(default_factory=asyncio.Event)  # set when finished or a batch is ready
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # orders mode changes, publishing and delivery
    call_id: str = field(default_factory=lambda: secrets.token_urlsafe(16))  # names the parked call in state
    round: int = 0  # MRTR rounds answered so far; a requestState is good for exactly one round
    parked_until_ms: int = 0

    @property
    def mrtr(self) -> bool:
        return self.outcome_kind in MRTR_OUTCOMES

    def input_requests(self) -> JSON:
        return {key: pending.request for key, pending in self.inputs.items()}
