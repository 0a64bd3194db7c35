"""The proxy's own upstream sessions: which one serves a request (`use`: the principal's shared one; `lease`: one
of its own for a call that could be asked; `adopt`: one a previous process left), bounded as the kind says.
Knows no kind and writes no session field; the sessions know nothing of the pool."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import structlog

from proxy.errors import ProxyError, UpstreamLimitError
from proxy.principals import Identity
from proxy.upstream.pool._askers import QuestionOwners
from proxy.upstream.pool._facts import ToolFactsReader
from proxy.upstream.session import Session, SessionKind, Sink
from proxy.wire.jsonrpc import JSON
from proxy.wire.upstream_events import UpstreamNotification

log = structlog.get_logger(__name__)


class SessionPool:
    """Which upstream session serves a request.

    One pool for every kind of upstream session (`session.py`): a `SessionKind` makes the sessions and says, in its
    `PoolLimits`, how they are bounded. The pool knows no kind.

    - `use(principal)`: the principal's shared session, for requests that cannot ask the client anything (lists,
      discover, completion, listen streams). A legacy server may bind a session to a token, so sessions are never
      shared between principals.
    - `lease(principal, sink, asks=...)`: a session of the principal that nothing else uses while the lease
      lasts, for a call that may ask the client something (`tools/call`, `prompts/get`, `resources/read`). The
      upstream may send that question naming no request (an HTTP session's GET stream; anything on a stdio
      process); on a leased session it can only be the lessee's, so it goes to `sink`. Where sessions are costly
      (`share_quiet_calls`: stdio processes) a call whose client could not answer anyway (`asks=False`) runs on
      the principal's shared session instead, unless it was seen asking before (`_askers.py`).
    - `adopt(principal, session_id, sink)`: the same, on a session an earlier proxy process initialized (it holds a
      task the upstream runs itself, resumed after a restart): no `initialize`.
    - `keep(session)`: a session whose upstream work outlives this process is let go without ending that work.

    The pool lends a session (`Session.lending.lend`) and takes it back (`Session.lending.take_back`); it writes no
    session's fields.

    List changes and resource updates seen on a lent session reach the principal's listen streams too. Sessions
    nobody uses are kept for reuse, least recently used first out: beyond `max_idle` idle sessions the oldest is
    closed; a lent session idle for `idle_seconds` is closed. With `max_open`, a new session beyond it first closes
    an idle one, else waits (bounded) for one to come free and then fails with UpstreamLimitError. Imports the
    session protocols; the sessions know nothing of the pool."""

    def __init__(self, kind: SessionKind) -> None:
        self.kind = kind
        self.limits = kind.limits
        self._shared: dict[str, Session] = {}  # principal key → its shared session
        # what a call needs to know before it starts (its tool's facts), kept with the principal's shared session
        self.facts = ToolFactsReader(kind, self.use, lambda key, session: self._shared.get(key) is session)
        self._spare: dict[str, list[Session]] = {}  # principal key → idle sessions to lease
        self._users: dict[Session, int] = {}
        self._idle: OrderedDict[Session, str] = OrderedDict()  # idle session → its principal key, oldest first
        self._open: set[Session] = set()  # every session made and not yet closed (closing ones included)
        self._closing: set[Session] = set()
        self._reserved = 0  # room taken by processes the pool does not hold (legacy clients' own sessions)
        self._lent: set[Session] = set()  # sessions lent to a call right now
        self._reclaims: dict[Session, Callable[[], bool]] = {}  # lent sessions whose call may give them up
        self._reclaiming: set[Session] = set()  # asked to give up, not back yet
        self._idle_timers: dict[Session, asyncio.TimerHandle] = {}
        self._changed = asyncio.Event()  # set (and replaced) whenever a session comes free or is closed
        self.questions = QuestionOwners()  # whose call a question naming no request is

    @property
    def server_info(self) -> JSON | None:
        """The upstream's serverInfo from the latest initialize (on any session)."""
        return self.kind.learned.server_info

    # --- handing sessions out ----------------------------------------------------------------------------

    def key_of(self, principal: Identity | None) -> str:
        """What the principal's sessions are kept under: its credential's hash, or its verified owner's where the
        proxy makes its upstream credential itself (`upstream.credentials`: a refreshed token keeps them). The
        credential source also hears of the caller here, at every use (the freshest token it presented)."""
        credentials = self.kind.credentials
        if not credentials.forwards:
            credentials.seen(principal)
        return credentials.session_key(principal)

    def session(self, principal: Identity | None) -> Session:
        """The principal's shared session (created on first use, not bounded by `max_open`). Prefer `use()`,
        which waits for room and keeps it from being evicted while in use."""
        key = self.key_of(principal)
        session = self._shared.get(key)
        if session is None:
            session = self._shared[key] = self._make(principal)
            self._idle[session] = key
            self._evict()
        return session

    def use(self, principal: Identity | None) -> AbstractAsyncContextManager[Session]:
        """The principal's shared session while the context lasts (waiting for room when the kind is bounded)."""
        return _Use(self, principal)

    async def _use(self, principal: Identity | None, key: str) -> Session:
        deadline = asyncio.get_running_loop().time() + self.limits.wait_seconds
        while key not in self._shared and not self._has_room():
            await self._wait_for_room(deadline, evict=True)
        session = self.session(principal)
        self._take(session)
        return session

    def lease(
        self,
        principal: Identity | None,
        sink: Sink,
        *,
        asks: bool = True,
        reclaim: Callable[[], bool] | None = None,
        asker: str | None = None,
    ) -> AbstractAsyncContextManager[Session]:
        """A session of the principal for one call alone, initialized before it is handed out; its unsolicited
        traffic goes to `sink` until the lease ends. `asks`: the call's client could answer a question; a call
        whose client could not runs on the principal's shared session instead, unless its `asker` (method and
        name) was seen asking before (`_askers.py`); there a question naming no request is the call's
        while no other call runs there, else it is refused. `reclaim`: when bounded sessions run out, the pool
        may ask the lessee to give its session up; it returns whether it will (e.g. a call parked between MRTR
        rounds, which ends as if nobody had retried)."""
        sink = self.questions.learning(asker, sink)
        if self.limits.share_quiet_calls and (
            self.limits.max_open == 1 or not (asks or self.questions.asked_before(asker))
        ):
            return _SharedLease(self, principal, sink)
        return self._lend(principal, sink, reclaim)

    @asynccontextmanager
    async def _lend(
        self, principal: Identity | None, sink: Sink, reclaim: Callable[[], bool] | None
    ) -> AsyncIterator[Session]:
        key = self.key_of(principal)
        session = await self._lendable(principal, key)
        async with self._lent_to(session, key, reclaim):
            self._keep_one_warm(principal, key)
            await session.ensure_initialized()
            session.lending.lend(sink, self._notifications_of(key))
            yield session

    @asynccontextmanager
    async def adopt(self, principal: Identity | None, session_id: str | None, sink: Sink) -> AsyncIterator[Session]:
        """A lease on the upstream session `session_id`, which an earlier proxy process initialized and left
        behind with a task the upstream still runs: taken over without `initialize`, its GET stream opened again.
        None (a stateless upstream, where any session serves): an ordinary lease."""
        if session_id is None:
            async with self.lease(principal, sink) as session:
                yield session
            return
        key = self.key_of(principal)
        deadline = asyncio.get_running_loop().time() + self.limits.wait_seconds
        while not (self._has_room() and self._may_lend()):
            await self._wait_for_room(deadline, evict=self._may_lend())
        session = self._make(principal)
        async with self._lent_to(session, key, None):
            await session.adopt(session_id)
            session.lending.lend(sink, self._notifications_of(key))
            yield session

    @asynccontextmanager
    async def _lent_to(self, session: Session, key: str, reclaim: Callable[[], bool] | None) -> AsyncIterator[None]:
        self._take(session)
        self._lent.add(session)
        if reclaim is not None:
            self._reclaims[session] = reclaim
        try:
            yield
        finally:
            session.lending.take_back()
            self._lent.discard(session)
            self._reclaims.pop(session, None)
            self._reclaiming.discard(session)
            self._release(session, key, spare=True)
            self._signal()

    def keep(self, session: Session) -> None:
        """The session holds upstream work a later proxy process resumes (a task the upstream runs itself): when
        its use ends it is let go without ending that work (no DELETE)."""
        session.lending.keep()

    async def _lendable(self, principal: Identity | None, key: str) -> Session:
        """A spare session of the principal, else a new one (waiting for room when the kind is bounded)."""
        deadline = asyncio.get_running_loop().time() + self.limits.wait_seconds
        while True:
            if self._may_lend():
                session = self._pop_spare(key)
                if session is not None:
                    return session
                if self._has_room():
                    return self._make(principal)
            else:
                self._reclaim_one()
            await self._wait_for_room(deadline, evict=self._may_lend())

    def warm_up(self) -> None:
        """At start, where sessions are costly to start (stdio processes): the anonymous caller's shared session
        and one spare start in the background, so the first requests do not wait for a server to start."""
        if not self.limits.share_quiet_calls:
            return
        shared = self.session(None)
        self.kind.spawn(self._warm_up(shared), "upstream-session-warm-up")
        self._keep_one_warm(None, self.key_of(None))

    def _keep_one_warm(self, principal: Identity | None, key: str) -> None:
        """Where sessions are costly to start (stdio processes), a principal that borrows one gets a spare
        started in the background, so its next call that can ask does not wait for a start; only when there is
        room for it and for the one place left to shared sessions."""
        maximum = self.limits.max_open
        if not self.limits.keep_warm or self._spare.get(key) or maximum is None:
            return
        if len(self._open) + self._reserved + 1 >= maximum or len(self._lent) + self._reserved + 1 >= maximum - 1:
            return
        session = self._make(principal)
        self._spare.setdefault(key, []).append(session)
        self._idle[session] = key
        self.kind.spawn(self._warm_up(session), "upstream-session-warm-up")

    async def _warm_up(self, session: Session) -> None:
        try:
            await session.ensure_initialized()
        except ProxyError as exc:
            log.warning("upstream_session_warm_up_failed", error=exc.message, detail=exc.detail)
            if session not in self._users and session in self._idle:
                self._close(session)
            return
        shared = session in self._shared.values()
        if session not in self._users and not shared and self.limits.idle_seconds is not None:
            loop = asyncio.get_running_loop()
            self._idle_timers[session] = loop.call_later(self.limits.idle_seconds, self._close, session)

    def _notifications_of(self, key: str) -> Callable[[UpstreamNotification], None]:
        """Where notifications seen on a session lent to the principal go: a list change or resource update
        reaches the principal's listen streams, which read its shared session."""

        def to_shared(notification: UpstreamNotification) -> None:
            shared = self._shared.get(key)
            if shared is not None:
                shared.subscribers.deliver(notification)

        return to_shared

    def _make(self, principal: Identity | None) -> Session:
        session = self.kind.new(principal)
        self._open.add(session)
        return session

    def _pop_spare(self, key: str) -> Session | None:
        spare = self._spare.get(key)
        if not spare:
            return None
        session = spare.pop()
        if not spare:
            del self._spare[key]
        return session

    def _take(self, session: Session) -> None:
        self._users[session] = self._users.get(session, 0) + 1
        self._idle.pop(session, None)
        timer = self._idle_timers.pop(session, None)
        if timer is not None:
            timer.cancel()

    def _release(self, session: Session, key: str, *, spare: bool = False) -> None:
        users = self._users.get(session, 1) - 1
        if users > 0:
            self._users[session] = users
            return
        self._users.pop(session, None)
        if session.lending.kept:
            self._close(session)  # a kept session's close only lets go of it (see `Session.detach`)
            return
        if session.subscribers.subscriptions:
            return  # a listen stream still reads it (it ends with its own use)
        if spare:
            if session.initialize_result is None:  # never initialized, or forgotten (or crashed) upstream
                self._close(session)
                return
            self._spare.setdefault(key, []).append(session)
            if self.limits.idle_seconds is not None:
                loop = asyncio.get_running_loop()
                self._idle_timers[session] = loop.call_later(self.limits.idle_seconds, self._close, session)
        self._idle[session] = key
        self._evict()
        self._signal()

    # --- bounds -----------------------------------------------------------------------------------------

    def surely_room(self) -> bool:
        """Whether any new call would get its session now, whoever calls (room for one more session, lent or
        shared, or no cap that refuses): `room_for` without its questions, for the common case."""
        limits = self.limits
        return (
            not limits.refuse_new_calls_when_full or limits.max_open is None or (self._has_room() and self._may_lend())
        )

    def room_for(self, principal: Identity | None, *, asks: bool, asker: str | None = None) -> bool:
        """Could a new call of the principal get its session now, without waiting for another call's to come
        back? (As `lease` would take it: the principal's shared session for a call that cannot ask, else a spare
        of its own or a new one, where an idle session may be ended to make room.) Always, where the kind does
        not refuse new calls when full (`PoolLimits.refuse_new_calls_when_full`)."""
        limits = self.limits
        if not limits.refuse_new_calls_when_full or limits.max_open is None:
            return True
        key = self.kind.credentials.session_key(principal)
        if limits.share_quiet_calls and not (asks or self.questions.asked_before(asker)):
            return key in self._shared or self._has_room() or bool(self._idle)
        if not self._may_lend():
            return False
        return bool(self._spare.get(key)) or self._has_room() or bool(self._idle)

    def _has_room(self) -> bool:
        return self.limits.max_open is None or len(self._open) + self._reserved < self.limits.max_open

    def _may_lend(self) -> bool:
        """Lent sessions and reservations leave one place of `max_open` to shared sessions: a call parked
        between MRTR rounds holds its session, and its client's retry must still find a shared one."""
        maximum = self.limits.max_open
        return maximum is None or len(self._lent) + self._reserved < max(maximum - 1, 1)

    async def reserve(self, make_room: Callable[[], None] | None = None) -> None:
        """Room for one session the pool does not hold (a legacy client's own stdio server process): it counts
        against `max_open` until `unreserve()`. Waits like a new session, then fails with UpstreamLimitError.
        When none of the pool's own idle sessions can make room, `make_room` is asked to end one of the
        holder's (it calls `unreserve()` once that is gone)."""
        deadline = asyncio.get_running_loop().time() + self.limits.wait_seconds
        while not (self._has_room() and self._may_lend()):
            evict = self._may_lend()
            if not evict:
                self._reclaim_one()
            if make_room is not None and not (evict and self._idle) and not self._reclaiming:
                make_room()
            await self._wait_for_room(deadline, evict=evict)
        self._reserved += 1

    def unreserve(self) -> None:
        self._reserved -= 1
        self._signal()

    def _reclaim_one(self) -> None:
        """Ask the oldest lessee that can give its session up to do so (one at a time)."""
        if self._reclaiming:
            return
        for session, reclaim in list(self._reclaims.items()):
            if reclaim():
                self._reclaiming.add(session)
                return

    async def _wait_for_room(self, deadline: float, *, evict: bool) -> None:
        """Make room (`evict`) by closing the least recently used idle session, unless a close under way already
        makes it; then wait for a change. UpstreamLimitError once `deadline` has passed."""
        assert self.limits.max_open is not None
        crowded = len(self._open) + self._reserved - len(self._closing) >= self.limits.max_open
        if evict and crowded and self._idle:
            self._close(next(iter(self._idle)))
        changed = self._changed
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(changed.wait(), max(remaining, 0))
        except TimeoutError:
            log.warning("upstream_limit_reached", limit=self.limits.limit_name, max=self.limits.max_open)
            raise UpstreamLimitError(self.limits.limit_name, self.limits.max_open, self.limits.wait_seconds) from None

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _evict(self) -> None:
        """Close the least recently used idle sessions beyond `max_idle`."""
        while len(self._idle) > self.limits.max_idle:
            self._close(next(iter(self._idle)))

    def _close(self, session: Session) -> None:
        """Take the session out of every list now; it counts as open until its close has finished."""
        key = self._idle.pop(session, None)
        timer = self._idle_timers.pop(session, None)
        if timer is not None:
            timer.cancel()
        for shared_key, shared in list(self._shared.items()):
            if shared is session:
                del self._shared[shared_key]
                self.facts.forget(shared_key)
        for spare_key in [key] if key is not None else list(self._spare):
            spare = self._spare.get(spare_key)
            if spare is not None and session in spare:
                spare.remove(session)
                if not spare:
                    del self._spare[spare_key]
        if session in self._closing or session not in self._open:
            return
        self._closing.add(session)
        self.kind.spawn(self._finish_close(session), "upstream-session-close")

    async def _finish_close(self, session: Session) -> None:
        try:
            await session.close()
        finally:
            self._open.discard(session)
            self._closing.discard(session)
            self._signal()

    # --- what the pool holds --------------------------------------------------------------------------------

    def spare_sessions(self, principal: Identity | None) -> list[Session]:
        """The principal's idle sessions waiting to be leased again, most recently returned last."""
        return list(self._spare.get(self.key_of(principal), ()))

    def sessions(self) -> list[Session]:
        """Every session the pool holds (shared, lent, spare, and those still closing)."""
        return list(self._open)

    @property
    def calls_in_flight(self) -> int:
        """Upstream requests open right now, on every session in use."""
        return sum(session.in_flight for session in self._users)

    @property
    def idle_sessions(self) -> int:
        return len(self._idle)

    @property
    def open_sessions(self) -> int:
        """Sessions the pool holds: shared ones, leased ones and spare ones (not those still closing)."""
        return len(self._open) - len(self._closing)

    # --- readiness and shutdown ---------------------------------------------------------------------------

    async def probe(self, max_age_seconds: float) -> None:
        """Readiness: UpstreamError saying what failed (see the kind's `probe`)."""
        await self.kind.probe(max_age_seconds, lambda: self.use(None))

    def end_subscriptions(self) -> None:
        """Shutdown: every listen stream ends with its graceful result."""
        for session in self._shared.values():
            session.subscribers.end()

    async def close(self) -> None:
        """Close every session (for stdio: every process stopped and reaped), then the kind's background work."""
        for timer in self._idle_timers.values():
            timer.cancel()
        sessions = list(self._open)
        self._shared.clear()
        self.facts.clear()
        self._spare.clear()
        self._idle.clear()
        self._idle_timers.clear()
        await asyncio.gather(*(session.close() for session in sessions), return_exceptions=True)
        self._open.clear()
        await self.kind.close()


