"""What an `Idempotency-Key` costs a synchronous modern `tools/call`: sequential calls of the lean upstream's
`echo` through one proxy process (SQLite store, `synchronous: full` by default, as the proxy's), without a
key, with a new key each (the first request: a claim and a settle, two committed writes) and with one key
repeated (a replay: one claim that finds the record, no upstream call).

    python -m benchmarks.idempotency [--calls N] [--rounds R] [--synchronous full|normal]

The three kinds alternate in R rounds of N/R calls each, so that noise on a shared machine falls on all alike;
it reports the median latency and the proxy's CPU per call of each. Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ECHO, Process, start_proxy, start_upstream
from benchmarks.loadgen import HttpClient
from tests.support.wire import modern_body, modern_headers

KINDS = ("no key", "new key", "repeated key")


async def run(calls: int, rounds: int, synchronous: str) -> dict[str, tuple[float, float]]:
    upstream = await start_upstream()
    with tempfile.TemporaryDirectory() as workdir:
        database = str(Path(workdir) / "keys.db")
        proxy = await start_proxy(
            upstream.url,
            Path(workdir),
            "keys",
            store={"path": database, "synchronous": synchronous},
            tasks={"tools": {"echo": {"mode": "forbidden"}}},
        )
        try:
            return await _measure(proxy, calls, rounds)
        finally:
            proxy.stop()
            upstream.stop()


async def _measure(proxy: Process, calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    http = HttpClient(proxy.url)
    latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
    cpu: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    numbers = iter(range(1, 10**9))

    async def call(key: str | None) -> None:
        body = json.dumps(modern_body("tools/call", ECHO, request_id=next(numbers), capabilities={})).encode()
        headers = modern_headers("tools/call", "echo")
        if key is not None:
            headers["Idempotency-Key"] = f'"{key}"'
        response = await http.post(body, headers)
        assert response.json()["result"]["content"][0]["text"] == "x", response.body

    for _ in range(20):  # warm-up: upstream session, the repeated key's record
        await call(None)
        await call("repeated")
    per_round = max(1, calls // rounds)
    for round_number in range(rounds):
        for kind in KINDS:
            started_cpu = proxy.cpu_seconds()
            for index in range(per_round):
                key = {"no key": None, "new key": f"k-{round_number}-{index}", "repeated key": "repeated"}[kind]
                started = time.perf_counter()
                await call(key)
                latencies[kind].append((time.perf_counter() - started) * 1000)
            cpu[kind] += proxy.cpu_seconds() - started_cpu
    http.close()
    done = per_round * rounds
    return {kind: (statistics.median(latencies[kind]), cpu[kind] * 1000 / done) for kind in KINDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls of each kind")
    parser.add_argument("--rounds", type=int, default=5, help="rounds the kinds alternate in")
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full", help="store.synchronous")
    arguments = parser.parse_args()
    figures = asyncio.run(run(arguments.calls, arguments.rounds, arguments.synchronous))
    base_latency, base_cpu = figures["no key"]
    print(f"{'calls':<14}{'median ms':>10}{'Δ ms':>8}{'CPU ms/call':>13}{'Δ CPU ms':>10}")
    for kind, (latency, cpu) in figures.items():
        print(f"{kind:<14}{latency:>10.2f}{latency - base_latency:>+8.2f}{cpu:>13.2f}{cpu - base_cpu:>+10.2f}")


if __name__ == "__main__":
    main()
