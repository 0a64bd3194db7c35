"""Prometheus metrics: every metric of one proxy in its own registry, with bounded labels (known methods, tools
named in the policy, else `other`). Imports nothing of the proxy."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OTHER: Final = "other"
# Label values are bounded: methods outside this set (and every tool not named in the policy) are `other`.
KNOWN_METHODS: Final = frozenset(
    {
        "initialize",
        "ping",
        "server/discover",
        "tools/list",
        "tools/call",
        "prompts/list",
        "prompts/get",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "resources/subscribe",
        "resources/unsubscribe",
        "completion/complete",
        "logging/setLevel",
        "subscriptions/listen",
        "tasks/get",
        "tasks/update",
        "tasks/cancel",
        "tasks/result",
        "tasks/list",
        "notifications/initialized",
        "notifications/cancelled",
        "notifications/progress",
        "notifications/roots/list_changed",
    }
)
LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
TASK_BUCKETS: Final = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400, 86400)


def method_label(method: str | None) -> str:
    if method is None:
        return "-"
    return method if method in KNOWN_METHODS else OTHER


_M = TypeVar("_M", Counter, Gauge, Histogram)


class Children(Generic[_M]):
    """The children of a labelled metric, each asked of prometheus_client once: `labels()` checks its values,
    builds their key and takes a lock on every call, a child kept here costs one dict lookup. For label values
    of a bounded set only (every label of `Metrics` is bounded), as a child is kept for good; and for metrics
    whose children are never removed (none of the proxy's are)."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: _M) -> None:
        self._metric: _M = metric
        self._children: dict[tuple[str, ...], _M] = {}

    def __call__(self, *values: str) -> _M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class Metrics:
    """Every metric of one proxy, in its own registry (so several apps in one process do not collide)."""

    def __init__(self, tool_names: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._tools = frozenset(tool_names)
        prefix = "mcp_tasks_proxy"
        self.requests = Counter(
            f"{prefix}_requests_total",
            "HTTP requests by era, MCP method and outcome (ok, jsonrpc_error, client_error, server_error, "
            "disconnected)",
            ["era", "method", "outcome"],
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            f"{prefix}_request_duration_seconds",
            "Time to answer a request (until its last byte for streams)",
            ["era", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tasks_created = Counter(f"{prefix}_tasks_created_total", "Tasks created", ["tool"], registry=self.registry)
        self.tasks_settled = Counter(
            f"{prefix}_tasks_settled_total",
            "Tasks settled, by final status",
            ["tool", "status"],
            registry=self.registry,
        )
        self.task_seconds = Histogram(
            f"{prefix}_task_duration_seconds",
            "Task lifetime from creation to settlement",
            ["tool", "status"],
            buckets=TASK_BUCKETS,
            registry=self.registry,
        )
        self.create_seconds = Histogram(
            f"{prefix}_task_create_seconds",
            "Time the proxy spends creating a task, limits check and commit included, until its CreateTaskResult "
            "is ready (path: task = at once, window = when the sync window ran out)",
            ["path"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tasks_running = Gauge(
            f"{prefix}_tasks_running", "Tasks whose upstream call runs in this process", registry=self.registry
        )
        self.calls_parked = Gauge(
            f"{prefix}_calls_parked",
            "Synchronous calls parked by an MRTR InputRequiredResult, waiting for the client's retry",
            registry=self.registry,
        )
        self.waiting_places = Gauge(
            f"{prefix}_waiting_places",
            "Calls that wait or may come to wait for their client's input, the count inputs.max_waiting caps: "
            "tasks in input_required, parked MRTR calls, and running calls whose client could answer a question",
            registry=self.registry,
        )
        self.input_requests = Counter(
            f"{prefix}_input_requests_total",
            "Upstream questions (elicitation, sampling, roots) by how they went: relayed as an inputRequest, or "
            "refused because the client did not declare the capability (or nobody waits for the call any more)",
            ["method", "outcome"],
            registry=self.registry,
        )
        self.tasks_by_status = Gauge(
            f"{prefix}_tasks",
            "Task records in the store, by status (kept by the store as records change, in the same transaction: "
            "a scrape reads a few rows, never counts them; every replica on one PostgreSQL database reads the same)",
            ["status"],
            registry=self.registry,
        )
        self.store_bytes = Gauge(
            f"{prefix}_store_size_bytes", "Size of the task database and its WAL on disk", registry=self.registry
        )
        self.upstream_seconds = Histogram(
            f"{prefix}_upstream_request_duration_seconds",
            "Upstream requests, from sending to the end of their answer",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            f"{prefix}_upstream_errors_total",
            "Upstream requests that failed (unreachable, timeout, broken stream)",
            ["method", "kind"],
            registry=self.registry,
        )

        # Read at scrape time (set_function in app.py) or counted where they happen; config/monitoring/ uses them.
        self.upstream_sessions = Gauge(
            f"{prefix}_upstream_sessions",
            "Upstream sessions open (for a stdio upstream: server processes running)",
            registry=self.registry,
        )
        self.upstream_sessions_idle = Gauge(
            f"{prefix}_upstream_sessions_idle", "Upstream sessions open and idle (kept warm)", registry=self.registry
        )
        self.upstream_calls_in_flight = Gauge(
            f"{prefix}_upstream_calls_in_flight", "Upstream requests open right now", registry=self.registry
        )
        self.lease_held = Gauge(
            f"{prefix}_lease_held",
            "1 while this replica holds its lease on the task store (renewed within store.lease_seconds), else 0",
            registry=self.registry,
        )
        self.limit_refusals = Counter(
            f"{prefix}_limit_refusals_total",
            "Requests refused by a limit of the proxy (data.limit of the error: max_running, max_parked, "
            "max_sessions, ...)",
            ["limit"],
            registry=self.registry,
        )
        self.listen_streams = Gauge(
            f"{prefix}_listen_streams", "subscriptions/listen streams open", registry=self.registry
        )
        self.idempotent_calls = Counter(
            f"{prefix}_idempotent_calls_total",
            "tools/call requests with an Idempotency-Key, by what the key did: first (ran), replayed (a recorded "
            "outcome answered), joined (waited for the first, still running), conflict (422: another request), "
            "busy (409: the first ran past the join timeout), interrupted (the first's process died), released "
            "(refused before the upstream saw it: the key is free again)",
            ["outcome"],
            registry=self.registry,
        )
        self.task_notifications = Counter(
            f"{prefix}_task_notifications_total",
            "notifications/tasks pushed to listen streams, by the task's status",
            ["status"],
            registry=self.registry,
        )
        self.client_notifications_dropped = Counter(
            f"{prefix}_client_notifications_dropped_total",
            "Notifications for a slow client of a call not written: replaced by a newer progress notification "
            "(coalesced), or dropped past limits.max_client_backlog_bytes (backlog_full)",
            ["reason"],
            registry=self.registry,
        )
        self.queued_calls = Gauge(
            f"{prefix}_queued_calls",
            "Calls waiting for an upstream slot (upstream.max_concurrent_calls), by tool",
            ["tool"],
            registry=self.registry,
        )
        self.queue_wait_seconds = Histogram(
            f"{prefix}_queue_wait_seconds",
            "How long a call waited for an upstream slot before its request was sent (calls that waited only)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
            registry=self.registry,
        )
        self.store_up = Gauge(
            f"{prefix}_store_up", "1 when the task store answered the last scrape, else 0", registry=self.registry
        )
        self.store_available = Gauge(
            f"{prefix}_store_available",
            "1 while the task store takes this replica's operations (its latest one succeeded), 0 while it is "
            "unavailable (down, frozen, failing over, a full disk): requests that need it are answered 503",
            registry=self.registry,
        )
        self.store_operation_errors = Counter(
            f"{prefix}_store_operation_errors_total",
            "Task store operations that failed because the store was unavailable, by operation (get, update, "
            "create, renew_lease, ...) and reason (timeout: past store.timeout_seconds; connection; read_only)",
            ["operation", "reason"],
            registry=self.registry,
        )
        self.store_read_seconds = Gauge(
            f"{prefix}_store_read_seconds",
            "How long the last scrape's read of the task store took (its counts and size)",
            registry=self.registry,
        )
        self.descriptors_open = Gauge(
            f"{prefix}_descriptors_open", "File descriptors open in this process", registry=self.registry
        )
        self.descriptors_limit = Gauge(
            f"{prefix}_descriptors_limit",
            "The process's soft RLIMIT_NOFILE (raised to the hard limit at start); new work is refused with 503 "
            "and data.limit descriptors when what is open nears it",
            registry=self.registry,
        )
        self.upstream_sessions_max = Gauge(
            f"{prefix}_upstream_sessions_max",
            "The most upstream sessions the pool opens at once (upstream.max_open_sessions; stdio: "
            "upstream.max_processes)",
            registry=self.registry,
        )
        self.settlements_refused = Counter(
            f"{prefix}_settlements_refused_total",
            "Task outcomes (results, errors) of calls run here that the store refused, so lost: by reason, fenced "
            "(another replica owns the task now: it was taken over) or settled (the task had ended otherwise "
            "meanwhile: a cancel, its TTL). The settlement_refused log lines name the tasks",
            ["reason"],
            registry=self.registry,
        )
        self.store_pending_settlements = Gauge(
            f"{prefix}_store_pending_settlements",
            "Task record writes (results, errors, questions, progress) waiting for the store to take them",
            registry=self.registry,
        )

        # What every request, upstream request and task counts: its labelled children, each looked up once.
        self._requests = Children(self.requests)
        self._request_seconds = Children(self.request_seconds)
        self._upstream_seconds = Children(self.upstream_seconds)
        self._tasks_created = Children(self.tasks_created)
        self._create_seconds = Children(self.create_seconds)
        self._tasks_settled = Children(self.tasks_settled)
        self._task_seconds = Children(self.task_seconds)

    def request_done(self, era: str, method: str, outcome: str, seconds: float) -> None:
        """One request answered: `era`, `method` (a `method_label`) and `outcome` are of bounded sets."""
        self._requests(era, method, outcome).inc()
        self._request_seconds(era, method).observe(seconds)

    def upstream_request_done(self, method: str, seconds: float) -> None:
        """One upstream request ended, after `seconds`; `method` is a `method_label`."""
        self._upstream_seconds(method).observe(seconds)

    def task_created(self, tool: str, path: str, seconds: float) -> None:
        """A task created for `tool` (any name: counted as its `tool_label`) by `path` (task or window)."""
        self._tasks_created(self.tool_label(tool)).inc()
        self._create_seconds(path).observe(seconds)

    def task_settled(self, tool: str, status: str, lifetime_seconds: float) -> None:
        """A task of `tool` (any name: counted as its `tool_label`) settled as `status`."""
        label = self.tool_label(tool)
        self._tasks_settled(label, status).inc()
        self._task_seconds(label, status).observe(lifetime_seconds)

    def store_operation_failed(self, operation: str, reason: str) -> None:
        """A store operation met an unavailable store (labels of bounded sets: the store's operation names)."""
        self.store_operation_errors.labels(operation, reason).inc()

    def tool_label(self, tool: str) -> str:
        """Tool names only when the operator listed them in `tasks.tools`; anything else is `other`."""
        return tool if tool in self._tools else OTHER

    def render(self) -> bytes:
        return generate_latest(self.registry)
