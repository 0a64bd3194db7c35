"""The upstream's concurrency cap (`upstream.max_concurrent_calls`, per replica): a call whose upstream request
is sent holds a slot until that request ends; the others wait in a fair queue, round robin across callers and
first come first served within one, so that one caller's burst cannot starve another. A tool may have a lower
cap of its own (`tasks.tools.<name>.max_concurrent`): its calls wait in the same queue while other tools' calls
go on. A call learns that it waits (`Queued`, with its place) and when it goes (`Admitted`); one that leaves
the queue (cancelled, its client gone) frees its place. Imports the ports, the command vocabulary, errors and
the metrics; no store, no upstream.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Final, TypeVar

from proxy.errors import QueueTimeoutError
from proxy.observability import Metrics
from proxy.tasks.commands import Admitted, Queued
from proxy.tasks.live_call import LiveCall
from proxy.tasks.ports import Feed

_T = TypeVar("_T")

FIRST_HOLD_SECONDS: Final = 1.0  # the estimate of one call's hold time before any call ended
HOLD_SMOOTHING: Final = 0.2  # weight of the latest call's hold time in the running estimate

Waiter = tuple[LiveCall, "asyncio.Future[None]"]


class Admission:
    def __init__(self, max_concurrent: int, max_wait_ms: int, feed: Feed, metrics: Metrics | None = None) -> None:
        self.max_concurrent = max_concurrent
        self.max_wait_ms = max_wait_ms
        self.feed = feed
        self.metrics = metrics  # the queue's depth by tool, and how long queued calls waited
        self._holders: dict[LiveCall, float] = {}  # since when (monotonic seconds) each holds its slot
        self._queues: dict[str, deque[Waiter]] = {}  # by caller, in the order of the round
        self._by_tool: dict[str, int] = {}  # holders of each tool that has a cap of its own
        self._hold_seconds = FIRST_HOLD_SECONDS

    def slot(self, call: LiveCall, inner: AbstractAsyncContextManager[_T]) -> AbstractAsyncContextManager[_T]:
        """`inner` (the call's upstream session) entered once the call holds a slot, which it keeps until it
        leaves; a call with no free slot waits its turn first."""
        return _Slot(self, call, inner)

    def free(self, call: LiveCall) -> bool:
        """The call's tool is under its own cap (`tasks.tools.<name>.max_concurrent`), or has none."""
        cap = _tool_cap(call)
        return cap is None or self._by_tool.get(call.name, 0) < cap

    def hold(self, call: LiveCall) -> None:
        self._holders[call] = time.monotonic()
        if _tool_cap(call) is not None:
            self._by_tool[call.name] = self._by_tool.get(call.name, 0) + 1

    async def take(self, call: LiveCall) -> None:
        """The call holds a slot once this returns (at once when one is free and nobody waits)."""
        if len(self._holders) < self.max_concurrent and not self._queues and self.free(call):
            self.hold(call)
            return
        try:
            queued_at = time.monotonic()
            await self._wait(call)
            if self.metrics is not None:
                self.metrics.queue_wait_seconds.observe(time.monotonic() - queued_at)
            await self.feed.dispatch(call, Admitted())
            if not call.state.running:  # abandoned meanwhile from within its own events (its lease was lost)
                raise asyncio.CancelledError
        except BaseException:
            self.release(call)  # granted as it was cancelled: the slot goes to the next
            raise

    async def _wait(self, call: LiveCall) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues.get(call.caller)
        ahead = self._ahead(call.caller, len(queue) if queue is not None else 0)
        if queue is None:
            queue = self._queues[call.caller] = deque()
        entry: Waiter = (call, waiter)
        queue.append(entry)
        self._count(call, 1)
        self._grant()  # a slot may be free for this call's tool while the calls before it wait for theirs
        if waiter.done():
            return
        try:
            await self.feed.dispatch(call, Queued(ahead, self.max_wait_ms, self._refusal(call, ahead)))
            if not call.state.running:  # abandoned from within that event: it leaves the queue
                raise asyncio.CancelledError
            await waiter
        except BaseException:
            if call not in self._holders:  # not granted (its cancel cancels `waiter` too): its place goes
                waiter.cancel()
                self._leave(call.caller, entry)
            raise

    def _ahead(self, caller: str, place: int) -> int:
        """Calls admitted before the one at `place` (0: first) of `caller`'s queue: those before it there, and in
        each round until its turn, one of every other caller still waiting (callers earlier in the round get one
        turn more)."""
        ahead = place
        earlier = True
        for other, queue in self._queues.items():
            if other == caller:
                earlier = False
                continue
            ahead += min(len(queue), place + 1 if earlier else place)
        return ahead

    def _refusal(self, call: LiveCall, ahead: int) -> QueueTimeoutError:
        """What a synchronous caller that waits its whole budget is told: come back when the calls before it
        should be done, by the running estimate of one call's hold time; it names the tighter cap."""
        cap = _tool_cap(call)
        limit, maximum = "upstream.max_concurrent_calls", self.max_concurrent
        if cap is not None and cap < maximum:
            limit, maximum = f"tasks.tools.{call.name}.max_concurrent", cap
        retry_after_seconds = max(1, math.ceil(self._hold_seconds * (ahead + 1) / maximum))
        return QueueTimeoutError(maximum, self.max_wait_ms, retry_after_seconds, limit)

    def _leave(self, caller: str, entry: Waiter) -> None:
        queue = self._queues.get(caller)
        if queue is None:
            return
        try:
            queue.remove(entry)
        except ValueError:
            return
        self._count(entry[0], -1)
        if not queue:
            del self._queues[caller]

    def release(self, call: LiveCall) -> None:
        since = self._holders.pop(call, None)
        if since is None:
            return
        if _tool_cap(call) is not None:
            self._by_tool[call.name] -= 1
        self._hold_seconds += HOLD_SMOOTHING * (time.monotonic() - since - self._hold_seconds)
        if self._queues:
            self._grant()

    def _grant(self) -> None:
        """Free slots go round the callers that wait: the first in the round whose next call's tool is under
        its own cap gets one and goes to the end of the round."""
        while len(self._holders) < self.max_concurrent and self._queues:
            caller = self._next_caller()
            if caller is None:
                return  # every caller's next call waits for its tool
            queue = self._queues.pop(caller)
            call, waiter = queue.popleft()
            self._count(call, -1)
            if queue:
                self._queues[caller] = queue
            if waiter.done():
                continue
            self.hold(call)
            waiter.set_result(None)

    def _next_caller(self) -> str | None:
        for caller, queue in self._queues.items():
            call, waiter = queue[0]
            if waiter.done() or self.free(call):
                return caller
        return None

    def _count(self, call: LiveCall, change: int) -> None:
        if self.metrics is not None:
            self.metrics.queued_calls.labels(self.metrics.tool_label(call.name)).inc(change)

    def depth(self) -> int:
        """Calls waiting for a slot."""
        return sum(len(queue) for queue in self._queues.values())

    @property
    def held(self) -> int:
        return len(self._holders)


def _tool_cap(call: LiveCall) -> int | None:
    policy = call.state.decision.policy
    return policy.max_concurrent if policy is not None else None


class _Slot(AbstractAsyncContextManager[_T]):
    """A slot held around the call's upstream session (a class, not a generator: it is on every call's path)."""

    __slots__ = ("_admission", "_call", "_inner")

    def __init__(self, admission: Admission, call: LiveCall, inner: AbstractAsyncContextManager[_T]) -> None:
        self._admission = admission
        self._call = call
        self._inner = inner

    async def __aenter__(self) -> _T:
        admission = self._admission
        if len(admission._holders) < admission.max_concurrent and not admission._queues and admission.free(self._call):
            admission.hold(self._call)  # a free slot, nobody waits: no coroutine more
        else:
            await admission.take(self._call)
        try:
            return await self._inner.__aenter__()
        except BaseException:
            self._admission.release(self._call)
            raise

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> bool | None:
        try:
            return await self._inner.__aexit__(kind, error, trace)
        finally:
            self._admission.release(self._call)
