"""The 2026-07-28 dispatcher: a validated modern request → the handler for its method → one final message.

Owns the method table, forwarding through the proxy's upstream sessions and the translation of what comes
back. It talks to the client only through `Channel` (notifications before the final message) and never
imports aiohttp: the HTTP shapes are `app.py`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import structlog
from mcp_types import jsonrpc as codes

from proxy.config.schema import Config
from proxy.errors import (
    InvalidParamsError,
    MethodNotFoundError,
    MissingCapabilityError,
    ProxyError,
    UpstreamError,
    UpstreamLimitError,
)
from proxy.events.service import Events
from proxy.front.handles import tools as handle_tools
from proxy.front.handles.service import Handles
from proxy.front.listen import ListenStreams
from proxy.policy import Outcome, decide, decide_job, policy_for
from proxy.tasks.live_call import UpstreamRequest
from proxy.tasks.machine.inputs import could_answer
from proxy.tasks.runner import Tasks
from proxy.tasks.services import idempotency
from proxy.tasks.services.push import TaskWatchers
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import RequestStream, Session
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.envelope import (
    Caller,
    Channel,
    ModernRequest,
    check_param_headers,
    known_core_method,
    validate_params,
)
from proxy.wire.jsonrpc import JSON, error_message, result_message
from proxy.wire.upstream_events import (
    UpstreamErrorResponse,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
    refusal,
)

log = structlog.get_logger(__name__)

LISTEN_KEEPALIVE_SECONDS: Final = 15.0  # SSE comment on idle listen streams, so intermediaries keep them open

Handler = Callable[["Front", ModernRequest, Caller, Channel], Awaitable[JSON]]


class Front:
    def __init__(
        self,
        current: Callable[[], Config],
        pool: SessionPool,
        tasks: Tasks,
        watchers: TaskWatchers,
        events: Events | None = None,
        new_work_refusal: Callable[[], ProxyError | None] = lambda: None,
    ) -> None:
        self._current = current  # the config in force, read once per request (a live reload swaps what it returns)
        config = current()  # what only a restart changes is bound here
        self.pool = pool
        self.tasks = tasks
        self.events = events  # the Events extension, when `events.enabled`
        # Why new work may not start now, asked before a new call or listen stream opens anything (the edge's
        # descriptor budget); None: it may.
        self.new_work_refusal = new_work_refusal
        self.cache = (config.discovery.cache_ttl_ms, config.discovery.cache_scope)
        self.listens = ListenStreams(lambda: current().limits, pool, tasks, watchers)
        self.handles = Handles(tasks, watchers)

    @property
    def config(self) -> Config:
        return self._current()

    async def dispatch(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        """Serve one modern request; returns the JSON-RPC response message (result or error)."""
        handler = METHODS.get(request.method)
        if handler is None:
            # Unknown and removed methods (initialize, ping, tasks/list, …) → HTTP 404 + -32601.
            raise MethodNotFoundError(f"Method not found: {request.method}")
        if known_core_method(request.method, request.protocol_version):
            validate_params(request)
        return await handler(self, request, caller, channel)

    async def discover(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        """Synthesized from the upstream's InitializeResult, reused for as long as clients may cache it."""
        initialize_result = await self.pool.facts.initialize_result(caller.principal, self.cache[0])
        result = translate.discover_result(initialize_result, self.cache)
        if self.events is not None:
            self.events.advertise(result["capabilities"])
        return result_message(request.id, result)

    async def listen(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        self._refuse_new_work()
        return await self.listens.serve(request, caller, channel)

    def _events(self, request: ModernRequest) -> Events:
        """The Events extension; a server that does not offer it answers `events/*` with -32601."""
        if self.events is None:
            raise MethodNotFoundError(f"Method not found: {request.method}")
        return self.events

    async def events_list(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        return await self._events(request).list(request, caller)

    async def events_poll(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        return await self._events(request).poll(request, caller)

    async def events_stream(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        return await self._events(request).stream(request, caller, channel)

    async def events_subscribe(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        return await self._events(request).subscribe(request, caller)

    async def events_unsubscribe(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        return await self._events(request).unsubscribe(request, caller)

    def _refuse_new_work(self) -> None:
        """New work (a call or a listen stream, not an MRTR retry) is refused before it opens anything when the
        descriptors left would not carry it: 503 with `Retry-After`."""
        if (refused := self.new_work_refusal()) is not None:
            raise refused

    def _refuse_without_session(
        self, request: ModernRequest, caller: Caller, outgoing: UpstreamRequest, *, job: bool
    ) -> None:
        """A new call is refused at its start when the upstream session it needs cannot be had now
        (`upstream.max_open_sessions`): 503 with `Retry-After`, never a task that fails later."""
        if self.pool.surely_room():  # (most calls: nothing more to work out)
            return
        asks = not job and could_answer(request.client_capabilities)  # a job's calls run on the shared session
        if not self.pool.room_for(caller.principal, asks=asks, asker=f"{outgoing.method} {outgoing.name}"):
            limits = self.pool.limits
            assert limits.max_open is not None
            log.warning("upstream_limit_reached", limit=limits.limit_name, max=limits.max_open)
            raise UpstreamLimitError(limits.limit_name, limits.max_open, 0)

    async def admit_legacy_call(
        self, request: ModernRequest, caller: Caller, outgoing: UpstreamRequest, config: Config
    ) -> None:
        """A legacy client's `handle` call, run as a call of the proxy's own (`edge/_legacy_handles.py`), passes
        what a fresh modern tools/call passes before it starts: the descriptor budget, the caller's quotas
        (`limits.calls_per_minute_per_principal`, the tool's own) and the upstream session cap."""
        self._refuse_new_work()
        per_minute, tool_quotas = config.limits.calls_per_minute_per_principal, config.tasks.has_tool_quotas
        if per_minute or tool_quotas:
            tool = outgoing.name
            await self.tasks.charge(caller, per_minute, tool, policy_for(config.tasks, tool) if tool_quotas else None)
        self._refuse_without_session(request, caller, outgoing, job=False)

    async def call_tool(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        """The tool's policy and this request's own declaration of the Tasks extension decide sync, task, window
        or -32021 (a task only ever goes to a request that declared the extension). Every tools/call runs as a
        runner call, so an upstream question can become an MRTR round or a task's inputRequests. A caller past
        its quota, or its quota for the tool, is refused first (an MRTR retry is the same call, not counted
        again). With an `Idempotency-Key` (not on an MRTR retry, which its requestState binds already) the key's
        record decides whether it runs (`tasks/services/idempotency.py`)."""
        config = self.config  # once: the whole request decides with one config, whatever a reload swaps meanwhile
        arrived = time.monotonic() if config.tasks.has_handles else 0.0  # a handle's hold counts from here
        if config.tasks.has_handles and not request.declares_tasks:
            base = handle_tools.names(config.handles.tool_prefix).base_of(request.params.get("name"))
            if base is not None:  # a synthesised task tool: the proxy answers it
                arguments = request.params.get("arguments")
                progress_token = request.progress_token
                return await self.handles.tool(
                    request.id,
                    base,
                    arguments,
                    caller,
                    channel,
                    progress_token,
                    self.pool.server_info,
                    config,
                    modern=True,
                )
        fresh = "requestState" not in request.params
        if fresh:
            self._refuse_new_work()
        per_minute, tool_quotas = config.limits.calls_per_minute_per_principal, config.tasks.has_tool_quotas
        if (per_minute or tool_quotas) and fresh:
            tool = str(request.params.get("name"))
            await self.tasks.charge(caller, per_minute, tool, policy_for(config.tasks, tool) if tool_quotas else None)
        outgoing = UpstreamRequest.of(request, caller)
        facts = await self.pool.facts.tool_facts(caller.principal, outgoing.name, self.cache[0])
        check_param_headers(caller.headers, request.params.get("arguments"), facts.param_headers)
        server_info = translate.implementation(facts.initialize_result)
        if not fresh:
            return await self.tasks.resume(outgoing, caller, channel, server_info, config)
        job = outgoing.name in config.jobs
        self._refuse_without_session(request, caller, outgoing, job=job)
        if job:  # a legacy job family's start tool: a task the proxy follows
            decision = decide_job(config.tasks, outgoing.name, declares_tasks=request.declares_tasks)
        else:
            decision = decide(
                config.tasks,
                outgoing.name,
                declares_tasks=request.declares_tasks,
                upstream_support=facts.task_support,
                hold_ms=config.handles.hold_ms,
            )

        def start(channel: Channel, task_id: str | None = None) -> Awaitable[JSON]:
            if decision.handle:  # held, then a handle: a client without the Tasks extension reads it by tools
                return self.handles.call(
                    outgoing, caller, channel, decision, server_info, config, modern=True, arrived=arrived
                )
            return self.tasks.call(outgoing, caller, channel, decision, server_info, config, task_id)

        key = caller.headers.get(idempotency.HEADER)  # without one, nothing more is done than this lookup
        if key is None or not config.idempotency.enabled:
            return await start(channel)
        # A call whose task record comes before its upstream request gets its task id now: its claim names it,
        # so a repeat after its process died knows whether the upstream could have seen it.
        task_id = wire_tasks.new_task_id() if decision.outcome is Outcome.TASK and not decision.upstream_task else None
        return await self.tasks.keyed(
            config.idempotency,
            key,
            request,
            caller,
            channel,
            lambda keyed: start(keyed, task_id),
            task_id=task_id,
            server_info=server_info,
        )

    async def input_capable(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        """`prompts/get` and `resources/read`: synchronous, but an upstream question is an MRTR round (the only
        methods besides tools/call that may answer `input_required`)."""
        fresh = "requestState" not in request.params
        if fresh:
            self._refuse_new_work()
        initialize_result = await self.pool.facts.initialize_result(caller.principal, self.cache[0])
        server_info = translate.implementation(initialize_result)
        outgoing = UpstreamRequest.of(request, caller)
        config = self.config
        if not fresh:
            return await self.tasks.resume(outgoing, caller, channel, server_info, config)
        self._refuse_without_session(request, caller, outgoing, job=False)
        return await self.tasks.call(outgoing, caller, channel, None, server_info, config)

    async def list_tools(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        """The upstream's tools, less the helpers of job families with `hide_helpers` (the proxy drives them); for
        a client without the Tasks extension while some policy says `handle`, as `handles/tools.py` lists them
        (the synthesised task tools on the last page)."""
        message = await self.forward(request, caller, channel)
        config = self.config
        if config.tasks.has_handles and not request.declares_tasks and isinstance(message.get("result"), dict):
            names = handle_tools.names(config.handles.tool_prefix)
            listed, clashes = handle_tools.listed(message["result"], config.tasks, names, config.handles.hold_ms)
            if clashes:
                log.warning("task_tool_name_taken", tools=clashes, detail="the upstream lists a tool of that name")
            message = {**message, "result": listed}
        jobs = config.jobs
        if not jobs:
            return message
        hidden = frozenset().union(*(job.helpers() for job in jobs.values() if job.hide_helpers))
        result = message.get("result")
        if hidden and isinstance(result, dict) and isinstance(result.get("tools"), list):
            tools = [tool for tool in result["tools"] if not (isinstance(tool, dict) and tool.get("name") in hidden)]
            message = {**message, "result": {**result, "tools": tools}}
        return message

    def _task_id(self, request: ModernRequest) -> str:
        """A client that did not declare the Tasks extension gets -32021 first (even for an unknown id), then
        the params are checked."""
        if not request.declares_tasks:
            raise MissingCapabilityError(
                wire_tasks.REQUIRED_CAPABILITY,
                f"Missing required client capability: {request.method} needs the io.modelcontextprotocol/tasks "
                "extension",
            )
        task_id = request.params.get("taskId")
        if not isinstance(task_id, str):
            raise InvalidParamsError("Invalid params: taskId must be a string")
        return task_id

    async def task_get(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        record = await self.tasks.get(self._task_id(request), caller)
        return result_message(request.id, wire_tasks.get_task_result(record, self.pool.server_info))

    async def task_update(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        """Answers go upstream and the client gets an empty ack; keys that are not outstanding are ignored, and a
        partial answer leaves the task `input_required` until the rest arrive."""
        task_id = self._task_id(request)
        responses = request.params.get("inputResponses")
        if not isinstance(responses, dict):
            raise InvalidParamsError("Invalid params: inputResponses must be an object")
        await self.tasks.update(task_id, caller, responses)
        return result_message(request.id, wire_tasks.ack_result(self.pool.server_info))

    async def task_cancel(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        await self.tasks.cancel(self._task_id(request), caller)
        return result_message(request.id, wire_tasks.ack_result(self.pool.server_info))

    async def forward(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        """Relay one request through the principal's shared upstream session and translate the outcome."""
        outgoing = UpstreamRequest.of(request, caller)
        async with (
            self.pool.use(caller.principal) as session,
            session.call(outgoing.method, outgoing.params, outgoing.headers) as call,
        ):
            try:
                return await self._drive(request, session, call, channel)
            except (asyncio.CancelledError, ConnectionResetError):
                # The client closed its stream (seen as the handler's cancellation, or as a failed write of a
                # notification); a legacy server needs an explicit cancel.
                await asyncio.shield(self._cancel(call, "client disconnected"))
                raise

    async def _drive(self, request: ModernRequest, session: Session, call: RequestStream, channel: Channel) -> JSON:
        server_info = self.pool.server_info
        if (final := call.answered()) is not None:  # a plain JSON answer, in already: no stream to read
            result = final.result if isinstance(final, UpstreamResult) else None
            error = final.error if isinstance(final, UpstreamErrorResponse) else None
            return translate.final_message(request.id, request.method, result, error, server_info, self.cache)
        async for event in call.events():
            if isinstance(event, UpstreamNotification):
                relayed = translate.relay_notification(event.message, request.progress_token, request.log_level)
                if relayed is not None:
                    await channel.notify(relayed)
            elif isinstance(event, UpstreamServerRequest):
                refused = await self._refuse(request, session, event)
                if refused is not None:
                    return refused
            else:
                result = event.result if isinstance(event, UpstreamResult) else None
                error = event.error if isinstance(event, UpstreamErrorResponse) else None
                return translate.final_message(request.id, request.method, result, error, server_info, self.cache)
        raise AssertionError("RequestStream.events() ends with a final event or raises")  # pragma: no cover

    async def _refuse(self, request: ModernRequest, session: Session, question: UpstreamServerRequest) -> JSON | None:
        """Only tools/call, prompts/get and resources/read may ask a 2026-07-28 client for input (as MRTR or a
        task); those run as calls of the runner. Here (any other method) the upstream gets an answer at once,
        so it never hangs, and finishes the request by itself: a client that did not declare the capability
        gets -32021 naming it; one that did gets -32603 saying the method cannot ask. No
        notifications/cancelled: a cancel racing that ending kills the whole session in the mcp 1.x SDK.
        Returns the request's answer, or None to read on (the upstream's request was not a question)."""
        result, error = refusal(question.method)
        await session.respond(question.id, result=result, error=error)
        if question.method not in translate.INPUT_METHODS:
            return None
        log.info("upstream_input_request_refused", method=request.method, input_method=question.method)
        required = translate.required_capability(question.method, question.params)
        if not all(request.declares(capability) for capability in required):
            raise MissingCapabilityError(
                required,
                f"Missing required client capability: the upstream asked for {question.method} during {request.method}",
            )
        message = (
            f"The upstream asked for {question.method} during {request.method}, which cannot ask the client for "
            "input in protocol 2026-07-28"
        )
        return error_message(request.id, {"code": codes.INTERNAL_ERROR, "message": message})

    async def _cancel(self, call: RequestStream, reason: str) -> None:
        try:
            await call.cancel(reason)
        except UpstreamError as exc:  # best effort: the call is being abandoned either way
            log.warning("upstream_cancel_failed", error=str(exc))


METHODS: Final[Mapping[str, Handler]] = {
    "server/discover": Front.discover,
    "tools/list": Front.list_tools,
    "tools/call": Front.call_tool,
    "prompts/list": Front.forward,
    "prompts/get": Front.input_capable,
    "resources/list": Front.forward,
    "resources/templates/list": Front.forward,
    "resources/read": Front.input_capable,
    "completion/complete": Front.forward,
    "subscriptions/listen": Front.listen,
    # The Tasks extension (SEP-2663); tasks/result and tasks/list were removed with it: 404 + -32601.
    "tasks/get": Front.task_get,
    "tasks/update": Front.task_update,
    "tasks/cancel": Front.task_cancel,
    # The Events extension (SEP-3415), when `events.enabled`; else -32601 as for any unknown method.
    "events/list": Front.events_list,
    "events/poll": Front.events_poll,
    "events/stream": Front.events_stream,
    "events/subscribe": Front.events_subscribe,
    "events/unsubscribe": Front.events_unsubscribe,
}
