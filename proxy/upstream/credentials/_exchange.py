"""`upstream.credentials: exchange`: RFC 8693 token exchange for each verified caller, its cache, and the grants
that renew a task's credential, kept in the store through the `GrantStore` port (see `Exchange`). Imports the
config, the principals, the errors and the token client; never a session kind or the store.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import secrets as random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Final, Protocol

import structlog

from proxy.background import Background
from proxy.config.credentials import ExchangeConfig, TargetConfig
from proxy.errors import CredentialRefusedError, CredentialUnavailableError
from proxy.principals import Identity, Principals, SealError, owner_key
from proxy.upstream.credentials._token_client import Token, TokenClient

log = structlog.get_logger(__name__)

NOT_VERIFIED: Final = (
    "Unauthorized: this proxy presents a credential of its own making upstream (upstream.credentials), which "
    "needs the caller's verified JWT (security.jwt); send a Bearer JWT of an accepted issuer"
)
NOT_RENEWABLE: Final = (
    "Unauthorized: the upstream credential can no longer be renewed: the caller's token has expired and the token "
    "endpoint gave no refresh token"
)
SUBJECT_MARGIN_SECONDS: Final = 1.0  # a caller's token this close to its exp is not exchanged any more
MAX_CALLERS: Final = 10_000  # callers whose exchanged tokens (and freshest inbound token) are kept in memory
REFRESH_LOCK_SECONDS: Final = 30.0  # a replica's hold on a grant while it refreshes it (one refresh at a time)
REFRESH_WAIT_STEP_SECONDS: Final = 0.1  # how often a replica waiting for another's refresh reads the grant


class GrantStore(Protocol):
    """The store's table of kept grants (one per caller's keyed hash and target, its tokens sealed with the
    deployment key): the port `Exchange` writes through. Failures raise CredentialUnavailableError."""

    async def read_grant(self, principal: str, target: str) -> str | None: ...

    async def lock_grant(self, principal: str, target: str, holder: str, until_ms: int, now_ms: int) -> str | None:
        """Hold the grant for a refresh (`holder` until `until_ms`): its sealed tokens, or None when it does not
        exist or another holder's hold is still in force."""

    async def write_grant(self, principal: str, target: str, sealed: str, now_ms: int, holder: str | None) -> bool:
        """Keep `sealed` (and let go of the hold); with `holder`, only while that hold is in force."""

    async def unlock_grant(self, principal: str, target: str, holder: str) -> None: ...

    async def drop_grant(self, principal: str, target: str) -> None: ...

    async def drop_grants(self, principal: str) -> int:
        """Erase the caller's grants unless a live task of the caller remains (on any replica)."""


def verified(principal: Identity | None) -> Identity:
    """The caller, when it is verified (a JWT's owner); else CredentialRefusedError (401)."""
    if principal is None or principal.owner is None:
        raise CredentialRefusedError(NOT_VERIFIED)
    return principal


def _bearer_token(credential: str) -> str:
    """The token of a verified `Bearer <JWT>` header value (the subject token of an exchange)."""
    scheme, _, token = credential.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else credential


def _target_key(target: TargetConfig) -> str:
    """How a target is named in the store and the cache (the config's own values, no secret)."""
    return json.dumps([target.audience, target.resource, target.scope], separators=(",", ":"))


