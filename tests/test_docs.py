"""The documentation: the generated references cover what the code has (and fail on what it lacks), the site
builds with every link and anchor resolved, and every proxy config shown in README.md and docs/ loads as
pasted."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field

from docsgen.hooks import expand
from docsgen.reference import (
    MissingDescription,
    cli_entries,
    cli_reference,
    config_keys,
    config_reference,
    metrics_reference,
)
from proxy.cli import _parser, main
from proxy.config.loader import load_config
from proxy.config.schema import Config
from proxy.edge._error_edge import METRICS
from proxy.edge.app import create_app
from tests.support.processes import ROOT

DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).with_name("mkdocs")
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


# --- the configuration reference --------------------------------------------------------------------------


class _Extra(BaseModel):
    new_key: int = Field(3, description="A key added to a model.")
    choice: str | None = Field(None, description="Another one, optional.")


class _Grown(Config):
    extra: _Extra = Field(default_factory=_Extra, description="A section added to the config.")


class _Undescribed(BaseModel):
    documented: int = Field(1, description="Has one.")
    bare: int = Field(2)


class _HasUndescribed(BaseModel):
    section: _Undescribed = Field(default_factory=_Undescribed, description="A section.")


def test_a_key_added_to_a_model_appears_in_the_reference_with_type_default_and_description() -> None:
    assert "extra.new_key" not in config_reference()
    reference = config_reference(_Grown)
    assert "## `extra`" in reference
    assert "| `extra.new_key` | int | `3` | - | A key added to a model. |" in reference  # no reload mark
    assert "| `extra.choice` | str or null | `null` | - | Another one, optional. |" in reference
    assert "| `listen.port` | int | `8080` |" in reference  # the rest of the config is still there


def test_a_key_without_a_description_fails_the_reference_and_so_the_build() -> None:
    with pytest.raises(MissingDescription, match=r"section\.bare has no description"):
        config_reference(_HasUndescribed)


def test_the_reference_walks_nested_keyed_and_union_sections() -> None:
    reference = config_reference()
    for heading in ("`tasks.default`", "`tasks.tools.<tool>`", "`security.jwt`", "`jobs.<start_tool>.status`"):
        assert f"### {heading}" in reference, heading
    keys = config_keys(Config)
    for key in ("upstream.url", "upstream.command", "upstream.max_sessions", "tasks.tools.<tool>.mode"):
        assert key in keys, key
        assert f"| `{key}` |" in reference, key
    assert "| `upstream.headers` | map of str to str | `{}` | restart | *With `url` only.*" in reference
    assert "| `upstream.max_processes` | int | `8` | restart | With `command`: server processes" in reference
    assert "| `upstream.url` | str | (none: setting it picks this kind) | restart | *With `url` only.*" in reference
    assert "| `upstream.max_concurrent_calls` | int | `0` | live |" in reference
    assert "| `tasks.default.on_restart` | one of `fail`, `rerun` | `fail` | live |" in reference  # as its section


# --- the command-line reference ----------------------------------------------------------------------------


def test_every_command_and_flag_of_the_parser_is_in_the_cli_reference() -> None:
    reference = cli_reference()
    entries = cli_entries(_parser())
    titles = [title for title, _ in entries]
    for expected in ("mcp-tasks-proxy serve", "mcp-tasks-proxy tasks purge", "mcp-tasks-proxy probe"):
        assert expected in titles, expected
    for title, names in entries:
        section = reference.split(f"`{title}`", 1)[1]
        for name in names:
            assert f"`{name}`" in section, f"{title}: {name}"
    assert "| `--upstream` `URL` | legacy MCP endpoint (sets upstream.url, clears upstream.command) |" in reference


def test_a_flag_added_to_a_parser_appears_with_its_help() -> None:
    parser = argparse.ArgumentParser(prog="tool")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="run it")
    run.add_argument("--speed", type=int, default=3, help="how fast (default %(default)s)")
    reference = cli_reference(parser)
    assert "`tool run`" in reference
    assert "| `--speed` `SPEED` | how fast (default 3) |" in reference


# --- the metrics reference ---------------------------------------------------------------------------------


def test_every_metric_a_proxy_exposes_is_in_the_metrics_reference_with_its_type() -> None:
    app = create_app(Config.model_validate({"upstream": {"url": "http://127.0.0.1:9/mcp"}}))
    exposition = app[METRICS].render().decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE))
    # The client library adds a `<name>_created` gauge beside a counter or histogram without labels.
    created = {
        name
        for name in types
        if name.endswith("_created") and {(base := name.removesuffix("_created")), f"{base}_total"} & set(types)
    }
    types = {name: kind for name, kind in types.items() if name not in created}
    assert len(types) > 30
    reference = metrics_reference()
    for name, kind in types.items():
        shown = f"{name}_total" if kind == "counter" and not name.endswith("_total") else name
        assert re.search(rf"^\| `{shown}`[^|]* \| {kind} \|", reference, re.MULTILINE), name
    assert "| `mcp_tasks_proxy_requests_total` | counter | `era`, `method`, `outcome` |" in reference


# --- the pages and the site --------------------------------------------------------------------------------


def test_each_reference_page_carries_its_generated_reference() -> None:
    for page, name in (("configuration", "configuration"), ("cli", "cli"), ("metrics", "metrics")):
        text = (DOCS / "reference" / f"{page}.md").read_text()
        assert f"<!-- reference: {name} -->" in text, page
        assert "<!-- reference:" not in expand(text), page


def test_an_unknown_reference_name_fails() -> None:
    with pytest.raises(ValueError, match="unknown reference 'metrix'"):
        expand("# Page\n\n<!-- reference: metrix -->\n")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(config.parent), "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )


def _copy_tree(tmp_path: Path) -> Path:
    """mkdocs.yml, docs/, docsgen/, proxy/ and README.md in a directory of their own, to build and break."""
    tree = tmp_path / "tree"
    tree.mkdir(parents=True)
    shutil.copy(ROOT / "mkdocs.yml", tree)
    shutil.copy(ROOT / "README.md", tree)
    for name in ("docs", "docsgen", "proxy"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    return tree


@pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (pip install -e '.[dev]')")
def test_the_site_builds_strictly_with_the_generated_references(tmp_path: Path) -> None:
    tree = _copy_tree(tmp_path)
    built = _build(tree / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr
    configuration = (tmp_path / "site" / "reference" / "configuration" / "index.html").read_text()
    assert "<code>tasks.default.sync_window_ms</code>" in configuration
    assert (
        "<code>mcp_tasks_proxy_tasks_created_total</code>"
        in (tmp_path / "site" / "reference" / "metrics" / "index.html").read_text()
    )
    assert "<code>--older-than</code>" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()


@pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (pip install -e '.[dev]')")
def test_a_broken_anchor_or_an_undescribed_key_fails_the_build(tmp_path: Path) -> None:
    tree = _copy_tree(tmp_path)
    glossary = tree / "docs" / "glossary.md"
    glossary.write_text(glossary.read_text() + "\nSee [nowhere](guides/tasks.md#no-such-heading).\n")
    built = _build(tree / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-heading" in built.stderr

    tree = _copy_tree(tmp_path / "again")
    config = tree / "proxy" / "config" / "schema.py"
    source = config.read_text()
    undescribed = source.replace('        description="TCP port the proxy listens on (0 picks a free port).",\n', "")
    assert undescribed != source
    config.write_text(undescribed)
    built = _build(tree / "mkdocs.yml", tmp_path / "again" / "site")
    assert built.returncode != 0
    assert "listen.port has no description" in built.stderr


# --- examples that work as pasted --------------------------------------------------------------------------

FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SECRET_KEYS = {"key_file", "secret_file", "password_file", "token_file"}


def config_examples() -> list[tuple[str, str]]:
    """(where, text) of every fenced block in README.md and docs/ that is a proxy config: one whose first line
    is `# proxy.yaml`, or YAML whose top-level keys are all config sections."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            body = match.group(2)
            marked = body.startswith("# proxy.yaml")
            try:
                loaded = yaml.safe_load(body)
            except yaml.YAMLError:
                loaded = None
            sections = isinstance(loaded, dict) and loaded and set(loaded) <= set(Config.model_fields)
            if marked or sections:
                line = text[: match.start()].count("\n") + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", body))
    return found


