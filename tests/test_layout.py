"""How the tests are laid out: a test module imports helpers from tests/support/ (and gets fixtures from
conftest.py through pytest), never another test module or conftest, so each can be read, run and changed alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FORBIDDEN = ("conftest", "test_")


def imported_test_modules(path: Path) -> list[str]:
    """The test modules (or conftest) that `path` imports, by dotted name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + (
                [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "tests" else []
            )
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "tests" and any(part.startswith(FORBIDDEN) for part in parts[1:]):
                found.append(module)
    return found


def test_no_module_of_the_tests_imports_a_test_module_or_conftest() -> None:
    """Test modules, conftest, tests/support/ and the fixture servers alike."""
    modules = sorted(TESTS.rglob("*.py"))
    assert len([path for path in modules if path.name.startswith("test_")]) > 40  # the glob found the suite
    offenders = {path.name: imported for path in modules if (imported := imported_test_modules(path))}
    assert offenders == {}


def test_the_check_sees_each_form_of_import(tmp_path: Path) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text(
        "import tests.test_app\n"
        "from tests.conftest import Upstream\n"
        "from tests import test_store\n"
        "from tests.test_flow_stdio import stdio_upstream\n"
        "from tests.support.wire import modern_body\n"
        "from tests import pg\n"
        "def later() -> None:\n"
        "    from tests.test_faults import rpc\n"
    )
    assert imported_test_modules(module) == [
        "tests.test_app",
        "tests.conftest",
        "tests.test_store",
        "tests.test_flow_stdio",
        "tests.test_faults",
    ]


def called_tests(path: Path) -> list[str]:
    """The test functions of `path` that code in `path` calls (a test runs on its own, pytest calls it)."""
    tree = ast.parse(path.read_text(), str(path))
    tests = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    }
    return sorted(
        {
            node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in tests
        }
    )


def test_no_test_calls_another_test() -> None:
    offenders = {path.name: called for path in sorted(TESTS.glob("test_*.py")) if (called := called_tests(path))}
    assert offenders == {}


def test_the_check_sees_a_test_calling_a_test(tmp_path: Path) -> None:
    module = tmp_path / "test_sample.py"
    module.write_text("def test_a() -> None:\n    pass\n\nasync def test_b() -> None:\n    test_a()\n    helper()\n")
    assert called_tests(module) == ["test_a"]
