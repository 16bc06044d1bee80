"""The Worker backend's organization stores: each organization's database is its own SQLite Durable Object, reached
through the data-plane Worker as ``org:<org_id>``; vectors in a shared Vectorize index, a namespace per organization.

Nothing is provisioned per organization: the Worker creates the Durable Object on first use (``idFromName``) and
applies migrations/org/ inside it (the versions recorded in its own ``d1_migrations``), so sign-up writes only the
control rows, routing row included (``backend = 'worker'``, ``location = 'org:<org_id>'``), and opening an
organization costs no migration request here. ``drop`` deletes the organization's vectors (their ids read from its
database), then empties every table of its Durable Object in one transaction (the Worker protocol has no op that
deletes a Durable Object; an emptied object holds only its schema), then the routing row; each step is safe to run
again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from services.ports import SqlDatabase, Statement, VectorIndex
from services.storage.stores import OrgStore, _BaseStores, valid_org_id

__all__ = ["WorkerOrgStores", "location_of", "DELETE_PAGE"]

log = logging.getLogger("memex.storage")

DELETE_PAGE = 1000
_FTS_SHADOWS = ("_data", "_idx", "_content", "_docsize", "_config")
_KEEP = ("sqlite_", "_cf_", "d1_migrations")


def location_of(org_id: str) -> str:
    """The Worker's name for an organization's database."""
    return f"org:{valid_org_id(org_id)}"


class WorkerOrgStores(_BaseStores):
    backend = "worker"
    #: The job worker works on a round's organizations at once: their calls share the Worker's requests (the client
    #: coalesces background work's ops), so a round costs about one request per step, not one per organization.
    concurrent_orgs = True

    def __init__(self, control: SqlDatabase, *, open_database: Callable[[str], SqlDatabase],
                 open_index: Callable[[str], VectorIndex], index_name: str,
                 schema_check: Callable[[], Awaitable[None]] | None = None, model: str | None = None) -> None:
        """``open_database("org:<id>")`` and ``open_index(name)`` make the Worker adapters (the composition root
        chooses them); ``schema_check()``, awaited before the first organization is opened, raises when the Worker
        bundles older org migrations than this service needs (its Durable Objects would lack tables); ``model``:
        the embedder's model id, recorded for each new organization and checked on each one opened (``_BaseStores``:
        the index shared by every organization holds one model's vectors per organization)."""
        super().__init__(control)
        self.model = model
        self.open_database = open_database
        self.open_index = open_index
        self.index_name = index_name
        self.schema_check = schema_check
        self._schema_checked = schema_check is None
        self._schema_lock = asyncio.Lock()
        self._indexes: dict[str, VectorIndex] = {}

    async def open(self, org_id: str, *, any_model: bool = False) -> OrgStore:
        if not self._schema_checked and self.schema_check is not None:
            async with self._schema_lock:
                if not self._schema_checked:
                    await self.schema_check()
                    self._schema_checked = True
        return await super().open(org_id, any_model=any_model)

    def index(self, name: str | None) -> VectorIndex:
        name = name or self.index_name
        idx = self._indexes.get(name)
        if idx is None:
            idx = self._indexes[name] = self.open_index(name)
        return idx

    async def _make(self, org_id: str, route: dict[str, Any]) -> OrgStore:
        store = OrgStore(org_id, self.open_database(route.get("location") or location_of(org_id)),
                         self.index(route.get("vector_index")))
        store.migrated = True  # the Durable Object migrates itself on first use after an upgrade
        return store

    async def provision(self, org_id: str) -> Statement:
        """No request: the routing row only (the Durable Object comes into being on first use)."""
        return self.routing.insert(org_id, self.backend, location_of(org_id), vector_index=self.index_name,
                                   embedding_model=self.model)

    async def discard(self, org_id: str) -> None:
        """Nothing to undo: provisioning made no request, and a sign-up that lost its race wrote nothing in the
        organization's Durable Object."""

    async def drop(self, org_id: str) -> None:
        route = await self.routing.get(valid_org_id(org_id))
        self._forget(org_id)
        if route is None:
            return
        db, index = self.open_database(route.get("location") or location_of(org_id)), self.index(route.get("vector_index"))
        ids = [r["id"] for r in (await db.execute("SELECT id FROM chunks WHERE organization_id = ?", (org_id,))).rows]
        tables = await self._tables(db)
        if "vector_gc" in tables:
            ids += [r["chunk_id"] for r in (await db.execute(
                "SELECT chunk_id FROM vector_gc WHERE organization_id = ?", (org_id,))).rows]
        ids = list(dict.fromkeys(ids))
        for i in range(0, len(ids), DELETE_PAGE):
            await index.delete_by_ids([f"{org_id}:{cid}" for cid in ids[i:i + DELETE_PAGE]])
        if tables:
            # twice over: rows a trigger writes while the first pass deletes (vector_gc) go in the second
            deletes = [Statement(f'DELETE FROM "{t}"') for t in tables]
            await db.batch(deletes + deletes)
        await self.routing.delete(org_id)

    @staticmethod
    async def _tables(db: SqlDatabase) -> list[str]:
        """Every table of an organization's database that holds its data (FTS tables, not their shadow tables;
        not the migrations record or SQLite's and Cloudflare's own tables)."""
        rows = (await db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' ORDER BY name")).rows
        virtual = [r["name"] for r in rows if (r.get("sql") or "").upper().startswith("CREATE VIRTUAL TABLE")]
        shadows = {v + s for v in virtual for s in _FTS_SHADOWS}
        return [r["name"] for r in rows if not r["name"].startswith(_KEEP) and r["name"] not in shadows
                and '"' not in r["name"]]

    async def close(self) -> None:
        for idx in self._indexes.values():
            await idx.close()
        for store in self._stores.values():
            await store.db.close()
        self._stores.clear()
