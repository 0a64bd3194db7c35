"""proxy.tasks.services.pacing: the pollIntervalMs a working task suggests from its tool's usual duration."""

from __future__ import annotations

import pytest

from proxy.tasks.services.pacing import MAX_TOOLS, MIN_POLL_MS, DurationEstimates, poll_interval_ms


def test_unknown_tools_keep_the_policys_pace() -> None:
    assert poll_interval_ms(1000, created_at_ms=0, now_ms=0, expected_ms=None) == 1000


@pytest.mark.parametrize(
    ("now_ms", "expected"),
    [
        (0, 1040),  # at creation: just after the expected end (1000 + 20 + 2 %), up to 1.25x the pace
        (500, 540),  # halfway: the rest of the way
        (990, 50),
        (1000, MIN_POLL_MS),  # at the expected end: soon
        (1200, 100),  # overrunning by 200 ms: half of that
        (5000, 1000),  # far overrun: back to the policy's pace, never slower
    ],
)
def test_polls_land_just_after_the_expected_end(now_ms: int, expected: int) -> None:
    assert poll_interval_ms(1000, created_at_ms=0, now_ms=now_ms, expected_ms=1000) == expected


def test_a_long_tool_is_polled_at_the_policys_pace_until_near_its_end() -> None:
    assert poll_interval_ms(1000, created_at_ms=0, now_ms=0, expected_ms=60_000) == 1000
    assert poll_interval_ms(1000, created_at_ms=0, now_ms=59_000, expected_ms=60_000) == 1000
    # 10 ms before the end: wait it out plus the margin (20 ms + 2 % of the duration), within 1.25x the pace.
    assert poll_interval_ms(1000, created_at_ms=0, now_ms=59_990, expected_ms=60_000) == 10 + 20 + 1200


def test_estimates_follow_recent_durations_and_forget_old_tools() -> None:
    estimates = DurationEstimates()
    assert estimates.expected_ms("a") is None
    estimates.observe("a", 1000)
    assert estimates.expected_ms("a") == 1000
    estimates.observe("a", 2000)
    assert estimates.expected_ms("a") == pytest.approx(1300)
    for number in range(MAX_TOOLS):
        estimates.observe(f"tool-{number}", 10)
    assert estimates.expected_ms("a") is None  # the least recently completed tool went first
    assert estimates.expected_ms(f"tool-{MAX_TOOLS - 1}") == 10


def test_estimates_loaded_from_the_store_replace_the_local_ones() -> None:
    estimates = DurationEstimates()
    estimates.observe("local", 100)
    estimates.observe("shared", 100)
    estimates.load({"shared": 2_000.0, "other": 50.0})
    assert (estimates.expected_ms("shared"), estimates.expected_ms("other"), estimates.expected_ms("local")) == (
        2_000.0,
        50.0,
        100,
    )
    estimates.load({f"tool_{index}": float(index) for index in range(MAX_TOOLS + 5)})
    assert estimates.expected_ms("local") is None  # the bound holds
    assert estimates.expected_ms(f"tool_{MAX_TOOLS + 4}") == MAX_TOOLS + 4
