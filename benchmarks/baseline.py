"""Benchmark rows against another commit (the `baseline` group of `make bench`): this proxy beside the proxy of
`--baseline REF` (default `main`), run from a `git archive` of it, both in front of one upstream, their
batches interleaved. What a change to the hop costs or saves, in throughput and the proxy's CPU per call.

Two settings: the other rows' (`logging.level: warning`, metrics off: the hop alone) and the defaults
(`info`, metrics on: the request log line and the request metrics of every call, as a deployment runs).
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from benchmarks.harness import (
    LegacyClient,
    ModernClient,
    Process,
    Row,
    Sample,
    baseline_tree,
    measure,
    start_proxy,
)

SETTINGS: Final[dict[str, dict[str, Any]]] = {
    "log warning, metrics off": {},
    "defaults: log info, metrics on": {"logging": {"level": "info"}, "observability": {"metrics": True}},
}
TARGET: Final = 0.95  # no slower than the baseline, within this machine's noise


async def _client(kind: str, url: str) -> tuple[Callable[[], Awaitable[None]], Callable[[], None]]:
    """The call a row makes (`pass-through`: a legacy client's tools/call on its session; `modern`: a 2026-07-28
    synchronous tools/call) and how to close its client."""
    if kind == "modern":
        modern = ModernClient(url)
        return modern.echo, modern.close
    legacy = LegacyClient(url)
    await legacy.start()
    return legacy.echo, legacy.close


def cpu_seconds(process: Process) -> float:
    """On-CPU time of the process's threads, in the scheduler's nanoseconds (`/proc/PID/task/*/schedstat`):
    clock ticks of 10 ms are too coarse for one batch."""
    total = 0
    for task in Path(f"/proc/{process.process.pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended
    return total / 1e9


@dataclass
class Side:
    """One side of a paired comparison: its batches merged, and each batch's rate and CPU per call."""

    sample: Sample = field(default_factory=Sample)
    rates: list[float] = field(default_factory=list)
    cpu_per_call: list[float] = field(default_factory=list)


async def paired(
    sides: tuple[tuple[Process, Callable[[], Awaitable[None]]], ...], *, count: int, rounds: int
) -> list[Side]:
    """Batches of each side's call in turn (the order alternating), `rounds` times, so that ratios can be taken
    between batches that ran a moment apart."""
    measured = [Side() for _ in sides]
    for round_number in range(rounds):
        order = range(len(sides)) if round_number % 2 == 0 else reversed(range(len(sides)))
        for index in order:
            process, call = sides[index]
            started = cpu_seconds(process)
            batch = await measure(call, count // rounds, 16)
            measured[index].cpu_per_call.append((cpu_seconds(process) - started) / batch.count)
            measured[index].rates.append(batch.rate)
            measured[index].sample.merge(batch)
    return measured


def _median_ratio(mine: list[float], theirs: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(mine, theirs, strict=True))


ROUNDS: Final = 20


async def baseline_row(
    upstream: Process, label: str, workdir: Path, tree: Path, ref: str, kind: str, setting: str, quick: bool
) -> Row:
    sections = SETTINGS[setting]
    name = f"{kind} tools/call, this proxy vs the proxy of {ref}, {label}, {setting}, concurrency 16"
    current = await start_proxy(upstream.url, workdir, "current", **sections)
    baseline = await start_proxy(upstream.url, workdir, "baseline", cwd=tree, **sections)
    now, close_now = await _client(kind, current.url)
    before, close_before = await _client(kind, baseline.url)
    try:
        await measure(now, 100, 16)
        await measure(before, 100, 16)
        base, via = await paired(((baseline, before), (current, now)), count=1200 if quick else 8000, rounds=ROUNDS)
    finally:
        close_now()
        close_before()
        current.stop()
        baseline.stop()
    # Ratios round by round, then their median: a burst of other work on the machine moves both sides of a round.
    ratio = _median_ratio(via.rates, base.rates)
    cpu_ratio = _median_ratio(via.cpu_per_call, base.cpu_per_call)
    cpu_now, cpu_base = statistics.median(via.cpu_per_call) * 1000, statistics.median(base.cpu_per_call) * 1000
    p50_now, p50_base = via.sample.percentile(0.5), base.sample.percentile(0.5)
    return Row(
        name,
        f"throughput {ratio:.2f}x (p50 {p50_now:.2f} vs {p50_base:.2f} ms); proxy CPU {cpu_ratio:.3f}x"
        f" ({cpu_now:.3f} vs {cpu_base:.3f} ms/call); medians of {ROUNDS} paired rounds",
        f">= {TARGET}x throughput",
        ratio >= TARGET,
        {
            "throughput_ratio": ratio,
            "cpu_ratio": cpu_ratio,
            "baseline_rps": base.sample.rate,
            "current_rps": via.sample.rate,
            "proxy_cpu_ms_per_call": cpu_now,
            "baseline_proxy_cpu_ms_per_call": cpu_base,
            "baseline": ref,
        },
    )


async def baseline_rows(upstream: Process, label: str, quick: bool, ref: str, kinds: tuple[str, ...]) -> list[Row]:
    """Every kind of call in `kinds` under both settings, in front of `upstream`."""
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-baseline-"))
    tree = baseline_tree(ref, workdir)
    if tree is None:
        return [Row(f"this proxy vs the proxy of {ref}", f"not measured: {ref} cannot be read from git", "", None, {})]
    rows = []
    for kind in kinds:
        for setting in SETTINGS:
            rows.append(await baseline_row(upstream, label, workdir, tree, ref, kind, setting, quick))
    return rows
