"""A SQLite store whose disk fills up while tasks run, against a real proxy process and the real legacy fixture
upstream: creation is refused with 503 and `Retry-After` while full, readiness is 503, existing tasks are still
read; once space returns, every task whose CreateTaskResult was sent ends with its own result (none dropped,
none left `working`) and the file passes `PRAGMA integrity_check`. At shutdown, a drain waits for the results
the disk holds back; what the store still refuses at the end is logged by task id."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.clients import meta, rpc, task_state, task_until
from tests.support.disks import fill, small_tmpfs
from tests.support.processes import ProxyProcess, Upstream
from tests.support.waiting import until
from tests.support.wire import DECLARING, policies, result_text

pytestmark = pytest.mark.faults

TASKS_RUNNING = 6
SLEEP_SECONDS = 2.0


async def create(http: aiohttp.ClientSession, url: str, seconds: float) -> tuple[int, dict[str, Any], str | None]:
    """One `tools/call` of `sleep`: status, message and its Retry-After header."""
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "sleep", "arguments": {"seconds": seconds}, "_meta": meta(DECLARING)},
    }
    headers = {
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": "tools/call",
        "Mcp-Name": "sleep",
    }
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(), response.headers.get("Retry-After")


async def ready(http: aiohttp.ClientSession, proxy: ProxyProcess) -> int:
    async with http.get(f"http://127.0.0.1:{proxy.port}/readyz") as response:
        return response.status


async def pending_settlements(http: aiohttp.ClientSession, proxy: ProxyProcess) -> float:
    async with http.get(proxy.ops_url("/metrics")) as response:
        for line in (await response.text()).splitlines():
            if line.startswith("mcp_tasks_proxy_store_pending_settlements "):
                return float(line.split()[1])
    raise AssertionError("no pending-settlements gauge")


def events(proxy: ProxyProcess, name: str) -> list[dict[str, Any]]:
    return [event for event in proxy.events() if event.get("event") == name]


def stored(database: Path) -> dict[str, tuple[str, str | None]]:
    """Every task in the file: its status and its result."""
    with sqlite3.connect(database) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return {
            task_id: (status, result)
            for task_id, status, result in conn.execute("SELECT task_id, status, result FROM tasks")
        }


async def held_back(http: aiohttp.ClientSession, proxy: ProxyProcess, disk: Path, count: int) -> tuple[Path, list[str]]:
    """`count` tasks of 1 s started, the disk filled meanwhile, and every result waiting for the store."""
    task_ids = []
    for _ in range(count):
        status, message, _ = await create(http, proxy.url, 1)
        assert status == 200, message
        task_ids.append(message["result"]["taskId"])
    filler = await asyncio.to_thread(fill, disk)
    await until(lambda: pending(proxy, task_ids), "every result waits for the store", 20)
    return filler, task_ids


def pending(proxy: ProxyProcess, task_ids: list[str]) -> bool:
    waiting = {event.get("task_id") for event in events(proxy, "settlement_pending") if event.get("write") == "settle"}
    return set(task_ids) <= waiting


def settled_or_pending(proxy: ProxyProcess, task_ids: list[str]) -> bool:
    """Each task's upstream call has ended: its settlement was written, or waits in the outbox."""
    seen = {
        event.get("task_id")
        for event in proxy.events()
        if event.get("event") == "task_settled"
        or (event.get("event") == "settlement_pending" and event.get("write") == "settle")
    }
    return set(task_ids) <= seen


