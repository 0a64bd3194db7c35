"""The one way tests wait for a state: poll a condition until it holds, failing with what was awaited after a
deadline. Never a fixed sleep. Imports nothing of the proxy."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

DEFAULT_SECONDS = 15.0


async def until(
    condition: Callable[[], Any], what: str | Callable[[], str], timeout_seconds: float = DEFAULT_SECONDS
) -> Any:
    """Poll `condition` (a plain or a coroutine function) until it returns something truthy; return that.

    After `timeout_seconds` the test fails with `what` (or what the callable says, e.g. the last state seen).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_seconds
    interval = 0.01
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(f"not within {timeout_seconds:g} s: {what() if callable(what) else what}")
        await asyncio.sleep(interval)
        interval = min(interval * 2, 0.1)


def until_sync(
    condition: Callable[[], Any], what: str | Callable[[], str], timeout_seconds: float = DEFAULT_SECONDS
) -> Any:
    """`until` for code outside an event loop (a child process starting, a blocking client)."""
    deadline = time.monotonic() + timeout_seconds
    interval = 0.01
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_seconds:g} s: {what() if callable(what) else what}")
        time.sleep(interval)
        interval = min(interval * 2, 0.1)
