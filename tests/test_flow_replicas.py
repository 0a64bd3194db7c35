"""End to end: three proxy processes on one PostgreSQL database, each with its own legacy upstream, behind a
round-robin client (every request to the next replica, no stickiness).

A task created on one replica is polled, answered and cancelled on the others; MRTR rounds are split across
replicas; shared pacing reaches every replica; a restarting replica leaves the others' tasks alone. The fault
tests (`faults` marker) kill one replica with 100 tasks in flight, and pause one past its lease. Waiting is by
polling with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.tasks.services.replicas import TAKEN_OVER, TAKEN_OVER_RERUN
from tests import pg
from tests.support.clients import Tasks
from tests.support.cluster import Cluster, Replica, RoundRobin, client
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, read_messages, result_text, sse_messages

LEASE_SECONDS = 3.0
ELICIT: dict[str, Any] = {"elicitation": {}}
TASKING: dict[str, Any] = {**ELICIT, **DECLARING}
TOOLS: dict[str, Any] = {
    "sleep": {"mode": "required"},
    "ask_name": {"mode": "required"},
    "multi_input": {"mode": "required"},
    "slow_compute": {"mode": "required", "poll_interval_ms": 3000},
    "counted": {"mode": "optional", "sync_window_ms": 0, "on_restart": "rerun"},
}
TERMINAL = {"completed", "failed", "cancelled"}


def accept(**content: Any) -> dict[str, Any]:
    return {"action": "accept", "content": content}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pg_server: pg.PgServer) -> Iterator[Cluster]:
    with pg_server.database() as dsn:
        replicas = Cluster(tmp_path_factory.mktemp("replicas"), dsn, 3, LEASE_SECONDS, TOOLS)
        yield replicas
        replicas.stop()


Clients = Callable[..., tuple[Tasks, RoundRobin]]


@pytest.fixture
def clients(
    http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> Callable[[Cluster, list[int] | None], tuple[Tasks, RoundRobin]]:
    """`clients(cluster)`: round-robin over every replica; `clients(cluster, [i])`: replica i only."""

    def make(of: Cluster, only: list[int] | None = None) -> tuple[Tasks, RoundRobin]:
        replicas = of.replicas if only is None else [of.replicas[index] for index in only]
        return client(http, replicas, modern_schema, tasks_schema)

    return make


async def cancelled_upstream_calls(pinned: Tasks) -> int:
    """How many tools/call the upstream of the replica `pinned` talks to saw cancelled."""
    return len(json.loads(await pinned.text("cancelled_requests", {})))


async def update(client: Tasks, task_id: str, responses: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return await client.post("tasks/update", {"taskId": task_id, "inputResponses": responses})


# --- any replica answers ---------------------------------------------------------------------------------------


async def test_a_task_is_polled_and_answered_on_replicas_that_do_not_run_it(cluster: Cluster, clients: Clients) -> None:
    rr, http = clients(cluster)
    task_id = await rr.create("ask_name", capabilities=TASKING)
    owner = http.last
    others = [index for index in range(3) if index != owner]
    task = await rr.until(task_id, lambda task: task["status"] == "input_required")  # polled round-robin
    assert list(task["inputRequests"]) == ["elicitation-1"]
    elsewhere, _ = clients(cluster, [others[0]])
    status, refused = await update(elsewhere, task_id, {"elicitation-1": {"action": "maybe"}})
    assert status == 400  # checked where it arrived, against the question the record shows
    assert refused["error"]["code"] == -32602
    assert "inputResponses.elicitation-1" in refused["error"]["message"]
    assert (await rr.task(task_id))["status"] == "input_required"
    status, ack = await update(elsewhere, task_id, {"elicitation-1": accept(name="Ada"), "never-issued": accept()})
    assert status == 200, ack
    done = await rr.settled(task_id)
    assert done["status"] == "completed"
    assert result_text(done) == "Hello, Ada"  # the answer reached the call on its owner's upstream


async def test_a_partial_answer_on_another_replica_shows_at_once_on_a_third(cluster: Cluster, clients: Clients) -> None:
    """As on one replica, a tasks/update is acked once its answers were taken: the next tasks/get, wherever it
    lands, shows only the questions still open."""
    owner, _ = clients(cluster, [0])
    answering, _ = clients(cluster, [1])
    reading, _ = clients(cluster, [2])
    task_id = await owner.create("multi_input", capabilities=TASKING)
    task = await reading.until(task_id, lambda task: len(task.get("inputRequests", {})) == 2)
    by_field = {
        next(iter(request["params"]["requestedSchema"]["properties"])): key
        for key, request in task["inputRequests"].items()
    }
    status, _ = await update(answering, task_id, {by_field["name"]: accept(name="Ada")})
    assert status == 200
    partial = await reading.task(task_id)
    assert partial["status"] == "input_required"
    assert list(partial["inputRequests"]) == [by_field["color"]]
    await update(reading, task_id, {by_field["color"]: accept(color="blue")})
    assert result_text(await answering.settled(task_id)) == "name=Ada; color=blue"


async def test_a_cancel_on_another_replica_reaches_the_owners_upstream(cluster: Cluster, clients: Clients) -> None:
    owner, _ = clients(cluster, [0])
    canceller, _ = clients(cluster, [1])
    reader, _ = clients(cluster, [2])
    before = await cancelled_upstream_calls(owner)
    task_id = await owner.create("sleep", {"seconds": 60})
    await reader.until(task_id, lambda task: "statusMessage" in task)  # the owner's upstream runs it
    status, ack = await canceller.post("tasks/cancel", {"taskId": task_id})
    assert status == 200, ack
    assert ack["result"]["resultType"] == "complete"
    assert (await reader.task(task_id))["status"] == "cancelled"

    async def cancelled_upstream() -> bool:
        return await cancelled_upstream_calls(owner) > before

    await until(cancelled_upstream, "the owner's upstream saw notifications/cancelled")
    status, _ = await reader.post("tasks/cancel", {"taskId": task_id})
    assert status == 200  # a settled task: acked again, and it stays cancelled
    assert (await canceller.task(task_id))["status"] == "cancelled"


async def test_a_foreign_principal_gets_not_found_on_every_replica(cluster: Cluster, clients: Clients) -> None:
    rr, _ = clients(cluster)
    task_id = await rr.create("slow_compute", {"seconds": 0.1}, headers={"Authorization": "Bearer alice"})
    for _ in range(3):
        _, foreign = await rr.get(task_id, headers={"Authorization": "Bearer mallory"})
        assert foreign["error"]["code"] == -32602
        _, own = await rr.get(task_id, headers={"Authorization": "Bearer alice"})
        assert own["result"]["taskId"] == task_id


async def test_mrtr_rounds_split_across_replicas(cluster: Cluster, clients: Clients) -> None:
    """Each round lands on another replica: the answers reach the call parked on the first one, and the next
    round, then the result, come back to the replica the client asked."""
    first, second, third = (clients(cluster, [index])[0] for index in range(3))
    params: dict[str, Any] = {"name": "test_input_required_result_multi_round", "arguments": {}}
    _, message = await first.post("tools/call", params, capabilities=ELICIT)
    result = message["result"]
    assert result["resultType"] == "input_required", message
    assert list(result["inputRequests"]) == ["elicitation-1"]
    retry = {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": result["requestState"]}
    status, message = await second.post("tools/call", retry, capabilities=ELICIT)
    assert status == 200, message
    result = message["result"]
    assert result["resultType"] == "input_required", message  # the upstream asked again: round two
    assert list(result["inputRequests"]) == ["elicitation-2"]
    final = {
        **params,
        "inputResponses": {"elicitation-2": accept(color="blue")},
        "requestState": result["requestState"],
    }
    status, message = await third.post("tools/call", final, capabilities=ELICIT)
    assert status == 200, message
    assert message["result"]["content"][0]["text"] == "Multi-round complete for Ada who likes blue"
    status, replayed = await third.post("tools/call", retry, capabilities=ELICIT)  # single use, on every replica
    assert status == 400
    assert "already used" in replayed["error"]["message"]


async def test_a_forwarded_retry_with_a_bad_answer_leaves_the_call_parked(cluster: Cluster, clients: Clients) -> None:
    first, second, third = (clients(cluster, [index])[0] for index in range(3))
    params: dict[str, Any] = {"name": "test_input_required_result_prompt"}
    _, message = await first.post("prompts/get", params, capabilities=ELICIT)
    result = message["result"]
    [key] = result["inputRequests"]
    bad = {**params, "inputResponses": {key: {"action": "sure"}}, "requestState": result["requestState"]}
    status, refused = await second.post("prompts/get", bad, capabilities=ELICIT)
    assert status == 400
    assert refused["error"]["code"] == -32602
    assert f"inputResponses.{key}" in refused["error"]["message"]
    good = {**bad, "inputResponses": {key: accept(context="docs")}}
    status, message = await third.post("prompts/get", good, capabilities=ELICIT)
    assert status == 200, message
    assert message["result"]["messages"][0]["content"]["text"] == "Prompt with context: docs"


async def test_a_tools_usual_duration_paces_tasks_on_every_replica(cluster: Cluster, clients: Clients) -> None:
    """The estimate behind pollIntervalMs lives in the store: a completion on one replica paces the others."""
    first, _ = clients(cluster, [0])
    second, _ = clients(cluster, [1])
    done = await first.create("slow_compute", {"seconds": 0.2})
    await first.settled(done)
    running = await second.create("slow_compute", {"seconds": 30})

    async def paced() -> bool:
        task = await second.task(running)
        return bool(task["pollIntervalMs"] < 3000)

    await until(paced, "replica 1 paced the task by replica 0's completion")
    await second.post("tasks/cancel", {"taskId": running})


async def test_a_restarting_replica_leaves_the_other_replicas_tasks_alone(cluster: Cluster, clients: Clients) -> None:
    """A replica that stops cleanly releases its lease: a survivor takes its live tasks over at once (re-run or
    failed per policy); the restarted replica starts fresh and touches no task of a live replica."""
    first, _ = clients(cluster, [0])
    last, _ = clients(cluster, [2])
    kept = await first.create("sleep", {"seconds": 60})
    left = await last.create("sleep", {"seconds": 60})
    rerun = await last.create("counted", {"key": "restart-rerun", "seconds": 0.5})
    owners = {task_id: row["owner"] for task_id, row in cluster.records([kept, left, rerun]).items()}
    assert cluster.replicas[2].terminate() == 0
    cluster.replicas[2].start()
    assert (await first.task(kept))["status"] == "working"
    failed = await first.until(left, lambda task: task["status"] in TERMINAL)
    assert failed["status"] == "failed"
    assert failed["error"]["message"] == TAKEN_OVER
    again = await first.settled(rerun)
    assert again["status"] == "completed"
    records = cluster.records([kept, left, rerun])
    assert records[kept]["owner"] == owners[kept]  # never touched
    assert records[left]["owner"] != owners[left]
    await first.post("tasks/cancel", {"taskId": kept})


# --- replica faults ----------------------------------------------------------------------------------------------


@pytest.fixture
def own_cluster(tmp_path: Path, pg_dsn: str) -> Iterator[Callable[[dict[str, Any]], Cluster]]:
    started: list[Cluster] = []

    def start(tools: dict[str, Any]) -> Cluster:
        started.append(Cluster(tmp_path, pg_dsn, 3, LEASE_SECONDS, tools))
        return started[-1]

    yield start
    for each in started:
        each.stop()


@pytest.mark.faults
async def test_kill_9_of_a_replica_with_100_tasks_in_flight(
    own_cluster: Callable[[dict[str, Any]], Cluster], clients: Clients
) -> None:
    """Every task of the killed replica is resolved by the survivors within the lease plus 5 s (failed as
    interrupted, or re-run per `on_restart`), the re-run ones finish, and no task is lost."""
    cluster = own_cluster({"sleep": {"mode": "required"}, "counted": {"mode": "required", "on_restart": "rerun"}})
    rr, http = clients(cluster)
    created: dict[str, tuple[int, str]] = {}  # task id → (the replica that created and runs it, its tool)
    for number in range(100):
        if number % 2:
            task_id = await rr.create("sleep", {"seconds": 60})
        else:
            task_id = await rr.create("counted", {"key": f"kill-{number}", "seconds": 2})
        created[task_id] = (http.last, "sleep" if number % 2 else "counted")
    doomed = [task_id for task_id, (replica, _) in created.items() if replica == 0]
    assert len(doomed) >= 33
    cluster.replicas[0].signal(signal.SIGKILL)

    def resolved(records: dict[str, dict[str, Any]]) -> bool:
        return all(row["status"] in TERMINAL or row["status_message"] == TAKEN_OVER_RERUN for row in records.values())

    await until(lambda: resolved(cluster.records(doomed)), "the survivors did not take over in time", LEASE_SECONDS + 5)
    survivors, _ = clients(cluster, [1, 2])
    for task_id, (_, tool) in created.items():  # nothing lost: every task answers on the survivors
        task = await survivors.task(task_id)
        assert task["taskId"] == task_id
        if task_id in doomed and tool == "sleep":
            assert task["status"] == "failed"
            assert task["error"]["message"] == TAKEN_OVER
    for task_id in doomed:
        if created[task_id][1] == "counted":  # completed before the kill, or re-run by a survivor
            done = await survivors.settled(task_id, timeout_seconds=30)
            assert done["status"] == "completed", done
            assert result_text(done) == "1"
    owners = {row["owner"] for row in cluster.records(doomed).values()}
    assert len(owners) >= 1
    for task_id, (replica, tool) in created.items():  # the survivors' own tasks run on, untouched
        if replica != 0 and tool == "sleep":
            assert (await survivors.task(task_id))["status"] == "working"


@pytest.mark.faults
async def test_a_replica_paused_past_its_lease_writes_nothing_to_tasks_it_no_longer_owns(
    own_cluster: Callable[[dict[str, Any]], Cluster], clients: Clients
) -> None:
    """SIGSTOP past the lease: the survivors take its tasks over and re-run them on their own upstreams. Its
    upstream finished the original calls meanwhile, so once resumed (SIGCONT) it holds their results and would
    settle them first, were its writes not fenced: the records show only the survivors' results."""
    cluster = own_cluster({"counted": {"mode": "optional", "sync_window_ms": 0, "on_restart": "rerun"}})
    paused, _ = clients(cluster, [0])
    keys = [f"paused-{number}" for number in range(6)]
    for key in keys:  # the paused replica's upstream counts 2 calls of each key before the task's own
        for _ in range(2):
            await paused.text("counted", {"key": key})
    task_ids = [await paused.create("counted", {"key": key, "seconds": 1}) for key in keys]
    for key in keys:  # its upstream runs each task's call (its third)

        async def started(key: str = key) -> bool:
            return await paused.text("call_count", {"key": key}) == "3"

        await until(started, f"the upstream ran {key}")
    paused_owner = {row["owner"] for row in cluster.records(task_ids).values()}
    assert len(paused_owner) == 1
    cluster.replicas[0].signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:

        def taken_over() -> bool:
            return not {row["owner"] for row in cluster.records(task_ids).values()} & paused_owner

        await until(taken_over, "the survivors did not take over in time", LEASE_SECONDS + 5)
        assert time.monotonic() - stopped_at > 1  # longer than its upstream calls: their results wait for it
    finally:
        cluster.replicas[0].signal(signal.SIGCONT)
    survivors, _ = clients(cluster, [1, 2])
    for task_id in task_ids:
        done = await survivors.settled(task_id, timeout_seconds=20)
        assert done["status"] == "completed"
        assert result_text(done) == "1", done  # a survivor's upstream ran it; "3" would be the paused one's

    def lease_lost() -> list[dict[str, Any]]:
        return [event for event in cluster.replicas[0].events() if event.get("event") == "lease_lost"]

    async def noticed() -> bool:
        return bool(lease_lost())

    await until(noticed, "the resumed replica noticed it lost its lease")
    settled_there = [
        event
        for event in cluster.replicas[0].events()
        if event.get("event") == "task_settled" and event.get("task_id") in task_ids
    ]
    assert settled_there == []
    records = cluster.records(task_ids)
    assert not {row["owner"] for row in records.values()} & paused_owner
    fresh = await paused.create("counted", {"key": "after-the-pause"})  # it serves again, under a new lease
    assert result_text(await paused.settled(fresh)) == "1"


