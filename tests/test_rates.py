"""upstream/stdio/rates.py: token bucket, stderr line sampler and restart backoff, driven by explicit times."""

from __future__ import annotations

import pytest

from proxy.upstream.stdio.rates import Backoff, LineSampler, TokenBucket


def test_the_bucket_allows_a_burst_then_refills_at_its_rate() -> None:
    bucket = TokenBucket(rate_per_second=2, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.available(100.4)
    assert bucket.take(100.5)  # one token per half second
    assert not bucket.take(100.5)
    assert [bucket.take(200.0) for _ in range(4)] == [True, True, True, False]  # never more than the burst
    assert not bucket.take(150.0)  # time going backwards refills nothing


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (1, 0)])
def test_a_bucket_needs_a_positive_rate_and_burst(rate: float, burst: int) -> None:
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(rate, burst, 0.0)


def test_backoff_doubles_after_quick_crashes_up_to_its_cap_and_resets_after_a_healthy_run() -> None:
    backoff = Backoff(initial_seconds=0.5, max_seconds=4, healthy_after_seconds=10)
    assert [backoff.crashed(lived_seconds=0.1) for _ in range(6)] == [0.5, 1, 2, 4, 4, 4]
    assert backoff.crashes == 6
    assert backoff.crashed(lived_seconds=10) == 0  # it ran long enough: start again at once
    assert backoff.crashes == 0
    assert backoff.crashed(lived_seconds=9.9) == 0.5


def test_backoff_reset_forgets_crashes_and_never_overflows() -> None:
    backoff = Backoff(initial_seconds=1, max_seconds=30)
    for _ in range(5000):
        delay = backoff.crashed(0)
    assert delay == 30
    backoff.reset()
    assert backoff.crashed(0) == 1


@pytest.mark.parametrize(
    "options",
    [{"initial_seconds": 0}, {"initial_seconds": 5, "max_seconds": 1}, {"factor": 0.5}],
)
def test_backoff_rejects_nonsense(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(**options)


def test_the_sampler_joins_lines_across_chunks_and_cuts_long_ones() -> None:
    sampler = LineSampler(TokenBucket(1, 10, 0.0), max_line_bytes=8, now=0.0)
    assert sampler.feed(b"hel", 0.0) == []
    assert sampler.feed(b"lo\nworld\nthis line is long", 0.0) == [(b"hello", False), (b"world", False)]
    assert sampler.feed(b" and longer\nlast", 0.0) == [(b"this lin", True)]
    assert sampler.flush(0.0) == [(b"last", False)]
    assert sampler.flush(0.0) == []
    assert sampler.suppressed == 0


def test_the_sampler_counts_what_the_budget_refuses_and_reports_it_once_a_second() -> None:
    sampler = LineSampler(TokenBucket(1, 2, 0.0), max_line_bytes=100, now=0.0)
    flood = b"".join(b"line %d\n" % n for n in range(1000))
    assert sampler.feed(flood, 0.0) == [(b"line 0", False), (b"line 1", False)]
    assert sampler.suppressed == 998
    assert sampler.report(0.5) == 0  # not yet: at most one report a second
    assert sampler.report(1.0) == 998
    assert sampler.report(5.0) == 0  # nothing new
    assert sampler.feed(b"partial li", 5.0) == []
    assert sampler.feed(b"ne\n", 5.0) == [(b"partial line", False)]
    assert sampler.feed(b"x\n" * 5, 5.0) == [(b"x", False)]
    assert sampler.report(5.1, final=True) == 4
