"""One database per organization: where each organization's data lives, and handles bound to it.

The control database (``control``) holds organizations, credentials, bindings, usage and the routing table
``org_databases``. Every organization's thoughts, chunks, keyword indexes, conversations, history and jobs
live in a database of its own:

* embedded (``EmbeddedOrgStores``): ``<data dir>/orgs/<org id>/memex.sqlite3`` and, beside it, the
  organization's vector file ``vectors.sqlite3``. A ``HandlePool`` bounds how many are open at once.
* Cloudflare (``D1OrgStores``): a D1 database per organization, created through the REST API when the
  organization is, deleted with it; vectors in a shared Vectorize index, one namespace per organization
  (the routing row names the index, so an operator can start new organizations in a new index).

The wall between organizations is structural: a handle reaches one organization's database and nothing
else. Rows still carry ``organization_id`` and vectors keep their ``organization_id`` filter and id prefix
(``services.storage.scoped``), as defence in depth.

Each organization database is migrated with the ``org`` stream (services.storage.migrate) when it is created, by
``memex migrate``, and when this process first opens it (so an upgraded service upgrades each organization on
its first request).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
import logging
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from services.errors import EmbeddingModelMismatch, NotFound
from services.ids import now_ms
from services.storage.migrate import ORG_DIR, applied, apply_pending, discover
from services.ports import SqlDatabase, Statement, VectorIndex
from services.storage.scoped import OrgSql, OrgVectors
from services.storage.pool import HandlePool, PooledDatabase, PooledIndex

__all__ = ["OrgStore", "OrgStores", "EmbeddedOrgStores", "RoutingTable", "OrgDatabaseStatus", "valid_org_id"]

log = logging.getLogger("memex.storage")

_ORG_ID = re.compile(r"^org_[a-z0-9_]{1,64}$")  # new_org_id makes org_ + 16 hex digits


def valid_org_id(org_id: str) -> str:
    """Organization ids become file and database names: only the shape ``new_org_id`` makes is accepted."""
    if not isinstance(org_id, str) or not _ORG_ID.match(org_id):
        raise NotFound("organization not found")
    return org_id


@dataclass
class OrgStore:
    """One organization's database and vector index (raw ports; services get ``sql``/``vectors``)."""

    org_id: str
    db: SqlDatabase
    index: VectorIndex
    migrated: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def sql(self) -> OrgSql:
        return OrgSql(self.db, self.org_id)

    @property
    def vectors(self) -> OrgVectors:
        return OrgVectors(self.index, self.org_id)


@dataclass(frozen=True)
class OrgDatabaseStatus:
    org_id: str
    backend: str
    location: str
    applied: list[str]
    pending: list[str]


class RoutingTable:
    """``org_databases`` in the control database."""

    def __init__(self, control: SqlDatabase) -> None:
        self.control = control

    async def get(self, org_id: str) -> dict[str, Any] | None:
        rows = (await self.control.execute("SELECT * FROM org_databases WHERE organization_id = ?", (org_id,))).rows
        return rows[0] if rows else None

    def insert(self, org_id: str, backend: str, location: str, *, account: str | None = None,
               vector_index: str | None = None, embedding_model: str | None = None) -> Statement:
        return Statement(
            "INSERT INTO org_databases (organization_id, backend, location, account, vector_index, schema_version, "
            "embedding_model, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (org_id, backend, location, account, vector_index, _latest(), embedding_model, now_ms()),
        )

    async def record_model(self, org_id: str, model: str, *, only_unset: bool = False) -> None:
        """The embedding model the organization's vectors are made with (``only_unset``: unless one is recorded)."""
        await self.control.execute(
            "UPDATE org_databases SET embedding_model = ? WHERE organization_id = ?"
            + (" AND embedding_model IS NULL" if only_unset else ""), (model, org_id))

    async def record_version(self, org_id: str, version: str | None) -> None:
        await self.control.execute("UPDATE org_databases SET schema_version = ? WHERE organization_id = ?",
                                   (version, org_id))

    async def delete(self, org_id: str) -> None:
        await self.control.execute("DELETE FROM org_databases WHERE organization_id = ?", (org_id,))

    async def org_ids(self) -> list[str]:
        rows = (await self.control.execute("SELECT organization_id FROM org_databases ORDER BY created_at")).rows
        return [r["organization_id"] for r in rows]

    async def all(self) -> list[dict[str, Any]]:
        return (await self.control.execute("SELECT * FROM org_databases ORDER BY created_at")).rows


