"""Per-caller quotas per UTC minute (`limits.calls_per_minute_per_principal`, and a tool's own), counted in the
store (shared by replicas on PostgreSQL); one beyond is 429 with `Retry-After` and the RateLimit fields.
Imports the store, the policy and errors; no upstream, no aiohttp."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

from proxy.errors import RateLimitedError, RatePolicy
from proxy.policy import Policy
from proxy.tasks.store import Usage

WINDOW_MS: Final = 60_000
LIMIT: Final = "calls_per_minute_per_principal"  # the global quota's `data.limit`


def tool_limit(entry: str) -> str:
    """A tool quota's `data.limit` (and `limit_refusals_total` label): the config key that sets it."""
    return f"tasks.tools.{entry}.{LIMIT}"


def tool_policy_name(entry: str) -> str:
    """A tool quota's name in the RateLimit fields, distinct from the global quota's `calls`."""
    return f"tool:{entry}"


class Quotas:
    def __init__(self, usage: Usage, clock: Callable[[], int]) -> None:
        self.usage = usage  # the store's usage port: the counts every replica shares
        self.clock = clock  # wall clock, epoch milliseconds: replicas share the windows

    async def charge(self, caller: str, per_minute: int, tool: str | None = None, policy: Policy | None = None) -> None:
        """Count one call of `caller` (the keyed hash of its principal) against the global quota (`per_minute`,
        0: none) and the tool's own (`policy.calls_per_minute`, None: none); RateLimitedError beyond either,
        telling it to come back when the window ends."""
        now_ms = self.clock()
        window_start_ms = now_ms - now_ms % WINDOW_MS
        policies: list[RatePolicy] = []
        refused: tuple[str, int] | None = None
        if per_minute:
            calls = await self.usage.count_call(f"principal:{caller}", window_start_ms)
            policies.append(RatePolicy(RateLimitedError.POLICY, per_minute, max(0, per_minute - calls)))
            if calls > per_minute:
                refused = (LIMIT, per_minute)
        tool_quota = policy.calls_per_minute if policy is not None else None
        if tool is not None and policy is not None and tool_quota is not None:
            entry = policy.entry if policy.entry is not None else tool
            calls = await self.usage.count_call(f"tool:{tool}:principal:{caller}", window_start_ms)
            policies.append(RatePolicy(tool_policy_name(entry), tool_quota, max(0, tool_quota - calls)))
            if calls > tool_quota and refused is None:
                refused = (tool_limit(entry), tool_quota)
        if refused is None:
            return
        retry_after_seconds = max(1, math.ceil((window_start_ms + WINDOW_MS - now_ms) / 1000))
        limit, maximum = refused
        raise RateLimitedError(limit, maximum, WINDOW_MS // 1000, retry_after_seconds, policies)
