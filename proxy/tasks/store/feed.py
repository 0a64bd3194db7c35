"""The in-process change feed: changes published by this process, fanned out to its subscribers.

The SQLite store's feed (one process sees every change), and a fan-out a replica can put behind its one
PostgreSQL listener. Each subscriber has a bounded queue: one that falls behind loses its backlog and gets a
RESYNC instead, so a slow reader never grows memory. Depends on `base` only; no database, no aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Final

from proxy.tasks.store.base import RESYNC, Change

MAX_QUEUED: Final = 1024  # changes a subscriber may lag behind before it is resynced


class _Subscription:
    """An async iterator of changes; starts with RESYNC; ends when its feed closes."""

    def __init__(self, for_replica: str | None, max_queued: int) -> None:
        self.for_replica = for_replica
        self._queue: asyncio.Queue[Change | None] = asyncio.Queue(max_queued)
        self._queue.put_nowait(Change(RESYNC))

    def offer(self, change: Change | None) -> None:
        if change is not None and not change.wanted_by(self.for_replica):
            return
        try:
            self._queue.put_nowait(change)
        except asyncio.QueueFull:  # fallen behind: what it missed is summed up as one RESYNC
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(Change(RESYNC) if change is not None else None)

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> Change:
        change = await self._queue.get()
        if change is None:
            self._queue.put_nowait(None)  # stays ended
            raise StopAsyncIteration
        return change


class LocalFeed:
    """Publish changes in this process; `subscribe()` hands each subscriber its own ordered stream."""

    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        self._max_queued = max_queued
        self._subscriptions: set[_Subscription] = set()
        self._closed = False

    def publish(self, change: Change) -> None:
        for subscription in self._subscriptions:
            subscription.offer(change)

    @contextlib.asynccontextmanager
    async def subscribe(self, for_replica: str | None = None) -> AsyncIterator[AsyncIterator[Change]]:
        """Changes from now on (a RESYNC first); messages only those addressed to `for_replica` when given."""
        subscription = _Subscription(for_replica, self._max_queued)
        if self._closed:
            subscription.offer(None)
        self._subscriptions.add(subscription)
        try:
            yield subscription
        finally:
            self._subscriptions.discard(subscription)

    def close(self) -> None:
        """End every subscription (their iterators stop after what they already hold)."""
        self._closed = True
        for subscription in self._subscriptions:
            subscription.offer(None)
