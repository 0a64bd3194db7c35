"""What replicas of one shared store say to each other about calls, sans-IO: the message kinds and payloads
(answers to a task's owner; an MRTR retry forwarded to the holder of its call, and what comes back).
Imports the machine's reply types, the input rules, errors and the wire; no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from proxy.errors import InvalidParamsError, ProxyError
from proxy.tasks.machine import inputs
from proxy.tasks.machine.commands import (
    ReplyError,
    ReplyInputRequired,
    ReplyKind,
    ReplyMissing,
    ReplyOutcome,
    ReplyTask,
)
from proxy.wire.jsonrpc import JSON
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult

# Messages travel through the store (`notify_owner`, `notify_replica`, `take_messages`) and the change feed wakes
# their recipient. A task's answers go to its owner (`INPUT`). An MRTR retry that lands on a replica other than the
# one holding the parked call is forwarded there (`RESUME`); the holder sends what the call produced for that round
# (`NOTE` for each notification on the way, then one `REPLY`), and is told when the waiting client went away (`LEFT`).
# Imports the machine's reply types, the input rules, errors and the wire; no I/O.

# Message kinds (a task's INPUT is the store's own kind).
RESUME: Final = "resume"  # to the holder of a parked call: an MRTR retry that arrived elsewhere
NOTE: Final = "note"  # to the replica whose client waits: a notification for its stream
REPLY: Final = "reply"  # to the replica whose client waits: the round's answer
LEFT: Final = "left"  # to the holder: the client waiting for that answer went away


class RelayedError(ProxyError):
    """A ProxyError raised on the replica that holds the call, answered here as it was there."""

    def __init__(self, error: JSON, status: int) -> None:
        message = error.get("message")
        super().__init__(message if isinstance(message, str) else None, data=error.get("data"), http_status=status)
        self._error = dict(error)

    def error_object(self) -> dict[str, Any]:
        return dict(self._error)


class ReplicaLostError(ProxyError):
    """The replica holding the call stopped renewing its lease while a client here waited for it."""

    http_status = 502
    default_message = (
        "Internal error: the proxy process holding this call was lost; send the request again without requestState"
    )


def check_answers(input_requests: Any, responses: Mapping[str, Any]) -> dict[str, JSON]:
    """`tasks/update` on a replica that does not run the task's call: each answer to a question the record
    shows outstanding, checked as its owner would (-32602 naming the key); the owner checks again against what
    is outstanding when the answers arrive."""
    return inputs.check_answers(inputs.outstanding(input_requests), responses)


def encode_reply(reply: ReplyKind, *, request_state: str, task_id: str | None) -> JSON:
    """A round's answer as a message payload: what the waiting replica needs to answer its client."""
    if isinstance(reply, ReplyOutcome):
        outcome = reply.outcome
        if isinstance(outcome, UpstreamResult):
            return {"result": outcome.result}
        if isinstance(outcome, UpstreamErrorResponse):
            return {"error": outcome.error}
        return _proxy_error(outcome)
    if isinstance(reply, ReplyTask):
        return {"task": task_id}
    if isinstance(reply, ReplyInputRequired):
        return {"inputRequests": reply.input_requests, "round": reply.round, "requestState": request_state}
    if isinstance(reply, ReplyMissing):
        return {"missing": reply.required}
    return _proxy_error(reply.error)


def _proxy_error(error: ProxyError) -> JSON:
    return {"proxyError": error.error_object(), "status": error.status}


def decode_reply(payload: JSON) -> tuple[ReplyKind, str, str | None]:
    """(reply, requestState of an InputRequiredResult, task id of a CreateTaskResult) from `encode_reply`'s
    payload; a payload it did not make is an internal error, never a crash."""
    if isinstance(payload.get("result"), dict):
        return ReplyOutcome(UpstreamResult(payload["result"])), "", None
    if isinstance(payload.get("error"), dict):
        return ReplyOutcome(UpstreamErrorResponse(payload["error"])), "", None
    if isinstance(payload.get("task"), str):
        return ReplyTask(), "", payload["task"]
    if isinstance(payload.get("inputRequests"), dict) and isinstance(payload.get("requestState"), str):
        round_ = payload.get("round")
        return (
            ReplyInputRequired(payload["inputRequests"], round_ if isinstance(round_, int) else 0),
            payload["requestState"],
            None,
        )
    if isinstance(payload.get("missing"), dict):
        return ReplyMissing(payload["missing"]), "", None
    error, status = payload.get("proxyError"), payload.get("status")
    if isinstance(error, dict) and isinstance(status, int):
        return ReplyError(RelayedError(error, status)), "", None
    return ReplyError(ProxyError("Internal error: another replica sent an answer this one cannot read")), "", None


def resume_payload(
    request_state: str,
    responses: Mapping[str, Any],
    progress_token: str | int | None,
    log_level: str | None,
    reply_to: str,
) -> JSON:
    return {
        "requestState": request_state,
        "inputResponses": dict(responses),
        "progressToken": progress_token,
        "logLevel": log_level,
        "replyTo": reply_to,
    }


def check_resume(payload: JSON) -> tuple[str, Mapping[str, Any], str | int | None, str | None, str]:
    """The fields of a RESUME payload (InvalidParamsError for one this proxy did not make)."""
    state, responses, reply_to = payload.get("requestState"), payload.get("inputResponses"), payload.get("replyTo")
    token, level = payload.get("progressToken"), payload.get("logLevel")
    if not isinstance(state, str) or not isinstance(responses, dict) or not isinstance(reply_to, str):
        raise InvalidParamsError("Invalid params: a forwarded retry could not be read")
    progress = token if isinstance(token, str | int) and not isinstance(token, bool) else None
    return state, responses, progress, level if isinstance(level, str) else None, reply_to
