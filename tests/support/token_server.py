"""A real OAuth token endpoint for the credential tests, written with Authlib on Flask, served on loopback from a
thread of the test process (werkzeug's threaded server; `stop()` ends it).

Grants: RFC 8693 token exchange (a custom grant registered on Authlib's AuthorizationServer: the subject token is
an access token JWT of `tests.support.oauth.ISSUER`, verified here with the issuer's key) and RFC 6749 refresh
(Authlib's RefreshTokenGrant, rotating: each refresh returns a new refresh token and revokes the old one). The
proxy's client authenticates with `client_secret_basic`, `client_secret_post` or a private_key_jwt assertion
(Authlib's RFC 7523 client assertion). Issued access tokens are RS256 JWTs of TOKEN_ISSUER (their key set is
`jwks_path`, which the upstream fixture trusts with `--auth`), `sub` the subject's, `aud` the audience asked for.

Switches for the tests: `lifetime_seconds`, `refresh_tokens` (issue them or not), `down` (answer 503),
`refuse_subjects` (subjects whose exchange is refused `invalid_grant`), and what was issued (`issued`, `exchanges`,
`refreshes`).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from authlib.integrations.flask_oauth2 import AuthorizationServer
from authlib.oauth2.rfc6749 import ClientMixin, InvalidGrantError, InvalidRequestError, OAuth2Error
from authlib.oauth2.rfc6749.grants import BaseGrant, RefreshTokenGrant, TokenEndpointMixin
from authlib.oauth2.rfc7523 import JWTBearerClientAssertion
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from flask import Flask, Response
from joserfc.jwk import RSAKey
from werkzeug.serving import BaseWSGIServer, make_server

from tests.support.oauth import ISSUER, Issuer

TOKEN_ISSUER = "https://token-endpoint.example"
EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN = "urn:ietf:params:oauth:token-type:access_token"
CLIENT_ID = "mcp-tasks-proxy"
AUTH_METHODS = ["client_secret_basic", "client_secret_post", JWTBearerClientAssertion.CLIENT_AUTH_METHOD]


class InvalidTargetError(OAuth2Error):  # type: ignore[misc]
    error = "invalid_target"  # RFC 8693 section 2.2.2


@dataclass
class ProxyClient(ClientMixin):  # type: ignore[misc]
    client_id: str
    client_secret: str
    public_key: dict[str, Any]

    def get_client_id(self) -> str:
        return self.client_id

    def check_client_secret(self, client_secret: str) -> bool:
        return secrets.compare_digest(client_secret, self.client_secret)

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return method in AUTH_METHODS

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type in (EXCHANGE, "refresh_token")

    def get_allowed_scope(self, scope: str) -> str:
        return scope


@dataclass
class Grant:
    """A refresh token's grant, as the endpoint keeps it."""

    subject: str
    audience: str | None
    scope: str | None
    client_id: str
    revoked: bool = False

    def check_client(self, client: ProxyClient) -> bool:
        return client.client_id == self.client_id

    def get_scope(self) -> str | None:
        return self.scope


@dataclass
class Issued:
    subject: str
    audience: str | None
    access_token: str
    grant: str  # exchange | refresh


class _Assertion(JWTBearerClientAssertion):  # type: ignore[misc]
    def __init__(self, server: TokenServer) -> None:
        super().__init__()
        self.server = server

    def get_audiences(self) -> list[str]:
        return [self.server.url]

    def validate_jti(self, claims: Any, jti: str) -> bool:
        return self.server.jtis.add_new(jti)

    def resolve_client_public_key(self, client: ProxyClient) -> Any:
        return RSAKey.import_key(client.public_key)


class _Jtis:
    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def add_new(self, jti: str) -> bool:
        with self.lock:
            if jti in self.seen:
                return False
            self.seen.add(jti)
            return True


class _TokenExchange(BaseGrant, TokenEndpointMixin):  # type: ignore[misc]
    GRANT_TYPE = EXCHANGE
    TOKEN_ENDPOINT_AUTH_METHODS = AUTH_METHODS
    token_server: TokenServer  # set on the class by TokenServer

    def validate_token_request(self) -> None:
        client = self.authenticate_token_endpoint_client()
        self.request.client = client
        form = self.request.form
        if form.get("subject_token_type") != ACCESS_TOKEN or not form.get("subject_token"):
            raise InvalidRequestError("subject_token of type access_token is required")
        server = self.token_server
        try:
            claims = jwt.decode(
                form["subject_token"],
                server.subject_issuer.key.public_key(),
                algorithms=["RS256"],
                issuer=ISSUER,
                options={"verify_aud": False, "require": ["exp", "sub"]},
            )
        except jwt.PyJWTError:
            raise InvalidGrantError("the subject token is not valid") from None
        if claims["sub"] in server.refuse_subjects:
            raise InvalidGrantError("the subject may not act here")
        audience = form.get("audience")
        if audience is not None and audience not in server.audiences:
            raise InvalidTargetError("unknown audience")
        if server.actor_token is not None and form.get("actor_token") != server.actor_token:
            raise InvalidRequestError("the actor token is missing or wrong")
        self.request.user = claims["sub"]

    def create_token_response(self) -> tuple[int, dict[str, Any], list[tuple[str, str]]]:
        form = self.request.form
        token = self.token_server.issue(
            self.request.user, form.get("audience"), form.get("scope"), self.request.client.client_id, "exchange"
        )
        token["issued_token_type"] = ACCESS_TOKEN
        return 200, token, self.TOKEN_RESPONSE_HEADER


