"""upstream/pool/: which upstream session serves a request. Real sessions of the HTTP kind against the fixture
upstream on loopback; the bounds of the stdio kind with no process started (its room is taken first)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from proxy.config.schema import HttpUpstreamConfig, StdioUpstreamConfig
from proxy.errors import UpstreamLimitError
from proxy.principals import Identity
from proxy.upstream.http.session import HttpKind
from proxy.upstream.pool import SessionPool
from proxy.upstream.pool._askers import QuestionOwners
from proxy.upstream.stdio.session import StdioKind
from proxy.wire.upstream_events import UpstreamEvent, UpstreamNotification, UpstreamServerRequest
from tests.support.processes import STDIO_FIXTURE, Upstream

A, B = Identity("Bearer a"), Identity("Bearer b")


async def nowhere(event: UpstreamEvent) -> None:
    """A lessee that takes what its session receives unasked and does nothing with it."""


@pytest.fixture
async def pool(upstream: Upstream, http: aiohttp.ClientSession) -> AsyncIterator[SessionPool]:
    made = SessionPool(HttpKind(HttpUpstreamConfig(url=upstream.url), http, "authorization", None))
    yield made
    await made.close()


async def test_a_call_that_could_be_asked_gets_a_session_of_its_own_and_gives_it_back_spare(
    pool: SessionPool,
) -> None:
    async with pool.lease(A, nowhere) as first, pool.lease(A, nowhere) as second:
        assert first is not second  # two calls at once: each holds its own
        assert first.lending.lent
        assert second.lending.lent
        async with pool.use(A) as shared:
            assert shared not in (first, second)  # the principal's shared session is apart
    assert not first.lending.lent  # taken back ...
    assert set(pool.spare_sessions(A)) == {first, second}  # ... and kept for the principal's next calls
    assert pool.spare_sessions(B) == []  # never another principal's
    async with pool.lease(A, nowhere) as again:
        assert again in (first, second)


async def test_a_call_that_could_not_be_asked_shares_the_principals_session(pool: SessionPool) -> None:
    async with pool.use(A) as shared, pool.lease(A, nowhere, asks=False) as quiet:
        assert quiet is shared
        assert quiet.lending.lent  # while it runs there alone, a question naming no request is its own
        async with pool.lease(A, nowhere, asks=False) as other:
            assert other is shared
            assert not shared.lending.lent  # two calls: nobody's, refused at once
    assert not shared.lending.lent


async def test_a_tool_seen_asking_gets_a_session_of_its_own_from_then_on(pool: SessionPool) -> None:
    asker = "tools/call ask_name"
    seen: list[UpstreamEvent] = []

    async def lessee(event: UpstreamEvent) -> None:
        seen.append(event)

    async with pool.use(A) as shared, pool.lease(A, lessee, asks=False, asker=asker) as quiet:
        assert quiet is shared
        assert quiet.lending.lessee is not None
        await quiet.lending.lessee(UpstreamServerRequest(1, "elicitation/create", {"message": "Name?"}))
    assert len(seen) == 1
    async with pool.use(A) as shared, pool.lease(A, nowhere, asks=False, asker=asker) as own:
        assert own is not shared


def test_askers_are_remembered_by_what_they_asked_and_forgotten_oldest_first() -> None:
    owners = QuestionOwners()
    assert not owners.asked_before("tools/call a")
    owners.remember("tools/call a", "sampling/createMessage")
    assert owners.asked_before("tools/call a")
    assert not owners.asked_before(None)


async def test_learning_ignores_notifications_and_what_names_no_asker() -> None:
    owners, seen = QuestionOwners(), []

    async def sink(event: UpstreamEvent) -> None:
        seen.append(event)

    learning = owners.learning("tools/call t", sink)
    await learning(UpstreamNotification({"method": "notifications/progress"}))
    assert not owners.asked_before("tools/call t")
    await learning(UpstreamServerRequest(2, "roots/list", None))
    assert owners.asked_before("tools/call t")
    assert owners.learning(None, sink) is sink
    assert len(seen) == 2


async def test_a_bounded_kind_waits_for_room_then_refuses_with_the_limit_error() -> None:
    """stdio processes are bounded: with the one place taken by a legacy client's own process (a reservation),
    a call waits `connect_timeout_seconds` for room and is refused with the limit's own error, no process
    started; once the reservation goes, there is room again."""
    config = StdioUpstreamConfig(command=STDIO_FIXTURE, max_processes=1, connect_timeout_seconds=0.2)
    pool = SessionPool(StdioKind(config))
    try:
        await pool.reserve()
        started = time.monotonic()
        with pytest.raises(UpstreamLimitError) as refused:
            async with pool.lease(A, nowhere):
                pass
        assert time.monotonic() - started >= 0.2
        assert refused.value.data == {"limit": "max_processes", "max": 1}
        assert pool.open_sessions == 0
        pool.unreserve()
        async with asyncio.timeout(0.1):  # the place is free again at once
            await pool.reserve()
        pool.unreserve()
    finally:
        await pool.close()


async def test_surely_room_is_said_only_where_every_caller_would_find_room(
    upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """`surely_room` (the front's shortcut before `room_for`) is never true while `room_for` refuses some
    caller: checked for both kinds of call and two callers at each step of filling a pool of three sessions."""
    config = HttpUpstreamConfig(url=upstream.url, max_open_sessions=3)
    pool = SessionPool(HttpKind(config, http, "authorization", None))

    def agrees() -> bool:
        rooms = [pool.room_for(who, asks=asks, asker="tools/call t") for who in (A, B) for asks in (True, False)]
        assert not pool.surely_room() or all(rooms), rooms
        return pool.surely_room()

    try:
        assert agrees()  # empty
        async with pool.use(A), pool.lease(A, nowhere):
            agrees()
            async with pool.lease(A, nowhere):
                assert not agrees()  # full: only a call that may share A's session still finds room
                assert pool.room_for(A, asks=False)
                assert not pool.room_for(B, asks=True)
        agrees()  # the sessions stay open (spare, idle): room for every call, though not for one more session
        assert pool.room_for(B, asks=True)
    finally:
        await pool.close()
