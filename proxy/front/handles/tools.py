"""The shapes of task handles, SANS-IO: the synthesised tools (names, definitions, arguments), a `tools/list`
page as a client without the Tasks extension sees it, and every `CallToolResult` the handles answer (the
handle, a status, a result, "no such task"), each with a text that tells a model what to call next and when.
Imports the config, the policy and the wire; no I/O.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from proxy.config.schema import TasksConfig
from proxy.policy import is_glob, policy_for
from proxy.wire import tasks as wire_tasks
from proxy.wire.jsonrpc import JSON, RawJSON
from proxy.wire.tasks import TaskRecord, TaskStatus

STATUS: Final = "task_status"
RESULT: Final = "task_result"
CANCEL: Final = "task_cancel"
RESPOND: Final = "task_respond"
BASES: Final = (STATUS, RESULT, CANCEL, RESPOND)

# The one answer for an id that is malformed, made up, expired or another caller's: nothing tells them apart.
NO_SUCH_TASK: Final = (
    "No such task. Check the taskId: it is the `taskId` of a result this client received, it is good only for "
    "the caller that received it, and only until the task expires."
)


@dataclass(frozen=True, slots=True)
class ToolNames:
    """The synthesised tools' names under `handles.tool_prefix`."""

    prefix: str

    @property
    def status(self) -> str:
        return self.prefix + STATUS

    @property
    def result(self) -> str:
        return self.prefix + RESULT

    @property
    def cancel(self) -> str:
        return self.prefix + CANCEL

    @property
    def respond(self) -> str:
        return self.prefix + RESPOND

    @property
    def all(self) -> tuple[str, ...]:
        return tuple(self.prefix + base for base in BASES)

    def base_of(self, name: object) -> str | None:
        """Which synthesised tool `name` calls (its name without the prefix), or None for any other tool."""
        if not isinstance(name, str) or not name.startswith(self.prefix):
            return None
        base = name[len(self.prefix) :]
        return base if base in BASES else None


@cache
def names(prefix: str) -> ToolNames:
    return ToolNames(prefix)


def handles(tasks: TasksConfig, tool: str, execution: object = None) -> bool:
    """Whether a client without the Tasks extension gets a handle for this tool: its policy says `handle` and
    it may run as a task (not `forbidden`, unless the upstream itself requires a task for it)."""
    policy = policy_for(tasks, tool)
    if policy.without_tasks != "handle":
        return False
    required = isinstance(execution, dict) and execution.get("taskSupport") == "required"
    return policy.mode != "forbidden" or required


@dataclass(frozen=True, slots=True)
class Served:
    """The names of the tools the handles serve under one config (the synthesised tools, the `handle` tools
    named exactly), as text and as the bytes a body spells them with; `every` when a glob or the default says
    `handle`, so that any call may be one."""

    names: frozenset[str]
    spelled: frozenset[bytes]
    every: bool

    def may_serve(self, name: object) -> bool:
        return self.every or name in self.names


_served: tuple[TasksConfig | None, str, Served] = (None, "", Served(frozenset(), frozenset(), every=False))


def served(tasks: TasksConfig, prefix: str) -> Served:
    """What the handles serve under `tasks` and `prefix`: worked out once per config (a reload brings a new one)."""
    global _served
    config, served_prefix, found = _served
    if config is tasks and served_prefix == prefix:
        return found
    every = tasks.default.without_tasks == "handle" or any(
        is_glob(name) and entry.without_tasks == "handle" for name, entry in tasks.tools.items()
    )
    named = [name for name, entry in tasks.tools.items() if entry.without_tasks == "handle"]
    texts = frozenset((*names(prefix).all, *named))
    found = Served(texts, frozenset(name.encode() for name in texts), every)
    _served = (tasks, prefix, found)
    return found


def may_concern(body: bytes, serving: Served) -> bool:
    """Whether a legacy body the proxy has not read may be a `tools/list`, or a `tools/call` of a tool the handles
    serve (then it is read and looked at properly): a look at its bytes, so that a call of any other tool is
    relayed unread, as without handles. A tool named in an escaped spelling of its name is relayed as written."""
    at = body.find(b"tools/")
    if at < 0:
        return False
    kind = body[at + 6 : at + 10]
    if kind == b"list":
        return True
    if kind != b"call" and b"tools/list" not in body and b"tools/call" not in body:
        return False
    if serving.every:
        return True
    at = body.find(b'"name"')
    while at >= 0:  # each "name" member's value (a tool's name has no quote or backslash to escape)
        start = body.find(b'"', at + 6)
        end = body.find(b'"', start + 1)
        if body[start + 1 : end] in serving.spelled:
            return True
        at = body.find(b'"name"', end)
    return False


