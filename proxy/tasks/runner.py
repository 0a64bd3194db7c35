"""The task runner: carries out what each call's machine (`machine.py`) decides, and owns every background
coroutine of a call that may outlive its HTTP request.

For each call it keeps the machine's state beside what carrying it out needs (the upstream session and
request, timers, the waiting client's reply and stream), feeds it events one at a time (under the call's lock)
and executes the commands that come out: store writes, upstream answers and cancels, replies, timers, the
`max_running` slots and the parked MRTR calls; what concerns a task the upstream runs itself is carried out
by `upstream_tasks.py`. It decides nothing itself. It also runs the task-level operations that need no call
(`tasks/get`, `tasks/cancel` of a task whose call is gone, TTL sweeps, restart recovery). With several replicas
on one store (`replicas.py` carries the lease, the feed and the messages) it writes as a task's owner only
under its lease's fence and forwards MRTR retries for calls parked on another replica; what other replicas do
reaches its calls through `replica_calls.py` (mixed in). Imports the store,
the upstream client, the machine, policy and wire; never aiohttp's web side or the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

import structlog

from proxy.config import Config, RestartAction
from proxy.errors import CallerLimitError, InvalidParamsError, ProxyError, TaskLimitError
from proxy.observability import Metrics
from proxy.policy import SYNC_CALL, Decision, Outcome, Policy, decide
from proxy.principals import Principals, SealError
from proxy.tasks import inputs, machine, pacing, remote
from proxy.tasks.commands import (
    Answer,
    Answered,
    Asked,
    CancelCall,
    CancelUpstreamTask,
    ClearTimer,
    ClientLeft,
    Command,
    CommitRefused,
    Committed,
    CreateRecord,
    Ended,
    Event,
    FollowUpstreamTask,
    HoldSlot,
    LeaseLost,
    Notified,
    Park,
    Parked,
    ParkRefused,
    PollUpstreamTask,
    Refuse,
    Relay,
    ReleaseCall,
    Reply,
    ReplyKind,
    Resumed,
    SetTimer,
    Settle,
    ShutDown,
    Start,
    StartCall,
    Stop,
    Timer,
    TimerFired,
    Unpark,
    WriteInputs,
    WriteProgress,
)
from proxy.tasks.followed import FollowedTask
from proxy.tasks.inputs import PendingInput
from proxy.tasks.machine import CallState
from proxy.tasks.replica_calls import CANCELLED_BY_CLIENT, ReplicaCalls
from proxy.tasks.replicas import Ask, ReplicaLink
from proxy.tasks.store import Fence, FencedError, StoreError, StoreFullError, TaskStore
from proxy.tasks.upstream_tasks import UpstreamTasks
from proxy.upstream.events import (
    UpstreamEvent,
    UpstreamNotification,
    UpstreamServerRequest,
    refusal,
)
from proxy.upstream.kinds import Session, SessionCall
from proxy.upstream.pool import UpstreamClient
from proxy.wire import legacy_tasks, translate
from proxy.wire import tasks as wire_tasks
from proxy.wire.envelope import Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

SWEEP_INTERVAL_SECONDS: Final = 1.0  # how often expired tasks are ended and old records purged
SHUTDOWN_GRACE_SECONDS: Final = 5.0  # how long close() waits for cancelled calls to tell the upstream
SHUTTING_DOWN: Final = "the proxy is shutting down"
DURATIONS_RELOAD_SECONDS: Final = 5.0  # how often the tools' duration estimates are read again (other replicas')

_T = TypeVar("_T")


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(eq=False)
class Call:
    """One call: the machine's state, and what carrying out its commands needs (asyncio objects live here)."""

    state: CallState
    method: str  # tools/call, prompts/get or resources/read
    name: str  # the tool or prompt name, or the resource URI
    principal: str | None  # the caller's principal header, sent upstream with the call
    caller: str  # its keyed hash: owns the task, and the caller's share of the limits is counted under it
    params: JSON  # the upstream params
    headers: dict[str, str]  # trace context for the upstream request
    digest: str  # of the client's params: an MRTR retry must repeat the same request
    call_id: str = field(default_factory=lambda: secrets.token_urlsafe(16))  # names the parked call in state
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one event at a time
    reply: asyncio.Future[ReplyKind] | None = None  # the waiting request's answer
    channel: Channel | None = None  # the waiting request's stream (notifications before the answer)
    request_state: str = ""  # the signed requestState of the current MRTR round
    record: TaskRecord | None = None  # as committed
    timers: dict[Timer, asyncio.TimerHandle] = field(default_factory=dict)
    pump: asyncio.Task[None] | None = None  # reads the upstream call
    session: Session | None = None
    upstream: SessionCall | None = None
    created_at: float = field(default_factory=time.perf_counter)
    fence: Fence | None = None  # the lease the task's record is written under (None: no task yet)
    ask: Ask | None = None  # set on a stand-in for a call parked on another replica (a forwarded MRTR retry)