def _with_secret_files(value: Any, tmp_path: Path) -> Any:
    """The example with each key, token or password file it names (a deployment's own secret, such as a
    mounted Secret) replaced by one made here: the rest is loaded exactly as shown."""
    if isinstance(value, dict):
        replaced = {}
        for key, item in value.items():
            if key in SECRET_KEYS and isinstance(item, str):
                secret = tmp_path / f"secret-{len(list(tmp_path.iterdir()))}"
                secret.write_text("k" * 48)
                secret.chmod(0o600)
                replaced[key] = str(secret)
            else:
                replaced[key] = _with_secret_files(item, tmp_path)
        return replaced
    return value


def test_the_docs_show_config_examples() -> None:
    places = [where for where, _ in config_examples()]
    assert len(places) >= 5, places
    assert any(where.startswith("README.md") for where in places), places
    assert any("guides/tasks.md" in where for where in places), places


@pytest.mark.parametrize(("where", "body"), config_examples(), ids=[where for where, _ in config_examples()])
def test_every_config_example_passes_check_config(
    where: str, body: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(_with_secret_files(yaml.safe_load(body), tmp_path)))
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    load_config(path, environ={})


# --- the README's links and its quickstart ------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as mkdocs makes it (Python-Markdown's `slugify`; GitHub's agrees for these pages)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(heading) for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_every_link_in_the_readme_reaches_a_page_and_its_heading() -> None:
    links = [link for link in LINK.findall((ROOT / "README.md").read_text()) if "://" not in link]
    assert len(links) > 20
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), link
        if anchor:
            assert anchor in _anchors(target), link


