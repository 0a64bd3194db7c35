"""The call's timers (`SetTimer`, `ClearTimer`): a timer that fires is fed back to the call as `TimerFired`.
Owns the loop handles (kept on the live call). Imports the ports and the command vocabulary only.
"""

from __future__ import annotations

import asyncio

from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import ClearTimer, SetTimer, Timer, TimerFired
from proxy.tasks.ports import Feed, Spawner


class Timers:
    def __init__(self, feed: Feed, spawner: Spawner) -> None:
        self.feed = feed
        self.spawner = spawner

    async def set(self, call: LiveCall, command: SetTimer) -> None:
        self._clear(call, command.timer)
        loop = asyncio.get_running_loop()
        call.timers[command.timer] = loop.call_later(command.delay_ms / 1000, self._fire, call, command.timer)

    async def clear(self, call: LiveCall, command: ClearTimer) -> None:
        self._clear(call, command.timer)

    def forget(self, call: LiveCall) -> None:
        for timer in list(call.timers):
            self._clear(call, timer)

    def _fire(self, call: LiveCall, timer: Timer) -> None:
        call.timers.pop(timer, None)
        self.spawner.spawn(self.feed.dispatch(call, TimerFired(timer)), f"timer-{timer.value}-{call.call_id}")

    def _clear(self, call: LiveCall, timer: Timer) -> None:
        handle = call.timers.pop(timer, None)
        if handle is not None:
            handle.cancel()
