"""`upstream.credentials`: what the proxy presents upstream for a caller (`forward`, its own header; `exchange`, an
RFC 8693 token exchange; `secrets`, a mounted per-caller map). A pure description: the files it names are read by
`proxy/upstream/credentials/`. Imports only the wire's field checks.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proxy.wire.fields import is_safe_value

TOKEN_EXCHANGE_GRANT: Final = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE: Final = "urn:ietf:params:oauth:token-type:access_token"
_LOOPBACK: Final = frozenset({"127.0.0.1", "::1", "localhost"})
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP token (RFC 9110, section 5.6.2)
# RFC 6749 appendix A: client_id and scope tokens are visible ASCII (scope tokens without space, `"` or `\`)
_VSCHAR: Final = re.compile(r"[\x20-\x7e]+")
_SCOPE: Final = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+( [\x21\x23-\x5b\x5d-\x7e]+)*")
JwtSigning = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _visible(value: str | None, what: str) -> str | None:
    if value is not None and not _VSCHAR.fullmatch(value):
        raise ValueError(f"{what} must be visible ASCII (RFC 6749, appendix A)")
    return value


class TargetConfig(_Frozen):
    """What the exchanged token is for: where the token endpoint aims it (RFC 8693 section 2.1)."""

    audience: str | None = Field(
        None,
        description="`audience` of the exchange: the logical name of the upstream as the token endpoint knows it "
        "(Keycloak: the upstream's client id; Okta: the upstream's authorization server audience). Null: none sent.",
    )
    resource: str | None = Field(
        None,
        description="`resource` of the exchange (RFC 8707): the upstream's URL, for endpoints that aim tokens by "
        "URL. Null: none sent.",
    )
    scope: str | None = Field(
        None,
        description="`scope` of the exchange: the space-separated scopes the upstream needs, no more (least "
        "privilege). Null: none sent (the endpoint's default).",
    )

    @field_validator("audience", "resource")
    @classmethod
    def _visible_ascii(cls, value: str | None) -> str | None:
        return _visible(value, "audience and resource")

    @field_validator("scope")
    @classmethod
    def _scopes(cls, value: str | None) -> str | None:
        if value is not None and not _SCOPE.fullmatch(value):
            raise ValueError("must be scope tokens separated by single spaces (RFC 6749, section 3.3)")
        return value


class PrivateKeyJwtConfig(_Frozen):
    """Client authentication by a signed assertion (`private_key_jwt`, RFC 7523 and OpenID Connect Core 9)."""

    key_file: str = Field(description="PEM file with the proxy client's private key (e.g. a mounted Secret).")
    algorithm: JwtSigning = Field("RS256", description="Signature algorithm of the assertion (asymmetric only).")
    kid: str | None = Field(
        None, description="`kid` header of the assertion, naming the key among the client's registered keys."
    )

    @field_validator("kid")
    @classmethod
    def _kid(cls, value: str | None) -> str | None:
        return _visible(value, "kid")


class ExchangeConfig(TargetConfig):
    """OAuth 2.0 Token Exchange (RFC 8693) at a token endpoint: the caller's verified access token is the
    `subject_token`; what comes back is sent upstream instead of it."""

    token_url: str = Field(
        description="The token endpoint (Keycloak: `https://sso.example/realms/R/protocol/openid-connect/token`; "
        "Okta: `https://example.okta.com/oauth2/<server>/v1/token`). https://, or http:// to a loopback address.",
    )
    client_id: str = Field(min_length=1, description="The proxy's own client id at the token endpoint.")
    client_secret_file: str | None = Field(
        None,
        description="File holding the proxy client's secret (e.g. a mounted Secret), read at start. Exactly one of "
        "`client_secret_file` and `private_key_jwt` is set.",
    )
    client_auth: Literal["client_secret_basic", "client_secret_post"] = Field(
        "client_secret_basic",
        description="With `client_secret_file`: the secret in HTTP Basic (`client_secret_basic`, the default "
        "every endpoint must take) or in the form (`client_secret_post`).",
    )
    private_key_jwt: PrivateKeyJwtConfig | None = Field(
        None, description="Authenticate the proxy client with a signed JWT instead of a secret (Okta's default)."
    )
    actor_token_file: str | None = Field(
        None,
        description="Optional file holding a token that names the proxy as the actor (`actor_token`, RFC 8693 "
        "section 2.1: delegation rather than impersonation), read at start.",
    )
    actor_token_type: str = Field(
        ACCESS_TOKEN_TYPE, description="`actor_token_type` sent with `actor_token_file` (a token type URI)."
    )
    header: str = Field(
        "authorization",
        description="The upstream request header the exchanged token goes in, as `Bearer <token>`.",
    )
    tools: dict[str, TargetConfig] = Field(
        default_factory=dict,
        description="Per-tool targets, keyed by exact tool name or glob (an exact name wins, then the first "
        "glob in file order): a tool whose upstream needs another audience, resource or scope. Its calls, and the "
        "tasks/* requests about a task it started, carry a token exchanged for that target; everything else "
        "(initialize, lists, answers to questions) the default one.",
    )
    renew_before_seconds: float = Field(
        30.0,
        ge=0,
        description="An exchanged token is renewed once less than this (or a quarter of its lifetime, whichever "
        "is less) is left, so no upstream request carries a token about to expire.",
    )
    timeout_seconds: float = Field(
        5.0,
        gt=0,
        le=60,
        description="Longest a request to the token endpoint may take; past it the caller gets 503 with "
        "`Retry-After` (never the inbound token forwarded instead).",
    )

    @field_validator("token_url")
    @classmethod
    def _secure_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme == "https" and parts.hostname:
            return value
        if parts.scheme == "http" and parts.hostname in _LOOPBACK:
            return value
        raise ValueError("must be an https:// URL (http:// only to a loopback address)")

    @field_validator("client_id", "actor_token_type")
    @classmethod
    def _client_id(cls, value: str) -> str:
        _visible(value, "client_id and actor_token_type")
        return value

    @field_validator("header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not _HEADER_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not an HTTP header name")
        return value

    @model_validator(mode="after")
    def _one_client_authentication(self) -> ExchangeConfig:
        if (self.client_secret_file is None) == (self.private_key_jwt is None):
            raise ValueError("set exactly one of client_secret_file and private_key_jwt")
        return self


class SecretsConfig(_Frozen):
    """Per-caller credentials from a mounted file or directory, keyed by the caller's verified claim value."""

    path: str = Field(
        description="A YAML or JSON file mapping each claim value (`security.jwt.claim`, e.g. `sub`) to its "
        "credential, `{NAME: value}`; or a directory (a mounted Kubernetes Secret) with one such mapping per file, "
        "named by the claim value. NAMEs are request headers for a `url` upstream and environment variables for a "
        "`command` upstream. Read at start and again whenever it changes (looked at every 2 s, and on SIGHUP).",
    )


