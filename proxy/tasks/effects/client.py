"""The waiting client's side of a call (`Reply`, `Relay`): one writer per client stream. Notifications and
the final reply go through one queue (`ClientEnd.outgoing`) to one writer task, in the order the machine gave
them, and none is written under the call's lock: a client slow to read holds up only its own writer, never the
call (the upstream's events go on being fed). The reply future gets the machine's reply once every
notification before it is written (a task reply carries the committed record, paced, so the waiting request
reads nothing back); a stream that broke is `ClientLeft`, fed to the call by the writer, and what was still
queued for it is dropped. Imports the ports and the command vocabulary only.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.tasks.commands import ClientLeft, Relay, Reply, ReplyKind, ReplyTask
from proxy.tasks.live_call import LiveCall
from proxy.tasks.ports import Feed, Spawner
from proxy.wire.envelope import Channel
from proxy.wire.tasks import TaskRecord


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
        channel = call.client.channel
        if channel is None:
            return
        call.client.outgoing.append(command.message)
        writer = call.client.writer
        if writer is None or writer.done():
            call.client.writer = self.spawner.spawn(self._write(call, channel), f"client-{call.call_id}")

    async def _write(self, call: LiveCall, channel: Channel) -> None:
        """Writes what is queued for the call's client, oldest first, until nothing is left."""
        outgoing = call.client.outgoing
        while outgoing:
            item = outgoing.popleft()
            if not isinstance(item, dict):
                _answer(call, item)
                continue
            try:
                await channel.notify(item)
            except ConnectionResetError:
                call.client.channel = None
                kept = [queued for queued in outgoing if not isinstance(queued, dict)]  # a reply still goes out
                outgoing.clear()
                outgoing.extend(kept)
                await self.feed.dispatch(call, ClientLeft())


def _answer(call: LiveCall, reply: ReplyKind) -> None:
    if call.client.reply is not None and not call.client.reply.done():
        call.client.reply.set_result(reply)
