"""Who a caller is, as the proxy keeps it: a keyed hash for ownership, and a sealed copy of the credential for
the one case that needs it back.

A task belongs to the HMAC-SHA256 of the caller's principal header under the deployment key, so a stolen
database does not let anyone confirm a token they hold (a bare SHA-256 would). A task with
`on_restart: rerun` must present the caller's header upstream again after a restart; that value is stored
encrypted (Fernet, from `cryptography`) under a key derived from the same deployment key. Pure: no I/O but
reading or creating the key file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Final

from cryptography.fernet import Fernet, InvalidToken

from proxy.config import Config
from proxy.keyfiles import MIN_SECRET_BYTES, read_secret

_HASH_CONTEXT: Final = b"mcp-tasks-proxy/principal/v1"
_SEAL_CONTEXT: Final = b"mcp-tasks-proxy/rerun-principal/v1"


class SealError(ValueError):
    """A sealed principal cannot be opened with this key (the key changed, or the value is not ours)."""


class Principals:
    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the deployment key needs at least {MIN_SECRET_BYTES} bytes")
        self._hash_key = hmac.new(key, _HASH_CONTEXT, hashlib.sha256).digest()
        seal_key = hmac.new(key, _SEAL_CONTEXT, hashlib.sha256).digest()
        self._fernet = Fernet(base64.urlsafe_b64encode(seal_key))

    def key_of(self, principal: str | None) -> str:
        """The stored owner of what the caller creates; "" for a caller without a principal."""
        if not principal:
            return ""
        return hmac.new(self._hash_key, principal.encode(), hashlib.sha256).hexdigest()

    def seal(self, principal: str) -> str:
        return self._fernet.encrypt(principal.encode()).decode()

    def unseal(self, sealed: str) -> str:
        try:
            return self._fernet.decrypt(sealed.encode()).decode()
        except (InvalidToken, ValueError):
            raise SealError("the stored credential cannot be decrypted with the current deployment key") from None


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
