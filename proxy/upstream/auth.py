"""Whether the upstream requires credentials, which decides if what the proxy learned from it (InitializeResult,
tool catalog) may serve every caller, or only the caller whose credential the upstream accepted. Owns only that
decision; imports the errors, never a session kind, the pool or aiohttp."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

import structlog

from proxy.errors import UpstreamAuthError, UpstreamError

log = structlog.get_logger(__name__)

AuthMode = Literal["detect", "required", "none"]


class UpstreamAuth:
    """`none`: the caches are shared (the operator says the upstream needs no credential). `required`: never
    shared. `detect`: shared once an `initialize` without the caller's credential succeeded, until the upstream
    refuses any request with 401 or 403 (then never again in this process). When nothing is known yet, the
    first question runs one anonymous `initialize` (`probe`) to find out."""

    def __init__(self, mode: AuthMode = "none", probe: Callable[[], Awaitable[None]] | None = None) -> None:
        self.mode = mode
        self._probe = probe
        self.refused = mode == "required"  # the upstream answered 401/403 (or the config says it would)
        self.open: bool | None = True if mode == "none" else None  # an anonymous initialize succeeded
        self._lock = asyncio.Lock()
        self._found_required: list[Callable[[], None]] = []

    def when_found_required(self, listener: Callable[[], None]) -> None:
        """`listener()` once `detect` finds that the upstream requires credentials (its first refusal)."""
        self._found_required.append(listener)

    def saw_refusal(self) -> None:
        if self.mode == "detect" and not self.refused:
            log.info("upstream_requires_auth", effect="cached discover and tool facts are no longer shared")
            self.refused = True
            for listener in self._found_required:
                listener()
        if self.mode != "none":
            self.refused = True

    def saw_anonymous_success(self) -> None:
        if self.open is None:
            self.open = True

    async def shared(self) -> bool:
        """May what one caller's session learned serve another caller?"""
        if self.mode == "none":
            return True
        if self.refused:
            return False
        if self.open is None and self._probe is not None:
            async with self._lock:
                if self.open is None and not self.refused:
                    await self._find_out(self._probe)
        return bool(self.open) and not self.refused

    async def _find_out(self, probe: Callable[[], Awaitable[None]]) -> None:
        try:
            await probe()
        except UpstreamAuthError:
            self.saw_refusal()
        except UpstreamError as exc:  # not known yet: this caller goes through its own session, a later one asks again
            log.warning("upstream_auth_probe_failed", error=exc.message)
        else:
            self.saw_anonymous_success()
