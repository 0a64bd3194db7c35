"""Starting and resuming calls for waiting requests: a new call from the front's upstream request, an MRTR
retry that takes the call parked for its round (here, or forwarded to the live replica that holds it, with a
stand-in call here whose reply is that replica's answer), a waiting request that went away, and every call
stopped at shutdown. Imports the table, the parking, the replica link and `remote.py`; no other effect.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import structlog

from proxy.config import InputsConfig, TasksConfig
from proxy.errors import InvalidParamsError, ProxyError
from proxy.policy import SYNC_CALL, Decision, decide
from proxy.tasks import inputs, remote
from proxy.tasks.commands import ClientLeft, ReplyError, ReplyTask, Resumed, ShutDown, Start
from proxy.tasks.context import TasksContext
from proxy.tasks.effects.slots import Parking
from proxy.tasks.live_call import LiveCall, known, new_call
from proxy.tasks.replicas import Ask, ReplicaLink
from proxy.tasks.request import UpstreamRequest
from proxy.tasks.state import CallState
from proxy.tasks.store import StoreError
from proxy.wire.envelope import Caller, Channel
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

SHUTTING_DOWN: Final = "the proxy is shutting down"
STORE_FAILED: Final = "Internal error: the task store failed"
HOLDER_GONE: Final = (
    "Invalid params: requestState belongs to a call held by another proxy process, which is not running; "
    "send the request again without it"
)


@dataclass(eq=False, slots=True)
class CallStarter:
    context: TasksContext
    config: Callable[[], TasksConfig]  # read at each call: a live reload swaps what these return
    inputs_config: Callable[[], InputsConfig]
    parking: Parking
    replicas: ReplicaLink
    notes: Callable[[LiveCall, JSON], Awaitable[None]]  # through the call's one client writer (`effects/client.py`)
    _progress_tokens: int = field(default=0, init=False)

    def state(
        self, decision: Decision, capabilities: JSON, progress_token: str | int | None, log_level: str | None
    ) -> CallState:
        inputs_config = self.inputs_config()
        return CallState(
            decision=decision,
            capabilities=capabilities,
            gather_ms=inputs_config.gather_ms,
            park_ttl_ms=inputs_config.request_state_ttl_ms,
            progress_token=progress_token,
            log_level=log_level,
        )

    async def begin(self, outgoing: UpstreamRequest, caller: Caller, decision: Decision, channel: Channel) -> LiveCall:
        """A new call for a waiting request; its reply arrives on `call.client.reply`."""
        params = outgoing.params
        if decision.may_become_task:
            meta = dict(params.get("_meta") or {})
            if "progressToken" not in meta:
                # Ask the upstream for progress even when the client did not: it becomes the statusMessage.
                self._progress_tokens += 1
                meta["progressToken"] = f"mcp-tasks-proxy-{self._progress_tokens}"
            params = {**params, "_meta": meta}
        request = outgoing.request
        state = self.state(decision, request.client_capabilities, request.progress_token, request.log_level)
        call = new_call(
            state,
            method=outgoing.method,
            name=outgoing.name,
            principal=caller.principal,
            caller=self.context.principals.key_of(caller.principal),
            params=params,
            headers=outgoing.headers,
            digest_of=lambda: outgoing.digest,
            channel=channel,
        )
        call.client.reply = asyncio.get_running_loop().create_future()
        self.context.table.add(call)
        await self.context.feed.submit(call, Start())
        return call

    async def resume(
        self, outgoing: UpstreamRequest, caller: Caller, responses: Mapping[str, Any], channel: Channel
    ) -> LiveCall:
        """An MRTR retry: the `requestState` must be genuine, unexpired, the caller's, for this method and
        these params, and name a call parked for this round (here, or on the live replica that issued it: the
        retry is forwarded there); its answers must fit the questions. Else -32602, and the call stays parked
        for a corrected retry."""
        request = outgoing.request
        state = request.params.get("requestState")
        if not isinstance(state, str):
            raise InvalidParamsError("Invalid params: requestState must be a string")
        claims = self.parking.signer.verify(state, self.parking.clock())
        if (
            claims.principal != self.context.principals.key_of(caller.principal)
            or claims.method != request.method
            or claims.digest != outgoing.digest
        ):
            raise InvalidParamsError("Invalid params: requestState was issued for another request")
        if claims.owner != self.parking.process_id:
            return await self._forward(outgoing, caller, claims, state, responses, channel)
        call, answers = self.parking.take(claims, responses)
        call.client.reply = asyncio.get_running_loop().create_future()
        call.client.channel = channel
        log.info("mrtr_resumed", method=call.method, name=call.name, round=call.state.round, answered=sorted(answers))
        await self.context.feed.submit(call, Resumed(answers, request.progress_token, request.log_level))
        return call

    async def _forward(
        self,
        outgoing: UpstreamRequest,
        caller: Caller,
        claims: inputs.StateClaims,
        state: str,
        responses: Mapping[str, Any],
        channel: Channel,
    ) -> LiveCall:
        """An MRTR retry for a call parked on another replica: sent there (through the store), and a stand-in
        call here whose reply is what that replica's call answers (its notifications reach `channel` too, through
        the stand-in's one client writer)."""
        if not await self.context.store.replica_alive(claims.owner):
            raise InvalidParamsError(HOLDER_GONE)
        request = outgoing.request
        decision = (
            decide(self.config(), outgoing.name, declares_tasks=request.declares_tasks)
            if request.method == "tools/call"
            else SYNC_CALL
        )
        standin = self.state(decision, request.client_capabilities, request.progress_token, request.log_level)
        call = new_call(
            standin,
            method=request.method,
            name=outgoing.name,
            principal=caller.principal,
            caller=self.context.principals.key_of(caller.principal),
            digest_of=known(claims.digest),
            channel=channel,
        )
        call.client.reply = asyncio.get_running_loop().create_future()
        origin = self.parking.process_id
        payload = remote.resume_payload(state, responses, request.progress_token, request.log_level, origin)
        call.ask = await self.replicas.ask(claims.owner, remote.RESUME, payload, on_note=partial(self.notes, call))
        self.context.spawner.spawn(self._await_forwarded(call, call.ask), f"forwarded-{call.ask.key}")
        log.info("mrtr_forwarded", method=call.method, name=call.name, round=claims.round, to=claims.owner)
        return call

    async def _await_forwarded(self, call: LiveCall, ask: Ask) -> None:
        try:
            reply, call.request_state, task_id = remote.decode_reply(await ask.reply)
            if task_id is not None:
                call.stored.record = await self.context.store.get(task_id)
                if call.stored.record is None:
                    reply = ReplyError(ProxyError("Internal error: the task the call became is gone"))
                else:
                    reply = ReplyTask(self.context.durations.paced(call.stored.record))
        except (ProxyError, StoreError) as exc:
            reply = ReplyError(exc if isinstance(exc, ProxyError) else ProxyError(STORE_FAILED, detail=str(exc)))
        if call.client.reply is not None and not call.client.reply.done():
            call.client.reply.set_result(reply)

    def client_left(self, call: LiveCall) -> None:
        """The waiting request went away (its handler is being cancelled): tell the call, in the background."""
        if call.ask is not None:  # a stand-in: the replica holding the call is told
            self.replicas.abandon(call.ask)
            return
        call.client.channel = None
        self.context.spawner.spawn(self.context.feed.dispatch(call, ClientLeft()), f"client-left-{call.call_id}")

    async def shut_down(self) -> None:
        """Every running call is cancelled upstream; its record stays live (failed or re-run per `on_restart`
        at the next start, or by another replica at once)."""
        calls = self.context.table.calls()
        await asyncio.gather(
            *(self.context.feed.dispatch(call, ShutDown(SHUTTING_DOWN)) for call in calls), return_exceptions=True
        )
