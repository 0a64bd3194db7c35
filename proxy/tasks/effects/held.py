"""The held upstream request of a call (`StartCall`, `Answer`, `Refuse`, `CancelCall`): sent on a session leased
for it (after its slot in the call queue, when a cap is in force), its events fed back by the pump, its
questions answered or refused. Imports the pump, the slots, the call queue and the upstream pool; not the store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import structlog

from proxy.errors import ProxyError
from proxy.observe.metrics import Metrics
from proxy.tasks.effects import pump
from proxy.tasks.effects.call_queue import Admission, Caps
from proxy.tasks.effects.slots import Parking
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine import inputs
from proxy.tasks.machine.commands import Answer, Asked, CancelCall, Command, Event, Reclaimed, Refuse, StartCall
from proxy.tasks.ports import Feed, Spawner
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import Session
from proxy.wire import translate
from proxy.wire.jsonrpc import JSON
from proxy.wire.upstream_events import refusal

log = structlog.get_logger(__name__)


class HeldRequest:
    def __init__(
        self,
        feed: Feed,
        spawner: Spawner,
        pool: SessionPool,
        parking: Parking,
        caps: Callable[[], Caps],
        metrics: Metrics | None = None,
    ) -> None:
        self.feed = feed
        self.spawner = spawner
        self.pool = pool
        self.parking = parking
        self.caps = caps  # the caps in force (`upstream.max_concurrent_calls`, the tools' `max_concurrent`)
        self.metrics = metrics
        self.admission: Admission | None = None  # the queue of those caps, once one is in force; None: no queue

    def caps_swapped(self, any_cap: bool) -> None:
        """At start and after a live reload: whether any cap is in force now. With none there is no queue and no
        per-call work; once one was in force, the queue stays (a cap removed admits every queued call at once,
        and the calls keep being counted, so a cap set again counts the ones running)."""
        if self.admission is not None:
            self.admission.changed()
        elif any_cap:
            self.admission = Admission(self.caps, self.feed, self.metrics, self.spawner)

    async def start(self, call: LiveCall, command: StartCall) -> None:
        """Send the upstream request and feed what comes back to the machine, until its final event (or until
        the call is abandoned)."""

        async def send(session: Session) -> None:
            async with session.call(call.method, call.params, call.headers) as upstream:
                pump.sending(call, upstream)
                await pump.stream(self.feed, call, upstream, until=lambda: not call.state.running)

        session = self._session(call)
        admission = self.admission
        if admission is not None:  # the request waits for a slot (and holds it until it ends)
            session = admission.slot(call, session)
        pump.start(self.spawner, self.feed, call, session, send, f"upstream-{call.call_id}")

    def _session(self, call: LiveCall) -> AbstractAsyncContextManager[Session]:
        """A call whose client could answer a question (it declared elicitation, sampling or roots) gets an
        upstream session of its own while it runs: whatever the upstream sends on that session's GET stream (a
        question naming no request) is this call's, never a guess; so does a call of a tool seen asking before.
        The others share the principal's session; a question sent there unasked is the call's while it runs
        there alone, else refused at once (questions on the call's own stream stay the call's, and its client is
        told what it lacks)."""
        asks = inputs.could_answer(call.state.capabilities)
        reclaim = lambda: self._reclaim(call)  # noqa: E731 - bound to this call
        asker = f"{call.method} {call.name}"  # a call of it seen asking before gets a session of its own too
        sink = pump.sink(self.feed, call)
        return self.pool.lease(call.principal, sink, asks=asks, reclaim=reclaim, asker=asker)

    def _reclaim(self, call: LiveCall) -> bool:
        """The pool has no upstream session left to lend (stdio processes are bounded) and asks for this call's:
        given up only while the call waits parked for an MRTR retry, and then it ends as if nobody retried in
        time (its requestState is refused and the client sends the request afresh)."""
        if not self.parking.holds(call):
            return False
        log.info("mrtr_call_reclaimed", method=call.method, name=call.name, round=call.state.round)
        self.spawner.spawn(self.feed.dispatch(call, Reclaimed()), f"reclaim-{call.call_id}")
        return True

    async def answer(self, call: LiveCall, command: Answer) -> None:
        await self._respond(call, command.upstream_id, result=command.result)

    async def refuse(self, call: LiveCall, command: Refuse) -> None:
        log.info(
            "input_request_refused",
            task_id=call.state.task_id,
            name=call.name,
            input_method=command.method,
            reason=command.reason,
        )
        result, error = refusal(command.method)
        await self._respond(call, command.upstream_id, result=result, error=error)

    async def _respond(
        self, call: LiveCall, upstream_id: int | str, *, result: JSON | None, error: JSON | None = None
    ) -> None:
        if call.upstream.session is None:
            return
        try:
            await call.upstream.session.respond(upstream_id, result=result, error=error)
        except ProxyError as exc:  # the call is lost; its stream ends it with that error
            log.warning("upstream_answer_not_delivered", task_id=call.state.task_id, error=exc.message)

    async def cancel(self, call: LiveCall, command: CancelCall) -> None:
        """The upstream is told (`notifications/cancelled`: for a legacy server a disconnect is not a cancel),
        then the pump stops. A call whose request is still on its way is cancelled by the session itself."""
        if call.upstream.stream is not None:
            try:
                await call.upstream.stream.cancel(command.reason)
            except ProxyError as exc:
                log.warning("upstream_cancel_failed", task_id=call.state.task_id, error=exc.message)
        stop_pump(call)


def stop_pump(call: LiveCall) -> None:
    if call.upstream.pump is not None and call.upstream.pump is not asyncio.current_task():
        call.upstream.pump.cancel()


class QuestionCounter:
    """Counts each question the upstream asks for the client: relayed, or refused at once (its span event is
    `services/observers.py`'s)."""

    def __init__(self, metrics: Metrics | None) -> None:
        self.metrics = metrics

    def __call__(self, call: LiveCall, event: Event, commands: list[Command]) -> None:
        if not isinstance(event, Asked):
            return
        question = event.question
        refused = any(isinstance(command, Refuse) and command.upstream_id == question.id for command in commands)
        if self.metrics is None or question.method not in translate.INPUT_METHODS:
            return
        self.metrics.input_requests.labels(question.method, "refused" if refused else "relayed").inc()