# --- tools/list ---------------------------------------------------------------------------------------------


def _id_schema(what: str) -> JSON:
    return {"type": "string", "description": f"The `taskId` of the handle {what}."}


@cache
def definitions(tool_names: ToolNames, hold_ms: int) -> tuple[JSON, ...]:
    """The synthesised tools as a `tools/list` lists them: no `outputSchema` (their answers vary with the
    task's state, and a completed task answers with its tool's own result). Made once per prefix and hold;
    never changed."""
    hold = _seconds(hold_ms)
    task_id = "taskId"
    return (
        {
            "name": tool_names.status,
            "title": "Task status",
            "description": "Check on a tool call that is running in the background: some tools answer with a "
            "task handle (a result holding a `taskId`) when they take long. Returns the task's status (working, "
            "input_required, completed, failed or cancelled), its progress message, and, when it waits for an "
            f"answer, its questions under `inputRequests` (answer them with {tool_names.respond}). To get the "
            f"result, call {tool_names.result}.",
            "inputSchema": {
                "type": "object",
                "properties": {task_id: _id_schema("to check")},
                "required": [task_id],
                "additionalProperties": False,
            },
            "annotations": {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False},
        },
        {
            "name": tool_names.result,
            "title": "Task result",
            "description": "Get the result of a tool call that is running in the background, by the `taskId` of "
            f"its handle. Waits up to `wait_seconds` (at most {hold} s, the default) for the tool to finish. Once "
            "it has completed, returns the tool's own result, exactly as the tool produced it. If the task failed "
            "or was cancelled, says so. If it is still working, says so with `pollAfterSeconds`: call this again "
            "then.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    task_id: _id_schema("whose result to get"),
                    "wait_seconds": {
                        "type": "number",
                        "minimum": 0,
                        "description": f"How long to wait for the tool to finish (at most {hold} s, the default).",
                    },
                },
                "required": [task_id],
                "additionalProperties": False,
            },
            "annotations": {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False},
        },
        {
            "name": tool_names.cancel,
            "title": "Cancel task",
            "description": "Cancel a tool call that is running in the background, by the `taskId` of its "
            "handle: the tool is stopped and the task ends `cancelled`. A task that has ended already stays as it "
            "is.",
            "inputSchema": {
                "type": "object",
                "properties": {task_id: _id_schema("to cancel")},
                "required": [task_id],
                "additionalProperties": False,
            },
            "annotations": {"destructiveHint": True, "idempotentHint": True, "openWorldHint": False},
        },
        {
            "name": tool_names.respond,
            "title": "Answer a task's questions",
            "description": "Answer the questions a tool call running in the background waits on (its status is "
            f"input_required, and {tool_names.status} lists the questions under `inputRequests`, each under a "
            "key). `inputResponses` holds one answer per key: for an elicitation "
            '`{"action": "accept", "content": {...the fields it asks for}}` (or `{"action": "decline"}`), for '
            'a sampling request `{"role": "assistant", "content": {"type": "text", "text": "..."}, "model": '
            '"..."}`, for a roots request `{"roots": [{"uri": "file:///..."}]}`. The tool then goes on; call '
            f"{tool_names.result} for its result.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    task_id: _id_schema("whose questions to answer"),
                    "inputResponses": {
                        "type": "object",
                        "description": "The answers, keyed as the questions are in `inputRequests`.",
                        "additionalProperties": {"type": "object"},
                    },
                },
                "required": [task_id, "inputResponses"],
                "additionalProperties": False,
            },
            "annotations": {"openWorldHint": False},
        },
    )


