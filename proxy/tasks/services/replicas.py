"""This process as one replica of a task store: its lease and fence, the change feed, the messages to and from
other replicas, and the take-over of gone replicas' tasks (a lease run out, and a whole lease since the store's
latest return to renew it, by the store's clock: docs/guides/replicas.md); what happened is reported to its
owner (the inbox). Imports the store and `remote.py`; never the runner, aiohttp or the front."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import structlog

from proxy.tasks.services import remote
from proxy.tasks.store import CANCEL, INPUT, RESYNC, STATUS, Change, Fence, FencedError, Message, StoreError, TaskStore
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

TAKEN_OVER: Final = "interrupted: the replica running it was lost"
TAKEN_OVER_RERUN: Final = "re-running: the replica running it was lost"
LEASE_LAPSED: Final = "interrupted: the replica running it lost its lease"
LEASE_LAPSED_RERUN: Final = "re-running: the replica running it lost its lease"
RENEWALS_PER_LEASE: Final = 3  # the lease is renewed this often within its own length
RETRIES_PER_LEASE: Final = 10  # ... and a failed renewal is tried again this often
FEED_RETRY_SECONDS: Final = 1.0  # after the change feed failed to start
NOTE_TIMEOUT_SECONDS: Final = 5.0  # a waiting client that does not take a relayed notification in time misses it
SUBSCRIBE_TIMEOUT_SECONDS: Final = 30.0
# On SQLite the change feed is this process's own: what another process (an operator's `tasks cancel`) leaves
# in the store is looked for this often, with one indexed read.
MESSAGE_POLL_SECONDS: Final = 1.0
ANSWERS_ACK_SECONDS: Final = 2.0  # how long a tasks/update waits for the owner to take the answers it relayed

_T = TypeVar("_T")


class ReplicaOwner(Protocol):
    """What the replica link reports to (`replica_inbox.py`). Each report returns at once: the owner starts whatever
    work it needs in the background, except take-overs, which the sweep waits for."""

    def spawn(self, coroutine: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]: ...

    def lease_changed(self, fence: Fence) -> None: ...

    async def taken_over(self, records: list[TaskRecord]) -> None: ...

    def settled_elsewhere(self, task_id: str, status: TaskStatus) -> None: ...

    def answers_arrived(self, task_id: str, answers: JSON) -> None: ...

    def resume_arrived(self, key: str, payload: JSON) -> None: ...

    def waiting_client_gone(self, key: str) -> None: ...

    def resync(self) -> None: ...


@dataclass(eq=False)
class Ask:
    """A request to another replica whose answer a client here waits for (an MRTR retry forwarded to the holder
    of its parked call)."""

    key: str
    replica: str
    reply: asyncio.Future[JSON]
    on_note: Callable[[JSON], Awaitable[None]] | None
    started: float = field(default_factory=time.monotonic)


class ReplicaLink:
    """With SQLite the process is the only replica: the lease never lapses and the feed carries its own changes. With
    PostgreSQL several replicas share the store. Each renews a lease (`store.lease_seconds`); every write it makes
    as a task's owner carries the lease's fence, so a replica whose lease lapsed (paused, cut off) can no longer
    change a task. A replica whose lease ran out is gone once it has also had a whole lease period, counted by the
    store's clock from the store's latest return (after an outage every replica saw), to renew it: at each sweep a
    survivor takes over a gone replica's live tasks. So a restart or a freeze of the store takes nothing over from
    replicas that reconnect at different instants, while one cut off alone (the others renewed all along) or killed
    loses its tasks a lease after it stopped renewing. A lapsed lease is resumed, not surrendered: once the store
    answers again, the replica renews (a new epoch) and asks the store what changed. A task it still shows as this
    replica's was taken over by nobody (a take-over moves the owner, and none can happen while the new lease
    holds): its call keeps running and writes under the new fence. A task a survivor took (its owner is the
    survivor now) is stopped here without writing. So a store outage that every replica saw costs no task, and a
    replica cut off while others reached the store loses its tasks to them, its late writes refused by the fence.
    What other replicas record for a task (a cancel settles it; answers are a message to its owner) wakes the owner
    through the feed. This module carries messages and reports what happened to its owner (the replica inbox,
    through `ReplicaOwner`); what a call does about it is the call machine's."""

    owner: ReplicaOwner  # what the link reports to, from `start` on

    def __init__(self, store: TaskStore, replica_id: str, lease_seconds: float) -> None:
        self.store = store
        self.replica_id = replica_id
        self.lease_seconds = lease_seconds
        self._fence = Fence(replica_id, 0)
        self._renewed_at = float("-inf")  # monotonic start of the last successful renewal
        self._reclaiming = asyncio.Lock()  # writes refused at once (after an outage) share one renewal
        self._subscribed = asyncio.Event()
        self._wake = asyncio.Event()  # messages may be waiting
        self._asks: dict[str, Ask] = {}
        self._watchers: dict[str, list[asyncio.Future[None]]] = {}  # task id → who waits for its record to change
        self._closed = False

    @property
    def fence(self) -> Fence:
        """What this replica's owner writes carry: the current lease's epoch."""
        return self._fence

    async def start(self, owner: ReplicaOwner) -> None:
        """Take the lease (before any task is written), listen to the feed (before any request is served), and
        report to `owner` from now on."""
        self.owner = owner
        await self._renew()
        log.info("lease_taken", replica=self.replica_id, epoch=self._fence.epoch)  # this process's name in the store
        self.owner.spawn(self._lease_forever(), "replica-lease")
        self.owner.spawn(self._feed_forever(), "replica-feed")
        self.owner.spawn(self._take_forever(), "replica-messages")
        if not self.store.replicas.shared:
            self.owner.spawn(self._poll_forever(), "replica-message-poll")
        async with asyncio.timeout(SUBSCRIBE_TIMEOUT_SECONDS):
            await self._subscribed.wait()

    async def close(self) -> None:
        """End the lease at once (a clean stop): survivors take the live tasks over at their next sweep."""
        self._closed = True
        for ask in self._asks.values():
            if not ask.reply.done():
                ask.reply.set_exception(remote.ReplicaLostError("Internal error: this proxy is shutting down"))
        try:
            await self.store.replicas.release_lease(self._fence)
        except StoreError as exc:
            log.warning("lease_not_released", error=str(exc))

    def lease_problem(self) -> str | None:
        """Why this replica may not hold its lease now (readiness), or None."""
        since = time.monotonic() - self._renewed_at
        if since > self.lease_seconds:
            return f"not renewed for {since:.1f} s (store.lease_seconds = {self.lease_seconds:g})"
        return None

    # --- the lease ------------------------------------------------------------------------------------------

    async def _renew(self) -> None:
        started = time.monotonic()
        fence = await self.store.replicas.renew_lease(self.replica_id, self.lease_seconds)
        self._renewed_at = started
        if fence != self._fence:
            lapsed = self._fence.epoch != 0
            self._fence = fence
            if lapsed:  # the lease ran out in between: tasks may have been taken over
                log.warning("lease_lost", replica=self.replica_id, epoch=fence.epoch)
                self.owner.lease_changed(fence)

    async def held_fence(self) -> Fence:
        """The fence a new task's writes carry. A lease not renewed for half its length may have lapsed (the store
        was away): it is renewed first, since a survivor would take over at once a task created under a lapsed
        lease. On the normal path, a clock read. StoreError when the store is away."""
        if time.monotonic() - self._renewed_at > self.lease_seconds / 2:
            await self._renew_once(time.monotonic())
        return self._fence

    async def _renew_once(self, asked: float) -> None:
        """Renew, unless a renewal began since `asked` (writes refused at once share one)."""
        async with self._reclaiming:
            if self._renewed_at < asked:
                await self._renew()

    async def reclaim(self, task_id: str) -> Fence | None:
        """A write for `task_id` was refused by its fence: renew the lease now (a new epoch if it lapsed) and say
        whether the task is still this replica's. The fence to write under again, or None when another replica
        owns the task (or it ended): then its call stops without writing. StoreError when the store is away."""
        await self._renew_once(time.monotonic())
        record = await self.store.records.get(task_id)
        if record is None or record.status.terminal or record.owner != self.replica_id:
            return None
        return self._fence

    async def _lease_forever(self) -> None:
        """Renew `RENEWALS_PER_LEASE` times a lease; after a failure, every `RETRIES_PER_LEASE`th of it (the first
        failure of a row is logged), so that a lease lapses only in an outage of more than half of it."""
        failing_since: float | None = None
        while not self._closed:
            share = RENEWALS_PER_LEASE if failing_since is None else RETRIES_PER_LEASE
            await asyncio.sleep(self.lease_seconds / share)
            try:
                await self._renew()
            except StoreError as exc:
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("lease_not_renewed", replica=self.replica_id, error=str(exc))
                continue
            if failing_since is not None:
                failed = round(time.monotonic() - failing_since, 2)
                log.info("lease_renewed_again", replica=self.replica_id, epoch=self._fence.epoch, after_seconds=failed)
                failing_since = None

    # --- taking over dead replicas ------------------------------------------------------------------------

    async def sweep(self, take_over: bool = True) -> None:
        """Take over the live tasks of replicas whose lease ran out (one survivor gets each replica's tasks),
        unless `take_over` is False (this replica drains); give up on requests to replicas that died while a
        client here waited."""
        for dead in await self.store.replicas.expired_replicas() if take_over else []:
            if dead == self.replica_id:
                continue  # our own lease lapsed: the next renewal says so
            try:
                records = await self.store.replicas.take_over(dead, self._fence)
            except FencedError:
                return  # our lease lapsed too: we may not take anything over
            if records:
                log.warning("replica_taken_over", replica=dead, tasks=len(records))
                await self.owner.taken_over(records)
        await self._watch_asks()

    async def _watch_asks(self) -> None:
        due = [ask for ask in self._asks.values() if time.monotonic() - ask.started > self.lease_seconds]
        for replica in {ask.replica for ask in due}:
            if await self.store.replicas.replica_alive(replica):
                continue
            for ask in due:
                if ask.replica == replica and not ask.reply.done():
                    ask.reply.set_exception(remote.ReplicaLostError())

    # --- messages -------------------------------------------------------------------------------------------

    async def post_answers(self, task_id: str, answers: JSON) -> None:
        """Answers for the owner of a live task, stored as a message; returns once the owner changed the record
        (it took the answers: a `tasks/get` anywhere shows them answered, as after a local update), or after
        ANSWERS_ACK_SECONDS (the message stays for the owner, or for whoever takes the task over)."""
        changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watchers.setdefault(task_id, []).append(changed)  # before the message: its change is not missed
        try:
            if await self.store.replicas.notify_owner(task_id, INPUT, {"answers": answers}) is None:
                return  # settled meanwhile
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(changed), ANSWERS_ACK_SECONDS)
        finally:
            waiting = self._watchers.get(task_id, [])
            if changed in waiting:
                waiting.remove(changed)
            if not waiting:
                self._watchers.pop(task_id, None)

    async def send(self, replica: str, kind: str, key: str, payload: JSON) -> None:
        await self.store.replicas.notify_replica(replica, kind, key, payload)

    async def ask(
        self, replica: str, kind: str, payload: JSON, on_note: Callable[[JSON], Awaitable[None]] | None = None
    ) -> Ask:
        """Send a request whose REPLY (and NOTEs before it) come back here; the REPLY resolves `Ask.reply`."""
        ask = Ask(secrets.token_urlsafe(16), replica, asyncio.get_running_loop().create_future(), on_note)
        self._asks[ask.key] = ask
        try:
            await self.send(replica, kind, ask.key, payload)
        except BaseException:
            del self._asks[ask.key]
            raise
        return ask

    def abandon(self, ask: Ask) -> None:
        """The waiting client went away: the replica that serves the request is told, in the background."""
        if not ask.reply.done():
            ask.reply.cancel()
        if self._asks.pop(ask.key, None) is not None and not self._closed:
            self.owner.spawn(self._left(ask), f"left-{ask.key}")

    async def _left(self, ask: Ask) -> None:
        with contextlib.suppress(StoreError):
            await self.send(ask.replica, remote.LEFT, ask.key, {})

    # --- the change feed ----------------------------------------------------------------------------------

    async def _feed_forever(self) -> None:
        while not self._closed:
            try:
                async with self.store.replicas.changes(for_replica=self.replica_id) as changes:
                    self._subscribed.set()
                    async for change in changes:
                        self._on_change(change)
            except StoreError as exc:
                log.warning("change_feed_failed", error=str(exc))
            if not self._closed:
                await asyncio.sleep(FEED_RETRY_SECONDS)

    def _on_change(self, change: Change) -> None:
        if change.kind == RESYNC:  # changes may have been missed: re-read what we follow
            self.owner.resync()
            self._wake.set()
        elif change.kind == STATUS:
            for changed in self._watchers.pop(change.key, []):
                if not changed.done():
                    changed.set_result(None)
            if change.recipient == self.replica_id and change.status is not None and change.status.terminal:
                self.owner.settled_elsewhere(change.key, change.status)
        elif change.recipient == self.replica_id:
            self._wake.set()

    async def _take_forever(self) -> None:
        """Take every message addressed here whenever the feed says some are waiting (a burst is one take)."""
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            try:
                messages = await self.store.replicas.take_messages(self.replica_id)
            except StoreError as exc:
                log.warning("messages_not_taken", error=str(exc))
                continue
            for message in messages:
                await self._route(message)

    async def _poll_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(MESSAGE_POLL_SECONDS)
            try:
                if await self.store.replicas.pending_messages(self.replica_id):
                    self._wake.set()
            except StoreError as exc:
                log.warning("messages_not_polled", error=str(exc))

    async def _route(self, message: Message) -> None:
        payload = message.payload if isinstance(message.payload, dict) else {}
        if message.kind == INPUT:
            answers = payload.get("answers")
            if isinstance(answers, dict):
                self.owner.answers_arrived(message.key, answers)
        elif message.kind == CANCEL:  # an operator's cancel from another process: the record is settled already
            self.owner.settled_elsewhere(message.key, TaskStatus.CANCELLED)
        elif message.kind == remote.RESUME:
            self.owner.resume_arrived(message.key, payload)
        elif message.kind == remote.LEFT:
            self.owner.waiting_client_gone(message.key)
        elif message.kind == remote.NOTE:
            ask = self._asks.get(message.key)
            note = payload.get("message")
            if ask is not None and ask.on_note is not None and isinstance(note, dict):
                with contextlib.suppress(TimeoutError, OSError):  # a client gone: it misses the note
                    await asyncio.wait_for(ask.on_note(note), NOTE_TIMEOUT_SECONDS)
        elif message.kind == remote.REPLY:
            ask = self._asks.pop(message.key, None)
            if ask is not None and not ask.reply.done():
                ask.reply.set_result(payload)
        else:
            log.warning("message_unknown", kind=message.kind)


class RemoteChannel:
    """The stream of a client that waits on another replica: each notification goes there as a NOTE message
    (in order, before the REPLY). A notification that cannot be stored is dropped, as on a slow stream."""

    def __init__(self, link: ReplicaLink, replica: str, key: str) -> None:
        self.link = link
        self.replica = replica
        self.key = key

    async def notify(self, message: JSON, *, required: bool = False) -> None:
        try:
            await self.link.send(self.replica, remote.NOTE, self.key, {"message": message})
        except StoreError as exc:
            log.warning("note_not_sent", to=self.replica, error=str(exc))

    async def keepalive(self, *, open_stream: bool = False) -> None:
        return None  # the replica the client is connected to keeps its stream alive
