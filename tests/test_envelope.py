"""wire/envelope.py: era classification and the 2026-07-28 validation order (`_meta`, then routing headers,
then the version)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp_types.methods import CLIENT_REQUESTS, validate_client_request
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.errors import HeaderMismatchError, InvalidParamsError, ProxyError, UnsupportedVersionError
from proxy.wire.envelope import (
    ModernRequest,
    check_param_headers,
    decode_header_value,
    is_modern,
    may_carry_version_key,
    param_headers,
    validate_modern,
    validate_params,
)

META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientCapabilities": {},
}


def headers(method: str, name: str | None = None, version: str = "2026-07-28") -> dict[str, str]:
    result = {"MCP-Protocol-Version": version, "Mcp-Method": method}
    if name is not None:
        result["Mcp-Name"] = name
    return result


def call(params: dict[str, Any] | None, hdrs: dict[str, str], method: str = "tools/call") -> Any:
    return validate_modern(hdrs, 1, method, params)


# --- classification -----------------------------------------------------------------------------------


def test_meta_version_makes_a_request_modern() -> None:
    assert is_modern({}, {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": META}})


def test_modern_header_makes_a_request_modern_even_without_meta() -> None:
    assert is_modern({"mcp-protocol-version": "2026-07-28"}, {"jsonrpc": "2.0", "id": 1, "method": "x"})
    assert is_modern({"MCP-Protocol-Version": "2099-01-01"}, None)  # unknown versions are not legacy


@pytest.mark.parametrize("version", ["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"])
def test_handshake_versions_are_legacy(version: str) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    assert not is_modern({"MCP-Protocol-Version": version, "Mcp-Session-Id": "abc"}, body)


@pytest.mark.parametrize("kind", [dict, CIMultiDict, lambda pairs: CIMultiDictProxy(CIMultiDict(pairs))])
def test_the_version_header_is_read_the_same_from_any_mapping(kind: Callable[[dict[str, str]], Any]) -> None:
    """aiohttp's case-insensitive headers are looked up directly; a plain mapping is searched by lowered name."""
    assert is_modern(kind({"mcp-PROTOCOL-version": " 2026-07-28 "}), None)
    assert not is_modern(kind({"MCP-Protocol-Version": "2025-11-25"}), None)
    assert not is_modern(kind({"Mcp-Session-Id": "abc"}), None)


def test_initialize_without_headers_is_legacy() -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-11-25"}}
    assert not is_modern({}, body)
    assert not is_modern({}, [body])


KEY = "io.modelcontextprotocol/protocolVersion"


def _escaped(text: str, escape: Callable[[str], bool]) -> str:
    """`text` as a JSON string whose characters `escape` picks are written as `\\uXXXX` (a `/` as `\\/`)."""
    parts = []
    for char in text:
        if not escape(char):
            parts.append(char)
        elif char == "/":
            parts.append("\\/")
        else:
            parts.append(f"\\u{ord(char):04x}")
    return '"' + "".join(parts) + '"'


@pytest.mark.parametrize(
    ("body", "may"),
    [
        (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","arguments":{"text":"x"}}}', False),
        (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"arguments":{"text":"a\\nb \\"q\\""}}}', False),
        (b"not json at all", False),
        (json.dumps({"params": {"_meta": META}}).encode(), True),
        (json.dumps({"params": {"arguments": {"note": KEY}}}).encode(), True),  # the name anywhere: decode to tell
        (b'{"params":{"_meta":{' + _escaped(KEY, lambda c: c == "/").encode() + b':"2026-07-28"}}}', True),
        (b'{"params":{"_meta":{' + _escaped(KEY, lambda c: True).encode() + b':"2026-07-28"}}}', True),
        (b'{"params":{"_meta":{' + _escaped(KEY, lambda c: c == "V").encode() + b':"2026-07-28"}}}', True),
        (b'{"params":{"text":"C:\\\\users"}}', True),  # an escaped backslash before a `u`: decoded, to be safe
    ],
    ids=["plain", "escapes", "not-json", "meta", "named", "slash-escaped", "all-escaped", "one-escaped", "backslash-u"],
)
def test_a_body_without_the_version_key_or_an_escape_that_could_spell_it_is_legacy_by_its_bytes(
    body: bytes, may: bool
) -> None:
    assert may_carry_version_key(body) is may
    if not may:
        assert not is_modern({}, _decoded_or_none(body))