async def test_a_forwarded_rounds_progress_reaches_the_client_on_the_replica_it_asked(
    cluster: Cluster, http: aiohttp.ClientSession, modern_schema: ModernSchema
) -> None:
    """The call runs on the replica that parked it; the progress it reports after the retry's answers is
    relayed to the retry's stream on the other replica, tagged with the retry's own progressToken."""
    params: dict[str, Any] = {"name": "ask_then_progress", "arguments": {}}
    body = modern_body("tools/call", params, capabilities=ELICIT, progressToken="first-token")
    async with http.post(
        cluster.replicas[0].proxy.url, json=body, headers=modern_headers("tools/call", "ask_then_progress")
    ) as response:
        [asked] = await read_messages(response)
    state = asked["result"]["requestState"]
    retry = {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": state}
    body = modern_body("tools/call", retry, capabilities=ELICIT, progressToken="retry-token")
    async with http.post(
        cluster.replicas[1].proxy.url, json=body, headers=modern_headers("tools/call", "ask_then_progress")
    ) as response:
        messages = await read_messages(response)
    modern_schema.check_all(messages, "tools/call")
    *notes, final = messages
    assert final["result"]["content"][0]["text"] == "Hello, Ada"
    progress = [note for note in notes if note.get("method") == "notifications/progress"]
    assert [(note["params"]["progressToken"], note["params"]["progress"]) for note in progress] == [("retry-token", 1)]


@pytest.mark.faults
async def test_readiness_reports_the_store_and_the_lease_when_postgresql_goes_away(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """/readyz writes to PostgreSQL and checks the lease: with the database gone, the replica leaves the
    Service (503) naming the store, and once its lease has run out, the lease too."""
    server = await asyncio.to_thread(pg.start_throwaway)
    replica: Replica | None = None
    try:
        dsn = server.dsn(await asyncio.to_thread(server.create_database))
        key = tmp_path / "key"
        key.write_text("k" * 64)
        replica = await asyncio.to_thread(Replica, tmp_path, dsn, key, 1.0, {})
        url = replica.proxy.ops_url("/readyz")  # the reasons are on the operations port
        async with http.get(url) as response:
            assert response.status == 200, await response.text()
        await asyncio.to_thread(server.stop)

        async def reasons() -> list[str]:
            async with http.get(url) as response:
                body = await response.json()
                return list(body.get("reasons", [])) if response.status == 503 else []

        async def store_and_lease() -> bool:
            found = await reasons()
            return any(r.startswith("store:") for r in found) and any(r.startswith("lease:") for r in found)

        await until(store_and_lease, "readiness names the store and the lease", timeout_seconds=30)
    finally:
        if replica is not None:
            replica.stop()
        await asyncio.to_thread(server.stop)


# --- push across replicas ------------------------------------------------------------------------------------------


async def test_a_task_running_on_one_replica_is_pushed_to_a_listener_on_another(
    cluster: Cluster, clients: Clients, http: aiohttp.ClientSession, tasks_schema: SchemaValidator
) -> None:
    """The store's feed carries every replica's status writes: a client following its task on replica 2 hears
    each change of the task replica 0 runs, as `tasks/get` on any replica returns it."""
    owner, _ = clients(cluster, [0])
    reader, _ = clients(cluster, [1])
    task_id = await owner.create("sleep", {"seconds": 1})
    body = modern_body(
        "subscriptions/listen", {"notifications": {"taskIds": [task_id]}}, request_id="X1", capabilities=DECLARING
    )
    headers = modern_headers("subscriptions/listen")
    async with http.post(cluster.replicas[2].proxy.url, json=body, headers=headers) as response:
        assert response.status == 200
        stream = sse_messages(response)
        ack = await asyncio.wait_for(anext(stream), 10)
        assert ack["params"]["notifications"]["taskIds"] == [task_id]
        while True:
            message = await asyncio.wait_for(anext(stream), 15)
            tasks_schema.validate(message, "TaskStatusNotification")
            if message["params"]["status"] == "completed":
                break
    polled = await reader.task(task_id)
    assert {key: value for key, value in polled.items() if key not in ("_meta", "resultType")} == {
        key: value for key, value in message["params"].items() if key != "_meta"
    }