class Exchange:
    """RFC 8693 token exchange for each verified caller (`upstream.credentials.exchange`).

    - The freshest verified token each caller presented is remembered (`_subjects`, by its `exp`); the token
      exchanged for it is cached per (caller, target) and renewed before it expires: by a new exchange while
      the caller's token is still valid, else with the refresh token the endpoint returned.
    - A caller with a task running here is `bind`-ed: its grants (the exchanged token and its refresh token,
      sealed with the deployment key as one value) are kept in the store, so a later poll, a restart or a
      take-over on another replica sharing the key renews it; `release` erases them once the caller's last
      live task settled. One refresh of a grant at a time across replicas (a hold in the store); a rotated
      refresh token replaces the one before; a refused one is erased and the task fails saying so.
    """

    forwards = False

    def __init__(
        self,
        config: ExchangeConfig,
        principals: Principals,
        client: TokenClient,
        grants: GrantStore | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.principals = principals
        self.client = client
        self.grants = grants
        self.clock = clock
        self._tokens: OrderedDict[str, dict[str, Token]] = OrderedDict()  # caller → target → token, LRU
        self._subjects: OrderedDict[str, Identity] = OrderedDict()  # caller → its freshest verified token
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}  # one renewal per (caller, target) in this process
        self._bound: dict[str, set[str]] = {}  # caller → its tasks running here
        self.keeps_grants = grants is not None
        self._holder = random.token_hex(8)  # this process, as a holder of grants in the store
        self._background = Background("credential_background_failed")

    def session_key(self, principal: Identity | None) -> str:
        return owner_key(principal)

    def environment(self, principal: Identity | None) -> Mapping[str, str]:
        return {}

    def version(self) -> int:
        return 0

    def seen(self, principal: Identity | None) -> None:
        if principal is not None and principal.owner is not None and principal.credential:
            self._see(self.principals.key_of(principal), principal)

    def start(self) -> None:
        pass

    async def reload(self, trigger: str) -> None:
        pass

    async def close(self) -> None:
        await self._background.close()
        await self.client.close()

    def target_of(self, tool: str | None) -> TargetConfig:
        """The tool's own target (exact name, then the first glob that matches), else the upstream's."""
        tools = self.config.tools
        if tool is not None and tools:
            if tool in tools:
                return tools[tool]
            for pattern, target in tools.items():
                if fnmatch.fnmatchcase(tool, pattern):
                    return target
        return self.config

    async def headers(self, principal: Identity | None, tool: str | None = None) -> Mapping[str, str]:
        token = await self.token(principal, tool)
        return {self.config.header: f"Bearer {token.access}"}

    async def token(self, principal: Identity | None, tool: str | None = None) -> Token:
        caller_identity = verified(principal)
        caller = self.principals.key_of(caller_identity)
        self._see(caller, caller_identity)
        target = self.target_of(tool)
        key = _target_key(target)
        cached = self._cached(caller, key)
        if cached is not None and cached.fresh(self.clock(), self.config.renew_before_seconds):
            return cached
        lock = self._locks.setdefault((caller, key), asyncio.Lock())
        try:
            async with lock:
                cached = self._cached(caller, key)  # renewed meanwhile by whoever held the lock
                if cached is not None and cached.fresh(self.clock(), self.config.renew_before_seconds):
                    return cached
                token = await self._renew(caller, target, key, cached)
                self._remember(caller, key, token)
                return token
        finally:
            if not lock.locked():
                self._locks.pop((caller, key), None)

    # --- renewing ---------------------------------------------------------------------------------------------

    async def _renew(self, caller: str, target: TargetConfig, key: str, cached: Token | None) -> Token:
        subject = self._subjects.get(caller)
        now = self.clock()
        if subject is not None and (subject.expires_at or 0) - now > SUBJECT_MARGIN_SECONDS:
            token = await self.client.exchange(_bearer_token(subject.credential), target)
            log.info("credential_exchanged", audience=target.audience, lifetime_seconds=round(token.expires_at - now))
            if caller in self._bound:
                await self._keep(caller, key, token)
            return token
        if self.grants is not None and caller in self._bound:
            return await self._refresh_kept(caller, target, key, cached)
        if cached is None or cached.refresh is None:
            raise CredentialRefusedError(NOT_RENEWABLE)
        return await self._refreshed(caller, key, cached, target)

    async def _refreshed(self, caller: str, key: str, stored: Token, target: TargetConfig) -> Token:
        """The grant's refresh token traded for a fresh token (a rotated refresh token replaces it; none given:
        the old one serves on); a refused one is erased and the credential cannot be renewed."""
        assert stored.refresh is not None
        try:
            fresh = await self.client.refresh(stored.refresh, target)
        except CredentialRefusedError as exc:
            self._forget(caller, key)
            if self.grants is not None:
                await self.grants.drop_grant(caller, key)
            error = exc.data.get("error") if isinstance(exc.data, dict) else None
            raise CredentialRefusedError(
                "Unauthorized: the upstream credential can no longer be renewed: the token endpoint refused its "
                f"refresh token ({error})",
                error,
            ) from None
        log.info("credential_refreshed", audience=target.audience, rotated=fresh.refresh is not None)
        return fresh if fresh.refresh is not None else replace(fresh, refresh=stored.refresh)

    async def _refresh_kept(self, caller: str, target: TargetConfig, key: str, cached: Token | None) -> Token:
        """The grant kept in the store, renewed by one replica at a time: the one that holds it refreshes and
        writes the result; the others wait for that and take it. None kept (it could not be written): the one in
        memory, kept once renewed."""
        assert self.grants is not None
        deadline = self.clock() + REFRESH_LOCK_SECONDS
        while True:
            now_ms = int(self.clock() * 1000)
            until_ms = now_ms + int(REFRESH_LOCK_SECONDS * 1000)
            sealed = await self.grants.lock_grant(caller, key, self._holder, until_ms, now_ms)
            if sealed is None:
                current = await self.grants.read_grant(caller, key)
                if current is None:
                    if cached is None or cached.refresh is None:
                        raise CredentialRefusedError(NOT_RENEWABLE)
                    fresh = await self._refreshed(caller, key, cached, target)
                    await self._keep(caller, key, fresh)
                    return fresh
                stored = self._open(current)
                if stored.fresh(self.clock(), self.config.renew_before_seconds):
                    return stored  # another replica has just renewed it
                if self.clock() > deadline:
                    raise CredentialUnavailableError(detail="another replica's refresh of the grant did not end")
                await asyncio.sleep(REFRESH_WAIT_STEP_SECONDS)
                continue
            stored = self._open(sealed)
            if stored.fresh(self.clock(), self.config.renew_before_seconds) or stored.refresh is None:
                await self.grants.unlock_grant(caller, key, self._holder)
                if stored.refresh is None and not stored.fresh(self.clock(), self.config.renew_before_seconds):
                    raise CredentialRefusedError(NOT_RENEWABLE)
                return stored
            try:
                fresh = await self._refreshed(caller, key, stored, target)
            except CredentialUnavailableError:
                await self.grants.unlock_grant(caller, key, self._holder)
                raise
            await self.grants.write_grant(caller, key, self._seal(fresh), int(self.clock() * 1000), self._holder)
            return fresh

    # --- tasks ------------------------------------------------------------------------------------------------

    def bind(self, principal: Identity | None, task_id: str) -> None:
        if principal is None or principal.owner is None or self.grants is None:
            return
        caller = self.principals.key_of(principal)
        self._see(caller, principal)
        tasks = self._bound.setdefault(caller, set())
        first = not tasks
        tasks.add(task_id)
        if first:  # what was exchanged before the task existed (a call that became a task after its window)
            for key, token in list(self._tokens.get(caller, {}).items()):
                self._background.spawn(self._keep(caller, key, token), "credential-keep")

    def release(self, caller: str, task_id: str) -> None:
        tasks = self._bound.get(caller)
        if tasks is None:
            return
        tasks.discard(task_id)
        if not tasks:
            del self._bound[caller]
            self._background.spawn(self._erase(caller), "credential-erase")

    async def _keep(self, caller: str, key: str, token: Token) -> None:
        assert self.grants is not None
        try:
            await self.grants.write_grant(caller, key, self._seal(token), int(self.clock() * 1000), None)
        except CredentialUnavailableError as exc:  # it serves on here; a take-over may not find it
            log.warning("credential_not_kept", error=exc.message)

    async def _erase(self, caller: str) -> None:
        assert self.grants is not None
        try:
            erased = await self.grants.drop_grants(caller)
        except CredentialUnavailableError as exc:  # the sweep erases it later
            log.warning("credential_not_erased", error=exc.message)
            return
        if erased:
            log.info("credential_grants_erased", grants=erased)

    # --- memory -----------------------------------------------------------------------------------------------

    def _see(self, caller: str, principal: Identity) -> None:
        """Remember the caller's freshest verified token (the one that expires last)."""
        if not principal.credential or principal.expires_at is None:
            return
        known = self._subjects.get(caller)
        if known is None or (known.expires_at or 0) < principal.expires_at:
            self._subjects[caller] = principal
        self._subjects.move_to_end(caller)
        while len(self._subjects) > MAX_CALLERS:
            self._subjects.popitem(last=False)

    def _cached(self, caller: str, key: str) -> Token | None:
        tokens = self._tokens.get(caller)
        if tokens is None:
            return None
        self._tokens.move_to_end(caller)
        return tokens.get(key)

    def _remember(self, caller: str, key: str, token: Token) -> None:
        self._tokens.setdefault(caller, {})[key] = token
        self._tokens.move_to_end(caller)
        while len(self._tokens) > MAX_CALLERS:
            self._tokens.popitem(last=False)

    def _forget(self, caller: str, key: str) -> None:
        tokens = self._tokens.get(caller)
        if tokens is not None:
            tokens.pop(key, None)

    def _seal(self, token: Token) -> str:
        return self.principals.seal(token.to_json())

    def _open(self, sealed: str) -> Token:
        try:
            return Token.from_json(self.principals.unseal(sealed))
        except (SealError, ValueError, KeyError, TypeError):
            raise CredentialRefusedError(
                "Unauthorized: the kept upstream credential cannot be opened with this deployment key"
            ) from None
