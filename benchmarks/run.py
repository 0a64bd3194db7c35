"""`make bench`: the proxy's cost, each figure beside a baseline measured in the same run on the same machine.

Starts a lean legacy upstream (`benchmarks.upstream`) and proxy processes on loopback, runs every row, prints
a table and writes `benchmarks/results/latest.json`. Machines here are shared and noisy (2 cores): rows report
medians, percentiles and ratios against their baseline, and direct/proxied batches are interleaved.

    python -m benchmarks.run [--quick]

The processes, clients and measuring it shares with `replicas.py` and `tracing.py` are in `harness.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.deploy import deploy_rows
from benchmarks.harness import (
    ROOT,
    LegacyClient,
    ModernClient,
    Process,
    Row,
    creation_rows,
    interleaved,
    measure,
    push_row,
    start_proxy,
    start_upstream,
)
from benchmarks.replicas import replica_rows
from benchmarks.tracing import tracing_rows

RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
SDK_LABEL = "mcp 1.x SDK upstream"  # what legacy servers run: the baseline the targets are about
LEAN_LABEL = "lean upstream"  # a minimal aiohttp server: the worst case, the proxy's own cost laid bare


# --- rows ------------------------------------------------------------------------------------------------------


async def passthrough_rows(upstream: Process, proxy: Process, quick: bool, label: str) -> list[Row]:
    rows = []
    for concurrency in (1, 16):
        direct, proxied = LegacyClient(upstream.url), LegacyClient(proxy.url)
        await direct.start()
        await proxied.start()
        await measure(direct.echo, 50, concurrency)  # warm-up
        await measure(proxied.echo, 50, concurrency)
        count = (600 if quick else 3000) if concurrency == 16 else (300 if quick else 1200)
        cpu_before = proxy.cpu_seconds()
        base, via = await interleaved(direct.echo, proxied.echo, count=count, concurrency=concurrency)
        cpu_ms = (proxy.cpu_seconds() - cpu_before) * 1000 / via.count  # idle while the direct batches run
        ratio = via.rate / base.rate
        added_p50 = via.percentile(0.5) - base.percentile(0.5)
        added_p99 = via.percentile(0.99) - base.percentile(0.99)
        rows.append(
            Row(
                f"pass-through tools/call, {label}, concurrency {concurrency}",
                f"throughput {ratio:.2f}x direct; added p50 {added_p50:+.2f} ms, p99 {added_p99:+.2f} ms;"
                f" proxy CPU {cpu_ms:.2f} ms/call",
                ">= 0.85x, added p50 <= 1 ms",
                ratio >= 0.85 and added_p50 <= 1.0,
                {
                    "throughput_ratio": ratio,
                    "added_p50_ms": added_p50,
                    "added_p99_ms": added_p99,
                    "direct_rps": base.rate,
                    "proxied_rps": via.rate,
                    "direct_p50_ms": base.percentile(0.5),
                    "proxied_p50_ms": via.percentile(0.5),
                    "proxy_cpu_ms_per_call": cpu_ms,
                },
            )
        )
    return rows


async def modern_sync_row(upstream: Process, proxy: Process, quick: bool, label: str) -> Row:
    direct, modern = LegacyClient(upstream.url), ModernClient(proxy.url)
    await direct.start()
    await measure(modern.echo, 50, 16)
    cpu_before = proxy.cpu_seconds()
    base, via = await interleaved(direct.echo, modern.echo, count=600 if quick else 3000, concurrency=16)
    cpu_ms = (proxy.cpu_seconds() - cpu_before) * 1000 / via.count
    ratio = via.rate / base.rate
    return Row(
        f"modern sync tools/call vs legacy direct, {label}, concurrency 16",
        f"throughput {ratio:.2f}x direct (p50 {via.percentile(0.5):.2f} vs {base.percentile(0.5):.2f} ms);"
        f" proxy CPU {cpu_ms:.2f} ms/call",
        ">= 0.75x",
        ratio >= 0.75,
        {
            "throughput_ratio": ratio,
            "direct_rps": base.rate,
            "modern_rps": via.rate,
            "proxy_cpu_ms_per_call": cpu_ms,
        },
    )


async def stdio_row(http_proxy: Process, workdir: Path, quick: bool) -> Row:
    """A modern synchronous call through a proxy in front of the SDK fixture as a stdio server it runs, against
    the same call through a proxy in front of the same fixture over HTTP."""
    proxy = await start_proxy([sys.executable, "-m", "tests.upstream", "--stdio"], workdir, "stdio")
    try:
        via_http, via_stdio = ModernClient(http_proxy.url), ModernClient(proxy.url)
        await measure(via_stdio.echo, 50, 16)  # warm-up (the server process starts)
        await measure(via_http.echo, 50, 16)
        cpu_before = proxy.cpu_seconds()
        base, via = await interleaved(via_http.echo, via_stdio.echo, count=600 if quick else 3000, concurrency=16)
        cpu_ms = (proxy.cpu_seconds() - cpu_before) * 1000 / via.count
    finally:
        proxy.stop()
    ratio = via.rate / base.rate
    return Row(
        f"modern sync tools/call, stdio upstream vs the same over HTTP, {SDK_LABEL}, concurrency 16",
        f"throughput {ratio:.2f}x HTTP (p50 {via.percentile(0.5):.2f} vs {base.percentile(0.5):.2f} ms);"
        f" proxy CPU {cpu_ms:.2f} ms/call",
        ">= 0.9x",
        ratio >= 0.9,
        {
            "throughput_ratio": ratio,
            "http_rps": base.rate,
            "stdio_rps": via.rate,
            "http_p50_ms": base.percentile(0.5),
            "stdio_p50_ms": via.percentile(0.5),
            "proxy_cpu_ms_per_call": cpu_ms,
        },
    )


async def end_to_end_row(proxy: Process, quick: bool) -> Row:
    """A 1.0 s tool as a task, polled exactly as each answer's pollIntervalMs advises."""
    client = ModernClient(proxy.url, declares_tasks=True)
    ratios = []
    polls = []
    for _ in range(4 if quick else 8):
        started = time.perf_counter()
        created = await client.create(1.0)
        interval, count = created.get("pollIntervalMs", 1000), 0
        while True:
            await asyncio.sleep(interval / 1000)
            task = await client.get(created["taskId"])
            count += 1
            if task["status"] == "completed":
                break
            interval = task.get("pollIntervalMs", interval)
        ratios.append(time.perf_counter() - started)
        polls.append(count)
    ratio = statistics.median(ratios) / 1.0
    return Row(
        "end to end: 1.0 s tool as a task, polled per pollIntervalMs",
        f"{ratio:.2f}x the tool's time (median of {len(ratios)}, first {ratios[0]:.2f}x; polls {polls})",
        "<= 1.15x",
        ratio <= 1.15,
        {"ratio": ratio, "runs_seconds": ratios, "polls": polls},
    )


