"""The store's kept grants as the credential source's port (`upstream.credentials: exchange`): the same
operations, with a store that fails (away, or erring) told as `CredentialUnavailableError`, which the caller of
an upstream request gets as 503 with `Retry-After` and a task's poll meets as a passing failure. Imports the
store and the errors; no upstream.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from proxy.errors import CredentialUnavailableError
from proxy.tasks.store import StoreError, TaskStore
from proxy.tasks.store.contract import Grants

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


class StoreGrants:
    """`GrantStore` (proxy/upstream/credentials) on the task store's grants table."""

    def __init__(self, store: Callable[[], TaskStore]) -> None:
        self._store = store  # (the store opens after the upstream pool that holds this port: read at each use)

    @property
    def _grants(self) -> Grants:
        return self._store().grants

    async def _run(self, what: str, work: Callable[[], Awaitable[_T]]) -> _T:
        try:
            return await work()
        except StoreError as exc:
            log.error("credential_store_failed", operation=what, error=str(exc))
            raise CredentialUnavailableError(
                "Service unavailable: the upstream credential kept for this caller cannot be read or written now",
                retry_after_seconds=2,
                detail=str(exc),
            ) from None

    async def read_grant(self, principal: str, target: str) -> str | None:
        return await self._run("read_grant", lambda: self._grants.read_grant(principal, target))

    async def lock_grant(self, principal: str, target: str, holder: str, until_ms: int, now_ms: int) -> str | None:
        return await self._run(
            "lock_grant", lambda: self._grants.lock_grant(principal, target, holder, until_ms, now_ms)
        )

    async def write_grant(self, principal: str, target: str, sealed: str, now_ms: int, holder: str | None) -> bool:
        return await self._run(
            "write_grant", lambda: self._grants.write_grant(principal, target, sealed, now_ms, holder)
        )

    async def unlock_grant(self, principal: str, target: str, holder: str) -> None:
        await self._run("unlock_grant", lambda: self._grants.unlock_grant(principal, target, holder))

    async def drop_grant(self, principal: str, target: str) -> None:
        await self._run("drop_grant", lambda: self._grants.drop_grant(principal, target))

    async def drop_grants(self, principal: str) -> int:
        return await self._run("drop_grants", lambda: self._grants.drop_grants(principal))
