"""`subscriptions/listen`: one long-lived stream of the notifications a client opted in to (the upstream's list
changes and resource updates; `notifications/tasks` for the tasks it named), capped in total, per caller and in
task ids. Imports the tasks facade, the upstream pool and the wire; never aiohttp."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import structlog
from mcp_types import SERVER_INFO_META_KEY

from proxy.config.schema import LimitsConfig
from proxy.errors import CallerLimitError, InvalidParamsError, MissingCapabilityError, TaskLimitError, UpstreamError
from proxy.observe import span_attributes, tracing
from proxy.tasks.runner import Tasks
from proxy.tasks.services.push import ListenInbox, TaskWatchers
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import Session
from proxy.wire import tasks as wire_tasks
from proxy.wire import translate
from proxy.wire.envelope import Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON, notification_message, result_message
from proxy.wire.tasks import TaskRecord

log = structlog.get_logger(__name__)

KEEPALIVE_SECONDS: Final = 15.0  # SSE comment on idle listen streams, so intermediaries keep them open
PROGRESS_COALESCE_SECONDS: Final = 0.2  # a task whose status stays the same is sent at most this often


class ListenStreams:
    """The acknowledgement first (with what the proxy honours), then: the upstream's list-changed and resource-updated
    notifications, read from the caller's shared upstream session; and, for a client that declared the Tasks
    extension, `notifications/tasks` for each change of the tasks it named in `taskIds` (its own, unexpired ones:
    other ids are left out without a trace), each carrying the complete task as `tasks/get` returns it. A task
    already settled is sent once at once. Progress-only changes of one task are sent at most every
    PROGRESS_COALESCE_SECONDS, with the latest state. The stream ends with its graceful result at shutdown, or when
    it falls behind (the client polls, or listens again). Caps: streams in total and per caller (the owner of its
    tasks: every token of one `security.jwt` owner counts alike), task ids per stream. Imports the runner, the
    upstream pool and the wire; never aiohttp."""

    def __init__(
        self, limits: Callable[[], LimitsConfig], pool: SessionPool, tasks: Tasks, watchers: TaskWatchers
    ) -> None:
        self._limits = limits  # the limits in force, read at each stream (a live reload swaps what it returns)
        self.pool = pool
        self.tasks = tasks
        self.watchers = watchers
        self._open: Counter[str] = Counter()  # open streams per caller (the owner of its tasks)

    @property
    def limits(self) -> LimitsConfig:
        return self._limits()

    @property
    def open_streams(self) -> int:
        return sum(self._open.values())

    async def serve(self, request: ModernRequest, caller: Caller, channel: Channel) -> JSON:
        wanted = request.params.get("notifications")
        wanted = wanted if isinstance(wanted, dict) else {}
        limits = self.limits  # once per stream
        task_ids = self._task_ids(request, wanted, limits)
        caller_key = self.tasks.owner(caller)  # a verified JWT counts as its owner, not the token
        if sum(self._open.values()) >= limits.max_listen_streams:
            raise TaskLimitError("max_listen_streams", limits.max_listen_streams)
        if self._open[caller_key] >= limits.max_listen_streams_per_principal:
            raise CallerLimitError("max_listen_streams_per_principal", limits.max_listen_streams_per_principal)
        self._open[caller_key] += 1
        try:
            async with self.pool.use(caller.principal) as session:
                return await _Stream(self, request, caller, channel, session).run(wanted, task_ids)
        finally:
            self._open[caller_key] -= 1
            if not self._open[caller_key]:
                del self._open[caller_key]

    def _task_ids(self, request: ModernRequest, wanted: JSON, limits: LimitsConfig) -> list[str] | None:
        if "taskIds" not in wanted:
            return None
        if not request.declares_tasks:  # task notifications are the extension's
            raise MissingCapabilityError(
                wire_tasks.REQUIRED_CAPABILITY,
                "Missing required client capability: taskIds need the io.modelcontextprotocol/tasks extension",
            )
        ids = wanted["taskIds"]
        if not isinstance(ids, list) or not all(isinstance(task_id, str) for task_id in ids):
            raise InvalidParamsError("Invalid params: notifications.taskIds must be a list of task ids")
        if len(ids) > limits.max_listen_task_ids:
            raise CallerLimitError("max_listen_task_ids", limits.max_listen_task_ids)
        return list(dict.fromkeys(ids))


class _Stream:
    """One listen stream, from its acknowledgement to its graceful result."""

    def __init__(
        self, streams: ListenStreams, request: ModernRequest, caller: Caller, channel: Channel, session: Session
    ) -> None:
        self.streams = streams
        self.request = request
        self.channel = channel
        self.session = session
        self.tasks = streams.tasks
        self.owner = self.tasks.owner(caller)
        self.tag = {translate.SUBSCRIPTION_ID_META_KEY: request.id}
        self.inbox = ListenInbox()
        self.sent: dict[str, tuple[str, int, float]] = {}  # task id → (status, lastUpdatedAt, when) last sent
        self.due: dict[str, float] = {}  # task id → when its coalesced change may be sent

    async def run(self, wanted: JSON, task_ids: list[str] | None) -> JSON:
        initialize_result = await self.session.ensure_initialized()
        capabilities = initialize_result.get("capabilities")
        honoured = translate.honoured_filter(wanted, capabilities if isinstance(capabilities, dict) else {})
        self.session.subscribers.subscribe(self.inbox)
        subscribed: list[str] = []
        settled: list[TaskRecord] = []
        try:
            for uri in honoured.get("resourceSubscriptions", []):
                try:
                    await self.session.subscribers.subscribe_resource(uri)
                    subscribed.append(uri)
                except UpstreamError as exc:
                    log.info("upstream_resource_subscribe_refused", error=exc.message)
            if "resourceSubscriptions" in honoured:
                honoured["resourceSubscriptions"] = subscribed
            if task_ids is not None:
                honoured["taskIds"], settled = await self._own_tasks(task_ids)
            ack = {"_meta": self.tag, "notifications": honoured}
            await self.channel.notify(
                notification_message("notifications/subscriptions/acknowledged", ack), required=True
            )
            for record in settled:  # settled before the stream began: told once, at once
                await self._send(record)
            await self._loop(honoured)
        finally:
            self.session.subscribers.unsubscribe(self.inbox)
            self.streams.watchers.drop(self.inbox)
            for uri in subscribed:
                await asyncio.shield(self._unsubscribe(uri))
        server_info = translate.implementation(initialize_result)
        meta: JSON = {**self.tag, **({SERVER_INFO_META_KEY: server_info} if server_info else {})}
        return result_message(self.request.id, {"resultType": "complete", "_meta": meta})

    async def _own_tasks(self, task_ids: list[str]) -> tuple[list[str], list[TaskRecord]]:
        """The caller's own, unexpired tasks among `task_ids`: followed (before they are read, so no change is
        missed in between); the settled ones are returned to be sent once."""
        self.streams.watchers.follow(self.inbox, task_ids)
        honoured: list[str] = []
        settled: list[TaskRecord] = []
        for task_id in task_ids:
            record = await self._read(task_id)
            if record is None:
                self.streams.watchers.drop(self.inbox, [task_id])
                continue
            honoured.append(task_id)
            if record.status.terminal:
                settled.append(record)
        return honoured, settled

    async def _read(self, task_id: str) -> TaskRecord | None:
        return await self.tasks.peek(task_id, self.owner)

    async def _loop(self, honoured: JSON) -> None:
        while True:
            now = time.monotonic()
            next_due = min(self.due.values(), default=now + KEEPALIVE_SECONDS)
            woken = await self.inbox.wait(max(0.0, min(next_due - now, KEEPALIVE_SECONDS)))
            if not woken and not self.due:
                await self.channel.keepalive()
            while self.inbox.messages:
                relayed = translate.listen_notification(self.inbox.messages.popleft(), honoured, self.request.id)
                if relayed is not None:
                    await self.channel.notify(relayed, required=True)
            if self.inbox.ended is not None:
                if self.inbox.ended.lagging:
                    log.info("listen_stream_fell_behind", subscription_id=self.request.id)
                return
            now = time.monotonic()
            ready = [task_id for task_id, at in self.due.items() if at <= now]
            changed = self.inbox.changed | set(ready)
            self.inbox.changed.clear()
            for task_id in changed:
                self.due.pop(task_id, None)
                await self._changed(task_id, now)

    async def _changed(self, task_id: str, now: float) -> None:
        record = await self._read(task_id)
        if record is None:  # gone (expired, purged): nothing more will come
            self.streams.watchers.drop(self.inbox, [task_id])
            return
        last = self.sent.get(task_id)
        if last is not None and (last[0], last[1]) == (record.status.value, record.updated_at_ms):
            return  # nothing the client has not seen
        progress_only = last is not None and not record.status.terminal and last[0] == record.status.value
        if last is not None and progress_only and now - last[2] < PROGRESS_COALESCE_SECONDS:
            self.due[task_id] = last[2] + PROGRESS_COALESCE_SECONDS  # the latest state, a little later
            return
        await self._send(record)

    async def _send(self, record: TaskRecord) -> None:
        task: dict[str, Any] = wire_tasks.detailed_task(self.tasks.paced(record))
        message = notification_message("notifications/tasks", {"_meta": self.tag, **task})
        await self.channel.notify(message, required=True)
        tracing.event("task_pushed", {span_attributes.TASK_ID: record.task_id, "mcp.task.status": record.status.value})
        self.tasks.pushed(record.status.value)
        self.sent[record.task_id] = (record.status.value, record.updated_at_ms, time.monotonic())
        if record.status.terminal:
            self.streams.watchers.drop(self.inbox, [record.task_id])

    async def _unsubscribe(self, uri: str) -> None:
        try:
            await self.session.subscribers.unsubscribe_resource(uri)
        except UpstreamError as exc:  # best effort: the subscription ends either way
            log.info("upstream_resource_unsubscribe_failed", error=exc.message)
