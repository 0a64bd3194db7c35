"""Fault tests (`faults` marker): a killed proxy, a killed upstream, hostile input, many pollers at once.

Real processes on loopback, bounded in time. Nothing committed may be lost, no client input may produce a 5xx,
and every task must end in a clear state.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from proxy.edge._app_keys import POOL
from tests.support.clients import ClientFactory, Tasks, meta, rpc, task_state, task_until
from tests.support.processes import ProxyProcess, Upstream, key_file
from tests.support.waiting import until
from tests.support.wire import DECLARING, TASKS, policies, result_text

pytestmark = pytest.mark.faults

ELICIT_TASKS: dict[str, Any] = {**DECLARING, "elicitation": {}}


# --- a killed proxy --------------------------------------------------------------------------------------------


async def test_kill_9_loses_nothing_committed(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    """kill -9 with tasks working and waiting for input: at the next start every task resolves (failed with the
    restart message, or re-run per policy), the completed result is intact, the database is sound."""
    database = tmp_path / "faults.db"
    sections: dict[str, Any] = {
        "store": {"path": str(database)},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(
            echo={"mode": "required"},
            sleep={"mode": "required"},
            ask_name={"mode": "required"},
            counted={"mode": "required", "on_restart": "rerun"},
        ),
    }
    first = ProxyProcess(tmp_path, own_upstream.url, **sections)
    processes.append(first)
    await first.start()
    async with aiohttp.ClientSession() as session:

        async def create(tool: str, arguments: dict[str, Any]) -> str:
            params = {"name": tool, "arguments": arguments}
            status, message = await rpc(session, first.url, "tools/call", params, ELICIT_TASKS)
            assert status == 200, message
            task_id: str = message["result"]["taskId"]
            return task_id

        done = await create("echo", {"text": "kept"})
        await task_until(session, first.url, done, lambda task: task["status"] == "completed")
        working = await create("sleep", {"seconds": 30})
        waiting = await create("ask_name", {})
        await task_until(session, first.url, waiting, lambda task: task["status"] == "input_required")
        rerun = await create("counted", {"key": "kill-9", "seconds": 0.5})
        await asyncio.to_thread(first.stop)  # SIGKILL

        second = ProxyProcess(tmp_path, own_upstream.url, **sections)
        processes.append(second)
        await second.start()
        for task_id in (working, waiting):
            failed = await task_state(session, second.url, task_id)
            assert failed["status"] == "failed"
            assert "restarted" in failed["error"]["message"]
        again = await task_until(session, second.url, rerun, lambda task: task["status"] == "completed")
        assert result_text(again) in ("1", "2")  # sent again; the first run may or may not have reached the upstream
        kept = await task_state(session, second.url, done)
        assert result_text(kept) == "kept"
    with sqlite3.connect(database) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)


# --- a killed upstream ---------------------------------------------------------------------------------------------


async def test_an_upstream_killed_mid_call_fails_clearly_and_the_proxy_recovers(
    tasks_client: ClientFactory, own_upstream: Upstream
) -> None:
    """kill -9 of the upstream with a task and a sync call running: the task fails with a message naming the
    upstream, the sync caller gets a gateway error, the proxy keeps serving, and once the upstream is back (with
    none of its old sessions) calls work again on a new session."""
    client = await tasks_client(own_upstream.url, tasks=policies(sleep={"mode": "required"}))
    task_id = await client.create("sleep", {"seconds": 30})
    sync_client = Tasks(client.client, client.core, client.tasks)
    sync_call = asyncio.get_running_loop().create_task(
        sync_client.call("slow_compute", {"seconds": 30, "label": "cut"}, capabilities={})
    )
    pool = client.client.app[POOL]
    await until(lambda: pool.calls_in_flight >= 2, "both calls are open upstream")
    assert own_upstream.process is not None
    port = own_upstream.port
    own_upstream.process.kill()
    await asyncio.to_thread(own_upstream.process.wait)
    failed = await client.settled(task_id)
    assert failed["status"] == "failed"
    assert "Upstream" in failed["error"]["message"]
    status, message = await sync_call
    assert status in (502, 504), message
    assert message["error"]["code"] == -32603
    status, message = await client.call("echo", {"text": "down"}, capabilities={})
    assert status in (502, 504)  # the proxy answers, as a gateway, while the upstream is away
    await asyncio.to_thread(own_upstream.start, port)
    status, message = await client.call("echo", {"text": "back"}, capabilities={})
    assert status == 200, message
    assert message["result"]["content"][0]["text"] == "back"


# --- many pollers ------------------------------------------------------------------------------------------------


async def test_two_hundred_pollers_while_tasks_come_and_go(tasks_client: ClientFactory) -> None:
    """200 clients poll tasks/get while tasks are created and settle: no errors, no task lost."""
    client = await tasks_client(tasks={**policies(counted={"mode": "required"}), "max_running": 4096})
    task_ids: list[str] = []
    errors: list[Any] = []
    creating = True

    async def creator() -> None:
        for number in range(60):
            task_ids.append(await client.create("counted", {"key": f"poll-{number}", "seconds": 0.2}))

    async def poller(seed: int) -> None:
        rng = random.Random(seed)
        poller_client = Tasks(client.client, client.core, client.tasks)
        while creating or rng.random() < 0.5:
            if task_ids:
                status, message = await poller_client.get(rng.choice(task_ids))
                if status != 200:
                    errors.append(message)
            await asyncio.sleep(rng.uniform(0, 0.05))

    pollers = [asyncio.get_running_loop().create_task(poller(seed)) for seed in range(200)]
    await creator()
    creating = False
    await asyncio.gather(*pollers)
    assert errors == []
    for task_id in task_ids:
        done = await client.settled(task_id)
        assert done["status"] == "completed"
    assert len(set(task_ids)) == 60


# --- hostile input ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON token written into the body as it is: what `json.dumps` cannot produce (1e999, deep nesting)."""

    token: str


