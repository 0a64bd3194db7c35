"""The task runner: carries out what each call's machine (`machine.py`) decides, and owns every background
coroutine of a call that may outlive its HTTP request.

For each call it keeps the machine's state beside what carrying it out needs (the upstream session and
request, timers, the waiting client's reply and stream), feeds it events one at a time (under the call's lock)
and executes the commands that come out: store writes, upstream answers and cancels, replies, timers, the
`max_running` slots and the parked MRTR calls; what concerns a task the upstream runs itself is carried out
by `upstream_tasks.py`. It decides nothing itself. The task records and the task-level operations that need
no call (`tasks/get`, `tasks/update`, `tasks/cancel`, TTL sweeps, restart recovery) are `records.py`, mixed
in. With several replicas on one store (`replicas.py` carries the lease, the feed and the messages) it writes
as a task's owner only under its lease's fence and forwards MRTR retries for calls parked on another replica;
what other replicas do reaches its calls through `replica_calls.py` (mixed in too). Imports the store, the
upstream client, the machine, policy and wire; never aiohttp's web side or the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar

import structlog

from proxy.config import Config
from proxy.errors import CallerLimitError, InvalidParamsError, ProxyError, TaskLimitError
from proxy.observability import Metrics
from proxy.policy import SYNC_CALL, Decision, decide
from proxy.principals import Principals
from proxy.tasks import inputs, machine, pacing, remote
from proxy.tasks.calls import Call, wall_clock_ms
from proxy.tasks.commands import (
    Answer,
    Asked,
    CancelCall,
    CancelUpstreamTask,
    ClearTimer,
    ClientLeft,
    Command,
    CreateRecord,
    Ended,
    Event,
    FollowUpstreamTask,
    HoldSlot,
    Notified,
    Park,
    Parked,
    ParkRefused,
    PollUpstreamTask,
    Refuse,
    Relay,
    ReleaseCall,
    Reply,
    Resumed,
    SetTimer,
    Settle,
    ShutDown,
    Start,
    StartCall,
    Timer,
    TimerFired,
    Unpark,
    WriteInputs,
    WriteProgress,
)
from proxy.tasks.records import TaskRecords
from proxy.tasks.replica_calls import ReplicaCalls
from proxy.tasks.replicas import ReplicaLink
from proxy.tasks.state import CallState
from proxy.tasks.store import TaskStore
from proxy.tasks.upstream_tasks import UpstreamTasks
from proxy.upstream.events import (
    UpstreamEvent,
    UpstreamNotification,
    UpstreamServerRequest,
    refusal,
)
from proxy.upstream.kinds import Session
from proxy.upstream.pool import UpstreamClient
from proxy.wire import translate
from proxy.wire.envelope import Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

SHUTDOWN_GRACE_SECONDS: Final = 5.0  # how long close() waits for cancelled calls to tell the upstream
SHUTTING_DOWN: Final = "the proxy is shutting down"

_T = TypeVar("_T")


class TaskRunner(TaskRecords, ReplicaCalls):
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
        """A call whose client could answer a question (it declared elicitation, sampling or roots) gets an
        upstream session of its own while it runs: whatever the upstream sends on that session's GET stream (a
        question naming no request) is this call's, never a guess. The others share the principal's session;
        a question sent there unasked is refused at once (questions on the call's own stream stay the call's,
        and its client is told what it lacks)."""

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

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def open_calls(self) -> int:
        """Calls not finished yet (tasks, synchronous calls, parked MRTR rounds): what a drain waits for."""
        return len(self._calls)

    @property
    def parked(self) -> int:
        return len(self._parked)
