"""tasks/job.py: where a legacy job's id, state and message are read from its tools' results (JMESPath over the
CallToolResult plus `json`, its first text block parsed), and the helper tools' arguments."""

from __future__ import annotations

import json
from typing import Any

from proxy.config.schema import JobConfig
from proxy.tasks.machine.job import MAX_BACKOFF_MS, MAX_MESSAGE_CHARS, JobReport, JobSpec, backoff_ms, searched

STATES = {"running": "working", "done": "completed", "failed": "failed", "cancelled": "cancelled"}


def spec(**overrides: Any) -> JobSpec:
    config: dict[str, Any] = {
        "job_id": "structuredContent.job_id || json.job_id",
        "status": {
            "tool": "render_status",
            "state": "json.state",
            "states": STATES,
            "message": "json.progress",
            "error": "json.error",
        },
        "cancel": {"tool": "cancel_render", "arguments": {"job_id": "{job_id}", "why": "job {job_id}", "n": 1}},
    }
    config.update(overrides)
    return JobSpec("start_render", JobConfig.model_validate(config))


def text(value: Any) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": value if isinstance(value, str) else json.dumps(value)}]}


def test_the_job_id_is_read_from_structured_content_or_from_json_text() -> None:
    job = spec()
    structured = {"content": [{"type": "text", "text": "Render r-1 started"}], "structuredContent": {"job_id": "r-1"}}
    assert job.job_id(structured) == "r-1"
    assert job.job_id(text({"job_id": "r-2"})) == "r-2"
    assert job.job_id(text({"job_id": 42})) == "42"  # a number, as its decimal text


def test_no_id_an_empty_one_or_an_error_result_is_no_job() -> None:
    job = spec()
    assert job.job_id(text("Render r-1 started")) is None  # prose: `json` is null
    assert job.job_id(text({"job_id": ""})) is None
    assert job.job_id(text({"job_id": True})) is None
    assert job.job_id({**text({"job_id": "r-1"}), "isError": True}) is None
    error = job.no_job_id(text("Render r-1 started"))
    assert error["code"] == -32603
    assert "no job id at `structuredContent.job_id || json.job_id`" in error["message"]
    assert error["data"]["result"] == text("Render r-1 started")


def test_json_is_the_first_text_block_parsed_and_null_when_it_does_not_parse() -> None:
    assert searched(text({"a": 1}))["json"] == {"a": 1}
    assert searched(text("not json"))["json"] is None
    image_first = {"content": [{"type": "image", "data": "", "mimeType": "image/png"}, *text([1])["content"]]}
    assert searched(image_first)["json"] == [1]
    assert searched({"content": []})["json"] is None


def test_mapped_states_end_the_task_and_others_keep_it_working_with_the_state_shown() -> None:
    job = spec()
    assert job.report(text({"state": "running", "progress": "40%"})) == JobReport("working", "40%")
    assert job.report(text({"state": "queued", "progress": "0%"})) == JobReport("working", "queued: 0%")
    assert job.report(text({"state": "queued"})) == JobReport("working", "queued")
    assert job.report(text({"state": "done", "progress": "100%"})) == JobReport("completed", "100%")
    assert job.report(text({"state": "cancelled"})) == JobReport("cancelled")
    assert job.report(text({"state": 3})) == JobReport("working", "3")


def test_a_failed_job_reads_its_error_else_its_message_else_a_plain_one() -> None:
    job = spec()
    assert job.report(text({"state": "failed", "error": "out of memory"})) == JobReport("failed", None, "out of memory")
    assert job.report(text({"state": "failed", "progress": "50%"})) == JobReport("failed", "50%", "50%")
    assert job.report(text({"state": "failed"})) == JobReport("failed", None, "the job failed")


def test_a_status_result_that_says_nothing_usable_is_no_report() -> None:
    job = spec()
    assert job.report({**text({"state": "running"}), "isError": True}) is None
    assert job.report(text({"progress": "40%"})) is None  # no state
    assert job.report(text({"state": {"phase": "x"}})) is None
    assert job.report(text("running")) is None  # prose, and the state is read from json


def test_a_state_in_plain_text_can_be_read_from_the_text_block_itself() -> None:
    job = spec(status={"tool": "s", "state": "content[0].text", "states": {"done": "completed"}})
    assert job.report(text("running 40%")) == JobReport("working", "running 40%")
    assert job.report(text("done")) == JobReport("completed")


def test_a_long_message_is_cut_and_a_structured_one_is_shown_as_json() -> None:
    job = spec()
    report = job.report(text({"state": "running", "progress": "x" * 5000}))
    assert report is not None
    assert report.message == "x" * MAX_MESSAGE_CHARS
    assert job.report(text({"state": "running", "progress": {"done": 3}})) == JobReport("working", '{"done":3}')


def test_every_job_id_in_the_templates_is_replaced_at_any_depth() -> None:
    job = spec()
    assert job.config.cancel is not None
    assert JobSpec.arguments(job.config.cancel, "r-9") == {
        "name": "cancel_render",
        "arguments": {"job_id": "r-9", "why": "job r-9", "n": 1},
    }
    assert JobSpec.arguments(job.config.status, "r-9") == {"name": "render_status", "arguments": {"job_id": "r-9"}}


def test_the_tools_a_family_names_by_role() -> None:
    assert spec().tools() == {"start": "start_render", "status": "render_status", "cancel": "cancel_render"}


def test_failed_polls_back_off_up_to_a_bound_never_below_the_configured_interval() -> None:
    assert backoff_ms(2000, 2000) == 4000
    assert backoff_ms(20_000, 2000) == MAX_BACKOFF_MS
    assert backoff_ms(MAX_BACKOFF_MS, 2000) == MAX_BACKOFF_MS
    assert backoff_ms(40_000, 60_000) == 60_000  # a configured interval above the bound stays
