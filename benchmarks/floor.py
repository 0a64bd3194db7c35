"""The floor of a hop on this stack: the proxy beside the least an aiohttp relay can do.

    python -m benchmarks.run --only floor [--quick]             # the `floor` group of `make bench`
    python -m benchmarks.floor --relay UPSTREAM_URL --port N   # the floor relay alone

The floor relay is aiohttp's server on uvloop with one handler: read the POST, send it upstream through the
proxy's own lean client (`proxy/upstream/http/lean.py`) with the client's headers, read the answer whole and
write it back. No admission checks, limits, metrics, logging, tracing or drain, and no streaming: what no
relay on aiohttp can do without. Legacy `tools/call`s go through it and through the proxy (pass-through), each
against the upstream called directly, batches of the three interleaved, in front of the mcp 1.x SDK server
and of the lean upstream, at concurrency 1 and 16. What the floor adds is the price of the stack (a CPython
event loop, aiohttp's server, one more pair of socket writes); what the proxy adds beyond it is its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    LegacyClient,
    Process,
    Row,
    Sample,
    free_port,
    measure,
    spawn,
    start_proxy,
    wait_for_port,
)

SKIPPED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})


def serve_relay(upstream_url: str, port: int) -> None:
    """The floor relay (see the module's text), until killed."""
    import uvloop
    from aiohttp import web
    from yarl import URL

    from proxy.upstream.http.lean import LeanClient

    url = URL(upstream_url)
    client = LeanClient(url, 5, 60)

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        headers = [(name, value) for name, value in request.headers.items() if name.lower() not in SKIPPED]
        answer = await client.post(url.raw_path_qs, headers, body)
        payload = await answer.read()
        kept = {name: value for name, value in answer.headers.items() if name.lower() not in SKIPPED}
        return web.Response(status=answer.status, headers=kept, body=payload)

    app = web.Application()
    app.router.add_post(url.path, relay)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def start_floor(upstream: Process) -> Process:
    port = free_port()
    process = spawn(["-m", "benchmarks.floor", "--relay", upstream.url, "--port", str(port)])
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}/mcp")


async def floor_rows(upstream: Process, label: str, workdir: Path, quick: bool) -> list[Row]:
    floor = await start_floor(upstream)
    proxy = await start_proxy(upstream.url, workdir, f"floor-{len(label)}")
    clients = [LegacyClient(url) for url in (upstream.url, floor.url, proxy.url)]
    rows = []
    try:
        for client in clients:
            await client.start()
        for concurrency in (1, 16):
            samples = [Sample(), Sample(), Sample()]
            cpu = [0.0, 0.0]
            count = (300 if quick else 1200) if concurrency == 1 else (600 if quick else 3000)
            for client in clients:
                await measure(client.echo, 50, concurrency)  # warm-up
            for round_number in range(6):
                order = (0, 1, 2) if round_number % 2 == 0 else (2, 1, 0)
                for index in order:
                    hop = (None, floor, proxy)[index]
                    before = hop.cpu_seconds() if hop is not None else 0.0
                    samples[index].merge(await measure(clients[index].echo, count // 6, concurrency))
                    if hop is not None:
                        cpu[index - 1] += hop.cpu_seconds() - before
            direct, through_floor, through_proxy = samples

            def ratios(via: Sample, direct: Sample = direct) -> str:
                return (
                    f"{via.rate / direct.rate:.2f}x throughput, p50 {via.percentile(0.5):.2f} ms"
                    f" ({via.percentile(0.5) / direct.percentile(0.5):.2f}x)"
                )

            rows.append(
                Row(
                    f"pass-through: the floor relay and the proxy vs legacy direct, {label}, concurrency {concurrency}",
                    f"direct p50 {direct.percentile(0.5):.2f} ms; floor {ratios(through_floor)}, CPU"
                    f" {cpu[0] * 1000 / through_floor.count:.2f} ms/call; proxy {ratios(through_proxy)}, CPU"
                    f" {cpu[1] * 1000 / through_proxy.count:.2f} ms/call",
                    "",
                    None,
                    {
                        "direct_rps": direct.rate,
                        "floor_throughput_ratio": through_floor.rate / direct.rate,
                        "proxy_throughput_ratio": through_proxy.rate / direct.rate,
                        "floor_p50_ratio": through_floor.percentile(0.5) / direct.percentile(0.5),
                        "proxy_p50_ratio": through_proxy.percentile(0.5) / direct.percentile(0.5),
                        "floor_cpu_ms_per_call": cpu[0] * 1000 / through_floor.count,
                        "proxy_cpu_ms_per_call": cpu[1] * 1000 / through_proxy.count,
                    },
                )
            )
    finally:
        for client in clients:
            client.close()
        floor.stop()
        proxy.stop()
    return rows


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--relay", metavar="UPSTREAM_URL", help="serve the floor relay in front of this URL")
    parser.add_argument("--port", type=int, help="the floor relay's port")
    args = parser.parse_args(argv)
    if args.relay:
        if args.port is None:
            parser.error("--relay needs --port")
        serve_relay(args.relay, args.port)
        return 0
    parser.error("the floor rows run in `python -m benchmarks.run --only floor`; alone this serves --relay only")


if __name__ == "__main__":
    sys.exit(main())
