"""No import circles in the proxy or the benchmarks: every import between their modules counts, those under
`if TYPE_CHECKING:` and inside functions included, so the layers (`test_layers.py`) can be read one way."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter

from tests.support.imports import PACKAGES, import_graph, imported


def test_the_graph_sees_imports_of_every_form() -> None:
    graph = import_graph()
    assert "proxy.upstream.pool" in graph["proxy.edge._lifecycle"]  # from a.b import C
    assert "proxy.wire.jsonrpc" in graph["proxy.edge.app"]  # from a import module
    assert "proxy.config.schema" in graph["proxy.policy"]
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
