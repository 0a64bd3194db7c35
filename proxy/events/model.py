"""The Events extension on the wire, sans-IO: the event types the proxy offers (`events/list`), a subscription's
arguments checked against them, the derived subscription id, cursors, the `EventOccurrence` a log entry becomes,
the Standard Webhooks secret, callback URLs and the addresses a delivery may reach, and the retry schedule.

No I/O and no event loop; imports the wire, the store's event values and the errors.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import SplitResult, urlsplit

from proxy.errors import InvalidParamsError
from proxy.events.errors import EventsNotFoundError, UnsupportedError
from proxy.tasks.store.events import TASK_STATUS, StoredEvent
from proxy.wire.fields import FieldError, check_field
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus, iso_timestamp

EXTENSION: Final = "io.modelcontextprotocol/events"
SUBSCRIPTION_ID_META: Final = "io.modelcontextprotocol/subscriptionId"
POLL: Final = "poll"
PUSH: Final = "push"
WEBHOOK: Final = "webhook"
MAX_BODY_BYTES: Final = 256 * 1024  # a webhook body at most (the extension's delivery profile)
MAX_URL_CHARS: Final = 2048
EVENT_STATUSES: Final = frozenset(
    {TaskStatus.INPUT_REQUIRED, TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED}
)
# `lastError` / `data.reason` categories: fixed words, never what an endpoint said.
CONNECTION_REFUSED: Final = "connection_refused"
TIMEOUT: Final = "timeout"
TLS_ERROR: Final = "tls_error"
HTTP_4XX: Final = "http_4xx"
HTTP_5XX: Final = "http_5xx"
CHALLENGE_FAILED: Final = "challenge_failed"


@dataclass(frozen=True, slots=True)
class EventType:
    name: str
    description: str
    input_schema: JSON
    payload_schema: JSON
    delivery: tuple[str, ...]
    subject_argument: str | None  # the argument that names what the event is about (a task id), if any

    def descriptor(self) -> JSON:
        return {
            "name": self.name,
            "description": self.description,
            "delivery": list(self.delivery),
            "inputSchema": self.input_schema,
            "payloadSchema": self.payload_schema,
        }


_ISO: Final[JSON] = {"type": "string", "format": "date-time"}
TASK_STATUS_TYPE: Final = EventType(
    name=TASK_STATUS,
    description="Fires when a task of the subscribing caller reaches `input_required` or ends (`completed`, "
    "`failed`, `cancelled`). The payload is the task's status, never its result: read that with `tasks/get`. "
    "With `taskId`, one task (one that has already ended delivers its end at once); without, every task of "
    "the caller.",
    input_schema={
        "type": "object",
        "properties": {"taskId": {"type": "string", "description": "One task of the caller; omit for all."}},
        "additionalProperties": False,
    },
    payload_schema={
        "type": "object",
        "properties": {
            "taskId": {"type": "string"},
            "status": {"type": "string", "enum": sorted(status.value for status in EVENT_STATUSES)},
            "statusMessage": {"type": "string"},
            "createdAt": _ISO,
            "lastUpdatedAt": _ISO,
            "ttlMs": {"type": ["integer", "null"]},
            "pollIntervalMs": {"type": "integer"},
        },
        "required": ["taskId", "status", "createdAt", "lastUpdatedAt", "ttlMs"],
    },
    delivery=(POLL, PUSH, WEBHOOK),
    subject_argument="taskId",
)
RESOURCE_UPDATED: Final = "resource.updated"
RESOURCE_UPDATED_TYPE: Final = EventType(
    name=RESOURCE_UPDATED,
    description="Fires when the legacy server says the resource `uri` changed (its "
    "`notifications/resources/updated`). The proxy subscribes to it upstream while someone is subscribed here; "
    "read the resource with `resources/read`.",
    input_schema={
        "type": "object",
        "properties": {"uri": {"type": "string", "description": "The resource to watch."}},
        "required": ["uri"],
        "additionalProperties": False,
    },
    payload_schema={"type": "object", "properties": {"uri": {"type": "string"}}, "required": ["uri"]},
    delivery=(POLL, PUSH, WEBHOOK),
    subject_argument="uri",
)


def _list_changed(kind: str) -> EventType:
    return EventType(
        name=f"{kind}.list_changed",
        description=f"Fires when the legacy server says its {kind} changed (its `notifications/{kind}/list_changed`); "
        f"list them again with `{kind}/list`.",
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        payload_schema={"type": "object", "properties": {}},
        delivery=(POLL, PUSH, WEBHOOK),
        subject_argument=None,
    )


LIST_CHANGED_TYPES: Final = {kind: _list_changed(kind) for kind in ("tools", "prompts", "resources")}
# The legacy server's notification behind each upstream event type.
UPSTREAM_NOTIFICATIONS: Final[Mapping[str, str]] = {
    RESOURCE_UPDATED: "notifications/resources/updated",
    **{event_type.name: f"notifications/{kind}/list_changed" for kind, event_type in LIST_CHANGED_TYPES.items()},
}
CATALOG: Final[Mapping[str, EventType]] = {
    TASK_STATUS_TYPE.name: TASK_STATUS_TYPE,
    RESOURCE_UPDATED: RESOURCE_UPDATED_TYPE,
    **{event_type.name: event_type for event_type in LIST_CHANGED_TYPES.values()},
}


def catalog(upstream_capabilities: JSON) -> dict[str, EventType]:
    """The event types offered for this legacy server: a task's status always; a resource's updates when it
    declared `resources.subscribe`; a list's changes when it declared that list's `listChanged`."""
    offered = {TASK_STATUS_TYPE.name: TASK_STATUS_TYPE}
    resources = upstream_capabilities.get("resources")
    if isinstance(resources, dict) and resources.get("subscribe") is True:
        offered[RESOURCE_UPDATED] = RESOURCE_UPDATED_TYPE
    for kind, event_type in LIST_CHANGED_TYPES.items():
        declared = upstream_capabilities.get(kind)
        if isinstance(declared, dict) and declared.get("listChanged") is True:
            offered[event_type.name] = event_type
    return offered


@dataclass(frozen=True, slots=True)
class Subscription:
    """What a request subscribes to: the type, its arguments (canonical JSON) and the subject they name."""

    type: EventType
    arguments: JSON
    canonical: str
    subject: str | None


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def subscription_of(params: JSON, mode: str, offered: Mapping[str, EventType] = CATALOG) -> Subscription:
    """`{name, arguments}` of an `events/*` request, checked: a name not `offered` is NotFound, a mode the type
    does not offer Unsupported, arguments outside its `inputSchema` InvalidParams."""
    name = params.get("name")
    if not isinstance(name, str):
        raise InvalidParamsError("Invalid params: name must be a string")
    event_type = offered.get(name)
    if event_type is None:
        raise EventsNotFoundError(f"Not found: no event type {name[:128]!r}", data={"kind": "event"})
    if mode not in event_type.delivery:
        raise UnsupportedError(
            f"Unsupported: {name} is not delivered by {mode}", {"feature": "deliveryMode", "value": mode}
        )
    arguments = params.get("arguments", {})
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise InvalidParamsError("Invalid params: arguments must be an object")
    allowed = event_type.input_schema.get("properties", {})
    unknown = sorted(set(arguments) - set(allowed))
    if unknown:
        raise InvalidParamsError(f"Invalid params: {name} takes no argument {unknown[0][:64]!r}")
    subject: str | None = None
    required = event_type.input_schema.get("required", [])
    missing = [key for key in required if key not in arguments]
    if missing:
        raise InvalidParamsError(f"Invalid params: {name} needs the argument {missing[0]!r}")
    if event_type.subject_argument is not None and event_type.subject_argument in arguments:
        subject = arguments[event_type.subject_argument]
        if not isinstance(subject, str) or not subject or len(subject) > MAX_URL_CHARS:
            raise InvalidParamsError(f"Invalid params: arguments.{event_type.subject_argument} must be a string")
    return Subscription(event_type, arguments, canonical_json(arguments), subject)


def upstream_event(event_type: EventType, principal: str, subject: str, event_id: str, now_ms: int) -> StoredEvent:
    """The event a legacy server's notification becomes (its `eventId` minted by the proxy: the notification
    carries none)."""
    data: JSON = {"uri": subject} if event_type.subject_argument == "uri" else {}
    return StoredEvent(0, event_id, event_type.name, principal, subject, data, now_ms)


def subscription_id(principal: str, url: str, name: str, canonical_arguments: str) -> str:
    """Deterministic over the subscription key (principal, callback URL, name, arguments): stable across
    refreshes and restarts; a routing handle, never accepted as input."""
    key = "\0".join((principal, url, name, canonical_arguments)).encode()
    return "sub_" + hashlib.sha256(key).hexdigest()[:32]


# --- cursors -------------------------------------------------------------------------------------------------


def encode_cursor(epoch: str, position: int) -> str:
    return f"{epoch}.{position}"


def decode_cursor(value: Any, epoch: str) -> int | None:
    """The log position a client's cursor names; None for `null`/absent ("start from now"); -1 for a cursor of
    another log (this store was replaced): the caller resumes at what it can serve, with `truncated`."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidParamsError("Invalid params: cursor must be a string or null")
    cursor_epoch, _, position = value.partition(".")
    if not position.isdigit() or not cursor_epoch or len(value) > 64:
        raise InvalidParamsError("Invalid params: cursor is not one this server issued")
    return int(position) if cursor_epoch == epoch else -1


