"""The one auth step for REST and MCP alike: credentials in, a frozen AuthContext (and its quota) out.

Credentials, in order: an ``Authorization: Bearer mx_…`` API key; else, when Access is configured, the
``Cf-Access-Jwt-Assertion`` header or ``CF_Authorization`` cookie.

Which organization: an API key belongs to one; naming another (URL or header) is 404. An Access identity (a
member's email, a service token's common_name) is bound per organization and may be bound in several: the
organization is the one the URL names (``/orgs/{slug}/…``) or the ``Memex-Organization`` header names (both
given and different: 400); with neither, the identity's only binding, and 400 naming the header when it has
several. Never whichever organization bound it last.

Limits (tenancy.ratelimit, moving windows):

* failed attempts count per (client address, credential prefix) -- the prefix is the key id of an
  ``mx_`` key, ``access`` for an Access token, ``malformed`` or ``none`` -- and per address across prefixes
  (so rotating made-up key ids does not escape). Over either, the request is answered 429 *without* the
  argon2 verify unless the credential can still be valid: a key id that exists, is live and belongs to an
  active organization is verified (one such verify at a time) and a valid key passes; an Access token is
  always verified (cheap). A valid credential presented correctly is never locked out.
* every admitted request counts against its credential (per organization) and its organization; the
  tighter of the two is reported in RateLimit headers, and a 429 carries them with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from services.errors import InvalidInput, NotFound, RateLimited, Unauthenticated
from services.ids import now_ms
from services.ports import SqlDatabase
from tenancy.keys import KeyManager, parse_raw_key
from tenancy.models import ROLE_SCOPES, AuthContext
from tenancy.ratelimit import Limit, RateLimits, Verdict

if TYPE_CHECKING:
    from tenancy.access import AccessVerifier

__all__ = ["Admission", "AuthLimits", "Authenticator", "Credentials", "ORG_HEADER", "credential_prefix"]

#: The header that names the organization where the URL does not.
ORG_HEADER = "Memex-Organization"


@dataclass(frozen=True, slots=True)
class Credentials:
    authorization: str | None
    access_token: str | None
    client: str
    org_hint: str | None = None  # the organization slug in the URL (/orgs/{slug}/…)
    org_header: str | None = None  # the Memex-Organization header


@dataclass(frozen=True, slots=True)
class AuthLimits:
    """Per minute: requests per credential, per organization; failures per (address, prefix), per address."""

    key_per_minute: int = 1200
    org_per_minute: int = 6000
    failures_per_minute: int = 30
    address_failures_per_minute: int = 120


@dataclass(frozen=True, slots=True)
class Admission:
    ctx: AuthContext
    #: The tighter of the credential's and the organization's limits after this request.
    quota: Verdict


class Authenticator:
    def __init__(
        self,
        db: SqlDatabase,
        keys: KeyManager,
        *,
        access: AccessVerifier | None = None,
        limits: AuthLimits | None = None,
        rate_limits: RateLimits | None = None,
    ) -> None:
        self.db = db
        self.keys = keys
        self.access = access
        policy = limits or AuthLimits()
        self.rate_limits = rate_limits or RateLimits()
        self.key_limit = Limit("credential", policy.key_per_minute, 60)
        self.org_limit = Limit("organization", policy.org_per_minute, 60)
        self.failure_limit = Limit("auth-failures", policy.failures_per_minute, 60)
        self.address_failure_limit = Limit("auth-failures-address", policy.address_failures_per_minute, 60)
        self._locked_verify: asyncio.Semaphore | None = None
        self._slugs: dict[str, str] = {}

    async def authenticate(self, creds: Credentials) -> AuthContext:
        return (await self.admit(creds)).ctx

    async def admit(self, creds: Credentials) -> Admission:
        hint = _org_choice(creds)
        prefix = credential_prefix(creds)
        pair = f"{creds.client}|{prefix}"
        lockout = None
        for limit, ident in ((self.failure_limit, pair), (self.address_failure_limit, creds.client)):
            verdict = await self.rate_limits.check(limit, ident)
            if not verdict.allowed:
                lockout = verdict
                break
        if lockout is not None:
            ctx = await self._while_locked(creds, hint, lockout)
        else:
            try:
                ctx = await self._authenticate(creds, hint)
            except Unauthenticated:
                await self.rate_limits.hit(self.failure_limit, pair)
                await self.rate_limits.hit(self.address_failure_limit, creds.client)
                raise
        return Admission(ctx, await self._count(ctx))

    async def tier(self, creds: Credentials, org_slug: str) -> tuple[str, AuthContext | None]:
        """How a request stands towards one organization's published knowledge (the knowledge-server seed's tiers):
        ``open`` with no credential; ``members`` with a credential of this organization that may read; ``public``
        with any other valid identity (another organization's key, an Access identity bound elsewhere or nowhere).
        A credential that is not valid is refused (Unauthenticated, 401), never taken for no credential. The
        context is the credential's when it has one (its requests are counted against its limits as usual)."""
        if not creds.authorization and not (self.access is not None and creds.access_token):
            return "open", None
        if creds.authorization:
            ctx = (await self.admit(replace(creds, org_hint=None, org_header=None))).ctx
            return ("members" if ctx.org_slug == org_slug and ctx.allows("read") else "public"), ctx
        assert self.access is not None and creds.access_token is not None
        claims = await self.access.verify(creds.access_token)
        try:
            ctx = (await self._service(claims.common_name, org_slug) if claims.kind == "service"
                   else await self._member(claims.email, org_slug))
        except Unauthenticated:  # a valid identity, not bound to this organization
            return "public", None
        await self._count(ctx)
        return ("members" if ctx.allows("read") else "public"), ctx

    async def _count(self, ctx: AuthContext) -> Verdict:
        mine = await self.rate_limits.hit(self.key_limit, f"{ctx.org_id}|{ctx.principal}")
        if not mine.allowed:
            raise _limited("rate limit exceeded for this credential", mine)
        org = await self.rate_limits.hit(self.org_limit, ctx.org_id)
        if not org.allowed:
            raise _limited("rate limit exceeded for this organization", org)
        return min((mine, org), key=lambda v: (v.remaining / v.limit.amount, v.remaining))

    async def _while_locked(self, creds: Credentials, hint: str | None, lockout: Verdict) -> AuthContext:
        """Over the failure limit: only a credential that can still be valid is checked; nothing else is."""
        refused = _limited("too many failed authentications from this address; a valid credential is still accepted",
                           lockout)
        try:
            bearer = _bearer(creds.authorization)
        except Unauthenticated:
            raise refused from None
        if bearer is not None:
            key_id = parse_raw_key(bearer)
            if key_id is None or not await self._live_key(key_id):
                raise refused
            if self._locked_verify is None:
                self._locked_verify = asyncio.Semaphore(1)
            async with self._locked_verify:  # at most one argon2 verify at a time for locked-out traffic
                try:
                    return await self._authenticate(creds, hint)
                except Unauthenticated:
                    raise refused from None
        if self.access is not None and creds.access_token:
            try:
                return await self._authenticate(creds, hint)
            except Unauthenticated:
                raise refused from None
        raise refused

    async def _live_key(self, key_id: str) -> bool:
        rows = (
            await self.db.execute(
                "SELECT 1 AS live FROM api_keys k JOIN organizations o ON o.id = k.organization_id WHERE k.id = ? "
                "AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > ?) AND o.status = 'active'",
                (key_id, now_ms()),
            )
        ).rows
        return bool(rows)

    async def _authenticate(self, creds: Credentials, hint: str | None) -> AuthContext:
        bearer = _bearer(creds.authorization)
        if bearer is not None:
            vk = await self.keys.verify(bearer)
            if vk is None:
                raise Unauthenticated("invalid, expired or revoked API key")
            slug = await self._slug(vk.organization_id)
            if hint is not None and hint != slug:
                raise NotFound("organization not found")  # a key belongs to one organization; never confirm another
            return AuthContext(vk.organization_id, slug, f"key:{vk.key_id}", vk.scopes, vk.key_id)
        if self.access is not None and creds.access_token:
            claims = await self.access.verify(creds.access_token)
            if claims.kind == "service":
                return await self._service(claims.common_name, hint)
            return await self._member(claims.email, hint)
        raise Unauthenticated("missing credentials: send Authorization: Bearer <api key>")

    async def _slug(self, org_id: str) -> str:
        slug = self._slugs.get(org_id)
        if slug is None:
            rows = (await self.db.execute("SELECT slug FROM organizations WHERE id = ?", (org_id,))).rows
            if not rows:
                raise Unauthenticated("organization no longer exists")
            slug = self._slugs[org_id] = rows[0]["slug"]
        return slug

    async def _service(self, common_name: str | None, hint: str | None) -> AuthContext:
        rows = (
            await self.db.execute(
                "SELECT t.organization_id, t.scopes, o.slug FROM service_tokens t "
                "JOIN organizations o ON o.id = t.organization_id WHERE t.common_name = ? AND o.status = 'active'",
                (common_name or "",),
            )
        ).rows
        r = _one_binding(rows, hint, "service token")
        return AuthContext(r["organization_id"], r["slug"], f"service:{common_name}", frozenset(json.loads(r["scopes"])))

    async def _member(self, email: str | None, hint: str | None) -> AuthContext:
        email = (email or "").lower()
        rows = (
            await self.db.execute(
                "SELECT m.organization_id, m.role, o.slug FROM memberships m "
                "JOIN organizations o ON o.id = m.organization_id WHERE m.email = ? AND o.status = 'active'",
                (email,),
            )
        ).rows
        r = _one_binding(rows, hint, "user")
        return AuthContext(r["organization_id"], r["slug"], f"user:{email}", ROLE_SCOPES[r["role"]])


def _one_binding(rows: list[dict[str, Any]], hint: str | None, what: str) -> dict[str, Any]:
    """The binding of the organization the request names; the only one when it names none."""
    if hint is not None:
        rows = [r for r in rows if r["slug"] == hint]
    if not rows:
        where = "this organization" if hint is not None else "any organization"
        raise Unauthenticated(f"this Access {what} is not bound to {where}")
    if len(rows) > 1:
        raise InvalidInput(
            f"this Access {what} is bound to several organizations: name one in the {ORG_HEADER} header "
            "(or use an /orgs/{slug}/ URL)",
            details={"header": ORG_HEADER, "organizations": sorted(r["slug"] for r in rows)},
        )
    return rows[0]


def _org_choice(creds: Credentials) -> str | None:
    url, header = creds.org_hint, (creds.org_header or "").strip() or None
    if url is not None and header is not None and url != header:
        raise InvalidInput(
            f"the URL names one organization and the {ORG_HEADER} header another",
            details={"header": ORG_HEADER, "url": url[:64], "header_value": header[:64]},
        )
    return url or header


def _limited(message: str, verdict: Verdict) -> RateLimited:
    return RateLimited(message, retry_after=verdict.retry_after or 1,
                       details={"limit": verdict.limit.name, "policy": verdict.limit.policy},
                       headers=verdict.headers())


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthenticated("Authorization must be 'Bearer <api key>'")
    return value.strip()


def credential_prefix(creds: Credentials) -> str:
    """What failed attempts are counted under, beside the address: a key's (public) id, ``access``,
    ``malformed`` or ``none``. Never a secret."""
    try:
        bearer = _bearer(creds.authorization)
    except Unauthenticated:
        return "malformed"
    if bearer is not None:
        return parse_raw_key(bearer) or "malformed"
    return "access" if creds.access_token else "none"


def credentials_from(headers: Mapping[str, str], cookies: Mapping[str, str], client: str, org_hint: str | None) -> Credentials:
    from tenancy.access import token_from_request

    return Credentials(
        authorization=headers.get("authorization"),
        access_token=token_from_request(headers, cookies),
        client=client,
        org_hint=org_hint,
        org_header=headers.get("memex-organization"),
    )
