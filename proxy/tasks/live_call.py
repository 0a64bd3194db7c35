"""One live call: the upstream request it was made from, the machine's state, and its three ends (client,
upstream, record), each written by one module; `new_call`, the one way to build one; the table of calls in
flight. Asyncio objects live here, never in the machine's state; nothing here does I/O."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Final, Protocol

from proxy.principals import Identity
from proxy.tasks.machine import inputs
from proxy.tasks.machine.commands import (
    CancelUpstreamTask,
    FollowUpstreamTask,
    PollUpstreamTask,
    ReleaseCall,
    ReplyKind,
    StartUpstreamTask,
    Timer,
)
from proxy.tasks.machine.state import CallState
from proxy.tasks.services.replicas import Ask
from proxy.tasks.store import Fence
from proxy.upstream.session import RequestStream, Session
from proxy.wire import translate
from proxy.wire.envelope import Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord


@dataclass(frozen=True)
class UpstreamRequest:
    """The upstream request one client request becomes, built once by the front for both of its paths (the
    synchronous `forward` and a call of the runner): the method, the tool or prompt name (the URI for
    `resources/read`), the legacy params, the trace headers, and the digest an MRTR retry must match. Pure."""

    request: ModernRequest = field(repr=False)
    method: str
    name: str
    params: JSON
    headers: dict[str, str]

    @classmethod
    def of(cls, request: ModernRequest, caller: Caller) -> UpstreamRequest:
        name = request.params.get("uri") if request.method == "resources/read" else request.params.get("name")
        return cls(
            request,
            request.method,
            str(name),
            translate.upstream_params(request.params),
            translate.trace_headers(request.meta, caller.headers),
        )

    @cached_property
    def digest(self) -> str:
        """Of the client's params: a requestState is bound to the request it was issued for."""
        return inputs.params_digest(self.request.params)


def known(digest: str) -> Callable[[], str]:
    """A digest already known (from a requestState's claims; empty for a re-run task, which no retry resumes)."""
    return lambda: digest


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def _call_ids() -> Iterator[str]:
    """Unguessable call ids (16 bytes from the OS's random source, as `secrets.token_urlsafe(16)`), drawn 4 KiB
    at a time: one system call per 256 calls instead of one per call, which showed in profiles of the modern
    path. A forked child starts a draw of its own (`os.register_at_fork` below)."""
    while True:
        drawn = os.urandom(4096)
        for start in range(0, len(drawn), 16):
            yield base64.urlsafe_b64encode(drawn[start : start + 16]).rstrip(b"=").decode()


_call_id_source = _call_ids()


def _fresh_call_ids() -> None:
    global _call_id_source
    _call_id_source = _call_ids()


os.register_at_fork(after_in_child=_fresh_call_ids)


def new_call_id() -> str:
    return next(_call_id_source)


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Queued for the client's writer: an SSE keep-alive comment while a poll-to-sync client waits."""


KEEP_ALIVE: Final = KeepAlive()


Outgoing = JSON | ReplyKind | KeepAlive  # what the client's writer writes: a notification, the reply, a comment


@dataclass(eq=False, slots=True)
class ClientEnd:
    """What the client side owns: the waiting request's answer, its stream, and what is queued for the one
    writer that writes it in order (`effects/client.py`, the only module that changes it), with the bytes of
    the notifications waiting (its backlog, bounded by `limits.max_client_backlog_bytes`)."""

    reply: asyncio.Future[ReplyKind] | None = None
    channel: Channel | None = None
    writer: asyncio.Task[None] | None = None
    writing: bool = False  # the writer waits for the client to take a write
    backlog_bytes: int = 0  # the notifications queued, as the JSON they are written as
    dropped: int = 0  # notifications dropped past the backlog's cap
    progress_at: float = 0.0  # when progress was last queued for the client (`time.perf_counter`; 0: never)
    progress: float | None = None  # the last progress value the upstream reported to it
    warmed: int = 0  # progress notifications the proxy sent it itself, to keep its connection warm
    _outgoing: deque[tuple[Outgoing, int]] = field(default_factory=deque)  # each with its size (0: no note)

    def queued(self) -> bool:
        return bool(self._outgoing)

    def queue(self, item: Outgoing, size: int = 0) -> None:
        self._outgoing.append((item, size))
        self.backlog_bytes += size

    def replace_progress(self, message: JSON, size: int) -> bool:
        """A progress notification still waiting is replaced by `message` (which goes last); False when none
        waits."""
        for index in range(len(self._outgoing) - 1, -1, -1):
            queued, queued_size = self._outgoing[index]
            if isinstance(queued, dict) and queued.get("method") == PROGRESS:
                del self._outgoing[index]
                self.backlog_bytes -= queued_size
                self.queue(message, size)
                return True
        return False

    def next(self) -> Outgoing | None:
        if not self._outgoing:
            return None
        item, size = self._outgoing.popleft()
        self.backlog_bytes -= size
        return item

    def drop_notes(self) -> None:
        """The stream broke: what was queued for it goes, but a reply (the waiting request's answer)."""
        kept = [(item, 0) for item, _ in self._outgoing if not isinstance(item, dict | KeepAlive)]
        self._outgoing.clear()
        self._outgoing.extend(kept)
        self.backlog_bytes = 0


