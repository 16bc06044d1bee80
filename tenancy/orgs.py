"""Organizations and sign-up.

Sign-up provisions the organization's own database first (services.storage), then writes the organization,
its first admin key and its routing row in one atomic batch of the control database. A crash in between
leaves at most an unreferenced database, never an organization without one; a slug taken meanwhile discards
the database again."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.errors import Conflict, InvalidInput, NotFound
from services.ports import SqlDatabase, Statement
from services.ids import new_org_id, now_ms
from tenancy.keys import IssuedKey, KeyManager

if TYPE_CHECKING:
    from services.storage.stores import OrgStores

__all__ = ["Organization", "OrgDirectory", "SLUG_RULE", "validate_slug"]

SLUG_RULE = "3-40 characters: lower-case letters, digits and single hyphens, starting with a letter, not ending with a hyphen"
_SLUG = re.compile(r"^[a-z](-?[a-z0-9])+$")
_RESERVED = frozenset({"admin", "api", "app", "docs", "health", "mcp", "memex", "schema", "signup", "static", "www", "v1"})


def validate_slug(slug: str) -> str:
    if not isinstance(slug, str) or not 3 <= len(slug) <= 40 or not _SLUG.match(slug):
        raise InvalidInput("invalid slug", details={"field": "slug", "rule": SLUG_RULE})
    if slug in _RESERVED:
        raise InvalidInput("this slug is reserved", details={"field": "slug"})
    return slug


@dataclass(frozen=True, slots=True)
class Organization:
    id: str
    slug: str
    name: str
    status: str
    created_at: int

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Organization":
        return cls(row["id"], row["slug"], row["name"], row["status"], row["created_at"])


class OrgDirectory:
    def __init__(self, db: SqlDatabase, keys: KeyManager, stores: "OrgStores") -> None:
        self.db = db
        self.keys = keys
        self.stores = stores

    async def create(self, *, name: str, slug: str, key_name: str = "default") -> tuple[Organization, IssuedKey]:
        """Create an organization and its first key (scopes read, write, admin). 409 if the slug is taken."""
        slug = validate_slug(slug)
        if not name or len(name) > 200:
            raise InvalidInput("name must be 1-200 characters", details={"field": "name"})
        if (await self.db.execute("SELECT 1 AS x FROM organizations WHERE slug = ?", (slug,))).rows:
            raise Conflict("an organization with this slug already exists", details={"field": "slug"})
        org = Organization(new_org_id(), slug, name, "active", now_ms())
        issued, key_stmt = await self.keys.prepare(org.id, name=key_name, scopes=["read", "write", "admin"])
        route = await self.stores.provision(org.id)
        try:
            results = await self.db.batch(
                [
                    Statement(
                        "INSERT INTO organizations (id, slug, name, status, created_at) VALUES (?, ?, ?, ?, ?) "
                        "ON CONFLICT(slug) DO NOTHING",
                        (org.id, org.slug, org.name, org.status, org.created_at),
                    ),
                    key_stmt,  # a lost slug race fails this one (no organization row): the batch rolls back
                    route,
                ]
            )
        except BaseException:
            await self.stores.discard(org.id)
            if (await self.db.execute("SELECT 1 AS x FROM organizations WHERE slug = ?", (slug,))).rows:
                raise Conflict("an organization with this slug already exists", details={"field": "slug"}) from None
            raise
        if results[0].changes == 0:
            await self.stores.discard(org.id)
            raise Conflict("an organization with this slug already exists", details={"field": "slug"})
        return org, issued

    async def delete(self, org_id: str) -> None:
        """Remove the organization: its database and vectors first, then its keys, bindings, usage, routing and
        knowledge bases' webhook routes (the control rows go last, so a crash midway leaves an organization whose
        deletion can be run again, never data without an owner). Its keys stop working at once: evicted from this process's key
        cache here, and from every other process's through the revocation log the key deletions write."""
        key_ids = [r["id"] for r in (await self.db.execute(
            "SELECT id FROM api_keys WHERE organization_id = ?", (org_id,))).rows]
        await self.stores.drop(org_id)
        await self.db.batch([
            Statement("DELETE FROM api_keys WHERE organization_id = ?", (org_id,)),
            Statement("DELETE FROM memberships WHERE organization_id = ?", (org_id,)),
            Statement("DELETE FROM service_tokens WHERE organization_id = ?", (org_id,)),
            Statement("DELETE FROM llm_usage WHERE organization_id = ?", (org_id,)),
            Statement("DELETE FROM org_databases WHERE organization_id = ?", (org_id,)),
            Statement("DELETE FROM knowledge_base_routes WHERE organization_id = ?", (org_id,)),
            Statement("DELETE FROM organizations WHERE id = ?", (org_id,)),
        ])
        for key_id in key_ids:
            self.keys.evict(key_id)

    async def by_slug(self, slug: str) -> Organization:
        rows = (await self.db.execute("SELECT * FROM organizations WHERE slug = ?", (slug,))).rows
        if not rows:
            raise NotFound("organization not found")
        return Organization.from_row(rows[0])

    async def by_id(self, org_id: str) -> Organization:
        rows = (await self.db.execute("SELECT * FROM organizations WHERE id = ?", (org_id,))).rows
        if not rows:
            raise NotFound("organization not found")
        return Organization.from_row(rows[0])

    async def all(self) -> list[Organization]:
        rows = (await self.db.execute("SELECT * FROM organizations ORDER BY created_at")).rows
        return [Organization.from_row(r) for r in rows]


def scopes_json(scopes: list[str]) -> str:
    return json.dumps(sorted(set(scopes)))
