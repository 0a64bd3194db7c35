"""A client request's side of a call: starting and resuming calls (`CallStarter`, MRTR retries forwarded to the
replica that holds them) and waiting for the reply, turned into the request's JSON-RPC answer
(`WaitingRequests`). Imports the live call, the parking, the replica link and the wire; no aiohttp."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import structlog
from mcp_types import SERVER_INFO_META_KEY

from proxy.config.schema import Config
from proxy.errors import InvalidParamsError, MissingCapabilityError, ProxyError
from proxy.policy import SYNC_CALL, Decision, Outcome, decide
from proxy.tasks.context import TasksContext
from proxy.tasks.effects import Followers
from proxy.tasks.effects.client import ClientSide
from proxy.tasks.effects.slots import Parking, WaitingPlaces
from proxy.tasks.live_call import LiveCall, UpstreamRequest, known, new_call
from proxy.tasks.machine import inputs
from proxy.tasks.machine.commands import (
    ClientLeft,
    ReplyError,
    ReplyInputRequired,
    ReplyKind,
    ReplyMissing,
    ReplyOutcome,
    ReplyTask,
    Resumed,
    ShutDown,
    Start,
)
from proxy.tasks.machine.state import CallState
from proxy.tasks.services import remote
from proxy.tasks.services.replicas import Ask, ReplicaLink
from proxy.tasks.store import StoreError
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.envelope import TASKS_EXTENSION, Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON, result_message
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamResult

# What the reply is (the result, a `CreateTaskResult`, an MRTR `InputRequiredResult`, -32021, a limit error) is
# decided by the call's machine (`tasks/machine/`) and carried out by the executor; the waiting side only waits and
# translates (a task reply carries its record). A poll-to-sync client's keep-alive comments, and the progress that
# keeps a held client with a `progressToken` warm, are asked of the call's one client writer (`keep_alive`, injected:
# `effects/client.py`), never written here. Imports the live call (and its table), the parking, the replica link,
# `remote.py` and the wire's translation; no other effect, no aiohttp.

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
    config: Callable[[], Config]  # the config in force, read at each call: a live reload swaps what it returns
    parking: Parking
    waiting: WaitingPlaces  # a call that could wait for its client takes a place at its start
    replicas: ReplicaLink
    client: ClientSide  # the call's client side: its reply, its stream and their one writer
    followers: Followers  # how a call follows a task the upstream runs, chosen as it is built
    _progress_tokens: int = field(default=0, init=False)

    def state(
        self,
        decision: Decision,
        capabilities: JSON,
        progress_token: str | int | None,
        log_level: str | None,
        config: Config | None = None,
    ) -> CallState:
        """A fresh call's state; `config` is the one its request decides with (else the one in force now)."""
        inputs_config = (config or self.config()).inputs
        return CallState(
            decision=decision,
            capabilities=capabilities,
            gather_ms=inputs_config.gather_ms,
            park_ttl_ms=inputs_config.request_state_ttl_ms,
            progress_token=progress_token,
            log_level=log_level,
        )

    async def begin(
        self,
        outgoing: UpstreamRequest,
        caller: Caller,
        decision: Decision,
        channel: Channel,
        config: Config,
        task_id: str | None = None,
    ) -> LiveCall:
        """A new call for a waiting request; its reply arrives on `call.client.reply`. `task_id`: the id its task
        record gets, when the caller fixed it before (a keyed call's claim names it). A call that could come to
        wait for its client is refused first when no waiting place is left for it (nothing was started)."""
        request = outgoing.request
        caller_key = self.context.principals.key_of(caller.principal)
        capabilities = inputs.THROUGH_HANDLES if decision.handle else request.client_capabilities
        waits = not decision.job and self.waiting.needs_one(capabilities)
        if waits and (refused := self.waiting.refusal(caller_key, config)) is not None:
            raise refused
        params = outgoing.params
        if decision.may_become_task:
            meta = dict(params.get("_meta") or {})
            if "progressToken" not in meta:
                # Ask the upstream for progress even when the client did not: it becomes the statusMessage.
                self._progress_tokens += 1
                meta["progressToken"] = f"mcp-tasks-proxy-{self._progress_tokens}"
            params = {**params, "_meta": meta}
        state = self.state(decision, capabilities, request.progress_token, request.log_level, config)
        call = new_call(
            state,
            method=outgoing.method,
            name=outgoing.name,
            principal=caller.principal,
            caller=caller_key,
            params=params,
            headers=outgoing.headers,
            digest_of=lambda: outgoing.digest,
            follower=self.followers.of(decision),
            planned_id=task_id,
        )
        self.client.wait(call, channel)
        self.context.table.add(call)
        if waits:
            self.waiting.take(call)
        await self.context.feed.submit(call, Start())
        return call

    async def resume(
        self,
        outgoing: UpstreamRequest,
        caller: Caller,
        responses: Mapping[str, Any],
        channel: Channel,
        config: Config | None = None,
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
            return await self._forward(outgoing, caller, claims, state, responses, channel, config or self.config())
        call, answers = self.parking.take(claims, responses)
        self.client.wait(call, channel)
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
        config: Config,
    ) -> LiveCall:
        """An MRTR retry for a call parked on another replica: sent there (through the store), and a stand-in
        call here whose reply is what that replica's call answers (its notifications reach `channel` too, through
        the stand-in's one client writer)."""
        if not await self.context.store.replicas.replica_alive(claims.owner):
            raise InvalidParamsError(HOLDER_GONE)
        request = outgoing.request
        decision = (
            decide(config.tasks, outgoing.name, declares_tasks=request.declares_tasks)
            if request.method == "tools/call"
            else SYNC_CALL
        )
        standin = self.state(decision, request.client_capabilities, request.progress_token, request.log_level, config)
        call = new_call(
            standin,
            method=request.method,
            name=outgoing.name,
            principal=caller.principal,
            caller=self.context.principals.key_of(caller.principal),
            digest_of=known(claims.digest),
        )
        self.client.wait(call, channel)
        origin = self.parking.process_id
        payload = remote.resume_payload(state, responses, request.progress_token, request.log_level, origin)
        call.ask = await self.replicas.ask(
            claims.owner, remote.RESUME, payload, on_note=partial(self.client.note, call)
        )
        self.context.spawner.spawn(self._await_forwarded(call, call.ask), f"forwarded-{call.ask.key}")
        log.info("mrtr_forwarded", method=call.method, name=call.name, round=claims.round, to=claims.owner)
        return call

    async def _await_forwarded(self, call: LiveCall, ask: Ask) -> None:
        try:
            reply, call.request_state, task_id = remote.decode_reply(await ask.reply)
            if task_id is not None:
                record = await self.context.store.records.get(task_id)
                if record is None:
                    reply = ReplyError(ProxyError("Internal error: the task the call became is gone"))
                else:
                    reply = ReplyTask(self.context.durations.paced(record))
        except (ProxyError, StoreError) as exc:
            reply = ReplyError(exc if isinstance(exc, ProxyError) else ProxyError(STORE_FAILED, detail=str(exc)))
        self.client.answer(call, reply)

    def client_left(self, call: LiveCall) -> None:
        """The waiting request went away (its handler is being cancelled): tell the call, in the background."""
        if call.ask is not None:  # a stand-in: the replica holding the call is told
            self.replicas.abandon(call.ask)
            return
        self.client.left(call)
        self.context.spawner.spawn(self.context.feed.dispatch(call, ClientLeft()), f"client-left-{call.call_id}")

    async def shut_down(self) -> None:
        """Every running call is cancelled upstream; its record stays live (failed or re-run per `on_restart`
        at the next start, or by another replica at once)."""
        calls = self.context.table.calls()
        await asyncio.gather(
            *(self.context.feed.dispatch(call, ShutDown(SHUTTING_DOWN)) for call in calls), return_exceptions=True
        )


