"""The admin listener: a second aiohttp site on its own port (never the MCP one), off unless `admin.port` is set:
the tasks as JSON and as pages (each task linked to its own, reloading themselves), with a cancel, behind a bearer
token or the cookie it sets. No argument, credential or result shown unless `admin.show_results`. Imports
aiohttp's web side, the store and the views."""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final
from urllib.parse import quote, urlencode

import structlog
from aiohttp import web

from proxy.config.keyfiles import read_token
from proxy.config.schema import AdminConfig
from proxy.operators import _views as task_views
from proxy.tasks.store import StoreError, TaskStore
from proxy.wire.jsonrpc import RawJSON
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

PREFIX: Final = "/admin"
COOKIE: Final = "mcp_tasks_proxy_admin"
_PAGE_LIMIT: Final = 200  # tasks on the page
REFRESH_SECONDS: Final = 5  # how often the pages reload themselves
# The page loads nothing, runs no script and is framed by no one; its forms post only to itself.
_PAGE_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION: Final = web.RequestKey("admin_session", bool)  # signed in by the cookie (forms need their token too)


def admin_url(config: AdminConfig, token: str) -> str:
    """Where a browser signs in once: the page, with the token in the query (it is swapped for a cookie)."""
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.port}{PREFIX}/?{urlencode({'token': token})}"


