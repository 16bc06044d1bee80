"""The auth middleware (the one auth step, for REST and MCP) and the scope guard."""

from __future__ import annotations

import re

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult

from services.errors import Forbidden
from tenancy.auth import credentials_from
from tenancy.models import AuthContext

__all__ = ["AuthMiddleware", "require", "PUBLIC_PATHS"]

PUBLIC_PATHS = ["^/health$", "^/v1/signup$", "^/schema"]
_ORG_PATH = re.compile(r"^/orgs/([^/]+)/")


def client_address(connection: ASGIConnection) -> str:
    client = connection.scope.get("client")
    return client[0] if client else "unknown"


class AuthMiddleware(AbstractAuthenticationMiddleware):
    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        memex = connection.app.state.memex
        m = _ORG_PATH.match(connection.scope["path"])
        creds = credentials_from(connection.headers, connection.cookies, client_address(connection), m.group(1) if m else None)
        ctx = await memex.auth.authenticate(creds)
        return AuthenticationResult(user=ctx, auth=ctx)


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
