"""The path of one `tools/call` that becomes a task (`benchmarks/path.py`), measured on the real proxy in front
of the lean upstream: it runs through the call's machine, its executor and the store, and the composition
roots that wired them at start (the app's `lifecycle.py`, the tasks' `runner.py`) are not on it: services hold
what they need (the config getter itself, the executor's forgetters), not closures back into a root."""

from __future__ import annotations

from benchmarks.path import call_path


async def test_a_task_making_call_runs_through_the_machine_and_the_store_and_not_the_composition_root() -> None:
    parts = await call_path()
    request, task = parts["request"], parts["task"]
    for module in (
        "proxy.edge.app",
        "proxy.front.dispatch",
        "proxy.tasks.machine",
        "proxy.tasks.executor",
        "proxy.policy",
    ):
        assert module in request.modules, module
    assert "proxy.tasks.store.sqlite" in request.modules  # the record is created before the handle is sent
    assert "proxy.tasks.effects.records" in task.modules  # and the result committed after it
    assert "RecordWrites.settle" in task.modules["proxy.tasks.effects.records"]
    assert all(module.startswith("proxy.") for module in request.modules | task.modules)
    for root in ("proxy.edge._lifecycle", "proxy.tasks.runner"):
        assert root not in request.modules | task.modules, root
    assert request.steps
    assert task.steps
