"""The webhook client: one signed POST to a callback (Standard Webhooks, by the `standardwebhooks` package),
hardened against being aimed inside. Imports aiohttp's client, `standardwebhooks` and the model; nothing of
the front or the store."""

from __future__ import annotations

import hmac
import ipaddress
import json
import secrets
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import aiohttp
import structlog
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from standardwebhooks.webhooks import Webhook

from proxy.events import model
from proxy.wire.fields import check_fields

log = structlog.get_logger(__name__)

MAX_ANSWER_BYTES: Final = 8192  # of a receiver's answer, read at most (the challenge's echo is all we need)


class BlockedAddressError(OSError):
    """The callback's host resolved to an address deliveries must not reach."""


class _CheckedResolver(AbstractResolver):
    """Resolves with the default resolver, then refuses the whole answer if any address is not globally
    routable: a name that mixes public and private addresses is not one to deliver to."""

    def __init__(self, allow_private: Callable[[], bool]) -> None:
        self._resolver = DefaultResolver()
        self._allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        if not self._allow_private():
            for entry in found:
                if not model.routable(ipaddress.ip_address(entry["host"])):
                    raise BlockedAddressError(f"{host} resolves to an address that is not globally routable")
        return found

    async def close(self) -> None:
        await self._resolver.close()


@dataclass(frozen=True, slots=True)
class Answer:
    """What one POST came to: the receiver's status (None when none came) and the failure category, if any."""

    status: int | None
    failure: str | None
    body: bytes = b""

    @property
    def accepted(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def signature(keys: Sequence[str], message_id: str, timestamp: int, body: str) -> str:
    """The `webhook-signature` value: one `v1,` signature per secret (several during a rotation)."""
    at = datetime.fromtimestamp(timestamp, UTC)
    return " ".join(Webhook(key).sign(message_id, at, body) for key in keys)


def signed_headers(
    keys: Sequence[str], message_id: str, subscription_id: str, timestamp: int, body: str
) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(keys, message_id, timestamp, body),
        "X-MCP-Subscription-Id": subscription_id,
    }
    check_fields(headers.items())  # the ids came from the store; a value that would split a header is never written
    return headers


class WebhookClient:
    """Each connection resolves the callback's host itself and checks every address it got against the IANA special-
    purpose registries (unless private callbacks are allowed) before connecting to one of them, with the original
    host in `Host` and TLS SNI: the address checked is the address connected to, so a name that changes between the
    subscribe and the delivery (DNS rebinding) gains nothing. No redirect is followed, an answer's body is read only
    up to a small cap, and every header written is checked first."""

    def __init__(self, allow_private: Callable[[], bool], timeout_seconds: Callable[[], float]) -> None:
        self._allow_private = allow_private
        self._timeout = timeout_seconds
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=_CheckedResolver(self._allow_private), use_dns_cache=False, limit=256, limit_per_host=8
            )
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False
            )
        return self._session

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        """POST `body`; never raises for what the receiver or the network did (the category says it)."""
        timeout = aiohttp.ClientTimeout(total=self._timeout())
        try:
            async with self._open().post(
                url, data=body, headers=dict(headers), allow_redirects=False, timeout=timeout
            ) as response:
                answer = await _capped(response.content)
                return Answer(
                    response.status, None if 200 <= response.status < 300 else model.category(response.status), answer
                )
        except BlockedAddressError as exc:
            log.warning("event_callback_address_refused", reason=str(exc))
            return Answer(None, model.CONNECTION_REFUSED)
        except TimeoutError:
            return Answer(None, model.TIMEOUT)
        except (aiohttp.ClientSSLError, ssl.SSLError):
            return Answer(None, model.TLS_ERROR)
        except (aiohttp.ClientError, OSError, ValueError):
            return Answer(None, model.CONNECTION_REFUSED)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


async def _capped(content: Any) -> bytes:
    """At most MAX_ANSWER_BYTES of an answer's body; the rest is never read (the connection is not reused)."""
    chunks: list[bytes] = []
    size = 0
    while size < MAX_ANSWER_BYTES:
        chunk = await content.read(MAX_ANSWER_BYTES - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


async def challenge(
    client: WebhookClient, url: str, subscription_id: str, keys: Sequence[str], nonce: str, now_seconds: int
) -> str | None:
    """POST the `verification` envelope (`webhook-id` `msg_verification_<random>`); None when the endpoint echoed
    the nonce in a 2xx body (compared in constant time), else the failure category (`challenge_failed` for a
    reachable endpoint that did not)."""
    body = model.canonical_json({"type": "verification", "challenge": nonce})
    message_id = f"msg_verification_{secrets_token()}"
    headers = signed_headers(keys, message_id, subscription_id, now_seconds, body)
    answer = await client.post(url, body.encode(), headers)
    if answer.failure is not None and answer.status is None:
        return answer.failure
    if not answer.accepted:
        return model.CHALLENGE_FAILED
    try:
        echoed = json.loads(answer.body)
    except ValueError:
        return model.CHALLENGE_FAILED
    got = echoed.get("challenge") if isinstance(echoed, dict) else None
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), nonce.encode()):
        return model.CHALLENGE_FAILED
    return None


def secrets_token() -> str:
    return secrets.token_urlsafe(18)
