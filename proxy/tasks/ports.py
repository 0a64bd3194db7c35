"""The only ways back up from an effect or a service to what drives the calls: `Feed` (an event for a call,
fed under its lock), `Spawner` (named background work) and `CredentialBindings` (the upstream credentials a
task keeps).
Protocols only; imports the command vocabulary and the live call, nothing that does I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from proxy.principals import Identity
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


class CredentialBindings(Protocol):
    """The upstream credential source's view of tasks (`upstream.credentials`): what renews a task's credential
    is kept while the task is live (`bind`, here), and erased after its caller's last task settled (`release`);
    `keeps_grants`: something is kept at all (the sweep erases what no live task needs any more)."""

    keeps_grants: bool

    def bind(self, principal: Identity | None, task_id: str) -> None: ...

    def release(self, caller: str, task_id: str) -> None: ...
