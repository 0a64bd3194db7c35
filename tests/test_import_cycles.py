"""No import circles in the proxy or the benchmarks: every import between their modules counts, those under
`if TYPE_CHECKING:` and inside functions included, so the layers in docs/architecture.md can be read one way."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "benchmarks")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules `name` imports, anywhere in its text."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b` names module a.b when there is one, else something defined in a
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a package's attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    modules = set(paths)
    return {
        name: imported(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", modules)
        for name, path in paths.items()
    }


def test_the_graph_sees_imports_of_every_form() -> None:
    graph = import_graph()
    assert "proxy.upstream.pool" in graph["proxy.lifecycle"]  # from a.b import C
    assert "proxy.wire.jsonrpc" in graph["proxy.app"]  # from a import module
    assert "proxy.config" in graph["proxy.upstream.http.shared"]
    assert all(target.startswith(PACKAGES) for targets in graph.values() for target in targets)


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle, each named once: after one is found, its first import is set aside and the search goes on."""
    graph = {name: set(targets) for name, targets in graph.items()}
    found: list[str] = []
    while True:
        try:
            TopologicalSorter(graph).prepare()
        except CycleError as exc:
            cycle: list[str] = exc.args[1]
            found.append(" imports ".join(reversed(cycle)))
            graph[cycle[1]].discard(cycle[0])  # graphlib lists a circle backwards: cycle[1] imports cycle[0]
        else:
            return found


def test_the_search_finds_a_circle_behind_type_checking() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proxy.b import B\n"
    graph = {"proxy.a": imported(ast.parse(source), "proxy.a", False, {"proxy.a", "proxy.b"}), "proxy.b": {"proxy.a"}}
    assert len(circles(graph)) == 1


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


# The layers of docs/architecture.md, lowest first, by module or package: a module imports only from its own
# layer or the ones below it. A new module of the proxy must be placed in one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "the wire and what every layer imports",
        (
            "proxy.wire",
            "proxy.errors",
            "proxy.config",
            "proxy.config_loader",
            "proxy.keyfiles",
            "proxy.live_config",
            "proxy.observability",
            "proxy.tracing",
            "proxy.span_attributes",
            "proxy.trace_context",
            "proxy.tracing_setup",
            "proxy.policy",
            "proxy.principals",
            "proxy.jwt_identity",
            "proxy.audit",
            "proxy.background",
        ),
    ),
    ("upstream", ("proxy.upstream",)),
    ("legacy and tasks", ("proxy.legacy", "proxy.tasks")),
    (
        "front, app and cli",
        (
            "proxy",
            "proxy.__main__",
            "proxy.front",
            "proxy.handles",
            "proxy.listen",
            "proxy.task_views",
            "proxy.relay",
            "proxy.admin",
            "proxy.edge",
            "proxy.drain",
            "proxy.app",
            "proxy.app_keys",
            "proxy.admission",
            "proxy.ops",
            "proxy.lifecycle",
            "proxy.serve",
            "proxy.startup",
            "proxy.cli",
            "proxy.operator_cli",
        ),
    ),
)


def layer_of(module: str) -> int | None:
    """The index of the module's layer (its own name or its nearest package named in `LAYERS`), or None."""
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(f"{name}.")) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a layer above its own, named with both layers."""
    found: list[str] = []
    for name, targets in sorted(graph.items()):
        below = layer_of(name)
        for target in sorted(targets):
            above = layer_of(target)
            if below is not None and above is not None and above > below:
                found.append(f"{name} ({LAYERS[below][0]}) imports {target} ({LAYERS[above][0]})")
    return found


def test_every_module_of_the_proxy_has_a_layer() -> None:
    assert [name for name in import_graph() if name.startswith("proxy") and layer_of(name) is None] == []


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    assert upward_imports(import_graph()) == []


def test_the_layer_check_finds_an_upstream_module_importing_legacy() -> None:
    source = "def later() -> None:\n    from proxy.legacy.passthrough import PassThrough\n"
    modules = {"proxy.upstream.pool", "proxy.legacy", "proxy.legacy.passthrough"}
    graph = {"proxy.upstream.pool": imported(ast.parse(source), "proxy.upstream.pool", False, modules)}
    assert upward_imports(graph) == [
        "proxy.upstream.pool (upstream) imports proxy.legacy.passthrough (legacy and tasks)"
    ]
