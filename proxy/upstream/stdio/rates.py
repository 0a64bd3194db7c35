"""How often things may happen around a stdio server: a token bucket and a line sampler for what it writes
on stderr, a backoff for restarting it after crashes.

Pure classes: they take the time (or a duration) as an argument, do no I/O and need no event loop.
Imports nothing from the proxy.
"""

from __future__ import annotations


class TokenBucket:
    """At most `burst` events at once, refilled at `rate_per_second`: the budget of a noisy source's log lines."""

    def __init__(self, rate_per_second: float, burst: int, now: float) -> None:
        if rate_per_second <= 0 or burst < 1:
            raise ValueError("a token bucket needs a positive rate and a burst of at least 1")
        self.rate_per_second = rate_per_second
        self.burst = burst
        self._tokens = float(burst)
        self._updated = now

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self._tokens = min(float(self.burst), self._tokens + (now - self._updated) * self.rate_per_second)
            self._updated = now

    def available(self, now: float) -> bool:
        """Whether `take(now)` would succeed."""
        self._refill(now)
        return self._tokens >= 1.0

    def take(self, now: float) -> bool:
        """Spend one token if there is one; False when the budget is used up."""
        self._refill(now)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class Backoff:
    """How long to wait before starting a server again after it crashed.

    A process that lived at least `healthy_after_seconds` was healthy: its exit resets the count and the next
    start is immediate. Each consecutive quicker crash doubles the wait (times `factor`), from
    `initial_seconds` up to `max_seconds`. Exits the proxy asked for (`stop()`) are not crashes: do not report
    them.
    """

    def __init__(
        self,
        *,
        initial_seconds: float = 0.5,
        max_seconds: float = 30.0,
        factor: float = 2.0,
        healthy_after_seconds: float = 10.0,
    ) -> None:
        if initial_seconds <= 0 or max_seconds < initial_seconds or factor < 1 or healthy_after_seconds < 0:
            raise ValueError("backoff needs 0 < initial_seconds <= max_seconds, factor >= 1, healthy_after >= 0")
        self.initial_seconds = initial_seconds
        self.max_seconds = max_seconds
        self.factor = factor
        self.healthy_after_seconds = healthy_after_seconds
        self.crashes = 0  # consecutive quick crashes

    def crashed(self, lived_seconds: float) -> float:
        """Record an unexpected exit of a process that ran `lived_seconds`; returns the seconds to wait
        before the next start (0: start at once)."""
        if lived_seconds >= self.healthy_after_seconds:
            self.crashes = 0
            return 0.0
        self.crashes += 1
        # The exponent is capped so a server crashing for days cannot overflow the float.
        exponent = min(self.crashes - 1, 64)
        return float(min(self.max_seconds, self.initial_seconds * self.factor**exponent))

    def reset(self) -> None:
        """A session on a fresh process succeeded (e.g. `initialize` answered): forget earlier crashes."""
        self.crashes = 0


class LineSampler:
    """Splits a noisy byte stream (a server's stderr) into lines and lets through only what `bucket` allows.

    A line is kept up to `max_line_bytes` (the rest is dropped and the line marked cut), so neither a flood of
    lines nor one endless line costs more than that in memory. Refused lines are counted, and `report()` hands
    the count out at most once per `report_every_seconds`.
    """

    def __init__(self, bucket: TokenBucket, max_line_bytes: int, now: float, report_every_seconds: float = 1.0) -> None:
        self.bucket = bucket
        self.max_line_bytes = max_line_bytes
        self.report_every_seconds = report_every_seconds
        self.suppressed = 0
        self._partial = bytearray()
        self._cut = False
        self._reported_at = now

    def feed(self, data: bytes, now: float) -> list[tuple[bytes, bool]]:
        """The complete lines in `data` (after what earlier calls left open) that are let through, each with
        whether it was cut."""
        admitted: list[tuple[bytes, bool]] = []
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if not self.bucket.available(now):
                # Over budget: count the remaining lines in one pass instead of looking at each.
                self.suppressed += data.count(b"\n", start)
                self._partial.clear()
                self._cut = False
                start = data.rfind(b"\n") + 1
                break
            self._keep(data[start:end])
            admitted.extend(self._line(now))
            start = end + 1
        self._keep(data[start:])
        return admitted

    def flush(self, now: float) -> list[tuple[bytes, bool]]:
        """The stream ended: its last line, if it had no newline and is let through."""
        return self._line(now) if self._partial else []

    def report(self, now: float, *, final: bool = False) -> int:
        """Lines refused since the last report, once per `report_every_seconds` (any time when `final`)."""
        if not self.suppressed or not (final or now - self._reported_at >= self.report_every_seconds):
            return 0
        count, self.suppressed, self._reported_at = self.suppressed, 0, now
        return count

    def _keep(self, piece: bytes) -> None:
        room = self.max_line_bytes - len(self._partial)
        if len(piece) > room:
            self._cut = True
        self._partial += piece[: max(room, 0)]

    def _line(self, now: float) -> list[tuple[bytes, bool]]:
        line, cut = bytes(self._partial), self._cut
        self._partial.clear()
        self._cut = False
        if not self.bucket.take(now):
            self.suppressed += 1
            return []
        return [(line, cut)]