async def test_a_full_disk_refuses_new_tasks_and_loses_no_result_once_space_returns(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    with small_tmpfs("4m") as disk:
        database = disk / "tasks.db"
        proxy = ProxyProcess(
            tmp_path,
            upstream.url,
            store={"path": str(database)},
            tasks=policies(sleep={"mode": "required"}),
        )
        processes.append(proxy)
        await proxy.start()
        timeline: dict[str, float] = {}
        async with aiohttp.ClientSession() as http:
            sent: list[tuple[str, float]] = []  # every task whose CreateTaskResult came back, and its duration
            for number in range(TASKS_RUNNING):
                seconds = SLEEP_SECONDS + number / 10
                status, message, _ = await create(http, proxy.url, seconds)
                assert status == 200, message
                sent.append((message["result"]["taskId"], seconds))

            timeline["fill_start"] = time.monotonic()
            filler = await asyncio.to_thread(fill, disk)

            refused: dict[str, Any] = {}

            async def refused_once() -> bool:
                status, message, retry_after = await create(http, proxy.url, 0.1)
                if status == 200:  # committed after all (SQLite found room): it must end like the others
                    sent.append((message["result"]["taskId"], 0.1))
                    return False
                refused.update(status=status, message=message, retry_after=retry_after)
                return True

            await until(refused_once, "a creation refused while the disk is full")
            timeline["first_503"] = time.monotonic()
            assert refused["status"] == 503
            assert refused["retry_after"] is not None
            assert refused["retry_after"].isdigit()
            assert refused["message"]["error"]["data"] == {"store": "sqlite", "reason": "disk full"}
            assert "unavailable" in refused["message"]["error"]["message"]
            await until(lambda: _is(ready(http, proxy), 503), "readiness 503 while the disk is full")

            # Every upstream call ends while the disk is full; what could not be written waits.
            task_ids = [task_id for task_id, _ in sent]
            await until(lambda: settled_or_pending(proxy, task_ids), "every upstream call ended", 20)
            assert await pending_settlements(http, proxy) >= 1
            for task_id in task_ids:  # read while full
                status, message = await rpc(http, proxy.url, "tasks/get", {"taskId": task_id}, DECLARING)
                assert status == 200, message
                assert message["result"]["status"] in ("working", "completed")
            assert await ready(http, proxy) == 503

            filler.unlink()
            timeline["space_freed"] = time.monotonic()
            for task_id, seconds in sent:
                task = await task_until(http, proxy.url, task_id, lambda task: task["status"] != "working")
                assert task["status"] == "completed", task
                assert result_text(task) == f"slept {seconds:g}"
            timeline["last_settled"] = time.monotonic()
            assert await pending_settlements(http, proxy) == 0
            await until(lambda: _is(ready(http, proxy), 200), "ready again once space returned")
            status, message, _ = await create(http, proxy.url, 0.1)
            assert status == 200, message
            done = await task_until(http, proxy.url, message["result"]["taskId"], lambda t: t["status"] != "working")
            assert done["status"] == "completed"
            assert (await task_state(http, proxy.url, sent[0][0]))["status"] == "completed"

        late = [event for event in proxy.events() if event.get("event") == "settlement_written_late"]
        assert late, "at least one settlement waited for the disk"
        assert all("result" not in event for event in late)
        assert await proxy.terminate() == 0
        with sqlite3.connect(database) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        start = timeline["fill_start"]
        print(
            "disk-full timeline (s from fill start):",
            {name: round(at - start, 3) for name, at in timeline.items()},
            f"tasks={len(sent)} written_late={len(late)}",
        )


async def _is(status: Any, expected: int) -> bool:
    return bool(await status == expected)


async def test_readiness_is_503_while_a_result_waits_for_the_store_even_when_a_probe_write_fits(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    """A disk with a little room: readiness' own tiny write commits, a 3 MB result does not. While that result
    waits in memory the replica is not ready, and the operations port says why; once space returns it is
    written and the replica is ready again."""
    with small_tmpfs("8m") as disk:
        database = disk / "tasks.db"
        proxy = ProxyProcess(
            tmp_path,
            upstream.url,
            store={"path": str(database)},
            tasks=policies(big_text={"mode": "required"}),
            observability={"readiness_max_age_seconds": 60},  # the upstream is not what this is about
        )
        processes.append(proxy)
        await proxy.start()
        async with aiohttp.ClientSession() as http:
            assert await ready(http, proxy) == 200
            filler = await asyncio.to_thread(fill, disk)
            os.truncate(filler, filler.stat().st_size - 512 * 1024)  # room for small writes only
            status, message = await rpc(http, proxy.url, "tools/call", big_text(3_000_000), DECLARING)
            assert status == 200, message
            task_id = message["result"]["taskId"]
            await until(lambda: pending(proxy, [task_id]), "the result waits for the store", 20)

            async def not_ready_for_the_result() -> bool:
                async with http.get(proxy.ops_url("/readyz")) as response:
                    body = await response.json()
                reasons = body.get("reasons", [])
                # The probe write fits: the only reason is the result held in memory.
                return response.status == 503 and reasons == [
                    "store: 1 task record write of 1 task wait in memory for it"
                ]

            await until(not_ready_for_the_result, "readiness names the held result and nothing else")
            assert await ready(http, proxy) == 503  # the MCP port's bare probe agrees
            filler.unlink()
            task = await task_until(http, proxy.url, task_id, lambda task: task["status"] != "working")
            assert task["status"] == "completed"
            await until(lambda: _is(ready(http, proxy), 200), "ready again once the result is written")


def big_text(size: int) -> dict[str, Any]:
    return {"name": "big_text", "arguments": {"size": size}}


async def test_a_drain_waits_for_the_results_a_full_disk_holds_back(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    """SIGTERM while results wait for the disk: the drain counts their tasks as work of its own, so once space
    returns they are written and the proxy exits 0 with every task completed in the file."""
    with small_tmpfs("4m") as disk:
        database = disk / "tasks.db"
        proxy = ProxyProcess(
            tmp_path,
            upstream.url,
            store={"path": str(database)},
            tasks={**policies(sleep={"mode": "required"}), "drain_seconds": 60},
        )
        processes.append(proxy)
        await proxy.start()
        async with aiohttp.ClientSession() as http:
            filler, task_ids = await held_back(http, proxy, disk, 3)
        assert proxy.process is not None
        proxy.process.send_signal(signal.SIGTERM)
        await until(lambda: events(proxy, "drain_started"), "the drain started")
        assert events(proxy, "drain_started")[0]["calls_left"] >= len(task_ids)
        assert proxy.process.poll() is None  # still draining: its results are not written yet
        filler.unlink()
        assert await asyncio.to_thread(proxy.process.wait, 30) == 0
        assert events(proxy, "settlement_lost") == []
        tasks = stored(database)
        for task_id in task_ids:
            status, result = tasks[task_id]
            assert status == "completed"
            assert result is not None
            assert json.loads(result)["content"][0]["text"] == "slept 1"


async def test_results_the_store_still_refuses_at_shutdown_are_logged_by_task_id_and_fail_at_the_next_start(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    with small_tmpfs("4m") as disk:
        database = disk / "tasks.db"
        sections: dict[str, Any] = {
            "store": {"path": str(database)},
            "tasks": {**policies(sleep={"mode": "required"}), "drain_seconds": 1},
        }
        proxy = ProxyProcess(tmp_path, upstream.url, **sections)
        processes.append(proxy)
        await proxy.start()
        async with aiohttp.ClientSession() as http:
            filler, task_ids = await held_back(http, proxy, disk, 2)
        # The disk is still full: the drain runs out, one last try fails, the WAL is left for the next start.
        assert await proxy.terminate() == 0
        lost = events(proxy, "settlement_lost")
        assert sorted(event["task_id"] for event in lost) == sorted(task_ids)
        assert all(event["writes"][-1] == "settle" for event in lost), lost
        assert "slept 1" not in proxy.log.read_text()  # the result value is never logged

        filler.unlink()
        assert {stored(database)[task_id][0] for task_id in task_ids} == {"working"}
        again = ProxyProcess(tmp_path, upstream.url, **sections)
        processes.append(again)
        await again.start()
        async with aiohttp.ClientSession() as http:
            for task_id in task_ids:
                task = await task_state(http, again.url, task_id)
                assert task["status"] == "failed"
                assert "restarted" in task["error"]["message"]
        assert await again.terminate() == 0
