"""The waiting client's side of a call: start or resume it for one request, wait for its reply, and turn the
reply into the request's JSON-RPC answer.

What the reply is (the result, a `CreateTaskResult`, an MRTR `InputRequiredResult`, -32021, a limit error) is
decided by the call's machine (`machine.py`) and carried out by the executor; this module only waits and
translates (a task reply carries its record). A request that goes away while waiting tells the call so. A
poll-to-sync client's keep-alive comments are asked of the call's one client writer (`keep_alive`, injected:
`effects/client.py`), never written here. Imports the call starter and the upstream request; no aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from mcp_types import SERVER_INFO_META_KEY

from proxy.errors import InvalidParamsError, MissingCapabilityError, ProxyError
from proxy.policy import SYNC_CALL, Decision, Outcome
from proxy.tasks import inputs
from proxy.tasks.commands import ReplyError, ReplyInputRequired, ReplyKind, ReplyMissing, ReplyOutcome, ReplyTask
from proxy.tasks.live_call import LiveCall
from proxy.tasks.request import UpstreamRequest
from proxy.tasks.starting import CallStarter
from proxy.upstream.events import UpstreamErrorResponse, UpstreamResult
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.envelope import TASKS_EXTENSION, Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON, result_message

KEEPALIVE_SECONDS: Final = 15.0  # SSE comment while a poll-to-sync client waits for its internal task


class WaitingRequests:
    def __init__(self, starter: CallStarter, keep_alive: Callable[[LiveCall], None], cache: tuple[int, str]) -> None:
        self.starter = starter
        self.keep_alive = keep_alive  # queues a keep-alive comment for the call's client writer
        self.cache = cache

    async def call(
        self,
        outgoing: UpstreamRequest,
        caller: Caller,
        channel: Channel,
        decision: Decision | None,
        server_info: JSON | None,
    ) -> JSON:
        """A fresh call: `decision` is the tool's (tools/call) or None (prompts/get, resources/read)."""
        request = outgoing.request
        decision = decision if decision is not None else SYNC_CALL
        if decision.outcome is Outcome.REJECT:
            raise MissingCapabilityError(
                wire_tasks.REQUIRED_CAPABILITY,
                f"Missing required client capability: tool {request.params.get('name')!r} runs only as a task; "
                f"declare the {TASKS_EXTENSION} extension",
            )
        call = await self.starter.begin(outgoing, caller, decision, channel)
        return await self._answer(call, request, server_info)

    async def resume(
        self, outgoing: UpstreamRequest, caller: Caller, channel: Channel, server_info: JSON | None
    ) -> JSON:
        """An MRTR retry with `inputResponses` and the `requestState` of the round it answers."""
        request = outgoing.request
        responses = request.params.get("inputResponses")
        if responses is None:
            responses = {}
        if not isinstance(responses, dict):
            raise InvalidParamsError("Invalid params: inputResponses must be an object")
        call = await self.starter.resume(outgoing, caller, responses, channel)
        return await self._answer(call, request, server_info)

    async def _answer(self, call: LiveCall, request: ModernRequest, server_info: JSON | None) -> JSON:
        assert call.client.reply is not None
        try:
            reply = await self._wait(call, call.client.reply)
        except BaseException:
            self.starter.client_left(call)  # the request went away while waiting: the call is told
            raise
        return self._message(reply, call, request, server_info)

    async def _wait(self, call: LiveCall, reply: asyncio.Future[ReplyKind]) -> ReplyKind:
        """The reply, with SSE keep-alive comments meanwhile for a poll-to-sync client (it may wait long): each
        goes through the call's client writer, behind the notifications it still writes."""
        if not call.state.decision.holds_client:
            return await reply
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(reply), KEEPALIVE_SECONDS)
            except TimeoutError:
                self.keep_alive(call)

    def _message(self, reply: ReplyKind, call: LiveCall, request: ModernRequest, server_info: JSON | None) -> JSON:
        if isinstance(reply, ReplyOutcome):
            outcome = reply.outcome
            if isinstance(outcome, ProxyError):
                raise outcome
            result = outcome.result if isinstance(outcome, UpstreamResult) else None
            error = outcome.error if isinstance(outcome, UpstreamErrorResponse) else None
            return translate.final_message(request.id, request.method, result, error, server_info, self.cache)
        if isinstance(reply, ReplyTask):
            # No requestState or inputRequests on a CreateTaskResult, even after MRTR rounds.
            assert reply.record is not None
            return result_message(request.id, wire_tasks.create_task_result(reply.record, server_info))
        if isinstance(reply, ReplyInputRequired):
            result = inputs.input_required_result(reply.input_requests, call.request_state)
            if server_info:
                result["_meta"] = {SERVER_INFO_META_KEY: server_info}
            return result_message(request.id, result)
        if isinstance(reply, ReplyMissing):
            raise MissingCapabilityError(
                reply.required,
                f"Missing required client capability: the upstream asked for {', '.join(sorted(reply.required))} "
                f"during {request.method}",
            )
        assert isinstance(reply, ReplyError)
        raise reply.error
