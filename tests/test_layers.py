"""The layers of docs/architecture.md, one per package, and the sans-IO rooms.

A module imports only from its own layer or the ones below it; every module of the proxy has a layer (a new
module lands in the package of its room). The sans-IO rooms (the wire, the call machine, the tool policy) and
whatever of the proxy they import never import an event loop, an HTTP client or server, or a database driver."""

from __future__ import annotations

import ast

from tests.support.imports import external_imports, import_graph, imported, module_paths

# Lowest first. A module's layer is that of its nearest package (or its own name) listed here.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "the wire and the words every layer shares",
        ("proxy.wire", "proxy.config", "proxy.errors", "proxy.principals", "proxy.policy", "proxy.background"),
    ),
    ("the client in the box (it imports nothing of the server)", ("proxy.client",)),
    ("what the proxy tells about itself", ("proxy.observe",)),
    ("the call machine (sans-IO)", ("proxy.tasks.machine",)),
    ("the upstream client", ("proxy.upstream",)),
    ("the task store", ("proxy.tasks.store",)),
    (
        "the tasks' executor, effects and services; the legacy servers; events",
        ("proxy.tasks", "proxy.legacy", "proxy.events"),
    ),
    ("the front and the operators' tools", ("proxy.front", "proxy.operators")),
    ("the HTTP edge", ("proxy.edge",)),
    ("the command line", ("proxy", "proxy.__main__", "proxy.cli")),
)

# Rooms that share a layer and must still not import each other.
APART: tuple[tuple[str, str], ...] = (("proxy.tasks", "proxy.legacy"), ("proxy.front", "proxy.operators"))

# Sans-IO: what these modules import (and what the proxy's modules they import do) is pure.
SANS_IO_ROOMS: tuple[str, ...] = ("proxy.wire", "proxy.tasks.machine", "proxy.policy")
NOT_SANS_IO: frozenset[str] = frozenset({"asyncio", "aiohttp", "sqlite3", "sqlite_utils", "psycopg", "psycopg_pool"})


def within(module: str, room: str) -> bool:
    return module == room or module.startswith(f"{room}.")


