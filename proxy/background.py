"""The one place the proxy starts background work: every coroutine named and referenced until done, a crash
logged, and all of it cancelled when its owner closes. Imports asyncio and structlog only, so that every layer
(upstream/, tasks/, the edge) may own one; `tests/test_background.py` fails on a task started anywhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


class Background:
    """The background tasks of one owner, which closes it when it stops; `failed` is the log event of a task
    that crashed (it names the task)."""

    def __init__(self, failed: str = "task_background_failed") -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failed = failed

    def spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(self._failed, task=task.get_name(), error=repr(task.exception()))

    async def close(self, grace_seconds: float | None = None) -> None:
        """Cancel everything still running and wait for it to finish (at most `grace_seconds`, when given)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_seconds)
