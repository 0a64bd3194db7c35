"""Who a caller is (`Identity`), its keyed hash (tasks' owner), a plain hash of its credential (the upstream
sessions' key) and a sealed copy of it (re-runs); the deployment key. Pure: no I/O but reading or creating the
key file."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from cryptography.fernet import Fernet, InvalidToken

from proxy.config.keyfiles import MIN_SECRET_BYTES, read_secret
from proxy.config.schema import Config

# A task belongs to the HMAC-SHA256 of the caller's principal header (or of a verified JWT's owner) under the
# deployment key, so a stolen database does not let anyone confirm a token they hold (a bare SHA-256 would). The
# upstream sessions, which live only in the process, are keyed by the SHA-256 of the header (`principal_key`). A task
# with `on_restart: rerun` must present the caller's header upstream again after a restart; that value is stored
# encrypted (Fernet, from `cryptography`) under a key derived from the same deployment key. Pure: no I/O but reading
# or creating the key file.

_HASH_CONTEXT: Final = b"mcp-tasks-proxy/principal/v1"
_SEAL_CONTEXT: Final = b"mcp-tasks-proxy/rerun-principal/v1"
_CALLBACK_CONTEXT: Final = b"mcp-tasks-proxy/event-callback-secret/v1"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who sent a request: the principal header's value (`credential`), which travels upstream as itself (with
    `upstream.credentials: forward`) and keys the caller's upstream sessions, and, for a Bearer JWT the proxy
    verified (`edge/_jwt_identity.py`), its `owner` (the issuer and the claim, a JSON array), which owns tasks in
    the credential's stead: the caller's next token, of the same owner, reads the same tasks; `expires_at` is
    that token's `exp`. An opaque token (or a JWT not verified) has no owner. A task's owner restored after a
    restart has no credential in hand (`Principals.restore`): only its owner."""

    credential: str = field(repr=False)  # a secret: never in a repr, hence in no log line or traceback
    owner: str | None = None
    expires_at: float | None = None  # epoch seconds; None: not known (an opaque token)

    def __post_init__(self) -> None:
        if not self.credential and self.owner is None:
            raise ValueError("an identity has a credential: a caller without one is anonymous (None)")

    @property
    def claim(self) -> str | None:
        """The verified claim's value (`security.jwt.claim`) that names the caller within its issuer."""
        if self.owner is None:
            return None
        _issuer, claim = json.loads(self.owner)
        return str(claim)


def identity_of(header: str | None) -> Identity | None:
    """The identity a principal header's value names by itself (an opaque token, no owner); None when the
    header is absent or empty: such a caller is anonymous."""
    return Identity(header) if header else None


def principal_key(principal: Identity | None) -> str:
    """What the caller's upstream sessions are kept under (the pool's shares and spares, the tools it sees, the
    legacy session it opened): "" for an anonymous caller, else the SHA-256 of the raw credential, so tokens
    are not dict keys in clear.

    Not `Principals.key_of`, and not of the owner: a session sends the credential that opened it upstream, so a
    refreshed token (same owner, new credential) must never be served by a session opened with the old one.
    Unkeyed, as it never leaves the process; the owner key is stored with the tasks, hence keyed."""
    if principal is None:
        return ""
    return hashlib.sha256(principal.credential.encode()).hexdigest()


def owner_key(principal: Identity | None) -> str:
    """What the caller's upstream sessions are kept under when the proxy presents a credential of its own making
    for them (`upstream.credentials` exchange or secrets): the SHA-256 of the verified owner, so a refreshed
    token (same owner) keeps its sessions, and no raw header value can name an owner's (another hash space)."""
    if principal is None:
        return ""
    if principal.owner is None:
        return principal_key(principal)
    return hashlib.sha256(b"owner\0" + principal.owner.encode()).hexdigest()


class SealError(ValueError):
    """A sealed principal cannot be opened with this key (the key changed, or the value is not ours)."""


# A kept principal that is the verified owner (not the credential) says so before its sealed text: the marker is
# the store's, outside what is sealed, so no caller's header value can pass for an owner.
_OWNER_MARK: Final = "owner:"


