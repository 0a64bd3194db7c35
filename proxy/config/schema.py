"""Configuration: the schema, frozen pydantic models, a pure description (reading files and the environment is
`loader.py`'s). Every field has a default, a description (the configuration reference is written from them)
and a reload mark (`LIVE` or `RESTART`). Imports only the wire's field checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cached_property
from typing import Annotated, Any, Final, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from proxy.config.credentials import CredentialsConfig
from proxy.wire.fields import is_safe_value

# Owns the shape of the config file and its validation: a pure description (the files it names are read by
# `keyfiles.py`, which the loader asks). Every field has a default and a description (the configuration reference,
# docs/reference/configuration.md, is written from these descriptions when the docs site is built). The upstream is a
# union of two kinds, told apart by which of `url` and `command` is set; only upstream/ looks at which. Imports only
# the wire's field checks from the rest of the proxy.

# A field whose values may be credentials (an API key header, a token in a server's environment): `redacted`
# (`loader.py`) prints its keys only. Key material itself is never in the configuration, only the paths
# of its files.
SECRET_VALUES: Final[JsonDict] = {"secret": True}
# How a reload treats a field (its `reload`): read where it is used, so a reload changes it (`LIVE`); or bound when
# the proxy starts, so a reload that changes it is refused until a restart (`RESTART`). Every field a reload
# compares carries one; `live.py` derives the restart list from them.
LIVE: Final[JsonDict] = {"reload": "live"}
RESTART: Final[JsonDict] = {"reload": "restart"}
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # an HTTP token (RFC 9110, section 5.6.2)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ListenConfig(_Frozen):
    host: str = Field(
        "127.0.0.1",
        description="Address the proxy binds to. Loopback by default: a sidecar is reached through its pod.",
        json_schema_extra=RESTART,
    )
    port: int = Field(
        8080,
        ge=0,
        le=65535,
        description="TCP port the proxy listens on (0 picks a free port).",
        json_schema_extra=RESTART,
    )
    path: str = Field(
        "/mcp",
        description="The one MCP endpoint, served to modern and legacy clients alike.",
        json_schema_extra=RESTART,
    )

    shutdown_grace_seconds: float = Field(
        3.0,
        ge=0,
        description="After the drain (`tasks.drain_seconds`): requests still open (calls the drain did not see "
        "end, legacy streams) get this long, then are cancelled. The drain plus this, plus a few seconds to close, "
        "stays below the pod's terminationGracePeriodSeconds.",
        json_schema_extra=RESTART,
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="The event loop `proxy serve` runs on: `uvloop` (installed by default where it builds; faster "
        "sockets and callbacks), the standard `asyncio` loop, or `auto`: uvloop when it is installed.",
        json_schema_extra=RESTART,
    )

    @field_validator("path")
    @classmethod
    def _path_is_absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        if value in ("/healthz", "/readyz", "/metrics", "/drainz"):
            raise ValueError(f"{value} is the proxy's own probe/metrics path")
        return value


class _UpstreamCommon(_Frozen):
    connect_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="Time allowed to open a TCP connection to the upstream before it counts as down. With "
        "`command`: how long a request waits for a process when `max_processes` are busy, and how long the "
        "readiness probe's `ping` may take (the start itself has `start_timeout_seconds`).",
        json_schema_extra=RESTART,
    )
    call_timeout_seconds: float = Field(
        3600.0,
        gt=0,
        description="Longest time one upstream request may run; bounds a hung upstream call.",
        json_schema_extra=RESTART,
    )
    max_concurrent_calls: int = Field(
        0,
        ge=0,
        description="Upstream requests of calls (tools/call, prompts/get, resources/read) this replica sends at "
        "once; more wait in a fair queue (round robin across callers, first come first served within one). A "
        "declaring client's call that has to wait becomes a task at once (`statusMessage` `queued: N ahead`); "
        "another caller waits up to `max_queue_wait_ms`. MRTR retries and `tasks/update` answers never wait: "
        "their call holds its slot already. 0: no cap (the upstream gets whatever arrives), and no queue. A live "
        "reload changes it for the calls waiting too (a raised or removed cap starts them at once).",
        json_schema_extra=LIVE,
    )
    max_queue_wait_ms: int = Field(
        30_000,
        gt=0,
        description="With `max_concurrent_calls`: how long a synchronous call (a client that did not declare the "
        "tasks extension, or a `forbidden` tool) waits in the queue; then it gets 503 with `Retry-After`, never "
        "having reached the upstream. 30 s stays within the 60 s request timeout common in MCP clients. A live "
        "reload changes it for calls that begin to wait from then on.",
        json_schema_extra=LIVE,
    )
    protocol_version: Literal["2025-11-25", "2025-06-18", "2025-03-26"] = Field(
        "2025-11-25",
        description="Protocol version the proxy offers in its own upstream `initialize` (the upstream may answer "
        "with an older one, which is then used).",
        json_schema_extra=RESTART,
    )
    credentials: CredentialsConfig = Field(
        default_factory=CredentialsConfig,
        description="What goes upstream as the caller's credential: `forward` (the default: the caller's own "
        "principal header), `exchange` (RFC 8693 token exchange, `url` upstreams) or `secrets` (a per-caller map "
        "from a mounted file); `credentials: forward` alone is short for `{mode: forward}`. See the credentials "
        "guide (docs/guides/credentials.md).",
        json_schema_extra=RESTART,
    )


class HttpUpstreamConfig(_UpstreamCommon):
    """A legacy server over Streamable HTTP (`url`)."""

    url: str = Field(
        description="Streamable HTTP endpoint of the legacy MCP server (2025-06-18 or 2025-11-25). Exactly one of "
        "`url` and `command` is set; empty: not set.",
        json_schema_extra=RESTART,
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=SECRET_VALUES | RESTART,
        description="Extra headers sent on every upstream request (e.g. a static API key the upstream needs); "
        "they replace a client's header of the same name, whatever its case. Names are HTTP tokens and values "
        "hold no control character but tab and no surrounding whitespace; a `Host` here replaces the URL's (a "
        "virtual host), a `Content-Length` is ignored.",
    )
    max_sessions: int = Field(
        64,
        gt=0,
        description="With `url`: idle upstream sessions kept for reuse: each caller's shared session, and the "
        "sessions lent to calls whose clients can answer questions. Beyond this the least recently used idle "
        "session is ended with DELETE. Sessions in use are bounded by `max_open_sessions`.",
        json_schema_extra=RESTART,
    )
    max_open_sessions: int = Field(
        512,
        gt=1,
        description="With `url`: upstream sessions open at once, busy and idle ones alike: each caller's shared "
        "session, and one per call whose client could answer a question (a running call, a task waiting for "
        "input, a parked MRTR call holds its own). At the limit an idle session is ended to make room; when none "
        "is idle, a new call that would need one more is refused at its start with HTTP 503, `Retry-After` and "
        "`data.limit: max_open_sessions` (never a task that fails later), and any other request waits up to "
        "`connect_timeout_seconds` for one to come free, then gets the same 503. Each open session costs a "
        "descriptor or two (its requests, its GET stream).",
        json_schema_extra=RESTART,
    )

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value

    @field_validator("headers")
    @classmethod
    def _headers_are_http(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~)")
            if not is_safe_value(text):
                raise ValueError(
                    f"the value of {name} holds a control character (a line break, NUL, ...) or surrounding "
                    "whitespace, which an HTTP header value cannot (RFC 9110, section 5.5)"
                )
        return value


class StdioUpstreamConfig(_UpstreamCommon):
    """A legacy server that speaks stdio, run by the proxy (`command`)."""

    command: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1,
        description="Instead of `url`: the argv of a legacy MCP server that speaks stdio (e.g. `[uvx, "
        "mcp-server-fetch]`), started and supervised by the proxy. Empty: not set.",
        json_schema_extra=RESTART,
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra=SECRET_VALUES | RESTART,
        description="With `command`: environment variables for the server, set over the few it inherits from the "
        "proxy when they are set there: HOME, LOGNAME, PATH, SHELL, TERM, USER, LANG, LC_ALL, LC_CTYPE, TZ, TMPDIR; "
        "the cache directories uvx and npx use (XDG_CACHE_HOME, XDG_CONFIG_HOME, XDG_DATA_HOME, XDG_STATE_HOME, "
        "XDG_RUNTIME_DIR, UV_CACHE_DIR, UV_TOOL_DIR, UV_PYTHON_INSTALL_DIR, npm_config_cache, NPM_CONFIG_CACHE); "
        "the trust store (SSL_CERT_FILE, SSL_CERT_DIR, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, NODE_EXTRA_CA_CERTS, "
        "PIP_CERT, UV_NATIVE_TLS); the outbound proxy (HTTP_PROXY, HTTPS_PROXY, NO_PROXY, ALL_PROXY and http_proxy, "
        "https_proxy, no_proxy, all_proxy). Nothing else of the proxy's environment reaches it.",
    )
    start_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="With `command`: how long a new server process has to answer `initialize`. `uvx` and `npx` "
        "resolve (and may download) the server first: a warm `uvx mcp-server-fetch` takes about 6 s. While it "
        "waits the proxy logs `upstream_process_still_starting` every 10 s; past it the request gets 504 saying "
        "the server did not answer initialize within this time.",
        json_schema_extra=RESTART,
    )
    cwd: str | None = Field(
        None,
        description="With `command`: the server's working directory; null: the proxy's own.",
        json_schema_extra=RESTART,
    )
    max_processes: int = Field(
        8,
        gt=0,
        description="With `command`: server processes running at once. A stdio server has exactly one client, "
        "so one process is one upstream session, and this bounds them: each caller's shared process (calls that "
        "cannot ask the client anything share it), one per call that can ask, one per legacy client session. At "
        "the limit a request waits up to `connect_timeout_seconds`, then gets 503 naming this field.",
        json_schema_extra=RESTART,
    )
    process_idle_seconds: float = Field(
        300.0,
        gt=0,
        description="With `command`: a server process lent to calls (or a legacy client's session) that has had "
        "no call for this long is stopped; each caller's shared process stays until its place is needed.",
        json_schema_extra=RESTART,
    )
    max_line_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="With `command`: the longest line (one JSON-RPC message) a server may write on stdout; a "
        "longer one kills that process, so one runaway message cannot exhaust the proxy's memory.",
        json_schema_extra=RESTART,
    )
    stop_grace_seconds: float = Field(
        5.0,
        ge=0,
        description="With `command`: stopping a server closes its stdin and waits this long, then sends SIGTERM "
        "(to its whole process group) and waits as long again, then sends SIGKILL.",
        json_schema_extra=RESTART,
    )

    @field_validator("credentials")
    @classmethod
    def _no_exchange_over_stdio(cls, value: CredentialsConfig) -> CredentialsConfig:
        if value.mode == "exchange":
            raise ValueError(
                "mode: exchange is for a url upstream (a token in each HTTP request); a stdio server takes its "
                "credential from its environment: use mode: secrets"
            )
        return value


# The upstream section of the file is flat: which of `url` and `command` is set says the kind, and the settings
# of the other kind (the example file shows them all) are left out.
_UPSTREAM_KINDS: Final[dict[str, type[_UpstreamCommon]]] = {"http": HttpUpstreamConfig, "stdio": StdioUpstreamConfig}


def _upstream_kind(value: Any) -> str | None:
    if isinstance(value, _UpstreamCommon):
        return "stdio" if isinstance(value, StdioUpstreamConfig) else "http"
    if not isinstance(value, Mapping):
        return None
    return "stdio" if value.get("command") else "http" if value.get("url") else None


def _one_kind(value: Any) -> Any:
    """Exactly one of `url` and `command` is set (empty or null: not set); the fields of the other kind go."""
    if not isinstance(value, Mapping):
        return value
    url, command = value.get("url"), value.get("command")
    if bool(url) == bool(command):
        raise PydanticCustomError(
            "upstream_kind",
            "set exactly one of upstream.url (a Streamable HTTP server) and upstream.command (a stdio server); {which}",
            {"which": "both are set" if url else "neither is set"},
        )
    kind = _UPSTREAM_KINDS[_upstream_kind(value) or "http"]
    foreign = set().union(*(model.model_fields for model in _UPSTREAM_KINDS.values())) - set(kind.model_fields)
    return {key: item for key, item in value.items() if key not in foreign}


UpstreamConfig = Annotated[
    Annotated[HttpUpstreamConfig, Tag("http")] | Annotated[StdioUpstreamConfig, Tag("stdio")],
    Discriminator(_upstream_kind),
    BeforeValidator(_one_kind),
]


JwtAlgorithm = Literal["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]


def _default_algorithms() -> list[JwtAlgorithm]:
    return ["RS256", "ES256"]


class JwtConfig(_Frozen):
    """A caller's Bearer JWT verified against its issuer's keys: the task owner is then the issuer plus a claim,
    which survives token refresh (an opaque token's owner is the token itself)."""

    jwks_url: str | None = Field(
        None,
        description="URL of the issuer's JSON Web Key Set (e.g. https://auth.example.com/.well-known/jwks.json). "
        "Fetched when first needed, cached, and fetched again when a token names an unknown `kid` (at most once "
        "per `jwks_refetch_seconds`). Exactly one of `jwks_url` and `jwks_file` is set.",
    )
    jwks_file: str | None = Field(
        None,
        description="A JSON Web Key Set in a file (e.g. a mounted ConfigMap), read when first needed and "
        "again after `jwks_ttl_seconds`.",
    )
    issuer: list[str] = Field(
        ...,
        min_length=1,
        description="Accepted `iss` values (one, or a list): a token from any other issuer gets 401.",
    )
    audience: list[str] = Field(
        default_factory=list,
        description="Accepted `aud` values; a token must name one of them. Empty: the audience is not checked "
        "(the upstream checks its own).",
    )
    claim: str = Field("sub", min_length=1, description="The claim that names the caller within its issuer.")
    algorithms: list[JwtAlgorithm] = Field(
        default_factory=_default_algorithms,
        min_length=1,
        description="Signature algorithms accepted (asymmetric only: `none` and HMAC are never accepted).",
    )
    leeway_seconds: float = Field(30.0, ge=0, le=300, description="Clock skew allowed on `exp`, `nbf` and `iat`.")
    max_keys: int = Field(64, ge=1, le=1024, description="Most keys kept from a key set; the rest are ignored.")
    jwks_refetch_seconds: float = Field(
        30.0,
        ge=0,
        description="Least time between two fetches of `jwks_url` caused by unknown `kid`s (a flood of tokens "
        "with made-up `kid`s costs one fetch per this interval).",
    )
    jwks_ttl_seconds: float = Field(
        3600.0, gt=0, description="A fetched key set is fetched again after this long (key rotation)."
    )
    jwks_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="Fetching the key set longer than this fails: callers with a JWT get 503 until it succeeds.",
    )

    @field_validator("issuer", "audience", mode="before")
    @classmethod
    def _one_or_a_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_key_source(self) -> JwtConfig:
        if bool(self.jwks_url) == bool(self.jwks_file):
            raise PydanticCustomError("jwks_source", "set exactly one of jwks_url and jwks_file")
        return self


