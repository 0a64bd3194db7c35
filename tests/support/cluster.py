"""Several proxy replicas on one PostgreSQL database, as pods of one Deployment: each `python -m proxy serve`
process has a legacy fixture upstream of its own, and all of them share the database and the requestState
key. Clients reach them round-robin (each request to the next replica, no stickiness) or one replica at a
time. Used by the replica flow tests; nothing here is mocked.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, cast

import aiohttp
import psycopg

from tests import pg
from tests.support.clients import Client, Tasks
from tests.support.processes import ProxyProcess, Upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until_sync

START_SECONDS = 30.0
DRAIN_SECONDS = 1.0  # a stopped replica drains this long at most (the drain tests choose their own)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def ready(port: int) -> bool:
    try:
        with _DIRECT.open(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


class Replica:
    """One pod: a proxy process and its own upstream."""

    def __init__(
        self,
        workdir: Path,
        dsn: str,
        key: Path,
        lease_seconds: float,
        tools: dict[str, Any],
        *,
        drain_seconds: float = DRAIN_SECONDS,
        store: dict[str, Any] | None = None,
        sections: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """`store`: more `store:` fields; `sections`: other config sections (`idempotency`, ...)."""
        self.upstream = Upstream()
        self.upstream.start()
        self.proxy = ProxyProcess(
            workdir,
            self.upstream.url,
            store={"url": pg.as_url(dsn), "lease_seconds": lease_seconds, **(store or {})},
            inputs={"secret_file": str(key)},
            upstream={"call_timeout_seconds": 120},
            tasks={"tools": tools, "drain_seconds": drain_seconds},
            **(sections or {}),
        )
        self.start()

    def start(self) -> None:
        """Start the proxy process and wait until it is ready (store, lease and upstream)."""
        self.proxy.process = self.proxy._spawn()
        process = self.proxy.process

        def up() -> bool:
            assert process.poll() is None, self.proxy.log.read_text()[-4000:]
            return ready(self.proxy.port)

        until_sync(up, "the replica did not become ready", START_SECONDS)

    @property
    def pid(self) -> int:
        assert self.proxy.process is not None
        return self.proxy.process.pid

    def signal(self, signum: signal.Signals) -> None:
        os.kill(self.pid, signum)

    def terminate(self) -> int:
        assert self.proxy.process is not None
        self.proxy.process.send_signal(signal.SIGTERM)
        return self.proxy.process.wait(60)

    def stop(self) -> None:
        self.proxy.stop()  # SIGKILL: it also ends a process paused with SIGSTOP
        self.upstream.stop()

    def events(self) -> list[dict[str, Any]]:
        return self.proxy.events()


class Cluster:
    def __init__(
        self,
        workdir: Path,
        dsn: str,
        count: int,
        lease_seconds: float,
        tools: dict[str, Any],
        *,
        drain_seconds: float = DRAIN_SECONDS,
    ) -> None:
        self.dsn = dsn
        self.lease_seconds = lease_seconds
        key = workdir / "request-state.key"
        key.write_bytes(os.urandom(48).hex().encode())
        self.replicas: list[Replica] = []
        try:
            for _ in range(count):
                self.replicas.append(Replica(workdir, dsn, key, lease_seconds, tools, drain_seconds=drain_seconds))
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def rows(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        """Read the shared database directly (what any replica's tasks/get would read)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn, conn.cursor() as cursor:
            cursor.execute(sql.encode(), params)
            names = [column.name for column in cursor.description or []]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def records(self, task_ids: list[str]) -> dict[str, dict[str, Any]]:
        rows = self.rows(
            "SELECT task_id, owner, status, status_message, result, updated_at_ms FROM tasks WHERE task_id = ANY(%s)",
            [task_ids],
        )
        for row in rows:
            row["result"] = None if row["result"] is None else json.loads(row["result"])
        return {row["task_id"]: row for row in rows}


class RoundRobin:
    """What `Tasks` posts through: each request goes to the next of `urls` (one URL: always that replica)."""

    def __init__(self, session: aiohttp.ClientSession, urls: list[str]) -> None:
        self.session = session
        self.urls = urls
        self._next = itertools.cycle(range(len(urls)))
        self.last = -1  # the index of the replica the latest request went to

    def post(self, path: str, **kwargs: Any) -> Any:
        self.last = next(self._next)
        return self.session.post(self.urls[self.last], **kwargs)


def client(
    session: aiohttp.ClientSession, replicas: list[Replica], core: ModernSchema, tasks: SchemaValidator
) -> tuple[Tasks, RoundRobin]:
    """A schema-checking Tasks client over these replicas, round-robin."""
    http = RoundRobin(session, [replica.proxy.url for replica in replicas])
    return Tasks(cast(Client, http), core, tasks), http
