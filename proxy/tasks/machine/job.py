"""A legacy job family (`jobs:`) as the machine follows it: where the job's id, state and message are in its
tools' results (JMESPath over the `CallToolResult` and its parsed text), and the helper tools' arguments.
Sans-IO and pure: imports the config, the wire and jmespath only."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import jmespath
from jmespath.parser import ParsedResult

from proxy.config.schema import JobConfig, JobToolConfig
from proxy.wire import tasks as wire_tasks
from proxy.wire.jsonrpc import JSON

# The machine follows a job as it follows a task the upstream runs itself (`upstream_task.py`), the job id standing
# for the upstream's task id; only how its status is read differs. Expressions are JMESPath
# (jmespath.org/specification.html) over the `CallToolResult` plus `json`, its first text block parsed as JSON.
# SANS-IO and pure: imports the config, the wire and jmespath only.

MAX_MESSAGE_CHARS: Final = 1024  # a status text longer than this is cut: it is written to the record on change
MAX_BACKOFF_MS: Final = 30_000  # failed polls double the interval up to this
JOB_FAILED: Final = "the job failed"
JOB_CANCELLED: Final = "the job was cancelled upstream"
_TEMPLATE: Final = "{job_id}"


@dataclass(frozen=True, slots=True)
class JobReport:
    """One status result, read: the task's status (`working`, `completed`, `failed`, `cancelled`), the text for
    its statusMessage, and a failed job's message."""

    status: str
    message: str | None = None
    error: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status != "working"


def searched(result: Mapping[str, Any]) -> dict[str, Any]:
    """What expressions see: the `CallToolResult` and `json`, its first text block parsed (when it parses)."""
    parsed: Any = None
    for block in result.get("content") or ():
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            try:
                parsed = json.loads(block["text"])
            except ValueError:
                parsed = None
            break
    return {**result, "json": parsed}


def _text(value: Any) -> str | None:
    if value is None or value == "":
        return None
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text[:MAX_MESSAGE_CHARS]


def _filled(template: Any, job_id: str) -> Any:
    if isinstance(template, str):
        return template.replace(_TEMPLATE, job_id)
    if isinstance(template, dict):
        return {key: _filled(value, job_id) for key, value in template.items()}
    if isinstance(template, list):
        return [_filled(value, job_id) for value in template]
    return template


class JobSpec:
    """One `jobs:` entry with its expressions compiled."""

    def __init__(self, start_tool: str, config: JobConfig) -> None:
        self.start_tool = start_tool
        self.config = config
        self.poll_interval_ms = config.poll_interval_ms
        self._job_id: ParsedResult = jmespath.compile(config.job_id)
        self._state: ParsedResult = jmespath.compile(config.status.state)
        self._message = None if config.status.message is None else jmespath.compile(config.status.message)
        self._error = None if config.status.error is None else jmespath.compile(config.status.error)

    def tools(self) -> dict[str, str]:
        """Every tool the family names, by the role it plays (for the check at start)."""
        roles = {"start": self.start_tool, "status": self.config.status.tool}
        if self.config.result is not None:
            roles["result"] = self.config.result.tool
        if self.config.cancel is not None:
            roles["cancel"] = self.config.cancel.tool
        return roles

    def job_id(self, result: Mapping[str, Any]) -> str | None:
        """The job's id in the start tool's result (a string or a number; anything else is no id)."""
        if result.get("isError") is True:
            return None
        value = self._job_id.search(searched(result))
        if isinstance(value, bool) or not isinstance(value, str | int | float) or value == "":
            return None
        return value if isinstance(value, str) else json.dumps(value)

    def no_job_id(self, result: JSON) -> JSON:
        """The error a start that answered no job id fails with, carrying that answer."""
        message = f"The start tool answered no job id at `{self.config.job_id}`"
        return {**wire_tasks.internal_error(message), "data": {"result": result}}

    @staticmethod
    def arguments(tool: JobToolConfig, job_id: str) -> JSON:
        return {"name": tool.tool, "arguments": _filled(tool.arguments, job_id)}

    def report(self, result: Mapping[str, Any]) -> JobReport | None:
        """A status result read; None when it says nothing usable (an `isError` result, no state)."""
        if result.get("isError") is True:
            return None
        seen = searched(result)
        state = self._state.search(seen)
        if state is None or isinstance(state, dict | list):
            return None
        state = state if isinstance(state, str) else json.dumps(state)
        message = None if self._message is None else _text(self._message.search(seen))
        mapped = self.config.status.states.get(state)
        if mapped is None:  # not a state the config names: still working, and the client sees which
            return JobReport("working", _text(state if message is None else f"{state}: {message}"))
        if mapped == "failed":
            error = None if self._error is None else _text(self._error.search(seen))
            return JobReport("failed", message, error or message or JOB_FAILED)
        return JobReport(mapped, message)


def backoff_ms(current_ms: int, configured_ms: int) -> int:
    """The next interval after a failed poll: doubled, at most MAX_BACKOFF_MS, never below the configured one."""
    return max(configured_ms, min(MAX_BACKOFF_MS, current_ms * 2))