class _Refresh(RefreshTokenGrant):  # type: ignore[misc]
    TOKEN_ENDPOINT_AUTH_METHODS = AUTH_METHODS
    INCLUDE_NEW_REFRESH_TOKEN = True
    token_server: TokenServer

    def authenticate_refresh_token(self, refresh_token: str) -> Grant | None:
        grant = self.token_server.grants.get(refresh_token)
        return grant if grant is not None and not grant.revoked else None

    def authenticate_user(self, refresh_token: Grant) -> str:
        return refresh_token.subject

    def issue_token(self, user: str, refresh_token: Grant) -> dict[str, Any]:
        return self.token_server.issue(
            user, refresh_token.audience, refresh_token.scope, refresh_token.client_id, "refresh"
        )

    def revoke_old_credential(self, refresh_token: Grant) -> None:
        refresh_token.revoked = True


@dataclass
class TokenServer:
    directory: Path
    subject_issuer: Issuer
    audiences: tuple[str, ...] = ("legacy-upstream",)
    lifetime_seconds: float = 600
    refresh_tokens: bool = True
    down: bool = False
    refuse_subjects: set[str] = field(default_factory=set)
    actor_token: str | None = None
    issued: list[Issued] = field(default_factory=list)
    grants: dict[str, Grant] = field(default_factory=dict)
    jtis: _Jtis = field(default_factory=_Jtis)
    url: str = ""

    def __post_init__(self) -> None:
        self.signing_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.jwks_path = self.directory / "token-endpoint-jwks.json"
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.signing_key.public_key()))
        self.jwks_path.write_text(json.dumps({"keys": [{**public, "kid": "te1", "alg": "RS256", "use": "sig"}]}))
        self.client_secret = secrets.token_urlsafe(24)
        self.client_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.client_key_path = self.directory / "client-key.pem"
        self.client_key_path.write_bytes(
            self.client_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        self.client_secret_path = self.directory / "client-secret"
        self.client_secret_path.write_text(self.client_secret)
        client_public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.client_key.public_key()))
        self.client = ProxyClient(CLIENT_ID, self.client_secret, client_public)
        self._lock = threading.Lock()
        self._server: BaseWSGIServer | None = None
        self._thread: threading.Thread | None = None

    # --- what the tests read ----------------------------------------------------------------------------------

    def tokens_of(self, subject: str) -> list[str]:
        with self._lock:
            return [issued.access_token for issued in self.issued if issued.subject == subject]

    def count(self, grant: str) -> int:
        with self._lock:
            return sum(1 for issued in self.issued if issued.grant == grant)

    # --- issuing ----------------------------------------------------------------------------------------------

    def issue(
        self, subject: str, audience: str | None, scope: str | None, client_id: str, grant: str
    ) -> dict[str, Any]:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": TOKEN_ISSUER,
            "sub": subject,
            "iat": now,
            "exp": now + int(self.lifetime_seconds),
            "jti": secrets.token_hex(8),
            "scope": scope or "mcp",
        }
        if audience is not None:
            claims["aud"] = audience
        access = jwt.encode(claims, self.signing_key, algorithm="RS256", headers={"kid": "te1"})
        token: dict[str, Any] = {
            "access_token": access,
            "token_type": "Bearer",
            "expires_in": int(self.lifetime_seconds),
            "scope": claims["scope"],
        }
        if self.refresh_tokens:
            refresh = secrets.token_urlsafe(32)
            token["refresh_token"] = refresh
            with self._lock:
                self.grants[refresh] = Grant(subject, audience, scope, client_id)
        with self._lock:
            self.issued.append(Issued(subject, audience, access, grant))
        return token

    # --- serving ----------------------------------------------------------------------------------------------

    def _app(self) -> Flask:
        app = Flask("token-endpoint")
        server = AuthorizationServer(app, query_client=self._query_client, save_token=lambda token, request: None)
        _TokenExchange.token_server = self
        _Refresh.token_server = self
        server.register_grant(_TokenExchange)
        server.register_grant(_Refresh)
        server.register_client_auth_method(JWTBearerClientAssertion.CLIENT_AUTH_METHOD, _Assertion(self))

        @app.post("/token")
        def token() -> Response:
            if self.down:
                return Response("down for maintenance", status=503)
            response: Response = server.create_token_response()
            return response

        return app

    def _query_client(self, client_id: str) -> ProxyClient | None:
        return self.client if client_id == CLIENT_ID else None

    def start(self) -> TokenServer:
        self._server = make_server("127.0.0.1", 0, self._app(), threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}/token"
        self._thread = threading.Thread(target=self._server.serve_forever, name="token-endpoint", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def exchange_config(self, **overrides: Any) -> dict[str, Any]:
        """`upstream.credentials` for a proxy using this endpoint (client_secret_basic unless overridden)."""
        exchange: dict[str, Any] = {
            "token_url": self.url,
            "client_id": CLIENT_ID,
            "client_secret_file": str(self.client_secret_path),
            "audience": self.audiences[0],
            "scope": "mcp",
        }
        exchange.update(overrides)
        return {"mode": "exchange", "exchange": exchange}