#: How long an organization's recorded embedding model is trusted before it is read again: an instance of the old
#: model refuses an organization within this long of its reindex into a new one.
MODEL_RECHECK_SECONDS = 30.0


def _latest() -> str | None:
    found = discover(ORG_DIR)
    return found[-1].name if found else None


class OrgStores(Protocol):
    """Where organizations' data lives. ``provision`` makes an organization's database (before the control
    rows that name it are written: a crash in between leaves an unreferenced database, never a routed
    organization without one); ``statement`` is the routing row to write in the same batch as the
    organization; ``open`` hands out its store; ``drop`` removes the database and vectors."""

    control: SqlDatabase

    async def provision(self, org_id: str) -> Statement: ...

    async def discard(self, org_id: str) -> None: ...

    async def open(self, org_id: str, *, any_model: bool = False) -> OrgStore: ...

    async def adopt_model(self, org_id: str) -> None: ...

    async def drop(self, org_id: str) -> None: ...

    async def org_ids(self) -> list[str]: ...

    async def status(self) -> list[OrgDatabaseStatus]: ...

    async def close(self) -> None: ...


class _BaseStores(ABC):
    """What both backends share: the store cache, first-open migrations and status."""

    backend = "?"
    #: The embedding model this process makes vectors with, when the stores check each organization's recorded one
    #: (``org_databases.embedding_model``): the Worker backend, whose index does not expose its description. None:
    #: not checked here (the embedded vector file and Vectorize's description over REST record the model).
    model: str | None = None

    def __init__(self, control: SqlDatabase) -> None:
        self.control = control
        self.routing = RoutingTable(control)
        self._stores: dict[str, OrgStore] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        #: organization -> (its recorded embedding model, when to read the record again: time.monotonic())
        self._models: dict[str, tuple[str, float]] = {}

    @abstractmethod
    async def _make(self, org_id: str, route: dict[str, Any]) -> OrgStore:
        """The store of a routed organization (its database and index handles, not yet migrated here)."""

    async def open(self, org_id: str, *, any_model: bool = False) -> OrgStore:
        """The organization's store, migrated. With ``model`` set, an organization whose recorded embedding model
        is another raises ``EmbeddingModelMismatch`` (``any_model``: opened anyway, for ``memex reindex``)."""
        store = self._stores.get(org_id)
        if store is not None and store.migrated and self._model_fresh(org_id):
            self._refuse_foreign(org_id, any_model)
            return store
        lock = self._opening.setdefault(org_id, asyncio.Lock())
        async with lock:
            store = self._stores.get(org_id)
            route = None
            if store is None:
                route = await self.routing.get(valid_org_id(org_id))
                if route is None:
                    raise NotFound("organization not found")
                store = await self._make(org_id, route)
                self._stores[org_id] = store
            if not self._model_fresh(org_id):
                route = route or await self.routing.get(org_id)
                if route is None:  # deleted by another process since it was opened here
                    self._forget(org_id)
                    raise NotFound("organization not found")
                await self._learn_model(org_id, route)
            if not store.migrated:
                ran = await apply_pending(store.db, ORG_DIR)
                if ran:
                    log.info("organization %s: applied %s", org_id, ", ".join(ran))
                    await self.routing.record_version(org_id, ran[-1])
                store.migrated = True
        self._refuse_foreign(org_id, any_model)
        return store

    def _model_fresh(self, org_id: str) -> bool:
        if self.model is None:
            return True
        seen = self._models.get(org_id)
        return seen is not None and time.monotonic() < seen[1]

    async def _learn_model(self, org_id: str, route: dict[str, Any]) -> None:
        """Read (at most every ``MODEL_RECHECK_SECONDS``) the model the routing row records; a row from before the
        record existed takes this process's model (the first instance to open it decides)."""
        model = self.model
        if model is None:
            return
        recorded = route.get("embedding_model")
        if recorded is None:
            await self.routing.record_model(org_id, model, only_unset=True)
            fresh = await self.routing.get(org_id)
            recorded = (fresh or {}).get("embedding_model") or model
        self._models[org_id] = (str(recorded), time.monotonic() + MODEL_RECHECK_SECONDS)

    def _refuse_foreign(self, org_id: str, any_model: bool) -> None:
        if self.model is None or any_model:
            return
        recorded = self._models[org_id][0]
        if recorded != self.model:
            raise EmbeddingModelMismatch(
                f"this organization's vectors were made with the embedding model {recorded}; this instance embeds with "
                f"{self.model}: serve it from instances of {recorded}, or re-embed it by running `memex reindex --org "
                "SLUG` with this instance's settings",
                details={"recorded_model": recorded, "model": self.model})

    async def adopt_model(self, org_id: str) -> None:
        """After ``memex reindex`` re-embedded every chunk of the organization with this process's model: record it
        (instances of the old model refuse the organization from their next check on)."""
        if self.model is not None:
            await self.routing.record_model(org_id, self.model)
            self._models[org_id] = (self.model, time.monotonic() + MODEL_RECHECK_SECONDS)

    async def org_ids(self) -> list[str]:
        return await self.routing.org_ids()

    async def status(self) -> list[OrgDatabaseStatus]:
        out = []
        names = [m.name for m in discover(ORG_DIR)]
        for route in await self.routing.all():
            org_id = route["organization_id"]
            store = self._stores.get(org_id) or await self._make(org_id, route)
            self._stores[org_id] = store
            done = await applied(store.db)
            out.append(OrgDatabaseStatus(org_id, route["backend"], route["location"], sorted(done & set(names)),
                                         [n for n in names if n not in done]))
        return out

    def _forget(self, org_id: str) -> OrgStore | None:
        self._opening.pop(org_id, None)
        self._models.pop(org_id, None)
        return self._stores.pop(org_id, None)


