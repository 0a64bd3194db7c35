"""The process's descriptor budget: the soft `RLIMIT_NOFILE` raised to the hard limit at start, what the configured
limits could need (`need`, warned about at start when it does not fit), and whether new work fits now
(`DescriptorBudget`: past the budget a new call or listen stream is refused with 503 before it opens anything, so
the process never meets `EMFILE`; the front asks it through the refusal it is handed). Imports the config schema
and the errors only.
"""

from __future__ import annotations

import os
import resource
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from proxy.config.schema import Config, HttpUpstreamConfig
from proxy.errors import ProxyError, TaskLimitError

FD_DIR: Final = "/proc/self/fd"
NR_OPEN: Final = "/proc/sys/fs/nr_open"

# What the process holds whatever it serves: standard streams, the event loop's selector and wake-up pipe, the
# listening sockets, the resolver's and threads' pipes, the audit file, a few loaded libraries' files.
BASE: Final = 32
SQLITE: Final = 8  # the writer's and the reader's connections (database, WAL, shared memory each), the lock file
ADMIN: Final = 8  # the admin listener and the few operators' connections it serves at once
STDIO_PROCESS: Final = 4  # a stdio server: its stdin, stdout and stderr pipes, and the pidfd that reaps it
# Kept free for what is not new work: accepting client connections (each is a descriptor), answering the
# refusals themselves, the store reconnecting, tasks/get and tasks/update.
MIN_RESERVE: Final = 64
RESERVE_SHARE: Final = 16  # ... or 1/16 of the limit, when that is more
COST_PER_CALL: Final = 2  # a call's upstream request, and the GET stream of a session of its own
RECOUNT_EVERY: Final = 64  # far below the budget, the descriptors open are counted once per this many new calls
PENDING_SECONDS: Final = 1.0  # a call admitted this recently may not hold its descriptors yet


def open_descriptors() -> int:
    """Descriptors open in this process: the size Linux reports for /proc/self/fd (one `stat`, since 6.2), else
    its entries counted (0 where there is no /proc: the budget then never refuses)."""
    try:
        size = os.stat(FD_DIR).st_size
        if size > 0:
            return size
        return len(os.listdir(FD_DIR)) - 1  # less the listing's own
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class Limit:
    soft_before: int
    soft: int
    hard: int


def raise_soft_limit() -> Limit:
    """At start: the soft limit raised to the hard one (an unlimited hard limit means the kernel's `nr_open`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open(NR_OPEN) as file:
                target = int(file.read())
        except (OSError, ValueError):
            target = soft
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return Limit(soft, soft, hard)
        return Limit(soft, target, hard)
    return Limit(soft, soft, hard)


def reserve(limit: int) -> int:
    return max(MIN_RESERVE, limit // RESERVE_SHARE)


def need(config: Config, limit: int) -> dict[str, int]:
    """What the configured limits could need at once, by part (their sum, with `reserve`, is the need): running
    tasks (their upstream request each), calls that wait or may (`inputs.max_waiting`: their request, with
    parked calls among them), the upstream sessions' GET streams (HTTP) or server processes (stdio), listen
    streams (the client's connection each), the store's connections, the admin listener, the base."""
    upstream = config.upstream
    store = config.store.pool_size + 2 if config.store.url is not None else SQLITE
    parts = {
        "base": BASE,
        "store": store,
        "running": config.tasks.max_running,
        "waiting": config.inputs.max_waiting,
        "upstream_sessions": upstream.max_open_sessions
        if isinstance(upstream, HttpUpstreamConfig)
        else upstream.max_processes * STDIO_PROCESS,
        "listen_streams": config.limits.max_listen_streams,
        "admin": ADMIN if config.admin.port is not None else 0,
        "reserve": reserve(limit),
    }
    return parts


class DescriptorBudget:
    """Whether new work fits in the descriptors left: refused past `limit - reserve(limit)`. Once half the budget
    may be in use, the descriptors open are counted at each new call; far below that, once every RECOUNT_EVERY
    calls (the calls admitted meanwhile taken to cost COST_PER_CALL each). Calls admitted within the last
    PENDING_SECONDS may not have opened their connections yet: what they will hold is taken as COST_PER_CALL
    each over the count when the first of them came, unless the count is higher already. So a busy process pays
    for a count only when it matters, and a burst of calls cannot all pass on one count."""

    def __init__(
        self, limit: int, count: Callable[[], int] = open_descriptors, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit = limit
        self._clock = clock
        self.usable = limit - reserve(limit)
        self._count = count
        self._watch_from = self.usable // 2
        self._open = count()
        self._since = 0  # calls admitted since the latest count
        self._recent: deque[tuple[float, int]] = deque()  # calls admitted lately: when, and the count then

    @classmethod
    def of_process(cls) -> DescriptorBudget:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls(soft if soft != resource.RLIM_INFINITY else 1 << 20)

    def refusal(self) -> ProxyError | None:
        """Why new work may not start now (503, `data.limit: descriptors`), or None (it is counted then)."""
        now = self._clock()
        estimate = self._open + COST_PER_CALL * (self._since + 1)
        if estimate >= self._watch_from or self._since >= RECOUNT_EVERY:
            recent = self._recent
            while recent and now - recent[0][0] > PENDING_SECONDS:
                recent.popleft()
            self._open = self._count()
            self._since = 0
            estimate = self._open + COST_PER_CALL
            if recent:
                estimate = max(estimate, recent[0][1] + COST_PER_CALL * (len(recent) + 1))
        if estimate > self.usable:
            return TaskLimitError("descriptors", self.limit)
        self._since += 1
        self._recent.append((now, self._open))
        return None

    @property
    def open(self) -> int:
        """The descriptors open at the latest count."""
        return self._open
