"""Benchmark rows for tracing (the `tracing` group of `make bench`): what OpenTelemetry costs the proxy.

Two proxies in front of one lean upstream (and, for every request traced, of the mcp 1.x SDK server too), one
with tracing on (`OTEL_EXPORTER_OTLP_ENDPOINT` pointing at a local OTLP/HTTP receiver in its own process, so
every span is really encoded and posted), one without; modern synchronous `tools/call` batches interleaved at
concurrency 16. Then tracing off against the proxy of another commit (`--tracing-baseline`, default `main`),
run from a `git archive` of it: with tracing off the hooks must cost nothing measurable.

    python -m benchmarks.tracing --receiver PORT   # the receiver alone: POST /v1/traces, GET /count
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

import aiohttp
from aiohttp import web

from benchmarks.harness import (
    ROOT,
    Process,
    Row,
    baseline_tree,
    free_port,
    proxy_config,
    side_by_side,
    start_upstream,
    wait_for_port,
)

TARGET_ON = 0.95  # throughput with tracing on, against off
TARGET_OFF = 0.95  # tracing off against the baseline commit: "no difference" within this machine's noise


def spawn(arguments: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
    return subprocess.Popen(
        [sys.executable, *arguments], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def start_receiver() -> Process:
    port = free_port()
    process = spawn(["-m", "benchmarks.tracing", "--receiver", str(port)])
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}")


async def start_traced_proxy(
    upstream: Process, workdir: Path, name: str, env: dict[str, str], cwd: Path = ROOT
) -> Process:
    """A proxy process whose environment is `env` (the OTEL_* settings), run from the code in `cwd`."""
    port = free_port()
    config = proxy_config(upstream.url, workdir, name, port, {"path": str(workdir / f"{name}.db")}, cwd)
    clean = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    process = spawn(["-m", "proxy", "serve", "--config", str(config)], cwd, {**clean, **env, "PYTHONPATH": str(cwd)})
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}/mcp")


async def _spans_received(receiver: Process) -> int:
    async with aiohttp.ClientSession() as http, http.get(f"{receiver.url}/count") as response:
        return int(await response.text())


SAMPLED: Final = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
NEVER_SAMPLED: Final = {"OTEL_TRACES_SAMPLER": "always_off"}


async def on_off_row(
    upstream: Process, workdir: Path, quick: bool, sampler: dict[str, str], what: str, label: str = "lean upstream"
) -> Row:
    receiver = await start_receiver()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "bench", "OTEL_BSP_SCHEDULE_DELAY": "500"}
    traced = await start_traced_proxy(upstream, workdir, "traced", {**otel, **sampler})
    plain = await start_traced_proxy(upstream, workdir, "untraced", {})
    try:
        base, via, cpu_off, cpu_on = await side_by_side(plain, traced, quick, settle_seconds=1.5)  # an export or two
        exports = await _spans_received(receiver)
    finally:
        traced.stop()
        plain.stop()
        receiver.stop()
    ratio = via.rate / base.rate
    return Row(
        f"modern sync tools/call, tracing on ({what}, OTLP/HTTP to a local receiver) vs off, {label}, c=16",
        f"throughput {ratio:.2f}x off (p50 {via.percentile(0.5):.2f} vs {base.percentile(0.5):.2f} ms);"
        f" proxy CPU {cpu_on:.2f} vs {cpu_off:.2f} ms/call; {exports} export requests received",
        f">= {TARGET_ON}x",
        ratio >= TARGET_ON and (exports > 0 or sampler is NEVER_SAMPLED),
        {
            "throughput_ratio": ratio,
            "off_rps": base.rate,
            "on_rps": via.rate,
            "proxy_cpu_ms_per_call_on": cpu_on,
            "proxy_cpu_ms_per_call_off": cpu_off,
            "export_requests": exports,
        },
    )


async def off_vs_baseline_row(upstream: Process, workdir: Path, quick: bool, ref: str) -> Row:
    name = f"modern sync tools/call, tracing off vs the proxy of {ref}, lean upstream, concurrency 16"
    tree = baseline_tree(ref, workdir)
    if tree is None:
        return Row(name, f"not measured: {ref} cannot be read from git", f">= {TARGET_OFF}x", None, {})
    current = await start_traced_proxy(upstream, workdir, "current", {})
    baseline = await start_traced_proxy(upstream, workdir, "baseline", {}, cwd=tree)
    try:
        base, via, cpu_base, cpu_now = await side_by_side(baseline, current, quick)
    finally:
        current.stop()
        baseline.stop()
    ratio = via.rate / base.rate
    return Row(
        name,
        f"throughput {ratio:.2f}x (p50 {via.percentile(0.5):.2f} vs {base.percentile(0.5):.2f} ms);"
        f" proxy CPU {cpu_now:.2f} vs {cpu_base:.2f} ms/call",
        f">= {TARGET_OFF}x",
        ratio >= TARGET_OFF,
        {
            "throughput_ratio": ratio,
            "baseline_rps": base.rate,
            "current_rps": via.rate,
            "proxy_cpu_ms_per_call": cpu_now,
            "baseline_proxy_cpu_ms_per_call": cpu_base,
            "baseline": ref,
        },
    )


async def tracing_rows(upstream: Process, quick: bool, baseline_ref: str) -> list[Row]:
    """In front of the lean upstream (the proxy's own cost laid bare: the worst case), then every request traced
    in front of the mcp 1.x SDK server, what legacy servers run (the server's own CPU beside the proxy's)."""
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-tracing-"))
    rows = [
        await on_off_row(upstream, workdir, quick, {}, "every request"),
        await on_off_row(upstream, workdir, quick, SAMPLED, "10 % of traces sampled"),
        await on_off_row(upstream, workdir, quick, NEVER_SAMPLED, "no trace sampled"),
        await off_vs_baseline_row(upstream, workdir, quick, baseline_ref),
    ]
    sdk = await start_upstream(sdk=True)
    try:
        rows.append(await on_off_row(sdk, workdir, quick, {}, "every request", "mcp 1.x SDK upstream"))
    finally:
        sdk.stop()
    return rows


# --- the receiver ------------------------------------------------------------------------------------------------


def serve_receiver(port: int) -> None:
    """An OTLP/HTTP receiver that accepts every export and counts them (GET /count)."""
    count = 0

    async def traces(request: web.Request) -> web.Response:
        nonlocal count
        await request.read()
        count += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def counted(request: web.Request) -> web.Response:
        return web.Response(text=str(count))

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/count", counted)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receiver", type=int, required=True, help="serve the OTLP receiver on this port")
    serve_receiver(parser.parse_args(argv).receiver)


if __name__ == "__main__":
    main()
