"""The one place tasks/ starts background work: every coroutine named and referenced until done, a crash
logged, and all of it cancelled at shutdown. Imports asyncio and structlog only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_background_failed", coroutine=task.get_name(), error=repr(task.exception()))

    async def close(self, grace_seconds: float) -> None:
        """Cancel everything still running and wait (bounded) for it to finish."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_seconds)
