"""Carries out what a call's machine (`machine.py`) decides: feeds it one event at a time (under the call's
lock), looks each command up by its type in the table of effects (`effects/`), runs it, and feeds the event a
command is answered with (`Committed`, `Parked`, ...) next, before anything else reaches the call. It decides
nothing and keeps no state of its own. Imports the machine and the ports; no effect, store or upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from proxy.tasks import machine
from proxy.tasks.commands import Command, Event
from proxy.tasks.live_call import LiveCall
from proxy.tasks.ports import Effect, Spawner

# Sees each event of a call with the commands it brought (metrics, the audit trail).
Observer = Callable[[LiveCall, Event, list[Command]], None]


class Executor:
    def __init__(
        self, spawner: Spawner, on_finished: Callable[[LiveCall], None], observers: Sequence[Observer] = ()
    ) -> None:
        self.spawner = spawner
        self.on_finished = on_finished
        self.observers = tuple(observers)
        self.effects: dict[type, Effect] = {}

    def install(self, effects: Mapping[type, Effect]) -> None:
        """The effects are built with this executor as their `Feed`; they are installed once built."""
        self.effects.update(effects)

    async def dispatch(self, call: LiveCall, event: Event) -> None:
        async with call.lock:
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
                self.on_finished(call)

    async def submit(self, call: LiveCall, event: Event) -> None:
        """A request handler's event runs to its end even if the handler is cancelled meanwhile (a half-carried
        out command would leave the call stuck)."""
        await asyncio.shield(self.spawner.spawn(self.dispatch(call, event), f"call-{call.call_id}"))
