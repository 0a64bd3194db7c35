"""Carries out what a call's machine decides: feeds it one event at a time under the call's lock, hands each
command to the command → effect table (`effects.Effects.carry_out`) and feeds the event a command is answered
with next. An effect feeding its own call from inside its lock raises `ReentryError` instead of waiting for
itself. Decides nothing; imports the machine and the ports, no effect, store or upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from proxy.tasks import machine
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import Command, Event
from proxy.tasks.ports import Spawner

# Sees each event of a call with the commands it brought (metrics, the audit trail).
Observer = Callable[[LiveCall, Event, list[Command]], None]
# Carries out one command for a call; the event it is answered with, if any (`effects.Effects.carry_out`).
CarryOut = Callable[[LiveCall, Command], Awaitable[Event | None]]


class ReentryError(RuntimeError):
    """An event fed to a call from inside that call's own lock (an effect feeding its own call while it is
    carried out): it could only wait for itself."""


class Executor:
    def __init__(self, spawner: Spawner, observers: Sequence[Observer] = ()) -> None:
        self.spawner = spawner
        self.observers = tuple(observers)
        self._forgetters: list[Callable[[LiveCall], None]] = []  # each owner's drop of a finished call
        self._carry_out: CarryOut | None = None  # the command → effect table, given once by `use`
        self._holders: dict[LiveCall, asyncio.Task[Any] | None] = {}  # the task inside each call's lock

    def use(self, carry_out: CarryOut) -> None:
        """The command → effect table the executor hands every command to; given once, after the effects were
        built with this executor as their feed."""
        if self._carry_out is not None:
            raise ValueError("the executor has its command → effect table already")
        self._carry_out = carry_out

    def when_finished(self, forget: Callable[[LiveCall], None]) -> None:
        """`forget` drops what its owner keeps of a call once the machine says the call is finished (run in the
        order registered, inside the call's lock)."""
        self._forgetters.append(forget)

    def _refuse_reentry(self, call: LiveCall) -> None:
        if call in self._holders and self._holders[call] is asyncio.current_task():
            raise ReentryError(f"an event for call {call.call_id} was fed from inside its own lock")

    async def dispatch(self, call: LiveCall, event: Event) -> None:
        self._refuse_reentry(call)
        carry_out = self._carry_out
        assert carry_out is not None, "the executor was given no command → effect table (`use`)"
        async with call.lock:
            self._holders[call] = asyncio.current_task()
            try:
                pending: list[Event] = [event]
                while pending:
                    current = pending.pop(0)
                    commands = machine.handle(call.state, current)
                    for observe in self.observers:
                        observe(call, current, commands)
                    for command in commands:
                        follow_up = await carry_out(call, command)
                        if follow_up is not None:
                            pending.append(follow_up)
                if machine.finished(call.state):
                    for forget in self._forgetters:
                        forget(call)
            finally:
                del self._holders[call]

    async def submit(self, call: LiveCall, event: Event) -> None:
        """A request handler's event runs to its end even if the handler is cancelled meanwhile (a half-carried
        out command would leave the call stuck)."""
        self._refuse_reentry(call)
        await asyncio.shield(self.spawner.spawn(self.dispatch(call, event), f"call-{call.call_id}"))