def _decoded_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
_VALUES = st.recursive(
    _SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
)


@given(
    params=st.dictionaries(st.text(max_size=6), _VALUES, max_size=3),
    with_key=st.booleans(),
    escape=st.sets(st.characters(codec="ascii")),
    ensure_ascii=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_no_body_whose_decoding_is_modern_is_legacy_by_its_bytes(
    params: dict[str, Any], with_key: bool, escape: set[str], ensure_ascii: bool
) -> None:
    """Whatever the message, and however its keys and strings are escaped, a body that decodes to a modern
    request is never judged legacy from its bytes (the bytes test may only err towards decoding)."""
    if with_key:
        params = {**params, "_meta": {KEY: "2026-07-28"}}
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": params}
    text = json.dumps(message, ensure_ascii=ensure_ascii)
    # The same JSON with the picked characters of the key escaped in another way.
    text = text.replace(json.dumps(KEY), _escaped(KEY, lambda char: char in escape))
    body = text.encode()
    assert json.loads(body) == message
    if is_modern({}, json.loads(body)):
        assert may_carry_version_key(body)


# --- validation order and codes -------------------------------------------------------------------------


def test_a_valid_request_yields_its_parts() -> None:
    meta = {**META, "progressToken": "p1", "io.modelcontextprotocol/logLevel": "info"}
    caps: dict[str, Any] = {"extensions": {"io.modelcontextprotocol/tasks": {}}, "sampling": {}}
    meta["io.modelcontextprotocol/clientCapabilities"] = caps
    request = call({"name": "greet", "_meta": meta}, headers("tools/call", "greet"))
    assert request.method == "tools/call"
    assert request.protocol_version == "2026-07-28"
    assert request.declares_tasks
    assert request.declares("sampling")
    assert not request.declares("elicitation")
    assert request.progress_token == "p1"
    assert request.log_level == "info"


def test_tasks_declaration_is_read_only_from_extensions() -> None:
    """The legacy 2025-11-25 `tasks` capability shape is not a declaration of the extension."""
    meta = {**META, "io.modelcontextprotocol/clientCapabilities": {"tasks": {"requests": {"tools": {"call": {}}}}}}
    assert not call({"name": "x", "_meta": meta}, headers("tools/call", "x")).declares_tasks


@pytest.mark.parametrize(
    "params",
    [
        None,
        {},
        {"_meta": "x"},
        {"_meta": {"io.modelcontextprotocol/clientCapabilities": {}}},
        {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}},
        {
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": 20260728,
                "io.modelcontextprotocol/clientCapabilities": {},
            }
        },
        {
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": [],
            }
        },
    ],
)
def test_missing_meta_fields_are_invalid_params_400(params: dict[str, Any] | None) -> None:
    """Required `_meta` fields are checked first, even before the headers are compared."""
    with pytest.raises(InvalidParamsError) as caught:
        validate_modern({}, 5, "server/discover", params)
    assert (caught.value.code, caught.value.status) == (-32602, 400)


