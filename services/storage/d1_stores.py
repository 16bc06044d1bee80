"""The Cloudflare backend's organization stores: a D1 database per organization, vectors in a shared
Vectorize index with a namespace per organization.

Why a namespace in a shared index rather than an index per organization: Vectorize allows 50,000 indexes per
account but also 50,000 namespaces per index (the same ceiling as D1's 50,000 databases per account), and a
namespace costs nothing to create: sign-up stays one D1 create, one migration request and one control batch.
An index per organization would add an index create and its metadata indexes (4 more requests of the
account's 1,200 per 5 minutes) to every sign-up. The price of sharing is Vectorize's 5 million vectors per
index; the routing row names each organization's index, so when one fills, an operator points
CLOUDFLARE_VECTORIZE_INDEX at a new index and new organizations go there while existing ones keep theirs.

Databases are named ``memex-<org id>``; the routing row keeps the uuid Cloudflare gave it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from services.storage.migrate import ORG_DIR, apply_all_fresh
from services.ports import SqlDatabase, Statement, VectorIndex
from services.storage.stores import OrgStore, _BaseStores, _latest, valid_org_id

__all__ = ["D1OrgStores", "database_name"]

log = logging.getLogger("memex.storage")

#: Vector ids deleted per request when an organization goes (Vectorize takes up to 5,000 per HTTP write).
DELETE_PAGE = 1000


class DatabaseAdmin(Protocol):
    """Creates and deletes databases (D1's REST administration: services.adapters.cloudflare.D1Admin)."""

    async def create_database(self, name: str) -> str: ...

    async def delete_database(self, uuid: str) -> None: ...

    async def find_database(self, name: str) -> str | None: ...


def database_name(org_id: str) -> str:
    return f"memex-{valid_org_id(org_id)}"


class D1OrgStores(_BaseStores):
    backend = "d1"

    def __init__(self, control: SqlDatabase, *, admin: DatabaseAdmin, open_database: Callable[[str], SqlDatabase],
                 open_index: Callable[[str], VectorIndex], index_name: str, account: str | None = None) -> None:
        """``admin`` creates and deletes databases; ``open_database(uuid)`` and ``open_index(name)`` make the
        adapters (the composition root chooses them)."""
        super().__init__(control)
        self.admin = admin
        self.open_database = open_database
        self.open_index = open_index
        self.index_name = index_name
        self.account = account
        self._indexes: dict[str, VectorIndex] = {}

    def index(self, name: str | None) -> VectorIndex:
        name = name or self.index_name
        idx = self._indexes.get(name)
        if idx is None:
            idx = self.open_index(name)
            self._indexes[name] = idx
        return idx

    def _database(self, uuid: str) -> SqlDatabase:
        return self.open_database(uuid)

    async def _make(self, org_id: str, route: dict[str, Any]) -> OrgStore:
        store = OrgStore(org_id, self._database(route["location"]), self.index(route.get("vector_index")))
        # The routing row records the last migration applied: when it is the newest, opening costs no request.
        store.migrated = route.get("schema_version") == _latest()
        return store

    async def provision(self, org_id: str) -> Statement:
        uuid = await self.admin.create_database(database_name(org_id))
        await apply_all_fresh(self._database(uuid), ORG_DIR)  # one request
        return self.routing.insert(org_id, self.backend, uuid, account=self.account, vector_index=self.index_name)

    async def discard(self, org_id: str) -> None:
        uuid = await self.admin.find_database(database_name(org_id))
        if uuid is not None:
            await self.admin.delete_database(uuid)

    async def drop(self, org_id: str) -> None:
        """Delete the organization's vectors (their ids are its chunks' ids, read from its database), then the
        database, then its route. Safe to run again after a failure: each step tolerates what is already gone."""
        route = await self.routing.get(valid_org_id(org_id))
        self._forget(org_id)
        if route is None:
            return
        db, index = self._database(route["location"]), self.index(route.get("vector_index"))
        try:
            ids = [r["id"] for r in (await db.execute(
                "SELECT id FROM chunks WHERE organization_id = ?", (org_id,))).rows]
        except Exception:
            if await self.admin.find_database(database_name(org_id)) is not None:
                raise
            ids = []  # the database is already gone (an earlier attempt): nothing to read the ids from
        for i in range(0, len(ids), DELETE_PAGE):
            await index.delete_by_ids([f"{org_id}:{cid}" for cid in ids[i:i + DELETE_PAGE]])
        await self.admin.delete_database(route["location"])
        await self.routing.delete(org_id)

    async def close(self) -> None:
        for idx in self._indexes.values():
            await idx.close()
        for store in self._stores.values():
            await store.db.close()
        self._stores.clear()

