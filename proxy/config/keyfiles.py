"""The files the configuration names and the proxy reads: the deployment key, the key that signs `requestState`
and the PostgreSQL password; `problems` checks them at load (an unmounted Secret fails the start), `read_secret`
and `read_password` read them. Imports nothing from the proxy."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Final

MIN_SECRET_BYTES: Final = 32  # a key file's shortest usable content


def read_password(path: str) -> str:
    """The password in a file, without its line ending; ValueError if unreadable or empty."""
    try:
        password = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not password:
        raise ValueError(f"{path} is empty")
    return password


def read_secret(path: str) -> bytes:
    """The bytes of a key file, surrounding whitespace removed; ValueError if unreadable or too short."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} needed")
    return secret


def read_token(path: str) -> str:
    """A bearer token in a file (`read_secret`'s rules), as text that fits an Authorization header and a URL
    query unescaped: visible ASCII letters, digits and `-._~` only; ValueError otherwise."""
    token = read_secret(path)
    if not all(chr(byte).isalnum() or chr(byte) in "-._~" for byte in token) or not token.isascii():
        raise ValueError(f"{path} must hold only ASCII letters, digits and -._~ (e.g. openssl rand -hex 32)")
    return token.decode("ascii")


FILES: Final[tuple[tuple[str, str, Callable[[str], object]], ...]] = (
    ("security", "key_file", read_secret),
    ("admin", "token_file", read_token),
    ("store", "password_file", read_password),
    ("inputs", "secret_file", read_secret),
)


def problems(
    data: Mapping[str, Any], absent: list[str] | None = None, files: Collection[str] | None = None
) -> list[str]:
    """Each named file that cannot be used, as `section.field: why`, from the configuration as it was read
    (before or without the schema: a problem elsewhere does not hide these). With `absent`, a file that does not
    exist at all (a Secret mounted only in the pod) goes there as a note instead (`section.field: read at start:
    file … not found here`); one that exists and is unusable is still a problem. `files`: only these
    (`section.field`), for a command that reads no other; None: all."""
    found = []
    for section, field, read in FILES:
        if files is not None and f"{section}.{field}" not in files:
            continue
        fields = data.get(section)
        path = fields.get(field) if isinstance(fields, Mapping) else None
        if isinstance(path, str):
            if absent is not None and not Path(path).exists():
                absent.append(f"{section}.{field}: read at start: file {path} not found here")
                continue
            try:
                read(path)
            except ValueError as exc:
                found.append(f"{section}.{field}: {exc}")
    return found