def layer_of(module: str) -> int | None:
    """The index of the module's layer (its own name or its nearest package named in `LAYERS`), or None."""
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if within(module, name) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def room_of(module: str) -> str | None:
    """The nearest package named in `LAYERS` that holds the module."""
    rooms = [name for _, names in LAYERS for name in names if within(module, name)]
    return max(rooms, key=len) if rooms else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a layer above its own, or from a room it must stay apart from."""
    found: list[str] = []
    for name, targets in sorted(graph.items()):
        below = layer_of(name)
        for target in sorted(targets):
            above = layer_of(target)
            if below is not None and above is not None and above > below:
                found.append(f"{name} ({LAYERS[below][0]}) imports {target} ({LAYERS[above][0]})")
            rooms = {room_of(name), room_of(target)}
            if any(rooms == set(pair) for pair in APART):
                found.append(f"{name} imports {target}: {room_of(name)} and {room_of(target)} stay apart")
    return found


def impure_imports(graph: dict[str, set[str]], external: dict[str, set[str]]) -> list[str]:
    """Each module of a sans-IO room, or of the proxy reached from one, that imports what does I/O."""
    found: list[str] = []
    for start in sorted(name for name in graph if any(within(name, room) for room in SANS_IO_ROOMS)):
        seen, path = {start}, [start]
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for bad in sorted(external.get(module, set()) & NOT_SANS_IO):
                found.append(f"{' imports '.join(path)} imports {bad}")
            for target in sorted(graph.get(module, ())):
                if target.startswith("proxy") and target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    return found


def external_graph() -> dict[str, set[str]]:
    return {
        name: external_imports(ast.parse(path.read_text(encoding="utf-8"))) for name, path in module_paths().items()
    }


def test_every_module_of_the_proxy_has_a_layer() -> None:
    assert [name for name in import_graph() if name.startswith("proxy") and layer_of(name) is None] == []


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    assert upward_imports(import_graph()) == []


def test_the_sans_io_rooms_import_nothing_that_does_io() -> None:
    graph = import_graph()
    assert any(within(name, "proxy.tasks.machine") for name in graph)  # the rooms are where the guard looks
    assert any(within(name, "proxy.wire") for name in graph)
    assert impure_imports(graph, external_graph()) == []


def test_the_layer_check_finds_an_upstream_module_importing_legacy() -> None:
    source = "def later() -> None:\n    from proxy.legacy.passthrough import PassThrough\n"
    modules = {"proxy.upstream.pool", "proxy.legacy", "proxy.legacy.passthrough"}
    graph = {"proxy.upstream.pool": imported(ast.parse(source), "proxy.upstream.pool", False, modules)}
    assert upward_imports(graph) == [
        "proxy.upstream.pool (the upstream client) imports proxy.legacy.passthrough "
        "(the tasks' executor, effects and services; the legacy servers; events)"
    ]


def test_the_layer_check_finds_tasks_importing_a_legacy_server() -> None:
    graph = {"proxy.tasks.runner": {"proxy.legacy.serving"}}
    assert upward_imports(graph) == [
        "proxy.tasks.runner imports proxy.legacy.serving: proxy.tasks and proxy.legacy stay apart"
    ]


def test_the_machine_importing_the_store_is_found() -> None:
    graph = {"proxy.tasks.machine.state": {"proxy.tasks.store"}}
    assert upward_imports(graph) == [
        "proxy.tasks.machine.state (the call machine (sans-IO)) imports proxy.tasks.store (the task store)"
    ]


def test_the_guard_finds_asyncio_in_a_wire_module_and_aiohttp_in_the_machine() -> None:
    graph = {
        "proxy.wire.jsonrpc": {"proxy.errors"},
        "proxy.errors": set(),
        "proxy.tasks.machine": {"proxy.tasks.machine.state"},
        "proxy.tasks.machine.state": set(),
    }
    wire = external_imports(ast.parse("import json\nimport asyncio\n"))
    machine_state = external_imports(ast.parse("def later() -> None:\n    from aiohttp import web\n"))
    external = {"proxy.wire.jsonrpc": wire, "proxy.errors": set(), "proxy.tasks.machine.state": machine_state}
    assert impure_imports(graph, external) == [
        "proxy.tasks.machine imports proxy.tasks.machine.state imports aiohttp",
        "proxy.tasks.machine.state imports aiohttp",
        "proxy.wire.jsonrpc imports asyncio",
    ]


def test_the_guard_follows_the_proxy_modules_a_sans_io_room_imports() -> None:
    graph = {"proxy.policy": {"proxy.config.schema"}, "proxy.config.schema": set()}
    external = {"proxy.policy": set(), "proxy.config.schema": {"psycopg"}}
    assert impure_imports(graph, external) == ["proxy.policy imports proxy.config.schema imports psycopg"]


def test_every_module_of_the_proxy_opens_with_a_short_header() -> None:
    """What a module owns and what it must not import, in at most five lines; the why, where it is needed, in the
    docstrings of what it defines."""
    long = {}
    for name, path in module_paths().items():
        if not name.startswith("proxy"):
            continue
        header = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        lines = len(header.strip("\n").split("\n")) if header else 0
        if not 1 <= lines <= 5:
            long[name] = lines
    assert long == {}


def test_the_proxy_composes_instead_of_mixing_in() -> None:
    """No class of the proxy inherits from two classes (a protocol or `Generic` beside one is fine), and nothing
    raises NotImplementedError: a part another part needs is a member, not a stub overridden later."""
    found = []
    for name, path in module_paths().items():
        if not name.startswith("proxy"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base) for base in node.bases]
                if len([base for base in bases if base.split("[")[0] not in ("Protocol", "Generic")]) > 1:
                    found.append(f"{name}.{node.name}({', '.join(bases)})")
            elif isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node.exc or node):
                found.append(f"{name}:{node.lineno} raises NotImplementedError")
    assert found == []


# Module names the proxy uses twice, each for one concept in two places (parallel variants, or a concept's two
# layers); any other name used twice names two different things, and a reader who knows one misreads the other.
SHARED_NAMES = {
    "session.py": "the upstream session's protocol, and its HTTP and stdio variants",
    "job.py": "a legacy job's reading (sans-IO machine) and the follower that carries it out (effects)",
    "upstream_task.py": "an upstream-run task's reading (sans-IO machine) and its follower (effects)",
    "grants.py": "kept grants: the store's SQL and port, and the credential source's view of that port",
    "errors.py": "the proxy's error tree, and the Events extension's codes within it",
    "service.py": "a front feature's service: the Events extension's, and task handles'",
}


def test_a_module_name_is_used_twice_only_for_one_concept() -> None:
    by_name: dict[str, list[str]] = {}
    for module, path in module_paths().items():
        if module.startswith("proxy.") and path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(module)
    shared = {name for name, modules in by_name.items() if len(modules) > 1}
    assert shared - SHARED_NAMES.keys() == set(), {name: by_name[name] for name in shared - SHARED_NAMES.keys()}
    assert SHARED_NAMES.keys() - shared == set()  # a name no longer shared leaves the list
