"""`python -m benchmarks.oauth [--quick]`: what `security.jwt` costs.

1. JWT verification per request with the issuer's keys cached (CPU time in this process): a token seen for the
   first time (signature checked), and the same token again (remembered until it expires).
2. The proxy's added latency for an authenticated modern call (Bearer JWT, `security.jwt` on) beside an
   unauthenticated one, both against the legacy client talking to the lean upstream directly, interleaved.

Prints the rows and writes `benchmarks/results/oauth.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from benchmarks.harness import LegacyClient, ModernClient, interleaved, measure, start_proxy, start_upstream
from benchmarks.loadgen import HttpClient, Response
from proxy.config.schema import JwtConfig
from proxy.edge._jwt_identity import JwtIdentity

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "oauth.json"
ISSUER = "https://issuer.example"


def key_set(directory: Path) -> tuple[rsa.RSAPrivateKey, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    path = directory / "jwks.json"
    path.write_text(json.dumps({"keys": [{**public, "kid": "k1", "alg": "RS256"}]}))
    return key, path


def token(key: rsa.RSAPrivateKey, subject: str) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "sub": subject, "iat": now, "exp": now + 3600}
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "k1"})


async def verification_rows(directory: Path, quick: bool) -> list[dict[str, Any]]:
    key, path = key_set(directory)
    config = JwtConfig(jwks_file=str(path), issuer=[ISSUER])
    count = 300 if quick else 2000
    values = [f"Bearer {token(key, f'user-{number}')}" for number in range(count)]
    rows = []
    for label, tokens in (("first sight (signature checked)", values[1:]), ("same token again", values[:1] * count)):
        runs = []
        for _ in range(5):
            identity = JwtIdentity(config)
            await identity.identify(values[0])  # the key set is read once, then cached
            started = time.process_time()
            for value in tokens:
                await identity.identify(value)
            runs.append((time.process_time() - started) / len(tokens) * 1e6)
            await identity.close()
        rows.append({"row": f"JWT verification per request, keys cached, {label}", "cpu_us": statistics.median(runs)})
    return rows


class WithHeaders:
    """An HttpClient whose every request also carries `extra` headers (also used by `benchmarks.credentials`)."""

    def __init__(self, http: HttpClient, extra: dict[str, str]) -> None:
        self.http = http
        self.extra = extra

    async def post(self, body: bytes, headers: dict[str, str]) -> Response:
        return await self.http.post(body, {**headers, **self.extra})

    def close(self) -> None:
        self.http.close()


async def latency_rows(directory: Path, quick: bool) -> list[dict[str, Any]]:
    key, path = key_set(directory)
    upstream = await start_upstream()
    jwt_section = {"jwt": {"jwks_file": str(path), "issuer": ISSUER}}
    proxy = await start_proxy(upstream.url, directory, "oauth", security=jwt_section)
    rows = []
    try:
        direct = LegacyClient(upstream.url)
        await direct.start()
        anonymous = ModernClient(proxy.url)
        authenticated = ModernClient(proxy.url)
        authenticated.http = WithHeaders(authenticated.http, {"Authorization": f"Bearer {token(key, 'alice')}"})  # type: ignore[assignment]
        await measure(anonymous.echo, 50, 1)
        await measure(authenticated.echo, 50, 1)
        count = 300 if quick else 1500
        base, without = await interleaved(direct.echo, anonymous.echo, count=count, concurrency=1)
        base_again, with_jwt = await interleaved(direct.echo, authenticated.echo, count=count, concurrency=1)
        for label, baseline, sample in (("unauthenticated", base, without), ("Bearer JWT", base_again, with_jwt)):
            rows.append(
                {
                    "row": f"modern tools/call through the proxy, {label}, concurrency 1",
                    "p50_ms": sample.percentile(0.5),
                    "direct_p50_ms": baseline.percentile(0.5),
                    "added_p50_ms": sample.percentile(0.5) - baseline.percentile(0.5),
                    "added_p99_ms": sample.percentile(0.99) - baseline.percentile(0.99),
                }
            )
        direct.close()
        anonymous.close()
        authenticated.close()
    finally:
        proxy.stop()
        upstream.stop()
    return rows


async def main(quick: bool) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        rows = await verification_rows(Path(workdir), quick) + await latency_rows(Path(workdir), quick)
    for row in rows:
        figures = ", ".join(f"{name} {value:.3f}" for name, value in row.items() if name != "row")
        print(f"{row['row']}: {figures}")
    RESULTS.write_text(json.dumps({"rows": rows, "quick": quick}, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    asyncio.run(main(parser.parse_args().quick))
