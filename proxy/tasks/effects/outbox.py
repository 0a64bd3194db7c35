"""The settlement outbox: task record writes (a result, an error, questions, progress) the store could not take
because it was unavailable, kept in memory in order per task and written again with backoff until it takes
them. A fenced refusal (another replica owns the task now) drops the task's writes; a settlement refused (so, or
because the task ended otherwise meanwhile) is told to its `refused` (logged, counted). Bounded: see `keep`.
Imports the store's errors and fence, and the metrics; no upstream, no effect.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Literal

import structlog

from proxy.observe.metrics import Metrics
from proxy.tasks.store import Fence, FencedError, StoreError, StoreUnavailableError
from proxy.wire.tasks import TaskRecord

log = structlog.get_logger(__name__)

Kind = Literal["progress", "queue", "inputs", "settle"]
Write = Callable[[Fence | None], Awaitable[TaskRecord | None]]
Reclaim = Callable[[str], Awaitable[Fence | None]]
Written = Callable[[TaskRecord | None], None]
# A settlement the store refused, told why: (fenced: another replica owns the task; seconds it waited here)
Refused = Callable[[bool, float], Awaitable[None]]

FIRST_RETRY_SECONDS: Final = 0.1  # a store back at once (a lock, a blip) is written to within a tenth of a second
LAST_RETRY_SECONDS: Final = 2.0  # the longest wait between tries: once the store is back, a settlement waits < 2 s
JITTER: Final = 0.2  # ± this share of each wait, so replicas that lost one store do not retry in step


@dataclass(slots=True)
class Pending:
    """One write waiting: `write(fence)` carries it out under the call's fence as it is when tried."""

    kind: Kind
    write: Write
    written: Written  # the bookkeeping of a write that succeeded (its log line, metrics)
    refused: Refused | None = None  # a settlement's: told (logged, counted) when the store refuses it
    kept_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class TaskWrites:
    fence: Callable[[], Fence | None]
    queue: deque[Pending] = field(default_factory=deque)
    trying: Pending | None = None  # being written right now: never replaced


