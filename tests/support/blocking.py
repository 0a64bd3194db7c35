"""The guard against blocking calls on the event loop's thread (`conftest.py` installs it for every test): a
call wrapped by `Recorder.guard`, made by the proxy's own code while an event loop runs on its thread, is
recorded and refused. Calls from the tests' own code, or from threads without a running loop, pass."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

PROXY = str(Path(__file__).resolve().parent.parent.parent / "proxy") + "/"
_P = ParamSpec("_P")
_T = TypeVar("_T")


def _proxy_caller() -> str | None:
    """The proxy's innermost frame on the current stack, as `path:line`, if any."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PROXY):
            return f"{frame.f_code.co_filename[len(PROXY) :]}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _on_the_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def guard(self, real: Callable[_P, _T], name: str) -> Callable[_P, _T]:
        def guarded(*args: _P.args, **kwargs: _P.kwargs) -> _T:
            where = _proxy_caller() if _on_the_loop() else None
            if where is not None:
                self.calls.append(f"{name} at proxy/{where}")
                raise AssertionError(f"{name} on the event loop's thread (proxy/{where})")
            return real(*args, **kwargs)

        return guarded
