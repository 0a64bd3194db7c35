"""Tools the fixture upstream runs as its OWN 2025-11-25 tasks, through the mcp 1.x SDK's experimental
Tasks support (``server.experimental.enable_tasks()``, ``ctx.experimental.run_task``). Enabled only by
``python -m tests.upstream --legacy-tasks`` (``build_server(legacy_tasks=True)``): the default fixture is
unchanged. Registered on the low-level server, because FastMCP cannot declare ``execution.taskSupport``.

Two departures from the SDK's defaults, each with an ``sdk_default`` switch that restores the SDK's own
behaviour, follow the 2025-11-25 Tasks page (modelcontextprotocol.io/specification/2025-11-25/basic/utilities/tasks):
an ``isError`` result ends the task ``failed`` (the SDK would say ``completed``), and a raising tool makes
``tasks/result`` answer with a JSON-RPC error (the SDK answers an empty result). Two SDK defects that would
break a live session are worked around: task groups are kept per session (``_PerSessionTaskSupport``), and
tasks/cancel stops the work (``_stopped_by_cancel``). Must not import proxy/.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup
from mcp import types
from mcp.server.experimental.task_context import ServerTaskContext
from mcp.server.experimental.task_support import TaskSupport
from mcp.server.fastmcp import FastMCP
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import McpError
from mcp.shared.experimental.tasks.helpers import RELATED_TASK_METADATA_KEY, is_terminal
from mcp.shared.experimental.tasks.in_memory_task_store import InMemoryTaskStore
from mcp.shared.experimental.tasks.message_queue import InMemoryTaskMessageQueue

from tests.upstream.support import text_result

PREFIX = "legacy_task_"
RAISES_ERROR = types.ErrorData(code=types.INTERNAL_ERROR, message="legacy_task_raises: simulated failure")
PROGRESS_STEPS = 4
_CANCEL_POLL_SECONDS = 0.05

Work = Callable[[ServerTaskContext], Awaitable[types.CallToolResult]]

_session_group: ContextVar[TaskGroup | None] = ContextVar("_session_group", default=None)


class _PerSessionTaskSupport(TaskSupport):
    """TaskSupport whose background work runs in the task group of the session that created it.

    The SDK's ``TaskSupport.run()`` is entered once per session but stores its group in one shared slot:
    a second session overwrites it, and the first session to end sets it to None, after which
    ``run_task`` fails with "TaskSupport not running" in every other session still open.
    """

    @property
    def task_group(self) -> TaskGroup:
        group = _session_group.get()
        if group is None:
            raise RuntimeError("no session task group: run_task outside Server.run()")
        return group

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        async with anyio.create_task_group() as group:
            token = _session_group.set(group)
            try:
                yield
            finally:
                _session_group.reset(token)


@dataclass(frozen=True)
class _Spec:
    tool: types.Tool
    start: Callable[[dict[str, Any], types.ProgressToken | None], Work]
    inline: Callable[[dict[str, Any]], Awaitable[types.CallToolResult]] | None = None
    """How an ``optional`` tool answers a call without params.task."""


def _schema(**properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


_SECONDS = {"type": "number", "minimum": 0, "description": "How long the task works, in seconds"}
_SDK_DEFAULT = {
    "type": "boolean",
    "default": False,
    "description": "Keep the mcp 1.x SDK's own handling of this outcome instead of the 2025-11-25 rule",
}


def _tool(name: str, description: str, mode: types.TaskExecutionMode, schema: dict[str, Any]) -> types.Tool:
    return types.Tool(
        name=name,
        description=description,
        inputSchema=schema,
        execution=types.ToolExecution(taskSupport=mode),
    )


def _seconds(arguments: dict[str, Any], default: float) -> float:
    value = arguments.get("seconds", default)
    return max(0.0, float(value)) if isinstance(value, int | float) else default


async def _progress(task: ServerTaskContext, token: types.ProgressToken | None, step: int, total: int) -> None:
    """One step done: the task's statusMessage (``notifications/tasks/status``) and, when the call carried a
    progressToken, a ``notifications/progress`` tagged with the task (it goes out on the GET stream, since
    the request that created the task has been answered)."""
    await task.update_status(f"step {step}/{total}")
    if token is None:
        return
    params = types.ProgressNotificationParams(
        progressToken=token,
        progress=step,
        total=total,
        _meta={RELATED_TASK_METADATA_KEY: {"taskId": task.task_id}},
    )
    notification = types.ServerNotification(types.ProgressNotification(params=params))
    await task._session.send_notification(notification)


async def _work_for(task: ServerTaskContext, seconds: float, token: types.ProgressToken | None) -> None:
    """Work ``seconds`` in PROGRESS_STEPS steps, reporting each."""
    for step in range(1, PROGRESS_STEPS + 1):
        await anyio.sleep(seconds / PROGRESS_STEPS)
        await _progress(task, token, step, PROGRESS_STEPS)


async def _until_cancelled(task: ServerTaskContext) -> None:
    """Return once the task's record says cancelled (or is gone), with the context's copy refreshed.

    Polled: the SDK's store keeps one wake-up event per task, and a second waiter would take it from the
    tasks/result handler waiting on the same task.
    """
    while True:
        current = await task._store.get_task(task.task_id)
        if current is None or current.status == "cancelled":
            if current is not None:
                task._ctx._task = current
            return
        await anyio.sleep(_CANCEL_POLL_SECONDS)


def _stopped_by_cancel(work: Work) -> Work:
    """Run ``work`` until it ends or tasks/cancel marks the task cancelled, whichever comes first.

    The SDK's tasks/cancel only marks the record and leaves the work running. When such work later returns
    or raises, the SDK tries to complete or fail the cancelled task, the store refuses the transition, and
    that error escapes into the session's task group and ends the whole session (HTTP 404 on its next
    request). Stopping the work and refreshing the context's copy of the record avoids both.
    """

    async def run(task: ServerTaskContext) -> types.CallToolResult:
        outcome: list[types.CallToolResult] = []
        errors: list[Exception] = []
        cancelled = False

        async def do() -> None:
            try:
                outcome.append(await work(task))
            except Exception as exc:  # noqa: BLE001 - re-raised below, outside the group (no ExceptionGroup)
                errors.append(exc)
            group.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal cancelled
            await _until_cancelled(task)
            cancelled = True
            group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(do)
            group.start_soon(watch)
        if cancelled:
            return text_result("cancelled")  # never stored: the record is already terminal
        if errors:
            raise errors[0]
        return outcome[0]

    return run


def _required(arguments: dict[str, Any], token: types.ProgressToken | None) -> Work:
    seconds = _seconds(arguments, 1.0)

    async def work(task: ServerTaskContext) -> types.CallToolResult:
        await _work_for(task, seconds, token)
        return text_result(f"done after {seconds:g}s")

    return work


def _optional(arguments: dict[str, Any], token: types.ProgressToken | None) -> Work:
    seconds = _seconds(arguments, 1.0)

    async def work(task: ServerTaskContext) -> types.CallToolResult:
        await _work_for(task, seconds, token)
        return text_result("optional done")

    return work


async def _optional_inline(arguments: dict[str, Any]) -> types.CallToolResult:
    await anyio.sleep(_seconds(arguments, 1.0))
    return text_result("optional done")


def _elicit(arguments: dict[str, Any], token: types.ProgressToken | None) -> Work:
    async def work(task: ServerTaskContext) -> types.CallToolResult:
        # The SDK queues this request for the task: it reaches the client on a tasks/result stream,
        # tagged with related-task, and the task is input_required until the answer arrives.
        answer = await task.elicit(
            "What is your name?",
            {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        )
        name = answer.content.get("name") if answer.action == "accept" and answer.content else None
        return text_result(f"Hello, {name}!" if isinstance(name, str) else "declined")

    return work


def _tool_error(arguments: dict[str, Any], token: types.ProgressToken | None) -> Work:
    seconds = _seconds(arguments, 0.0)
    sdk_default = arguments.get("sdk_default") is True

    async def work(task: ServerTaskContext) -> types.CallToolResult:
        await anyio.sleep(seconds)
        result = text_result("tool failed", is_error=True)
        if not sdk_default:
            # 2025-11-25: a tool result with isError ends the task failed; tasks/result still returns it.
            await task._store.store_result(task.task_id, result)
            await task.fail("tool failed")
        return result  # with sdk_default the SDK stores it and marks the task completed

    return work


def _raises(arguments: dict[str, Any], token: types.ProgressToken | None) -> Work:
    seconds = _seconds(arguments, 0.0)
    sdk_default = arguments.get("sdk_default") is True

    async def work(task: ServerTaskContext) -> types.CallToolResult:
        await anyio.sleep(seconds)
        if not sdk_default:
            _FAILURES[task.task_id] = RAISES_ERROR
        raise McpError(RAISES_ERROR)  # the SDK marks the task failed with the message as statusMessage

    return work


_FAILURES: dict[str, types.ErrorData] = {}
"""JSON-RPC errors that tasks/result answers for failed tasks, by task id."""

SPECS: dict[str, _Spec] = {
    spec.tool.name: spec
    for spec in (
        _Spec(
            _tool(
                f"{PREFIX}required",
                "Task required: works `seconds` (default 1) reporting 4 progress steps, then 'done after {seconds}s'",
                "required",
                _schema(seconds=_SECONDS),
            ),
            _required,
        ),
        _Spec(
            _tool(
                f"{PREFIX}optional",
                "Task optional: works `seconds` (default 1), then 'optional done'; runs inline without params.task",
                "optional",
                _schema(seconds=_SECONDS),
            ),
            _optional,
            _optional_inline,
        ),
        _Spec(
            _tool(
                f"{PREFIX}elicit",
                "Task required: asks one form elicitation for `name` through tasks/result, then 'Hello, {name}!' "
                "or 'declined'",
                "required",
                _schema(),
            ),
            _elicit,
        ),
        _Spec(
            _tool(
                f"{PREFIX}tool_error",
                "Task required: after `seconds` (default 0) returns an isError result 'tool failed'; the task ends "
                "failed (completed with sdk_default)",
                "required",
                _schema(seconds=_SECONDS, sdk_default=_SDK_DEFAULT),
            ),
            _tool_error,
        ),
        _Spec(
            _tool(
                f"{PREFIX}raises",
                "Task required: after `seconds` (default 0) raises; the task ends failed and tasks/result answers "
                "a JSON-RPC error -32603 (an empty result with sdk_default)",
                "required",
                _schema(seconds=_SECONDS, sdk_default=_SDK_DEFAULT),
            ),
            _raises,
        ),
    )
}


def _install(low: Server[Any, Any]) -> None:
    inner_list = low.request_handlers[types.ListToolsRequest]
    inner_call = low.request_handlers[types.CallToolRequest]
    inner_result = low.request_handlers[types.GetTaskPayloadRequest]

    async def list_tools(req: types.ListToolsRequest) -> types.ServerResult:
        result = await inner_list(req)
        assert isinstance(result.root, types.ListToolsResult)
        result.root.tools.extend(spec.tool for spec in SPECS.values())
        return result

    async def call_tool(req: types.CallToolRequest) -> types.ServerResult:
        spec = SPECS.get(req.params.name)
        if spec is None:
            return await inner_call(req)
        ctx = low.request_context
        arguments = req.params.arguments or {}
        mode = spec.tool.execution.taskSupport if spec.tool.execution else None
        ctx.experimental.validate_task_mode(mode)  # -32601 for a required tool called without params.task
        if not ctx.experimental.is_task:
            assert spec.inline is not None  # validate_task_mode let through an optional tool only
            return types.ServerResult(await spec.inline(arguments))
        token = ctx.meta.progressToken if ctx.meta else None
        return types.ServerResult(await ctx.experimental.run_task(_stopped_by_cancel(spec.start(arguments, token))))

    async def task_result(req: types.GetTaskPayloadRequest) -> types.ServerResult:
        result = await inner_result(req)  # the SDK's: delivers queued requests, blocks until terminal
        error = _FAILURES.get(req.params.taskId)
        if error is not None:
            raise McpError(error)
        return result

    low.request_handlers[types.ListToolsRequest] = list_tools
    low.request_handlers[types.CallToolRequest] = call_tool
    low.request_handlers[types.GetTaskPayloadRequest] = task_result


class _TaskStore(InMemoryTaskStore):
    """The SDK's in-memory store, without its lost wake-up. Its tasks/result reads the task, sends what is
    queued (which yields), and only then creates the event it waits on; a task that ended in between is never
    announced again, and tasks/result hung until the client's tasks/get. A finished task is not waited for."""

    async def wait_for_update(self, task_id: str) -> None:
        task = await self.get_task(task_id)  # no suspension point from here to the event's creation
        if task is not None and is_terminal(task.status):
            return
        await super().wait_for_update(task_id)


def enable(mcp: FastMCP[Any]) -> None:
    """Turn on the SDK's experimental Tasks on ``mcp`` and add the ``legacy_task_*`` tools."""
    low = mcp._mcp_server
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # mcp 1.x marks the experimental tasks API deprecated
        experimental = low.experimental
    support = experimental.enable_tasks(store=_TaskStore(), queue=InMemoryTaskMessageQueue())
    support.__class__ = _PerSessionTaskSupport  # same fields; only where the session's work runs differs
    _install(low)