@pytest.mark.parametrize(
    "hdrs",
    [
        {"Mcp-Method": "tools/call", "Mcp-Name": "greet"},  # no MCP-Protocol-Version
        headers("tools/call", "greet", version="2025-11-25"),  # header != _meta
        {"MCP-Protocol-Version": "2026-07-28", "Mcp-Name": "greet"},  # no Mcp-Method
        headers("tools/list", "greet"),  # Mcp-Method != method
        headers("tools/call"),  # no Mcp-Name on a name-bearing method
        headers("tools/call", "other"),  # Mcp-Name != params.name
        headers("tools/call", "=?base64?!!!?="),  # undecodable sentinel
        headers("tools/call", "gr\x7feet"),  # invalid characters
    ],
)
def test_routing_header_faults_are_header_mismatch_400(hdrs: dict[str, str]) -> None:
    with pytest.raises(HeaderMismatchError) as caught:
        call({"name": "greet", "_meta": META}, hdrs)
    assert (caught.value.code, caught.value.status) == (-32020, 400)


def test_header_names_are_case_insensitive_and_values_trimmed() -> None:
    hdrs = {"mcp-protocol-version": "2026-07-28", "MCP-METHOD": "tools/call", "mcp-name": "  greet "}
    assert call({"name": "greet", "_meta": META}, hdrs).method == "tools/call"


def test_base64_sentinel_is_decoded_before_comparing() -> None:
    """Non-ASCII names travel base64-encoded (`=?base64?…?=`) and are decoded before comparing."""
    name = "grüße"
    encoded = "=?base64?" + base64.b64encode(name.encode()).decode() + "?="
    assert call({"name": name, "_meta": META}, headers("tools/call", encoded)).params["name"] == name


@pytest.mark.parametrize(("method", "field"), [("prompts/get", "name"), ("resources/read", "uri")])
def test_mcp_name_mirrors_the_right_field(method: str, field: str) -> None:
    call({field: "test://x", "_meta": META}, headers(method, "test://x"), method)
    with pytest.raises(HeaderMismatchError):
        call({field: "test://x", "_meta": META}, headers(method, "test://y"), method)


def test_mcp_name_on_tasks_methods_is_checked_when_present_and_tolerated_when_absent() -> None:
    """The proxy's choice where the spec is silent: a missing Mcp-Name on tasks/* is tolerated; a present one
    must equal `params.taskId` (-32020 otherwise)."""
    params = {"taskId": "t1", "_meta": META}
    assert call(params, headers("tasks/get"), "tasks/get").params["taskId"] == "t1"
    assert call(params, headers("tasks/get", "t1"), "tasks/get").params["taskId"] == "t1"
    with pytest.raises(HeaderMismatchError):
        call(params, headers("tasks/get", "t2"), "tasks/get")


def test_unsupported_version_names_supported_and_requested() -> None:
    """Header and _meta agree on a version the proxy does not serve → -32022 + data."""
    meta = {**META, "io.modelcontextprotocol/protocolVersion": "v999.0.0"}
    with pytest.raises(UnsupportedVersionError) as caught:
        validate_modern(headers("server/discover", version="v999.0.0"), 3, "server/discover", {"_meta": meta})
    error = caught.value
    assert (error.code, error.status) == (-32022, 400)
    assert error.data == {"supported": ["2026-07-28"], "requested": "v999.0.0"}


def test_header_mismatch_wins_over_unsupported_version() -> None:
    meta = {**META, "io.modelcontextprotocol/protocolVersion": "v999.0.0"}
    with pytest.raises(HeaderMismatchError):
        validate_modern(headers("server/discover"), 3, "server/discover", {"_meta": meta})


def test_params_shape_is_checked_with_the_2026_models() -> None:
    request = call({"name": "greet", "arguments": "not-an-object", "_meta": META}, headers("tools/call", "greet"))
    with pytest.raises(InvalidParamsError) as caught:
        validate_params(request)
    assert "arguments" in caught.value.message


def _refusal(params: dict[str, Any]) -> str | None:
    """What validating `params` of a tools/call says (None: valid)."""
    try:
        validate_params(call(params, headers("tools/call", "greet")))
    except InvalidParamsError as refused:
        return refused.message
    return None


