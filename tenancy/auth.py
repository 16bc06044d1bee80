"""The one auth step for REST and MCP alike: credentials in, a frozen AuthContext out.

Order: an ``Authorization: Bearer mx_…`` API key; else, when Access is configured, the
``Cf-Access-Jwt-Assertion`` header or ``CF_Authorization`` cookie. A user's email maps to a membership (the
organization named in the URL, or the ``Memex-Organization`` header, or the only one they have); a service
token's common_name maps to its binding. Failures are counted per client address and rate limited; every
success is rate limited per principal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from services.errors import InvalidInput, RateLimited, Unauthenticated
from services.ports import SqlDatabase
from tenancy.keys import KeyManager
from tenancy.models import ROLE_SCOPES, AuthContext
from tenancy.ratelimit import WindowLimiter

__all__ = ["Authenticator", "Credentials"]


@dataclass(frozen=True, slots=True)
class Credentials:
    authorization: str | None
    access_token: str | None
    client: str
    org_hint: str | None = None  # an organization slug from the URL or the Memex-Organization header


class Authenticator:
    def __init__(
        self,
        db: SqlDatabase,
        keys: KeyManager,
        *,
        access=None,  # tenancy.access.AccessVerifier | None
        failures_per_minute: int = 30,
        requests_per_minute: int = 1200,
    ) -> None:
        self.db = db
        self.keys = keys
        self.access = access
        self.failures = WindowLimiter(failures_per_minute, 60)
        self.requests = WindowLimiter(requests_per_minute, 60)
        self._slugs: dict[str, str] = {}

    async def authenticate(self, creds: Credentials) -> AuthContext:
        wait = self.failures.retry_after(creds.client)
        if wait:
            raise RateLimited("too many failed authentications from this address", retry_after=wait)
        try:
            ctx = await self._authenticate(creds)
        except Unauthenticated:
            self.failures.hit(creds.client)
            raise
        wait = self.requests.hit(ctx.principal)
        if wait:
            raise RateLimited("rate limit exceeded for this credential", retry_after=wait)
        return ctx

    async def _authenticate(self, creds: Credentials) -> AuthContext:
        bearer = _bearer(creds.authorization)
        if bearer is not None:
            vk = await self.keys.verify(bearer)
            if vk is None:
                raise Unauthenticated("invalid, expired or revoked API key")
            return AuthContext(vk.organization_id, await self._slug(vk.organization_id), f"key:{vk.key_id}", vk.scopes, vk.key_id)
        if self.access is not None and creds.access_token:
            claims = await self.access.verify(creds.access_token)
            if claims.kind == "service":
                return await self._service(claims.common_name)
            return await self._member(claims.email, creds.org_hint)
        raise Unauthenticated("missing credentials: send Authorization: Bearer <api key>")

    async def _slug(self, org_id: str) -> str:
        slug = self._slugs.get(org_id)
        if slug is None:
            rows = (await self.db.execute("SELECT slug FROM organizations WHERE id = ?", (org_id,))).rows
            if not rows:
                raise Unauthenticated("organization no longer exists")
            slug = self._slugs[org_id] = rows[0]["slug"]
        return slug

    async def _service(self, common_name: str | None) -> AuthContext:
        rows = (
            await self.db.execute(
                "SELECT t.organization_id, t.scopes, o.slug FROM service_tokens t "
                "JOIN organizations o ON o.id = t.organization_id WHERE t.common_name = ? AND o.status = 'active'",
                (common_name or "",),
            )
        ).rows
        if not rows:
            raise Unauthenticated("this Access service token is not bound to an organization")
        r = rows[0]
        return AuthContext(r["organization_id"], r["slug"], f"service:{common_name}", frozenset(json.loads(r["scopes"])))

    async def _member(self, email: str | None, org_hint: str | None) -> AuthContext:
        rows = (
            await self.db.execute(
                "SELECT m.organization_id, m.role, o.slug FROM memberships m "
                "JOIN organizations o ON o.id = m.organization_id WHERE m.email = ? AND o.status = 'active'",
                ((email or "").lower(),),
            )
        ).rows
        if org_hint is not None:
            rows = [r for r in rows if r["slug"] == org_hint]
        if not rows:
            raise Unauthenticated("this Access user is not a member of the organization")
        if len(rows) > 1:
            raise InvalidInput(
                "this user belongs to several organizations: name one in the Memex-Organization header",
                details={"organizations": sorted(r["slug"] for r in rows)},
            )
        r = rows[0]
        return AuthContext(r["organization_id"], r["slug"], f"user:{email.lower()}", ROLE_SCOPES[r["role"]])


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthenticated("Authorization must be 'Bearer <api key>'")
    return value.strip()


def credentials_from(headers: Mapping[str, str], cookies: Mapping[str, str], client: str, org_hint: str | None) -> Credentials:
    from tenancy.access import token_from_request

    return Credentials(
        authorization=headers.get("authorization"),
        access_token=token_from_request(headers, cookies),
        client=client,
        org_hint=org_hint or headers.get("memex-organization"),
    )