def _nested(depth: int, closed: bool, bracket: str) -> Raw:
    opening, closing = ("[", "]") if bracket == "[" else ('{"a":', "}")
    return Raw(opening * depth + ("0" + closing * depth if closed else ""))


# Lone surrogates, RTL marks, NUL, noncharacters, an emoji, a combining mark, and any character at all.
ODD_CHARACTERS = "\ud800\udfff\udc80\u200f\u202e\u0000\ufffe\uffff\ufdd0\U0010ffff\U0001f600\u0301\u00e9\u4e2d"
ODD_TEXT = st.text(st.sampled_from(ODD_CHARACTERS) | st.characters(exclude_categories=()), max_size=12)
ODD_NUMBERS = st.sampled_from(
    [
        *("1e999", "-1e999", "1E400", "2e308", "-0", "-0.0", "0e0", "4.9e-324", "1e-400"),
        *("1" + "0" * 400, "-" + "9" * 1000, "9" * 5000),
        *("NaN", "Infinity", "-Infinity"),
    ]
).map(Raw)
DEEP = st.builds(_nested, st.sampled_from([127, 128, 129, 1000, 20_000]), st.booleans(), st.sampled_from("[{"))
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=30)
    | ODD_TEXT
    | ODD_NUMBERS
    | DEEP,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10) | ODD_TEXT, children, max_size=4)
    ),
    max_leaves=12,
)
METHOD_NAMES = [
    "tools/call",
    "tools/list",
    "tasks/get",
    "tasks/update",
    "tasks/cancel",
    "tasks/result",
    "tasks/list",
    "server/discover",
    "prompts/get",
    "resources/read",
    "initialize",
    "ping",
    "subscriptions/listen",
]
METHODS = st.sampled_from(METHOD_NAMES) | st.text(max_size=20) | ODD_TEXT
META_KEYS = [
    "io.modelcontextprotocol/protocolVersion",
    "io.modelcontextprotocol/clientCapabilities",
    "io.modelcontextprotocol/clientInfo",
    "progressToken",
]
META = st.one_of(
    st.just(meta({})),
    st.just(meta({"extensions": {TASKS: {}}})),
    st.builds(
        lambda base, extra: {**base, **extra},
        st.just(meta({"extensions": {TASKS: {}}})),
        st.dictionaries(st.sampled_from(META_KEYS[2:]) | ODD_TEXT, JSON_VALUES, max_size=3),
    ),
    st.dictionaries(st.sampled_from(META_KEYS) | ODD_TEXT, JSON_VALUES),
    JSON_VALUES,
)
PARAMS = st.builds(
    lambda known, extra: {**extra, **known},
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(["echo", "sleep", "ask_name"]) | ODD_TEXT | JSON_VALUES,
            "arguments": JSON_VALUES,
            "taskId": st.sampled_from(["task_x", ""]) | ODD_TEXT | JSON_VALUES,
            "cursor": ODD_TEXT | JSON_VALUES,
            "inputResponses": JSON_VALUES,
            "requestState": st.text(max_size=200) | ODD_TEXT | JSON_VALUES,
            "_meta": META,
            "uri": ODD_TEXT | JSON_VALUES,
        },
    ),
    st.dictionaries(ODD_TEXT, JSON_VALUES, max_size=2),
)
# Any field value HTTP allows (visible ASCII, space, tab, and bytes >= 0x80 as obs-text): odd text goes out as
# its UTF-8 bytes, a lone surrogate as the three bytes a lenient encoder writes for it.
HEADER_TEXT = st.text(
    st.characters(min_codepoint=32, max_codepoint=255, exclude_characters="\x7f")
    | st.sampled_from(ODD_CHARACTERS.replace("\u0000", "")),
    max_size=40,
)
REQUESTS = st.fixed_dictionaries(
    {
        "method": METHODS,
        "params": PARAMS | JSON_VALUES,
        "id": st.integers(min_value=-(2**70), max_value=2**70) | ODD_TEXT | ODD_NUMBERS | JSON_VALUES,
        "shape": st.sampled_from(["object", "batch", "raw", "huge", "no-jsonrpc"]),
        "ascii_only": st.booleans(),
        "raw": st.binary(max_size=64),
        "version_header": st.sampled_from(["2026-07-28", "2025-11-25", "", "v999"]) | HEADER_TEXT,
        "method_header": st.none() | st.sampled_from(METHOD_NAMES) | HEADER_TEXT,
        "name_header": st.none() | HEADER_TEXT,
        "principal_header": st.none() | HEADER_TEXT,
    }
)
# A sound modern request with one position replaced by a hostile value: reaches deeper than a random body.
SOUND_REQUESTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("tools/call", {"name": "echo", "arguments": {"text": "hi"}}, "echo"),
    ("tools/call", {"name": "sleep", "arguments": {"seconds": 0.01}}, "sleep"),
    ("tools/list", {"cursor": "c"}, None),
    ("tasks/get", {"taskId": "task_x"}, "task_x"),
    ("tasks/cancel", {"taskId": "task_x"}, None),
    ("tasks/update", {"taskId": "task_x", "inputResponses": {"k": {"action": "cancel"}}}, None),
    ("server/discover", {}, None),
    ("prompts/get", {"name": "test_prompt_with_arguments", "arguments": {"arg1": "a", "arg2": "b"}}, None),
    ("resources/read", {"uri": "test://static-text"}, "test://static-text"),
]
BODY_POSITIONS = [
    "id",
    "method",
    "param_key",
    "param_value",
    "argument_key",
    "argument_value",
    "meta_key",
    "meta_value",
]
HEADER_POSITIONS = ["version_header", "method_header", "name_header", "principal_header"]
HOSTILE_VALUES = ODD_TEXT | ODD_NUMBERS | DEEP | JSON_VALUES


