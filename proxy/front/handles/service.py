"""Task handles served, in either era: a `handle` call held up to `handles.hold_ms` (its result, or a handle to
the task it became), and the synthesised task tools, which read, wait for, cancel and answer the caller's own
tasks through the task operations. Answers are legacy results or, for a 2026-07-28 client, translated ones.
Imports the tasks' facade and push watchers, the policy and the wire; no aiohttp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Final

import structlog

from proxy.config.schema import Config
from proxy.errors import InvalidParamsError, ProxyError, RequestId, UpstreamError
from proxy.front.handles import tools
from proxy.policy import Decision
from proxy.tasks.live_call import UpstreamRequest
from proxy.tasks.machine.commands import ReplyError, ReplyOutcome, ReplyTask
from proxy.tasks.runner import Tasks
from proxy.tasks.services.push import ListenInbox, TaskWatchers
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import read_tools
from proxy.wire import translate
from proxy.wire.envelope import Caller, Channel
from proxy.wire.jsonrpc import JSON, error_message, result_message
from proxy.wire.tasks import TaskRecord
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult

log = structlog.get_logger(__name__)

WARM_SECONDS: Final = 8.0  # a `task_result` wait sends progress at least this often to a client that asked


@dataclass(eq=False, slots=True)
class Handles:
    """Each request brings the config its front read once for it."""

    tasks: Tasks
    watchers: TaskWatchers

    async def call(
        self,
        outgoing: UpstreamRequest,
        caller: Caller,
        channel: Channel,
        decision: Decision,
        server_info: JSON | None,
        config: Config,
        *,
        modern: bool,
        arrived: float,
    ) -> JSON:
        """A `handle` call: its own answer when it ends within the hold, else the handle of the task it became
        (committed before the answer leaves, as any task). The hold counts from the request's arrival
        (`arrived`, `time.monotonic()`), what it took to learn of the tool first included."""
        request_id = outgoing.request.id
        hold_ms = decision.hold_ms
        left_ms = max(0, round(hold_ms - (time.monotonic() - arrived) * 1000))
        reply = await self.tasks.reply(outgoing, caller, channel, replace(decision, hold_ms=left_ms), config)
        if isinstance(reply, ReplyTask):
            assert reply.record is not None
            log.info("task_handle_given", tool=outgoing.name, task_id=reply.record.task_id)
            result = tools.handle_result(reply.record, tools.names(config.handles.tool_prefix), hold_ms)
            return result_message(request_id, _era(result, modern, server_info))
        if isinstance(reply, ReplyOutcome):
            outcome = reply.outcome
            if isinstance(outcome, ProxyError):
                raise outcome
            answer = outcome.result if isinstance(outcome, UpstreamResult) else None
            error = outcome.error if isinstance(outcome, UpstreamErrorResponse) else None
            if modern:
                return translate.final_message(request_id, "tools/call", answer, error, server_info, None)
            return error_message(request_id, error) if error is not None else result_message(request_id, answer or {})
        if isinstance(reply, ReplyError):
            raise reply.error
        raise ProxyError(f"Internal error: a handle call was answered {type(reply).__name__}")  # pragma: no cover

    async def tool(
        self,
        request_id: RequestId,
        base: str,
        arguments: Any,
        caller: Caller,
        channel: Channel,
        progress_token: str | int | None,
        server_info: JSON | None,
        config: Config,
        *,
        modern: bool,
    ) -> JSON:
        """One call of a synthesised tool (`base` is its name without the prefix), answered as a tool result:
        the caller's own task, or the one "no such task" answer for any id that is not (malformed, made up,
        expired, another caller's), decided before anything of the task shows."""
        task_id = tools.task_id_of(arguments)
        if task_id is None:
            result = tools.no_such_task()
        else:
            try:
                result = await self._serve(base, task_id, arguments, caller, channel, progress_token, config)
            except _NoSuchTask:
                result = tools.no_such_task()
        return result_message(request_id, _era(result, modern, server_info))

    async def _serve(
        self,
        base: str,
        task_id: str,
        arguments: Any,
        caller: Caller,
        channel: Channel,
        progress_token: str | int | None,
        config: Config,
    ) -> JSON:
        names = tools.names(config.handles.tool_prefix)
        if base == tools.STATUS:
            return tools.status_result(await self._observe(task_id, caller), names)
        if base == tools.RESULT:
            hold_ms = config.handles.hold_ms
            wait = tools.wait_seconds_of(arguments, hold_ms)
            if wait is None:
                return tools.bad_arguments(f"{names.result}: wait_seconds must be a number of seconds")
            record = await self._settled(task_id, caller, wait, channel, progress_token)
            return tools.outcome_result(record) if record.status.terminal else tools.still_working(record, names)
        if base == tools.CANCEL:
            try:
                await self.tasks.cancel(task_id, caller)
            except InvalidParamsError:
                raise _NoSuchTask() from None
            return tools.cancel_result(await self._observe(task_id, caller))
        responses = arguments.get("inputResponses")
        if not isinstance(responses, dict):
            await self._observe(task_id, caller)  # an unknown id says so first, whatever else is wrong
            return tools.bad_arguments(f"{names.respond}: inputResponses must be an object of answers by key")
        record = await self._observe(task_id, caller)
        answered = [key for key in responses if key in record.input_requests]
        try:
            await self.tasks.update(task_id, caller, responses)
        except InvalidParamsError as exc:  # an answer that does not fit its question (the caller's own task)
            return tools.bad_arguments(exc.message)
        return tools.respond_result(record, answered if not record.status.terminal else [], names)

    async def _observe(self, task_id: str, caller: Caller) -> TaskRecord:
        try:
            return await self.tasks.get(task_id, caller)
        except InvalidParamsError:
            raise _NoSuchTask() from None

    async def _settled(
        self, task_id: str, caller: Caller, wait_seconds: float, channel: Channel, progress_token: str | int | None
    ) -> TaskRecord:
        """The task once it has settled, or as it is after `wait_seconds`: woken by the store's feed (any
        replica's writes), read again at each change. A client that sent a `progressToken` hears progress at
        least every WARM_SECONDS meanwhile."""
        record = await self._observe(task_id, caller)
        if record.status.terminal or wait_seconds <= 0:
            return record
        inbox = ListenInbox()
        self.watchers.follow(inbox, [task_id])
        deadline = time.monotonic() + wait_seconds
        warmed = 0
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return record
                slice_seconds = min(remaining, WARM_SECONDS) if progress_token is not None else remaining
                if not await inbox.wait(slice_seconds):
                    if progress_token is not None and deadline - time.monotonic() > 0:
                        warmed += 1
                        await _progress(channel, progress_token, warmed)
                    continue
                inbox.changed.clear()
                record = await self._observe(task_id, caller)
                if record.status.terminal:
                    return record
        finally:
            self.watchers.drop(inbox)


