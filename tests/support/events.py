"""Events extension helpers for the flow tests: `events/*` requests as a modern client sends them, and a real
webhook receiver on loopback that verifies every delivery with the `standardwebhooks` library, answers the
callback challenge, and answers deliveries with a scripted series of statuses."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientResponse, web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.support.wire import DECLARING, modern_body, modern_headers, read_messages, sse_messages


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


async def rpc(
    client: Any, method: str, params: dict[str, Any], *, principal: str | None = "alice", request_id: int | str = 1
) -> tuple[int, dict[str, Any]]:
    headers = modern_headers(method)
    if principal is not None:
        headers["Authorization"] = f"Bearer {principal}"
    response = await client.post(
        "/mcp", json=modern_body(method, params, request_id=request_id, capabilities=DECLARING), headers=headers
    )
    messages = await read_messages(response)
    return response.status, messages[-1]


async def open_stream(
    client: Any, params: dict[str, Any], *, principal: str = "alice", request_id: str = "S1"
) -> tuple[ClientResponse, AsyncIterator[dict[str, Any]]]:
    headers = {**modern_headers("events/stream"), "Authorization": f"Bearer {principal}"}
    response = await client.post(
        "/mcp",
        json=modern_body("events/stream", params, request_id=request_id, capabilities=DECLARING),
        headers=headers,
    )
    return response, sse_messages(response)


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    verified: bool
    at: float
    status: int


@dataclass
class Receiver:
    """A webhook endpoint: `statuses` answers deliveries in order (the last one repeats); the challenge is echoed
    unless `echo` is False. Every request is verified against `secret`."""

    secret: str = field(default_factory=new_secret)
    statuses: list[int] = field(default_factory=lambda: [200])
    echo: bool = True
    deliveries: list[Received] = field(default_factory=list)
    challenges: list[Received] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/hook"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = dict(request.headers)
        try:
            Webhook(self.secret).verify(body, headers)
            verified = True
        except WebhookVerificationError:
            verified = False
        message = json.loads(body)
        if message.get("type") == "verification":
            self.challenges.append(Received(headers, body, verified, time.time(), 200))
            if not self.echo:
                return web.json_response({"challenge": "wrong"})
            return web.json_response({"challenge": message["challenge"]})
        status = self.statuses[min(len(self.deliveries), len(self.statuses) - 1)]
        self.deliveries.append(Received(headers, body, verified, time.time(), status))
        return web.Response(status=status)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(received.body) for received in self.deliveries]
