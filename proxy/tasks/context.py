"""What every service of tasks/ shares, built once by the composition root (`runner.py`) and handed to each
service whole: the store, the table of live calls, the principals, the feed into the calls, the spawner of
background work, the clock, this process's id, the pacing estimates and the metrics. Frozen: a live reload
changes the services' settings, never this. Imports the ports, the store, the table and the pacing; nothing
that carries out a command.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.observe.metrics import Metrics
from proxy.principals import Principals
from proxy.tasks.live_call import CallTable
from proxy.tasks.ports import CredentialBindings, Feed, Spawner
from proxy.tasks.services.pacing import Durations
from proxy.tasks.store import TaskStore


@dataclass(frozen=True, slots=True, kw_only=True)
class TasksContext:
    store: TaskStore
    table: CallTable  # the calls live in this process
    principals: Principals
    feed: Feed  # events into a call's machine (the executor)
    spawner: Spawner  # named background work
    clock: Callable[[], int]  # wall clock, in milliseconds
    process_id: str  # the `owner` of every task this process runs
    durations: Durations  # the pacing estimates; `durations.paced` is the record a client sees
    credentials: CredentialBindings  # what renews a task's upstream credential, kept while the task is live
    metrics: Metrics | None = None
