"""The descriptor budget: what the configured limits could need, the soft limit raised to the hard one in a child
process (the test's own limits stay as they are), and new work refused past the budget, counted from what is
really open."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from proxy.config.schema import Config
from proxy.edge._descriptors import (
    COST_PER_CALL,
    MIN_RESERVE,
    PENDING_SECONDS,
    DescriptorBudget,
    need,
    open_descriptors,
    reserve,
)
from proxy.errors import TaskLimitError


def test_the_need_adds_up_what_the_configured_limits_could_hold_at_once() -> None:
    config = Config.model_validate(
        {
            "upstream": {"url": "http://127.0.0.1:9/mcp", "max_open_sessions": 100},
            "tasks": {"max_running": 10},
            "inputs": {"max_waiting": 20},
            "limits": {"max_listen_streams": 5},
        }
    )
    parts = need(config, 4096)
    assert (parts["running"], parts["waiting"], parts["upstream_sessions"], parts["listen_streams"]) == (10, 20, 100, 5)
    assert parts["reserve"] == reserve(4096) == 4096 // 16
    assert parts["admin"] == 0
    with_defaults = sum(need(Config.model_validate({"upstream": {"url": "http://127.0.0.1:9/mcp"}}), 1024).values())
    assert with_defaults > 1024  # the shipped limits do not fit the usual soft limit: the start warns


def test_open_descriptors_counts_what_this_process_holds(tmp_path: Path) -> None:
    before = open_descriptors()
    files = [open(tmp_path / f"f{number}", "w") for number in range(5)]  # noqa: SIM115 - held open on purpose
    try:
        assert open_descriptors() == before + 5
    finally:
        for file in files:
            file.close()
    assert open_descriptors() == before


def test_new_work_is_refused_past_the_budget_and_admitted_again_once_descriptors_close() -> None:
    held, now = [100], [0.0]
    budget = DescriptorBudget(1024, lambda: held[0], lambda: now[0])  # usable: 1024 - 64 = 960
    admitted = 0
    while budget.refusal() is None:
        admitted += 1
        held[0] += COST_PER_CALL  # each admitted call opens its descriptors
        assert admitted < 1000
    refused = budget.refusal()
    assert isinstance(refused, TaskLimitError)
    assert (refused.status, refused.data, refused.response_headers()) == (
        503,
        {"limit": "descriptors", "max": 1024},
        {"Retry-After": "1"},
    )
    assert held[0] <= 1024 - MIN_RESERVE  # never past the budget
    held[0] = 200  # calls ended ...
    assert budget.refusal() is not None  # ... but those admitted within the last second may not have opened yet
    now[0] += PENDING_SECONDS + 0.1
    assert budget.refusal() is None


def test_a_burst_admitted_on_one_count_is_taken_to_cost_what_it_will_open() -> None:
    """Calls admitted together have not opened their connections yet when the next one is counted: the budget
    counts them as if they had, so a burst cannot pass on one stale count."""
    budget = DescriptorBudget(1024, lambda: 600, lambda: 0.0)  # nothing ever seems to open
    admitted = 0
    while budget.refusal() is None:
        admitted += 1
        assert admitted < 1000
    assert 600 + COST_PER_CALL * admitted <= 1024 - MIN_RESERVE


def test_the_soft_limit_is_raised_to_the_hard_one_at_start(tmp_path: Path) -> None:
    """In a child whose soft limit is 256 and hard one 4096, as a container may start the proxy."""
    script = textwrap.dedent(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
        from proxy.edge._descriptors import raise_soft_limit
        limit = raise_soft_limit()
        print(limit.soft_before, limit.soft, limit.hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=os.getcwd(), timeout=60
    ).stdout.split()
    assert out == ["256", "4096", "4096", "4096"]
