"""A real headless browser for the tests: Debian's chromium, each run with a new profile. `dump_dom(url)` is the
DOM after loading `url` (redirects and cookies followed); `Browser` drives one page over the DevTools protocol
(a websocket, with aiohttp) to navigate, read the DOM and click. Tests skip when /usr/bin/chromium is absent."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Final

import aiohttp

from tests.support.waiting import until

CHROMIUM: Final = Path("/usr/bin/chromium")
FLAGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """Chromium and every process it started (renderers, the crash handler), which write into the profile until
    they exit: the profile can be removed only once the whole process group is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    await process.wait()

    def group_gone() -> bool:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        return False

    await until(group_gone, "chromium's processes outlived it", 10)


async def dump_dom(url: str, timeout_seconds: float = 60) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            str(CHROMIUM),
            *FLAGS,
            f"--user-data-dir={profile}",
            "--dump-dom",
            url,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, stopped whole by _stop
        )
        try:
            out, _ = await asyncio.wait_for(process.communicate(), timeout_seconds)
        finally:
            await _stop(process)
    return out.decode()


# What DevTools answers a read of a page that a navigation replaced meanwhile (its own refresh, a click).
NAVIGATED: Final = "Inspected target navigated or closed"


class DevToolsError(Exception):
    """DevTools answered a command with an error (its message, whole)."""


class Browser:
    """One chromium with remote debugging on a free port, and its first page's DevTools session."""

    def __init__(self) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-")
        self._process: asyncio.subprocess.Process | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        profile = Path(self._profile.name)
        self._process = await asyncio.create_subprocess_exec(
            str(CHROMIUM),
            *FLAGS,
            f"--user-data-dir={profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",  # chromium picks one and writes it to DevToolsActivePort
            "about:blank",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, stopped whole by _stop
        )
        active = profile / "DevToolsActivePort"
        await until(lambda: active.exists() and len(active.read_text().splitlines()) >= 2, "chromium never started", 30)
        port = active.read_text().splitlines()[0]
        self._http = aiohttp.ClientSession()

        async def page() -> str | None:
            async with self._http.get(f"http://127.0.0.1:{port}/json/list") as response:  # type: ignore[union-attr]
                targets = await response.json()
            urls = [target["webSocketDebuggerUrl"] for target in targets if target.get("type") == "page"]
            return urls[0] if urls else None

        self._ws = await self._http.ws_connect(await until(page, "chromium opened no page", 30), max_msg_size=0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._process is not None:
            await _stop(self._process)
        self._profile.cleanup()

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        call_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads((await asyncio.wait_for(self._ws.receive(), 30)).data)
            if message.get("id") == call_id:
                if "error" in message:
                    raise DevToolsError(message)
                result: dict[str, Any] = message["result"]
                return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def html(self) -> str:
        """The page's HTML once it has loaded; "" while it loads or navigates (a page that refreshes itself, or a
        click's navigation, can replace it mid-read), so a caller polls with `until`."""
        try:
            value = await self.evaluate("document.readyState === 'complete' ? document.documentElement.outerHTML : ''")
        except DevToolsError as exc:
            if NAVIGATED not in str(exc):
                raise
            return ""
        return str(value or "")
