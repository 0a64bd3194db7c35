"""Per-caller quotas (`limits.calls_per_minute_per_principal`): each `tools/call` a caller starts is counted in
a fixed window of one minute (from the start of each UTC minute), in the store: shared by every replica on
PostgreSQL, kept by the one process on SQLite. One beyond the quota is refused (`RateLimitedError`: 429 with
`Retry-After` and the RateLimit fields) before anything else is done for it; the edge counts the refusal in
`limit_refusals_total`. Imports the store protocol and errors; no upstream, no aiohttp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

from proxy.errors import RateLimitedError
from proxy.tasks.store import TaskStore

WINDOW_MS: Final = 60_000
LIMIT: Final = "calls_per_minute_per_principal"


class Quotas:
    def __init__(self, store: TaskStore, clock: Callable[[], int]) -> None:
        self.store = store
        self.clock = clock  # wall clock, epoch milliseconds: replicas share the windows

    async def charge(self, caller: str, per_minute: int) -> None:
        """Count one call of `caller` (the keyed hash of its principal); RateLimitedError beyond `per_minute`,
        telling it to come back when the window ends."""
        now_ms = self.clock()
        window_start_ms = now_ms - now_ms % WINDOW_MS
        calls = await self.store.count_call(f"principal:{caller}", window_start_ms)
        if calls <= per_minute:
            return
        retry_after_seconds = max(1, math.ceil((window_start_ms + WINDOW_MS - now_ms) / 1000))
        raise RateLimitedError(LIMIT, per_minute, WINDOW_MS // 1000, retry_after_seconds)