def _mutated(
    sound: tuple[str, dict[str, Any], str | None], position: str, value: Any, key: str, header: str, ascii_only: bool
) -> dict[str, Any]:
    method, params, name = sound
    params = {**params, "arguments": dict(params.get("arguments", {}))} if "arguments" in params else dict(params)
    params["_meta"] = meta({"extensions": {TASKS: {}}})
    data: dict[str, Any] = {
        "method": method,
        "params": params,
        "id": 1,
        "shape": "object",
        "ascii_only": ascii_only,
        "raw": b"",
        "version_header": "2026-07-28",
        "method_header": method,
        "name_header": name,
        "principal_header": "Bearer caller-1",
    }
    if position in ("id", "method"):
        data[position] = value
    elif position == "param_key":
        params[key] = value
    elif position == "param_value":
        params[next(iter(params))] = value
    elif position == "argument_key":
        params["arguments"] = {**params.get("arguments", {}), key: value}
    elif position == "argument_value":
        params["arguments"] = {"text": value}
    elif position == "meta_key":
        params["_meta"] = {**params["_meta"], key: value}
    elif position == "meta_value":
        params["_meta"] = {**params["_meta"], "progressToken": value}
    else:
        data[position] = header
    return data


MUTATED = st.builds(
    _mutated,
    st.sampled_from(SOUND_REQUESTS),
    st.sampled_from(BODY_POSITIONS + HEADER_POSITIONS),
    HOSTILE_VALUES,
    ODD_TEXT,
    HEADER_TEXT,
    st.booleans(),
)
ALLOWED_CODES = {
    400: {-32700, -32600, -32602, -32020, -32021, -32022},
    404: {-32601},
    405: {-32600},
    413: {-32600},
}


