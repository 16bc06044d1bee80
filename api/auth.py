"""The auth middleware (the one auth step, for REST and MCP) and the scope guard.

The client address is the TCP peer unless the peer is a trusted proxy (MEMEX_TRUSTED_PROXIES; see
tenancy.addresses). Every admitted request's response carries the RateLimit headers of the tighter of its
credential's and its organization's limits.
"""

from __future__ import annotations

import re

from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.types import Message, Receive, Scope, Send

from services.errors import Forbidden
from tenancy.auth import credentials_from
from tenancy.models import AuthContext

__all__ = ["AuthMiddleware", "require", "PUBLIC_PATHS", "client_address"]

PUBLIC_PATHS = ["^/health$", "^/v1/signup$", "^/schema", "^/kb/", "^/hooks/"]
_ORG_PATH = re.compile(r"^/orgs/([^/]+)/")
_QUOTA = "memex.quota"  # where the admitted request's rate-limit verdict waits for the response


def client_address(connection: ASGIConnection) -> str:
    """The client's address: the peer, or what a trusted proxy says (MEMEX_TRUSTED_PROXIES)."""
    client = connection.scope.get("client")
    peer = client[0] if client else None
    resolver = connection.app.state.memex.client_addresses
    return resolver.resolve(peer, connection.headers.getall(resolver.header, []))


class AuthMiddleware(AbstractAuthenticationMiddleware):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return

        async def send_with_quota(message: Message) -> None:
            verdict = scope.get(_QUOTA)  # type: ignore[call-overload]
            if verdict is not None and message["type"] == "http.response.start":
                headers = MutableScopeHeaders.from_message(message)
                for name, value in verdict.headers().items():
                    headers[name] = value
            await send(message)

        await super().__call__(scope, receive, send_with_quota)

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        memex = connection.app.state.memex
        m = _ORG_PATH.match(connection.scope["path"])
        creds = credentials_from(connection.headers, connection.cookies, client_address(connection), m.group(1) if m else None)
        admission = await memex.auth.admit(creds)
        connection.scope[_QUOTA] = admission.quota  # type: ignore[literal-required]
        return AuthenticationResult(user=admission.ctx, auth=admission.ctx)


def require(scope: str):
    """A guard: the caller's credential must hold ``scope`` (admin holds every scope)."""

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if connection.scope.get("method") == "OPTIONS":
            return  # CORS preflight and OPTIONS carry no credentials and touch nothing
        ctx: AuthContext = connection.user
        if not ctx.allows(scope):
            raise Forbidden(f"this credential lacks the '{scope}' scope", details={"required": scope})

    guard.__name__ = f"require_{scope}"
    return guard
