"""Who may come in through Cloudflare Access: members (email -> role) and service tokens
(common_name -> scopes), bound per organization and managed by its admins. The same email or common_name
may be bound by several organizations, each with its own role or scopes; which one a request acts in is
chosen by its URL or Memex-Organization header (tenancy.auth), never by who bound it last."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from services.errors import Conflict, InvalidInput, NotFound
from services.storage.scoped import OrgSql
from services.ids import now_ms
from tenancy.models import ROLE_SCOPES, SCOPES

__all__ = ["Member", "ServiceToken", "OrgBindings"]

_EMAIL = re.compile(r"^[^@ \t\r\n]{1,64}@[^@ \t\r\n]{1,255}$")
_CN = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclass(frozen=True, slots=True)
class Member:
    email: str
    role: str
    created_at: int


@dataclass(frozen=True, slots=True)
class ServiceToken:
    common_name: str
    name: str
    scopes: list[str]
    created_at: int


class OrgBindings:
    def __init__(self, sql: OrgSql) -> None:
        self.sql = sql

    async def add_member(self, email: str, role: str) -> Member:
        email = (email or "").strip().lower()
        if not _EMAIL.match(email):
            raise InvalidInput("invalid email", details={"field": "email"})
        if role not in ROLE_SCOPES:
            raise InvalidInput("role must be one of " + ", ".join(ROLE_SCOPES), details={"field": "role"})
        now = now_ms()
        await self.sql.execute(
            "INSERT INTO memberships (organization_id, email, role, created_at) VALUES (?1, ?2, ?3, ?4) "
            "ON CONFLICT(organization_id, email) DO UPDATE SET role = excluded.role",
            [email, role, now],
        )
        row = await self.sql.one("SELECT * FROM memberships WHERE organization_id = ?1 AND email = ?2", [email])
        if row is None:  # removed by a concurrent request between the upsert and this read
            raise NotFound("member not found")
        return Member(row["email"], row["role"], row["created_at"])

    async def members(self) -> list[Member]:
        rows = await self.sql.rows("SELECT * FROM memberships WHERE organization_id = ?1 ORDER BY email")
        return [Member(r["email"], r["role"], r["created_at"]) for r in rows]

    async def remove_member(self, email: str) -> None:
        res = await self.sql.execute(
            "DELETE FROM memberships WHERE organization_id = ?1 AND email = ?2", [(email or "").strip().lower()]
        )
        if res.changes == 0:
            raise NotFound("member not found")

    async def add_service_token(self, common_name: str, name: str, scopes: list[str]) -> ServiceToken:
        if not _CN.match(common_name or ""):
            raise InvalidInput("invalid common_name (the Access service token's client id)", details={"field": "common_name"})
        if not scopes or any(s not in SCOPES for s in scopes):
            raise InvalidInput("scopes must be a non-empty subset of read, write, admin", details={"field": "scopes"})
        name = (name or common_name).strip()[:100]
        res = await self.sql.execute(
            "INSERT INTO service_tokens (organization_id, common_name, name, scopes, created_at) "
            "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
            [common_name, name, json.dumps(sorted(set(scopes))), now_ms()],
        )
        if res.changes == 0:
            raise Conflict("this service token is already bound in this organization", details={"field": "common_name"})
        return await self.service_token(common_name)

    async def service_token(self, common_name: str) -> ServiceToken:
        r = await self.sql.one(
            "SELECT * FROM service_tokens WHERE organization_id = ?1 AND common_name = ?2", [common_name]
        )
        if r is None:
            raise NotFound("service token not found")
        return ServiceToken(r["common_name"], r["name"], json.loads(r["scopes"]), r["created_at"])

    async def service_tokens(self) -> list[ServiceToken]:
        rows = await self.sql.rows("SELECT * FROM service_tokens WHERE organization_id = ?1 ORDER BY common_name")
        return [ServiceToken(r["common_name"], r["name"], json.loads(r["scopes"]), r["created_at"]) for r in rows]

    async def remove_service_token(self, common_name: str) -> None:
        res = await self.sql.execute(
            "DELETE FROM service_tokens WHERE organization_id = ?1 AND common_name = ?2", [common_name]
        )
        if res.changes == 0:
            raise NotFound("service token not found")