KEEPALIVE_SECONDS: Final = 15.0  # SSE comment while a poll-to-sync client waits for its internal task
WARM_TICK_SECONDS: Final = 2.0  # how often a waiting client that asked for progress is looked at


class WaitingRequests:
    def __init__(
        self, starter: CallStarter, keep_alive: Callable[[LiveCall, bool], None], cache: tuple[int, str]
    ) -> None:
        self.starter = starter
        self.keep_alive = keep_alive  # queues a keep-alive comment or progress for the call's client writer
        self.cache = cache

    async def call(
        self,
        outgoing: UpstreamRequest,
        caller: Caller,
        channel: Channel,
        decision: Decision | None,
        server_info: JSON | None,
        config: Config,
        task_id: str | None = None,
    ) -> JSON:
        """A fresh call: `decision` is the tool's (tools/call) or None (prompts/get, resources/read); `task_id`:
        the id of its task record, when fixed before."""
        request = outgoing.request
        decision = decision if decision is not None else SYNC_CALL
        if decision.outcome is Outcome.REJECT:
            raise MissingCapabilityError(
                wire_tasks.REQUIRED_CAPABILITY,
                f"Missing required client capability: tool {request.params.get('name')!r} runs only as a task; "
                f"declare the {TASKS_EXTENSION} extension",
            )
        call = await self.starter.begin(outgoing, caller, decision, channel, config, task_id)
        return await self._answer(call, request, server_info)

    async def resume(
        self, outgoing: UpstreamRequest, caller: Caller, channel: Channel, server_info: JSON | None, config: Config
    ) -> JSON:
        """An MRTR retry with `inputResponses` and the `requestState` of the round it answers."""
        request = outgoing.request
        responses = request.params.get("inputResponses")
        if responses is None:
            responses = {}
        if not isinstance(responses, dict):
            raise InvalidParamsError("Invalid params: inputResponses must be an object")
        call = await self.starter.resume(outgoing, caller, responses, channel, config)
        return await self._answer(call, request, server_info)

    async def reply(
        self, outgoing: UpstreamRequest, caller: Caller, channel: Channel, decision: Decision, config: Config
    ) -> ReplyKind:
        """A fresh call whose reply its front turns into an answer itself (a handle's, in either era)."""
        call = await self.starter.begin(outgoing, caller, decision, channel, config)
        return await self._reply(call)

    async def _answer(self, call: LiveCall, request: ModernRequest, server_info: JSON | None) -> JSON:
        return self._message(await self._reply(call), call, request, server_info)

    async def _reply(self, call: LiveCall) -> ReplyKind:
        assert call.client.reply is not None
        try:
            return await self._wait(call, call.client.reply)
        except BaseException:
            self.starter.client_left(call)  # the request went away while waiting: the call is told
            raise

    async def _wait(self, call: LiveCall, reply: asyncio.Future[ReplyKind]) -> ReplyKind:
        """The reply, keeping the client's connection warm meanwhile: SSE keep-alive comments for a poll-to-sync
        client (it may wait long), progress for one that sent a `progressToken` (`keep_alive`); each goes through
        the call's client writer, behind the notifications it still writes."""
        holds = call.state.decision.holds_client
        warm = call.state.progress_token is not None
        if not (holds or warm):
            return await reply
        tick = min(KEEPALIVE_SECONDS if holds else WARM_TICK_SECONDS, WARM_TICK_SECONDS if warm else KEEPALIVE_SECONDS)
        commented = time.perf_counter()
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(reply), tick)
            except TimeoutError:
                now = time.perf_counter()
                comment = holds and now - commented >= KEEPALIVE_SECONDS
                if comment:
                    commented = now
                self.keep_alive(call, comment)

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
