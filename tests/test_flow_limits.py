"""End to end: each caller's share of the proxy's limits, and what needs no upstream session of its own.

One caller cannot starve the others: listen streams, running tasks and parked MRTR calls are capped per caller
(HTTP 429) as well as in total (HTTP 503), each with `data.limit` naming the limit. `server/discover` from a new
caller is answered from the latest InitializeResult, without an upstream session of its own.
"""

from __future__ import annotations

from typing import Any

from proxy.edge._app_keys import POOL
from tests.support.clients import ClientFactory, Tasks, upstream_calls_open
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
