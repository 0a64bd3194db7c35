"""The admin listener, against a proxy in front of the legacy fixture upstream on loopback: its API answers only
with the bearer token; the page signs a real headless chromium in with `/admin/?token=…` (an HttpOnly,
SameSite=Strict cookie, then the clean URL), lists the tasks with their ages as people read them, links each to
a page of its own, reloads itself, and a click on a task's cancel button ends it (the upstream call is
cancelled). Nothing of a task's arguments or result is shown unless `admin.show_results`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.cli import main
from proxy.edge._app_keys import ADMIN
from tests.support.browser import CHROMIUM, Browser, dump_dom
from tests.support.clients import ClientFactory, Tasks
from tests.support.processes import Upstream, free_port
from tests.support.sdk import connect, text
from tests.support.waiting import until

SECRET = "s3cr3t-admin-41c9"
TOOLS: dict[str, Any] = {"tools": {"sleep": {"mode": "required"}, "echo": {"mode": "required"}}}


@pytest.fixture
def token() -> str:
    return os.urandom(32).hex()


@pytest.fixture
def token_file(tmp_path: Path, token: str) -> Path:
    path = tmp_path / "admin.token"
    path.write_text(token + "\n")
    return path


def admin_section(token_file: Path, **more: Any) -> dict[str, Any]:
    return {"port": free_port(), "token_file": str(token_file), **more}


async def cancelled_upstream(url: str) -> int:
    async with connect(url) as conn:
        return len(json.loads(text(await conn.session.call_tool("cancelled_requests", {}))))


async def tasks_running(client: Tasks, own_upstream: Upstream) -> tuple[str, str]:
    """A completed echo task (its argument holds SECRET) and a running sleep task."""
    done = await client.create("echo", {"text": f"{SECRET}-argument"})
    await client.until(done, lambda task: task["status"] == "completed")
    running = await client.create("sleep", {"seconds": 60})
    return done, running


async def test_the_api_answers_only_with_the_token_and_cancels_a_task(
    tasks_client: ClientFactory, own_upstream: Upstream, token_file: Path, token: str, http: aiohttp.ClientSession
) -> None:
    client = await tasks_client(own_upstream.url, tasks=TOOLS, admin=admin_section(token_file))
    admin = client.client.app[ADMIN]
    assert admin.port != client.client.port  # its own port, never the MCP one
    base = f"http://127.0.0.1:{admin.port}/admin"
    done, running = await tasks_running(client, own_upstream)
    bearer = {"Authorization": f"Bearer {token}"}

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}, {"Cookie": "x=1"}):
        async with http.get(f"{base}/tasks", headers=headers) as response:
            assert response.status == 401, headers
        async with http.post(f"{base}/tasks/{running}/cancel", headers=headers) as response:
            assert response.status == 401, headers
    async with http.get(f"{base}/", params={"token": "wrong"}) as response:
        assert response.status == 401
    async with http.get(f"http://127.0.0.1:{client.client.port}/admin/tasks", headers=bearer) as response:
        assert response.status != 200  # the MCP port serves no admin route

    async with http.get(f"{base}/tasks", headers=bearer) as response:
        assert response.status == 200
        listed = await response.json()
    assert [task["taskId"] for task in listed["tasks"]] == [running, done]
    assert SECRET not in json.dumps(listed)
    async with http.get(f"{base}/tasks", params={"status": "working"}, headers=bearer) as response:
        assert [task["taskId"] for task in (await response.json())["tasks"]] == [running]
    async with http.get(f"{base}/tasks", params={"status": "done"}, headers=bearer) as response:
        assert response.status == 400
    async with http.get(f"{base}/tasks/{done}", headers=bearer) as response:
        shown = await response.json()
    assert (shown["status"], shown["tool"]) == ("completed", "echo")
    assert "result" not in shown  # admin.show_results is off
    async with http.get(f"{base}/tasks/task_never", headers=bearer) as response:
        assert response.status == 404

    before = await cancelled_upstream(own_upstream.url)
    async with http.post(f"{base}/tasks/{running}/cancel", headers=bearer) as response:
        assert response.status == 200
        assert await response.json() == {"taskId": running, "status": "cancelled", "cancelled": True}
    seen = await client.task(running)
    assert (seen["status"], seen["statusMessage"]) == ("cancelled", "cancelled by an operator")

    async def stopped_upstream() -> bool:
        return await cancelled_upstream(own_upstream.url) > before

    await until(stopped_upstream, "the upstream call was never cancelled")
    async with http.post(f"{base}/tasks/{done}/cancel", headers=bearer) as response:
        assert await response.json() == {"taskId": done, "status": "completed", "cancelled": False}


async def test_show_results_puts_results_on_the_api(
    tasks_client: ClientFactory, own_upstream: Upstream, token_file: Path, token: str, http: aiohttp.ClientSession
) -> None:
    client = await tasks_client(own_upstream.url, tasks=TOOLS, admin=admin_section(token_file, show_results=True))
    done = await client.create("echo", {"text": "shown"})
    await client.until(done, lambda task: task["status"] == "completed")
    bearer = {"Authorization": f"Bearer {token}"}
    async with http.get(f"http://127.0.0.1:{client.client.app[ADMIN].port}/admin/tasks/{done}", headers=bearer) as r:
        assert (await r.json())["result"]["content"][0]["text"] == "shown"


def test_admin_url_prints_the_sign_in_url(
    tmp_path: Path, token_file: Path, token: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text(
        yaml.safe_dump(
            {"upstream": {"url": "http://127.0.0.1:1/mcp"}, "admin": {"port": 9091, "token_file": str(token_file)}}
        )
    )
    assert main(["tasks", "admin-url", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == f"http://127.0.0.1:9091/admin/?token={token}"
    config.write_text(yaml.safe_dump({"upstream": {"url": "http://127.0.0.1:1/mcp"}}))
    assert main(["tasks", "admin-url", "--config", str(config)]) == 1
    assert "no admin.port" in capsys.readouterr().err


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)")
async def test_the_page_in_a_real_browser_lists_the_tasks_and_cancels_one(
    tasks_client: ClientFactory, own_upstream: Upstream, token_file: Path, token: str, http: aiohttp.ClientSession
) -> None:
    client = await tasks_client(own_upstream.url, tasks=TOOLS, admin=admin_section(token_file))
    done, running = await tasks_running(client, own_upstream)
    url = f"http://127.0.0.1:{client.client.app[ADMIN].port}/admin/?token={token}"

    dom = await dump_dom(url)  # signed in by the redirect's cookie, the clean page rendered
    assert f'id="{running}"' in dom
    assert f'id="{done}"' in dom
    assert "sleep" in dom
    assert SECRET not in dom  # no argument, no result
    assert dom.count("<button") == 1  # only the live task can be cancelled
    async with http.get(url.split("?")[0]) as response:
        assert response.status == 401  # the page itself needs the cookie

    before = await cancelled_upstream(own_upstream.url)
    async with Browser() as browser:
        await browser.navigate(url)

        async def page_with_task() -> str | None:
            page = await browser.html()
            return page if f'data-task="{running}"' in page else None

        await until(page_with_task, "the page never listed the running task", 30)
        assert await browser.evaluate("location.search") == ""  # the token left the address bar
        assert await browser.evaluate("document.cookie") == ""  # HttpOnly: no script reads the session
        await browser.evaluate(f"document.querySelector('form[data-task=\"{running}\"] button').click()")

        async def cancelled_on_the_page() -> bool:
            page = await browser.html()
            return f'<tr id="{running}" class="cancelled">' in page

        await until(cancelled_on_the_page, "the page never showed the task cancelled", 30)
    assert (await client.task(running))["status"] == "cancelled"

    async def stopped_upstream() -> bool:
        return await cancelled_upstream(own_upstream.url) > before

    await until(stopped_upstream, "the upstream call was never cancelled")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no chromium here (apt-get install chromium)")
async def test_the_page_links_each_task_refreshes_itself_and_shows_ages_as_people_read_them(
    tasks_client: ClientFactory, own_upstream: Upstream, token_file: Path, token: str, http: aiohttp.ClientSession
) -> None:
    client = await tasks_client(own_upstream.url, tasks=TOOLS, admin=admin_section(token_file))
    done, running = await tasks_running(client, own_upstream)
    base = f"http://127.0.0.1:{client.client.app[ADMIN].port}/admin"
    async with Browser() as browser:
        await browser.navigate(f"{base}/?token={token}")

        async def listed() -> str | None:
            page = await browser.html()
            return page if f'data-task="{running}"' in page else None

        page = await until(listed, "the page never listed the running task", 30)
        assert '<meta http-equiv="refresh" content="5">' in page
        ages = re.findall(r'<td title="created [^"]+ UTC">([^<]+)</td>', page)
        assert len(ages) == 2
        assert all(re.fullmatch(r"\d+s|\d+m\d\ds", age) for age in ages), ages
        # Each task's id is a link to its own page, which refreshes too.
        await browser.evaluate(f"document.querySelector('tr[id=\"{running}\"] a').click()")

        async def on_its_page() -> str | None:
            page = await browser.html()
            return page if f"Task <code>{running}</code>" in page and "working" in page else None

        await until(on_its_page, "the link never led to the task's page", 30)
        assert SECRET not in await browser.html()
        # Cancelled elsewhere (the API): the page shows it by itself, with no navigation.
        bearer = {"Authorization": f"Bearer {token}"}
        async with http.post(f"{base}/tasks/{running}/cancel", headers=bearer) as response:
            assert response.status == 200

        async def shown_cancelled() -> bool:
            page = await browser.html()
            return f"Task <code>{running}</code>" in page and '<p class="cancelled">cancelled' in page

        await until(shown_cancelled, "the task's page never refreshed to show the cancel", 30)
    async with http.get(f"{base}/tasks/{done}", headers=bearer) as response:  # the API still answers JSON
        assert response.content_type == "application/json"
        assert (await response.json())["status"] == "completed"


async def test_a_form_post_without_the_pages_token_is_refused(
    tasks_client: ClientFactory, own_upstream: Upstream, token_file: Path, token: str
) -> None:
    """The cookie alone (which SameSite=Strict already keeps off other sites' forms) does not cancel."""
    client = await tasks_client(own_upstream.url, tasks=TOOLS, admin=admin_section(token_file))
    running = await client.create("sleep", {"seconds": 60})
    base = f"http://127.0.0.1:{client.client.app[ADMIN].port}/admin"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        async with browser.get(f"{base}/", params={"token": token}) as response:
            assert response.status == 200
            assert response.history[0].status == 303
            cookie = response.history[0].headers["Set-Cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        async with browser.post(f"{base}/tasks/{running}/cancel", data={"form": "forged"}) as response:
            assert response.status == 403
    assert (await client.task(running))["status"] == "working"


def test_the_admin_port_must_not_be_the_mcp_port_and_needs_a_token(tmp_path: Path, token_file: Path) -> None:
    from proxy.config.loader import ConfigError, load_config

    base: dict[str, Any] = {"upstream": {"url": "http://127.0.0.1:1/mcp"}, "listen": {"port": 9000}}
    with pytest.raises(ConfigError, match=r"must differ from listen\.port"):
        load_config(None, environ={}, overrides={**base, "admin": {"port": 9000, "token_file": str(token_file)}})
    with pytest.raises(ConfigError, match=r"needs admin\.token_file"):
        load_config(None, environ={}, overrides={**base, "admin": {"port": 9001}})
    short = tmp_path / "short.token"
    short.write_text("abc")
    with pytest.raises(ConfigError, match=r"admin\.token_file"):
        load_config(None, environ={}, overrides={**base, "admin": {"port": 9001, "token_file": str(short)}})
