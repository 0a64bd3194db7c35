"""Instructions per call in the proxy process, counted by valgrind's callgrind: the same on a quiet machine
and on a loaded one, so a change of a few percent shows where times and CPU seconds drown it in noise.

    python -m benchmarks.instructions [--baseline REF] [--calls N]

A lean upstream, then for each kind of call (a legacy client's `tools/call` on its session through the
pass-through, a modern synchronous `tools/call`) and each setting (`logging.level: warning` with metrics off,
as the other rows run; the defaults, `info` with metrics on) a proxy under callgrind, from this tree and from
a `git archive` of REF (default `main`). Counting starts after a warm-up of 300 calls and covers the next N
(default 600), at concurrency 4; what callgrind counts is every instruction of the proxy's process, its
threads included. Slow (about a minute a proxy) and needs `valgrind`; not part of `make bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.baseline import SETTINGS
from benchmarks.harness import (
    ROOT,
    LegacyClient,
    ModernClient,
    baseline_tree,
    free_port,
    measure,
    proxy_config,
    start_upstream,
    wait_for_port,
)

WARM_UP = 300
CONCURRENCY = 4


async def _call(kind: str, url: str) -> Callable[[], Awaitable[None]]:
    if kind == "modern":
        return ModernClient(url).echo
    legacy = LegacyClient(url)
    await legacy.start()
    return legacy.echo


def _counted(workdir: Path, out: Path) -> int:
    """The instructions callgrind's last dump to `out` holds (its `totals:` or `summary:` line)."""
    dumps = sorted(workdir.glob(f"{out.name}.*"))
    if not dumps:
        raise RuntimeError("callgrind wrote no dump")
    for line in dumps[-1].read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    return 0


def _under_callgrind(tree: Path, config: Path, out: Path) -> subprocess.Popen[Any]:
    """The proxy of `tree`, run by callgrind with its instrumentation off until switched on."""
    return subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            *("-m", "proxy", "serve", "--config", str(config)),
        ],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _control(process: subprocess.Popen[Any], command: str) -> None:
    subprocess.run(["callgrind_control", command, str(process.pid)], check=True, capture_output=True)


async def instructions_per_call(
    upstream_url: str, tree: Path, kind: str, sections: dict[str, Any], calls: int, workdir: Path
) -> float:
    """The proxy of `tree` under callgrind, its instrumentation switched on for `calls` calls only."""
    port = free_port()
    name = f"callgrind-{port}"
    config = proxy_config(upstream_url, workdir, name, port, {"path": str(workdir / f"{name}.db")}, tree, **sections)
    out = workdir / f"{name}.out"
    process = _under_callgrind(tree, config, out)
    try:
        await wait_for_port(port, process, timeout_seconds=600)
        call = await _call(kind, f"http://127.0.0.1:{port}/mcp")
        await measure(call, WARM_UP, CONCURRENCY)
        await asyncio.to_thread(_control, process, "--instr=on")
        await measure(call, calls, CONCURRENCY)
        await asyncio.to_thread(_control, process, "--dump")
        return await asyncio.to_thread(_counted, workdir, out) / calls
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 60)


async def run(baseline: str, calls: int) -> list[str]:
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-instructions-"))
    tree = baseline_tree(baseline, workdir)
    if tree is None:
        raise SystemExit(f"{baseline} cannot be read from git")
    upstream = await start_upstream()
    lines = []
    try:
        for kind in ("pass-through", "modern"):
            for setting, sections in SETTINGS.items():
                mine = await instructions_per_call(upstream.url, ROOT, kind, sections, calls, workdir)
                theirs = await instructions_per_call(upstream.url, tree, kind, sections, calls, workdir)
                line = (
                    f"{kind} tools/call, {setting}: {mine:,.0f} instructions per call, {baseline} {theirs:,.0f}"
                    f" ({mine / theirs - 1:+.1%})"
                )
                print(line, flush=True)
                lines.append(line)
    finally:
        upstream.stop()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="main", help="git ref whose proxy is counted beside this one")
    parser.add_argument("--calls", type=int, default=600, help="calls counted per proxy (after the warm-up)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    asyncio.run(run(args.baseline, args.calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
