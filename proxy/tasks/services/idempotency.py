"""`Idempotency-Key` on a 2026-07-28 `tools/call`: the first request with a key runs as any call, its outcome
recorded in the task store; a repeat with the same payload joins it (one upstream call, on any replica) or gets
the outcome, another payload is 422. A release or outcome the store could not take is owed and written once it
can. Consulted by the front only for a request with the header. Imports the store, config, errors and wire."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Protocol, TypeVar

import structlog
from mcp_types import jsonrpc as codes

from proxy.config.schema import IdempotencyConfig
from proxy.errors import (
    InvalidParamsError,
    ProxyError,
    RequestId,
    UpstreamAuthError,
    UpstreamError,
    UpstreamUnreachableError,
)
from proxy.observe.metrics import Metrics
from proxy.principals import Principals
from proxy.tasks.store import KeyRecord, StoreError, StoreUnavailableError, TaskStore
from proxy.wire import jsonrpc
from proxy.wire.envelope import Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

HEADER: Final = "Idempotency-Key"
MAX_KEY_CHARS: Final = 255  # as Stripe's limit; the draft sets none
FIRST_POLL_SECONDS: Final = 0.01  # a joining repeat reads the key's record again after this, doubling ...
MAX_POLL_SECONDS: Final = 0.25  # ... up to this: on another replica the outcome shows within a quarter second
MAX_OWED: Final = 10_000  # releases and outcomes kept for a store that is away (a bound, not a need)
FIRST_RETRY_SECONDS: Final = 0.1  # owed writes are tried again after this, doubling ...
LAST_RETRY_SECONDS: Final = 2.0  # ... up to this (as the settlement outbox), ± 20 %
_TOKEN_CHARS: Final = frozenset("!#$%&'*+-.^_`|~:/0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_MALFORMED: Final = (
    "Invalid params: the Idempotency-Key header must be a structured-field string (a quoted string of visible "
    f'ASCII characters, e.g. "8e03978e-40d5"), or those characters unquoted, 1 to {MAX_KEY_CHARS} characters'
)

Run = Callable[[Channel], Awaitable[JSON]]


class KeyConflictError(InvalidParamsError):
    """The key was used for a request with another tool or other arguments: 422, nothing runs (the draft)."""

    http_status = 422


class KeyBusyError(ProxyError):
    """The first request with the key still runs past `idempotency.join_timeout_seconds`: 409, as the draft
    answers a repeat of a request still being processed; the client may send it again later."""

    code = codes.INVALID_REQUEST
    http_status = 409
    headers: ClassVar[dict[str, str]] = {"Retry-After": "1"}


class ReplayedError(ProxyError):
    """A failure recorded for the key, answered again as it was first (its JSON-RPC error and HTTP status)."""

    def __init__(self, error: JSON, status: int) -> None:
        super().__init__(str(error.get("message", "")), data=error.get("data"), http_status=status)
        self.recorded = error

    def error_object(self) -> dict[str, Any]:
        return dict(self.recorded)


INTERRUPTED: Final = {
    "proxyError": {
        "code": codes.INTERNAL_ERROR,
        "message": "Internal error: the first request with this Idempotency-Key was interrupted (its proxy process "
        "stopped) before its outcome was recorded; the upstream may have run it. Send the request with a new key "
        "to run it again",
        "data": {"idempotencyKey": "interrupted"},
    },
    "status": 500,
}


def parse_key(value: str) -> str:
    """The key of an `Idempotency-Key` value: a structured-field string (RFC 8941 §3.3.3: `"` ... `"`, with
    `\\"` and `\\\\` escapes, characters 0x20-0x7E) or, as clients of Stripe-style APIs send it, the bare key made
    of token characters (RFC 9110 §5.6.2, and `:` `/`). Parameters after the string are not accepted."""
    if value.startswith('"'):
        key: list[str] = []
        escaped = False
        for index, char in enumerate(value[1:], start=1):
            if escaped:
                if char not in '"\\':
                    raise InvalidParamsError(_MALFORMED)
                key.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                if index != len(value) - 1:
                    raise InvalidParamsError(_MALFORMED)
                return _checked("".join(key))
            elif " " <= char <= "~":
                key.append(char)
            else:
                raise InvalidParamsError(_MALFORMED)
        raise InvalidParamsError(_MALFORMED)  # no closing quote
    if not _TOKEN_CHARS.issuperset(value):
        raise InvalidParamsError(_MALFORMED)
    return _checked(value)


def _checked(key: str) -> str:
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise InvalidParamsError(_MALFORMED)
    return key


def fingerprint(name: object, arguments: object) -> str:
    """SHA-256 of the tool name and its arguments as canonical JSON (sorted keys, compact): the same call with its
    arguments in another order is the same request."""
    canonical = json.dumps([name, arguments], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def records_failure(error: ProxyError) -> bool:
    """Whether a failure is the key's outcome. Only an upstream failure after the request may have reached the
    upstream (it timed out, the connection broke, the answer was too large, the session was lost): the tool may
    have run, so a repeat must not run it again. Everything the proxy refused itself (a limit, a validation
    error, a missing capability) and an upstream that could not be reached or refused the credential leaves
    nothing recorded: the key can be used again."""
    return isinstance(error, UpstreamError) and not isinstance(error, UpstreamUnreachableError | UpstreamAuthError)


def outcome_of(message: JSON) -> str:
    """A final message as the key's outcome: its result or its JSON-RPC error, without the request's id."""
    kept = {"result": message["result"]} if "result" in message else {"error": message["error"]}
    return jsonrpc.dumps(kept).decode()


def replay(outcome: str, request_id: RequestId) -> JSON:
    """The recorded outcome as the answer to a repeat (with the repeat's own id)."""
    recorded = json.loads(outcome)
    if "result" in recorded:
        return jsonrpc.result_message(request_id, recorded["result"])
    if "error" in recorded:
        return jsonrpc.error_message(request_id, recorded["error"])
    raise ReplayedError(recorded["proxyError"], int(recorded["status"]))


class DetachableChannel:
    """The first request's channel, which its call may outlive: once that client left, notifications go nowhere
    (instead of ending the call), so the call runs to its end and a repeat gets its outcome."""

    def __init__(self, channel: Channel) -> None:
        self.channel: Channel | None = channel

    def detach(self) -> None:
        self.channel = None

    async def notify(self, message: JSON, *, required: bool = False) -> None:
        if self.channel is not None:
            try:
                await self.channel.notify(message, required=required)
            except ConnectionResetError:
                self.channel = None

    async def keepalive(self, *, open_stream: bool = False) -> None:
        if self.channel is not None:
            try:
                await self.channel.keepalive(open_stream=open_stream)
            except ConnectionResetError:
                self.channel = None


_T = TypeVar("_T")


class Spawner(Protocol):
    """Starts a named background coroutine the runner owns."""

    def __call__(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]: ...


Claim = tuple[str, str, int]  # a claim of a key: its scope, key and created_at_ms (this process owns it)


def _claim(record: KeyRecord) -> Claim:
    return record.scope, record.key, record.created_at_ms


@dataclass(frozen=True)
class IdempotencyKeys:
    """Serves keyed calls; `process_id` is the owner of the keys this process runs (its replica id), and
    `spawn` starts a named background coroutine the runner owns."""

    store: TaskStore
    principals: Principals
    process_id: str
    spawn: Spawner
    clock: Callable[[], int]
    metrics: Metrics | None
    closing: Callable[[], bool] = lambda: False  # the runner shuts down: answers are the shutdown's own
    # Claims a request here waits on (being made, or its call running), counted: a repeat here joins those only.
    _held: Counter[Claim] = field(default_factory=Counter, init=False)
    # What this process owes the store for claims no request here waits on any more: a release (None) or the
    # outcome, oldest first. Written by `_pay_forever` once the store takes writes again, or by a repeat.
    _owed: OrderedDict[Claim, tuple[KeyRecord, str | None]] = field(default_factory=OrderedDict, init=False)
    _paying: list[asyncio.Task[None]] = field(default_factory=list, init=False)
    _writing: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)  # one owed write at a time

    async def serve(
        self,
        config: IdempotencyConfig,
        header: str,
        request: ModernRequest,
        caller: Caller,
        channel: Channel,
        run: Run,
    ) -> JSON:
        """The answer to a keyed tools/call: `run(channel)` serves it as today when the key is new."""
        key = parse_key(header)
        printed = fingerprint(request.params.get("name"), request.params.get("arguments"))
        scope = self.principals.key_of(caller.principal)
        while True:
            now = self.clock()
            while (scope, key, now) in self._held or (scope, key, now) in self._owed:
                now += 1  # this process's claims of one key differ by their creation: a late write names one
            claim = KeyRecord(scope, key, printed, self.process_id, now, now + round(config.retention_seconds * 1000))
            self._held[_claim(claim)] += 1  # before the claim is sent: a repeat here that finds it joins it
            try:
                holder = await self.store.keys.claim_key(claim)
            except BaseException:  # refused (503) or left: whether the store committed the claim is unknown
                self._owe(claim, None)
                self._unhold(claim)
                raise
            if holder is None:
                self._note("first")
                return await self._first(claim, channel, run)
            self._unhold(claim)
            if holder.fingerprint != printed:
                self._note("conflict")
                raise KeyConflictError(
                    "Invalid params: this Idempotency-Key was used for a different request (another tool or other "
                    "arguments); use a new key for a new request"
                )
            answer = await self._repeat(holder, config, request.id)
            if answer is not None:
                return answer
            # released meanwhile (the first was refused before the upstream saw it): this one claims it

    async def _first(self, claim: KeyRecord, channel: Channel, run: Run) -> JSON:
        """Run in a task of its own: when the client leaves, the call runs on and its outcome is still recorded
        (the client's retry with the key joins it instead of running the tool again)."""
        detachable = DetachableChannel(channel)
        task = self.spawn(self._run(claim, detachable, run), "idempotent-call")
        try:
            answer = await asyncio.shield(task)
        except asyncio.CancelledError:
            detachable.detach()
            raise
        if isinstance(answer, ProxyError):
            raise answer
        return answer

    async def _run(self, claim: KeyRecord, channel: Channel, run: Run) -> JSON | ProxyError:
        try:
            try:
                message = await run(channel)
            except ProxyError as error:
                if self.closing():
                    await self._settle(claim, json.dumps(INTERRUPTED))
                elif records_failure(error):
                    await self._settle(claim, json.dumps({"proxyError": error.error_object(), "status": error.status}))
                else:
                    await self._release(claim)
                return error
            except BaseException:
                await self._release(claim)
                raise
            # A call stopped by a shutdown answers that the proxy shuts down: not the upstream's outcome, which is
            # unknown (the upstream was told to cancel), so a repeat is told so rather than to send again.
            await self._settle(claim, json.dumps(INTERRUPTED) if self.closing() else outcome_of(message))
            return message
        finally:
            self._unhold(claim)  # settled, released, or owed by now: a repeat here finds it so

    async def _settle(self, claim: KeyRecord, outcome: str) -> None:
        try:
            await self.store.keys.settle_key(claim, outcome)
        except StoreError as exc:  # the answer still goes out; the outcome is written once the store takes it
            log.warning("idempotency_key_not_recorded", error=str(exc), owed=True)
            self._owe(claim, outcome)

    async def _release(self, claim: KeyRecord) -> None:
        self._note("released")
        try:
            await self.store.keys.release_key(claim)
        except StoreError as exc:  # released once the store takes it (a repeat here does it at once)
            log.warning("idempotency_key_not_released", error=str(exc), owed=True)
            self._owe(claim, None)

    def _unhold(self, claim: KeyRecord) -> None:
        held = _claim(claim)
        self._held[held] -= 1
        if self._held[held] <= 0:
            del self._held[held]

    # --- what is owed to the store ----------------------------------------------------------------------------

    def _owe(self, claim: KeyRecord, outcome: str | None) -> None:
        """A release (None) or an outcome the store did not take: kept, and written as soon as it takes writes."""
        self._owed[_claim(claim)] = (claim, outcome)
        while len(self._owed) > MAX_OWED:  # the oldest goes: a repeat of it is told "interrupted", never run twice
            (dropped, _) = self._owed.popitem(last=False)[1]
            log.error(
                "idempotency_key_not_written", reason=f"more than {MAX_OWED} owed", key_created=dropped.created_at_ms
            )
        if not any(not task.done() for task in self._paying):
            self._paying[:] = [self.spawn(self._pay_forever(), "idempotency-keys-owed")]

    async def _pay(self, claim: KeyRecord) -> bool:
        """Write what is owed for `claim` now: True when it was owed (and is written), False when nothing is."""
        async with self._writing:  # a repeat and the background never write one claim at once
            owed = self._owed.get(_claim(claim))
            if owed is None:
                return False
            record, outcome = owed
            if outcome is None:
                await self.store.keys.release_key(record)
            else:
                await self.store.keys.settle_key(record, outcome)
            self._owed.pop(_claim(claim), None)
        log.info("idempotency_key_owed_written", released=outcome is None)
        return True

    async def _pay_forever(self) -> None:
        """Owed writes, oldest first, until the store has taken them all (backoff while it is away)."""
        delay = FIRST_RETRY_SECONDS
        while self._owed:
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            try:
                await self.pay_owed()
            except StoreUnavailableError:
                delay = min(delay * 2, LAST_RETRY_SECONDS)
                continue
            delay = FIRST_RETRY_SECONDS

    async def pay_owed(self) -> None:
        """One round over what is owed (and the last one at shutdown): StoreUnavailableError while the store is
        away; a lasting store failure drops the write (logged)."""
        for record, _ in list(self._owed.values()):
            try:
                await self._pay(record)
            except StoreUnavailableError:
                raise
            except StoreError as exc:
                self._owed.pop(_claim(record), None)
                log.error("idempotency_key_not_written", error=str(exc))

    async def close(self) -> None:
        """Shutdown: the owed writes are tried once more; what the store still does not take is logged (a
        repeat of such a key on another replica is told "interrupted", never run twice)."""
        for task in self._paying:
            task.cancel()
        try:
            await self.pay_owed()
        except StoreUnavailableError as exc:
            log.error("idempotency_keys_not_written", owed=len(self._owed), error=str(exc))

    async def _repeat(self, holder: KeyRecord, config: IdempotencyConfig, request_id: RequestId) -> JSON | None:
        """The recorded outcome, once there is one (waiting for a first request still running, up to the join
        timeout); None when the key was released meanwhile."""
        deadline = time.monotonic() + config.join_timeout_seconds
        delay = FIRST_POLL_SECONDS
        record: KeyRecord | None = holder
        joined = False
        while record is not None and record.outcome is None:
            if record.owner == self.process_id and not self._held.get(_claim(record)):
                # This process made the claim and no request here waits on it any more: refused (503) or left
                # while the claim was made, or its release or outcome could not be written. Written now.
                paid = await self._pay(record)
                if not paid and await self.store.keys.settle_key(record, json.dumps(INTERRUPTED)):
                    # Nothing known of it (more were owed than kept): its outcome is unknown, as after a crash.
                    log.warning("idempotency_key_interrupted", owner=record.owner)
                    self._note("interrupted")
            elif record.owner != self.process_id and not await self.store.replicas.replica_alive(record.owner):
                # The process running the first request died: what the upstream did is unknown, so it is
                # not run again; the repeats are told so.
                if await self.store.keys.settle_key(record, json.dumps(INTERRUPTED)):
                    log.warning("idempotency_key_interrupted", owner=record.owner)
                    self._note("interrupted")
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._note("busy")
                    raise KeyBusyError(
                        "Invalid Request: a request with this Idempotency-Key is still being processed; send it "
                        "again later"
                    )
                joined = True
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, MAX_POLL_SECONDS)
            record = await self.store.keys.get_key(holder.scope, holder.key)
        if record is None:
            return None
        how = "joined" if joined else "replayed"
        self._note(how)
        structlog.contextvars.bind_contextvars(idempotency=how)  # on the request's log line
        log.info("idempotent_call_answered_from_key", how=how)
        assert record.outcome is not None
        return replay(record.outcome, request_id)

    def _note(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.idempotent_calls.labels(outcome).inc()