class _Use:
    """`SessionPool.use`'s context (a class, not a generator: it is entered on every request that uses the
    shared session)."""

    __slots__ = ("_key", "_pool", "_principal", "_session")

    def __init__(self, pool: SessionPool, principal: Identity | None) -> None:
        self._pool = pool
        self._principal = principal
        self._key = pool.key_of(principal)
        self._session: Session | None = None

    async def __aenter__(self) -> Session:
        self._session = await self._pool._use(self._principal, self._key)
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            self._pool._release(self._session, self._key)


class _SharedLease:
    """A lease on the principal's shared session (`SessionPool.lease` for a call that cannot ask): initialized,
    its questions naming no request the call's while no other call runs there (`_askers.py`)."""

    __slots__ = ("_key", "_notifications", "_pool", "_principal", "_session", "_sharer", "_sink")

    def __init__(self, pool: SessionPool, principal: Identity | None, sink: Sink) -> None:
        self._pool = pool
        self._principal = principal
        self._sink = sink
        self._key = pool.key_of(principal)
        self._notifications = pool._notifications_of(self._key)
        self._session: Session | None = None
        self._sharer: Sink | None = None

    async def __aenter__(self) -> Session:
        pool = self._pool
        session = await pool._use(self._principal, self._key)
        try:
            await session.ensure_initialized()
        except BaseException:
            pool._release(session, self._key)
            raise
        self._session = session
        self._sharer = pool.questions.share(session, self._sink, self._notifications)
        return session

    async def __aexit__(self, *exc: object) -> None:
        session, sharer = self._session, self._sharer
        if session is None or sharer is None:
            return
        pool = self._pool
        pool.questions.unshare(session, sharer, self._notifications)
        pool._release(session, self._key)
