"""tasks/remote.py: what replicas say to each other about calls, with no I/O: every round's answer survives the
trip to the replica whose client waits, and answers checked on a replica that does not run the task's call
are checked as its owner would check them."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import InvalidParamsError, MissingCapabilityError, ProxyError, TaskLimitError, UpstreamError
from proxy.tasks.machine.commands import (
    ReplyError,
    ReplyInputRequired,
    ReplyKind,
    ReplyMissing,
    ReplyOutcome,
    ReplyTask,
)
from proxy.tasks.services import remote
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult

ELICIT = {"method": "elicitation/create", "params": {"message": "Name?", "requestedSchema": {"type": "object"}}}
ROOTS = {"method": "roots/list"}
ACCEPT = {"action": "accept", "content": {"name": "Ada"}}


@pytest.mark.parametrize(
    ("reply", "state", "task_id"),
    [
        (ReplyOutcome(UpstreamResult({"content": [], "isError": False})), "", None),
        (ReplyOutcome(UpstreamErrorResponse({"code": -32000, "message": "no"})), "", None),
        (ReplyTask(), "", "task_1"),
        (ReplyInputRequired({"elicitation-2": ELICIT}, 2), "signed-state", None),
        (ReplyMissing({"sampling": {}}), "", None),
    ],
)
def test_a_rounds_answer_survives_the_trip(reply: ReplyKind, state: str, task_id: str | None) -> None:
    payload = remote.encode_reply(reply, request_state=state, task_id=task_id)
    assert remote.decode_reply(payload) == (reply, state, task_id)


@pytest.mark.parametrize(
    "error",
    [
        InvalidParamsError("Invalid params: inputResponses.elicitation-1 is not a valid answer"),
        TaskLimitError("max_parked", 1),
        UpstreamError("Upstream MCP server unavailable"),
        MissingCapabilityError({"roots": {}}, "Missing required client capability"),
    ],
)
def test_an_error_raised_where_the_call_is_held_is_answered_as_it_was(error: ProxyError) -> None:
    for reply in (ReplyError(error), ReplyOutcome(error)):
        decoded, _, _ = remote.decode_reply(remote.encode_reply(reply, request_state="", task_id=None))
        assert isinstance(decoded, ReplyError)
        assert decoded.error.error_object() == error.error_object()
        assert decoded.error.status == error.status


def test_a_payload_it_did_not_make_is_an_internal_error() -> None:
    decoded, _, _ = remote.decode_reply({"something": "else"})
    assert isinstance(decoded, ReplyError)
    assert decoded.error.error_object()["code"] == -32603


def test_answers_are_checked_against_the_questions_the_record_shows() -> None:
    questions = {"elicitation-1": ELICIT, "roots-2": ROOTS}
    checked = remote.check_answers(questions, {"elicitation-1": ACCEPT, "roots-2": {"roots": []}, "sampling-9": {}})
    assert checked == {"elicitation-1": ACCEPT, "roots-2": {"roots": []}}  # keys not outstanding are ignored
    with pytest.raises(InvalidParamsError, match=r"inputResponses\.roots-2"):
        remote.check_answers(questions, {"roots-2": {"roots": "all of them"}})


@pytest.mark.parametrize("questions", [None, {}, {"elicitation-1": "not a question"}, {"x-1": {"method": "ping"}}])
def test_nothing_is_outstanding_in_a_record_without_questions(questions: Any) -> None:
    assert remote.check_answers(questions, {"elicitation-1": ACCEPT, "x-1": {}}) == {}


def test_a_forwarded_retry_is_read_back_or_refused() -> None:
    payload = remote.resume_payload("state", {"elicitation-1": ACCEPT}, "token", "info", "replica-b")
    assert remote.check_resume(payload) == ("state", {"elicitation-1": ACCEPT}, "token", "info", "replica-b")
    with pytest.raises(InvalidParamsError):
        remote.check_resume({**payload, "requestState": 7})
    assert remote.check_resume({**payload, "progressToken": True})[2] is None  # a bool is no progress token