PROGRESS: Final = "notifications/progress"


class Follower(Protocol):
    """How a call follows a task the upstream runs (its own 2025-11-25 task, or a legacy job), chosen when the
    call is built: it carries out the machine's commands about that task."""

    async def start(self, call: LiveCall, command: StartUpstreamTask) -> None: ...

    async def follow(self, call: LiveCall, command: FollowUpstreamTask) -> None: ...

    async def poll(self, call: LiveCall, command: PollUpstreamTask) -> None: ...

    async def cancel(self, call: LiveCall, command: CancelUpstreamTask) -> None: ...

    async def release(self, call: LiveCall, command: ReleaseCall) -> None: ...


@dataclass(eq=False, slots=True)
class UpstreamEnd:
    """What the upstream side owns: the session the call runs on, its request stream, the pump reading it, and
    how it follows a task the upstream runs (None for a call that runs none)."""

    session: Session | None = None
    stream: RequestStream | None = None
    pump: asyncio.Task[None] | None = None
    follower: Follower | None = None


@dataclass(eq=False, slots=True)
class StoredEnd:
    """What the record side owns: the task record as committed and the lease it is written under."""

    record: TaskRecord | None = None
    fence: Fence | None = None  # None: no task yet
    planned_id: str | None = None  # the id its record gets, when fixed before (a keyed call's claim names it)


@dataclass(eq=False)
class LiveCall:
    """One call: the machine's state (its `CallState`, changed only by the machine), what the call is (method,
    name, caller, params), and the parts each side owns (`client`, `upstream`, `stored`). Asyncio objects live
    here. Built by `new_call`."""

    state: CallState
    method: str  # tools/call, prompts/get or resources/read
    name: str  # the tool or prompt name, or the resource URI
    principal: Identity | None  # who the caller is: its credential is sent upstream with the call
    caller: str  # its keyed hash: owns the task, and the caller's share of the limits is counted under it
    params: JSON  # the upstream params
    headers: dict[str, str]  # trace context for the upstream request
    digest_of: Callable[[], str]  # works out `digest`, which only an MRTR round needs (see below)
    call_id: str = field(default_factory=new_call_id)  # names the parked call in state
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one event at a time
    client: ClientEnd = field(default_factory=ClientEnd)
    upstream: UpstreamEnd = field(default_factory=UpstreamEnd)
    stored: StoredEnd = field(default_factory=StoredEnd)
    request_state: str = ""  # the signed requestState of the current MRTR round
    timers: dict[Timer, asyncio.TimerHandle] = field(default_factory=dict)
    created_at: float = field(default_factory=time.perf_counter)
    ask: Ask | None = None  # set on a stand-in for a call parked on another replica (a forwarded MRTR retry)

    @cached_property
    def digest(self) -> str:
        """Of the client's params: an MRTR retry must repeat the same request. Hashed the first time a round
        needs it, not for every call (most never ask anything)."""
        return self.digest_of()


def new_call(
    state: CallState,
    *,
    method: str,
    name: str,
    principal: Identity | None,
    caller: str,
    digest_of: Callable[[], str],
    params: JSON | None = None,
    headers: dict[str, str] | None = None,
    channel: Channel | None = None,
    record: TaskRecord | None = None,
    fence: Fence | None = None,
    follower: Follower | None = None,
    planned_id: str | None = None,
) -> LiveCall:
    """The one way a call is built: by keyword, the raw principal apart from its keyed hash (`caller`), with
    the follower of the task the upstream runs when its decision says there is one, and the id its task record
    gets when the caller fixed it before (`planned_id`: a keyed call's claim names it)."""
    return LiveCall(
        state,
        method,
        name,
        principal,
        caller,
        {} if params is None else params,
        {} if headers is None else headers,
        digest_of,
        client=ClientEnd(channel=channel),
        upstream=UpstreamEnd(follower=follower),
        stored=StoredEnd(record, fence, planned_id=planned_id),
    )


class CallTable:
    """Every call not finished yet, and the calls of tasks whose upstream call runs in this process, by task
    id. Plain data."""

    def __init__(self) -> None:
        self._calls: set[LiveCall] = set()
        self._by_task: dict[str, LiveCall] = {}

    def add(self, call: LiveCall) -> None:
        self._calls.add(call)

    def add_task(self, task_id: str, call: LiveCall) -> None:
        self._by_task[task_id] = call

    def drop_task(self, task_id: str) -> None:
        self._by_task.pop(task_id, None)

    def task(self, task_id: str) -> LiveCall | None:
        return self._by_task.get(task_id)

    def forget(self, call: LiveCall) -> None:
        self._calls.discard(call)
        task_id = call.state.task_id
        if task_id is not None and self._by_task.get(task_id) is call:
            del self._by_task[task_id]

    def calls(self) -> list[LiveCall]:
        return list(self._calls)

    def tasks(self) -> dict[str, LiveCall]:
        return dict(self._by_task)

    @property
    def count(self) -> int:
        return len(self._calls)
