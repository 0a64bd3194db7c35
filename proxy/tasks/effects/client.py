"""The waiting client's side of a call (`Reply`, `Relay`): its reply future gets the machine's reply (a task
reply carries the committed record, paced, so the waiting request reads nothing back), and notifications go
to its stream; a stream that broke is `ClientLeft`. Imports the ports and the command vocabulary only.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.tasks.commands import ClientLeft, Relay, Reply, ReplyTask
from proxy.tasks.live_call import LiveCall
from proxy.wire.tasks import TaskRecord


class ClientSide:
    def __init__(self, paced: Callable[[TaskRecord], TaskRecord]) -> None:
        self.paced = paced

    async def reply(self, call: LiveCall, command: Reply) -> None:
        reply = command.reply
        if isinstance(reply, ReplyTask) and reply.record is None and call.stored.record is not None:
            reply = ReplyTask(self.paced(call.stored.record))
        if call.client.reply is not None and not call.client.reply.done():
            call.client.reply.set_result(reply)
        call.client.channel = None

    async def relay(self, call: LiveCall, command: Relay) -> ClientLeft | None:
        if call.client.channel is None:
            return None
        try:
            await call.client.channel.notify(command.message)
        except ConnectionResetError:
            call.client.channel = None
            return ClientLeft()
        return None
