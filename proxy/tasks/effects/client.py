"""The waiting client's side of a call (`Reply`, `Relay`, keep-alive comments): one writer per client stream.
Notifications, the keep-alive comments of a poll-to-sync wait and the final reply go through one queue
(`ClientEnd.outgoing`) to one writer task, in the order they were given, so nothing else writes the stream
meanwhile, and none is written under the call's lock: a client slow to read holds up only its own writer,
never the call (the upstream's events go on being fed). The reply future gets the machine's reply once every
notification before it is written (a task reply carries the committed record, paced, so the waiting request
reads nothing back); a stream that broke is `ClientLeft`, fed to the call by the writer, and what was still
queued for it is dropped. Imports the ports and the command vocabulary only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from proxy.tasks.live_call import KEEP_ALIVE, KeepAlive, LiveCall
from proxy.tasks.machine.commands import ClientLeft, Relay, Reply, ReplyKind, ReplyTask
from proxy.tasks.ports import Feed, Spawner
from proxy.wire.envelope import Channel
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord

WARM_SECONDS: Final = 8.0  # a held client that asked for progress hears some at least this often (under 10 s)
WARM_MESSAGE: Final = "still working"


class ClientSide:
    def __init__(self, paced: Callable[[TaskRecord], TaskRecord], feed: Feed, spawner: Spawner) -> None:
        self.paced = paced
        self.feed = feed
        self.spawner = spawner

    async def reply(self, call: LiveCall, command: Reply) -> None:
        reply = command.reply
        if isinstance(reply, ReplyTask) and reply.record is None and call.stored.record is not None:
            reply = ReplyTask(self.paced(call.stored.record))
        call.client.channel = None
        writer = call.client.writer
        if writer is None or writer.done():
            _answer(call, reply)  # nothing queued before it: answered at once
        else:
            call.client.outgoing.append(reply)  # after the notifications still being written

    async def relay(self, call: LiveCall, command: Relay) -> None:
        await self.note(call, command.message)

    async def note(self, call: LiveCall, message: JSON) -> None:
        """A notification already in the client's form (a forwarded MRTR retry's, from the replica that holds
        the call), queued behind what the call's writer still writes, as a relayed one is."""
        channel = call.client.channel
        if channel is None:
            return
        if message.get("method") == "notifications/progress":
            _heard(call, message.get("params"))
        call.client.outgoing.append(message)
        self._writing(call, channel)

    def keep_alive(self, call: LiveCall, comment: bool) -> None:
        """What keeps a waiting client's connection warm, queued behind what its writer still writes (the
        waiting request's own timer asks for it; the call's lock is not taken): a keep-alive comment when
        `comment` (a poll-to-sync client), and a progress notification for a client that sent a
        `progressToken` and heard no progress for WARM_SECONDS (the last value the upstream reported, else the
        proxy's own count), so that a client that resets its timeout on progress never gives up on a held
        call. None once the reply was given or the client is gone."""
        channel = call.client.channel
        if channel is None:
            return
        if comment:
            call.client.outgoing.append(KEEP_ALIVE)
        token = call.state.progress_token
        now = time.perf_counter()
        if token is not None and now - max(call.created_at, call.client.progress_at) >= WARM_SECONDS:
            call.client.progress_at = now
            call.client.warmed += 1
            progress = call.client.progress if call.client.progress is not None else call.client.warmed
            params = {"progressToken": token, "progress": progress, "message": WARM_MESSAGE}
            call.client.outgoing.append({"jsonrpc": "2.0", "method": "notifications/progress", "params": params})
        if call.client.outgoing:
            self._writing(call, channel)

    def _writing(self, call: LiveCall, channel: Channel) -> None:
        """The call's writer, started for what was just queued unless one is still writing."""
        writer = call.client.writer
        if writer is None or writer.done():
            call.client.writer = self.spawner.spawn(self._write(call, channel), f"client-{call.call_id}")

    async def _write(self, call: LiveCall, channel: Channel) -> None:
        """Writes what is queued for the call's client, oldest first, until nothing is left."""
        outgoing = call.client.outgoing
        while outgoing:
            item = outgoing.popleft()
            if not isinstance(item, dict | KeepAlive):
                _answer(call, item)
                continue
            try:
                if isinstance(item, KeepAlive):
                    await channel.keepalive(open_stream=True)
                else:
                    await channel.notify(item)
            except ConnectionResetError:
                call.client.channel = None
                # A reply still goes out; notifications and keep-alives for the broken stream are dropped.
                kept = [queued for queued in outgoing if not isinstance(queued, dict | KeepAlive)]
                outgoing.clear()
                outgoing.extend(kept)
                await self.feed.dispatch(call, ClientLeft())


def _heard(call: LiveCall, params: object) -> None:
    """A progress notification goes to the client: its connection is warm, and its value the latest."""
    call.client.progress_at = time.perf_counter()
    progress = params.get("progress") if isinstance(params, dict) else None
    if isinstance(progress, int | float) and not isinstance(progress, bool):
        call.client.progress = progress


def _answer(call: LiveCall, reply: ReplyKind) -> None:
    if call.client.reply is not None and not call.client.reply.done():
        call.client.reply.set_result(reply)
