"""The 2026-07-28 request envelope: era classification, `_meta` and routing-header validation; a `ModernRequest`
or the ProxyError the spec names. Sans-IO: must not import aiohttp, asyncio or the store."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

import pydantic
from mcp_types import (
    CLIENT_CAPABILITIES_META_KEY,
    LOG_LEVEL_META_KEY,
    PROTOCOL_VERSION_META_KEY,
)
from mcp_types.methods import CLIENT_REQUESTS, validate_client_request
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

from proxy.errors import (
    HeaderMismatchError,
    InvalidParamsError,
    RequestId,
    UnsupportedVersionError,
)
from proxy.wire.jsonrpc import JSON

if TYPE_CHECKING:
    from proxy.principals import Identity

TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
SUPPORTED_VERSIONS: Final[list[str]] = list(MODERN_PROTOCOL_VERSIONS)

PROTOCOL_VERSION_HEADER: Final = "mcp-protocol-version"
METHOD_HEADER: Final = "mcp-method"
NAME_HEADER: Final = "mcp-name"

# Streamable HTTP + the Tasks extension: which params field `Mcp-Name` mirrors, and whether it must be present.
NAME_FIELDS: Final[Mapping[str, tuple[str, bool]]] = {
    "tools/call": ("name", True),
    "prompts/get": ("name", True),
    "resources/read": ("uri", True),
    # The proxy's choice: validated when present, tolerated when absent (real clients omit it, and the spec only
    # says a client MUST send it).
    "tasks/get": ("taskId", False),
    "tasks/update": ("taskId", False),
    "tasks/cancel": ("taskId", False),
}

_SENTINEL_PREFIX: Final = "=?base64?"
_SENTINEL_SUFFIX: Final = "?="


@dataclass(frozen=True, slots=True)
class ModernRequest:
    """A validated 2026-07-28 request. `params` still carries `_meta` (it is forwarded in part)."""

    id: RequestId
    method: str
    params: JSON
    meta: JSON
    protocol_version: str
    client_capabilities: JSON

    @property
    def declares_tasks(self) -> bool:
        """Whether this request declares the Tasks extension, read from its own `_meta` only (never from an
        earlier request); the legacy 2025-11-25 `tasks` capability shape is not a declaration."""
        extensions = self.client_capabilities.get("extensions")
        return isinstance(extensions, dict) and isinstance(extensions.get(TASKS_EXTENSION), dict)

    @property
    def progress_token(self) -> str | int | None:
        token = self.meta.get("progressToken")
        if isinstance(token, str) or (isinstance(token, int) and not isinstance(token, bool)):
            return token
        return None

    @property
    def log_level(self) -> str | None:
        level = self.meta.get(LOG_LEVEL_META_KEY)
        return level if isinstance(level, str) else None

    def declares(self, capability: str) -> bool:
        return isinstance(self.client_capabilities.get(capability), dict)


def _lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in headers.items()}


def is_modern(headers: Mapping[str, str], message: Any) -> bool:
    """Era classification (architecture.md): modern when the body carries the 2026 `_meta` version key, or the
    `MCP-Protocol-Version` header names a version no `initialize` handshake could have negotiated.

    Everything else (initialize, Mcp-Session-Id traffic, old header values, no header) is legacy.
    """
    if isinstance(message, dict):
        params = message.get("params")
        if isinstance(params, dict):
            meta = params.get("_meta")
            if isinstance(meta, dict) and PROTOCOL_VERSION_META_KEY in meta:
                return True
    for key, value in headers.items():
        if key.lower() == PROTOCOL_VERSION_HEADER:
            return value.strip() not in HANDSHAKE_PROTOCOL_VERSIONS
    return False


_VERSION_KEY_BYTES: Final = PROTOCOL_VERSION_META_KEY.encode()
# The only JSON escapes that can spell a character of that key (letters, `.` and `/`) in another way.
_KEY_ESCAPE: Final = re.compile(rb"\\[u/]")


def may_carry_version_key(body: bytes) -> bool:
    """Whether `body` may hold the 2026 `_meta` version key anywhere, judged from its bytes alone: the key's
    name is in them, or an escape (`\\uXXXX`, `\\/`) that could spell it otherwise. False is certain, so such
    a body is classified by its headers alone and need not be decoded (`is_modern` cannot find the key in it);
    True only means it must be decoded to tell."""
    return _VERSION_KEY_BYTES in body or (b"\\" in body and _KEY_ESCAPE.search(body) is not None)


def encode_header_value(value: str) -> str:
    """What a client writes for `value` in a header (the inverse of `decode_header_value`): itself when it is
    visible ASCII without surrounding spaces, else `=?base64?<base64 of UTF-8>?=`."""
    if value.isascii() and value.isprintable() and value == value.strip(" ") and not value.startswith(_SENTINEL_PREFIX):
        return value
    return f"{_SENTINEL_PREFIX}{base64.b64encode(value.encode('utf-8')).decode('ascii')}{_SENTINEL_SUFFIX}"


def decode_header_value(value: str) -> str:
    """Header values are plain visible ASCII, or `=?base64?<base64 of UTF-8>?=` (Streamable HTTP: value
    encoding). Raises ValueError if invalid."""
    value = value.strip(" \t")
    if value.startswith(_SENTINEL_PREFIX) and value.endswith(_SENTINEL_SUFFIX):
        encoded = value[len(_SENTINEL_PREFIX) : -len(_SENTINEL_SUFFIX)]
        try:
            return base64.b64decode(encoded, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise ValueError("undecodable base64 header value") from None
    if not (value.isascii() and value.isprintable()):  # for ASCII, printable is exactly 0x20-0x7E
        raise ValueError("header value has characters outside visible ASCII")
    return value


def _header(headers: Mapping[str, str], name: str) -> str | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return decode_header_value(raw)
    except ValueError as exc:
        raise HeaderMismatchError(f"Header mismatch: {name}: {exc}") from None


def _required_meta(params: JSON | None) -> tuple[JSON, str, JSON]:
    """Every 2026-07-28 request carries `_meta` with protocolVersion and clientCapabilities, else -32602
    (HTTP 400)."""
    meta = params.get("_meta") if params is not None else None
    if not isinstance(meta, dict):
        raise InvalidParamsError(
            "Invalid params: missing params._meta (2026-07-28 requests carry "
            f"{PROTOCOL_VERSION_META_KEY} and {CLIENT_CAPABILITIES_META_KEY})",
        )
    version = meta.get(PROTOCOL_VERSION_META_KEY)
    if not isinstance(version, str):
        raise InvalidParamsError(
            f"Invalid params: _meta[{PROTOCOL_VERSION_META_KEY!r}] is required and must be a string",
        )
    capabilities = meta.get(CLIENT_CAPABILITIES_META_KEY)
    if not isinstance(capabilities, dict):
        raise InvalidParamsError(
            f"Invalid params: _meta[{CLIENT_CAPABILITIES_META_KEY!r}] is required and must be an object",
        )
    return meta, version, capabilities


def _check_headers(headers: Mapping[str, str], method: str, params: JSON, version: str) -> None:
    """Routing headers (MCP-Protocol-Version, Mcp-Method, Mcp-Name) present and equal to the body, else -32020
    (HTTP 400; Streamable HTTP: server validation)."""
    header_version = _header(headers, PROTOCOL_VERSION_HEADER)
    if header_version is None:
        raise HeaderMismatchError("Header mismatch: MCP-Protocol-Version header is required")
    if header_version != version:
        raise HeaderMismatchError(
            f"Header mismatch: MCP-Protocol-Version {header_version!r} != _meta protocolVersion {version!r}",
        )
    header_method = _header(headers, METHOD_HEADER)
    if header_method is None:
        raise HeaderMismatchError("Header mismatch: Mcp-Method header is required")
    if header_method != method:
        raise HeaderMismatchError(f"Header mismatch: Mcp-Method {header_method!r} != method {method!r}")
    name_rule = NAME_FIELDS.get(method)
    if name_rule is None:
        return
    field, required = name_rule
    header_name = _header(headers, NAME_HEADER)
    if header_name is None:
        if required:
            raise HeaderMismatchError(f"Header mismatch: Mcp-Name header is required for {method}")
        return
    body_value = params.get(field)
    if header_name != body_value:
        raise HeaderMismatchError(
            f"Header mismatch: Mcp-Name {header_name!r} != params.{field} {body_value!r}",
        )


def validate_modern(
    headers: Mapping[str, str], request_id: RequestId, method: str, params: JSON | None
) -> ModernRequest:
    """Validate a modern request's envelope: the required `_meta` first (the headers are compared with it),
    then the routing headers, then whether the proxy serves the version.

    Raises InvalidParamsError (-32602), HeaderMismatchError (-32020) or UnsupportedVersionError (-32022).
    """
    lowered = _lower_headers(headers)
    meta, version, capabilities = _required_meta(params)
    body = params if params is not None else {}
    _check_headers(lowered, method, body, version)
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(version, SUPPORTED_VERSIONS)
    return ModernRequest(request_id, method, body, meta, version, capabilities)


def known_core_method(method: str, version: str) -> bool:
    return (method, version) in CLIENT_REQUESTS


def validate_params(request: ModernRequest) -> None:
    """Shape of the params for a core method, via the `mcp_types` 2026-07-28 surface models (→ -32602)."""
    try:
        validate_client_request(request.method, request.protocol_version, request.params)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc'][1:]) or 'params'}: {error['msg']}"
            for error in exc.errors()[:5]
        )
        raise InvalidParamsError(f"Invalid params: {problems}") from None


# --- x-mcp-header: tool parameters mirrored into Mcp-Param-{Name} headers ----------------------------------

PARAM_HEADER_PREFIX: Final = "mcp-param-"
_TCHAR: Final = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_PARAM_TYPES: Final = ("string", "integer", "boolean")


@dataclass(frozen=True, slots=True)
class ParamHeader:
    """One valid `x-mcp-header` annotation: the header name part, the property path, the JSON type."""

    name: str
    path: tuple[str, ...]
    type: str


def param_headers(input_schema: Any) -> tuple[ParamHeader, ...]:
    """The valid `x-mcp-header` annotations of a tool's inputSchema.

    Only properties statically reachable through `properties` keys count, with a primitive type (string,
    integer, boolean) and a token-syntax name unique (case-insensitively) in the schema; annotations that
    break these rules are not enforced (a modern client drops such a tool from its list anyway).
    """
    found: list[ParamHeader] = []

    def walk(schema: Any, path: tuple[str, ...]) -> None:
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict):
            return
        for key, prop in properties.items():
            if not isinstance(prop, dict):
                continue
            name = prop.get("x-mcp-header")
            if isinstance(name, str) and name and set(name) <= _TCHAR and prop.get("type") in _PARAM_TYPES:
                found.append(ParamHeader(name, (*path, key), prop["type"]))
            walk(prop, (*path, key))

    walk(input_schema, ())
    lowered = [spec.name.lower() for spec in found]
    return tuple(spec for spec in found if lowered.count(spec.name.lower()) == 1)


def _argument_at(arguments: Any, path: tuple[str, ...]) -> Any:
    value = arguments
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _same_value(header_value: str, body_value: Any, declared_type: str) -> bool:
    """Value Encoding: strings as-is, integers in decimal (compared numerically), booleans lowercase."""
    if isinstance(body_value, bool):
        return header_value == ("true" if body_value else "false")
    if declared_type == "integer" and isinstance(body_value, int | float):
        try:
            return float(header_value) == float(body_value)
        except ValueError:
            return False
    if isinstance(body_value, str):
        return header_value == body_value
    return header_value == str(body_value)


def check_param_headers(headers: Mapping[str, str], arguments: Any, specs: tuple[ParamHeader, ...]) -> None:
    """Server validation of `x-mcp-header` parameters: every annotated argument present in the body has its
    header, equal after decoding; a header without a body value, or with invalid characters, is rejected too
    (-32020, HTTP 400)."""
    if not specs:
        return  # most tools mirror no parameter: nothing to look up
    lowered = _lower_headers(headers)
    for spec in specs:
        header_name = f"Mcp-Param-{spec.name}"
        value = _argument_at(arguments, spec.path)
        header = _header(lowered, PARAM_HEADER_PREFIX + spec.name.lower())
        if value is None:
            if header is not None:
                raise HeaderMismatchError(
                    f"Header mismatch: {header_name} is set but the argument {'.'.join(spec.path)} is absent",
                )
            continue
        if header is None:
            raise HeaderMismatchError(
                f"Header mismatch: {header_name} header is required when {'.'.join(spec.path)} is given",
            )
        if not _same_value(header, value, spec.type):
            # No values in the message: it is logged, and argument values never are.
            raise HeaderMismatchError(
                f"Header mismatch: {header_name} does not equal the argument {'.'.join(spec.path)}",
            )


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as far as the front needs to know: its identity (the principal header's value travels
    upstream and selects the upstream session; it, or a verified JWT's owner, owns tasks), None when anonymous,
    and the HTTP headers (trace context, Mcp-Param-*)."""

    principal: Identity | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


class Channel(Protocol):
    """Where request-scoped notifications go before the final message (an SSE stream, or nowhere).

    `required=True` opens the stream even for a client whose Accept did not list SSE (listen streams).
    `keepalive(open_stream=True)` opens an SSE stream (when the client accepts one) to hold a slow answer.
    """

    async def notify(self, message: JSON, *, required: bool = False) -> None: ...

    async def keepalive(self, *, open_stream: bool = False) -> None: ...
