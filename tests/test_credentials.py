"""The parts of `upstream.credentials` alone: the config's rules, the secrets map (what it refuses, a reload that
keeps the map in force), the token client's reading of what an endpoint answers (a real aiohttp endpoint on
loopback answering what each test says), the exchange's renewal (by exchange, by refresh, a rotated refresh
token, none), and the grants table with its hold on both store backends.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.credentials import CredentialsConfig, ExchangeConfig
from proxy.config.loader import ConfigError, load_config
from proxy.errors import CredentialRefusedError, CredentialUnavailableError, NoCredentialError
from proxy.principals import Identity, Principals
from proxy.tasks.services.grants import StoreGrants
from proxy.tasks.store import SqliteTaskStore, TaskStore
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.upstream.credentials import Exchange, Secrets
from proxy.upstream.credentials._secrets import SecretsError, read_map
from proxy.upstream.credentials._token_client import MAX_RESPONSE_BYTES, TokenClient
from proxy.wire.tasks import TaskStatus
from tests.support.records import make_record

ISSUER = "https://issuer.example"
JWT = {"jwks_file": "/nonexistent/jwks.json", "issuer": ISSUER}


def _load(**sections: Any) -> None:
    load_config(None, environ={}, overrides=sections)


# --- config ------------------------------------------------------------------------------------------------------


def test_credentials_config_refuses_what_cannot_work() -> None:
    exchange = {"token_url": "https://sso.example/token", "client_id": "p", "client_secret_file": "/s"}
    with pytest.raises(ConfigError, match=r"set security\.jwt"):
        _load(upstream={"url": "http://up/mcp", "credentials": {"mode": "exchange", "exchange": exchange}})
    with pytest.raises(ConfigError, match="use mode: secrets"):
        _load(
            upstream={"command": ["x"], "credentials": {"mode": "exchange", "exchange": exchange}},
            security={"jwt": JWT},
        )
    with pytest.raises(ConfigError, match="exactly one issuer"):
        _load(
            upstream={"url": "http://up/mcp", "credentials": {"mode": "secrets", "secrets": {"path": "/s"}}},
            security={"jwt": {**JWT, "issuer": [ISSUER, "https://other.example"]}},
        )
    with pytest.raises(ValueError, match="https"):
        ExchangeConfig.model_validate({**exchange, "token_url": "http://sso.example/token"})
    with pytest.raises(ValueError, match="exactly one of client_secret_file and private_key_jwt"):
        ExchangeConfig.model_validate({**exchange, "private_key_jwt": {"key_file": "/k"}})
    with pytest.raises(ValueError, match="scope tokens"):
        ExchangeConfig.model_validate({**exchange, "scope": "a  b"})
    with pytest.raises(ValueError, match="exchange section"):
        CredentialsConfig.model_validate("exchange")
    assert CredentialsConfig.model_validate("forward").forwards
    assert ExchangeConfig.model_validate({**exchange, "token_url": "http://127.0.0.1:9/token"}).token_url


# --- the secrets map ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "entry", "problem"),
    [
        ("headers", {"X Key": "s3cr3t-1"}, "not an HTTP header name"),
        ("headers", {"X-Key": "s3cr3t-2\r\nInjected: 1"}, "control character"),
        ("environment", {"1TOKEN": "s3cr3t-3"}, "not an environment variable name"),
        ("environment", {"TOKEN": "s3cr3t\0-4"}, "NUL"),
    ],
)
def test_a_map_with_an_entry_that_cannot_be_written_is_refused_naming_no_value(
    kind: Any, entry: dict[str, str], problem: str, tmp_path: Path
) -> None:
    path = tmp_path / "users.yaml"
    path.write_text(json.dumps({"alice": entry}))
    with pytest.raises(SecretsError, match=problem) as refused:
        read_map(str(path), kind)
    assert "'alice'" in str(refused.value)
    assert all(value not in str(refused.value) for value in entry.values())


async def test_secrets_refuse_an_unknown_caller_and_keep_the_map_in_force_when_a_reload_is_bad(tmp_path: Path) -> None:
    users = tmp_path / "users"
    users.mkdir()
    (users / "alice").write_text("X-Key: a1\n")
    (users / ".hidden").write_text("X-Key: nobody\n")
    secrets = Secrets(str(users), "headers")
    alice = Identity("Bearer t", owner=json.dumps([ISSUER, "alice"]))
    assert await secrets.headers(alice) == {"X-Key": "a1"}
    with pytest.raises(NoCredentialError):
        await secrets.headers(Identity("Bearer t", owner=json.dumps([ISSUER, ".hidden"])))
    with pytest.raises(CredentialRefusedError):
        await secrets.headers(Identity("Bearer t"))  # not verified: no owner
    (users / "alice").write_text("X-Key: [not, text]\n")
    assert not await secrets.map.reload("test")
    assert await secrets.headers(alice) == {"X-Key": "a1"}
    (users / "alice").write_text("X-Key: a2\n")
    assert await secrets.map.reload("test")
    assert await secrets.headers(alice) == {"X-Key": "a2"}
    assert secrets.version() == 1


# --- the token client and the exchange ---------------------------------------------------------------------------

Answer = Callable[[dict[str, str]], web.Response]


class Endpoint:
    """A token endpoint on loopback answering what `answer` says; `forms` holds what it received."""

    def __init__(self) -> None:
        self.forms: list[dict[str, str]] = []
        self.answer: Answer = lambda form: web.json_response({"error": "server_error"}, status=500)

    async def token(self, request: web.Request) -> web.Response:
        form = {key: str(value) for key, value in (await request.post()).items()}
        self.forms.append(form)
        return self.answer(form)


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[Endpoint, str]]:
    served = Endpoint()
    app = web.Application()
    app.router.add_post("/token", served.token)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield served, str(server.make_url("/token"))
    await server.close()


def exchange_of(url: str, grants: Any = None, clock: Callable[[], float] = time.time) -> Exchange:
    config = ExchangeConfig(token_url=url, client_id="proxy", client_secret_file="/s", audience="up", timeout_seconds=1)
    return Exchange(config, Principals(b"k" * 32, keep_owner=True), TokenClient(config, "s", None, None), grants, clock)


def caller(expires_in: float = 600) -> Identity:
    return Identity("Bearer a.b.c", owner=json.dumps([ISSUER, "alice"]), expires_at=time.time() + expires_in)


def issued(access: str, expires_in: int = 600, refresh: str | None = None, **extra: Any) -> Answer:
    body: dict[str, Any] = {"access_token": access, "token_type": "Bearer", "expires_in": expires_in, **extra}
    if refresh is not None:
        body["refresh_token"] = refresh
    return lambda form: web.json_response(body)


@pytest.mark.parametrize(
    ("answer", "refused"),
    [
        (lambda form: web.json_response({"error": "invalid_scope"}, status=400), CredentialRefusedError),
        (lambda form: web.json_response({"error": "invalid_target"}, status=400), CredentialRefusedError),
        (lambda form: web.json_response({"error": "invalid_client"}, status=401), CredentialUnavailableError),
        (lambda form: web.json_response({"error": "unauthorized_client"}, status=400), CredentialUnavailableError),
        (lambda form: web.Response(status=502), CredentialUnavailableError),
        (issued("has space"), CredentialUnavailableError),
        (issued("t", token_type="mac"), CredentialUnavailableError),
        (issued("t", expires_in=0), CredentialUnavailableError),
        (lambda form: web.json_response({"access_token": "t" * MAX_RESPONSE_BYTES}), CredentialUnavailableError),
        (lambda form: web.Response(text="<html>", content_type="text/html"), CredentialUnavailableError),
    ],
)
async def test_what_the_endpoint_answers_is_checked_and_classified_naming_no_token(
    answer: Answer, refused: type[Exception], endpoint: tuple[Endpoint, str]
) -> None:
    served, url = endpoint
    served.answer = answer
    with pytest.raises(refused) as caught:
        await exchange_of(url).headers(caller())
    assert "a.b.c" not in str(caught.value)
    if isinstance(caught.value, CredentialRefusedError):
        assert caught.value.status == 401
        assert caught.value.data["error"] in ("invalid_scope", "invalid_target")
    else:
        assert caught.value.status == 503  # type: ignore[attr-defined]


async def test_the_exchange_sends_the_callers_token_and_renews_by_refresh_once_it_expired(
    endpoint: tuple[Endpoint, str],
) -> None:
    served, url = endpoint
    now = [time.time()]
    exchange = exchange_of(url, clock=lambda: now[0])
    identity = Identity("Bearer a.b.c", owner=json.dumps([ISSUER, "alice"]), expires_at=now[0] + 60)
    served.answer = issued("first", expires_in=100, refresh="r1")
    assert await exchange.headers(identity) == {"authorization": "Bearer first"}
    exchange_form = served.forms[-1]
    assert exchange_form["subject_token"] == "a.b.c"
    assert exchange_form["subject_token_type"] == "urn:ietf:params:oauth:token-type:access_token"
    assert exchange_form["audience"] == "up"
    assert await exchange.headers(identity) == {"authorization": "Bearer first"}
    assert len(served.forms) == 1  # cached
    now[0] += 200  # both the caller's token and the exchanged one expired: the refresh token renews it
    served.answer = issued("second", expires_in=100)  # no new refresh token: the old one serves on
    assert await exchange.headers(identity) == {"authorization": "Bearer second"}
    assert served.forms[-1] == {"grant_type": "refresh_token", "refresh_token": "r1"}
    now[0] += 200
    served.answer = lambda form: web.json_response({"error": "invalid_grant"}, status=400)
    with pytest.raises(CredentialRefusedError, match="can no longer be renewed"):
        await exchange.headers(identity)


async def test_without_a_refresh_token_an_expired_credential_cannot_be_renewed(endpoint: tuple[Endpoint, str]) -> None:
    served, url = endpoint
    now = [time.time()]
    exchange = exchange_of(url, clock=lambda: now[0])
    served.answer = issued("only", expires_in=100)
    identity = Identity("Bearer a.b.c", owner=json.dumps([ISSUER, "alice"]), expires_at=now[0] + 60)
    await exchange.headers(identity)
    now[0] += 200
    with pytest.raises(CredentialRefusedError, match="gave no refresh token"):
        await exchange.headers(identity)


async def test_a_tools_own_target_gets_a_token_exchanged_for_it(endpoint: tuple[Endpoint, str]) -> None:
    served, url = endpoint
    config = ExchangeConfig.model_validate(
        {
            "token_url": url,
            "client_id": "proxy",
            "client_secret_file": "/s",
            "audience": "up",
            "tools": {"report": {"audience": "reports"}, "admin_*": {"audience": "up", "scope": "admin"}},
        }
    )
    exchange = Exchange(config, Principals(b"k" * 32, keep_owner=True), TokenClient(config, "s", None, None), None)
    served.answer = lambda form: web.json_response(
        {
            "access_token": f"{form.get('audience')}.{form.get('scope', 'none')}",
            "token_type": "Bearer",
            "expires_in": 60,
        }
    )
    assert await exchange.headers(caller(), "report") == {"authorization": "Bearer reports.none"}
    assert await exchange.headers(caller(), "admin_reset") == {"authorization": "Bearer up.admin"}
    assert await exchange.headers(caller(), "echo") == {"authorization": "Bearer up.none"}
    assert await exchange.headers(caller(), None) == {"authorization": "Bearer up.none"}
    assert len(served.forms) == 3  # one exchange per target, each cached


# --- the grants table, on both backends --------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[TaskStore]:
    opened: TaskStore
    if request.param == "sqlite":
        opened = await SqliteTaskStore.open(tmp_path / "tasks.db", max_records=100)
    else:
        opened = await PostgresTaskStore.open(request.getfixturevalue("pg_dsn"), max_records=100)
    yield opened
    await opened.close()


async def test_a_grant_is_held_by_one_refresher_at_a_time_and_lives_while_a_task_of_its_caller_does(
    store: TaskStore,
) -> None:
    grants = StoreGrants(lambda: store)
    assert await grants.write_grant("alice", "t", "sealed-1", 1000, None)
    assert await grants.lock_grant("alice", "t", "replica-a", until_ms=5000, now_ms=1000) == "sealed-1"
    assert await grants.lock_grant("alice", "t", "replica-b", until_ms=6000, now_ms=2000) is None  # held by a
    assert not await grants.write_grant("alice", "t", "sealed-b", 2000, "replica-b")  # b holds nothing
    assert await grants.write_grant("alice", "t", "sealed-2", 3000, "replica-a")  # a's renewal, and its hold ends
    assert await grants.lock_grant("alice", "t", "replica-b", until_ms=9000, now_ms=3000) == "sealed-2"
    assert await grants.lock_grant("alice", "t", "replica-a", until_ms=9999, now_ms=9000) == "sealed-2"  # b's lapsed
    await grants.unlock_grant("alice", "t", "replica-a")
    assert await grants.read_grant("alice", "t") == "sealed-2"
    assert await grants.lock_grant("bob", "t", "replica-a", until_ms=1, now_ms=0) is None  # no grant: nothing held

    await store.records.create(make_record("task-a", principal="alice"))
    assert await grants.drop_grants("alice") == 0  # its task is live
    await store.records.settle("task-a", TaskStatus.COMPLETED, now_ms=2_000)
    assert await grants.drop_grants("alice") == 1
    assert await grants.read_grant("alice", "t") is None
    await grants.write_grant("carol", "t", "sealed", 1, None)
    assert await store.grants.purge_grants() == 1  # no live task of carol anywhere: the sweep erases it