def _shorthand(value: Any) -> Any:
    """`credentials: forward` (a mode alone) stands for `credentials: {mode: forward}`."""
    return {"mode": value} if isinstance(value, str) else value


class CredentialsConfig(_Frozen):
    """What the proxy presents upstream for each caller (see the credentials guide, docs/guides/credentials.md)."""

    mode: Literal["forward", "exchange", "secrets"] = Field(
        "forward",
        description="`forward`: the caller's own principal header goes upstream (only for an upstream inside the "
        "proxy's trust boundary that accepts the token for itself). `exchange` (`url` upstreams): the caller's "
        "verified token is exchanged for one issued for the upstream (RFC 8693). `secrets`: the caller's "
        "credential comes from `secrets.path`. With `exchange` and `secrets` the inbound token is never sent "
        "upstream, every caller needs a verified JWT (`security.jwt`), and upstream sessions (stdio processes) are "
        "kept per caller, so a refreshed token keeps its session.",
    )
    exchange: ExchangeConfig | None = Field(None, description="With `mode: exchange`: the token endpoint.")
    secrets: SecretsConfig | None = Field(None, description="With `mode: secrets`: where the map is.")

    @model_validator(mode="before")
    @classmethod
    def _mode_alone(cls, value: Any) -> Any:
        return _shorthand(value)

    @model_validator(mode="after")
    def _section_of_the_mode(self) -> CredentialsConfig:
        for section in ("exchange", "secrets"):
            present = getattr(self, section) is not None
            if present and self.mode != section:
                raise ValueError(f"{section} is set but mode is {self.mode}")
            if self.mode == section and not present:
                raise ValueError(f"mode: {section} needs the {section} section")
        return self

    @property
    def forwards(self) -> bool:
        return self.mode == "forward"


def check_header_value(name: str, value: str) -> None:
    """A header a secrets entry sets, checked where it is read (and again by the HTTP client that writes it)."""
    if not _HEADER_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an HTTP header name")
    if not is_safe_value(value):
        raise ValueError(f"the value of {name} holds a control character or surrounding whitespace")