class EmbeddedOrgStores(_BaseStores):
    """Per-organization SQLite files under ``<data dir>/orgs/``, at most ``max_open`` organizations open at once (a
    database and a vector file each: the pool holds twice as many handles)."""

    backend = "sqlite"

    def __init__(self, control: SqlDatabase, data_dir: Path, *, open_database: Callable[[Path], SqlDatabase],
                 open_index: Callable[[Path], VectorIndex], dimensions: int, max_open: int = 64) -> None:
        """``open_database(path)`` and ``open_index(path)`` make the adapters (the composition root chooses
        them); they run in a worker thread, and again whenever the pool reopens an evicted handle."""
        super().__init__(control)
        self.root = Path(data_dir) / "orgs"
        self.dimensions = dimensions
        self.open_database = open_database
        self.open_index = open_index
        self.pool = HandlePool(2 * max_open)  # an organization open is two handles: database and vectors

    def directory(self, org_id: str) -> Path:
        return self.root / valid_org_id(org_id)

    def _database(self, directory: Path) -> PooledDatabase:
        path, open_database = directory / "memex.sqlite3", self.open_database
        return PooledDatabase(self.pool, lambda: open_database(path))

    def _index(self, directory: Path) -> PooledIndex:
        path, open_index = directory / "vectors.sqlite3", self.open_index
        return PooledIndex(self.pool, lambda: open_index(path), self.dimensions)

    async def _make(self, org_id: str, route: dict[str, Any]) -> OrgStore:
        directory = self.root / route["location"]
        if not (directory / "memex.sqlite3").exists():
            raise NotFound("organization not found", details={"reason": "its database is missing"})
        return OrgStore(org_id, self._database(directory), self._index(directory))

    async def provision(self, org_id: str) -> Statement:
        directory = self.directory(org_id)
        directory.mkdir(parents=True, exist_ok=True)
        db = self._database(directory)
        try:
            await apply_pending(db, ORG_DIR)
        finally:
            await db.close()
        return self.routing.insert(org_id, self.backend, org_id)

    async def discard(self, org_id: str) -> None:
        """Remove a provisioned database whose organization was never written (a sign-up that lost a race)."""
        await asyncio.to_thread(shutil.rmtree, self.directory(org_id), True)

    async def drop(self, org_id: str) -> None:
        store = self._forget(org_id)
        if store is not None:
            for handle in (store.db, store.index):
                await handle.close()
        await self.routing.delete(org_id)
        await asyncio.to_thread(shutil.rmtree, self.directory(org_id), True)

    async def close(self) -> None:
        for store in list(self._stores.values()):
            for handle in (store.db, store.index):
                await handle.close()
        self._stores.clear()