def non_negative_int(params: JSON, key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidParamsError(f"Invalid params: {key} must be a non-negative integer")
    return value


# --- occurrences ---------------------------------------------------------------------------------------------


def payload(event: StoredEvent) -> JSON:
    """The event's `data` as its type's `payloadSchema` says (the log keeps times in milliseconds)."""
    if event.name != TASK_STATUS:
        return dict(event.data)
    stored = event.data
    data: JSON = {
        "taskId": stored["taskId"],
        "status": stored["status"],
        "createdAt": iso_timestamp(int(stored["createdAtMs"])),
        "lastUpdatedAt": iso_timestamp(int(stored["updatedAtMs"])),
        "ttlMs": stored.get("ttlMs"),
    }
    if stored.get("statusMessage") is not None:
        data["statusMessage"] = stored["statusMessage"]
    if stored.get("pollIntervalMs") is not None:
        data["pollIntervalMs"] = stored["pollIntervalMs"]
    return data


def occurrence(event: StoredEvent, cursor: str | None = None, *, with_cursor: bool = False) -> JSON:
    """An `EventOccurrence`; push and webhook carry the position after it (`with_cursor`), poll does not."""
    found: JSON = {
        "eventId": event.event_id,
        "name": event.name,
        "timestamp": iso_timestamp(event.occurred_at_ms),
        "data": payload(event),
    }
    if with_cursor:
        found["cursor"] = cursor
    return found


def task_event(record: TaskRecord) -> StoredEvent:
    """The status event of a task as its record stands (the same `eventId` as the logged one)."""
    data: JSON = {
        "taskId": record.task_id,
        "status": record.status.value,
        "statusMessage": record.status_message,
        "createdAtMs": record.created_at_ms,
        "updatedAtMs": record.updated_at_ms,
        "ttlMs": record.ttl_ms,
        "pollIntervalMs": record.poll_interval_ms,
    }
    event_id = f"{record.task_id}.{record.status.value}.{record.updated_at_ms}"
    return StoredEvent(0, event_id, TASK_STATUS, record.principal, record.task_id, data, record.updated_at_ms)


# --- webhooks ------------------------------------------------------------------------------------------------


def check_secret(secret: Any) -> str:
    """A Standard Webhooks symmetric secret: `whsec_` and base64 of 24 to 64 bytes (else InvalidParams)."""
    if not isinstance(secret, str) or not secret.startswith("whsec_") or len(secret) > 200:
        raise InvalidParamsError("Invalid params: delivery.secret must be whsec_ followed by base64")
    try:
        raw = base64.b64decode(secret[len("whsec_") :], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParamsError("Invalid params: delivery.secret must be whsec_ followed by base64") from None
    if not 24 <= len(raw) <= 64:
        raise InvalidParamsError("Invalid params: delivery.secret must decode to 24 to 64 bytes")
    return secret


def check_callback(url: Any, *, allow_insecure: bool, allow_private: bool) -> SplitResult:
    """A callback URL the proxy may POST to, as far as the text tells: `https` (or `http` where allowed), a host,
    no credentials or fragment, printable ASCII that is a valid header value, and no literal address that is not
    globally routable (unless allowed). Names are resolved, and every address checked, at each delivery."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
        raise InvalidParamsError("Invalid params: delivery.url must be a URL")
    try:
        check_field("X-Callback", url)
        parts = urlsplit(url)
        port = parts.port
    except (FieldError, ValueError):
        raise InvalidParamsError("Invalid params: delivery.url is not a valid URL") from None
    schemes = ("https", "http") if allow_insecure else ("https",)
    if parts.scheme not in schemes:
        raise InvalidParamsError("Invalid params: delivery.url must use https")
    if not parts.hostname or parts.username is not None or parts.password is not None or parts.fragment:
        raise InvalidParamsError("Invalid params: delivery.url needs a host, and no credentials or fragment")
    if port == 0 or any(ord(char) > 126 or ord(char) < 33 for char in url):
        raise InvalidParamsError("Invalid params: delivery.url is not a valid URL")
    try:
        literal = ipaddress.ip_address(parts.hostname)
    except ValueError:
        literal = None
    if literal is not None and not allow_private and not routable(literal):
        raise InvalidParamsError("Invalid params: delivery.url names an address that is not globally routable")
    return parts


def routable(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Globally routable per the IANA special-purpose registries (an IPv4-mapped IPv6 address as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


def retry_delay(attempts: int, schedule: Sequence[float]) -> float | None:
    """Seconds before the next try of a delivery that failed its `attempts`-th try; None: give up."""
    return schedule[attempts - 1] if attempts <= len(schedule) else None


def category(status: int) -> str:
    return HTTP_5XX if status >= 500 else HTTP_4XX
