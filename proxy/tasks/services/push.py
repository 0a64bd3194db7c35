"""Push of task status: which `subscriptions/listen` inboxes follow which tasks, woken by the store's change
feed (every replica's writes on PostgreSQL; a RESYNC wakes them all). No aiohttp; the store is the only I/O."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

import structlog

from proxy.tasks.store import Replicas, StoreError
from proxy.tasks.store.base import RESYNC, STATUS
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

MAX_QUEUED_NOTIFICATIONS: Final = 256  # upstream list/resource notifications a listen stream may lag behind
RETRY_SECONDS: Final = 1.0  # the feed is subscribed again after this long when it fails


@dataclass(frozen=True, slots=True)
class Ended:
    """The stream ends with its graceful result: the proxy shuts down, or the stream fell too far behind (its
    client polls, or listens again)."""

    lagging: bool


class ListenInbox:
    """What a listen stream has to send, bounded whatever arrives: upstream notifications (a short queue; one
    that overflows ends the stream) and the ids of followed tasks that changed (a set: a burst of changes of one
    task is one entry)."""

    def __init__(self) -> None:
        self.messages: deque[JSON] = deque()
        self.changed: set[str] = set()
        self.ended: Ended | None = None
        self._wake = asyncio.Event()

    def offer(self, message: JSON | None) -> None:
        """An upstream notification for the stream; None: the proxy is shutting down."""
        if message is None:
            self.ended = Ended(lagging=False)
        elif len(self.messages) >= MAX_QUEUED_NOTIFICATIONS:
            self.ended = self.ended or Ended(lagging=True)
        else:
            self.messages.append(message)
        self._wake.set()

    def task_changed(self, task_id: str) -> None:
        self.changed.add(task_id)
        self._wake.set()

    async def wait(self, timeout_seconds: float) -> bool:
        """Until there is something to do, or `timeout_seconds` passed (False)."""
        if self.messages or self.changed or self.ended:
            return True
        self._wake.clear()
        try:
            async with asyncio.timeout(timeout_seconds):
                await self._wake.wait()
        except TimeoutError:
            return False
        return True


class TaskWatchers:
    """Every write of a task record goes through the store, which publishes a STATUS change for it: in one process from
    memory, on PostgreSQL over LISTEN/NOTIFY from every replica. `TaskWatchers` holds the one subscription of this
    process to that feed and wakes the inboxes that follow the changed task; a RESYNC (the feed restarted, changes
    may have been missed) wakes every inbox for every task it follows. An inbox only learns *that* a task changed;
    its stream reads the record and sends what `tasks/get` would return. No aiohttp; the store is the only I/O."""

    def __init__(self, feed: Replicas) -> None:
        self.feed = feed  # the store's replicas port: its change feed
        self._following: dict[str, set[ListenInbox]] = {}  # task id → the inboxes that follow it
        self._tasks_of: dict[ListenInbox, set[str]] = {}

    def follow(self, inbox: ListenInbox, task_ids: Iterable[str]) -> None:
        ids = self._tasks_of.setdefault(inbox, set())
        for task_id in task_ids:
            ids.add(task_id)
            self._following.setdefault(task_id, set()).add(inbox)

    def drop(self, inbox: ListenInbox, task_ids: Iterable[str] | None = None) -> None:
        """Stop following `task_ids` (all of the inbox's when None)."""
        ids = self._tasks_of.get(inbox, set())
        for task_id in list(ids if task_ids is None else task_ids):
            ids.discard(task_id)
            inboxes = self._following.get(task_id)
            if inboxes is not None:
                inboxes.discard(inbox)
                if not inboxes:
                    del self._following[task_id]
        if not ids:
            self._tasks_of.pop(inbox, None)

    async def run(self) -> None:
        """Read the store's feed for as long as the proxy runs (started by the runner); subscribed again after a
        failure, which counts as a RESYNC."""
        while True:
            try:
                async with self.feed.changes() as changes:
                    async for change in changes:
                        if change.kind == STATUS:
                            for inbox in self._following.get(change.key, ()):
                                inbox.task_changed(change.key)
                        elif change.kind == RESYNC:
                            self._resync()
            except StoreError as exc:
                log.warning("task_feed_lost", error=str(exc))
            self._resync()
            await asyncio.sleep(RETRY_SECONDS)

    def _resync(self) -> None:
        for inbox, ids in self._tasks_of.items():
            for task_id in ids:
                inbox.task_changed(task_id)
