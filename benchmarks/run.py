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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.baseline import baseline_rows
from benchmarks.deploy import deploy_rows
from benchmarks.floor import floor_rows
from benchmarks.harness import (
    ROOT,
    LegacyClient,
    ModernClient,
    Process,
    Row,
    Sample,
    creation_rows,
    free_port,
    interleaved,
    measure,
    push_row,
    side_by_side,
    spawn,
    start_proxy,
    start_upstream,
    wait_for_port,
)
from benchmarks.replicas import replica_rows
from benchmarks.tracing import tracing_rows

RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
SDK_LABEL = "mcp 1.x SDK upstream"  # what legacy servers run: the baseline the targets are about
LEAN_LABEL = "lean upstream"  # a minimal aiohttp server: the worst case, the proxy's own cost laid bare


# --- rows ------------------------------------------------------------------------------------------------------


# The targets (issue "the hop costs close to nothing"): against an mcp 1.x SDK server, what legacy servers run;
# against the lean upstream (the proxy's own cost laid bare) a throughput floor only.
SDK_TARGETS = {
    ("pass-through", 1): (0.85, 1.15),  # throughput ratio floor, p50 ratio ceiling (None: not a target)
    ("pass-through", 16): (0.95, None),
    ("modern", 1): (None, 1.25),
    ("modern", 16): (0.95, None),
}
LEAN_TARGETS = {
    ("pass-through", 1): (0.5, None),
    ("pass-through", 16): (0.5, None),
    ("modern", 1): (0.35, None),
    ("modern", 16): (0.35, None),
}


def _ratio_row(name: str, base: Sample, via: Sample, cpu_ms: float, targets: tuple[float | None, float | None]) -> Row:
    """A row of the proxied (or modern) batches against the direct ones: throughput and p50 as ratios."""
    ratio = via.rate / base.rate
    p50_ratio = via.percentile(0.5) / base.percentile(0.5)
    floor, ceiling = targets
    wanted = [f">= {floor:g}x throughput"] if floor is not None else []
    wanted += [f"<= {ceiling:g}x p50"] if ceiling is not None else []
    met = (floor is None or ratio >= floor) and (ceiling is None or p50_ratio <= ceiling)
    return Row(
        name,
        f"throughput {ratio:.2f}x, p50 {p50_ratio:.2f}x direct ({via.percentile(0.5):.2f} vs"
        f" {base.percentile(0.5):.2f} ms, added p99 {via.percentile(0.99) - base.percentile(0.99):+.2f} ms);"
        f" proxy CPU {cpu_ms:.2f} ms/call",
        ", ".join(wanted),
        met,
        {
            "throughput_ratio": ratio,
            "p50_ratio": p50_ratio,
            "added_p50_ms": via.percentile(0.5) - base.percentile(0.5),
            "added_p99_ms": via.percentile(0.99) - base.percentile(0.99),
            "direct_rps": base.rate,
            "proxied_rps": via.rate,
            "direct_p50_ms": base.percentile(0.5),
            "proxied_p50_ms": via.percentile(0.5),
            "proxy_cpu_ms_per_call": cpu_ms,
        },
    )


async def hop_rows(upstream: Process, proxy: Process, quick: bool, label: str) -> list[Row]:
    """Pass-through (a legacy client through the proxy) and modern synchronous tools/call (a 2026-07-28 client
    through the proxy), each against a legacy client calling the upstream directly, at concurrency 1 and 16."""
    targets = SDK_TARGETS if label == SDK_LABEL else LEAN_TARGETS
    rows = []
    for kind in ("pass-through", "modern"):
        for concurrency in (1, 16):
            direct = LegacyClient(upstream.url)
            await direct.start()
            if kind == "modern":
                proxied: Callable[[], Awaitable[None]] = ModernClient(proxy.url).echo
            else:
                legacy = LegacyClient(proxy.url)
                await legacy.start()
                proxied = legacy.echo
            await measure(direct.echo, 50, concurrency)  # warm-up
            await measure(proxied, 50, concurrency)
            count = (600 if quick else 3000) if concurrency == 16 else (300 if quick else 1200)
            cpu_before = proxy.cpu_seconds()
            base, via = await interleaved(direct.echo, proxied, count=count, concurrency=concurrency)
            cpu_ms = (proxy.cpu_seconds() - cpu_before) * 1000 / via.count  # idle while the direct batches run
            name = f"{kind} tools/call vs legacy direct, {label}, concurrency {concurrency}"
            rows.append(_ratio_row(name, base, via, cpu_ms, targets[(kind, concurrency)]))
    return rows


