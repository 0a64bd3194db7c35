"""The package as a user gets it, and a checkout that stays clean: the wheel built from this tree (with its
LICENSE) installs into a directory of its own and runs from elsewhere (`--version`, `check-config`, and a
`serve` that creates its SQLite store from the schema inside the package); the files a running proxy leaves
(the task database, its WAL, shared memory, journal and lock, the deployment key beside it, `make run`'s .run/)
are ignored by git (the image's build context keeps them out too: tests/test_deploy.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.upstream.session import PROXY_VERSION
from tests.support.processes import ROOT, free_port
from tests.support.waiting import until_sync

STATE_FILES = (
    "mcp-tasks-proxy.db",
    "mcp-tasks-proxy.db-wal",
    "mcp-tasks-proxy.db-shm",
    "mcp-tasks-proxy.db-journal",
    "mcp-tasks-proxy.db.lock",
    "mcp-tasks-proxy.db.key",
    "config/tasks.db.key",
    ".run/mcp-tasks-proxy.db",
    ".run/mcp-tasks-proxy.db.key",
)


@pytest.mark.parametrize("path", STATE_FILES)
def test_a_running_proxys_files_are_ignored_by_git(path: str) -> None:
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", "--quiet", path], cwd=ROOT, capture_output=True, check=False
    )
    assert checked.returncode == 0, f"{path} is not ignored by .gitignore (git add -A would commit it)"


# --- the wheel ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `python -m build` makes of this tree (in an isolated build environment, as a user's would)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=600,
    )
    [built] = out.glob("mcp_tasks_proxy-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed, without its dependencies (this environment has them), into a directory of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        check=True,
        timeout=300,
    )
    return target


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory outside the checkout."""
    directory = tmp_path / "elsewhere"
    directory.mkdir()
    assert ROOT not in directory.resolve().parents
    return directory


def run_installed(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), cwd=cwd, env=installed_env(installed), capture_output=True, text=True, timeout=120, check=False
    )


def installed_env(installed: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(installed), "PYTHONUNBUFFERED": "1"}


def test_the_wheel_holds_the_package_the_license_and_the_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
        assert "mcp-tasks-proxy = proxy.cli:main" in archive.read(entry_points).decode()
        metadata = archive.read(next(name for name in names if name.endswith(".dist-info/METADATA"))).decode()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert "proxy/tasks/store/sqlite_schema.py" in names
    assert not [name for name in names if name.startswith("tests/")]


def test_the_installed_package_runs_from_another_directory(installed: Path, elsewhere: Path) -> None:
    where = run_installed(installed, elsewhere, sys.executable, "-c", "import proxy; print(proxy.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(installed), where  # the installed copy, not the checkout
    for command in ([sys.executable, "-m", "proxy"], [str(installed / "bin" / "mcp-tasks-proxy")]):
        shown = run_installed(installed, elsewhere, *command, "--version")
        assert (shown.returncode, shown.stdout.strip()) == (0, f"mcp-tasks-proxy {PROXY_VERSION}"), shown
    (elsewhere / "proxy.yaml").write_text("upstream:\n  url: http://127.0.0.1:9/mcp\nstore:\n  path: tasks.db\n")
    checked = run_installed(installed, elsewhere, sys.executable, "-m", "proxy", "check-config", "proxy.yaml")
    assert (checked.returncode, checked.stdout.strip()) == (0, "proxy.yaml: ok"), checked


@pytest.fixture
def installed_proxy(installed: Path, elsewhere: Path) -> Iterator[subprocess.Popen[str]]:
    port = free_port()
    log = (elsewhere / "proxy.log").open("w")
    command = [str(installed / "bin" / "mcp-tasks-proxy"), "serve", "--upstream", "http://127.0.0.1:9/mcp"]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--db", "tasks.db"],
        cwd=elsewhere,
        env={**installed_env(installed), "MCP_TASKS_PROXY_OBSERVABILITY__PORT": "0"},  # never a port in use
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_the_installed_command_serves_with_a_store_made_from_the_packaged_schema(
    installed_proxy: subprocess.Popen[str], elsewhere: Path
) -> None:
    def started() -> list[dict[str, object]]:
        assert installed_proxy.poll() is None, (elsewhere / "proxy.log").read_text()
        lines = (elsewhere / "proxy.log").read_text().splitlines()
        return [event for line in lines if line.startswith("{") and (event := json.loads(line))["event"] == "started"]

    [line] = until_sync(started, "the installed proxy did not start", 60)
    assert line["store"] == f"sqlite: {(elsewhere / 'tasks.db').resolve()}"
    assert (elsewhere / "tasks.db").exists()
    installed_proxy.send_signal(signal.SIGTERM)
    assert installed_proxy.wait(30) == 0
