"""End to end: each caller's share of the proxy's limits, and what needs no upstream session of its own.

One caller cannot starve the others: listen streams, running tasks and parked MRTR calls are capped per caller
(HTTP 429) as well as in total (HTTP 503), each with `data.limit` naming the limit. `server/discover` from a new
caller is answered from the latest InitializeResult, without an upstream session of its own.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from proxy.edge._app_keys import POOL, RUNNER
from proxy.tasks.live_call import LiveCall
from tests.support.clients import ClientFactory, Tasks, upstream_calls_open
from tests.support.ops import scrape
from tests.support.waiting import until
from tests.support.wire import modern_body, modern_headers, policies

ELICIT: dict[str, Any] = {"elicitation": {}}


def as_caller(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}"}


async def test_listen_streams_are_capped_per_caller_and_in_total(tasks_client: ClientFactory) -> None:
    client = await tasks_client(limits={"max_listen_streams": 3, "max_listen_streams_per_principal": 2})
    body = modern_body("subscriptions/listen", {"notifications": {"toolsListChanged": True}}, request_id="l")
    opened: list[Any] = []

    async def listen(caller: str) -> int:
        headers = {**modern_headers("subscriptions/listen"), **as_caller(caller)}
        response = await client.client.post("/mcp", json=body, headers=headers)
        if response.status != 200:
            await response.read()
            return response.status
        await response.content.readline()  # the acknowledgement has started the stream
        opened.append(response)
        return 200

    async def refused(caller: str) -> tuple[int, dict[str, Any]]:
        status, message = await Tasks(client.client, client.core, client.tasks).post(
            "subscriptions/listen", body["params"], capabilities={}, headers=as_caller(caller)
        )
        return status, message

    assert await listen("a") == 200
    assert await listen("a") == 200
    status, message = await refused("a")
    assert (status, message["error"]["data"]) == (429, {"limit": "max_listen_streams_per_principal", "max": 2})
    assert await listen("b") == 200
    status, message = await refused("c")
    assert (status, message["error"]["data"]) == (503, {"limit": "max_listen_streams", "max": 3})
    opened.pop(0).close()  # one of a's streams ends: a may open one again

    async def reopened() -> bool:
        return await listen("a") == 200

    await until(reopened, "the proxy never saw a's stream go", 5)
    for response in opened:
        response.close()


async def test_running_tasks_are_capped_per_caller(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(sleep={"mode": "required"}), limits={"max_running_per_principal": 1})
    await client.create("sleep", {"seconds": 30}, headers=as_caller("hog"))
    status, message = await client.call("sleep", {"seconds": 30}, headers=as_caller("hog"))
    assert (status, message["error"]["code"]) == (429, -32603)
    assert message["error"]["data"] == {"limit": "max_running_per_principal", "max": 1}
    await client.create("sleep", {"seconds": 30}, headers=as_caller("other"))  # the others go on


async def test_parked_calls_are_capped_per_caller(tasks_client: ClientFactory) -> None:
    client = await tasks_client(limits={"max_parked_per_principal": 1})
    params = {"name": "ask_name", "arguments": {}}
    _, parked = await client.post("tools/call", params, capabilities=ELICIT, headers=as_caller("hog"))
    assert parked["result"]["resultType"] == "input_required"
    status, message = await client.post("tools/call", params, capabilities=ELICIT, headers=as_caller("hog"))
    assert (status, message["error"]["data"]) == (429, {"limit": "max_parked_per_principal", "max": 1})
    _, other = await client.post("tools/call", params, capabilities=ELICIT, headers=as_caller("other"))
    assert other["result"]["resultType"] == "input_required"


async def test_discover_from_new_callers_opens_no_upstream_session_of_theirs(tasks_client: ClientFactory) -> None:
    client = await tasks_client()
    pool = client.client.app[POOL]
    status, first = await client.post("server/discover", {}, capabilities={}, headers=as_caller("first"))
    assert status == 200
    sessions = pool.open_sessions
    for number in range(50):
        status, message = await client.post("server/discover", {}, capabilities={}, headers=as_caller(f"new-{number}"))
        assert status == 200
        assert message["result"]["capabilities"] == first["result"]["capabilities"]
    assert pool.open_sessions == sessions  # not one session more for fifty new callers
    await upstream_calls_open(client.client, 0)


async def test_a_client_that_reads_nothing_of_a_chatty_call_holds_no_more_than_the_backlog_cap(
    tasks_client: ClientFactory,
) -> None:
    """A synchronous call whose upstream sends 8 MB of log lines (more than the kernel buffers), a progress
    notification after each, for a client that asked for both and then reads nothing (its receive buffer kept
    small): the upstream is read to its answer all the same, what waits for the client stays under
    `limits.max_client_backlog_bytes`, progress is coalesced, the rest past the cap is dropped and counted, and
    the call's answer is kept."""
    cap = 64 * 1024
    client = await tasks_client(limits={"max_client_backlog_bytes": cap, "write_timeout_seconds": 120})
    meta = {"progressToken": "chat", "io.modelcontextprotocol/logLevel": "info"}
    body = json.dumps(modern_body("tools/call", {"name": "chatty", "arguments": {"count": 8000}}, **meta)).encode()
    headers = {**modern_headers("tools/call", "chatty"), "Host": f"127.0.0.1:{client.client.port}"}
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    request = f"POST /mcp HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body

    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    silent.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(silent, ("127.0.0.1", client.client.port))
    await loop.sock_sendall(silent, request)  # ... and never a read
    try:
        table = client.client.app[RUNNER].table

        def chatty() -> LiveCall | None:
            return next((call for call in table.calls() if call.name == "chatty"), None)

        call = await until(chatty, "the chatty call")
        await until(lambda: call.state.outcome is not None, "the upstream's answer", timeout_seconds=60)
        assert call.client.backlog_bytes <= cap
        assert call.client.dropped > 0  # past the cap: log lines dropped ...
        assert call.client.queued()  # ... and the answer kept, behind what still waits
        text = await scrape(client.client.app)  # the operations listener's /metrics
        dropped = {
            line.split("reason=")[1].split("}")[0].strip('"'): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("mcp_tasks_proxy_client_notifications_dropped_total{")
        }
        assert dropped["backlog_full"] == call.client.dropped
        assert dropped["coalesced"] > 0
    finally:
        silent.close()