class SecurityConfig(_Frozen):
    allowed_hosts: list[str] = Field(
        default_factory=lambda: ["localhost", "127.0.0.1", "[::1]"],
        description="Host header values accepted (port ignored, case ignored); anything else gets 403 "
        "(DNS-rebinding protection). Add the Service name when the proxy is reached through Kubernetes. A `*` "
        "label matches exactly one DNS label, so `mcp-server.*.svc.cluster.local` accepts the Service from any "
        "namespace; `*` is never the last label (`mcp-server.*` would accept mcp-server.com, a name anyone can "
        "register and point at the proxy), and the labels after it must be a domain you control or a cluster "
        "suffix.",
        json_schema_extra=LIVE,
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Origin header values accepted besides http(s)://<allowed host>[:port]; a request with "
        "any other Origin gets 403. Requests without Origin (non-browser clients) are accepted.",
        json_schema_extra=LIVE,
    )
    principal_header: str = Field(
        "authorization",
        description="Request header that identifies the caller; with `upstream.credentials: forward` it travels "
        "upstream with the requests it causes and upstream sessions are kept per distinct value; each task is bound "
        "to its keyed hash (another "
        "caller cannot see it). It must come from a trusted hop that authenticates the caller and overwrites what "
        "the client sent (see the security guide, docs/guides/security.md).",
        json_schema_extra=RESTART,
    )
    anonymous: Literal["allow", "refuse"] = Field(
        "allow",
        description="A 2026-07-28 request without the principal header (or with an empty one): `allow` serves it "
        "as the one shared anonymous caller (warned about at start on a non-loopback listener); `refuse` answers "
        "HTTP 401 with `WWW-Authenticate`.",
        json_schema_extra=LIVE,
    )
    jwt: JwtConfig | None = Field(
        None,
        description="Verify Bearer JWTs in `principal_header` (see the OAuth guide, docs/guides/oauth.md): a "
        "token that fails gets 401 before anything else; a valid one owns tasks as issuer + claim, so a refreshed "
        "token still reads its tasks. A value that is no JWT keeps the keyed hash of the whole value. Unset: every "
        "value is opaque.",
        json_schema_extra=RESTART,
    )
    upstream_auth: Literal["detect", "required", "none"] = Field(
        "detect",
        description="Does the upstream require credentials? `required`: what the proxy learns from it (discover, "
        "the tool catalog) serves only a caller whose own credential the upstream accepted; `none`: shared by "
        "every caller; `detect`: shared while an initialize without credentials succeeds and no request was "
        "refused with 401/403.",
        json_schema_extra=RESTART,
    )
    key_file: str | None = Field(
        None,
        description="The deployment key (at least 32 bytes, e.g. a mounted Secret): principals are stored as its "
        "HMAC, and the credential an `on_restart: rerun` task keeps is encrypted with it. Unset: "
        "`inputs.secret_file`, else a key created beside the SQLite database (`<store.path>.key`, 0600). "
        "Required with a PostgreSQL store and for `on_restart: rerun`.",
        json_schema_extra=RESTART,
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted; a larger one gets 413.",
        json_schema_extra=RESTART,
    )
    body_read_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="Time allowed for a whole request body to arrive once its headers are in; a slower one gets "
        "408 and its connection is closed, so a client that announces a large body and trickles it (or sends "
        "none) cannot hold a connection. 30 s takes `max_body_bytes` of 4 MiB at 140 KB/s.",
        json_schema_extra=LIVE,
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns_are_safe(cls, value: list[str]) -> list[str]:
        for name in value:
            labels = name.split(".")
            if any("*" in label and label != "*" for label in labels):
                raise ValueError(f"{name!r}: a `*` must be a whole label, as in mcp-server.*.svc")
            if labels[-1] == "*":
                raise ValueError(f"{name!r}: the last label cannot be `*` (it would accept public names)")
        return value


