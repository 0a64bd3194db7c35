"""The fixture as an OAuth resource server, with the mcp 1.x SDK's own support (`--auth-jwks`): a token
verifier that accepts JWTs signed by a key of a JSON Web Key Set file from one issuer, and the SDK's
`AuthSettings`, which answer 401/403 with `WWW-Authenticate: Bearer ... resource_metadata=...` and serve the
RFC 9728 protected-resource metadata. Tokens carry their scopes in `scope`; the SDK refuses a token without
the required one with 403 `insufficient_scope`. Also one plain route besides the MCP endpoint (`/echo`), which
answers what it received, for the relay of other paths; an embedded authorization server's metadata
(`/.well-known/oauth-authorization-server`) naming endpoints that echo as well; and tools that tools/list shows
only to a token with the `reports` scope, so two callers see different catalogs: `scoped_report` (its `tenant`
argument carries an `x-mcp-header` annotation) and, with `--legacy-tasks`, `legacy_task_required`. A call by
name is served to any accepted token, as servers often do. For the credential tests: `token_claims` (who the
token of this call names), `seen_tokens` (every token presented, as SHA-256) and `subscriptions_made` (who
subscribed to which resource, with which token).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any

import jwt
from mcp import types
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.fastmcp import FastMCP
from pydantic import AnyHttpUrl, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

REQUIRED_SCOPE = "mcp"
# The endpoints of the embedded authorization server whose metadata the fixture serves (they echo, as /echo does).
EMBEDDED_ENDPOINTS = {
    "authorization_endpoint": "/oauth/authorize",
    "token_endpoint": "/oauth/token",
    "registration_endpoint": "/oauth/register",
}
REPORTS_SCOPE = "reports"  # the scope that lists SCOPED_TOOLS
SCOPED_TOOLS = ("scoped_report", "legacy_task_required")  # the second only exists with --legacy-tasks


# The SHA-256 of every bearer token this server was presented, accepted or not (`seen_tokens`): the credential
# tests check that the caller's own token never reached it.
PRESENTED: list[str] = []
# Each `resources/subscribe` this server accepted: the URI, and the subject and SHA-256 of the token that carried it.
SUBSCRIPTIONS: list[dict[str, str | None]] = []


class JwksTokenVerifier:
    """Accepts a JWT signed by a key of `jwks_path` (read per token, so a test may rotate keys), issued by
    `issuer`, not expired; its scopes are the space-separated `scope` claim."""

    def __init__(self, jwks_path: str, issuer: str) -> None:
        self.jwks_path = Path(jwks_path)
        self.issuer = issuer

    async def verify_token(self, token: str) -> AccessToken | None:
        PRESENTED.append(hashlib.sha256(token.encode()).hexdigest())
        try:
            keys = jwt.PyJWKSet.from_dict(json.loads(self.jwks_path.read_text()))
            kid = jwt.get_unverified_header(token).get("kid")
            key = next(key for key in keys.keys if key.key_id == kid)
            claims: dict[str, Any] = jwt.decode(
                token, key.key, algorithms=[key.algorithm_name], issuer=self.issuer, options={"verify_aud": False}
            )
        except (jwt.PyJWTError, StopIteration, ValueError, OSError):
            return None
        return AccessToken(
            token=token,
            client_id=str(claims.get("client_id", "fixture-client")),
            scopes=str(claims.get("scope", "")).split(),
            expires_at=claims.get("exp"),
            subject=claims.get("sub"),
        )


def settings(issuer: str, resource_url: str) -> dict[str, Any]:
    """FastMCP keyword arguments that make the fixture a resource server of `issuer` at `resource_url`."""
    return {
        "auth": AuthSettings(
            issuer_url=AnyHttpUrl(issuer),
            resource_server_url=AnyHttpUrl(resource_url),
            required_scopes=[REQUIRED_SCOPE],
            validate_token_resource=False,
        )
    }


def register_echo(mcp: FastMCP[Any]) -> None:
    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "query": request.url.query,
                "headers": {name: value for name, value in request.headers.items()},
                "body": body.decode(errors="replace"),
            },
            headers={"X-Echo": "yes"},
        )

    mcp.custom_route("/echo", methods=["GET", "POST"])(echo)
    for path in EMBEDDED_ENDPOINTS.values():
        mcp.custom_route(path, methods=["GET", "POST"])(echo)

    async def authorization_server_metadata(request: Request) -> Response:
        """An embedded authorization server's RFC 8414 metadata: issued under the public origin the request came
        through (the proxy's, from X-Forwarded-Host), its endpoints on that origin, plus one elsewhere."""
        origin = f"http://{request.headers.get('x-forwarded-host', request.url.netloc)}"
        endpoints = {field: f"{origin}{path}" for field, path in EMBEDDED_ENDPOINTS.items()}
        return JSONResponse({"issuer": origin, **endpoints, "userinfo_endpoint": "https://elsewhere.example/userinfo"})

    mcp.custom_route("/.well-known/oauth-authorization-server", methods=["GET"])(authorization_server_metadata)


def register_credential_tools(mcp: FastMCP[Any]) -> None:
    """`token_claims`: the subject, audience and SHA-256 of the token that carried this call (and its expiry);
    `seen_tokens`: the SHA-256 of every token this server was ever presented; `subscriptions_made`: who subscribed
    to which resource (wraps the installed resources/subscribe handler, so call it after it is installed)."""

    @mcp.tool(description="Who called: the subject, audience and SHA-256 of the access token of this request")
    def token_claims() -> str:
        access = get_access_token()
        if access is None:
            return json.dumps({"sub": None})
        claims = jwt.decode(access.token, options={"verify_signature": False})
        digest = hashlib.sha256(access.token.encode()).hexdigest()
        return json.dumps({"sub": claims.get("sub"), "aud": claims.get("aud"), "token": digest, "exp": claims["exp"]})

    @mcp.tool(description="The SHA-256 of every bearer token this server was presented, accepted or not")
    def seen_tokens() -> str:
        return json.dumps(PRESENTED)

    @mcp.tool(description="Each resources/subscribe accepted: the URI, the subject and SHA-256 of its token")
    def subscriptions_made() -> str:
        return json.dumps(SUBSCRIPTIONS)

    low = mcp._mcp_server
    inner_subscribe = low.request_handlers[types.SubscribeRequest]

    async def subscribe(req: types.SubscribeRequest) -> types.ServerResult:
        user = getattr(low.request_context.request, "user", None)
        token = user.access_token.token if isinstance(user, AuthenticatedUser) else None
        SUBSCRIPTIONS.append(
            {
                "uri": str(req.params.uri),
                "sub": None if token is None else jwt.decode(token, options={"verify_signature": False}).get("sub"),
                "token": None if token is None else hashlib.sha256(token.encode()).hexdigest(),
            }
        )
        return await inner_subscribe(req)

    low.request_handlers[types.SubscribeRequest] = subscribe


def register_scoped_tool(mcp: FastMCP[Any]) -> None:
    """`scoped_report`, and the tools/list filter that shows SCOPED_TOOLS only to a token with REPORTS_SCOPE (the
    scopes of the HTTP request that carried this tools/list, not of the token that opened the session). Wraps
    whatever tools/list handler is installed, so call it after the other fixtures are registered."""

    @mcp.tool(description="A report for one tenant; listed only to callers with the reports scope")
    def scoped_report(
        tenant: Annotated[str, Field(description="Whose report", json_schema_extra={"x-mcp-header": "Tenant"})],
    ) -> str:
        return f"report for {tenant}"

    low = mcp._mcp_server
    inner_list = low.request_handlers[types.ListToolsRequest]

    async def list_tools(req: types.ListToolsRequest) -> types.ServerResult:
        result = await inner_list(req)
        assert isinstance(result.root, types.ListToolsResult)
        request = low.request_context.request
        user = getattr(request, "user", None)
        if not (isinstance(user, AuthenticatedUser) and REPORTS_SCOPE in user.scopes):
            result.root.tools = [tool for tool in result.root.tools if tool.name not in SCOPED_TOOLS]
        return result

    low.request_handlers[types.ListToolsRequest] = list_tools
