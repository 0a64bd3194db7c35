"""Group commit of task creations, shared by both stores: creations that arrive while a batch is being
committed wait and are committed together in the next one, by one worker thread.

The work runs in the store's executor thread, never in a caller's coroutine, so a caller that leaves (its
coroutine cancelled) neither cancels nor disturbs its batch. Depends on `base` only.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor

from proxy.tasks.store.base import StoreError, StoreUnavailableError
from proxy.wire.tasks import TaskRecord

# Commits every record given in one transaction; one outcome per record (None: committed). May raise: then
# the whole batch failed and every record gets that error.
CommitAll = Callable[[list[TaskRecord]], list[StoreError | None]]
Outcomes = list[tuple[asyncio.Future[None], StoreError | None]]


def caused(error: StoreError, cause: BaseException) -> StoreError:
    error.__cause__ = cause
    return error


def _answer(commit: asyncio.Future[Outcomes]) -> None:
    """On the loop: each creation of a batch gets its own outcome (unless its caller left)."""
    for committed, error in commit.result():
        if committed.cancelled():
            continue
        if error is None:
            committed.set_result(None)
        else:
            committed.set_exception(error)


class CreationBatcher:
    """Queues creations on the loop; the executor thread takes every queued one at once and commits them."""

    def __init__(self, commit_all: CommitAll, describe: str) -> None:
        self._commit_all = commit_all
        self._describe = describe  # for error messages: which store
        self._queued: list[tuple[TaskRecord, asyncio.Future[None]]] = []
        self._lock = threading.Lock()

    async def create(self, executor: Executor, record: TaskRecord) -> None:
        """Returns once `record` is committed; raises its StoreError (StoreFullError, a duplicate id...)."""
        loop = asyncio.get_running_loop()
        committed: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._queued.append((record, committed))
            first = len(self._queued) == 1
        if first:  # the thread takes every creation queued by the time it starts, this one included
            loop.run_in_executor(executor, self._commit_queued).add_done_callback(_answer)
        await committed

    def _commit_queued(self) -> Outcomes:
        """In the thread: one batch, each creation answered (never raises: nobody may wait forever)."""
        with self._lock:
            queued, self._queued = self._queued, []
        try:
            errors = self._commit_all([record for record, _ in queued])
        # The whole batch is rolled back and each caller gets the error. Anything at all, not only the
        # database's errors: the callers wait on this answer and nothing else would ever give them one.
        except StoreUnavailableError as exc:  # transient: each caller is told so (a 503, retried), not a 500
            errors = [caused(StoreUnavailableError(exc.kind, exc.reason, detail=exc.detail), exc) for _ in queued]
        except Exception as exc:  # noqa: BLE001
            errors = [caused(StoreError(f"task store {self._describe}: create failed: {exc}"), exc) for _ in queued]
        return [(committed, error) for (_, committed), error in zip(queued, errors, strict=True)]
