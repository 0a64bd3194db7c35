"""The requests that wait for a runner call: what one `tools/call`, `prompts/get` or `resources/read` answers.

Per the policy's outcome (T-1…T-3, T-15) a waiting request ends with the call's result, a `CreateTaskResult`
(the call continues as a task), an MRTR `InputRequiredResult` (the call is parked until the client retries
with `inputResponses` + `requestState`, C-11…C-13), or -32021 when the upstream asks what the client did not
declare (C-4). The runner owns the calls; this module only waits on them. No aiohttp.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import structlog
from mcp_types import SERVER_INFO_META_KEY

from proxy.errors import InvalidParamsError, MissingCapabilityError, ProxyError, TaskLimitError
from proxy.policy import Decision, Outcome
from proxy.tasks import inputs
from proxy.tasks.job import Job, JobMode, Woke
from proxy.tasks.runner import TaskRunner
from proxy.upstream.call import UpstreamErrorResponse, UpstreamResult
from proxy.upstream.session import principal_key
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.envelope import TASKS_EXTENSION, Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON, error_message, result_message
from proxy.wire.tasks import TaskStatus

log = structlog.get_logger(__name__)

KEEPALIVE_SECONDS: Final = 15.0  # SSE comment while a poll-to-sync client waits for its internal task
CLIENT_LEFT: Final = "client disconnected"


class WaitingCalls:
    def __init__(self, runner: TaskRunner) -> None:
        self.runner = runner

    async def call(
        self,
        request: ModernRequest,
        caller: Caller,
        channel: Channel,
        decision: Decision | None,
        server_info: JSON | None,
    ) -> JSON:
        """A fresh call: `decision` is the tool's (tools/call) or None (prompts/get, resources/read: sync)."""
        outcome = decision.outcome if decision is not None else Outcome.SYNC
        if outcome is Outcome.REJECT:
            raise MissingCapabilityError(
                wire_tasks.REQUIRED_CAPABILITY,
                f"Missing required client capability: tool {request.params.get('name')!r} runs only as a task; "
                f"declare the {TASKS_EXTENSION} extension",
                request_id=request.id,
            )
        runner = self.runner
        job = runner.new_job(request, caller, outcome, decision.policy if decision is not None else None)
        if outcome is Outcome.TASK:
            job.mode = JobMode.TASK
            started = time.perf_counter()
            record = await runner.shielded(runner.open_task(job, caller, request), "task-create")
            runner.observe_create("task", started)
            return result_message(request.id, wire_tasks.create_task_result(record, server_info))
        job.channel = channel
        if outcome is Outcome.WAIT:
            await runner.shielded(runner.open_task(job, caller, request), "task-create")
        else:
            runner.start_call(job)
        return await self._wait(job, request, caller, channel, server_info)

    async def resume(self, request: ModernRequest, caller: Caller, channel: Channel, server_info: JSON | None) -> JSON:
        """C-12 / C-13: an MRTR retry. The `requestState` must be genuine, unexpired, the caller's, for this
        method and these params, and name a call parked here for this round; else -32602."""
        runner = self.runner
        state = request.params.get("requestState")
        if not isinstance(state, str):
            raise InvalidParamsError("Invalid params: requestState must be a string", request_id=request.id)
        responses = request.params.get("inputResponses")
        if responses is None:
            responses = {}
        if not isinstance(responses, dict):
            raise InvalidParamsError("Invalid params: inputResponses must be an object", request_id=request.id)
        try:
            claims = runner.bridge.signer.verify(state, runner.clock())
            if (
                claims.principal != principal_key(caller.principal)
                or claims.method != request.method
                or claims.digest != inputs.params_digest(request.params)
            ):
                raise InvalidParamsError("Invalid params: requestState was issued for another request")
            job = runner.bridge.claim_parked(claims)
            answers = runner.bridge.answers(job, responses)  # a bad answer leaves the call parked for a corrected retry
        except ProxyError as exc:
            exc.request_id = request.id
            raise
        runner.bridge.unpark(job)
        job.mode = JobMode.FOREGROUND
        job.channel = channel
        job.progress_token = request.progress_token
        job.log_level = request.log_level
        log.info("mrtr_resumed", method=job.method, name=job.tool, round=job.round, answered=sorted(answers))
        try:
            await runner.bridge.deliver(job, answers)
        except BaseException:  # the client left while its answers went upstream: nobody waits for the call
            await runner.shielded(runner.stop_call(job, CLIENT_LEFT), "call-stop")
            raise
        return await self._wait(job, request, caller, channel, server_info)

    async def _wait(
        self, job: Job, request: ModernRequest, caller: Caller, channel: Channel, server_info: JSON | None
    ) -> JSON:
        """Wait for the call per its outcome; a client that leaves while waiting stops it (C-19, L-5)."""
        runner = self.runner
        try:
            if job.inputs and not job.finished.is_set():  # C-14: questions a retry left unanswered are asked again
                return await self._park(job, request, caller, server_info)
            kind = job.outcome_kind
            window = None
            if kind in (Outcome.WINDOW, Outcome.INPUT_FIRST):
                assert job.policy is not None
                window = job.policy.sync_window_ms / 1000
            woke = await self._attend(job, window, channel if kind is Outcome.WAIT else None)
            if woke is Woke.FINISHED:
                if job.mrtr and job.missing:
                    raise self._missing(job, request)
                if kind is Outcome.WAIT:
                    return await self._settled_reply(job, request, server_info)
                if kind is Outcome.INPUT_FIRST and job.policy is not None and job.policy.mode == "required":
                    return await self._to_task(job, request, caller, server_info)
                return self._reply(job, request, server_info)
            if woke is Woke.INPUT:
                if kind is Outcome.WINDOW:  # a declaring client: the question goes to the task (T-22)
                    return await self._to_task(job, request, caller, server_info)
                if job.inputs:
                    return await self._park(job, request, caller, server_info)
                await runner.bridge.detach(job)
                raise self._missing(job, request)
            return await self._to_task(job, request, caller, server_info)
        except BaseException:
            waiting = job.mode is JobMode.FOREGROUND or (job.mode is JobMode.TASK and job.task_id is None)
            if waiting and not job.finished.is_set():
                # The client left (or the task could not be created): nobody waits for the call any more.
                if job.task_id is not None:
                    await runner.shielded(runner.cancel_task(job.task_id, CLIENT_LEFT), "task-cancel")
                else:
                    await runner.shielded(runner.stop_call(job, CLIENT_LEFT), "call-stop")
            raise

    async def _attend(self, job: Job, window: float | None, keepalive: Channel | None) -> Woke:
        loop = asyncio.get_running_loop()
        deadline = None if window is None else loop.time() + window
        while True:
            job.attention.clear()
            if job.finished.is_set():
                return Woke.FINISHED
            if job.needs_client:
                job.needs_client = False
                return Woke.INPUT
            timeout = None if deadline is None else deadline - loop.time()
            if timeout is not None and timeout <= 0:
                return Woke.WINDOW
            if keepalive is not None:
                timeout = KEEPALIVE_SECONDS if timeout is None else min(timeout, KEEPALIVE_SECONDS)
            try:
                await asyncio.wait_for(job.attention.wait(), timeout)
            except TimeoutError:
                if keepalive is not None:
                    await keepalive.keepalive(open_stream=True)

    async def _park(self, job: Job, request: ModernRequest, caller: Caller, server_info: JSON | None) -> JSON:
        """C-11: InputRequiredResult with every outstanding question and a requestState for one retry. Beyond
        `inputs.max_parked` the questions are declined upstream (the call ends by itself) and the client gets
        a limit error."""
        runner = self.runner
        if runner.bridge.parked >= runner.bridge.parked_limit:
            await runner.bridge.detach(job)
            raise TaskLimitError("max_parked", runner.bridge.parked_limit, request_id=request.id)
        job.round += 1
        job.mode = JobMode.PARKED
        job.channel = None
        job.missing.clear()  # declined upstream and answered for: the client was asked what it can answer
        job.parked_until_ms = runner.clock() + runner.bridge.config.request_state_ttl_ms
        claims = inputs.StateClaims(
            call_id=job.call_id,
            round=job.round,
            principal=principal_key(caller.principal),
            method=request.method,
            digest=inputs.params_digest(request.params),
            expires_at_ms=job.parked_until_ms,
            owner=runner.process_id,
        )
        state = runner.bridge.park(job, claims)
        log.info("mrtr_input_required", method=job.method, name=job.tool, round=job.round, keys=sorted(job.inputs))
        result = inputs.input_required_result(job.input_requests(), state)
        if server_info:
            result["_meta"] = {SERVER_INFO_META_KEY: server_info}
        return result_message(request.id, result)

    def _missing(self, job: Job, request: ModernRequest) -> MissingCapabilityError:
        required: JSON = {}
        for capability in job.missing:
            for name, sub in capability.items():
                required[name] = {**required.get(name, {}), **sub}
        return MissingCapabilityError(
            required,
            f"Missing required client capability: the upstream asked for {', '.join(sorted(required))} during "
            f"{request.method}",
            request_id=request.id,
        )

    async def _to_task(self, job: Job, request: ModernRequest, caller: Caller, server_info: JSON | None) -> JSON:
        """The call continues as a task (no second upstream call); T-15: no requestState or inputRequests on
        the CreateTaskResult."""
        runner = self.runner
        started = time.perf_counter()
        record = await runner.shielded(runner.create_task(job, caller, request), "task-create")
        runner.observe_create("window", started)
        return result_message(request.id, wire_tasks.create_task_result(record, server_info))

    async def _settled_reply(self, job: Job, request: ModernRequest, server_info: JSON | None) -> JSON:
        """Poll-to-sync: the internal task's outcome as the synchronous answer."""
        assert job.task_id is not None
        settled = await self.runner.store.get(job.task_id)
        if settled is None or settled.status is TaskStatus.CANCELLED:
            return error_message(request.id, wire_tasks.internal_error("The task was cancelled"))
        if settled.status is TaskStatus.FAILED:
            return error_message(request.id, settled.error or wire_tasks.internal_error("Task failed"))
        if settled.status is TaskStatus.COMPLETED and settled.result is not None:
            return result_message(
                request.id, translate.complete_result(request.method, settled.result, server_info, None)
            )
        return self._reply(job, request, server_info)

    def _reply(self, job: Job, request: ModernRequest, server_info: JSON | None) -> JSON:
        outcome = job.outcome
        if isinstance(outcome, UpstreamResult):
            cache = self.runner.cache if request.method == "resources/read" else None
            return result_message(
                request.id, translate.complete_result(request.method, outcome.result, server_info, cache)
            )
        if isinstance(outcome, UpstreamErrorResponse):
            return error_message(request.id, translate.error_object(outcome.error))
        if isinstance(outcome, ProxyError):
            outcome.request_id = request.id
            raise outcome
        raise ProxyError("Internal error: the call ended without an outcome", request_id=request.id)
