"""Input bridging's moving parts: the upstream's questions during one call, gathered into batches and
published to the task's record or to the waiting client; answers delivered upstream; synchronous calls parked
between MRTR rounds.

The runner owns it (and every coroutine: `spawn` is the runner's); the sans-IO pieces are in `inputs.py`.
Imports the store, the job and the wire; never aiohttp's web side or the front.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final

import structlog

from proxy.config import InputsConfig
from proxy.errors import InvalidParamsError, UpstreamError
from proxy.observability import Metrics
from proxy.tasks import inputs
from proxy.tasks.job import Job, JobMode
from proxy.tasks.store import StoreError, TaskStore
from proxy.upstream.call import UpstreamCall, UpstreamServerRequest
from proxy.wire import translate
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskStatus

log = structlog.get_logger(__name__)

MAX_OUTSTANDING_INPUTS: Final = 64  # open questions per call; an upstream asking more at once is refused

Spawn = Callable[[Coroutine[Any, Any, None], str], "asyncio.Task[None]"]


class InputBridge:
    def __init__(
        self,
        config: InputsConfig,
        store: TaskStore,
        clock: Callable[[], int],
        metrics: Metrics | None,
        spawn: Spawn,
        running: set[Job],
        process_id: str,
    ) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self._spawn = spawn
        self._running = running  # the runner's `max_running` slots: a task waiting for input holds none
        self.process_id = process_id
        self.signer = inputs.RequestStateSigner(inputs.load_secret(config.secret_file))
        self._parked: dict[str, Job] = {}  # call id → a synchronous call waiting for an MRTR retry

    async def on_question(self, job: Job, call: UpstreamCall, question: UpstreamServerRequest) -> None:
        """An upstream server→client request mid-call (the upstream's ping never gets here). A question the
        client declared (C-14, K-19) gets a fresh key (T-30, K-39) and waits in the batch being gathered;
        anything else is answered at once, so the upstream never hangs (an elicitation is declined)."""
        if question.method not in translate.INPUT_METHODS:
            await call.refuse(question)
            return
        declared = inputs.declared(job.capabilities, question.method, question.params)
        relayed = declared and job.mode is not JobMode.DETACHED and len(job.inputs) < MAX_OUTSTANDING_INPUTS
        if self.metrics is not None:
            self.metrics.input_requests.labels(question.method, "relayed" if relayed else "refused").inc()
        if not relayed:
            await call.refuse(question)
            reason = "undeclared" if not declared else "detached" if job.mode is JobMode.DETACHED else "too_many"
            log.info(
                "input_request_refused",
                task_id=job.task_id,
                name=job.tool,
                input_method=question.method,
                reason=reason,
            )
            if not declared and job.mode is JobMode.FOREGROUND and job.mrtr:
                # C-4: the waiting client gets -32021 naming what it lacks (unless it can answer something else).
                job.missing.append(translate.required_capability(question.method, question.params))
                self._gather(job)
            return
        job.issued += 1
        key = inputs.mint_key(question.method, job.issued)
        job.inputs[key] = inputs.PendingInput(
            question.id, question.method, inputs.input_request(question.method, question.params)
        )
        self._gather(job)

    def _gather(self, job: Job) -> None:
        """Questions asked together (within `inputs.gather_ms` of the first) reach the client together."""
        if job.publish_timer is None or job.publish_timer.done():
            job.publish_timer = self._spawn(self._publish_later(job), f"gather-{job.call_id}")

    async def _publish_later(self, job: Job) -> None:
        await asyncio.sleep(self.config.gather_ms / 1000)
        await self._publish(job)

    async def _publish(self, job: Job) -> None:
        async with job.lock:
            if job.task_id is not None:
                await self.write_inputs(job)
            if job.mode is JobMode.FOREGROUND:
                job.needs_client = True
                job.attention.set()

    async def write_inputs(self, job: Job) -> None:
        """The task's record shows every outstanding question (T-22); a task with questions open holds no
        running slot. Called with the job's lock held."""
        assert job.task_id is not None
        asking = bool(job.inputs)
        changes = {
            "status": TaskStatus.INPUT_REQUIRED if asking else TaskStatus.WORKING,
            "input_requests": job.input_requests(),
            "inputs_issued": job.issued,
        }
        try:
            updated = await self.store.update(job.task_id, changes, now_ms=self.clock())
        except StoreError as exc:
            log.error("task_inputs_not_stored", task_id=job.task_id, error=str(exc))
            return
        if asking:
            self._running.discard(job)
        elif not job.finished.is_set() and job.mode is not JobMode.DETACHED:
            self._running.add(job)
        if updated is not None and asking:
            self.log_input_required(job)

    def log_input_required(self, job: Job) -> None:
        log.info(
            "task_input_required",
            task_id=job.task_id,
            tool=job.tool,
            keys=sorted(job.inputs),
            methods=sorted({pending.method for pending in job.inputs.values()}),
        )

    def answers(self, job: Job, responses: Mapping[str, Any]) -> dict[str, JSON]:
        """The answers to outstanding questions, validated before any is delivered (-32602 names the key); keys
        not outstanding (never issued, already answered) are ignored (T-28, C-14)."""
        answers: dict[str, JSON] = {}
        for key, response in responses.items():
            pending = job.inputs.get(key)
            if pending is not None:
                answers[key] = inputs.upstream_answer(key, pending.method, response)
        return answers

    async def deliver(self, job: Job, answers: Mapping[str, JSON]) -> None:
        """Each answer goes upstream as the JSON-RPC response to its question (T-29: a subset is fine); the
        same call then continues (T-31)."""
        async with job.lock:
            for key, answer in answers.items():
                pending = job.inputs.pop(key, None)
                if pending is None or job.call is None or job.finished.is_set():
                    continue
                try:
                    await job.call.answer(pending.upstream_id, result=answer)
                except UpstreamError as exc:  # the call is lost; its stream ends it with that error
                    log.warning("input_response_not_delivered", task_id=job.task_id, key=key, error=exc.message)
            if job.task_id is not None and not job.finished.is_set():
                await self.write_inputs(job)

    async def detach(self, job: Job) -> None:
        """Nobody will answer or read this call any more: its open questions are refused (the upstream ends
        the call by itself; a cancel racing that end would break an mcp 1.x session)."""
        async with job.lock:
            job.mode = JobMode.DETACHED
            job.channel = None
            pending_inputs = list(job.inputs.values())
            job.inputs.clear()
            if pending_inputs:
                log.info("input_requests_declined", task_id=job.task_id, name=job.tool, count=len(pending_inputs))
            for pending in pending_inputs:
                if job.call is not None and not job.finished.is_set():
                    question = UpstreamServerRequest(pending.upstream_id, pending.method, None)
                    try:
                        await job.call.refuse(question)
                    except UpstreamError as exc:
                        log.info("input_request_refusal_failed", error=exc.message)

    def park(self, job: Job, claims: inputs.StateClaims) -> str:
        """MRTR: the call waits for the client's retry; returns the signed `requestState` for that retry."""
        self._parked[job.call_id] = job
        return self.signer.sign(claims)

    def claim_parked(self, claims: inputs.StateClaims) -> Job:
        """The parked call a verified `requestState` names, taken for exactly one retry (single use, C-13)."""
        job = self._parked.get(claims.call_id)
        if job is None or job.round != claims.round:
            if claims.owner != self.process_id:
                raise InvalidParamsError(
                    "Invalid params: requestState belongs to a call held by another proxy process; send the "
                    "request again without it"
                )
            raise InvalidParamsError(
                "Invalid params: requestState was already used or its call has ended; send the request again without it"
            )
        return job

    def unpark(self, job: Job) -> None:
        self._parked.pop(job.call_id, None)

    @property
    def parked(self) -> int:
        return len(self._parked)

    @property
    def parked_limit(self) -> int:
        return self.config.max_parked

    def expired(self, now_ms: int) -> list[Job]:
        """Parked calls whose requestState has expired (the runner cancels them)."""
        return [job for job in self._parked.values() if job.parked_until_ms <= now_ms]