def test_a_meta_seen_valid_before_still_leaves_every_other_param_checked() -> None:
    """The second request with the same `_meta` skips only the `_meta`: the rest is refused as the first time."""
    meta = {**META, "io.modelcontextprotocol/clientInfo": {"name": "remembered", "version": "1"}}
    bad_arguments = {"name": "greet", "arguments": "not-an-object", "_meta": meta}
    first = _refusal(bad_arguments)
    assert first is not None
    assert "arguments" in first
    assert _refusal({"name": "greet", "arguments": {}, "_meta": meta}) is None  # the `_meta` is known now
    assert _refusal(bad_arguments) == first
    unknown = {**meta, "x-other": 1}  # validated whole: the same refusal
    assert _refusal({**bad_arguments, "_meta": unknown}) == first
    assert _refusal({"name": "greet", "requestState": 5, "_meta": meta}) is not None


def test_a_meta_that_is_not_valid_is_refused_every_time() -> None:
    """Only a `_meta` that validated is remembered; one that did not is refused again, and so is a known one's
    sibling that differs in a field that does not validate."""
    good = {**META, "io.modelcontextprotocol/clientInfo": {"name": "good", "version": "1"}}
    bad = {**META, "io.modelcontextprotocol/clientInfo": {"name": "bad"}}  # no version
    assert _refusal({"name": "greet", "_meta": good}) is None
    for _ in range(2):
        refused = _refusal({"name": "greet", "_meta": bad})
        assert refused is not None
        assert "clientInfo" in refused
    capabilities = {**good, "io.modelcontextprotocol/clientCapabilities": {"elicitation": "yes"}}
    assert _refusal({"name": "greet", "_meta": capabilities}) is not None


MODERN_METHODS = sorted(method for method, version in CLIENT_REQUESTS if version == "2026-07-28")
METAS = [
    META,
    {**META, "io.modelcontextprotocol/clientInfo": {"name": "c", "version": "1"}},
    {**META, "io.modelcontextprotocol/clientInfo": {"name": "c"}},  # no version: not valid
    {**META, "io.modelcontextprotocol/clientCapabilities": {"sampling": []}},  # not valid
    {**META, "progressToken": "p-1"},
    {**META, "progressToken": {"not": "a token"}},  # not valid
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from(["a", "type", "name"]), inner),
    max_leaves=4,
)
PARAM_KEYS = ["name", "uri", "arguments", "cursor", "requestState", "inputResponses", "taskId", "ref", "argument"]


@settings(max_examples=300, deadline=None)
@given(
    method=st.sampled_from(MODERN_METHODS),
    meta=st.sampled_from(range(len(METAS))),
    params=st.dictionaries(st.sampled_from(PARAM_KEYS), JSON_VALUES, max_size=4),
)
def test_params_are_judged_as_the_whole_request_model_judges_them(
    method: str, meta: int, params: dict[str, Any]
) -> None:
    """The params field validated alone, with a `_meta` seen before skipped, refuses exactly what the mcp-types
    surface model of the whole request refuses (each case twice: the second finds its `_meta` remembered)."""
    params = {**params, "_meta": METAS[meta]}
    try:
        validate_client_request(method, "2026-07-28", params)
        expected = "valid"
    except pydantic.ValidationError:
        expected = "refused"
    request = ModernRequest(1, method, params, params["_meta"], "2026-07-28", {})
    for _ in range(2):
        try:
            validate_params(request)
            got = "valid"
        except InvalidParamsError:
            got = "refused"
        assert got == expected


def test_decode_header_value() -> None:
    assert decode_header_value(" plain ") == "plain"
    assert decode_header_value("=?base64?aGk=?=") == "hi"
    with pytest.raises(ValueError, match="base64"):
        decode_header_value("=?base64?***?=")
    with pytest.raises(ValueError, match="ASCII"):
        decode_header_value("naïve")


def test_every_rejection_is_a_proxy_error() -> None:
    with pytest.raises(ProxyError):
        validate_modern({}, 1, "x", None)