async def scale_row(upstream: Process, workdir: Path, quick: bool) -> Row:
    """Thousands of tasks in flight at once (the upstream sleeps): the proxy's memory and tasks/get meanwhile."""
    proxy = await start_proxy(upstream.url, workdir, "scale")
    try:
        client = ModernClient(proxy.url, declares_tasks=True)
        idle_rss = proxy.rss_bytes()
        total = 2000 if quick else 10_000
        ids: list[str] = []

        async def create() -> None:
            ids.append((await client.create(600))["taskId"])

        created = await measure(create, total, 64)
        rss = proxy.rss_bytes()
        cursor = 0

        async def get() -> None:
            nonlocal cursor
            cursor += 7919
            await client.get(ids[cursor % len(ids)])

        gets = await measure(get, 1000, 8)
        p50, p99 = gets.percentile(0.5), gets.percentile(0.99)
        return Row(
            f"scale: {total:,} tasks in flight",
            f"RSS {rss / 2**20:.0f} MB (idle {idle_rss / 2**20:.0f} MB); tasks/get p50 {p50:.2f} ms, p99 {p99:.2f} ms",
            "10,000 tasks in <= 400 MB, tasks/get p99 <= 20 ms",
            rss <= 400 * 2**20 and p99 <= 20.0 and total == 10_000,
            {
                "tasks": total,
                "rss_bytes": rss,
                "idle_rss_bytes": idle_rss,
                "get_p50_ms": p50,
                "get_p99_ms": p99,
                "creations_per_second": created.rate,
            },
        )
    finally:
        proxy.stop()


