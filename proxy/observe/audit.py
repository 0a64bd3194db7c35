"""The audit log: one JSON line per modern request (from the edge) and per task transition (from the executor's
observer), naming who, what, which task, the outcome and the duration; never an argument, a result or a
credential. Imports the standard library and `principals`."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import structlog

from proxy.principals import Identity

log = structlog.get_logger(__name__)

STDOUT: Final = "-"
_FILE_MODE: Final = 0o600  # who called what is the operator's to read


def subject(principal: Identity | None) -> str | None:
    """The verified JWT's owner (issuer and claim) of a principal, else None: an opaque token is never shown."""
    return None if principal is None else principal.owner


class AuditLog:
    """Appends lines to `path` (or stdout for "-"); `reopen` (on SIGHUP) starts a new file after a rotation."""

    def __init__(self, path: str, replica: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.replica = replica
        self.clock = clock
        self._fd: int | None = None
        self.reopen()

    def reopen(self) -> None:
        """Open the path again: after logrotate moved the file away (its `create` mode), lines go to the new
        one. With `copytruncate` nothing is needed (O_APPEND writes at the end of the truncated file)."""
        if self.path == STDOUT:
            self._fd = sys.stdout.fileno()
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)

    def write(self, line: dict[str, Any]) -> None:
        """One line: `time` (UTC, ms) and `replica` first, then `line`'s fields (None-valued ones left out)."""
        body = {"time": _iso(self.clock()), "replica": self.replica}
        body.update((key, value) for key, value in line.items() if value is not None)
        data = (json.dumps(body, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        if self._fd is None:
            return
        try:
            os.write(self._fd, data)  # one write per line, appended: lines of one process never interleave
        except OSError as exc:  # a full disk must not fail the request it records
            log.warning("audit_write_failed", error=str(exc))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self.path != STDOUT:
            os.close(fd)


def _iso(epoch_seconds: float) -> str:
    whole = int(epoch_seconds)
    milliseconds = int((epoch_seconds - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{milliseconds:03d}Z"
