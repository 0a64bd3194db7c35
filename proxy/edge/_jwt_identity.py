"""`security.jwt`: a caller's Bearer JWT verified against its issuer's keys, so that its tasks belong to the
issuer plus a claim, which outlives the token; the key set fetched with aiohttp (bounded), verified tokens
remembered by hash. Imports the config, the errors and the principals; nothing of the front or the tasks."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Final

import aiohttp
import jwt
import structlog

from proxy.config.schema import Config, JwtConfig, SecurityConfig
from proxy.errors import ProxyError, UnauthorizedError
from proxy.principals import Identity, identity_of
from proxy.upstream.credentials import verified
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

# A JWS in compact form after the Bearer scheme; any other value is an opaque token (keyed hash, as before).
_BEARER_JWT: Final = re.compile(r"[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*)\s*")
MAX_JWKS_BYTES: Final = 1 << 20
CACHE_SECONDS: Final = 300.0  # a verified token is checked again after this long, even when it lives longer
CACHE_ENTRIES: Final = 10_000


class JwtRejectedError(UnauthorizedError):
    """The caller's JWT failed verification: HTTP 401 with `WWW-Authenticate: Bearer error="invalid_token"`
    (RFC 6750), before the request is looked at any further."""

    def response_headers(self) -> dict[str, str]:
        description = self.message.partition(": ")[2].replace('"', "'")
        return {"WWW-Authenticate": f'Bearer error="invalid_token", error_description="{description}"'}


class JwksUnavailableError(ProxyError):
    """The issuer's keys could not be fetched: a JWT cannot be judged either way, so the caller is asked to try
    again (HTTP 503) and nothing about the token is remembered."""

    code = -32603
    http_status = 503
    default_message = "Service unavailable: the JWT issuer's keys (security.jwt) could not be fetched"
    headers: ClassVar[dict[str, str]] = {"Retry-After": "5"}


class KeySet:
    """The issuer's keys by `kid`, from `jwks_url` or `jwks_file`."""

    def __init__(self, config: JwtConfig) -> None:
        self.config = config
        self.keys: dict[str | None, jwt.PyJWK] = {}
        self.declared_alg: dict[str | None, str] = {}
        self.fetched_at: float | None = None  # monotonic time of the last successful fetch
        self.fetch_tried_at = float("-inf")  # of the last refetch (unknown kid, or keys too old)
        self.fetches = 0  # attempts, failed ones included
        self.failed = False  # the latest attempt failed
        self._lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None

    async def key(self, kid: str | None) -> jwt.PyJWK:
        """The key named `kid`. Keys are fetched when there are none yet (503 when that fails), again after
        `jwks_ttl_seconds` (the old ones serve on while that fails), and again for an unknown `kid`, at most once
        per `jwks_refetch_seconds` (then 503 when the fetch fails, 401 when the key is still unknown)."""
        if self.fetched_at is None:
            await self._refresh(must_succeed=True)
        elif time.monotonic() - self.fetched_at > self.config.jwks_ttl_seconds and self._may_refetch():
            await self._refresh(must_succeed=False)
        key = self._lookup(kid)
        if key is None and self._may_refetch():
            await self._refresh(must_succeed=True)
            key = self._lookup(kid)
        if key is None:
            raise JwtRejectedError("Unauthorized: the JWT is signed with a key the issuer does not publish")
        return key

    def _lookup(self, kid: str | None) -> jwt.PyJWK | None:
        if kid is None and len(self.keys) == 1:
            return next(iter(self.keys.values()))
        return self.keys.get(kid)

    def _may_refetch(self) -> bool:
        now = time.monotonic()
        if now - self.fetch_tried_at < self.config.jwks_refetch_seconds:
            return False
        self.fetch_tried_at = now
        return True

    async def _refresh(self, *, must_succeed: bool) -> None:
        """One fetch at a time: callers that waited for another's fetch take its outcome (its keys, or its
        failure) instead of fetching again. A failed fetch changes nothing; it is an error only when the keys
        in hand cannot do (`must_succeed`)."""
        attempt = self.fetches
        async with self._lock:
            if self.fetches == attempt:
                self.failed = not await self._fetch()
        if self.failed and must_succeed:
            raise JwksUnavailableError()

    async def _fetch(self) -> bool:
        try:
            document = await self._read()
            keys = jwt.PyJWKSet.from_dict(document).keys[: self.config.max_keys]
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, jwt.PyJWTError) as exc:
            self.fetches += 1
            log.warning("jwks_unavailable", error=type(exc).__name__, detail=str(exc)[:200])
            return False
        else:
            self.fetches += 1
            raw = {entry.get("kid"): entry for entry in document.get("keys", []) if isinstance(entry, dict)}
            self.keys = {key.key_id: key for key in keys}
            self.declared_alg = {
                kid: str(raw[kid]["alg"]) for kid in self.keys if kid in raw and isinstance(raw[kid].get("alg"), str)
            }
            self.fetched_at = time.monotonic()
            log.info("jwks_fetched", keys=len(self.keys))
            return True

    async def _read(self) -> JSON:
        config = self.config
        if config.jwks_file:
            data = await asyncio.to_thread(Path(config.jwks_file).read_bytes)
        else:
            assert config.jwks_url is not None
            if self._http is None:
                self._http = aiohttp.ClientSession()
            timeout = aiohttp.ClientTimeout(total=config.jwks_timeout_seconds)
            async with self._http.get(config.jwks_url, timeout=timeout, allow_redirects=False) as response:
                response.raise_for_status()
                data = await response.content.read(MAX_JWKS_BYTES + 1)
        if len(data) > MAX_JWKS_BYTES:
            raise ValueError(f"the key set is larger than {MAX_JWKS_BYTES} bytes")
        document = json.loads(data)
        if not isinstance(document, dict):
            raise ValueError("the key set is not a JSON object")
        return document

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


