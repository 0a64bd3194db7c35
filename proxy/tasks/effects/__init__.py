"""The effects, and which carries out each command the machine gives (`Effects.carry_out`: one visible switch).
Each owns the state it needs; a task the upstream runs goes to the follower the call was built with. Each
reaches back only through `ports.py` and is tested alone with a fake `Feed`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from proxy.policy import Decision
from proxy.tasks.effects.client import ClientSide
from proxy.tasks.effects.held import HeldRequest
from proxy.tasks.effects.job import JobFollower
from proxy.tasks.effects.records import RecordWrites
from proxy.tasks.effects.slots import Parking, RunningSlots
from proxy.tasks.effects.timers import Timers
from proxy.tasks.effects.upstream_task import UpstreamTaskFollower
from proxy.tasks.live_call import Follower, LiveCall
from proxy.tasks.machine.commands import (
    Answer,
    CancelCall,
    CancelUpstreamTask,
    ClearTimer,
    Command,
    CreateRecord,
    Event,
    FollowUpstreamTask,
    HoldSlot,
    Park,
    PollUpstreamTask,
    Refuse,
    Relay,
    ReleaseCall,
    Reply,
    SetTimer,
    Settle,
    StartCall,
    StartUpstreamTask,
    Unpark,
    WriteInputs,
    WriteProgress,
    WriteQueue,
)


@dataclass(frozen=True, slots=True)
class Followers:
    """How a call follows a task the upstream runs, chosen when the call is built (`of`)."""

    tasks: UpstreamTaskFollower  # the upstream's own 2025-11-25 task: tasks/result, tasks/get, tasks/cancel
    jobs: JobFollower  # a legacy job family (`jobs:`): its start, status, result and cancel tools

    def of(self, decision: Decision) -> Follower | None:
        if decision.job:
            return self.jobs
        return self.tasks if decision.upstream_task else None


@dataclass(frozen=True, slots=True)
class Effects:
    held: HeldRequest
    records: RecordWrites
    client: ClientSide
    timers: Timers
    parking: Parking
    slots: RunningSlots

    async def carry_out(self, call: LiveCall, command: Command) -> Event | None:
        """The command → effect table; the event a command is answered with (a record written, a call parked,
        a lease found lost), if any."""
        match command:
            case Relay():
                await self.client.relay(call, command)
            case Reply():
                await self.client.reply(call, command)
            case WriteProgress():
                return await self.records.write_progress(call, command)
            case SetTimer():
                await self.timers.set(call, command)
            case ClearTimer():
                await self.timers.clear(call, command)
            case HoldSlot():
                await self.slots.hold(call, command)
            case StartCall():
                await self.held.start(call, command)
            case Answer():
                await self.held.answer(call, command)
            case Refuse():
                await self.held.refuse(call, command)
            case CancelCall():
                await self.held.cancel(call, command)
            case CreateRecord():
                return await self.records.create(call, command)
            case WriteInputs():
                return await self.records.write_inputs(call, command)
            case Settle():
                return await self.records.settle(call, command)
            case WriteQueue():
                return await self.records.write_queue(call, command)
            case Park():
                return await self.parking.park(call, command)
            case Unpark():
                await self.parking.unpark(call, command)
            case StartUpstreamTask():
                await _follower(call).start(call, command)
            case FollowUpstreamTask():
                await _follower(call).follow(call, command)
            case PollUpstreamTask():
                await _follower(call).poll(call, command)
            case CancelUpstreamTask():
                await _follower(call).cancel(call, command)
            case ReleaseCall():
                await _follower(call).release(call, command)
            case _:
                assert_never(command)
        return None


def _follower(call: LiveCall) -> Follower:
    follower = call.upstream.follower
    if follower is None:
        raise RuntimeError(f"call {call.call_id} follows no upstream task: it was built without a follower")
    return follower
