"""The shares of what calls may hold at once, each counted and checked here only: `max_running` slots
(`HoldSlot`), places of calls that may come to wait for their client (`WaitingPlaces`, taken at a call's start)
and parked MRTR calls (`Park` → `Parked` or `ParkRefused`; `Unpark`; an MRTR retry takes its parked call); each
refused beyond its limit or the caller's share. Imports the input rules (signing), the machine's answer check,
errors; no store, no upstream."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from proxy.config.schema import Config
from proxy.errors import CallerLimitError, InvalidParamsError, ProxyError, TaskLimitError
from proxy.tasks import machine
from proxy.tasks.live_call import LiveCall
from proxy.tasks.machine import inputs
from proxy.tasks.machine.commands import HoldSlot, Park, Parked, ParkRefused, Unpark
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

ALREADY_USED = "Invalid params: requestState was already used or its call has ended; send the request again without it"


@dataclass(eq=False, slots=True)
class Holders:
    """The calls that hold a place of a kind (a running slot, a waiting place), and how many each caller holds."""

    _calls: set[LiveCall] = field(default_factory=set)
    _by_caller: Counter[str] = field(default_factory=Counter)

    def add(self, call: LiveCall) -> None:
        if call not in self._calls:
            self._calls.add(call)
            self._by_caller[call.caller] += 1

    def discard(self, call: LiveCall) -> None:
        if call in self._calls:
            self._calls.discard(call)
            self._by_caller[call.caller] -= 1
            if not self._by_caller[call.caller]:
                del self._by_caller[call.caller]

    def holds(self, caller: str) -> int:
        return self._by_caller[caller]

    def __len__(self) -> int:
        return len(self._calls)


@dataclass(eq=False, slots=True)
class RunningSlots:
    """`tasks.max_running` and `limits.max_running_per_principal`."""

    config: Callable[[], Config]  # the config in force, read at each call: a live reload swaps what it returns
    _holders: Holders = field(default_factory=Holders, init=False)

    def refusal(self, call: LiveCall) -> ProxyError | None:
        """Why a new working task of this call may not start now, or None."""
        config = self.config()
        max_running = config.tasks.max_running
        if len(self._holders) >= max_running:
            return TaskLimitError("max_running", max_running)
        per_caller = config.limits.max_running_per_principal
        if self._holders.holds(call.caller) >= per_caller:
            return CallerLimitError("max_running_per_principal", per_caller)
        return None

    async def hold(self, call: LiveCall, command: HoldSlot) -> None:
        self._set(call, command.hold)

    def forget(self, call: LiveCall) -> None:
        self._set(call, False)

    def _set(self, call: LiveCall, hold: bool) -> None:
        if hold:
            self._holders.add(call)
        else:
            self._holders.discard(call)

    @property
    def count(self) -> int:
        return len(self._holders)


@dataclass(eq=False, slots=True)
class WaitingPlaces:
    """`inputs.max_waiting` and `limits.max_waiting_per_principal`. A call whose client could answer a question
    (it declared elicitation, sampling or roots) takes a place at its start and keeps it until it ends: while it
    runs it may ask at any moment, and then it waits (a task in `input_required`, a parked MRTR call) holding
    its upstream session. Counting it from its start, not from its question, is what bounds the waiting: a call
    admitted is never refused when it asks, and a caller never has more calls waiting than its share."""

    _holders: Holders = field(default_factory=Holders, init=False)

    @staticmethod
    def needs_one(capabilities: JSON) -> bool:
        """Could a call of a client with these capabilities come to wait for it?"""
        return inputs.could_answer(capabilities)

    def refusal(self, caller: str, config: Config) -> ProxyError | None:
        """Why a new call of `caller` that could wait may not start now under `config` (its request's), or None."""
        total = config.inputs.max_waiting
        if len(self._holders) >= total:
            return TaskLimitError("max_waiting", total)
        per_caller = config.limits.max_waiting_per_principal
        if self._holders.holds(caller) >= per_caller:
            return CallerLimitError("max_waiting_per_principal", per_caller)
        return None

    def take(self, call: LiveCall) -> None:
        """The call holds a place until it ends (`forget`); a call taken up after a restart or from another
        replica is counted without a check: it exists already."""
        self._holders.add(call)

    def forget(self, call: LiveCall) -> None:
        self._holders.discard(call)

    @property
    def count(self) -> int:
        return len(self._holders)

    def held_by(self, caller: str) -> int:
        return self._holders.holds(caller)


@dataclass(eq=False, slots=True)
class Parking:
    """Calls parked between MRTR rounds, by call id; `inputs.max_parked` and the caller's share."""

    config: Callable[[], Config]  # the config in force, read at each park: a live reload swaps what it returns
    signer: inputs.RequestStateSigner
    clock: Callable[[], int]
    process_id: str
    _parked: dict[str, LiveCall] = field(default_factory=dict, init=False)
    _by_caller: Counter[str] = field(default_factory=Counter, init=False)

    async def park(self, call: LiveCall, command: Park) -> Parked | ParkRefused:
        config = self.config()
        if len(self._parked) >= config.inputs.max_parked:
            return ParkRefused(TaskLimitError("max_parked", config.inputs.max_parked))
        per_caller = config.limits.max_parked_per_principal
        if self._by_caller[call.caller] >= per_caller:
            return ParkRefused(CallerLimitError("max_parked_per_principal", per_caller))
        claims = inputs.StateClaims(
            call_id=call.call_id,
            round=command.round,
            principal=call.caller,
            method=call.method,
            digest=call.digest,
            expires_at_ms=self.clock() + config.inputs.request_state_ttl_ms,
            owner=self.process_id,
        )
        call.request_state = self.signer.sign(claims)
        self._parked[call.call_id] = call
        self._by_caller[call.caller] += 1
        log.info(
            "mrtr_input_required",
            method=call.method,
            name=call.name,
            round=command.round,
            keys=sorted(call.state.inputs),
        )
        return Parked()

    async def unpark(self, call: LiveCall, command: Unpark) -> None:
        self.forget(call)

    def forget(self, call: LiveCall) -> None:
        if self._parked.pop(call.call_id, None) is not None:
            self._by_caller[call.caller] -= 1
            if not self._by_caller[call.caller]:
                del self._by_caller[call.caller]

    def take(self, claims: inputs.StateClaims, responses: Mapping[str, Any]) -> tuple[LiveCall, dict[str, JSON]]:
        """The call parked here for the claims' round, with the retry's answers checked (a bad answer leaves it
        parked for a corrected retry); it is no longer parked: exactly one retry resumes a round."""
        call = self._parked.get(claims.call_id)
        if call is None or not machine.resumable(call.state, claims.round):
            raise InvalidParamsError(ALREADY_USED)
        answers = machine.answers(call.state, responses)
        self.forget(call)
        return call, answers

    def holds(self, call: LiveCall) -> bool:
        return self._parked.get(call.call_id) is call

    @property
    def count(self) -> int:
        return len(self._parked)
