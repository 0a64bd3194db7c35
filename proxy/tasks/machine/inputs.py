"""Input bridging, sans-IO: upstream questions ↔ minted `inputRequests` keys ↔ `inputResponses` (the one check
of answers, `check_answers`), and the signed `requestState` of an MRTR round. Imports the wire, errors and
itsdangerous; no I/O."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import pydantic
from itsdangerous import BadSignature, URLSafeSerializer
from mcp_types import CreateMessageResult, ElicitResult, ListRootsResult
from mcp_types._types import CreateMessageResultWithTools

from proxy.config.keyfiles import MIN_SECRET_BYTES, read_secret
from proxy.errors import InvalidParamsError
from proxy.wire.jsonrpc import JSON
from proxy.wire.translate import INPUT_METHODS, LEGACY_META_KEYS, required_capability

# A legacy server asks mid-call with a JSON-RPC request (`elicitation/create`, `sampling/createMessage`,
# `roots/list`). The proxy keeps the upstream request id to itself and shows the client a minted key (never the raw
# upstream id, which can repeat across upstream sessions, and never reused over the task's life); the client's answer
# under that key goes back upstream as the JSON-RPC response. Imports the wire layer, errors and itsdangerous; no I/O.

KEY_PREFIXES: Final = {"elicitation/create": "elicitation", "sampling/createMessage": "sampling", "roots/list": "roots"}
# Request fields that are not part of the request itself: the MRTR retry adds the first two, `_meta`
# carries per-request envelope data, and `task` is the legacy opt-in the proxy ignores.
_NOT_SALIENT: Final = frozenset({"_meta", "inputResponses", "requestState", "task"})
_SALT: Final = "mcp-tasks-proxy/request-state/v1"

_RESPONSE_ADAPTERS: Final[Mapping[str, pydantic.TypeAdapter[Any]]] = {
    "elicitation/create": pydantic.TypeAdapter(ElicitResult),
    "sampling/createMessage": pydantic.TypeAdapter(CreateMessageResult | CreateMessageResultWithTools),
    "roots/list": pydantic.TypeAdapter(ListRootsResult),
}


@dataclass(frozen=True, slots=True)
class PendingInput:
    """One outstanding upstream question: its upstream JSON-RPC id (never shown) and the modern inputRequest."""

    upstream_id: int | str
    method: str
    request: JSON


def mint_key(method: str, number: int) -> str:
    """The key of the `number`-th question of a call or task (1-based; readable, unique for its whole life)."""
    return f"{KEY_PREFIXES[method]}-{number}"


def input_request(method: str, params: Any) -> JSON:
    """The upstream request as an `inputRequests` entry: no `jsonrpc`/`id`, no legacy `_meta` (related-task),
    no `elicitationId` (removed in 2026-07-28); a form elicitation names its mode."""
    cleaned: JSON = dict(params) if isinstance(params, dict) else {}
    meta = cleaned.pop("_meta", None)
    if isinstance(meta, dict):
        kept = {key: value for key, value in meta.items() if key not in LEGACY_META_KEYS and key != "progressToken"}
        if kept:
            cleaned["_meta"] = kept
    if method == "elicitation/create":
        cleaned.pop("elicitationId", None)
        cleaned.setdefault("mode", "form")
    if method == "roots/list" and not cleaned:
        return {"method": method}
    return {"method": method, "params": cleaned}


def declared(capabilities: Any, method: str, params: Any) -> bool:
    """May a client with these ClientCapabilities receive this question? Only request types it declared may be
    asked (URL elicitation needs `elicitation.url`; basic/patterns/mrtr)."""
    if method not in INPUT_METHODS or not isinstance(capabilities, dict):
        return False
    for name, sub in required_capability(method, params).items():
        have = capabilities.get(name)
        if not isinstance(have, dict):
            return False
        if any(not isinstance(have.get(sub_name), dict) for sub_name in sub):
            return False
    return True


def could_answer(capabilities: Any) -> bool:
    """Could a client with these ClientCapabilities be asked anything at all (elicitation, sampling, roots)?"""
    return isinstance(capabilities, dict) and any(
        isinstance(capabilities.get(name), dict) for name in ("elicitation", "sampling", "roots")
    )


def upstream_answer(key: str, method: str, response: Any) -> JSON:
    """The client's `inputResponses[key]` as the JSON-RPC result the upstream waits for; -32602 naming the key
    when it is not a valid answer to that kind of question."""
    adapter = _RESPONSE_ADAPTERS[method]
    if not isinstance(response, dict):
        raise InvalidParamsError(f"Invalid params: inputResponses.{key} must be an object answering {method}")
    try:
        adapter.validate_python(response)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or key}: {error['msg']}" for error in exc.errors()[:3]
        )
        raise InvalidParamsError(
            f"Invalid params: inputResponses.{key} is not a valid answer to {method}: {problems}"
        ) from None
    return {name: value for name, value in response.items() if name != "resultType"}


def outstanding(input_requests: Any) -> dict[str, str]:
    """The questions a task's record shows outstanding (its `inputRequests`), key → method: what another
    replica checks `tasks/update` answers against when it does not run the call."""
    questions = input_requests if isinstance(input_requests, dict) else {}
    found: dict[str, str] = {}
    for key, question in questions.items():
        method = question.get("method") if isinstance(question, dict) else None
        if isinstance(method, str) and method in KEY_PREFIXES:
            found[key] = method
    return found


def check_answers(
    questions: Mapping[str, str], responses: Mapping[str, Any], *, drop_invalid: bool = False
) -> dict[str, JSON]:
    """The client's answers to the outstanding `questions` (key → method), each as the JSON-RPC result the
    upstream waits for, checked before any is delivered: -32602 naming the key for one that is not a valid
    answer (with `drop_invalid`, left out instead: the question stays open). Keys not outstanding (never
    issued, already answered) are ignored. The one check of answers, wherever they arrive."""
    checked: dict[str, JSON] = {}
    for key, response in responses.items():
        method = questions.get(key)
        if method is None:
            continue
        try:
            checked[key] = upstream_answer(key, method, response)
        except InvalidParamsError:
            if not drop_invalid:
                raise
    return checked


def input_required_result(requests: Mapping[str, JSON], request_state: str) -> JSON:
    """The MRTR answer (`resultType: "input_required"`) of a synchronous request that needs the client's input
    first."""
    return {"resultType": "input_required", "inputRequests": dict(requests), "requestState": request_state}


def params_digest(params: Mapping[str, Any]) -> str:
    """A digest of the request's salient params (everything but the envelope and the MRTR fields), so a
    `requestState` is bound to the request it was issued for."""
    salient = {key: value for key, value in params.items() if key not in _NOT_SALIENT}
    canonical = json.dumps(salient, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StateClaims:
    """What a `requestState` vouches for: the parked call and its round (single use), who may resume it, for
    which request, until when, and which proxy process holds the call."""

    call_id: str
    round: int
    principal: str
    method: str
    digest: str
    expires_at_ms: int
    owner: str


class RequestStateSigner:
    """`requestState` is attacker-controlled (basic/patterns/mrtr), so it is HMAC-signed (itsdangerous),
    expiring and bound to the principal, the method and the params digest. A key shared through
    `inputs.secret_file` lets replicas verify each other's states (and say where the call is parked)."""

    def __init__(self, secret: bytes) -> None:
        self._serializer = URLSafeSerializer(secret, salt=_SALT)

    def sign(self, claims: StateClaims) -> str:
        payload = [
            claims.call_id,
            claims.round,
            claims.principal,
            claims.method,
            claims.digest,
            claims.expires_at_ms,
            claims.owner,
        ]
        return str(self._serializer.dumps(payload))

    def verify(self, token: str, now_ms: int) -> StateClaims:
        """The claims of a genuine, unexpired state, else -32602 (nothing about the failure leaks but its kind)."""
        try:
            payload = self._serializer.loads(token)
        except BadSignature:
            raise InvalidParamsError("Invalid params: requestState failed verification") from None
        claims = _claims(payload)
        # Only the exact token the proxy issued: base64 leaves slack in its last character's padding bits.
        if claims is None or not hmac.compare_digest(self.sign(claims), token):
            raise InvalidParamsError("Invalid params: requestState failed verification")
        if now_ms >= claims.expires_at_ms:
            raise InvalidParamsError("Invalid params: requestState has expired; send the request again without it")
        return claims


def _claims(payload: Any) -> StateClaims | None:
    if not isinstance(payload, list) or len(payload) != 7:
        return None
    call_id, round_, principal, method, digest, expires_at_ms, owner = payload
    strings = (call_id, principal, method, digest, owner)
    if not all(isinstance(value, str) for value in strings):
        return None
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in (round_, expires_at_ms)):
        return None
    return StateClaims(call_id, round_, principal, method, digest, expires_at_ms, owner)


def load_secret(path: str | None) -> bytes:
    """The `requestState` key: the file's bytes (surrounding whitespace removed), or a random per-process key.
    Raises ValueError for an unreadable or too short file."""
    if path is None:
        return secrets.token_bytes(MIN_SECRET_BYTES)
    try:
        return read_secret(path)
    except ValueError as exc:
        raise ValueError(f"inputs.secret_file: {exc}") from None