class TaskRunner(ReplicaCalls):
    def __init__(
        self,
        config: Config,
        store: TaskStore,
        upstream: UpstreamClient,
        principals: Principals,
        clock: Callable[[], int] = wall_clock_ms,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config.tasks
        self.principals = principals
        self.inputs = config.inputs
        self.metrics = metrics
        self.store = store
        self.upstream = upstream
        self.clock = clock
        self.process_id = uuid.uuid4().hex  # the `owner` of every task this process runs
        self.signer = inputs.RequestStateSigner(inputs.load_secret(config.inputs.secret_file))
        self.durations = pacing.DurationEstimates()  # how long each tool's tasks usually take (shared in the store)
        self.replicas = ReplicaLink(store, self.process_id, config.store.lease_seconds, self)
        self._calls: set[Call] = set()  # every call not finished yet
        self._tasks: dict[str, Call] = {}  # task id → its call, for tasks whose upstream call runs here
        self.limits = config.limits
        self._running: set[Call] = set()  # calls that hold a `max_running` slot
        self._running_by: Counter[str] = Counter()  # ... per caller
        self._parked: dict[str, Call] = {}  # call id → a call parked for an MRTR retry
        self._parked_by: Counter[str] = Counter()  # ... per caller
        self._background: set[asyncio.Task[Any]] = set()
        self._progress_tokens = 0
        self._served: dict[str, Call] = {}  # MRTR retries forwarded by another replica, by their message key
        self._adopting = asyncio.Lock()  # take-overs and a lapsed lease's recovery, one at a time
        self._durations_loaded_at = float("-inf")
        self.upstream_tasks = UpstreamTasks(self)  # carries out the commands about tasks the upstream runs

    # --- lifecycle -----------------------------------------------------------------------------------

    def spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        """The one place tasks/ starts background work: named, referenced until done."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._background.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_background_failed", coroutine=task.get_name(), error=repr(task.exception()))

    async def start(self) -> None:
        """The lease and the change feed first (every owner write carries the lease's fence), the shared pacing
        estimates, restart recovery (before the first request is served), then the periodic sweep."""
        await self.replicas.start()
        if self.store.shared and self.inputs.secret_file is None:
            log.warning(
                "request_state_key_not_shared",
                detail="inputs.secret_file is unset: an MRTR retry that reaches another replica is refused",
            )
        await self._load_durations()
        await self._recover()
        self.spawn(self._sweep_forever(), "task-sweeper")

    async def close(self) -> None:
        """Shutdown: running calls are cancelled upstream; their records stay live and are failed or re-run
        per `on_restart` at the next start, or by another replica at once (the lease is released); nothing
        committed is lost or rewritten here."""
        calls = list(self._calls)
        await asyncio.gather(*(self.dispatch(call, ShutDown(SHUTTING_DOWN)) for call in calls), return_exceptions=True)
        await self.replicas.close()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=SHUTDOWN_GRACE_SECONDS)

    async def _recover(self) -> None:
        """Tasks no running process owns any more. On a shared store (PostgreSQL), those of replicas whose lease
        ran out, an earlier run of this one included once its lease lapsed or was released: taken over, so the
        tasks of live replicas are never touched. On SQLite, every live task: the process that ran it is gone
        (the file lock says so); a task the upstream runs itself is followed again."""
        if self.store.shared:
            await self.replicas.sweep()
            return
        async with self._adopting:
            live = await self.store.live()
            await self._adopt(live, wire_tasks.RESTART_MESSAGE, wire_tasks.RERUN_MESSAGE, None, follow=True)

    async def _rerun(self, record: TaskRecord, fence: Fence) -> None:
        try:
            principal = None if record.rerun_principal is None else self.principals.unseal(record.rerun_principal)
        except SealError as exc:
            await self._fail(record.task_id, f"{wire_tasks.RESTART_MESSAGE}; not re-run: {exc}", fence)
            return
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, "rerun")
        state = self._state(Decision(Outcome.TASK, policy), record.client_capabilities, None, None)
        state.task_id = record.task_id
        state.issued = record.inputs_issued  # keys stay unique across the re-run too
        call = Call(state, "tools/call", record.tool, principal, record.principal, dict(record.request), {}, "")
        call.record = record
        call.fence = fence
        self._calls.add(call)
        self._tasks[record.task_id] = call
        await self.dispatch(call, Start())
        log.info("task_rerun", task_id=record.task_id, tool=record.tool)

    async def _follow_again(self, record: TaskRecord, before: TaskRecord, fence: Fence) -> None:
        """A task the upstream runs itself, left live by a previous process: followed again on its upstream
        session, with the questions it had asked (`before`, as the record was) still answerable."""
        assert record.upstream_task_id is not None
        on_restart: RestartAction = "rerun" if record.on_restart == "rerun" else "fail"
        policy = Policy("required", 0, record.ttl_ms, record.poll_interval_ms or 1000, on_restart)
        decision = Decision(Outcome.TASK, policy, upstream_task=True)
        state = self._state(decision, record.client_capabilities, None, None)
        state.task_id = record.task_id
        state.issued = record.inputs_issued
        state.upstream_task = FollowedTask(
            record.upstream_task_id, status_message=record.status_message, expires_at_ms=record.expires_at_ms
        )
        for key, request in before.input_requests.items():
            upstream_id = before.upstream_input_ids.get(key)
            if isinstance(request, dict) and isinstance(upstream_id, int | str):
                state.inputs[key] = PendingInput(upstream_id, str(request.get("method")), request)
        state.inputs_written = not state.inputs
        try:
            principal = None if record.rerun_principal is None else self.principals.unseal(record.rerun_principal)
        except SealError as exc:
            await self._fail(record.task_id, f"{wire_tasks.RESTART_MESSAGE}; not followed again: {exc}", fence)
            return
        call = Call(state, "tools/call", record.tool, principal, record.principal, dict(record.request), {}, "")
        call.record = record
        call.fence = fence
        self._calls.add(call)
        self._tasks[record.task_id] = call
        await self.dispatch(call, Start())
        log.info("task_resumed", task_id=record.task_id, tool=record.tool)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_SECONDS)
            try:
                await self.sweep()
            except StoreError as exc:
                log.error("task_sweep_failed", error=str(exc))

    async def sweep(self) -> None:
        """Live tasks past their TTL fail (their calls stop, here or, through the feed, on their owner); settled
        records past their TTL are dropped; dead replicas' tasks are taken over. On a shared store each of these
        is done once across replicas (the store hands each expired task, and the purge, to one of them)."""
        now = self.clock()
        error = wire_tasks.internal_error(wire_tasks.EXPIRED_MESSAGE)
        for record in await self.store.settle_expired(now, error=error, status_message=wire_tasks.EXPIRED_MESSAGE):
            self._settled(record, reason=wire_tasks.EXPIRED_MESSAGE)
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
            call = self._tasks.get(record.task_id)
            if call is not None:
                await self.submit(call, Stop(wire_tasks.EXPIRED_MESSAGE, error))
        purged = await self.store.purge_expired(now)
        if purged:
            log.info("tasks_purged", count=purged)
        await self.replicas.sweep()
        if time.monotonic() - self._durations_loaded_at > DURATIONS_RELOAD_SECONDS:
            await self._load_durations()

    # --- starting and resuming calls (the waiting client's side calls these) ---------------------------

    def _state(
        self, decision: Decision, capabilities: JSON, progress_token: str | int | None, log_level: str | None
    ) -> CallState:
        return CallState(
            decision=decision,
            capabilities=capabilities,
            gather_ms=self.inputs.gather_ms,
            park_ttl_ms=self.inputs.request_state_ttl_ms,
            progress_token=progress_token,
            log_level=log_level,
        )

    async def begin(self, request: ModernRequest, caller: Caller, decision: Decision, channel: Channel) -> Call:
        """A new call for a waiting request; its reply arrives on `call.reply`."""
        params = translate.upstream_params(request.params)
        if decision.may_become_task:
            meta = dict(params.get("_meta") or {})
            if "progressToken" not in meta:
                # Ask the upstream for progress even when the client did not: it becomes the statusMessage.
                self._progress_tokens += 1
                meta["progressToken"] = f"mcp-tasks-proxy-{self._progress_tokens}"
            params["_meta"] = meta
        name = request.params.get("uri") if request.method == "resources/read" else request.params.get("name")
        state = self._state(decision, request.client_capabilities, request.progress_token, request.log_level)
        call = Call(
            state=state,
            method=request.method,
            name=str(name),
            principal=caller.principal,
            caller=self.principals.key_of(caller.principal),
            params=params,
            headers=translate.trace_headers(request.meta, caller.headers),
            digest=inputs.params_digest(request.params),
            channel=channel,
        )
        call.reply = asyncio.get_running_loop().create_future()
        self._calls.add(call)
        await self.submit(call, Start())
        return call

    async def resume(
        self, request: ModernRequest, caller: Caller, responses: Mapping[str, Any], channel: Channel
    ) -> Call:
        """An MRTR retry: the `requestState` must be genuine, unexpired, the caller's, for this method and
        these params, and name a call parked for this round (here, or on the live replica that issued it: the
        retry is forwarded there); its answers must fit the questions. Else -32602, and the call stays parked
        for a corrected retry."""
        state = request.params.get("requestState")
        if not isinstance(state, str):
            raise InvalidParamsError("Invalid params: requestState must be a string")
        claims = self.signer.verify(state, self.clock())
        if (
            claims.principal != self.principals.key_of(caller.principal)
            or claims.method != request.method
            or claims.digest != inputs.params_digest(request.params)
        ):
            raise InvalidParamsError("Invalid params: requestState was issued for another request")
        if claims.owner != self.process_id:
            return await self._forward(request, caller, claims, state, responses, channel)
        call, answers = self._take_parked(claims, responses)
        call.reply = asyncio.get_running_loop().create_future()
        call.channel = channel
        log.info("mrtr_resumed", method=call.method, name=call.name, round=call.state.round, answered=sorted(answers))
        await self.submit(call, Resumed(answers, request.progress_token, request.log_level))
        return call

    def _take_parked(self, claims: inputs.StateClaims, responses: Mapping[str, Any]) -> tuple[Call, dict[str, JSON]]:
        """The call parked here for the claims' round, with the retry's answers checked; it is no longer parked."""
        call = self._parked.get(claims.call_id)
        if call is None or not machine.resumable(call.state, claims.round):
            raise InvalidParamsError(
                "Invalid params: requestState was already used or its call has ended; send the request again without it"
            )
        answers = machine.answers(call.state, responses)  # a bad answer leaves the call parked for a corrected retry
        self._unpark(call)  # taken: exactly one retry resumes a round
        return call, answers

    async def _forward(
        self,
        request: ModernRequest,
        caller: Caller,
        claims: inputs.StateClaims,
        state: str,
        responses: Mapping[str, Any],
        channel: Channel,
    ) -> Call:
        """An MRTR retry for a call parked on another replica: sent there (through the store), and a stand-in
        call here whose reply is what that replica's call answers (its notifications reach `channel` too)."""
        if not await self.store.replica_alive(claims.owner):
            raise InvalidParamsError(
                "Invalid params: requestState belongs to a call held by another proxy process, which is not "
                "running; send the request again without it"
            )
        name = request.params.get("uri") if request.method == "resources/read" else request.params.get("name")
        decision = (
            decide(self.config, str(name), declares_tasks=request.declares_tasks)
            if request.method == "tools/call"
            else SYNC_CALL
        )
        standin = self._state(decision, request.client_capabilities, request.progress_token, request.log_level)
        key = self.principals.key_of(caller.principal)
        call = Call(standin, request.method, str(name), caller.principal, key, {}, {}, claims.digest, channel=channel)
        call.reply = asyncio.get_running_loop().create_future()
        payload = remote.resume_payload(state, responses, request.progress_token, request.log_level, self.process_id)
        call.ask = await self.replicas.ask(claims.owner, remote.RESUME, payload, on_note=channel.notify)
        self.spawn(self._await_forwarded(call, call.ask), f"forwarded-{call.ask.key}")
        log.info("mrtr_forwarded", method=call.method, name=call.name, round=claims.round, to=claims.owner)
        return call

    def client_left(self, call: Call) -> None:
        """The waiting request went away (its handler is being cancelled): tell the call, in the background."""
        if call.ask is not None:  # a stand-in: the replica holding the call is told
            self.replicas.abandon(call.ask)
            return
        call.channel = None
        self.spawn(self.dispatch(call, ClientLeft()), f"client-left-{call.call_id}")

    async def submit(self, call: Call, event: Event) -> None:
        """Feed an event on behalf of a request handler: it runs to its end even if the handler is cancelled
        meanwhile (a half-carried-out command would leave the call stuck)."""
        await asyncio.shield(self.spawn(self.dispatch(call, event), f"call-{call.call_id}"))

    # --- feeding events, carrying out commands ------------------------------------------------------------

    async def dispatch(self, call: Call, event: Event) -> None:
        """Feed `event` to the call's machine and carry out its commands in order; an event a command brings
        back (`Committed`, `Parked`, ...) is fed next, before anything else reaches the call."""
        async with call.lock:
            pending: list[Event] = [event]
            while pending:
                current = pending.pop(0)
                commands = machine.handle(call.state, current)
                if isinstance(current, Asked):
                    self._count_question(current.question, commands)
                for command in commands:
                    follow_up = await self._execute(call, command)
                    if follow_up is not None:
                        pending.append(follow_up)
            if machine.finished(call.state):
                self._forget(call)

    async def _execute(self, call: Call, command: Command) -> Event | None:
        if isinstance(command, StartCall):
            pump = self.upstream_tasks.pump(call, command.ttl_ms) if command.upstream_task else self._pump(call)
            call.pump = self.spawn(pump, f"upstream-{call.call_id}")
        elif isinstance(command, FollowUpstreamTask | PollUpstreamTask | CancelUpstreamTask | ReleaseCall):
            await self.upstream_tasks.execute(call, command)
        elif isinstance(command, CreateRecord):
            return await self._create_record(call, command)
        elif isinstance(command, WriteInputs):
            return await self._write_inputs(call, command)
        elif isinstance(command, WriteProgress):
            return await self._write_progress(call, command)
        elif isinstance(command, Settle):
            return await self._settle(call, command)
        elif isinstance(command, Answer):
            await self._respond(call, command.upstream_id, result=command.result)
        elif isinstance(command, Refuse):
            log.info(
                "input_request_refused",
                task_id=call.state.task_id,
                name=call.name,
                input_method=command.method,
                reason=command.reason,
            )
            result, error = refusal(command.method)
            await self._respond(call, command.upstream_id, result=result, error=error)
        elif isinstance(command, CancelCall):
            await self._cancel_upstream(call, command.reason)
        elif isinstance(command, Relay):
            return await self._relay(call, command.message)
        elif isinstance(command, SetTimer):
            self._clear_timer(call, command.timer)
            loop = asyncio.get_running_loop()
            call.timers[command.timer] = loop.call_later(command.delay_ms / 1000, self._fire, call, command.timer)
        elif isinstance(command, ClearTimer):
            self._clear_timer(call, command.timer)
        elif isinstance(command, Park):
            return self._park(call, command.round)
        elif isinstance(command, Unpark):
            self._unpark(call)
        elif isinstance(command, HoldSlot):
            self._hold_slot(call, command.hold)
        elif isinstance(command, Reply):
            if call.reply is not None and not call.reply.done():
                call.reply.set_result(command.reply)
            call.channel = None
        return None

    def _forget(self, call: Call) -> None:
        self._calls.discard(call)
        for timer in list(call.timers):
            self._clear_timer(call, timer)
        self._hold_slot(call, False)
        self._unpark(call)
        if call.state.task_id is not None and self._tasks.get(call.state.task_id) is call:
            del self._tasks[call.state.task_id]

    def _count_question(self, question: UpstreamServerRequest, commands: list[Command]) -> None:
        if self.metrics is None or question.method not in translate.INPUT_METHODS:
            return
        refused = any(isinstance(command, Refuse) and command.upstream_id == question.id for command in commands)
        self.metrics.input_requests.labels(question.method, "refused" if refused else "relayed").inc()

    # --- the upstream call -----------------------------------------------------------------------------------

    async def _pump(self, call: Call) -> None:
        """Send the upstream request and feed what comes back to the machine, until its final event (or until
        the call is abandoned)."""
        try:
            async with self._session(call) as session:
                call.session = session
                async with session.call(call.method, call.params, call.headers) as upstream:
                    call.upstream = upstream
                    async for event in upstream.events():
                        await self.dispatch(call, self._event(event))
                        if not call.state.running:
                            return
        except ProxyError as exc:  # UpstreamError and friends: a lost upstream
            await self.dispatch(call, Ended(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the coroutine wrapper: a crash is the call's outcome, never silence
            log.exception("call_crashed", task_id=call.state.task_id, name=call.name)
            await self.dispatch(
                call, Ended(ProxyError("Internal error: the call failed in the proxy", detail=repr(exc)))
            )

    @contextlib.asynccontextmanager
    async def _session(self, call: Call) -> AsyncIterator[Session]:
        """Every call gets an upstream session of its own while it runs: whatever the upstream sends on that
        session's GET stream (a question naming no request) is this call's, never a guess. Even a client that
        declared no capability could be asked, and then it is the one to be told what it lacks (-32021)."""

        async def on_stream(event: UpstreamEvent) -> None:
            await self.dispatch(call, self._event(event))

        asks = inputs.could_answer(call.state.capabilities)
        reclaim = lambda: self._reclaim(call)  # noqa: E731 - bound to this call
        async with self.upstream.lease(call.principal, on_stream, asks=asks, reclaim=reclaim) as session:
            yield session

    def _reclaim(self, call: Call) -> bool:
        """The pool has no upstream session left to lend (stdio processes are bounded) and asks for this call's:
        given up only while the call waits parked for an MRTR retry, and then it ends as if nobody retried in
        time (its requestState is refused and the client sends the request afresh)."""
        if self._parked.get(call.call_id) is not call:
            return False
        log.info("mrtr_call_reclaimed", method=call.method, name=call.name, round=call.state.round)
        self.spawn(self.dispatch(call, TimerFired(Timer.PARK)), f"reclaim-{call.call_id}")
        return True

    def _event(self, event: UpstreamEvent) -> Event:
        if isinstance(event, UpstreamServerRequest):
            return Asked(event)
        if isinstance(event, UpstreamNotification):
            return Notified(event.message, time.monotonic() * 1000)
        return Ended(event)

    async def _respond(
        self, call: Call, upstream_id: int | str, *, result: JSON | None, error: JSON | None = None
    ) -> None:
        if call.session is None:
            return
        try:
            await call.session.respond(upstream_id, result=result, error=error)
        except ProxyError as exc:  # the call is lost; its stream ends it with that error
            log.warning("upstream_answer_not_delivered", task_id=call.state.task_id, error=exc.message)

    async def _cancel_upstream(self, call: Call, reason: str) -> None:
        """The upstream is told (`notifications/cancelled`: for a legacy server a disconnect is not a cancel),
        then the pump stops. A call whose request is still on its way is cancelled by the session itself."""
        if call.upstream is not None:
            try:
                await call.upstream.cancel(reason)
            except ProxyError as exc:
                log.warning("upstream_cancel_failed", task_id=call.state.task_id, error=exc.message)
        if call.pump is not None and call.pump is not asyncio.current_task():
            call.pump.cancel()

    async def _relay(self, call: Call, message: JSON) -> Event | None:
        if call.channel is None:
            return None
        try:
            await call.channel.notify(message)
        except ConnectionResetError:
            call.channel = None
            return ClientLeft()
        return None

    # --- timers and parking ----------------------------------------------------------------------------------

    def _fire(self, call: Call, timer: Timer) -> None:
        call.timers.pop(timer, None)
        self.spawn(self.dispatch(call, TimerFired(timer)), f"timer-{timer.value}-{call.call_id}")

    def _clear_timer(self, call: Call, timer: Timer) -> None:
        handle = call.timers.pop(timer, None)
        if handle is not None:
            handle.cancel()

    def _hold_slot(self, call: Call, hold: bool) -> None:
        if hold and call not in self._running:
            self._running.add(call)
            self._running_by[call.caller] += 1
        elif not hold and call in self._running:
            self._running.discard(call)
            self._running_by[call.caller] -= 1
            if not self._running_by[call.caller]:
                del self._running_by[call.caller]

    def _unpark(self, call: Call) -> None:
        if self._parked.pop(call.call_id, None) is not None:
            self._parked_by[call.caller] -= 1
            if not self._parked_by[call.caller]:
                del self._parked_by[call.caller]

    def _park(self, call: Call, round_: int) -> Event:
        """The call waits for the client's retry; beyond `inputs.max_parked`, or the caller's share of it, it is
        refused."""
        if len(self._parked) >= self.inputs.max_parked:
            return ParkRefused(TaskLimitError("max_parked", self.inputs.max_parked))
        share = self.limits.max_parked_per_principal
        if self._parked_by[call.caller] >= share:
            return ParkRefused(CallerLimitError("max_parked_per_principal", share))
        claims = inputs.StateClaims(
            call_id=call.call_id,
            round=round_,
            principal=call.caller,
            method=call.method,
            digest=call.digest,
            expires_at_ms=self.clock() + self.inputs.request_state_ttl_ms,
            owner=self.process_id,
        )
        call.request_state = self.signer.sign(claims)
        self._parked[call.call_id] = call
        self._parked_by[call.caller] += 1
        log.info(
            "mrtr_input_required", method=call.method, name=call.name, round=round_, keys=sorted(call.state.inputs)
        )
        return Parked()

    # --- task records -----------------------------------------------------------------------------------------

    async def _create_record(self, call: Call, command: CreateRecord) -> Event:
        """Limits first (nothing is written when refused), then the committed record."""
        decision = call.state.decision
        if command.status is TaskStatus.WORKING:
            if len(self._running) >= self.config.max_running:
                return CommitRefused(TaskLimitError("max_running", self.config.max_running))
            share = self.limits.max_running_per_principal
            if self._running_by[call.caller] >= share:
                return CommitRefused(CallerLimitError("max_running_per_principal", share))
        policy = decision.policy
        assert policy is not None
        now = self.clock()
        call.fence = self.replicas.fence  # taken before the commit: a lease lost meanwhile stops the call
        record = TaskRecord(
            task_id=wire_tasks.new_task_id(),
            principal=call.caller,
            tool=call.name,
            status=command.status,
            created_at_ms=now,
            updated_at_ms=now,
            ttl_ms=legacy_tasks.bounded_ttl_ms(policy.ttl_ms, command.upstream_expires_at_ms, now),
            poll_interval_ms=policy.poll_interval_ms,
            owner=self.process_id,
            on_restart=policy.on_restart,
            request=call.params,
            status_message=command.status_message,
            input_requests=command.input_requests,
            inputs_issued=command.issued,
            # A re-run, and following an upstream's own task after a restart, present the principal again: it is
            # kept sealed with the deployment key until the task settles.
            rerun_principal=self.principals.seal(call.principal)
            if call.principal and (policy.on_restart == "rerun" or command.upstream_task_id)
            else None,
            client_capabilities=call.state.capabilities,
            upstream_task_id=command.upstream_task_id,
            upstream_session_id=call.session.session_id if command.upstream_task_id and call.session else None,
            upstream_input_ids=command.upstream_input_ids or {},
        )
        started = time.perf_counter()
        self._tasks[record.task_id] = call  # before the commit: a committed task is never taken for an orphan
        try:
            await self.store.create(record)
        except StoreError as exc:
            del self._tasks[record.task_id]
            if isinstance(exc, StoreFullError):
                return CommitRefused(TaskLimitError("max_records", self.config.max_records))
            return CommitRefused(ProxyError("Internal error: the task could not be stored", detail=str(exc)))
        call.record = record
        log.info("task_created", task_id=record.task_id, tool=call.name, ttl_ms=record.ttl_ms)
        if command.input_requests:
            self._log_input_required(record.task_id, call.name, command.input_requests)
        if self.metrics is not None:
            self.metrics.tasks_created.labels(self.metrics.tool_label(call.name)).inc()
            path = "task" if decision.task_first else "window"
            self.metrics.create_seconds.labels(path).observe(time.perf_counter() - started)
        return Committed(record.task_id)

    async def _write_inputs(self, call: Call, command: WriteInputs) -> Event | None:
        task_id = call.state.task_id
        assert task_id is not None
        try:
            updated = await self.store.set_inputs(
                task_id,
                command.input_requests,
                command.issued,
                now_ms=self.clock(),
                fence=call.fence,
                upstream_input_ids=command.upstream_input_ids,
            )
        except FencedError:
            return LeaseLost()
        except StoreError as exc:
            log.error("task_inputs_not_stored", task_id=task_id, error=str(exc))
            return None
        if updated is not None and command.input_requests:
            self._log_input_required(task_id, call.name, command.input_requests)
        return None

    async def _write_progress(self, call: Call, command: WriteProgress) -> Event | None:
        assert call.state.task_id is not None
        try:
            await self.store.set_status_message(
                call.state.task_id, command.status_message, now_ms=self.clock(), fence=call.fence
            )
        except FencedError:
            return LeaseLost()
        except StoreError as exc:  # a lost progress line is not worth failing the task for
            log.warning("task_progress_not_stored", task_id=call.state.task_id, error=str(exc))
        return None

    def _log_input_required(self, task_id: str, tool: str, input_requests: JSON) -> None:
        methods = sorted(
            {str(request.get("method")) for request in input_requests.values() if isinstance(request, dict)}
        )
        log.info("task_input_required", task_id=task_id, tool=tool, keys=sorted(input_requests), methods=methods)

    async def _settle(self, call: Call, command: Settle) -> Event | None:
        task_id = call.state.task_id
        assert task_id is not None
        try:
            settled = await self.store.settle(
                task_id,
                command.status,
                now_ms=self.clock(),
                result=command.result,
                error=command.error,
                status_message=command.status_message,
                fence=call.fence,
            )
        except FencedError:
            return LeaseLost()  # another replica owns the task now: its outcome is that replica's to write
        except StoreError as exc:  # the record stays live; its TTL (or a take-over) ends it
            log.error("task_not_settled", task_id=task_id, status=command.status.value, error=str(exc))
            return None
        self._settled(settled)
        return None

    def _settled(self, record: TaskRecord | None, **context: Any) -> None:
        """Every settlement that won (the first) is logged and counted here, whoever settled it."""
        if record is None:
            return
        log.info("task_settled", task_id=record.task_id, tool=record.tool, status=record.status.value, **context)
        if record.status is TaskStatus.COMPLETED:
            duration_ms = record.updated_at_ms - record.created_at_ms
            self.durations.observe(record.tool, duration_ms)  # at once here; for every replica through the store
            self.spawn(self._share_duration(record.tool, duration_ms), f"duration-{record.task_id}")
        if self.metrics is not None:
            tool = self.metrics.tool_label(record.tool)
            self.metrics.tasks_settled.labels(tool, record.status.value).inc()
            lifetime_seconds = max(0, record.updated_at_ms - record.created_at_ms) / 1000
            self.metrics.task_seconds.labels(tool, record.status.value).observe(lifetime_seconds)

    def paced(self, record: TaskRecord) -> TaskRecord:
        """The record as the client sees it: a working task's `pollIntervalMs` follows its tool's usual
        duration (`pacing.py`); the stored value is the policy's."""
        if record.status is not TaskStatus.WORKING or record.poll_interval_ms is None:
            return record
        interval = pacing.poll_interval_ms(
            record.poll_interval_ms,
            created_at_ms=record.created_at_ms,
            now_ms=self.clock(),
            expected_ms=self.durations.expected_ms(record.tool),
        )
        return record if interval == record.poll_interval_ms else replace(record, poll_interval_ms=interval)

    # --- tasks/get, tasks/update, tasks/cancel, expiry -----------------------------------------------------

    async def observe(self, task_id: str, caller: Caller) -> TaskRecord:
        """The caller's own, unexpired task, or -32602 (the same for an unknown, foreign or expired id, so
        ids cannot be probed). A live task seen past its TTL is failed now (and its call stopped)."""
        record = await self.store.get(task_id, principal=self.principals.key_of(caller.principal))
        if record is None:
            raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
        if record.expired(self.clock()):
            if record.status.terminal:
                await self.store.delete(task_id)  # past its TTL a settled record goes (the sweep would drop it too)
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            expired = await self._expire(record) or await self.store.get(task_id)
            if expired is None:
                raise InvalidParamsError(wire_tasks.NOT_FOUND_MESSAGE)
            return expired
        return self.paced(record)

    async def update(self, task_id: str, caller: Caller, responses: Mapping[str, Any]) -> None:
        """Answers for the task's outstanding questions go upstream; the ack does not wait for the state change.
        For a task whose call runs on another replica they are checked against the questions its record shows
        (-32602 naming the key) and stored as a message to its owner, which the feed wakes."""
        record = await self.observe(task_id, caller)
        if record.status.terminal:
            return
        call = self._tasks.get(task_id)
        if call is None:
            answers = remote.check_answers(record.input_requests, responses)
            if answers:
                await self.replicas.post_answers(task_id, answers)
            return
        answers = machine.answers(call.state, responses)
        if answers:
            await self.submit(call, Answered(answers))

    async def cancel(self, task_id: str, caller: Caller) -> None:
        """Ack even on a settled task; a live one is settled `cancelled` (unless it settles first) and its
        call stopped (`notifications/cancelled` upstream): here, or by its owner when the feed tells it."""
        record = await self.observe(task_id, caller)
        if record.status.terminal:
            return
        settled = await self.store.settle(
            task_id, TaskStatus.CANCELLED, now_ms=self.clock(), status_message=CANCELLED_BY_CLIENT
        )
        self._settled(settled, reason=CANCELLED_BY_CLIENT)
        call = self._tasks.get(task_id)
        if call is not None:
            await self.submit(call, Stop(CANCELLED_BY_CLIENT))

    async def _fail(self, task_id: str, message: str, fence: Fence | None = None) -> TaskRecord | None:
        settled = await self.store.settle(
            task_id,
            TaskStatus.FAILED,
            now_ms=self.clock(),
            error=wire_tasks.internal_error(message),
            status_message=message,
            fence=fence,
        )
        self._settled(settled, reason=message)
        return settled

    async def _expire(self, record: TaskRecord) -> TaskRecord | None:
        settled = await self._fail(record.task_id, wire_tasks.EXPIRED_MESSAGE)
        call = self._tasks.get(record.task_id)
        if call is not None:
            error = wire_tasks.internal_error(wire_tasks.EXPIRED_MESSAGE)
            await self.submit(call, Stop(wire_tasks.EXPIRED_MESSAGE, error))
        if settled is not None:
            log.info("task_expired", task_id=record.task_id, tool=record.tool)
        return settled

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def parked(self) -> int:
        return len(self._parked)