def _block_after(text: str, start: int, language: str) -> tuple[str, int]:
    opening = text.index(f"```{language}\n", start) + len(language) + 4
    closing = text.index("```\n", opening)
    return text[opening:closing], closing


def _fragments_in_order(expected: str, actual: str) -> bool:
    """Whether `actual` starts with the expected line's first piece and holds each following piece (those
    between the `…`) in the same order."""
    pieces = expected.split("…")
    if not actual.startswith(pieces[0]):
        return False
    position = len(pieces[0])
    for piece in pieces[1:]:
        found = actual.find(piece, position)
        if found < 0:
            return False
        position = found + len(piece)
    return actual.endswith(pieces[-1])


def _quickstart() -> tuple[str, str, str]:
    """The README's URL quickstart: (the text before it, its shell lines, the expected output)."""
    readme = (ROOT / "README.md").read_text()
    marker = readme.index("<!-- quickstart: url -->")
    script, after = _block_after(readme, marker, "sh")
    expected, _ = _block_after(readme, after, "text")
    return readme[:marker], script, expected


async def _run_quickstart(script: str, proxy_url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert "URL=http://127.0.0.1:8080/mcp\n" in script
    return await asyncio.to_thread(
        subprocess.run,
        ["sh", "-c", script.replace("http://127.0.0.1:8080/mcp", proxy_url)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _answers_as_shown(ran: subprocess.CompletedProcess[str], expected: str) -> None:
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    wanted = expected.splitlines()
    assert len(lines) == len(wanted) == 5, ran.stdout
    for line, shape in zip(lines, wanted, strict=True):
        assert _fragments_in_order(shape, line), f"{line}\n  does not match\n{shape}"
    task_ids = {json.loads(line)["result"]["taskId"] for line in lines[2:]}
    assert len(task_ids) == 1  # the id captured from the first answer is the one polled


@pytest.mark.skipif(shutil.which("curl") is None, reason="the quickstart uses curl")
async def test_the_readme_url_quickstart_answers_as_it_says(tmp_path: Path) -> None:
    from tests.support.processes import ProxyProcess, Upstream

    before, script, expected = _quickstart()
    assert "mcp-tasks-proxy serve --upstream http://127.0.0.1:9000/mcp\n" in before
    upstream = Upstream()
    upstream.start()
    proxy = ProxyProcess(tmp_path, upstream.url)
    try:
        await proxy.start()
        ran = await _run_quickstart(script, proxy.url, tmp_path)
    finally:
        proxy.stop()
        upstream.stop()
    _answers_as_shown(ran, expected)


@pytest.mark.skipif(shutil.which("curl") is None, reason="the quickstart uses curl")
async def test_the_readme_stdio_quickstart_answers_like_the_url_one(tmp_path: Path) -> None:
    """`serve -- CMD ARGS` with the README's example server as the command, from the repository's root."""
    import aiohttp

    from tests.support.processes import free_port
    from tests.support.waiting import until

    _, script, expected = _quickstart()
    readme = (ROOT / "README.md").read_text()
    assert ".venv/bin/mcp-tasks-proxy serve -- .venv/bin/python -m tests.upstream --stdio\n" in readme
    port = free_port()
    serve = [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--db", str(tmp_path / "tasks.db")]
    with (tmp_path / "proxy.log").open("wb") as log:
        process = await asyncio.to_thread(
            subprocess.Popen,
            [*serve, "--", sys.executable, "-m", "tests.upstream", "--stdio"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "MCP_TASKS_PROXY_OBSERVABILITY__PORT": "0"},  # never a port in use
        )
    try:
        async with aiohttp.ClientSession() as http:

            async def healthy() -> bool:
                assert process.poll() is None, (tmp_path / "proxy.log").read_text()
                try:
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await until(healthy, "the proxy did not start", 20)
        ran = await _run_quickstart(script, f"http://127.0.0.1:{port}/mcp", tmp_path)
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)
    _answers_as_shown(ran, expected)


def test_the_shape_check_fails_on_a_different_answer() -> None:
    shape = '{"result":{"status":"completed",…,"text":"slept 5"…}}'
    assert _fragments_in_order(shape, '{"result":{"status":"completed","x":1,"text":"slept 5","y":2}}')
    assert not _fragments_in_order(shape, '{"result":{"status":"working","x":1,"text":"slept 5","y":2}}')
    assert not _fragments_in_order(shape, '{"result":{"status":"completed","text":"slept 4"}}')