class ToolNameTakenError(Exception):
    """A synthesised tool's name is one the upstream lists too: the start stops, naming both."""


async def check_tool_names(pool: SessionPool, tool_names: tools.ToolNames) -> None:
    """At start, with some policy saying `handle`: the upstream's tool list is read once, and a synthesised
    tool's name it lists too stops the start (ToolNameTakenError). An upstream that cannot be asked now (down,
    or it wants the caller's credentials) is only logged: the lists served later leave such a tool out."""
    try:
        async with pool.use(None) as session:
            listed, _ = await read_tools(session)
    except UpstreamError as exc:
        log.warning("task_tool_names_unchecked", error=exc.message)
        return
    taken = [name for name in tool_names.all if name in listed]
    if taken:
        raise ToolNameTakenError(
            f"the upstream lists a tool named {', '.join(repr(name) for name in taken)}, the name of the proxy's "
            f"synthesised task tool{'s' if len(taken) > 1 else ''} {', '.join(repr(name) for name in taken)} "
            f"(handles.tool_prefix is {tool_names.prefix!r}): set handles.tool_prefix, e.g. 'proxy_'"
        )


class _NoSuchTask(Exception):
    """The id names no task of the caller's (unknown, another caller's, expired): answered as "no such task"."""


async def _progress(channel: Channel, token: str | int, count: int) -> None:
    """Progress on the waiting request's stream (a client that left makes this raise ConnectionResetError,
    which ends the wait)."""
    params = {"progressToken": token, "progress": count, "message": "waiting for the task"}
    await channel.notify({"jsonrpc": "2.0", "method": "notifications/progress", "params": params})


def _era(result: JSON, modern: bool, server_info: JSON | None) -> JSON:
    """A tool result as the client's era has it: as it is for a legacy client, with `resultType` (and the
    server's identity) for a 2026-07-28 one."""
    return translate.complete_result("tools/call", result, server_info, None) if modern else result
