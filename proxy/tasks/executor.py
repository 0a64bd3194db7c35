"""Carries out what a call's machine (`machine/`) decides: feeds it one event at a time (under the call's
lock), looks each command up by its type in the table of effects (`effects/`), runs it, and feeds the event a
command is answered with (`Committed`, `Parked`, ...) next, before anything else reaches the call. Each effect
is registered with the command type it carries out (`register`, checked by the type checker). An effect that
fed its own call again (`dispatch` or `submit` from inside the call's lock) would wait for itself forever: that
raises `ReentryError` instead. It decides nothing and keeps no state of its own beyond which task holds which
call's lock. Imports the machine and the ports; no effect, store or upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from proxy.tasks import machine
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import Command, Event
from proxy.tasks.ports import Effect, Spawner

_C = TypeVar("_C", bound=Command)

# Sees each event of a call with the commands it brought (metrics, the audit trail).
Observer = Callable[[LiveCall, Event, list[Command]], None]


class ReentryError(RuntimeError):
    """An event fed to a call from inside that call's own lock (an effect feeding its own call while it is
    carried out): it could only wait for itself."""


class Executor:
    def __init__(self, spawner: Spawner, observers: Sequence[Observer] = ()) -> None:
        self.spawner = spawner
        self.observers = tuple(observers)
        self._forgetters: list[Callable[[LiveCall], None]] = []  # each owner's drop of a finished call
        self.effects: dict[type, Effect[Any]] = {}  # filled only by `register`, which keeps it typed
        self._holders: dict[LiveCall, asyncio.Task[Any] | None] = {}  # the task inside each call's lock

    def register(self, kind: type[_C], effect: Effect[_C]) -> None:
        """`effect` carries out every command of type `kind` (one effect per type)."""
        if kind in self.effects:
            raise ValueError(f"an effect is already registered for {kind.__name__}")
        self.effects[kind] = effect

    def when_finished(self, forget: Callable[[LiveCall], None]) -> None:
        """`forget` drops what its owner keeps of a call once the machine says the call is finished (run in the
        order registered, inside the call's lock)."""
        self._forgetters.append(forget)

    def _refuse_reentry(self, call: LiveCall) -> None:
        if call in self._holders and self._holders[call] is asyncio.current_task():
            raise ReentryError(f"an event for call {call.call_id} was fed from inside its own lock")

    async def dispatch(self, call: LiveCall, event: Event) -> None:
        self._refuse_reentry(call)
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
                        follow_up = await self.effects[type(command)](call, command)
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
