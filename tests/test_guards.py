"""The suite's own guard against blocking calls on the event loop (`conftest.py`, autouse): it catches the proxy's
code, not the tests' own, and not a thread without a running loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.blocking import PROXY


def proxy_code(source: str) -> Callable[[], Any]:
    """A function compiled as if it were in proxy/ (the guard looks at where its caller's code lives)."""
    namespace: dict[str, Any] = {}
    exec(compile(f"import time\ndef run():\n    {source}\n", f"{PROXY}sample.py", "exec"), namespace)
    run: Callable[[], Any] = namespace["run"]
    return run


async def test_a_sleep_in_the_proxys_code_on_the_loop_is_refused_and_recorded(
    no_blocking_calls_on_the_event_loop: list[str],
) -> None:
    with pytest.raises(AssertionError, match=r"time\.sleep on the event loop"):
        proxy_code("time.sleep(0)")()
    assert no_blocking_calls_on_the_event_loop == ["time.sleep at proxy/sample.py:3"]
    no_blocking_calls_on_the_event_loop.clear()  # seen: this test's one blocking call is not the test's failure


async def test_the_same_sleep_off_the_loop_or_from_a_test_passes(
    no_blocking_calls_on_the_event_loop: list[str],
) -> None:
    await asyncio.to_thread(proxy_code("time.sleep(0)"))  # the store's threads may block
    time.sleep(0)  # noqa: ASYNC251 - the test's own code, which the guard leaves alone
    assert no_blocking_calls_on_the_event_loop == []
