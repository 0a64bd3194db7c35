"""The table of live calls: every call not finished yet, and the calls of tasks whose upstream call runs in
this process, by task id. Plain data; imports the live call only.
"""

from __future__ import annotations

from proxy.tasks.live_call import LiveCall


class CallTable:
    def __init__(self) -> None:
        self._calls: set[LiveCall] = set()
        self._by_task: dict[str, LiveCall] = {}

    def add(self, call: LiveCall) -> None:
        self._calls.add(call)

    def add_task(self, task_id: str, call: LiveCall) -> None:
        self._by_task[task_id] = call

    def drop_task(self, task_id: str) -> None:
        self._by_task.pop(task_id, None)

    def task(self, task_id: str) -> LiveCall | None:
        return self._by_task.get(task_id)

    def forget(self, call: LiveCall) -> None:
        self._calls.discard(call)
        task_id = call.state.task_id
        if task_id is not None and self._by_task.get(task_id) is call:
            del self._by_task[task_id]

    def calls(self) -> list[LiveCall]:
        return list(self._calls)

    def tasks(self) -> dict[str, LiveCall]:
        return dict(self._by_task)

    @property
    def count(self) -> int:
        return len(self._calls)