class Outbox:
    def __init__(self, limit: int, metrics: Metrics | None, reclaim: Reclaim | None = None) -> None:
        self.limit = limit
        self.metrics = metrics
        # A refused write: is the task still this replica's under a renewed lease? (`ReplicaLink.reclaim`)
        self.reclaim = reclaim
        self._tasks: OrderedDict[str, TaskWrites] = OrderedDict()  # the oldest task first
        self._count = 0  # writes waiting, over all tasks
        self._wake = asyncio.Event()
        self.retry_seconds = FIRST_RETRY_SECONDS

    # --- what the record writes ask -----------------------------------------------------------------------

    def holds(self, task_id: str) -> bool:
        """Writes of `task_id` wait here: a new one must go after them (the normal path pays a dict lookup)."""
        return task_id in self._tasks

    @property
    def full(self) -> bool:
        """At the limit: no new task may start (its writes would add to the ones waiting)."""
        return self._count >= self.limit

    @property
    def count(self) -> int:
        return self._count

    @property
    def tasks(self) -> int:
        """Tasks with writes waiting: each is a task that has not ended in the store yet (a drain waits for them)."""
        return len(self._tasks)

    def keep(
        self,
        task_id: str,
        kind: Kind,
        fence: Callable[[], Fence | None],
        write: Write,
        written: Written,
        reason: str,
        refused: Refused | None = None,
    ) -> None:
        """Keep one write of `task_id` after the ones already waiting.

        The newest progress line or set of questions replaces a waiting one of the same kind at the end of the
        task's queue (it writes the same columns, newer). At the limit a progress-only write that replaces
        nothing is dropped (logged): the next progress line or the settlement supersedes it. Questions and
        settlements are always kept: they are results, and new tasks are refused at the limit, so only calls
        already running can add to them (at most `tasks.max_running` more).
        """
        entry = self._tasks.get(task_id)
        if entry is None:
            entry = self._tasks[task_id] = TaskWrites(fence)
        last = entry.queue[-1] if entry.queue else None
        if kind != "settle" and last is not None and last.kind == kind and last is not entry.trying:
            entry.queue[-1] = Pending(kind, write, written, kept_at=last.kept_at)
            return
        if kind == "progress" and self.full:
            if not entry.queue:
                del self._tasks[task_id]
            log.warning("task_progress_not_stored", task_id=task_id, error="store.max_pending_settlements reached")
            return
        entry.queue.append(Pending(kind, write, written, refused))
        self._count += 1
        self._counted()
        log.warning("settlement_pending", task_id=task_id, write=kind, pending=self._count, reason=reason)
        self._wake.set()

    def task_ids(self) -> list[str]:
        """The tasks with writes waiting, oldest first: their calls have ended, so a lease check that looks at
        the running calls must look here too."""
        return list(self._tasks)

    def refence(self, task_id: str, fence: Fence) -> None:
        """A lease renewed under a new epoch still owns `task_id` (no survivor took it): its waiting writes are
        tried under `fence` from now on instead of the fence of the call that made them."""
        entry = self._tasks.get(task_id)
        if entry is not None:
            entry.fence = lambda: fence

    # --- writing them -----------------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        """Wait for writes, then try them until the store takes them all (backoff between failed rounds)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._tasks:
                if await self.try_all():
                    self.retry_seconds = FIRST_RETRY_SECONDS
                    continue
                await asyncio.sleep(self.retry_seconds * random.uniform(1 - JITTER, 1 + JITTER))
                self.retry_seconds = min(self.retry_seconds * 2, LAST_RETRY_SECONDS)

    async def try_all(self) -> bool:
        """One round, oldest task first, each task's writes in order. False as soon as the store is still
        unavailable (the rest waits for the next round); True when everything waiting was written or dropped."""
        for task_id in list(self._tasks):
            entry = self._tasks.get(task_id)
            while entry is not None and entry.queue:
                pending = entry.trying = entry.queue[0]
                refused = entry.fence()
                try:
                    try:
                        record = await pending.write(refused)
                    except FencedError:
                        # The store is back and the lease lapsed in the outage: this write may come before the
                        # renewal, or before the lapsed lease's recovery re-fences it. Tried once more under
                        # the renewed lease while the task is still this replica's (as a direct write is).
                        fence = None if self.reclaim is None else await self.reclaim(task_id)
                        if fence is None or fence == refused:
                            raise
                        log.info("task_lease_resumed", task_id=task_id, epoch=fence.epoch)
                        self.refence(task_id, fence)
                        record = await pending.write(fence)
                except StoreUnavailableError:  # the store's health notes it (store_available)
                    return False
                except FencedError:
                    dropped = list(entry.queue)
                    log.info(
                        "settlement_dropped", task_id=task_id, writes=[each.kind for each in dropped], reason="fenced"
                    )
                    self._drop(task_id, len(dropped))
                    for each in dropped:  # a settlement among them is told, never dropped silently
                        if each.refused is not None:
                            await each.refused(True, time.monotonic() - each.kept_at)
                    break
                except StoreError as exc:  # not transient (a corrupt record, a closed store): as a direct write would
                    log.error("task_not_settled", task_id=task_id, write=pending.kind, error=str(exc))
                    self._pop(task_id, entry)
                else:
                    self._pop(task_id, entry)
                    waited = time.monotonic() - pending.kept_at
                    if record is not None and pending.kind == "settle":
                        status = record.status.value
                        log.info(
                            "settlement_written_late", task_id=task_id, status=status, waited_seconds=round(waited, 3)
                        )
                    pending.written(record)
                    if record is None and pending.refused is not None:  # the task had ended otherwise meanwhile
                        await pending.refused(False, waited)
                finally:
                    entry.trying = None
        return True

    async def close(self) -> None:
        """Shutdown: one last round; what the store still does not take is logged by task id (never its value)."""
        if self._tasks:
            await self.try_all()
        for task_id, entry in self._tasks.items():
            kinds = [pending.kind for pending in entry.queue]
            log.error("settlement_lost", task_id=task_id, writes=kinds, reason="the store was unavailable at shutdown")
        self._drop_all()

    # --- bookkeeping ------------------------------------------------------------------------------------------

    def _pop(self, task_id: str, entry: TaskWrites) -> None:
        entry.queue.popleft()
        self._count -= 1
        if not entry.queue:
            del self._tasks[task_id]
        self._counted()

    def _drop(self, task_id: str, count: int) -> None:
        del self._tasks[task_id]
        self._count -= count
        self._counted()

    def _drop_all(self) -> None:
        self._tasks.clear()
        self._count = 0
        self._counted()

    def _counted(self) -> None:
        if self.metrics is not None:
            self.metrics.store_pending_settlements.set(self._count)
