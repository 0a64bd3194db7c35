"""The proxy as a client of a token endpoint (`TokenClient`): RFC 8693 exchange and RFC 6749 refresh requests,
the proxy's client authenticated by its secret or a signed assertion (RFC 7523), the answer read with a size cap
and a timeout and checked before use, refusals classified once. Imports aiohttp's client, PyJWT, the config and
the errors; no session.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import quote, urlencode

import aiohttp
import jwt
import structlog

from proxy.config.credentials import ACCESS_TOKEN_TYPE, TOKEN_EXCHANGE_GRANT, ExchangeConfig, TargetConfig
from proxy.errors import CredentialRefusedError, CredentialUnavailableError

log = structlog.get_logger(__name__)

MAX_RESPONSE_BYTES: Final = 64 * 1024  # a token response is a few KB; anything larger is refused unread
DEFAULT_LIFETIME_SECONDS: Final = 60.0  # a token whose answer gives no `expires_in` is renewed this soon
MAX_RETRY_AFTER_SECONDS: Final = 300
ASSERTION_SECONDS: Final = 60  # lifetime of a private_key_jwt client assertion
CLIENT_ASSERTION_TYPE: Final = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
# Refused because of the caller's token or what was asked for it (RFC 6749 section 5.2, RFC 8693 section 2.2.2).
CALLER_ERRORS: Final = frozenset({"invalid_grant", "invalid_request", "invalid_target", "invalid_scope"})
_B64TOKEN: Final = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 section 2.1
_VSCHAR: Final = re.compile(r"[\x20-\x7e]+")  # RFC 6749 appendix A: refresh tokens, client ids
_ERROR_CODE: Final = re.compile(r"[\x20\x21\x23-\x5b\x5d-\x7e]{1,64}")  # RFC 6749 section 5.2, bounded


@dataclass(frozen=True, slots=True)
class Token:
    """One token the endpoint issued, with when it expires (epoch seconds) and, when it gave one, the refresh
    token that renews it. Its fields are secrets: never in a repr."""

    access: str = field(repr=False)
    issued_at: float
    expires_at: float
    refresh: str | None = field(default=None, repr=False)

    def fresh(self, now: float, renew_before_seconds: float) -> bool:
        """Still good to send: more than `renew_before_seconds` (or a quarter of its lifetime, the lesser) left."""
        margin = min(renew_before_seconds, max(self.expires_at - self.issued_at, 0.0) / 4)
        return now < self.expires_at - margin

    def to_json(self) -> str:
        return json.dumps({"a": self.access, "i": self.issued_at, "e": self.expires_at, "r": self.refresh})

    @classmethod
    def from_json(cls, text: str) -> Token:
        data = json.loads(text)
        return cls(str(data["a"]), float(data["i"]), float(data["e"]), data["r"] if data.get("r") else None)


def _checked(value: str, what: str) -> str:
    if not _VSCHAR.fullmatch(value):
        raise CredentialUnavailableError(detail=f"{what} is not visible ASCII and is not sent")
    return value


class TokenClient:
    """Requests to one token endpoint (`upstream.credentials.exchange`) on an aiohttp client of its own.

    Everything written is checked where it is written: form values are visible ASCII before they are encoded,
    the Basic credential follows RFC 6749 section 2.3.1, and the access token that comes back must be an RFC 6750
    `b64token` (it becomes a header). A refusal is the caller's (`CredentialRefusedError`) or not
    (`CredentialUnavailableError`, logged at error level); no error, log line or repr names a token or a secret."""

    def __init__(
        self,
        config: ExchangeConfig,
        client_secret: str | None,
        private_key: bytes | None,
        actor_token: str | None,
    ) -> None:
        self.config = config
        self._client_secret = client_secret
        self._private_key = private_key
        self._actor_token = actor_token
        self._http: aiohttp.ClientSession | None = None
        self.requests = 0  # token requests sent, for the metrics and tests

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def exchange(self, subject_token: str, target: TargetConfig) -> Token:
        """RFC 8693 section 2.1: the caller's access token for one issued for `target`."""
        form = {
            "grant_type": TOKEN_EXCHANGE_GRANT,
            "subject_token": _checked(subject_token, "the subject token"),
            "subject_token_type": ACCESS_TOKEN_TYPE,
            "requested_token_type": ACCESS_TOKEN_TYPE,
        }
        if self._actor_token is not None:
            form["actor_token"] = _checked(self._actor_token, "the actor token")
            form["actor_token_type"] = self.config.actor_token_type
        return await self._request(form, target, "exchange")

    async def refresh(self, refresh_token: str, target: TargetConfig) -> Token:
        """RFC 6749 section 6: a fresh token for the same grant (the scope asked for again, as it was)."""
        form = {"grant_type": "refresh_token", "refresh_token": _checked(refresh_token, "the refresh token")}
        return await self._request(form, target, "refresh")

    # --- one request -----------------------------------------------------------------------------------------

    async def _request(self, form: dict[str, str], target: TargetConfig, grant: str) -> Token:
        for name, value in (("audience", target.audience), ("resource", target.resource), ("scope", target.scope)):
            if value is not None and (grant == "exchange" or name == "scope"):
                form[name] = value  # (checked by the config: visible ASCII, scope tokens)
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"}
        self._authenticate(form, headers)
        if self._http is None:
            self._http = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_seconds)
        started = time.time()
        self.requests += 1
        try:
            async with self._http.post(
                self.config.token_url, data=urlencode(form), headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                body = await response.content.read(MAX_RESPONSE_BYTES + 1)
                status = response.status
                retry_after = response.headers.get("Retry-After", "")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.error("token_endpoint_unavailable", grant=grant, error=type(exc).__name__)
            raise CredentialUnavailableError(detail=f"{grant}: {type(exc).__name__}") from None
        if len(body) > MAX_RESPONSE_BYTES:
            log.error("token_endpoint_answer_too_large", grant=grant, max_bytes=MAX_RESPONSE_BYTES)
            raise CredentialUnavailableError(detail=f"{grant}: answer over {MAX_RESPONSE_BYTES} bytes")
        if status == 200:
            return self._token(body, started, grant)
        raise self._refusal(status, body, retry_after, grant)

    def _authenticate(self, form: dict[str, str], headers: dict[str, str]) -> None:
        """The proxy client's authentication (RFC 6749 section 2.3.1; RFC 7523 section 2.2)."""
        config = self.config
        if self._private_key is not None:
            assert config.private_key_jwt is not None
            now = int(time.time())
            claims = {
                "iss": config.client_id,
                "sub": config.client_id,
                "aud": config.token_url,
                "jti": secrets.token_urlsafe(16),
                "iat": now,
                "exp": now + ASSERTION_SECONDS,
            }
            key_headers = {"kid": config.private_key_jwt.kid} if config.private_key_jwt.kid else None
            form["client_id"] = config.client_id
            form["client_assertion_type"] = CLIENT_ASSERTION_TYPE
            form["client_assertion"] = jwt.encode(
                claims, self._private_key, algorithm=config.private_key_jwt.algorithm, headers=key_headers
            )
            return
        assert self._client_secret is not None
        if config.client_auth == "client_secret_post":
            form["client_id"] = config.client_id
            form["client_secret"] = self._client_secret
            return
        # Basic: each part form-urlencoded first (RFC 6749 section 2.3.1), so a ':' in the id cannot split it.
        pair = f"{quote(config.client_id, safe='')}:{quote(self._client_secret, safe='')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()

    def _token(self, body: bytes, started: float, grant: str) -> Token:
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            log.error("token_endpoint_answer_invalid", grant=grant, problem="not a JSON object")
            raise CredentialUnavailableError(detail=f"{grant}: the answer is not a JSON object")
        access = answer.get("access_token")
        token_type = answer.get("token_type")
        expires_in = answer.get("expires_in")
        refresh = answer.get("refresh_token")
        problem = None
        if not isinstance(access, str) or not _B64TOKEN.fullmatch(access):
            problem = "access_token missing or not a bearer token (RFC 6750 b64token)"
        elif not isinstance(token_type, str) or token_type.lower() != "bearer":
            problem = "token_type is not Bearer"
        elif expires_in is not None and (
            isinstance(expires_in, bool) or not isinstance(expires_in, int | float) or expires_in <= 0
        ):
            problem = "expires_in is not a positive number"
        elif refresh is not None and (not isinstance(refresh, str) or not _VSCHAR.fullmatch(refresh)):
            problem = "refresh_token is not visible ASCII"
        if problem is not None:
            log.error("token_endpoint_answer_invalid", grant=grant, problem=problem)
            raise CredentialUnavailableError(detail=f"{grant}: {problem}")
        assert isinstance(access, str)
        lifetime = float(expires_in) if expires_in is not None else DEFAULT_LIFETIME_SECONDS
        return Token(access, started, started + lifetime, refresh if isinstance(refresh, str) else None)

    def _refusal(
        self, status: int, body: bytes, retry_after: str, grant: str
    ) -> CredentialRefusedError | CredentialUnavailableError:
        """RFC 6749 section 5.2: the caller's errors are a 401 naming the endpoint's `error`; the rest (the proxy's
        own client refused, an unknown error, a 5xx, no error at all) are a 503, logged at error level."""
        error = None
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and isinstance(answer.get("error"), str) and _ERROR_CODE.fullmatch(answer["error"]):
            error = answer["error"]
        if status < 500 and error in CALLER_ERRORS:
            log.info("token_endpoint_refused_caller", grant=grant, status=status, error=error)
            what = "exchange the caller's token" if grant == "exchange" else "renew the upstream credential"
            return CredentialRefusedError(
                f"Unauthorized: the token endpoint refused to {what} ({error}); authorize again", error
            )
        log.error("token_endpoint_refused", grant=grant, status=status, error=error or "none")
        seconds = int(retry_after) if retry_after.isdigit() else 5
        return CredentialUnavailableError(
            retry_after_seconds=max(1, min(seconds, MAX_RETRY_AFTER_SECONDS)),
            detail=f"{grant}: HTTP {status} {error or ''}".rstrip(),
        )
