"""What the proxy presents upstream for a caller (`upstream.credentials`), asked by every upstream request when it
is made: `Forward` (the caller's own header), `Secrets` (a mounted map, `_secrets.py`), `Exchange` (RFC 8693,
`_exchange.py` and `_token_client.py`). Imports the config, the principals and the errors; never a session kind
or the store (its grants come through the `GrantStore` port the composition root hands in).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import structlog

from proxy.background import Background
from proxy.config.credentials import CredentialsConfig
from proxy.config.keyfiles import read_password
from proxy.errors import NoCredentialError
from proxy.principals import Identity, Principals, owner_key, principal_key
from proxy.upstream.credentials._exchange import Exchange, GrantStore, verified
from proxy.upstream.credentials._secrets import Kind, SecretsMap
from proxy.upstream.credentials._token_client import TokenClient

log = structlog.get_logger(__name__)


class Credentials(Protocol):
    """A credential source.

    Asked at the moment of each request, so a poll, a follow, a resume or a take-over long after the caller's
    request gets a credential valid then. With `exchange` and `secrets` the inbound token never goes upstream, only
    a verified caller gets a credential, and the caller's sessions are kept under its verified owner
    (`session_key`), so a refreshed token keeps them."""

    forwards: bool  # the caller's own header goes upstream (the hot path stays as it was)
    keeps_grants: bool  # tokens that renew a task's credential are kept in the store

    def session_key(self, principal: Identity | None) -> str:
        """What the caller's upstream sessions are kept under."""

    async def headers(self, principal: Identity | None, tool: str | None = None) -> Mapping[str, str]:
        """The headers that carry the caller's upstream credential on an HTTP request (about `tool`, if any)."""

    def environment(self, principal: Identity | None) -> Mapping[str, str]:
        """The caller's variables for a stdio server process of its own ({} for the proxy's own processes)."""

    def version(self) -> int:
        """Moves on whenever what `environment` gives may have changed (a reloaded map)."""

    def seen(self, principal: Identity | None) -> None:
        """The caller is being served now (its freshest token is the one to act with)."""

    def bind(self, principal: Identity | None, task_id: str) -> None:
        """A task of the caller runs here: what renews its credential is kept in the store until it settles."""

    def release(self, caller: str, task_id: str) -> None:
        """The task settled: erase what was kept for the caller once none of its tasks is live."""

    def start(self) -> None: ...

    async def reload(self, trigger: str) -> None: ...

    async def close(self) -> None: ...


class _Quiet:
    """What `Forward` and `Secrets` keep nothing for."""

    keeps_grants = False

    def version(self) -> int:
        return 0

    def seen(self, principal: Identity | None) -> None:
        pass

    def bind(self, principal: Identity | None, task_id: str) -> None:
        pass

    def release(self, caller: str, task_id: str) -> None:
        pass

    def start(self) -> None:
        pass

    async def reload(self, trigger: str) -> None:
        pass

    async def close(self) -> None:
        pass


class Forward(_Quiet):
    """The caller's own principal header, as it came (today's behaviour; see the credentials guide's threat
    model for why this is only for an upstream in the proxy's trust boundary)."""

    forwards = True

    def __init__(self, principal_header: str) -> None:
        self.principal_header = principal_header

    def session_key(self, principal: Identity | None) -> str:
        return principal_key(principal)

    async def headers(self, principal: Identity | None, tool: str | None = None) -> Mapping[str, str]:
        return {self.principal_header: principal.credential} if principal and principal.credential else {}

    def environment(self, principal: Identity | None) -> Mapping[str, str]:
        return {}


class Secrets(_Quiet):
    """Each verified caller's entry of the map; a verified caller without one is refused (403), an unverified
    one (401); nobody gets another's entry or a shared one instead."""

    forwards = False

    def __init__(self, path: str, kind: Kind) -> None:
        self.map = SecretsMap(path, kind)
        self._background = Background("credential_background_failed")

    def session_key(self, principal: Identity | None) -> str:
        return owner_key(principal)

    def entry(self, principal: Identity | None) -> Mapping[str, str]:
        caller = verified(principal)
        claim = caller.claim
        found = self.map.entry(claim) if claim is not None else None
        if found is None:
            log.info("credential_secret_missing", entries=len(self.map.entries))
            raise NoCredentialError()
        return found

    async def headers(self, principal: Identity | None, tool: str | None = None) -> Mapping[str, str]:
        return self.entry(principal)

    def environment(self, principal: Identity | None) -> Mapping[str, str]:
        return {} if principal is None else self.entry(principal)

    def version(self) -> int:
        return self.map.version

    def start(self) -> None:
        self._background.spawn(self.map.watch(), "credential-secrets-watch")

    async def reload(self, trigger: str) -> None:
        await self.map.reload(trigger)

    async def close(self) -> None:
        await self._background.close()


def credentials_of(
    config: CredentialsConfig,
    *,
    principal_header: str,
    kind: Kind,
    principals: Principals | None = None,
    grants: GrantStore | None = None,
) -> Credentials:
    """The source `config` describes; its files are read now (a missing one stops the start)."""
    if config.mode == "secrets":
        assert config.secrets is not None
        return Secrets(config.secrets.path, kind)
    if config.mode == "exchange":
        assert config.exchange is not None
        if principals is None:
            raise ValueError("token exchange keeps grants sealed with the deployment key: principals are needed")
        exchange = config.exchange
        secret = read_password(exchange.client_secret_file) if exchange.client_secret_file else None
        key = Path(exchange.private_key_jwt.key_file).read_bytes() if exchange.private_key_jwt else None
        actor = read_password(exchange.actor_token_file) if exchange.actor_token_file else None
        return Exchange(exchange, principals, TokenClient(exchange, secret, key, actor), grants)
    return Forward(principal_header)


__all__ = ["Credentials", "Exchange", "Forward", "GrantStore", "Secrets", "credentials_of", "verified"]
