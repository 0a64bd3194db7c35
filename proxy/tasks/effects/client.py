"""The waiting client's side of a call (`Reply`, `Relay`, keep-alive comments): one writer per client stream, and
the only module that changes a call's `ClientEnd`. What goes to the client is queued, in order, for one writer
task, never written under the call's lock: a slow client holds up only its writer, and what waits for it is
bounded (`limits.max_client_backlog_bytes`: a newer progress replaces an older one, notifications past the cap are
dropped, the reply never). Imports the ports, the command vocabulary and the wire's JSON writer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from proxy.config.schema import Config
from proxy.observe.metrics import Metrics
from proxy.tasks.live_call import KEEP_ALIVE, PROGRESS, KeepAlive, LiveCall
from proxy.tasks.machine.commands import ClientLeft, Relay, Reply, ReplyKind, ReplyTask
from proxy.tasks.ports import Feed, Spawner
from proxy.wire.envelope import Channel
from proxy.wire.jsonrpc import JSON, dumps
from proxy.wire.tasks import TaskRecord

log = structlog.get_logger(__name__)


class ClientSide:
    def __init__(
        self,
        paced: Callable[[TaskRecord], TaskRecord],
        feed: Feed,
        spawner: Spawner,
        config: Callable[[], Config],
        metrics: Metrics | None = None,
    ) -> None:
        self.paced = paced
        self.feed = feed
        self.spawner = spawner
        self.config = config  # the config in force: its backlog cap, read at each notification queued
        self.metrics = metrics

    # --- the waiting request ------------------------------------------------------------------------------

    def wait(self, call: LiveCall, channel: Channel | None) -> asyncio.Future[ReplyKind]:
        """A request waits for the call's reply from now on, its notifications going to `channel`."""
        reply = call.client.reply = asyncio.get_running_loop().create_future()
        call.client.channel = channel
        return reply

    def left(self, call: LiveCall) -> None:
        """The waiting request is gone: nothing more is written to its stream."""
        call.client.channel = None

    def gone(self, call: LiveCall) -> None:
        """Nobody waits for the call's reply any more (a forwarded retry's client went away on its replica)."""
        if call.client.reply is not None and not call.client.reply.done():
            call.client.reply.cancel()

    def answer(self, call: LiveCall, reply: ReplyKind) -> None:
        """The waiting request's reply, given at once (a stand-in's, from the replica that holds the call)."""
        _answer(call, reply)

    # --- the commands ---------------------------------------------------------------------------------------

    async def reply(self, call: LiveCall, command: Reply) -> None:
        reply = command.reply
        if isinstance(reply, ReplyTask) and reply.record is None and call.stored.record is not None:
            reply = ReplyTask(self.paced(call.stored.record))
        call.client.channel = None
        writer = call.client.writer
        if writer is None or writer.done():
            _answer(call, reply)  # nothing queued before it: answered at once
        else:
            call.client.queue(reply)  # after the notifications still being written

    async def relay(self, call: LiveCall, command: Relay) -> None:
        await self.note(call, command.message)

    async def note(self, call: LiveCall, message: JSON) -> None:
        """A notification for the client's stream (relayed, or in the client's form already: a forwarded MRTR
        retry's, from the replica that holds the call), queued behind what the call's writer still writes."""
        channel = call.client.channel
        if channel is None:
            return
        self._into_backlog(call, message)
        self._writing(call, channel)

    def _into_backlog(self, call: LiveCall, message: JSON) -> None:
        """Queued, and counted, unless the client is so slow that it cannot take it: while the writer is stuck
        on a write, a newer progress replaces an older one still waiting; past the cap it is dropped."""
        client = call.client
        size = len(dumps(message))
        if client.writing and message.get("method") == PROGRESS and client.replace_progress(message, size):
            self._count("coalesced")
            return
        cap = self.config().limits.max_client_backlog_bytes
        if client.backlog_bytes + size <= cap:
            client.queue(message, size)
            return
        client.dropped += 1
        self._count("backlog_full")
        if client.dropped == 1:
            log.warning(
                "client_backlog_full",
                task_id=call.state.task_id,
                name=call.name,
                backlog_bytes=client.backlog_bytes,
                max_client_backlog_bytes=cap,
                detail="the client reads its stream slower than the upstream sends: further notifications are "
                "dropped until it catches up; the call's answer is kept",
            )

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.client_notifications_dropped.labels(reason).inc()

    def keep_alive(self, call: LiveCall) -> None:
        """A keep-alive comment for a poll-to-sync client still waiting, queued behind what its writer still
        writes (the waiting request's own timer asks for it; the call's lock is not taken). None once the reply
        was given or the client is gone."""
        channel = call.client.channel
        if channel is None:
            return
        call.client.queue(KEEP_ALIVE)
        self._writing(call, channel)

    # --- the writer -----------------------------------------------------------------------------------------

    def _writing(self, call: LiveCall, channel: Channel) -> None:
        """The call's writer, started for what was just queued unless one is still writing."""
        writer = call.client.writer
        if writer is None or writer.done():
            call.client.writer = self.spawner.spawn(self._write(call, channel), f"client-{call.call_id}")

    async def _write(self, call: LiveCall, channel: Channel) -> None:
        """Writes what is queued for the call's client, oldest first, until nothing is left."""
        client = call.client
        while (item := client.next()) is not None:
            if not isinstance(item, dict | KeepAlive):
                _answer(call, item)
                continue
            client.writing = True
            try:
                if isinstance(item, KeepAlive):
                    await channel.keepalive(open_stream=True)
                else:
                    await channel.notify(item)
            except ConnectionResetError:
                client.channel = None
                client.drop_notes()  # a reply still goes out; notifications for the broken stream do not
                await self.feed.dispatch(call, ClientLeft())
            finally:
                client.writing = False


def _answer(call: LiveCall, reply: ReplyKind) -> None:
    if call.client.reply is not None and not call.client.reply.done():
        call.client.reply.set_result(reply)
