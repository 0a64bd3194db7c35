"""The only ways back up from an effect or a service to what drives the calls: `Feed` (an event for a call,
fed under its lock) and `Spawner` (named background work).
Protocols only; imports the command vocabulary and the live call, nothing that does I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import Event

_T = TypeVar("_T")


class Feed(Protocol):
    async def dispatch(self, call: LiveCall, event: Event) -> None:
        """Feed `event` to the call's machine and carry out what comes out, one event at a time per call."""
        ...

    async def submit(self, call: LiveCall, event: Event) -> None:
        """`dispatch` on behalf of a request handler: it runs to its end even if the handler is cancelled."""
        ...


class Spawner(Protocol):
    def spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]: ...