class RelayConfig(_Frozen):
    """Paths that are neither the MCP endpoint nor the proxy's own, relayed to the upstream's origin."""

    enabled: bool = Field(
        True,
        description="Relay every other path (OAuth protected-resource metadata, an embedded authorization "
        "server's /authorize, /token, /register, static pages) verbatim to the upstream URL's origin, with the "
        "pass-through's header rules, limits and X-Forwarded-*. Off: such paths get 404. A stdio upstream has "
        "no origin: 404 with a JSON body saying so.",
        json_schema_extra=RESTART,
    )
    prefixes: list[str] = Field(
        default_factory=list,
        description="Relay only paths under these prefixes (e.g. `/.well-known/`, `/authorize`); empty: every "
        "path. Others get 404.",
        json_schema_extra=RESTART,
    )

    @field_validator("prefixes")
    @classmethod
    def _absolute(cls, value: list[str]) -> list[str]:
        for prefix in value:
            if not prefix.startswith("/"):
                raise ValueError(f"{prefix!r} must start with '/'")
        return value


class DiscoveryConfig(_Frozen):
    cache_ttl_ms: int = Field(
        60_000,
        ge=0,
        description="`ttlMs` put on server/discover and list results: how long a client may reuse them. The "
        "upstream cannot say, so this is the operator's promise of how stable its lists are.",
        json_schema_extra=RESTART,
    )
    cache_scope: Literal["public", "private"] = Field(
        "private",
        description="`cacheScope` on cacheable results. `private` is safe when the upstream's answers depend on "
        "the caller's credentials; `public` lets shared caches reuse them.",
        json_schema_extra=RESTART,
    )