async def stdio_row(http_proxy: Process, workdir: Path, quick: bool) -> Row:
    """A modern synchronous call through a proxy in front of the SDK fixture as a stdio server it runs, against
    the same call through a proxy in front of the same fixture over HTTP."""
    proxy = await start_proxy([sys.executable, "-m", "tests.upstream", "--stdio"], workdir, "stdio")
    try:
        base, via, _, cpu_ms = await side_by_side(http_proxy, proxy, quick)  # its warm-up starts the server process
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
    """A 1.0 s tool as a task, polled as advised (the anchored rows have this row beside the anchor's)."""
    ran = await end_to_end(ModernClient(proxy.url, declares_tasks=True), quick)
    return Row(
        "end to end: 1.0 s tool as a task, polled per pollIntervalMs",
        f"{ran.ratio:.2f}x the tool's time (median of {len(ran.runs)}, first {ran.runs[0]:.2f}x; polls {ran.polls})",
        "<= 1.1x",
        ran.ratio <= 1.1,
        {"ratio": ran.ratio, "runs_seconds": ran.runs, "polls": ran.polls},
    )


ANCHOR_PYTHON = ROOT / ".venv-anchor" / "bin" / "python"  # `make bench` installs it (benchmarks/anchor.py)


async def start_anchor() -> Process | None:
    """FastMCP + fastmcp-tasks in memory (`anchor.py`), or None when its environment is not installed."""
    if not ANCHOR_PYTHON.exists():
        return None
    port = free_port()
    process = spawn(["-m", "benchmarks.anchor", "--port", str(port)], str(ANCHOR_PYTHON))
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}/mcp")


async def anchored_rows(proxy: Process, anchor: Process, quick: bool) -> list[Row]:
    """Durable task creation through the proxy (the record committed to SQLite before the answer) against a server
    that runs tasks itself, in memory; and a 1.0 s tool end to end, each polled exactly as advised."""
    via, native = ModernClient(proxy.url, declares_tasks=True), ModernClient(anchor.url, declares_tasks=True)

    async def proxy_create() -> None:
        await via.create(600)

    async def anchor_create() -> None:
        await native.create(600)

    await interleaved(proxy_create, anchor_create, count=40, concurrency=1)  # warm-up
    base, mine = await interleaved(anchor_create, proxy_create, count=120 if quick else 600, concurrency=1)
    p50_ratio = mine.percentile(0.5) / base.percentile(0.5)
    base16, mine16 = await interleaved(anchor_create, proxy_create, count=300 if quick else 1800, concurrency=16)
    rate_ratio = mine16.rate / base16.rate
    proxy_end, anchor_end = await end_to_end(via, quick), await end_to_end(native, quick)
    return [
        Row(
            "durable task creation vs FastMCP + fastmcp-tasks in memory, concurrency 1",
            f"p50 {p50_ratio:.2f}x ({mine.percentile(0.5):.2f} vs {base.percentile(0.5):.2f} ms)",
            "<= 0.5x p50",
            p50_ratio <= 0.5,
            {"p50_ratio": p50_ratio, "proxy_p50_ms": mine.percentile(0.5), "anchor_p50_ms": base.percentile(0.5)},
        ),
        Row(
            "durable task creations/s vs FastMCP + fastmcp-tasks in memory, concurrency 16",
            f"{rate_ratio:.2f}x ({mine16.rate:.0f} vs {base16.rate:.0f}/s)",
            ">= 3x",
            rate_ratio >= 3.0,
            {"rate_ratio": rate_ratio, "proxy_per_second": mine16.rate, "anchor_per_second": base16.rate},
        ),
        Row(
            "end to end: 1.0 s tool as a task, polled per pollIntervalMs",
            f"{proxy_end.ratio:.2f}x the tool's time (polls {proxy_end.polls});"
            f" FastMCP + fastmcp-tasks {anchor_end.ratio:.2f}x (polls {anchor_end.polls})",
            "<= 1.1x",
            proxy_end.ratio <= 1.1,
            {
                "ratio": proxy_end.ratio,
                "runs_seconds": proxy_end.runs,
                "polls": proxy_end.polls,
                "anchor_ratio": anchor_end.ratio,
                "anchor_runs_seconds": anchor_end.runs,
            },
        ),
    ]