def encode(value: Any, ascii_only: bool) -> str:
    """JSON text of `value` with its Raw tokens as they are; strings escaped (`ascii_only`) or written raw."""
    if isinstance(value, Raw):
        return value.token
    if isinstance(value, dict):
        members = (
            f"{json.dumps(str(key), ensure_ascii=ascii_only)}:{encode(item, ascii_only)}" for key, item in value.items()
        )
        return "{" + ",".join(members) + "}"
    if isinstance(value, list):
        return "[" + ",".join(encode(item, ascii_only) for item in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def header_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def hostile_proxy(tmp_path_factory: pytest.TempPathFactory, upstream: Upstream) -> Iterator[ProxyProcess]:
    tmp_path = tmp_path_factory.mktemp("hostile")
    proxy = ProxyProcess(
        tmp_path, upstream.url, security={"max_body_bytes": 65536}, tasks=policies(sleep={"mode": "required"})
    )
    asyncio.run(proxy.start())
    yield proxy
    proxy.stop()


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(REQUESTS | MUTATED)
def test_hostile_requests_never_get_a_5xx(
    hostile_proxy: ProxyProcess, upstream: Upstream, request_data: dict[str, Any]
) -> None:
    """Malformed, oversized, wrongly typed and wrongly headed requests, with lone surrogates, odd unicode, numbers
    JSON cannot carry and deep nesting in every string and value position: never a 5xx from the proxy, never a
    crash, and every error of its own is a JSON-RPC error whose code fits its HTTP status. A request classified
    as legacy is relayed verbatim, so its answer must be exactly what the upstream gives a direct client."""
    message = {"jsonrpc": "2.0", "id": request_data["id"], "method": request_data["method"]}
    message["params"] = request_data["params"]
    shape, ascii_only = request_data["shape"], request_data["ascii_only"]
    if shape == "batch":
        text = encode([message, message], ascii_only)
    elif shape == "huge":
        text = encode({**message, "padding": "x" * 70_000}, ascii_only)
    elif shape == "no-jsonrpc":
        text = encode({key: value for key, value in message.items() if key != "jsonrpc"}, ascii_only)
    else:
        text = encode(message, ascii_only)
    body = request_data["raw"] if shape == "raw" else text.encode("utf-8", "surrogatepass")
    headers = {"Content-Type": b"application/json", "Accept": b"application/json, text/event-stream"}
    for name, key in [
        ("MCP-Protocol-Version", "version_header"),
        ("Mcp-Method", "method_header"),
        ("Mcp-Name", "name_header"),
        ("Authorization", "principal_header"),
    ]:
        if request_data[key]:
            headers[name] = header_bytes(request_data[key])
    status, answer = post(hostile_proxy.port, headers, body)
    assert hostile_proxy.process is not None
    assert hostile_proxy.process.poll() is None, "the proxy died"
    if status < 400:
        event(f"HTTP {status}")
        return
    direct_status, direct_answer = post(upstream.port, headers, body)
    if (status, answer) == (direct_status, direct_answer):
        event(f"HTTP {status}, relayed from the upstream")
        return  # a legacy request relayed verbatim: the upstream's own answer, as a direct client gets it
    event(f"HTTP {status}, from the proxy")
    assert status < 500, (status, answer[:300])
    error = json.loads(answer)["error"]
    assert error["code"] in ALLOWED_CODES.get(status, {-32600, -32602}), (status, error)


def post(port: int, headers: dict[str, bytes], body: bytes) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("POST", "/mcp")
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", errors="replace")
    finally:
        connection.close()
