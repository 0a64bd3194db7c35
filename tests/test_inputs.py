"""proxy.tasks.machine.inputs: keys, translation of upstream questions, capability checks, answers, requestState.

Pure functions, tested without I/O; the flows are in tests/test_flow_inputs.py.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from itsdangerous import URLSafeSerializer

from proxy.errors import InvalidParamsError
from proxy.tasks.machine import inputs
from proxy.tasks.machine.inputs import RequestStateSigner, StateClaims
from tests.support.schemas import SCHEMA_DIR, SchemaValidator

SECRET = b"k" * 32
CLAIMS = StateClaims(
    call_id="call-1",
    round=1,
    principal="p" * 64,
    method="tools/call",
    digest="d" * 64,
    expires_at_ms=10_000,
    owner="process-a",
)


@pytest.fixture(scope="module")
def core_schema() -> SchemaValidator:
    return SchemaValidator(SCHEMA_DIR / "mcp-2026-07-28.schema.json")


# --- keys and translation: minted keys, no legacy fields --------------------------------------------------


def test_keys_name_the_kind_and_count() -> None:
    assert inputs.mint_key("elicitation/create", 1) == "elicitation-1"
    assert inputs.mint_key("sampling/createMessage", 2) == "sampling-2"
    assert inputs.mint_key("roots/list", 3) == "roots-3"


@pytest.mark.parametrize(
    ("method", "params", "expected"),
    [
        (  # a 2025-06-18 form elicitation has no `mode`: it is a form
            "elicitation/create",
            {"message": "Name?", "requestedSchema": {"type": "object", "properties": {}}},
            {"message": "Name?", "requestedSchema": {"type": "object", "properties": {}}, "mode": "form"},
        ),
        (  # URL elicitation loses its elicitationId (gone in 2026-07-28); the related-task _meta goes too
            "elicitation/create",
            {
                "mode": "url",
                "message": "Consent",
                "url": "https://x.example/",
                "elicitationId": "e-1",
                "_meta": {"io.modelcontextprotocol/related-task": {"taskId": "legacy"}},
            },
            {"mode": "url", "message": "Consent", "url": "https://x.example/"},
        ),
        (  # other _meta is kept; the upstream's progressToken is not the client's business
            "sampling/createMessage",
            {"messages": [], "maxTokens": 5, "_meta": {"progressToken": 3, "trace": "t"}},
            {"messages": [], "maxTokens": 5, "_meta": {"trace": "t"}},
        ),
    ],
)
def test_input_request_translation(method: str, params: dict[str, Any], expected: dict[str, Any]) -> None:
    assert inputs.input_request(method, params) == {"method": method, "params": expected}


def test_roots_request_without_params_has_none() -> None:
    assert inputs.input_request("roots/list", None) == {"method": "roots/list"}
    assert inputs.input_request("roots/list", {"_meta": {"progressToken": 1}}) == {"method": "roots/list"}


def test_translated_requests_are_valid_2026_input_requests(core_schema: SchemaValidator) -> None:
    legacy = {
        "elicitation/create": {
            "message": "m",
            "requestedSchema": {"type": "object", "properties": {"a": {"type": "string"}}},
            "elicitationId": "x",
        },
        "sampling/createMessage": {
            "messages": [{"role": "user", "content": {"type": "text", "text": "q"}}],
            "maxTokens": 9,
        },
        "roots/list": None,
    }
    for method, params in legacy.items():
        core_schema.validate(inputs.input_request(method, params), "InputRequest")


# --- capabilities: only what the client declared is asked ----------------------------------------------------


@pytest.mark.parametrize(
    ("capabilities", "method", "params", "expected"),
    [
        ({"elicitation": {}}, "elicitation/create", {"message": "m"}, True),
        ({"elicitation": {}}, "elicitation/create", {"mode": "form"}, True),
        ({"elicitation": {}}, "elicitation/create", {"mode": "url"}, False),  # URL mode needs elicitation.url
        ({"elicitation": {"url": {}}}, "elicitation/create", {"mode": "url"}, True),
        ({"sampling": {}}, "elicitation/create", {}, False),
        ({"sampling": {}}, "sampling/createMessage", {}, True),
        ({"roots": {"listChanged": True}}, "roots/list", None, True),
        ({}, "roots/list", None, False),
        ({"elicitation": True}, "elicitation/create", {}, False),  # not an object: not declared
        ({"elicitation": {}}, "ping", {}, False),
        (None, "roots/list", None, False),
    ],
)
def test_declared(capabilities: Any, method: str, params: Any, expected: bool) -> None:
    assert inputs.declared(capabilities, method, params) is expected


# --- answers ---------------------------------------------------------------------------------------------------


def test_answers_go_upstream_without_result_type() -> None:
    answer = inputs.upstream_answer(
        "k", "elicitation/create", {"action": "accept", "content": {"a": 1}, "resultType": "complete"}
    )
    assert answer == {"action": "accept", "content": {"a": 1}}
    sampled = {"role": "assistant", "content": {"type": "text", "text": "t"}, "model": "m"}
    assert inputs.upstream_answer("k", "sampling/createMessage", sampled) == sampled
    assert inputs.upstream_answer("k", "roots/list", {"roots": []}) == {"roots": []}


@pytest.mark.parametrize(
    ("method", "response"),
    [
        ("elicitation/create", 12345),
        ("elicitation/create", None),
        ("elicitation/create", {"action": "maybe"}),
        ("elicitation/create", {}),
        ("sampling/createMessage", {"role": "assistant"}),
        ("roots/list", {"roots": "file:///"}),
    ],
)
def test_invalid_answers_are_minus_32602_naming_the_key(method: str, response: Any) -> None:
    with pytest.raises(InvalidParamsError) as raised:
        inputs.upstream_answer("the-key", method, response)
    assert raised.value.code == -32602
    assert "inputResponses.the-key" in raised.value.message


def test_one_check_serves_the_call_another_replica_and_a_relay() -> None:
    questions = {"elicitation-1": "elicitation/create", "roots-2": "roots/list"}
    good, bad = {"action": "decline"}, {"action": "maybe"}
    responses = {"elicitation-1": good, "roots-2": {"roots": []}, "sampling-9": {}}
    assert inputs.check_answers(questions, responses) == {"elicitation-1": good, "roots-2": {"roots": []}}
    with pytest.raises(InvalidParamsError, match=r"inputResponses\.elicitation-1"):
        inputs.check_answers(questions, {"roots-2": {"roots": []}, "elicitation-1": bad})
    relayed = inputs.check_answers(questions, {"elicitation-1": bad, "roots-2": {"roots": []}}, drop_invalid=True)
    assert relayed == {"roots-2": {"roots": []}}  # the invalid one stays open
    record_shows = {"elicitation-1": {"method": "elicitation/create"}, "x": {"method": "tools/call"}, "y": 3}
    assert inputs.outstanding(record_shows) == {"elicitation-1": "elicitation/create"}
    assert inputs.outstanding(None) == {}


def test_input_required_result_is_schema_valid(core_schema: SchemaValidator) -> None:
    result = inputs.input_required_result({"roots-1": {"method": "roots/list"}}, "state")
    assert result == {
        "resultType": "input_required",
        "inputRequests": {"roots-1": {"method": "roots/list"}},
        "requestState": "state",
    }
    core_schema.validate(result, "InputRequiredResult")


# --- requestState: signed, bound, expiring ------------------------------------------------------------------------


def test_params_digest_covers_the_request_not_the_envelope() -> None:
    base = {"name": "t", "arguments": {"a": 1, "b": [1, 2]}}
    digest = inputs.params_digest(base)
    reordered = {"arguments": {"b": [1, 2], "a": 1}, "name": "t"}
    assert inputs.params_digest(reordered) == digest
    retry = {**base, "_meta": {"progressToken": 1}, "inputResponses": {"k": {}}, "requestState": "s", "task": {}}
    assert inputs.params_digest(retry) == digest
    assert inputs.params_digest({**base, "arguments": {"a": 2, "b": [1, 2]}}) != digest
    assert inputs.params_digest({**base, "name": "u"}) != digest


def test_state_round_trip() -> None:
    signer = RequestStateSigner(SECRET)
    token = signer.sign(CLAIMS)
    assert signer.verify(token, now_ms=9_999) == CLAIMS


@pytest.mark.parametrize(
    "mutate",
    [
        lambda token: token[:-1] + ("A" if token[-1] != "A" else "B"),  # last char: maybe only padding bits
        lambda token: token[:-1] + ("B" if token[-1] != "B" else "C"),
        lambda token: token[:-5] + ("x" if token[-5] != "x" else "y") + token[-4:],  # signature changed
        lambda token: ("A" if token[0] != "A" else "B") + token[1:],  # payload changed
        lambda token: token + "-TAMPERED",
        lambda token: "",
        lambda token: "not.a.state",
    ],
)
def test_tampered_states_are_refused(mutate: Any) -> None:
    signer = RequestStateSigner(SECRET)
    with pytest.raises(InvalidParamsError, match="failed verification"):
        signer.verify(mutate(signer.sign(CLAIMS)), now_ms=0)


def test_a_state_signed_with_another_key_is_refused() -> None:
    token = RequestStateSigner(b"x" * 32).sign(CLAIMS)
    with pytest.raises(InvalidParamsError, match="failed verification"):
        RequestStateSigner(SECRET).verify(token, now_ms=0)


def test_an_expired_state_is_refused() -> None:
    signer = RequestStateSigner(SECRET)
    token = signer.sign(CLAIMS)
    with pytest.raises(InvalidParamsError, match="expired"):
        signer.verify(token, now_ms=CLAIMS.expires_at_ms)


def test_a_genuine_state_with_a_malformed_payload_is_refused() -> None:
    """Defence in depth: a signed payload of the wrong shape (e.g. from another format version) is refused."""
    serializer = URLSafeSerializer(SECRET, salt="mcp-tasks-proxy/request-state/v1")
    for payload in ({"call": 1}, ["c", "1", "p", "m", "d", 1, "o"], ["c", 1, "p", "m", "d", True, "o"], [1] * 7):
        with pytest.raises(InvalidParamsError, match="failed verification"):
            RequestStateSigner(SECRET).verify(str(serializer.dumps(payload)), now_ms=0)


def test_secret_from_file_or_random(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"  " + b"s" * 40 + b"\n")
    assert inputs.load_secret(str(path)) == b"s" * 40
    first, second = inputs.load_secret(None), inputs.load_secret(None)
    assert len(first) == 32
    assert first != second
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 32 needed"):
        inputs.load_secret(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        inputs.load_secret(str(tmp_path / "missing"))


def test_a_token_differing_only_in_base64_padding_bits_is_refused() -> None:
    """The last base64 character of the signature carries 2 unused bits: flipping one decodes to the same
    bytes, yet it is not the token the proxy issued, so it is refused like any other change."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    signer = RequestStateSigner(SECRET)
    token = signer.sign(CLAIMS)
    twin = token[:-1] + alphabet[alphabet.index(token[-1]) ^ 1]
    signature, twin_signature = token.rsplit(".", 1)[1], twin.rsplit(".", 1)[1]
    assert base64.urlsafe_b64decode(signature + "=") == base64.urlsafe_b64decode(twin_signature + "=")
    with pytest.raises(InvalidParamsError, match="failed verification"):
        signer.verify(twin, now_ms=0)