class Admin:
    """The admin app and its site. `start()` after the store is open, `stop()` before it closes.

    `GET /admin/tasks` (the CLI's filters, JSON), `GET /admin/tasks/{id}`, `POST /admin/tasks/{id}/cancel`, and `GET
    /admin/`, a server-rendered page listing tasks with a cancel button. Every route needs the bearer token
    (`admin.token_file`, compared in constant time) or the session cookie that `/admin/?token=…` sets (HttpOnly,
    SameSite=Strict, so no other site's form can carry it; the page's forms also carry a token derived from it). No
    argument, credential or result is shown unless `admin.show_results`. Imports aiohttp's web side, the store and
    `task_views`; nothing of the runner or the front."""

    def __init__(self, config: AdminConfig, store: TaskStore, clock: Callable[[], int]) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self._token = read_token(config.token_file or "").encode()
        self._session = hmac.new(self._token, b"admin session", hashlib.sha256).hexdigest()
        self._form = hmac.new(self._token, b"admin form", hashlib.sha256).hexdigest()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=16 * 1024)
        app.router.add_get(f"{PREFIX}/", self.page)
        app.router.add_get(f"{PREFIX}/tasks", self.list_tasks)
        app.router.add_get(f"{PREFIX}/tasks/{{task_id}}", self.show_task)
        app.router.add_post(f"{PREFIX}/tasks/{{task_id}}/cancel", self.cancel_task)
        return app

    async def start(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve on `sockets` when the serve loop bound them already, else bind `admin.host` and `admin.port`."""
        runner = self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None)
        await runner.setup()
        sites: list[web.BaseSite] = [web.SockSite(runner, sock) for sock in sockets or []]
        if not sites:
            sites.append(web.TCPSite(runner, self.config.host, self.config.port))
        for site in sites:
            await site.start()
        self.port = runner.addresses[0][1]
        log.info("admin_listening", host=self.config.host, port=self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- sign-in --------------------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        offered = request.query.get("token")
        if offered is not None and request.method == "GET" and request.path == f"{PREFIX}/":
            if not hmac.compare_digest(offered.encode(), self._token):
                raise web.HTTPUnauthorized(text="the admin token is wrong\n")
            response = web.HTTPSeeOther(f"{PREFIX}/")  # the clean URL: the token leaves the address bar
            response.set_cookie(COOKIE, self._session, httponly=True, samesite="Strict", path=PREFIX)
            response.headers.update(_PAGE_HEADERS)
            raise response
        bearer = request.headers.get("Authorization", "")
        if bearer.startswith("Bearer ") and hmac.compare_digest(bearer[7:].encode(), self._token):
            request[SESSION] = False
            return await handler(request)
        if hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), self._session.encode()):
            request[SESSION] = True
            return await handler(request)
        raise web.HTTPUnauthorized(
            text="sign in with the admin token: Authorization: Bearer …, or open `mcp-tasks-proxy tasks admin-url`\n",
            headers={"WWW-Authenticate": 'Bearer realm="mcp-tasks-proxy admin"'},
        )

    # --- the API --------------------------------------------------------------------------------------------

    def _query(self, request: web.Request, limit: int) -> Any:
        filters = request.query
        try:
            return task_views.query(
                self.clock(),
                statuses=filters.getall("status", []),
                tool=filters.get("tool"),
                principal=filters.get("principal"),
                older_than_seconds=_duration(filters.get("older_than")),
                younger_than_seconds=_duration(filters.get("younger_than")),
                limit=int(filters.get("limit", limit)),
                after=filters.get("after"),
            )
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None

    async def list_tasks(self, request: web.Request) -> web.Response:
        query = self._query(request, 50)
        records = await self._store(self.store.operators.list_tasks(query))
        return web.json_response(task_views.page(records, query, self.clock()))

    async def show_task(self, request: web.Request) -> web.Response:
        """One task: JSON for the API, a page for a browser (which asks for HTML first, as the page's links do)."""
        record = await self._store(self.store.records.get(request.match_info["task_id"]))
        if record is None:
            raise web.HTTPNotFound(text="no such task\n")
        if _wants_html(request):
            return self._task_page(record)
        return web.json_response(self._detail(record))

    def _detail(self, record: TaskRecord) -> dict[str, Any]:
        shown = task_views.summary(record, self.clock())
        shown["inputKeys"] = sorted(record.input_requests) if isinstance(record.input_requests, dict) else []
        if self.config.show_results:
            result = record.result.value() if isinstance(record.result, RawJSON) else record.result
            shown.update(result=result, error=record.error)
        return shown

    async def cancel_task(self, request: web.Request) -> web.StreamResponse:
        task_id = request.match_info["task_id"]
        from_page = request[SESSION]
        if from_page:  # a browser's form: its token too (the SameSite=Strict cookie alone already stops CSRF)
            form = await request.post()
            if not hmac.compare_digest(str(form.get("form", "")).encode(), self._form.encode()):
                raise web.HTTPForbidden(text="the form's token is wrong: reload the page\n")
        now_ms = self.clock()
        cancelled = await self._store(
            self.store.operators.cancel_task(task_id, task_views.OPERATOR_CANCEL_MESSAGE, now_ms=now_ms)
        )
        record = cancelled or await self._store(self.store.records.get(task_id))
        if record is None:
            raise web.HTTPNotFound(text="no such task\n")
        log.info("task_cancelled_by_operator", task_id=task_id, cancelled=cancelled is not None)
        if from_page:
            raise web.HTTPSeeOther(f"{PREFIX}/", headers=_PAGE_HEADERS)
        return web.json_response({"taskId": task_id, "status": record.status.value, "cancelled": cancelled is not None})

    async def _store(self, work: Awaitable[Any]) -> Any:
        try:
            return await work
        except StoreError as exc:
            raise web.HTTPServiceUnavailable(text=f"the task store cannot be read: {exc}\n") from None

    # --- the page -------------------------------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.Response:
        query = self._query(request, _PAGE_LIMIT)
        records = await self._store(self.store.operators.list_tasks(query))
        now_ms = self.clock()
        rows = "\n".join(self._row(record, now_ms) for record in records) or ('<tr><td colspan="6">no tasks</td></tr>')
        filters = " ".join(f'<a href="{PREFIX}/?status={status}">{status}</a>' for status in task_views.STATUSES)
        body = _PAGE.format(
            head=_head("mcp-tasks-proxy: tasks"),
            rows=rows,
            filters=filters,
            count=len(records),
            at=html.escape(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now_ms / 1000))),
            refresh=REFRESH_SECONDS,
        )
        return web.Response(text=body, content_type="text/html", charset="utf-8", headers=_PAGE_HEADERS)

    def _row(self, record: TaskRecord, now_ms: int) -> str:
        task_id = html.escape(record.task_id)
        result = ""
        if self.config.show_results and record.status.terminal:
            detail = self._detail(record)
            result = html.escape(str(detail.get("result") if detail.get("result") is not None else detail.get("error")))
        return (
            f'<tr id="{task_id}" class="{record.status.value}">'
            f'<td><a href="{_task_href(record.task_id)}"><code>{task_id}</code></a></td>'
            f"<td>{record.status.value}</td><td>{html.escape(record.tool)}</td>{_age_cell(record, now_ms)}"
            f"<td>{html.escape(record.status_message or '')}{'<br>' + result if result else ''}</td>"
            f"<td>{self._cancel_form(record)}</td></tr>"
        )

    def _cancel_form(self, record: TaskRecord) -> str:
        """The cancel button of a live task (its form carries the page's token); nothing for a settled one."""
        if record.status not in (TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED):
            return ""
        action = html.escape(f"{_task_href(record.task_id)}/cancel")
        return (
            f'<form method="post" action="{action}" data-task="{html.escape(record.task_id)}">'
            f'<input type="hidden" name="form" value="{self._form}">'
            '<button type="submit">cancel</button></form>'
        )

    def _task_page(self, record: TaskRecord) -> web.Response:
        """One task's page: what the API shows of it, and its cancel button while it runs."""
        now_ms = self.clock()
        shown = self._detail(record)
        rows = "\n".join(
            f"<tr><th>{html.escape(key)}</th><td><code>{html.escape(_shown(value))}</code></td></tr>"
            for key, value in shown.items()
            if value is not None
        )
        body = _TASK_PAGE.format(
            head=_head(f"mcp-tasks-proxy: task {html.escape(record.task_id)}"),
            task_id=html.escape(record.task_id),
            status=record.status.value,
            age=task_views.age_text(max(0, now_ms - record.created_at_ms) // 1000),
            rows=rows,
            cancel=self._cancel_form(record),
            refresh=REFRESH_SECONDS,
        )
        return web.Response(text=body, content_type="text/html", charset="utf-8", headers=_PAGE_HEADERS)


def _duration(text: str | None) -> float | None:
    return None if text is None else task_views.duration_seconds(text)


def _task_href(task_id: str) -> str:
    return html.escape(f"{PREFIX}/tasks/{quote(task_id, safe='')}")


def _age_cell(record: TaskRecord, now_ms: int) -> str:
    """The age as people read it, the creation time on hover."""
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.created_at_ms / 1000))
    age = task_views.age_text(max(0, now_ms - record.created_at_ms) // 1000)
    return f'<td title="created {html.escape(created)}">{age}</td>'


def _shown(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _wants_html(request: web.Request) -> bool:
    """A browser's request (HTML before JSON in its Accept), not the API's."""
    accept = request.headers.get("Accept", "")
    return "text/html" in accept and accept.find("text/html") < (
        accept.find("application/json") if "application/json" in accept else len(accept)
    )


def _head(title: str) -> str:
    return f'<meta charset="utf-8"><title>{title}</title>'


_STYLE: Final = """<style>body{font-family:system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse}
td,th{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left;vertical-align:top}
.working,.input_required{background:#fffbe6}.failed{background:#fff0f0}</style>"""
# The pages refresh themselves (a meta refresh: the page runs no script); a cancel redirects to the list.
_PAGE: Final = (
    """<!doctype html>
<html lang="en"><head>{head}<meta http-equiv="refresh" content="{refresh}">"""
    + _STYLE.replace("{", "{{").replace("}", "}}")
    + """</head>
<body><h1>Tasks</h1>
<p>{count} newest tasks at {at} (this page refreshes every {refresh} s). Show: <a href="/admin/">all</a>
{filters}</p>
<table><thead><tr><th>task</th><th>state</th><th>tool</th><th>age</th><th>message</th><th></th></tr></thead>
<tbody>
{rows}
</tbody></table></body></html>
"""
)
_TASK_PAGE: Final = (
    """<!doctype html>
<html lang="en"><head>{head}<meta http-equiv="refresh" content="{refresh}">"""
    + _STYLE.replace("{", "{{").replace("}", "}}")
    + """</head>
<body><p><a href="/admin/">all tasks</a></p><h1>Task <code>{task_id}</code></h1>
<p class="{status}">{status}, {age} old (this page refreshes every {refresh} s) {cancel}</p>
<table><tbody>
{rows}
</tbody></table></body></html>
"""
)