class JwtIdentity:
    """Turns the principal header's value into an `Identity` whose owner is the issuer plus the claim, when
        the value is a Bearer JWT that verifies; any other value is an identity of its own (an opaque token).

    PyJWT (with `cryptography`) verifies; this module fetches the JSON Web Key Set itself with aiohttp, so the event
    loop never blocks on the network (PyJWT's `PyJWKClient` fetches with urllib), and bounds it: at most `max_keys`
    keys, one fetch at a time, a refetch for an unknown `kid` at most every `jwks_refetch_seconds`. A verified token
    is remembered (by its SHA-256, until it expires, at most CACHE_SECONDS and CACHE_ENTRIES) so a client's next
    request with the same token costs a hash, not a signature check. Errors carry no token. Imports the config, the
    errors and the principals; nothing of the front or the tasks."""

    def __init__(self, config: JwtConfig) -> None:
        self.config = config
        self.keys = KeySet(config)
        # token digest → owner, remembered until, the token's exp
        self._verified: OrderedDict[bytes, tuple[str, float, float]] = OrderedDict()

    async def identify(self, value: str) -> Identity:
        match = _BEARER_JWT.fullmatch(value)
        if match is None:
            return Identity(value)
        token = match.group(1)
        digest = hashlib.sha256(token.encode()).digest()
        remembered = self._verified.get(digest)
        if remembered is not None and time.time() < remembered[1]:
            self._verified.move_to_end(digest)
            return Identity(value, owner=remembered[0], expires_at=remembered[2])
        owner, expires_at = await self._verify(token)
        self._remember(digest, owner, min(expires_at, time.time() + CACHE_SECONDS), expires_at)
        return Identity(value, owner=owner, expires_at=expires_at)

    async def _verify(self, token: str) -> tuple[str, float]:
        config = self.config
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise JwtRejectedError("Unauthorized: the Bearer token is not a well-formed JWT") from None
        algorithm = header.get("alg")
        if algorithm not in config.algorithms:
            raise JwtRejectedError(f"Unauthorized: JWT algorithm {str(algorithm)[:20]!a} is not accepted")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise JwtRejectedError("Unauthorized: the JWT's kid is not a string")
        key = await self.keys.key(kid)
        declared = self.keys.declared_alg.get(kid if kid is not None else key.key_id)
        if declared is not None and declared != algorithm:
            raise JwtRejectedError("Unauthorized: the JWT's algorithm is not its key's")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[algorithm],
                issuer=config.issuer,
                audience=config.audience or None,
                leeway=config.leeway_seconds,
                options={"require": ["exp", "iss"], "verify_aud": bool(config.audience)},
            )
        except jwt.ExpiredSignatureError:
            raise JwtRejectedError("Unauthorized: the JWT has expired") from None
        except jwt.InvalidIssuerError:
            raise JwtRejectedError("Unauthorized: the JWT's issuer is not accepted") from None
        except jwt.InvalidAudienceError:
            raise JwtRejectedError("Unauthorized: the JWT's audience is not accepted") from None
        except jwt.InvalidSignatureError:
            raise JwtRejectedError("Unauthorized: the JWT's signature does not verify") from None
        except (jwt.PyJWTError, ValueError, TypeError) as exc:
            raise JwtRejectedError(f"Unauthorized: the JWT is not valid ({type(exc).__name__})") from None
        subject = claims.get(config.claim)
        if not isinstance(subject, str | int) or isinstance(subject, bool) or subject == "":
            raise JwtRejectedError(f"Unauthorized: the JWT has no {config.claim} claim")
        owner = json.dumps([claims["iss"], str(subject)])
        return owner, float(claims["exp"])

    def _remember(self, digest: bytes, owner: str, until: float, expires_at: float) -> None:
        self._verified[digest] = (owner, until, expires_at)
        self._verified.move_to_end(digest)
        while len(self._verified) > CACHE_ENTRIES:
            self._verified.popitem(last=False)

    async def close(self) -> None:
        await self.keys.close()


async def identify(headers: Mapping[str, str], security: SecurityConfig, jwt: JwtIdentity | None) -> Identity | None:
    """Who sent a request the proxy serves itself, in either era: the principal header's identity (an empty one
    counts as none), its Bearer JWT verified when `security.jwt` is set (one that fails: 401 here). A caller
    without one is anonymous (None), or refused with 401 under `security.anonymous: refuse`."""
    principal = identity_of(headers.get(security.principal_header))
    if principal is None and security.anonymous == "refuse":
        raise UnauthorizedError(
            f"Unauthorized: this proxy serves no anonymous callers; send {security.principal_header}"
        )
    if principal is not None and jwt is not None:
        principal = await jwt.identify(principal.credential)
    return principal


async def caller_identity(headers: Mapping[str, str], config: Config, jwt: JwtIdentity | None) -> Identity | None:
    """`identify`, and where the proxy makes the upstream credential itself (`upstream.credentials` exchange or
    secrets) a caller it cannot verify is refused (401): the credential is made for a verified owner only."""
    principal = await identify(headers, config.security, jwt)
    if not config.upstream.credentials.forwards:
        if principal is None:
            raise UnauthorizedError(
                f"Unauthorized: this proxy serves no anonymous callers; send {config.security.principal_header}"
            )
        verified(principal)
    return principal