class IdempotencyConfig(_Frozen):
    enabled: bool = Field(
        True,
        description="Honour the `Idempotency-Key` request header on 2026-07-28 `tools/call` "
        "(draft-ietf-httpapi-idempotency-key-header): a repeat of a call with the same key does not run the tool "
        "again. `false`: the header is ignored and every call runs.",
        json_schema_extra=LIVE,
    )
    retention_seconds: float = Field(
        86_400.0,
        gt=0,
        description="How long a key's record (and the outcome replayed for it) is kept after the first request. "
        "24 h, as Stripe keeps its keys: long past any client's retries of one operation (minutes, an agent's "
        "restart), short enough that the table stays small.",
        json_schema_extra=LIVE,
    )
    join_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="How long a repeat that arrives while the first request still runs waits for its outcome "
        "(it joins it: one upstream call); past that it is answered HTTP 409 and may retry. Below a gateway's "
        "usual 60 s cut-off.",
        json_schema_extra=LIVE,
    )


class StoreConfig(_Frozen):
    path: str = Field(
        "mcp-tasks-proxy.db",
        description="SQLite file that holds durable tasks; put it on a volume. A relative path written in the "
        "config file is taken from that file's directory; one from `--db`, the environment or the default from "
        "the working directory (the start logs the absolute path, `store_opened`). One proxy process per file "
        "(a second one refuses to start on a file in use). It and its -wal, -shm and .lock files are owner-only "
        "(0600); directories the proxy creates for it are 0700. Unused when `store.url` is set.",
        json_schema_extra=RESTART,
    )
    synchronous: Literal["normal", "full"] = Field(
        "full",
        description="SQLite `synchronous` mode. `full`: a task is on disk before its handle is returned, so it "
        "survives a power loss; `normal`: it survives a crash of the proxy process, not of the machine, and "
        "creation is faster.",
        json_schema_extra=RESTART,
    )
    url: str | None = Field(
        None,
        description="PostgreSQL URL, e.g. `postgresql://proxy@db:5432/tasks`. When set, tasks live in PostgreSQL "
        "instead of `store.path`, and several replicas may share it. Never a password here: it comes from "
        "`store.password_file` or the `PGPASSWORD` environment variable. Give the proxy a database (or a schema, "
        "`?options=-csearch_path%3Dname`) of its own.",
        json_schema_extra=RESTART,
    )
    password_file: str | None = Field(
        None,
        description="File holding the PostgreSQL password (e.g. a mounted Secret), read for each new connection "
        "so a rotated password is picked up. Unset: libpq's own sources (`PGPASSWORD`, `~/.pgpass`).",
        json_schema_extra=RESTART,
    )
    pool_size: int = Field(
        10,
        ge=1,
        le=1000,
        description="PostgreSQL connections a replica keeps at most for its reads and writes (one more commits "
        "task creations in batches, one more listens to the change feed).",
        json_schema_extra=RESTART,
    )
    connect_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="Time allowed to connect to PostgreSQL: at start (the proxy refuses to start without its "
        "store) and for each new connection later.",
        json_schema_extra=RESTART,
    )
    lease_seconds: float = Field(
        10.0,
        gt=0,
        description="With PostgreSQL: how long a replica's lease lasts unless renewed. A replica that stops "
        "renewing it (killed, paused, cut off) loses its running tasks to a survivor after this long.",
        json_schema_extra=RESTART,
    )
    max_pending_settlements: int = Field(
        1024,
        ge=1,
        description="Task record writes (results, errors, questions, progress) kept in memory while the store "
        "cannot take them (unavailable: PostgreSQL away, SQLite's disk full or read-only), written again with "
        "backoff in order per task. Results are never dropped: at this many, a progress-only write is dropped "
        "(the next one or the result replaces it) and new tasks are refused (503, `data.limit`) so nothing new "
        "adds to them, while the calls already running still settle here. The default matches "
        "`tasks.max_running`: every task running when the store went away can settle.",
        json_schema_extra=RESTART,
    )
    timeout_seconds: float = Field(
        5.0,
        gt=0,
        le=300,
        description="With PostgreSQL: the deadline of every store operation (waiting for a pooled connection, "
        "connecting, the statement itself). Past it the store counts as unavailable: the request that needed it "
        "is answered 503 with `Retry-After` instead of hanging; while it stays away, operations wait 1 s at most. 5 s "
        "is hundreds of times a healthy commit and well inside the 30-60 s clients and load balancers wait for an "
        "answer.",
        json_schema_extra=RESTART,
    )

    @field_validator("url")
    @classmethod
    def _url_is_postgresql_without_password(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL")
        parts = urlsplit(value)
        if parts.password is not None or "password" in parse_qs(parts.query):
            raise ValueError(
                "must not contain a password: put it in the file named by store.password_file, "
                "or in the PGPASSWORD environment variable"
            )
        return value

    @model_validator(mode="after")
    def _password_needs_url(self) -> StoreConfig:
        if self.password_file is not None and self.url is None:
            raise ValueError("store.password_file is only used with store.url (PostgreSQL)")
        return self


TaskMode = Literal["forbidden", "optional", "required"]
RestartAction = Literal["fail", "rerun"]


class TaskPolicyConfig(_Frozen):
    mode: TaskMode = Field(
        "optional",
        description="`forbidden`: always synchronous. `optional`: a task when the client declared the extension "
        "and the call is still running after `sync_window_ms`. `required`: always a task for a declaring client.",
    )
    sync_window_ms: int = Field(
        1000,
        ge=0,
        description="How long an `optional` call may run before it becomes a task (0: a task at once). Fast calls "
        "stay plain synchronous results.",
    )
    ttl_ms: int | None = Field(
        300_000,
        gt=0,
        description="Lifetime of a task from its creation: a task not settled by then fails, and a settled one "
        "stays readable until then. `null`: unlimited.",
    )
    poll_interval_ms: int = Field(
        1000,
        gt=0,
        description="`pollIntervalMs` suggested to clients polling `tasks/get`. Once a tool has completed tasks, "
        "a working task of it suggests polling just after its expected end instead (up to 1.25x this value).",
    )
    on_restart: RestartAction = Field(
        "fail",
        description="What a task still running when the proxy stopped becomes at the next start: `fail` (-32603 "
        "with a message saying so) or `rerun` (the same tools/call is sent again; only for idempotent tools).",
    )
    resolve_input_first: bool = Field(
        False,
        description="For a declaring client: questions the upstream asks within `sync_window_ms` are answered "
        "in synchronous MRTR rounds first, and only a call still running after a window becomes a task. "
        "Needs `sync_window_ms` > 0.",
    )


class ToolPolicyConfig(_Frozen):
    """One tool's (or one glob's) policy: every field optional; what is left out comes from `tasks.default`."""

    mode: TaskMode | None = Field(None, description="As `tasks.default.mode`, for this tool.")
    sync_window_ms: int | None = Field(None, ge=0, description="As `tasks.default.sync_window_ms`, for this tool.")
    ttl_ms: int | None = Field(None, gt=0, description="As `tasks.default.ttl_ms` (`null`: unlimited), for this tool.")
    poll_interval_ms: int | None = Field(None, gt=0, description="As `tasks.default.poll_interval_ms`, for this tool.")
    on_restart: RestartAction | None = Field(None, description="As `tasks.default.on_restart`, for this tool.")
    resolve_input_first: bool | None = Field(None, description="As `tasks.default.resolve_input_first`, for this tool.")
    max_concurrent: int | None = Field(
        None,
        gt=0,
        description="Upstream requests of this tool's calls this replica sends at once, below "
        "`upstream.max_concurrent_calls` (for a tool the upstream handles worse than the rest); more wait in the "
        "same fair queue. null: only the upstream's cap. A live reload changes it for the calls waiting too.",
    )
    calls_per_minute_per_principal: int | None = Field(
        None,
        gt=0,
        description="`tools/call` requests of this tool one caller may start per minute, beside "
        "`limits.calls_per_minute_per_principal` (which counts every tool): the same fixed UTC-minute window, "
        "counted per tool (each tool a glob matches has its own count), shared by replicas on PostgreSQL. One "
        "more gets HTTP 429 with `Retry-After`, `RateLimit-Policy`/`RateLimit` naming this tool's policy, and "
        "`data.limit` `tasks.tools.<key>.calls_per_minute_per_principal`. MRTR retries do not count. null: no "
        "quota of its own.",
    )


class TasksConfig(_Frozen):
    default: TaskPolicyConfig = Field(
        default_factory=TaskPolicyConfig,
        description="The policy of every tool not named in `tasks.tools`.",
        json_schema_extra=LIVE,
    )
    tools: dict[str, ToolPolicyConfig] = Field(
        default_factory=dict,
        description="Per-tool policies, keyed by exact tool name or by glob (`batch_*`): an exact name wins, "
        "then the first matching glob in file order. A partial entry inherits the rest from `tasks.default`.",
        json_schema_extra=LIVE,
    )
    undeclared_required: Literal["reject", "wait"] = Field(
        "reject",
        description="A `required` tool called by a client that did not declare the extension: `reject` answers "
        "-32021 naming it; `wait` runs the task internally and answers synchronously when it settles.",
        json_schema_extra=LIVE,
    )
    max_running: int = Field(
        1024,
        gt=0,
        description="Tasks whose upstream call runs at once; one more is refused with -32603 (`data.limit`) "
        "before anything is stored. Tasks waiting for client input do not count.",
        json_schema_extra=LIVE,
    )
    max_records: int = Field(
        10_000,
        gt=0,
        description="Task records kept; at the limit the oldest settled records are evicted first, and a new "
        "task is refused only when every record is still live.",
        json_schema_extra=RESTART,
    )
    tombstone_seconds: float = Field(
        86_400.0,
        ge=0,
        description="How long a deleted record (its TTL ran out, or an operator purged it) leaves a tombstone, so "
        "that `tasks/get`, `tasks/update` and `tasks/cancel` of it answer that it expired (and when) instead of "
        '"not found", to its own principal only. A day covers a client that was away overnight; after that an '
        "id is unknown again. 0: no tombstones.",
        json_schema_extra=LIVE,
    )
    max_tombstones: int = Field(
        100_000,
        ge=0,
        description="Tombstones kept at most (about 100 bytes each: 10 MB at the default); the oldest go first, "
        "trimmed once a minute.",
        json_schema_extra=LIVE,
    )
    drain_seconds: float = Field(
        20.0,
        ge=0,
        description="On SIGTERM: how long the replica drains. It turns unready, refuses new calls with 503 and "
        "`Retry-After`, serves its tasks, MRTR retries and listen streams, and exits as soon as nothing of its own "
        "runs. What still runs after this long is left as at any stop (another replica or the next start fails or "
        "re-runs it per `on_restart`). 20 s leaves room for the final shutdown within Kubernetes' default "
        "terminationGracePeriodSeconds of 30.",
        json_schema_extra=LIVE,
    )

    @cached_property
    def has_tool_quotas(self) -> bool:
        """Some tool has a quota of its own (`tasks.tools.<key>.calls_per_minute_per_principal`): worked out once
        per config (a reload brings a new object)."""
        return any(entry.calls_per_minute_per_principal for entry in self.tools.values())


_TEMPLATE_FIELD: Final = re.compile(r"\{([^{}]*)\}")
JobState = Literal["working", "completed", "failed", "cancelled"]


def _jmespath(expression: str) -> str:
    """A JMESPath expression (jmespath.org/specification.html) that compiles; the error says where it breaks."""
    import jmespath  # config validation only: the calls compile their own copy (proxy/tasks/machine/job.py)
    from jmespath.exceptions import JMESPathError

    try:
        jmespath.compile(expression)
    except JMESPathError as exc:
        raise PydanticCustomError(
            "jmespath", "not a JMESPath expression: {error}", {"error": " ".join(str(exc).split())}
        ) from None
    return expression


def _job_template(value: Any) -> Any:
    """Tool arguments whose strings may name `{job_id}` (and nothing else), at any depth."""
    if isinstance(value, str):
        for name in _TEMPLATE_FIELD.findall(value):
            if name != "job_id":
                raise PydanticCustomError(
                    "job_template", "a template may name only job_id, not '{name}'", {"name": name}
                )
    elif isinstance(value, dict):
        for item in value.values():
            _job_template(item)
    elif isinstance(value, list):
        for item in value:
            _job_template(item)
    return value


Expression = Annotated[str, BeforeValidator(_jmespath)]
JobArguments = Annotated[dict[str, Any], BeforeValidator(_job_template)]


class JobToolConfig(_Frozen):
    """A helper tool of the job family, called with the job's id."""

    tool: str = Field(min_length=1, description="The upstream tool's name.")
    arguments: JobArguments = Field(
        default_factory=lambda: {"job_id": "{job_id}"},
        description='Its arguments; every `"{job_id}"` in a string is replaced by the job\'s id. The default passes '
        "it as `job_id`.",
    )


class JobStatusConfig(JobToolConfig):
    """The status tool, and how to read its answer. Expressions are JMESPath over the upstream's
    `CallToolResult`, plus `json`: its first text block parsed as JSON, when it parses."""

    state: Expression = Field(description="Where the job's state is in the status result (e.g. `json.state`).")
    states: dict[str, JobState] = Field(
        min_length=1,
        description="The upstream's states, each mapped to the task's: `working`, `completed`, `failed` or "
        "`cancelled`. A state not named here keeps the task `working` and is shown in its statusMessage.",
    )
    message: Expression | None = Field(
        None, description="Optional: where a progress text is; it becomes the task's statusMessage."
    )
    error: Expression | None = Field(None, description="Optional: where a failed job's message is.")


class JobConfig(_Frozen):
    """A legacy job family (start / status / result / cancel tools) served as one tool whose call is a task the
    proxy follows by polling the status tool; keyed by the start tool's name."""

    job_id: Expression = Field(
        description="Where the job's id is in the start tool's result (e.g. `structuredContent.job_id`, "
        "`json.id`). A result without one fails the call with that result."
    )
    status: JobStatusConfig = Field(description="The status tool, polled until the job's state maps to an end.")
    result: JobToolConfig | None = Field(
        None,
        description="Optional: the tool whose answer is a completed job's result; without it, the last status "
        "result is.",
    )
    cancel: JobToolConfig | None = Field(
        None, description="Optional: the tool `tasks/cancel` calls; without it, a cancel only ends the task here."
    )
    poll_interval_ms: int = Field(
        2000,
        ge=100,
        description="How often the status tool is called; after failed polls the interval grows (up to 30 s), "
        "never below this. 2 s keeps a job's progress fresh at one small call per job.",
    )
    hide_helpers: bool = Field(
        False,
        description="Leave the status, result and cancel tools out of modern clients' tools/list (the proxy "
        "drives them). Legacy clients still see every tool.",
    )
    shared: bool = Field(
        False,
        description="The job lives in a backend every replica's upstream shares: a replica taking a dead "
        "replica's task over polls the same job on. Off: taken-over job tasks fail or re-run per `on_restart`.",
    )

    def helpers(self) -> frozenset[str]:
        named = (self.status, self.result, self.cancel)
        return frozenset(helper.tool for helper in named if helper is not None)


class InputsConfig(_Frozen):
    """Input bridging: the upstream's mid-call elicitation, sampling and roots requests."""

    gather_ms: int = Field(
        100,
        ge=0,
        le=10_000,
        description="After an upstream question, how long to wait for more questions asked at the same time, so "
        "that one `inputRequests` map (of a task or an MRTR round) carries them all.",
        json_schema_extra=LIVE,
    )
    request_state_ttl_ms: int = Field(
        600_000,
        gt=0,
        description="How long a synchronous call parked by an MRTR `InputRequiredResult` waits for the client's "
        "retry; then its `requestState` is refused and the upstream call is cancelled.",
        json_schema_extra=LIVE,
    )
    max_parked: int = Field(
        1024,
        gt=0,
        description="Synchronous calls parked for a client's retry at once; beyond it the upstream question is "
        "declined and the client gets -32603 (`data.limit`) with HTTP 503.",
        json_schema_extra=LIVE,
    )
    max_waiting: int = Field(
        1024,
        gt=0,
        description="Calls that wait, or may come to wait, for a client's input at once, in this replica: tasks in "
        "`input_required`, parked MRTR calls, and the calls running whose client could answer a question (it "
        "declared elicitation, sampling or roots), since any of them may ask. A new such call beyond it is refused "
        "at its start with -32603, HTTP 503, `Retry-After` and `data.limit: max_waiting`; it is never queued, and "
        "a call admitted is never refused when it asks. Each one holds an upstream session of its own.",
        json_schema_extra=LIVE,
    )
    secret_file: str | None = Field(
        None,
        description="File holding the key that signs `requestState` (at least 32 bytes, e.g. a mounted Secret). "
        "Unset: a random key per process, so a state is only valid on the process that issued it.",
        json_schema_extra=RESTART,
    )


class ObservabilityConfig(_Frozen):
    metrics: bool = Field(
        True,
        description="Serve Prometheus metrics at `/metrics` on the listen port (no tokens, no arguments).",
        json_schema_extra=RESTART,
    )
    readiness_max_age_seconds: float = Field(
        10.0,
        gt=0,
        description="`/readyz` is ready when the upstream answered within this many seconds; when it has been "
        "quiet longer, the probe sends a fresh `initialize` to find out.",
        json_schema_extra=LIVE,
    )


class LoggingConfig(_Frozen):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="Lowest log level written to stderr.",
        json_schema_extra=LIVE,
    )
    format: Literal["auto", "json", "console"] = Field(
        "auto",
        description="`json`: one JSON object per line, for log pipelines; `console`: for humans (structlog's "
        "console renderer); `auto`: console when stderr is a terminal (`make run`), else JSON. "
        "`MCP_TASKS_PROXY_LOGGING__FORMAT=json` forces one from the environment.",
        json_schema_extra=LIVE,
    )