def seed_settled_records(database: Path, count: int) -> None:
    """Write `count` settled task records straight into a database the proxy created (its schema)."""
    connection = sqlite3.connect(database)
    now = int(time.time() * 1000)
    rows = (
        (
            f"task_seed{number:012d}",
            "p",
            "echo",
            "completed",
            now - 1000,
            now - 500,
            3_600_000,
            now + 3_600_000,
            "seed",
            "fail",
            "{}",
            '{"content":[{"type":"text","text":"x"}],"isError":false,"resultType":"complete"}',
            "{}",
            0,
            "{}",
        )
        for number in range(count)
    )
    with connection:
        connection.executemany(
            "INSERT INTO tasks (task_id, principal, tool, status, created_at_ms, updated_at_ms, ttl_ms,"
            " expires_at_ms, owner, on_restart, request, result, input_requests, inputs_issued,"
            " client_capabilities) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    connection.close()


async def store_row(upstream: Process, workdir: Path, quick: bool) -> Row:
    """tasks/get on a store with many settled records vs an almost empty one, both proxies up at once and
    their gets interleaved."""
    count = 200_000 if quick else 1_000_000
    proxies: dict[str, Process] = {}
    try:
        for name, seeded in (("empty", 0), ("full", count)):
            database = workdir / f"store-{name}.db"
            (await start_proxy(upstream.url, workdir, f"store-{name}", database)).stop()  # its own schema
            if seeded:
                seed_settled_records(database, seeded)
            proxies[name] = await start_proxy(upstream.url, workdir, f"store-{name}", database)
        clients = {name: ModernClient(proxy.url, declares_tasks=True) for name, proxy in proxies.items()}
        task_ids = {name: (await client.create(600))["taskId"] for name, client in clients.items()}

        async def get_empty() -> None:
            await clients["empty"].get(task_ids["empty"])

        async def get_full() -> None:
            await clients["full"].get(task_ids["full"])

        await interleaved(get_empty, get_full, count=120, concurrency=1)  # warm-up
        empty, full = await interleaved(get_empty, get_full, count=1200, concurrency=1)
    finally:
        for proxy in proxies.values():
            proxy.stop()
    ratio = full.percentile(0.5) / empty.percentile(0.5)
    return Row(
        f"store: tasks/get with {count:,} settled records vs empty",
        f"p50 {full.percentile(0.5):.2f} vs {empty.percentile(0.5):.2f} ms ({ratio:.2f}x)",
        "1M records within 1.2x of empty",
        ratio <= 1.2 and count == 1_000_000,
        {
            "records": count,
            "ratio": ratio,
            "full_p50_ms": full.percentile(0.5),
            "empty_p50_ms": empty.percentile(0.5),
            "full_p99_ms": full.percentile(0.99),
            "empty_p99_ms": empty.percentile(0.99),
        },
    )


# --- main ------------------------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    width = max(len(row.name) for row in rows)
    print(f"\n{'benchmark'.ljust(width)}  {'met':<4} figure   [target]")
    for row in rows:
        met = "-" if row.met is None else ("yes" if row.met else "NO")
        print(f"{row.name.ljust(width)}  {met:<4} {row.figure}   [{row.target}]")


GROUPS = ("sdk", "lean", "replicas", "scale", "store", "tracing", "deploy")


async def run(quick: bool, groups: tuple[str, ...] = GROUPS, tracing_baseline: str = "main") -> list[Row]:
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-"))
    rows: list[Row] = []
    if "sdk" in groups:
        sdk_upstream = await start_upstream(sdk=True)
        sdk_proxy = await start_proxy(sdk_upstream.url, workdir, "sdk")
        try:
            rows += await passthrough_rows(sdk_upstream, sdk_proxy, quick, SDK_LABEL)
            rows.append(await modern_sync_row(sdk_upstream, sdk_proxy, quick, SDK_LABEL))
            rows.append(await stdio_row(sdk_proxy, workdir, quick))
        finally:
            sdk_proxy.stop()
            sdk_upstream.stop()
    if "lean" in groups:
        upstream = await start_upstream()
        proxy = await start_proxy(upstream.url, workdir, "main")
        try:
            rows += await passthrough_rows(upstream, proxy, quick, LEAN_LABEL)
            rows.append(await modern_sync_row(upstream, proxy, quick, LEAN_LABEL))
            rows += await creation_rows(proxy, quick)
            rows.append(await end_to_end_row(proxy, quick))
            rows.append(await push_row(proxy, quick))
        finally:
            proxy.stop()
            upstream.stop()
    if "replicas" in groups:
        rows += await replica_rows(start_upstream, workdir, quick)
    if "deploy" in groups:
        rows += await deploy_rows(workdir, quick)
    if "scale" in groups or "store" in groups:
        upstream = await start_upstream()  # an upstream of its own, without the earlier rows' leftovers
        try:
            if "scale" in groups:
                rows.append(await scale_row(upstream, workdir, quick))
            if "store" in groups:
                rows.append(await store_row(upstream, workdir, quick))
        finally:
            upstream.stop()
    if "tracing" in groups:
        upstream = await start_upstream()
        try:
            rows += await tracing_rows(upstream, quick, tracing_baseline)
        finally:
            upstream.stop()
    return rows


def _commit() -> str | None:
    """The commit measured (with `+` when the tree has changes), so results can be compared over time."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "proxy"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None  # not a git checkout
    return head.stdout.strip() + ("+" if status.stdout.strip() else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller counts (a smoke run, not for figures)")
    parser.add_argument(
        "--only",
        default=",".join(GROUPS),
        help=f"comma-separated row groups to run, of {', '.join(GROUPS)} (a partial run is not written to the JSON)",
    )
    parser.add_argument(
        "--tracing-baseline",
        default="main",
        help="git ref whose proxy the `tracing` group compares the current one (tracing off) with",
    )
    args = parser.parse_args()
    groups = tuple(group.strip() for group in args.only.split(","))
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown row groups: {', '.join(sorted(unknown))}")
    started = time.monotonic()
    rows = asyncio.run(run(args.quick, groups, args.tracing_baseline))
    print_table(rows)
    if set(groups) != set(GROUPS):
        return 0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "quick": args.quick,
                "commit": _commit(),
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.system()},
                "seconds": round(time.monotonic() - started, 1),
                "rows": [row.__dict__ for row in rows],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten to {RESULTS.relative_to(ROOT)} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
