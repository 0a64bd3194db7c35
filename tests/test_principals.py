"""principals.py and the security switches around it: keyed hashes of principals, sealed re-run credentials,
the deployment key, anonymous callers.

Unit tests first (no loop), then the proxy on loopback in front of the real fixture upstream, with its real
SQLite file read back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from proxy.config.loader import ConfigError, load_config
from proxy.edge.app import create_app
from proxy.principals import Identity, Principals, SealError, deployment_key, identity_of, principal_key
from tests.support.clients import Tasks, upstream_calls_open
from tests.support.processes import Upstream, key_file, proxy_config
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.wire import modern_body, modern_headers, policies, read_messages

KEY = b"k" * 32
URL = "http://127.0.0.1:9/mcp"


def test_principals_are_keyed_hashes_not_bare_sha256() -> None:
    principals = Principals(KEY)
    token = "Bearer secret-token"
    stored = principals.key_of(Identity(token))
    assert stored == principals.key_of(Identity(token))  # stable: the owner finds its tasks again
    assert stored != hashlib.sha256(token.encode()).hexdigest()  # a token holder cannot recompute it
    assert stored != Principals(b"o" * 32).key_of(Identity(token))  # another deployment key, another hash
    assert "secret" not in stored
    assert principals.key_of(None) == principals.key_of(identity_of("")) == ""


def test_the_owner_key_is_the_hmac_of_the_credential_or_of_a_verified_owner() -> None:
    hash_key = hmac.new(KEY, b"mcp-tasks-proxy/principal/v1", hashlib.sha256).digest()
    opaque = hmac.new(hash_key, b"Bearer secret-token", hashlib.sha256).hexdigest()
    assert Principals(KEY).key_of(Identity("Bearer secret-token")) == opaque
    owner = '["https://issuer", "alice"]'
    verified = hmac.new(hash_key, b"owner\0" + owner.encode(), hashlib.sha256).hexdigest()
    assert Principals(KEY).key_of(Identity("Bearer first-token", owner=owner)) == verified
    assert Principals(KEY).key_of(Identity("Bearer refreshed-token", owner=owner)) == verified


def test_the_session_key_is_the_sha256_of_the_raw_credential_whoever_owns_it() -> None:
    owner = '["https://issuer", "alice"]'
    first, refreshed = Identity("Bearer first-token", owner=owner), Identity("Bearer refreshed-token", owner=owner)
    assert principal_key(first) == hashlib.sha256(b"Bearer first-token").hexdigest()
    assert principal_key(first) == principal_key(Identity("Bearer first-token"))  # the owner plays no part
    assert principal_key(refreshed) == hashlib.sha256(b"Bearer refreshed-token").hexdigest()
    assert principal_key(first) != principal_key(refreshed)  # a new token never reuses the old one's sessions
    assert Principals(KEY).key_of(first) == Principals(KEY).key_of(refreshed)  # but owns the same tasks
    assert principal_key(None) == ""


def test_an_identity_is_a_value_that_keeps_its_owner() -> None:
    verified = Identity("Bearer a.b.c", owner="https://issuer sub:alice")
    assert verified == Identity("Bearer a.b.c", owner="https://issuer sub:alice")
    assert verified != Identity("Bearer a.b.c")
    with pytest.raises(dataclasses.FrozenInstanceError):
        verified.owner = None  # type: ignore[misc]
    assert identity_of("Bearer opaque") == Identity("Bearer opaque", owner=None)
    assert identity_of("") is None
    assert identity_of(None) is None
    with pytest.raises(ValueError, match="anonymous"):
        Identity("")
    assert "a.b.c" not in repr(verified)  # the credential is a secret: no repr (log line, traceback) shows it
    assert "sub:alice" in repr(verified)


def test_a_sealed_credential_opens_only_with_its_key() -> None:
    principals = Principals(KEY)
    sealed = principals.seal("Bearer secret-token")
    assert "secret" not in sealed
    assert principals.unseal(sealed) == "Bearer secret-token"
    with pytest.raises(SealError):
        Principals(b"o" * 32).unseal(sealed)
    with pytest.raises(SealError):
        principals.unseal("Bearer secret-token")  # a plaintext value left by an older version
    with pytest.raises(ValueError, match="32 bytes"):
        Principals(b"short")


def test_without_a_configured_key_one_is_kept_beside_the_database(tmp_path: Path) -> None:
    config = load_config(
        None, environ={}, overrides={"upstream": {"url": URL}, "store": {"path": str(tmp_path / "db" / "t.db")}}
    )
    first = deployment_key(config)
    path = tmp_path / "db" / "t.db.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert deployment_key(config) == first  # the next start reads it back
    configured = load_config(
        None,
        environ={},
        overrides={"upstream": {"url": URL}, "security": {"key_file": key_file(tmp_path)}},
    )
    assert deployment_key(configured) == Path(key_file(tmp_path)).read_bytes().strip()


def test_rerun_and_a_shared_store_need_a_configured_key() -> None:
    base: dict[str, Any] = {"upstream": {"url": URL}}
    with pytest.raises(ConfigError, match=r"tasks\.tools\.batch_\*: on_restart: rerun .* security\.key_file"):
        load_config(None, environ={}, overrides={**base, "tasks": {"tools": {"batch_*": {"on_restart": "rerun"}}}})
    with pytest.raises(ConfigError, match=r"store\.url: .* shared deployment key"):
        load_config(None, environ={}, overrides={**base, "store": {"url": "postgresql://db/tasks"}})


async def test_tasks_store_hashes_and_a_rerun_credential_encrypted(
    make_proxy: Callable[..., Any],
    own_upstream: Upstream,
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
    tmp_path: Path,
) -> None:
    database = tmp_path / "principals.db"
    sections = {
        "store": {"path": str(database)},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(counted={"mode": "required", "on_restart": "rerun"}),
    }
    client = Tasks(await make_proxy(own_upstream.url, **sections), modern_schema, tasks_schema)
    token = "Bearer plaintext-credential"
    task_id = await client.create("counted", {"key": "sealed", "seconds": 30}, headers={"Authorization": token})
    await upstream_calls_open(client.client, 1)
    with sqlite3.connect(database) as connection:
        principal, sealed = connection.execute(
            "SELECT principal, rerun_principal FROM tasks WHERE task_id = ?", (task_id,)
        ).fetchone()
    key = load_config(None, environ={}, overrides={"upstream": {"url": URL}, **sections})
    assert principal == Principals(deployment_key(key)).key_of(Identity(token))
    assert "plaintext-credential" not in sealed
    assert (await client.task(task_id, headers={"Authorization": token}))["status"] == "working"


async def test_anonymous_callers_are_refused_with_401_when_configured(
    make_proxy: Callable[..., Any], upstream: Upstream
) -> None:
    client = await make_proxy(upstream.url, security={"anonymous": "refuse"})
    for headers in ({}, {"Authorization": ""}):  # an empty value counts as none
        response = await client.post(
            "/mcp", json=modern_body("tools/list", {}), headers={**modern_headers("tools/list"), **headers}
        )
        [message] = await read_messages(response)
        assert response.status == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert message["error"]["code"] == -32600
    response = await client.post(
        "/mcp",
        json=modern_body("tools/list", {}),
        headers={**modern_headers("tools/list"), "Authorization": "Bearer a"},
    )
    assert response.status == 200


def test_anonymous_callers_on_a_non_loopback_listener_are_warned_about(tmp_path: Path) -> None:
    for host, warned in (("0.0.0.0", True), ("127.0.0.1", False), ("::1", False)):
        config = proxy_config(URL, tmp_path, listen={"host": host})
        with structlog.testing.capture_logs() as events:
            create_app(config)
        assert [event["event"] for event in events].count("anonymous_callers_allowed") == int(warned), host
    refusing = proxy_config(URL, tmp_path, listen={"host": "0.0.0.0"}, security={"anonymous": "refuse"})
    with structlog.testing.capture_logs() as events:
        create_app(refusing)
    assert "anonymous_callers_allowed" not in [event["event"] for event in events]