def listed(result: JSON, tasks: TasksConfig, tool_names: ToolNames, hold_ms: int) -> tuple[JSON, list[str]]:
    """A `tools/list` page for a client without the Tasks extension: a `handle` tool without its `outputSchema`
    (clients check `structuredContent` against it, and a handle does not fit it), and on the last page (no
    `nextCursor`) the synthesised tools. An upstream tool of a synthesised name is left out (the proxy answers
    calls of that name); its names are returned. `result` is not changed."""
    tools = result.get("tools")
    if not isinstance(tools, list):
        return result, []
    reserved = set(tool_names.all)
    page: list[Any] = []
    clashes: list[str] = []
    for tool in tools:
        if not isinstance(tool, dict):
            page.append(tool)
            continue
        name = tool.get("name")
        if name in reserved:
            clashes.append(str(name))
            continue
        if "outputSchema" in tool and isinstance(name, str) and handles(tasks, name, tool.get("execution")):
            tool = {key: value for key, value in tool.items() if key != "outputSchema"}
        page.append(tool)
    if result.get("nextCursor") is None:
        page.extend(definitions(tool_names, hold_ms))
    return {**result, "tools": page}, clashes


# --- arguments ----------------------------------------------------------------------------------------------


def task_id_of(arguments: object) -> str | None:
    """The `taskId` argument when it has the shape of a task id (checked before any store is asked), else None."""
    value = arguments.get("taskId") if isinstance(arguments, dict) else None
    return value if wire_tasks.is_task_id(value) else None


def wait_seconds_of(arguments: object, hold_ms: int) -> float | None:
    """`task_result`'s wait: the smaller of `wait_seconds` and the hold (the hold when omitted); None when it is
    given but not a number."""
    hold = hold_ms / 1000
    value = arguments.get("wait_seconds") if isinstance(arguments, dict) else None
    if value is None:
        return hold
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return min(max(float(value), 0.0), hold)


def bad_arguments(message: str) -> JSON:
    return _error_text(message)


def no_such_task() -> JSON:
    return _error_text(NO_SUCH_TASK)


# --- answers --------------------------------------------------------------------------------------------------


def poll_after_seconds(record: TaskRecord) -> int:
    """When to ask again: the task's (paced) poll interval, in whole seconds, at least 1."""
    interval = record.poll_interval_ms
    return max(1, math.ceil(interval / 1000)) if interval else 1


def task_fields(record: TaskRecord) -> JSON:
    """What a handle's `structuredContent` says of the task: the fields `tasks/get` answers (without the
    result), the tool, and `pollAfterSeconds` while it is live."""
    fields: JSON = {"taskId": record.task_id, "tool": record.tool}
    fields.update(wire_tasks.detailed_task(record))
    fields.pop("result", None)
    if not record.status.terminal:
        fields["pollAfterSeconds"] = poll_after_seconds(record)
    return fields


def handle_result(record: TaskRecord, tool_names: ToolNames, hold_ms: int) -> JSON:
    """The answer to a `handle` call still running after the hold: a plain tool result holding the handle."""
    task, tool = record.task_id, record.tool
    if record.status is TaskStatus.INPUT_REQUIRED:
        text = (
            f'The tool "{tool}" needs an answer before it can go on. It waits in the background as task {task}. '
            f"{_questions(record, tool_names)}"
        )
    else:
        text = (
            f'The tool "{tool}" is still running, so it goes on in the background as task {task}. To get its '
            f"result, call {tool_names.result} with {_args(task)}: it waits up to {_seconds(hold_ms)} s for the "
            "tool to finish, and says so when it is still working; then call it again. "
            f"{tool_names.status} shows the task's progress; {tool_names.cancel} stops it."
        )
    return _structured(text, task_fields(record))


def status_result(record: TaskRecord, tool_names: ToolNames) -> JSON:
    """`task_status`: the task as `tasks/get` shows it (no result), and what to call next."""
    task, tool = record.task_id, record.tool
    message = f": {record.status_message}" if record.status_message else ""
    status = record.status
    if status is TaskStatus.INPUT_REQUIRED:
        text = f'Task {task} ("{tool}") waits for answers. {_questions(record, tool_names)}'
    elif status is TaskStatus.WORKING:
        text = (
            f'Task {task} ("{tool}") is working{message}. Call {tool_names.result} with {_args(task)} for its '
            f"result (it waits for the tool to finish), or check again in about {poll_after_seconds(record)} s."
        )
    elif status is TaskStatus.COMPLETED:
        text = f'Task {task} ("{tool}") has completed. Call {tool_names.result} with {_args(task)} for its result.'
    elif status is TaskStatus.FAILED:
        text = f'Task {task} ("{tool}") failed{message}.'
    else:
        text = f'Task {task} ("{tool}") was cancelled{message}.'
    return _structured(text, task_fields(record))


