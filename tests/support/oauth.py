"""A token issuer for the OAuth tests: a signing key, its public JSON Web Key Set in a file, and tokens minted
with it (RS256 JWTs, as an authorization server would issue them)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

ISSUER = "https://issuer.example"


class Issuer:
    """A signing key, its public JSON Web Key Set in a file, and tokens minted with it."""

    def __init__(self, directory: Path, kid: str = "k1") -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = kid
        self.jwks_path = directory / "jwks.json"
        self.jwks_path.write_text(json.dumps(self.jwks()))

    def jwks(self) -> dict[str, Any]:
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**public, "kid": self.kid, "alg": "RS256", "use": "sig"}]}

    def token(self, subject: str = "alice", *, scope: str = "mcp", lifetime: float = 600, **extra: Any) -> str:
        payload = claims(subject, scope=scope, exp=int(time.time() + lifetime), **extra)
        return jwt.encode(payload, self.key, algorithm="RS256", headers={"kid": self.kid})

    def public_pem(self) -> bytes:
        return self.key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


def _segment(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def handmade(header: dict[str, Any], payload: dict[str, Any], secret: bytes | None) -> str:
    """A JWT assembled by hand, as an attacker would: `secret` None leaves the signature empty (`alg: none`),
    else it is an HMAC-SHA256 under `secret` (e.g. the issuer's public key, for algorithm confusion)."""
    signing_input = f"{_segment(json.dumps(header).encode())}.{_segment(json.dumps(payload).encode())}"
    signature = b"" if secret is None else hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{_segment(signature)}"


def claims(subject: str = "alice", **extra: Any) -> dict[str, Any]:
    now = int(time.time())
    return {"iss": ISSUER, "sub": subject, "scope": "mcp", "iat": now, "exp": now + 600, **extra}