class Principals:
    """The deployment key's uses for principals: their keyed hashes, and what a task keeps of its caller (sealed).
    `keep_owner`: a task keeps its caller's verified owner instead of the credential (the proxy mints upstream
    credentials itself, `upstream.credentials` exchange or secrets: the inbound token is not needed again)."""

    def __init__(self, key: bytes, *, keep_owner: bool = False) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the deployment key needs at least {MIN_SECRET_BYTES} bytes")
        self.keep_owner = keep_owner
        self._hash_key = hmac.new(key, _HASH_CONTEXT, hashlib.sha256).digest()
        seal_key = hmac.new(key, _SEAL_CONTEXT, hashlib.sha256).digest()
        self._fernet = Fernet(base64.urlsafe_b64encode(seal_key))
        callback_key = hmac.new(key, _CALLBACK_CONTEXT, hashlib.sha256).digest()
        self._callbacks = Fernet(base64.urlsafe_b64encode(callback_key))  # webhook secrets, under a key of their own

    def key_of(self, principal: Identity | None) -> str:
        """The stored owner of what the caller creates; "" for an anonymous caller. Keyed (HMAC-SHA256 under the
        deployment key), so a stolen store confirms no token; of a verified JWT's owner, hashed in a space of its
        own so no header value can take its place, so the caller's refreshed token owns the same tasks."""
        if principal is None:
            return ""
        if principal.owner is not None:
            return hmac.new(self._hash_key, b"owner\0" + principal.owner.encode(), hashlib.sha256).hexdigest()
        return hmac.new(self._hash_key, principal.credential.encode(), hashlib.sha256).hexdigest()

    def seal(self, credential: str) -> str:
        """The credential alone (an `Identity`'s owner is not kept), encrypted under the deployment key."""
        return self._fernet.encrypt(credential.encode()).decode()

    def unseal(self, sealed: str) -> str:
        try:
            return self._fernet.decrypt(sealed.encode()).decode()
        except (InvalidToken, ValueError):
            raise SealError("the stored credential cannot be decrypted with the current deployment key") from None

    def seal_callback_secret(self, secret: str) -> str:
        """An events webhook's signing secret, encrypted under the deployment key (stored so, never logged)."""
        return self._callbacks.encrypt(secret.encode()).decode()

    def unseal_callback_secret(self, sealed: str) -> str:
        try:
            return self._callbacks.decrypt(sealed.encode()).decode()
        except (InvalidToken, ValueError):
            raise SealError("a webhook secret cannot be decrypted with the current deployment key") from None

    def keep(self, principal: Identity) -> str:
        """What a task keeps of its caller to act for it again (a re-run, a follow after a restart): the sealed
        credential, or (`keep_owner`) the sealed verified owner."""
        if self.keep_owner and principal.owner is not None:
            return _OWNER_MARK + self.seal(principal.owner)
        return self.seal(principal.credential)

    def restore(self, kept: str) -> Identity | None:
        """The caller a task kept (`keep`); SealError when this key cannot open it."""
        if kept.startswith(_OWNER_MARK):
            return Identity("", owner=self.unseal(kept.removeprefix(_OWNER_MARK)))
        return identity_of(self.unseal(kept))


def deployment_key(config: Config) -> bytes:
    """`security.key_file`, else `inputs.secret_file`, else a key kept beside the SQLite database
    (`<store.path>.key`, created 0600 at the first start): the hashes of principals stay valid across restarts.
    A PostgreSQL store needs a configured key (the config check says so): replicas must share it."""
    configured = config.security.key_file or config.inputs.secret_file
    if configured is not None:
        return read_secret(configured)
    path = Path(f"{config.store.path}.key")
    try:
        return read_secret(str(path))
    except ValueError:
        if path.exists():
            raise
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_hex(MIN_SECRET_BYTES).encode()
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # written meanwhile by another start: use that one
        return read_secret(str(path))
    with os.fdopen(descriptor, "wb") as file:
        file.write(key)
    return key