class AuditConfig(_Frozen):
    """The audit log: who called what, when, with which outcome. Never an argument value, a result or a
    credential."""

    path: str | None = Field(
        None,
        description="Where the audit log goes: a file (JSON lines, appended, created 0600), or `-` for stdout. One "
        "line per modern request and per task transition: time, principal (the JWT subject, else the keyed "
        "principal hash), method, tool, task id, outcome, duration, replica. Unset: no audit log (nothing is "
        "done per call). The file is reopened on SIGHUP (logrotate's `create` + `postrotate kill -HUP`); "
        "`copytruncate` works too (writes append at the end).",
        json_schema_extra=RESTART,
    )


class AdminConfig(_Frozen):
    """The operators' listener: a second port, never the MCP one, off unless `port` is set."""

    host: str = Field(
        "127.0.0.1",
        description="Address the admin listener binds to. Loopback by default: reach it with `kubectl port-forward` "
        "or an SSH tunnel, never through the MCP port's ingress.",
        json_schema_extra=RESTART,
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of the admin listener (`GET /admin/` page, `/admin/tasks` API). Unset: no listener.",
        json_schema_extra=RESTART,
    )
    token_file: str | None = Field(
        None,
        description="File holding the admin bearer token (at least 32 characters: letters, digits, `-._~`; e.g. "
        "`openssl rand -hex 32`). Required with `port`. Compared in constant time; a browser signs in once with "
        "`/admin/?token=…` (`mcp-tasks-proxy tasks admin-url`), which sets an HttpOnly SameSite=Strict cookie.",
        json_schema_extra=RESTART,
    )
    show_results: bool = Field(
        False,
        description="Show task results and errors on the admin page and API. Off: only state, tool, age and "
        "status message (never arguments, results or credentials).",
        json_schema_extra=RESTART,
    )

    @model_validator(mode="after")
    def _a_port_needs_a_token(self) -> AdminConfig:
        if self.port is not None and self.token_file is None:
            raise ValueError("admin.port needs admin.token_file (the bearer token operators sign in with)")
        return self


