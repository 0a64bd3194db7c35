"""Idempotency-Key (draft-ietf-httpapi-idempotency-key-header), one row per outcome: the key's grammar (RFC 8941
sf-string, or a bare token), the fingerprint, which failures are recorded, and `IdempotencyKeys.serve` on a real
SQLite store with a plain function in the place of the call: first, joined, replayed, conflict, released,
recorded failure, interrupted, busy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest

from proxy.config.schema import IdempotencyConfig
from proxy.errors import (
    InvalidParamsError,
    TaskLimitError,
    TaskStoreUnavailableError,
    UpstreamAuthError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from proxy.observe.metrics import Metrics
from proxy.principals import Identity, Principals
from proxy.tasks.services import idempotency
from proxy.tasks.services.idempotency import (
    IdempotencyKeys,
    KeyBusyError,
    KeyConflictError,
    ReplayedError,
    fingerprint,
    parse_key,
    records_failure,
)
from proxy.tasks.store import KeyRecord, SqliteTaskStore
from proxy.wire.envelope import Caller, Channel, ModernRequest
from proxy.wire.jsonrpc import JSON
from tests.support.disks import fill, small_tmpfs
from tests.support.waiting import until


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ('"abc"', "abc"),
        ("abc", "abc"),
        ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('"with space"', "with space"),
        ('"q\\"uote\\\\"', 'q"uote\\'),
        ("urn:key/1", "urn:key/1"),
        ('"' + "x" * 255 + '"', "x" * 255),
    ],
)
def test_a_key_is_an_sf_string_or_a_bare_token(value: str, key: str) -> None:
    assert parse_key(value) == key


@pytest.mark.parametrize(
    "value",
    ['""', "", '"open', '"a"b', '"a";param=1', '"a\\n"', '"tab\tin"', "two words", "é", '"é"', "x" * 256],
)
def test_a_malformed_or_too_long_key_is_invalid_params(value: str) -> None:
    with pytest.raises(InvalidParamsError) as caught:
        parse_key(value)
    assert caught.value.status == 400


def test_the_fingerprint_is_canonical_json_of_the_name_and_arguments() -> None:
    assert fingerprint("t", {"a": 1, "b": [1, 2]}) == fingerprint("t", {"b": [1, 2], "a": 1})
    assert fingerprint("t", {"a": 1}) != fingerprint("u", {"a": 1})
    assert fingerprint("t", {"a": 1}) != fingerprint("t", {"a": 2})
    assert fingerprint("t", {"a": "é"}) != fingerprint("t", {"a": "e"})


def test_only_upstream_failures_after_the_request_are_recorded() -> None:
    assert records_failure(UpstreamTimeoutError())
    assert not records_failure(UpstreamUnreachableError())
    assert not records_failure(UpstreamAuthError(401, None))
    assert not records_failure(TaskLimitError("max_running", 1))
    assert not records_failure(InvalidParamsError())


class NoChannel:
    async def notify(self, message: JSON, *, required: bool = False) -> None:
        return None

    async def keepalive(self, *, open_stream: bool = False) -> None:
        return None


class Harness:
    """`IdempotencyKeys` on a real store, whose call is `work`: it counts its runs and answers `answer`."""

    def __init__(self, store: SqliteTaskStore, process_id: str = "replica-a") -> None:
        self.metrics = Metrics()
        self.closing = False
        principals = Principals(b"k" * 32)
        self.keys = IdempotencyKeys(
            store, principals, process_id, self.spawn, lambda: 1_000, self.metrics, lambda: self.closing
        )
        self.runs = 0
        self.answer: JSON | Exception = {"content": [], "resultType": "complete"}
        self.release = asyncio.Event()
        self.release.set()
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self.tasks.add(task)
        return task

    async def work(self, channel: Channel) -> JSON:
        self.runs += 1
        await self.release.wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return {"jsonrpc": "2.0", "id": 1, "result": self.answer}

    async def call(
        self, key: str = '"k"', arguments: JSON | None = None, *, request_id: int = 1, join_seconds: float = 5
    ) -> JSON:
        request = ModernRequest(request_id, "tools/call", {"name": "t", "arguments": arguments or {}}, {}, "", {})
        config = IdempotencyConfig(join_timeout_seconds=join_seconds)
        return await self.keys.serve(config, key, request, Caller(Identity("alice")), NoChannel(), self.work)

    def counted(self, outcome: str) -> float:
        value = self.metrics.registry.get_sample_value("mcp_tasks_proxy_idempotent_calls_total", {"outcome": outcome})
        return value or 0.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteTaskStore]:
    opened = await SqliteTaskStore.open(tmp_path / "tasks.db", max_records=100)
    await opened.replicas.renew_lease("replica-a", 10)
    yield opened
    await opened.close()


async def test_first_runs_and_a_repeat_after_it_ended_is_replayed_with_its_own_id(store: SqliteTaskStore) -> None:
    harness = Harness(store)
    first = await harness.call()
    again = await harness.call(request_id=7)
    assert harness.runs == 1
    assert again == {**first, "id": 7}
    assert (harness.counted("first"), harness.counted("replayed")) == (1, 1)


async def test_a_repeat_while_the_first_runs_joins_it(store: SqliteTaskStore) -> None:
    harness = Harness(store)
    harness.release.clear()
    first = harness.spawn(harness.call(), "first")
    await until(lambda: harness.runs == 1, "the first request never ran")
    repeat = harness.spawn(harness.call(request_id=2), "repeat")
    await asyncio.wait([repeat], timeout=0.05)  # a unit test of the join: the repeat waits for the first's answer
    assert not repeat.done()
    harness.release.set()
    assert (await repeat)["result"] == (await first)["result"]
    assert harness.runs == 1
    assert harness.counted("joined") == 1


async def test_the_same_key_with_other_arguments_is_a_conflict(store: SqliteTaskStore) -> None:
    harness = Harness(store)
    await harness.call(arguments={"a": 1})
    with pytest.raises(KeyConflictError) as caught:
        await harness.call(arguments={"a": 2})
    assert (caught.value.status, caught.value.code) == (422, -32602)
    assert harness.runs == 1


async def test_a_refusal_before_the_upstream_releases_the_key(store: SqliteTaskStore) -> None:
    harness = Harness(store)
    harness.answer = TaskLimitError("max_running", 1)
    with pytest.raises(TaskLimitError):
        await harness.call()
    harness.answer = {"content": [], "resultType": "complete"}
    assert "result" in await harness.call()
    assert harness.runs == 2
    assert harness.counted("released") == 1


async def test_an_upstream_failure_after_the_request_is_recorded(store: SqliteTaskStore) -> None:
    harness = Harness(store)
    harness.answer = UpstreamTimeoutError()
    with pytest.raises(UpstreamTimeoutError):
        await harness.call()
    with pytest.raises(ReplayedError) as caught:
        await harness.call()
    assert caught.value.status == 504
    assert caught.value.error_object() == UpstreamTimeoutError().error_object()
    assert harness.runs == 1


async def test_a_first_request_whose_process_died_is_interrupted_not_run_again(store: SqliteTaskStore) -> None:
    harness = Harness(store)
    scope = harness.keys.principals.key_of(Identity("alice"))
    dead = KeyRecord(scope, "k", fingerprint("t", {}), "replica-gone", 1_000, 10_000)
    assert await store.keys.claim_key(dead) is None
    with pytest.raises(ReplayedError) as caught:
        await harness.call()
    assert caught.value.status == 500
    assert caught.value.error_object()["data"] == {"idempotencyKey": "interrupted"}
    assert harness.runs == 0
    assert harness.counted("interrupted") == 1


async def test_a_release_the_store_could_not_take_is_owed_and_written_once_it_can() -> None:
    """Refusals before the upstream while the store cannot commit (a full disk): the keys' releases cannot be
    written either, so they are owed. Once the disk has room again a repeat here runs its key at once (never a
    wait for a request that no longer exists, never "interrupted" for a tool that never ran), and the release of
    a key nobody repeats is written by itself."""
    with small_tmpfs("4m") as directory:
        store = await SqliteTaskStore.open(directory / "tasks.db", max_records=100)
        try:
            harness = Harness(store)
            harness.release.clear()
            harness.answer = TaskStoreUnavailableError("sqlite", "disk full")
            refused = [harness.spawn(harness.call(key), key) for key in ('"k"', '"k2"')]
            await until(lambda: harness.runs == 2, "the first requests never ran")
            filler = fill(directory)
            harness.release.set()
            for request in refused:
                with pytest.raises(TaskStoreUnavailableError):
                    await request
            scope = harness.keys.principals.key_of(Identity("alice"))
            for key in ("k", "k2"):
                assert await store.keys.get_key(scope, key) is not None  # claimed, its release owed
            filler.unlink()
            harness.answer = {"content": [], "resultType": "complete"}
            assert "result" in await harness.call('"k"', join_seconds=30)
            assert harness.runs == 3
            await until(lambda: _gone(store, scope, "k2"), "the owed release was written once the disk had room", 10)
            assert harness.counted("interrupted") == 0
        finally:
            await store.close()


async def _gone(store: SqliteTaskStore, scope: str, key: str) -> bool:
    return await store.keys.get_key(scope, key) is None


async def test_a_claim_of_this_process_that_nothing_here_knows_is_interrupted_not_run(store: SqliteTaskStore) -> None:
    """More releases and outcomes were owed than kept (or one was dropped for a lasting store error): a claim this
    process made, that no request here waits on and nothing is owed for, has an unknown outcome, as after a crash."""
    harness = Harness(store)
    scope = harness.keys.principals.key_of(Identity("alice"))
    forgotten = KeyRecord(scope, "k", fingerprint("t", {}), "replica-a", 900, 10_000)
    assert await store.keys.claim_key(forgotten) is None
    with pytest.raises(ReplayedError) as caught:
        await harness.call(join_seconds=30)
    assert caught.value.error_object()["data"] == {"idempotencyKey": "interrupted"}
    assert harness.runs == 0


async def test_an_answer_given_while_the_proxy_shuts_down_records_an_unknown_outcome(store: SqliteTaskStore) -> None:
    """The shutdown's own answer ("the proxy is shutting down") is not the upstream's outcome: a repeat is told the
    outcome is unknown, never to send the same key again."""
    harness = Harness(store)
    harness.closing = True
    harness.answer = {"content": [{"type": "text", "text": "the proxy is shutting down"}], "isError": True}
    await harness.call()
    with pytest.raises(ReplayedError) as caught:
        await harness.call()
    assert caught.value.error_object()["data"] == {"idempotencyKey": "interrupted"}
    assert harness.runs == 1


async def test_a_first_request_running_past_the_join_timeout_is_busy(store: SqliteTaskStore) -> None:
    harness = Harness(store)
    harness.release.clear()
    first = harness.spawn(harness.call(), "first")
    await until(lambda: harness.runs == 1, "the first request never ran")
    with pytest.raises(KeyBusyError) as caught:
        await harness.call(join_seconds=0.05)
    assert caught.value.status == 409
    assert caught.value.response_headers() == {"Retry-After": "1"}
    harness.release.set()
    await first


def test_the_header_name_is_the_drafts() -> None:
    assert idempotency.HEADER == "Idempotency-Key"