# --- x-mcp-header: Mcp-Param-{Name} headers -------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"},
        "count": {"type": "integer", "x-mcp-header": "Count"},
        "verbose": {"type": "boolean", "x-mcp-header": "Verbose"},
        "ratio": {"type": "number", "x-mcp-header": "Ratio"},  # number is not allowed
        "bad": {"type": "string", "x-mcp-header": "Bad Name"},  # not a token
        "target": {"type": "object", "properties": {"zone": {"type": "string", "x-mcp-header": "Zone"}}},
        "list": {"type": "array", "items": {"type": "string", "x-mcp-header": "Item"}},  # through items
        "dup1": {"type": "string", "x-mcp-header": "Dup"},
        "dup2": {"type": "string", "x-mcp-header": "dup"},  # not unique case-insensitively
    },
}


def test_param_headers_keeps_only_valid_annotations() -> None:
    specs = param_headers(SCHEMA)
    assert {(spec.name, spec.path, spec.type) for spec in specs} == {
        ("Region", ("region",), "string"),
        ("Count", ("count",), "integer"),
        ("Verbose", ("verbose",), "boolean"),
        ("Zone", ("target", "zone"), "string"),
    }
    assert param_headers(None) == ()
    assert param_headers({"type": "object"}) == ()


def test_matching_param_headers_pass() -> None:
    specs = param_headers(SCHEMA)
    arguments = {"region": "Hello", "count": 42, "verbose": True, "target": {"zone": "é"}}
    headers = {
        "Mcp-Param-Region": "=?base64?SGVsbG8=?=",
        "mcp-param-count": "42.0",  # integers compare numerically
        "MCP-PARAM-VERBOSE": "true",
        "Mcp-Param-Zone": "=?base64?" + base64.b64encode("é".encode()).decode() + "?=",
    }
    check_param_headers(headers, arguments, specs)
    check_param_headers({}, {}, specs)  # absent arguments: no headers expected
    check_param_headers({}, {"region": None}, specs)  # null: the client omits the header


@pytest.mark.parametrize(
    ("headers", "arguments"),
    [
        ({}, {"region": "a"}),  # value in body, header missing
        ({"Mcp-Param-Region": "b"}, {"region": "a"}),  # differs
        ({"Mcp-Param-Region": "=?base64?SGVsbG8?="}, {"region": "Hello"}),  # bad padding
        ({"Mcp-Param-Region": "=?base64?SGVs!!!bG8=?="}, {"region": "Hello"}),  # bad characters
        ({"Mcp-Param-Count": "41"}, {"count": 42}),
        ({"Mcp-Param-Count": "forty-two"}, {"count": 42}),
        ({"Mcp-Param-Verbose": "True"}, {"verbose": True}),  # lowercase only
        ({"Mcp-Param-Region": "a"}, {}),  # header without a body value
    ],
)
def test_mismatched_param_headers_are_rejected(headers: dict[str, str], arguments: dict[str, Any]) -> None:
    with pytest.raises(HeaderMismatchError) as caught:
        check_param_headers(headers, arguments, param_headers(SCHEMA))
    assert (caught.value.code, caught.value.status) == (-32020, 400)


def test_param_mismatch_messages_carry_no_argument_values() -> None:
    """The error edge logs the message, and argument values are never logged."""
    with pytest.raises(HeaderMismatchError) as caught:
        check_param_headers({"Mcp-Param-Region": "secret-b"}, {"region": "secret-a"}, param_headers(SCHEMA))
    assert "secret" not in caught.value.message
    assert "Mcp-Param-Region" in caught.value.message


def test_literal_values_that_only_look_encoded_compare_as_text() -> None:
    specs = param_headers(SCHEMA)
    check_param_headers({"Mcp-Param-Region": "SGVsbG8="}, {"region": "SGVsbG8="}, specs)
    check_param_headers({"Mcp-Param-Region": "=?base64?SGVsbG8="}, {"region": "=?base64?SGVsbG8="}, specs)
