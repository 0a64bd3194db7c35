"""The upstream's concurrency cap (`upstream.max_concurrent_calls`, and a tool's own `max_concurrent`): a fair
queue, round robin across callers, telling each call its place and when it goes; caps read live. Imports the
policy, the ports, the command vocabulary, errors and the metrics; no store, no upstream."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Final, TypeVar

from proxy.background import Background
from proxy.config.schema import TasksConfig
from proxy.errors import QueueTimeoutError
from proxy.observe.metrics import Metrics
from proxy.policy import policy_for
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine.commands import Admitted, Queued, QueueMoved
from proxy.tasks.ports import Feed, Spawner

_T = TypeVar("_T")

FIRST_HOLD_SECONDS: Final = 1.0  # the estimate of one call's hold time before any call ended
HOLD_SMOOTHING: Final = 0.2  # weight of the latest call's hold time in the running estimate
POSITION_SECONDS: Final = 0.5  # a queued call learns a new place at most this often
POSITIONS_TOLD: Final = 100  # ... if it is among the first this many in line (each told place is a store write)

Waiter = tuple[LiveCall, "asyncio.Future[None]"]


@dataclass(frozen=True)
class Caps:
    """The caps in force: the upstream's (`upstream.max_concurrent_calls`, `upstream.max_queue_wait_ms`) and the
    tools' (`tasks`; None: each call's own policy says its tool's cap)."""

    max_concurrent: int
    max_wait_ms: int
    tasks: TasksConfig | None = None


class Admission:
    """Places are told coalesced, not at each move: at most every `POSITION_SECONDS`, a call among the first
    `POSITIONS_TOLD` in line whose place differs from the one it was last told learns its new one (each is one store
    write for a task); a call further back keeps the place it was told until it comes that far. Imports the policy,
    the ports, the command vocabulary, errors and the metrics; no store, no upstream."""

    def __init__(
        self,
        caps: Callable[[], Caps],
        feed: Feed,
        metrics: Metrics | None = None,
        spawner: Spawner | None = None,
    ) -> None:
        self.caps = caps  # read at each admission: a live reload swaps what it returns
        self.feed = feed
        self.metrics = metrics  # the queue's depth by tool, and how long queued calls waited
        # Runs the telling of new places (None: an owner of its own, for an Admission used alone).
        self.spawner: Spawner = spawner if spawner is not None else Background()
        self._holders: dict[LiveCall, float] = {}  # since when (monotonic seconds) each holds its slot
        self._queues: dict[str, deque[Waiter]] = {}  # by caller, in the order of the round
        self._by_tool: dict[str, int] = {}  # holders of each tool (of tools/call), so a cap set later counts them
        self._hold_seconds = FIRST_HOLD_SECONDS
        self._told: dict[LiveCall, int] = {}  # the place each queued call was last told
        self._moved = False  # the queue changed since places were last told
        self._telling: asyncio.Task[None] | None = None

    @property
    def max_concurrent(self) -> int:
        return self.caps().max_concurrent

    @property
    def max_wait_ms(self) -> int:
        return self.caps().max_wait_ms

    def changed(self) -> None:
        """After a live reload: the calls that wait are admitted by the caps now in force. A raised cap admits
        queued calls at once; a lowered one admits none until the calls running are below it."""
        if self._queues:
            self._grant()

    def slot(self, call: LiveCall, inner: AbstractAsyncContextManager[_T]) -> AbstractAsyncContextManager[_T]:
        """`inner` (the call's upstream session) entered once the call holds a slot, which it keeps until it
        leaves; a call with no free slot waits its turn first."""
        return _Slot(self, call, inner)

    def free(self, call: LiveCall) -> bool:
        """The call's tool is under its own cap (`tasks.tools.<name>.max_concurrent`), or has none."""
        cap = self._tool_cap(call)
        return cap is None or self._by_tool.get(call.name, 0) < cap

    def _tool_cap(self, call: LiveCall) -> int | None:
        policy = call.state.decision.policy
        if policy is None:  # prompts/get, resources/read: no tool policy
            return None
        tasks = self.caps().tasks
        return policy.max_concurrent if tasks is None else policy_for(tasks, call.name).max_concurrent

    def hold(self, call: LiveCall) -> None:
        self._holders[call] = time.monotonic()
        if call.state.decision.policy is not None:
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
        self._told[call] = ahead
        self._queue_moved()  # a new caller's turn may come before calls already waiting
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
        cap = self._tool_cap(call)
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
        self._told.pop(entry[0], None)
        if not queue:
            del self._queues[caller]
        self._queue_moved()

    def release(self, call: LiveCall) -> None:
        since = self._holders.pop(call, None)
        if since is None:
            return
        if call.state.decision.policy is not None:
            held = self._by_tool[call.name] - 1
            if held:
                self._by_tool[call.name] = held
            else:
                del self._by_tool[call.name]
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
            self._told.pop(call, None)
            if queue:
                self._queues[caller] = queue
            self._queue_moved()
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

    # --- telling queued calls their new place -------------------------------------------------------------

    def _queue_moved(self) -> None:
        """The queue changed: the calls whose place differs learn it, coalesced (see the module's doc)."""
        self._moved = True
        if (self._telling is None or self._telling.done()) and self._told:
            telling = self._tell_places()
            self._telling = self.spawner.spawn(telling, "queue-places")

    async def _tell_places(self) -> None:
        while self._moved and self._told:
            await asyncio.sleep(POSITION_SECONDS)
            self._moved = False
            changed = [(call, ahead) for call, ahead in self.places() if self._told.get(call, ahead) != ahead]
            for call, ahead in changed:
                self._told[call] = ahead
            if changed:
                await asyncio.gather(*(self.feed.dispatch(call, QueueMoved(ahead)) for call, ahead in changed))

    def places(self) -> list[tuple[LiveCall, int]]:
        """The calls among the first `POSITIONS_TOLD` in line, with the calls admitted before each. What is ahead
        of a call grows with its place in its caller's queue and with its caller's turn in the round (each
        caller before it there has a call before it), so each queue is looked at only until that many are
        ahead, and only the first `POSITIONS_TOLD` callers of the round are: a few hundred looks at most."""
        places: list[tuple[LiveCall, int]] = []
        for turn, (caller, queue) in enumerate(self._queues.items()):
            if turn >= POSITIONS_TOLD:
                break
            for place, (call, waiter) in enumerate(queue):
                ahead = self._ahead(caller, place)
                if ahead >= POSITIONS_TOLD:
                    break
                if not waiter.done():
                    places.append((call, ahead))
        return places

    def _count(self, call: LiveCall, change: int) -> None:
        if self.metrics is not None:
            self.metrics.queued_calls.labels(self.metrics.tool_label(call.name)).inc(change)

    def depth(self) -> int:
        """Calls waiting for a slot."""
        return sum(len(queue) for queue in self._queues.values())

    @property
    def held(self) -> int:
        return len(self._holders)


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