@dataclass
class EndToEnd:
    ratio: float  # the median run's time over the tool's 1.0 s
    runs: list[float]
    polls: list[int]


async def end_to_end(client: ModernClient, quick: bool) -> EndToEnd:
    """A 1.0 s tool as a task, polled exactly as each answer's pollIntervalMs advises."""
    runs: list[float] = []
    polls: list[int] = []
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
        runs.append(time.perf_counter() - started)
        polls.append(count)
    return EndToEnd(statistics.median(runs) / 1.0, runs, polls)


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


GROUPS = ("sdk", "lean", "floor", "replicas", "scale", "store", "tracing", "deploy", "baseline")


async def run(
    quick: bool, groups: tuple[str, ...] = GROUPS, tracing_baseline: str = "main", baseline: str = "main"
) -> list[Row]:
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-"))
    rows: list[Row] = []
    if "sdk" in groups:
        sdk_upstream = await start_upstream(sdk=True)
        sdk_proxy = await start_proxy(sdk_upstream.url, workdir, "sdk")
        try:
            rows += await hop_rows(sdk_upstream, sdk_proxy, quick, SDK_LABEL)
            rows.append(await stdio_row(sdk_proxy, workdir, quick))
        finally:
            sdk_proxy.stop()
            sdk_upstream.stop()
    if "lean" in groups:
        upstream = await start_upstream()
        proxy = await start_proxy(upstream.url, workdir, "main")
        try:
            rows += await hop_rows(upstream, proxy, quick, LEAN_LABEL)
            rows += await creation_rows(proxy, quick)
            anchor = await start_anchor()
            if anchor is None:
                print("no .venv-anchor (make bench installs it): the rows against FastMCP are left out")
                rows.append(await end_to_end_row(proxy, quick))
            else:
                try:
                    rows += await anchored_rows(proxy, anchor, quick)
                finally:
                    anchor.stop()
            rows.append(await push_row(proxy, quick))
        finally:
            proxy.stop()
            upstream.stop()
    if "floor" in groups:
        for sdk, label in ((True, SDK_LABEL), (False, LEAN_LABEL)):
            upstream = await start_upstream(sdk=sdk)
            try:
                rows += await floor_rows(upstream, label, workdir, quick)
            finally:
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
    if "baseline" in groups:
        for sdk, label, kinds in (
            (False, LEAN_LABEL, ("pass-through", "modern")),
            (True, SDK_LABEL, ("pass-through",)),
        ):
            upstream = await start_upstream(sdk=sdk)
            try:
                rows += await baseline_rows(upstream, label, quick, baseline, kinds)
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
    parser.add_argument(
        "--baseline",
        default="main",
        help="git ref whose proxy the `baseline` group compares the current one with (pass-through and modern calls)",
    )
    args = parser.parse_args()
    groups = tuple(group.strip() for group in args.only.split(","))
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown row groups: {', '.join(sorted(unknown))}")
    started = time.monotonic()
    rows = asyncio.run(run(args.quick, groups, args.tracing_baseline, args.baseline))
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
