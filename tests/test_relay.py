"""The relay's routing decision (which paths go to the upstream's origin, and where), without a network."""

from __future__ import annotations

import pytest

from proxy.config.schema import RelayConfig
from proxy.edge._relay import OriginRelay, relayed_shown
from proxy.principals import Identity, Principals


def test_a_target_keeps_the_path_and_query_as_encoded_on_the_upstreams_origin() -> None:
    relay = OriginRelay(RelayConfig(), "http://127.0.0.1:9000/mcp", None)
    target = relay.target("/.well-known/oauth-protected-resource/mcp?x=%2F&y=1")
    assert str(target) == "http://127.0.0.1:9000/.well-known/oauth-protected-resource/mcp?x=%2F&y=1"


@pytest.mark.parametrize("raw_path", ["//evil.example/x", "http://evil.example/x", "evil"])
def test_a_target_that_could_name_another_host_is_not_relayed(raw_path: str) -> None:
    relay = OriginRelay(RelayConfig(), "http://127.0.0.1:9000/mcp", None)
    assert relay.target(raw_path) is None


def test_by_default_only_the_well_known_documents_are_relayed() -> None:
    default = OriginRelay(RelayConfig(), "http://u/mcp", None)
    assert default.relays("/.well-known/oauth-protected-resource/mcp")
    assert default.relays("/.well-known/oauth-authorization-server")
    for path in ("/anything", "/admin.html", "/", "/.well-knownx", "/token"):
        assert not default.relays(path), path


def test_prefixes_replace_the_list_an_empty_one_relays_nothing_and_a_slash_everything() -> None:
    narrowed = OriginRelay(RelayConfig(prefixes=["/.well-known/", "/token"]), "http://u/mcp", None)
    assert narrowed.relays("/.well-known/openid-configuration")
    assert narrowed.relays("/token")
    assert not narrowed.relays("/static/page.html")
    nothing = OriginRelay(RelayConfig(prefixes=[]), "http://u/mcp", None)
    assert not nothing.relays("/.well-known/oauth-protected-resource/mcp")
    everything = OriginRelay(RelayConfig(prefixes=["/"]), "http://u/mcp", None)
    assert everything.relays("/anything")
    assert everything.relays("/admin.html")
    assert not OriginRelay(RelayConfig(enabled=False), "http://u/mcp", None).relays("/.well-known/x")


def test_the_start_line_says_what_is_relayed() -> None:
    learned = "the authorization endpoints its metadata names, when the upstream requires credentials"
    assert relayed_shown(RelayConfig(), has_origin=True) == ["/.well-known/*", learned]
    assert relayed_shown(RelayConfig(prefixes=[]), has_origin=True) == []
    assert relayed_shown(RelayConfig(prefixes=["/"]), has_origin=True) == ["/*"]
    assert relayed_shown(RelayConfig(prefixes=["/.well-known/oauth-protected-resource"]), has_origin=True) == [
        "/.well-known/oauth-protected-resource*"
    ]
    assert relayed_shown(RelayConfig(enabled=False), has_origin=True) == []
    assert relayed_shown(RelayConfig(), has_origin=False) == []  # a stdio server has no origin


def test_a_verified_credential_owns_as_its_owner_and_never_as_a_header_value() -> None:
    principals = Principals(b"k" * 32)
    first = Identity("Bearer first-token", owner='["https://issuer", "alice"]')
    refreshed = Identity("Bearer refreshed-token", owner='["https://issuer", "alice"]')
    assert principals.key_of(first) == principals.key_of(refreshed)
    assert principals.key_of(first) != principals.key_of(Identity("Bearer first-token"))
    assert principals.key_of(first) != principals.key_of(Identity('["https://issuer", "alice"]'))
    other = Identity("Bearer first-token", owner='["https://issuer", "bob"]')
    assert principals.key_of(other) != principals.key_of(first)