def still_working(record: TaskRecord, tool_names: ToolNames) -> JSON:
    """`task_result` for a task that did not settle within its wait."""
    task, tool = record.task_id, record.tool
    if record.status is TaskStatus.INPUT_REQUIRED:
        text = f'Task {task} ("{tool}") cannot go on before it gets answers. {_questions(record, tool_names)}'
    else:
        message = f" ({record.status_message})" if record.status_message else ""
        text = (
            f'Task {task} ("{tool}") is still working{message}. Call {tool_names.result} with {_args(task)} '
            "again for its result."
        )
    return _structured(text, task_fields(record))


def outcome_result(record: TaskRecord) -> JSON:
    """`task_result` of a settled task: a completed task's own tool result, exactly as the upstream produced it
    (`content`, `structuredContent`, `isError`); a failed or cancelled one as an `isError` result saying so."""
    if record.status is TaskStatus.COMPLETED:
        result = record.result.value() if isinstance(record.result, RawJSON) else record.result
        if not isinstance(result, dict):
            return {"content": []}
        return {key: value for key, value in result.items() if key != "resultType"}
    task, tool = record.task_id, record.tool
    if record.status is TaskStatus.FAILED:
        error = record.error or {}
        reason = record.status_message or str(error.get("message") or "the upstream call failed")
        text = f'Task {task} ("{tool}") failed: {reason}'
    else:
        text = f'Task {task} ("{tool}") was cancelled' + (f": {record.status_message}" if record.status_message else "")
    return {**_structured(text, task_fields(record)), "isError": True}


def cancel_result(record: TaskRecord) -> JSON:
    """`task_cancel`: the task as it is now (cancelled, or as it had ended)."""
    task, tool = record.task_id, record.tool
    if record.status is TaskStatus.CANCELLED:
        text = f'Task {task} ("{tool}") is cancelled: the tool was stopped.'
    else:
        text = f'Task {task} ("{tool}") had ended already ({record.status.value}); nothing was cancelled.'
    return _structured(text, task_fields(record))


def respond_result(record: TaskRecord, answered: list[str], tool_names: ToolNames) -> JSON:
    """`task_respond`: which answers went to the tool; what is still asked shows in `task_status`."""
    task = record.task_id
    if not answered:
        text = (
            f"None of these keys is a question task {task} waits on, so nothing was sent. Call "
            f"{tool_names.status} with {_args(task)} for the questions it waits on now."
        )
    else:
        text = (
            f"Sent the answers to {', '.join(answered)} to task {task}; the tool goes on. Call "
            f"{tool_names.result} with {_args(task)} for its result."
        )
    return _structured(text, {"taskId": task, "tool": record.tool, "answered": answered})


def _questions(record: TaskRecord, tool_names: ToolNames) -> str:
    """The questions a task waits on, one line each, and how to answer them."""
    lines = []
    for key, request in record.input_requests.items():
        method = request.get("method") if isinstance(request, dict) else None
        params = request.get("params") if isinstance(request, dict) else None
        message = params.get("message") if isinstance(params, dict) else None
        said = f": {json.dumps(message)}" if isinstance(message, str) else ""
        lines.append(f"{key} ({method}{said})")
    return (
        f"It asks {len(lines)} question(s), shown under inputRequests by key: {'; '.join(lines)}. Answer with "
        f'{tool_names.respond} {{"taskId": "{record.task_id}", "inputResponses": {{"<key>": <answer>}}}} (an '
        'elicitation is answered {"action": "accept", "content": {...the fields it asks for}} or {"action": '
        f'"decline"}}), then call {tool_names.result} with {_args(record.task_id)} for the result.'
    )


def _args(task_id: str) -> str:
    return f'{{"taskId": "{task_id}"}}'


def _seconds(milliseconds: int) -> str:
    seconds = milliseconds / 1000
    return str(int(seconds)) if seconds.is_integer() else f"{seconds:g}"


def _structured(text: str, structured: JSON) -> JSON:
    return {"content": [{"type": "text", "text": text}], "structuredContent": structured, "isError": False}


def _error_text(text: str) -> JSON:
    return {"content": [{"type": "text", "text": text}], "isError": True}
