"""The operations listener of an in-process proxy (`observability.port`: metrics, readiness with its reasons),
served for one request on loopback, as `serve` serves it beside the MCP port."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.edge._ops import ops_app


async def ops_get(proxy: web.Application, path: str) -> tuple[int, str]:
    """GET `path` on the operations listener of the proxy app `proxy`: the status and the body."""
    client: TestClient[web.Request, Any] = TestClient(TestServer(ops_app(proxy), host="127.0.0.1"))
    await client.start_server()
    try:
        async with client.get(path) as response:
            return response.status, await response.text()
    finally:
        await client.close()


async def scrape(proxy: web.Application) -> str:
    """The Prometheus text of the proxy app `proxy`."""
    status, text = await ops_get(proxy, "/metrics")
    assert status == 200, text
    return text