class LimitsConfig(_Frozen):
    """Bounds on what one upstream answer, one slow reader or one caller may hold: memory and shares of the
    proxy stay bounded by configuration, whatever clients and the upstream send."""

    max_result_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Largest upstream answer (or message on an upstream stream) the proxy reads. A larger one is "
        "never held whole: the upstream call is cancelled, a synchronous caller gets -32603 with "
        "`data.limit: max_result_bytes` (HTTP 502) and a task fails with that error. From a stdio server the line "
        "is read to its end (bounded by `upstream.max_line_bytes`) and dropped; the process serves on.",
        json_schema_extra=RESTART,
    )
    write_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="How long an answer may wait for a client that does not read it; then the connection is closed "
        "and its buffers are freed.",
        json_schema_extra=LIVE,
    )
    legacy_replay_bytes: int = Field(
        4 * 1024 * 1024,
        ge=0,
        description="With a stdio upstream: per legacy (2025-11-25) client session, the bytes of SSE events kept "
        "so that a client whose stream broke resumes it with `Last-Event-ID` (oldest dropped first). The default "
        "equals the default `max_result_bytes`, so the largest answer the proxy passes can be replayed whole; in "
        "all at most `upstream.max_processes` times this, held only by sessions that sent that much. 0: no "
        "event ids, priming events or resumption, and an answer with nothing before it comes as plain JSON.",
        json_schema_extra=RESTART,
    )
    max_listen_streams: int = Field(
        256,
        gt=0,
        description="`subscriptions/listen` streams open at once; one more gets HTTP 503 (`data.limit`).",
        json_schema_extra=LIVE,
    )
    max_listen_streams_per_principal: int = Field(
        16,
        gt=0,
        description="`subscriptions/listen` streams one caller may hold open; one more gets HTTP 429. With "
        "`security.jwt` the caller is the token's owner (issuer and claim), so every token of one owner counts alike.",
        json_schema_extra=LIVE,
    )
    max_listen_task_ids: int = Field(
        256,
        gt=0,
        description="`taskIds` one `subscriptions/listen` stream may follow; more get HTTP 429.",
        json_schema_extra=LIVE,
    )
    max_running_per_principal: int = Field(
        256,
        gt=0,
        description="Tasks whose upstream call runs at once for one caller (its share of `tasks.max_running`); one "
        "more gets -32603 with `data.limit` (HTTP 429), so one caller cannot starve the others.",
        json_schema_extra=LIVE,
    )
    calls_per_minute_per_principal: int = Field(
        0,
        ge=0,
        description="`tools/call` requests one caller may start per minute (a fixed window from the start of "
        "each UTC minute); one more gets HTTP 429 with `Retry-After` and the `RateLimit-Policy`/`RateLimit` "
        "fields. MRTR retries are the same call and do not count. On PostgreSQL the count is kept in the store, "
        "so the limit holds across every replica; on SQLite (one process) it is kept in that process. 0: no quota.",
        json_schema_extra=LIVE,
    )
    max_client_backlog_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="What may wait for one slow client of one call: the notifications relayed to its stream "
        "(progress, log messages) that it has not read yet, counted as the JSON they are written as. A newer "
        "progress notification replaces an older one still waiting; past this, further notifications are dropped "
        "(counted in `client_notifications_dropped_total`, and `client_backlog_full` logged once per call), never "
        "the call's final answer, and the upstream is read on as ever.",
        json_schema_extra=LIVE,
    )
    max_parked_per_principal: int = Field(
        256,
        gt=0,
        description="MRTR calls parked for one caller's retry at once (its share of `inputs.max_parked`); beyond it "
        "the question is declined and the caller gets HTTP 429.",
        json_schema_extra=LIVE,
    )
    max_waiting_per_principal: int = Field(
        256,
        gt=0,
        description="One caller's share of `inputs.max_waiting`: its tasks in `input_required`, its parked MRTR "
        "calls and its calls running whose client could answer a question. One more such call is refused at its "
        "start with -32603, HTTP 429, `Retry-After` and `data.limit: max_waiting_per_principal`, so one caller "
        "cannot hold more calls waiting for it (nor upstream sessions for them) than this.",
        json_schema_extra=LIVE,
    )


