"""`python -m benchmarks.credentials [--quick]`: what `upstream.credentials: exchange` costs once its cache is warm.

1. The credential source per upstream request, CPU time in this process: `forward` (the caller's header) and
   `exchange` with the caller's exchanged token cached (the hit that every request after the first makes).
2. The proxy's added latency for a modern synchronous `tools/call` by a caller with a Bearer JWT (`security.jwt`
   on in both): `credentials: forward` beside `credentials: exchange` (warm: one exchange per caller, at the
   first call), both against the legacy client talking to the lean upstream directly, interleaved. The token
   endpoint is a small one in this process (an RFC 8693 answer with a one-hour token).

Prints the rows and writes `benchmarks/results/credentials.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from benchmarks.harness import (
    LegacyClient,
    ModernClient,
    Process,
    free_port,
    interleaved,
    measure,
    proxy_config,
    spawn,
    start_proxy,
    start_upstream,
    wait_for_port,
)
from benchmarks.oauth import ISSUER, WithHeaders, key_set, token
from proxy.config.credentials import ExchangeConfig
from proxy.principals import Identity, Principals
from proxy.upstream.credentials import Exchange, Forward
from proxy.upstream.credentials._token_client import TokenClient

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "credentials.json"


async def _token_endpoint() -> tuple[web.AppRunner, str, list[int]]:
    """An RFC 8693 token endpoint that exchanges anything for a one-hour token (and counts the exchanges)."""
    exchanges = [0]

    async def token(request: web.Request) -> web.Response:
        exchanges[0] += 1
        await request.post()
        return web.json_response(
            {"access_token": secrets.token_urlsafe(32), "token_type": "Bearer", "expires_in": 3600}
        )

    app = web.Application()
    app.router.add_post("/token", token)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/token", exchanges


async def source_rows(directory: Path, token_url: str, quick: bool) -> list[dict[str, Any]]:
    secret = directory / "client-secret"
    secret.write_text("s" * 32)
    config = ExchangeConfig(token_url=token_url, client_id="proxy", client_secret_file=str(secret), audience="up")
    principals = Principals(b"k" * 32, keep_owner=True)
    caller = Identity("Bearer x.y.z", owner=json.dumps([ISSUER, "alice"]), expires_at=time.time() + 3600)
    exchange = Exchange(config, principals, TokenClient(config, "s" * 32, None, None), None)
    forward = Forward("authorization")
    await exchange.headers(caller, "echo")  # the one exchange: the cache is warm from here on
    count = 2000 if quick else 20000
    rows = []
    for label, source in (("forward", forward), ("exchange, cached token", exchange)):
        runs = []
        for _ in range(5):
            started = time.process_time()
            for _ in range(count):
                await source.headers(caller, "echo")
            runs.append((time.process_time() - started) / count * 1e6)
        rows.append({"row": f"credential source per upstream request, {label}", "cpu_us": statistics.median(runs)})
    await exchange.close()
    return rows


async def _exchanging_proxy(
    url: str, directory: Path, security: dict[str, Any], credentials: dict[str, Any]
) -> Process:
    """`start_proxy`'s proxy, with `upstream.credentials` set."""
    port = free_port()
    config = proxy_config(url, directory, "exchange", port, {"path": str(directory / "exchange.db")}, security=security)
    settings = json.loads(config.read_text())
    settings["upstream"]["credentials"] = credentials
    config.write_text(json.dumps(settings))
    process = spawn(["-m", "proxy", "serve", "--config", str(config)])
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}/mcp")


async def latency_rows(directory: Path, token_url: str, exchanges: list[int], quick: bool) -> list[dict[str, Any]]:
    key, path = key_set(directory)
    secret = directory / "client-secret"
    secret.write_text("s" * 32)
    upstream = await start_upstream()
    security = {"jwt": {"jwks_file": str(path), "issuer": ISSUER}}
    exchange = {
        "mode": "exchange",
        "exchange": {"token_url": token_url, "client_id": "proxy", "client_secret_file": str(secret), "audience": "up"},
    }
    forwarding = await start_proxy(upstream.url, directory, "forward", security=security)
    exchanging = await _exchanging_proxy(upstream.url, directory, security, exchange)
    rows = []
    bearer = {"Authorization": f"Bearer {token(key, 'alice')}"}
    try:
        direct = LegacyClient(upstream.url)
        await direct.start()
        clients = {}
        for label, proxy in (("credentials: forward", forwarding), ("credentials: exchange, warm cache", exchanging)):
            client = ModernClient(proxy.url)
            client.http = WithHeaders(client.http, bearer)  # type: ignore[assignment]
            await measure(client.echo, 50, 1)
            clients[label] = client
        count = 300 if quick else 1500
        for label, client in clients.items():
            base, sample = await interleaved(direct.echo, client.echo, count=count, concurrency=1)
            rows.append(
                {
                    "row": f"modern tools/call through the proxy, Bearer JWT, {label}, concurrency 1",
                    "p50_ms": sample.percentile(0.5),
                    "direct_p50_ms": base.percentile(0.5),
                    "added_p50_ms": sample.percentile(0.5) - base.percentile(0.5),
                    "added_p99_ms": sample.percentile(0.99) - base.percentile(0.99),
                }
            )
            client.close()
        rows.append({"row": "token exchanges made by the exchanging proxy (one caller)", "count": float(exchanges[0])})
        direct.close()
    finally:
        forwarding.stop()
        exchanging.stop()
        upstream.stop()
    return rows


async def main(quick: bool) -> None:
    runner, token_url, exchanges = await _token_endpoint()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            rows = await source_rows(Path(workdir), token_url, quick)
            exchanges[0] = 0
            rows += await latency_rows(Path(workdir), token_url, exchanges, quick)
    finally:
        await runner.cleanup()
    for row in rows:
        figures = ", ".join(f"{name} {value:.3f}" for name, value in row.items() if name != "row")
        print(f"{row['row']}: {figures}")
    RESULTS.write_text(json.dumps({"rows": rows, "quick": quick}, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    asyncio.run(main(parser.parse_args().quick))
