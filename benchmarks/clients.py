"""CPU per POST of the two upstream HTTP clients the proxy has: aiohttp's, set up as the relay sets it up, and
the lean client of `proxy/upstream/http/lean.py`, in one process, against the lean upstream.

    python -m benchmarks.clients [--calls N] [--rounds R]

Each round sends N sequential POSTs (a legacy `tools/call`, answered as JSON) through each client in turn and
reads each answer whole, on uvloop when it is installed (as the proxy); the process's CPU time per POST is
printed per round and as the median. Not part of `make bench`: it measures one client against another, not
the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable

from yarl import URL

from benchmarks.harness import LegacyClient, start_upstream
from proxy.legacy.passthrough import NO_AUTO_HEADERS
from proxy.upstream.http.lean import LeanClient
from proxy.upstream.http.session import relay_client

BODY = json.dumps(
    {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo", "arguments": {"text": "x"}}}
).encode()


async def _cpu_per_call(send: Callable[[], Awaitable[None]], calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        await send()
    return (time.process_time() - started) / calls * 1e6


async def run(calls: int, rounds: int) -> None:
    upstream = await start_upstream()
    session = LegacyClient(upstream.url)
    await session.start()  # for its session headers
    headers = dict(session.headers)
    session.close()
    url = URL(upstream.url)
    http = relay_client()
    lean = LeanClient(url, 5, 60)

    async def through_aiohttp() -> None:
        async with http.post(url, data=BODY, headers=headers, skip_auto_headers=NO_AUTO_HEADERS) as response:
            await response.read()

    async def through_lean() -> None:
        response = await lean.post(url.raw_path_qs, headers.items(), BODY)
        await response.read()

    results: dict[str, list[float]] = {"aiohttp": [], "lean": []}
    try:
        for send in (through_aiohttp, through_lean):  # warm-up
            await _cpu_per_call(send, 200)
        for round_number in range(rounds):
            order = [("aiohttp", through_aiohttp), ("lean", through_lean)]
            for name, send in order if round_number % 2 == 0 else reversed(order):
                results[name].append(await _cpu_per_call(send, calls))
        for name, values in results.items():
            rounded = ", ".join(f"{value:.0f}" for value in values)
            print(f"{name:8} CPU per POST: median {statistics.median(values):.0f} µs (rounds: {rounded})")
        ratio = statistics.median(results["lean"]) / statistics.median(results["aiohttp"])
        print(f"lean / aiohttp: {ratio:.2f}x")
    finally:
        await http.close()
        await lean.close()
        upstream.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    try:  # the loop the proxy serves on when it is installed
        import uvloop
    except ImportError:
        asyncio.run(run(args.calls, args.rounds))
    else:
        uvloop.run(run(args.calls, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