class Config(_Frozen):
    listen: ListenConfig = Field(default_factory=ListenConfig, description="Where the proxy listens.")
    # Validated even when the section is missing, so that "neither url nor command" is reported with its path.
    upstream: UpstreamConfig = Field(
        default_factory=lambda: {},
        validate_default=True,
        description="The legacy MCP server: over Streamable HTTP (`url`) or a stdio program the proxy runs "
        "(`command`); exactly one of the two is set.",
    )
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="Request admission.")
    relay: RelayConfig = Field(default_factory=RelayConfig, description="Other paths relayed to the upstream's origin.")
    discovery: DiscoveryConfig = Field(
        default_factory=DiscoveryConfig, description="Caching hints on discover and list results."
    )
    store: StoreConfig = Field(default_factory=StoreConfig, description="The task database.")
    idempotency: IdempotencyConfig = Field(
        default_factory=IdempotencyConfig, description="Idempotency-Key on tools/call: repeats do no work twice."
    )
    tasks: TasksConfig = Field(default_factory=TasksConfig, description="Tool policies and task limits.")
    inputs: InputsConfig = Field(
        default_factory=InputsConfig, description="Upstream questions relayed as inputRequests (tasks and MRTR)."
    )
    observability: ObservabilityConfig = Field(
        default_factory=ObservabilityConfig, description="Health probes and metrics."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Log output.")
    audit: AuditConfig = Field(default_factory=AuditConfig, description="The audit log (off unless a path is set).")
    admin: AdminConfig = Field(
        default_factory=AdminConfig, description="The operators' listener (off unless a port is set)."
    )
    limits: LimitsConfig = Field(
        default_factory=LimitsConfig, description="Bounds on upstream answers, slow readers and each caller's share."
    )
    jobs: dict[str, JobConfig] = Field(
        default_factory=dict,
        description="Legacy job families, keyed by the start tool's name: a modern client's call of that tool is "
        "one task the proxy drives through the family's status, result and cancel tools.",
        json_schema_extra=LIVE,
    )

    @model_validator(mode="after")
    def _the_admin_port_is_not_the_mcp_port(self) -> Config:
        if self.admin.port is not None and self.admin.port == self.listen.port:
            raise PydanticCustomError("admin_port", "admin.port must differ from listen.port (the MCP port)")
        return self

    @model_validator(mode="after")
    def _credentials_need_a_verified_caller(self) -> Config:
        """`exchange` and `secrets` act on who the caller is, which only a verified JWT says (its issuer and
        claim); a map keyed by the claim value alone must not let two issuers name one entry."""
        mode = self.upstream.credentials.mode
        if mode == "forward":
            return self
        jwt = self.security.jwt
        if jwt is None:
            raise PydanticCustomError(
                "credentials_need_jwt",
                "upstream.credentials.mode: {mode} acts on the caller's verified identity: set security.jwt",
                {"mode": mode},
            )
        if mode == "secrets" and len(jwt.issuer) != 1:
            raise PydanticCustomError(
                "secrets_one_issuer",
                "upstream.credentials.mode: secrets keys its entries by the {claim} claim alone: security.jwt.issuer "
                "must name exactly one issuer, so that no other issuer's token names the same entry",
                {"claim": jwt.claim},
            )
        return self

    @model_validator(mode="after")
    def _a_deployment_key_where_one_is_needed(self) -> Config:
        """Replicas must share the key principals are hashed with; a credential kept for a re-run is stored
        encrypted, so a configured key must exist to encrypt it."""
        if self.security.key_file is not None or self.inputs.secret_file is not None:
            return self
        if self.store.url is not None:
            raise PydanticCustomError(
                "key_required",
                "store.url: several replicas need one shared deployment key: set security.key_file (or "
                "inputs.secret_file)",
            )
        policies = {"tasks.default": self.tasks.default.on_restart} | {
            f"tasks.tools.{name}": entry.on_restart for name, entry in self.tasks.tools.items()
        }
        rerun = [path for path, action in policies.items() if action == "rerun"]
        if rerun:
            raise PydanticCustomError(
                "key_required",
                "{paths}: on_restart: rerun keeps the caller's credential to present it upstream again, encrypted "
                "with the deployment key: set security.key_file (or inputs.secret_file)",
                {"paths": ", ".join(rerun)},
            )
        return self
