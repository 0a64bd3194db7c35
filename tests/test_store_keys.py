"""The TaskStore contract for Idempotency-Key records, against both backends: a real SQLite file under tmp_path
and a real PostgreSQL database (tests/pg.py). One claim wins (also when many race), the holder is read back,
an outcome is recorded once by the holder only, a released key is free again, a late release or outcome of an
earlier claim never touches a later one, and retention ends a record."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.tasks.store import KeyRecord, SqliteTaskStore, TaskStore
from proxy.tasks.store.postgres import PostgresTaskStore


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TaskStore]:
    opened: TaskStore
    if request.param == "postgres":
        opened = await PostgresTaskStore.open(request.getfixturevalue("pg_dsn"), max_records=100)
    else:
        opened = await SqliteTaskStore.open(tmp_path / "tasks.db", max_records=100)
    yield opened
    await opened.close()


def claim(key: str = "k-1", *, scope: str = "alice", owner: str = "replica-a", at_ms: int = 1_000) -> KeyRecord:
    return KeyRecord(scope, key, "fp-1", owner, created_at_ms=at_ms, expires_at_ms=at_ms + 500)


async def test_the_first_claim_wins_and_a_second_reads_the_holder(store: TaskStore) -> None:
    first = claim()
    assert await store.keys.claim_key(first) is None
    holder = await store.keys.claim_key(dataclasses.replace(first, owner="replica-b", fingerprint="fp-2"))
    assert holder == first  # running: no outcome yet, the first owner and fingerprint kept
    assert await store.keys.get_key("alice", "k-1") == first
    assert await store.keys.get_key("bob", "k-1") is None  # the scope is part of the key


async def test_many_concurrent_claims_of_one_key_have_exactly_one_winner(store: TaskStore) -> None:
    claims = [claim(owner=f"replica-{number}") for number in range(12)]
    results = await asyncio.gather(*(store.keys.claim_key(record) for record in claims))
    winners = [record for record, result in zip(claims, results, strict=True) if result is None]
    assert len(winners) == 1
    assert all(result == winners[0] for result in results if result is not None)


async def test_only_the_holder_records_the_outcome_and_only_once(store: TaskStore) -> None:
    first = claim()
    await store.keys.claim_key(first)
    assert await store.keys.settle_key(dataclasses.replace(first, owner="replica-b"), '{"result":{}}') is False
    assert await store.keys.settle_key(first, '{"result":{"n":1}}') is True
    assert await store.keys.settle_key(first, '{"result":{"n":2}}') is False
    got = await store.keys.get_key("alice", "k-1")
    assert got is not None
    assert got.outcome == '{"result":{"n":1}}'
    await store.keys.release_key(first)  # a settled key is never released
    assert await store.keys.get_key("alice", "k-1") is not None


async def test_a_released_key_can_be_claimed_again(store: TaskStore) -> None:
    first = claim()
    await store.keys.claim_key(first)
    await store.keys.release_key(dataclasses.replace(first, owner="replica-b"))  # not the holder: kept
    assert await store.keys.get_key("alice", "k-1") is not None
    await store.keys.release_key(first)
    assert await store.keys.get_key("alice", "k-1") is None
    assert await store.keys.claim_key(dataclasses.replace(first, owner="replica-b")) is None


async def test_a_key_past_its_retention_is_claimed_anew_and_purged(store: TaskStore) -> None:
    first = claim(at_ms=1_000)  # kept until 1500
    await store.keys.claim_key(first)
    await store.keys.settle_key(first, '{"result":{}}')
    assert await store.keys.claim_key(claim(owner="replica-b", at_ms=1_499)) is not None
    later = claim(owner="replica-b", at_ms=1_500)
    assert await store.keys.claim_key(later) is None  # expired but not swept yet: replaced atomically
    assert await store.keys.get_key("alice", "k-1") == later
    await store.keys.claim_key(claim("k-2", at_ms=1_000))
    assert await store.keys.purge_keys(1_499) == 0
    assert await store.keys.purge_keys(2_000) == 2
    assert await store.keys.get_key("alice", "k-1") is None


async def test_a_late_release_or_outcome_of_an_earlier_claim_leaves_a_later_claim_alone(store: TaskStore) -> None:
    """A process that owed the release of a claim it gave up on writes it late, after its own repeat claimed the
    key again: only the claim it names (owner and creation) goes."""
    earlier = claim(at_ms=1_000)
    await store.keys.claim_key(earlier)
    await store.keys.release_key(earlier)
    later = claim(at_ms=1_001)
    assert await store.keys.claim_key(later) is None
    await store.keys.release_key(earlier)
    assert await store.keys.settle_key(earlier, '{"result":{}}') is False
    assert await store.keys.get_key("alice", "k-1") == later
    assert await store.keys.settle_key(later, '{"result":{"n":1}}') is True
