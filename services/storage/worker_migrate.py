"""``memex cloudflare migrate``: move a REST-backed Cloudflare deployment into the data-plane Worker's stores.

Two source layouts are read, both through the ``SqlDatabase`` port (D1 over the REST API):

* **One D1 database per organization** (this release's REST backend): the control database routes each
  organization (``org_databases``: backend ``d1``, location = its database's uuid). Each organization's database is
  moved whole into its Durable Object (``services.storage.move_org.move_database``: rows, rowids, FTS rows,
  counters; the counts proven on both sides), then its routing row is switched to ``worker`` / ``org:<id>``. The
  switch is the last step for each organization, so a run that stops anywhere is resumed by running again: switched
  organizations are skipped, a half-copied Durable Object is emptied and copied again.
* **One shared D1 database** (the release before per-organization databases): the legacy tables are matched with the
  new schemas (``services.storage.convert_plan.make_plan``, as the embedded converter does), the control rows are
  copied into the Worker's control database, and each organization's rows into its Durable Object, its routing row
  written last.

The control database: when the Worker's D1 binding is the same database as the REST deployment's control database
(``same_database`` checks, with a probe table), nothing is copied: only routing rows change. Otherwise the control
tables are copied once into the Worker's (migrated) control database, which must not already hold other
organizations.

Vectors do not move: the Worker binds the same Vectorize index, whose namespaces and ids (``<org>:<chunk>``) are
what both backends read. Stop writers (``memex serve`` on the REST backend) before migrating: a source that changes
during a copy is detected and the organization is left unswitched.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.ports import SqlDatabase, Statement
from services.storage.convert_copy import copy_control, copy_organization
from services.storage.convert_plan import ConversionError, make_plan
from services.storage.migrate import CONTROL_DIR, ORG_DIR, apply_pending
from services.storage.move_org import _empty, database_tables, move_database, table_counts
from services.storage.stores import RoutingTable
from services.storage.worker_stores import location_of

__all__ = ["MigrationReport", "migrate_to_worker", "same_database"]


@dataclass
class MigrationReport:
    layout: str  # "per-organization" or "shared"
    control: str  # "same database", "copied" or "already copied"
    moved: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "control": self.control, "moved": self.moved, "skipped": self.skipped,
                "rows": sum(sum(c.values()) for c in self.moved.values())}


async def _tables(db: SqlDatabase) -> set[str]:
    return {r["name"] for r in (await db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")).rows}


async def same_database(a: SqlDatabase, b: SqlDatabase) -> bool:
    """Whether ``a`` and ``b`` reach one database: a probe table made through ``a`` is looked for through ``b``."""
    name = f"memex_migrate_probe_{secrets.token_hex(6)}"
    await a.executescript(f"CREATE TABLE {name} (x INTEGER)")
    try:
        rows = (await b.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))).rows
    finally:
        await a.executescript(f"DROP TABLE {name}")
    return bool(rows)


async def _org_ids(db: SqlDatabase) -> list[str]:
    return [r["id"] for r in (await db.execute("SELECT id FROM organizations ORDER BY created_at, id")).rows]


def _switch(control: SqlDatabase, org_id: str, vector_index: str | None) -> list[Statement]:
    """The routing row that says "this organization lives in its Durable Object" (written last, in one batch)."""
    return [Statement("DELETE FROM org_databases WHERE organization_id = ?", (org_id,)),
            RoutingTable(control).insert(org_id, "worker", location_of(org_id), vector_index=vector_index)]


Progress = Callable[[str, str], None]


async def migrate_to_worker(source_control: SqlDatabase, open_source: Callable[[str], SqlDatabase],
                            dest_control: SqlDatabase, open_dest: Callable[[str], SqlDatabase], *,
                            vector_index: str, open_scratch: Callable[[Path], SqlDatabase],
                            only: list[str] | None = None, progress: Progress | None = None) -> MigrationReport:
    """Move every organization (or those in ``only``) of the REST deployment whose control database is
    ``source_control`` into the Worker (``dest_control``, ``open_dest("org:<id>")``, which hands out a migrated
    database). ``open_source(uuid)`` opens a per-organization D1 database; ``open_scratch(path)`` a local SQLite
    file (the shared layout's plan reads the new schemas from two scratch databases). Resumable; raises
    ``ConversionError`` when something would be lost."""
    note = progress or (lambda org, what: None)
    await apply_pending(dest_control, CONTROL_DIR)
    source_tables = await _tables(source_control)
    if "org_databases" in source_tables:
        return await _per_organization(source_control, open_source, dest_control, open_dest,
                                       vector_index=vector_index, only=only, note=note)
    if "documents" in source_tables and "organizations" in source_tables:
        return await _shared(source_control, dest_control, open_dest, open_scratch,
                             vector_index=vector_index, only=only, note=note)
    raise ConversionError("the source database is neither a control database (org_databases) nor a single shared "
                          "database (organizations + documents): check CLOUDFLARE_D1_DATABASE_ID")


async def _control(source: SqlDatabase, dest: SqlDatabase, copy: Callable[[], Any]) -> str:
    if await same_database(source, dest):
        return "same database"
    src_orgs, dest_orgs = await _org_ids(source), await _org_ids(dest)
    if dest_orgs and set(dest_orgs) - set(src_orgs):
        raise ConversionError("the Worker's control database already holds organizations the source does not "
                              f"({len(set(dest_orgs) - set(src_orgs))}): it is another deployment's; refusing to mix")
    if dest_orgs and set(dest_orgs) == set(src_orgs):
        return "already copied"
    await copy()
    return "copied"


async def _per_organization(source_control: SqlDatabase, open_source: Callable[[str], SqlDatabase],
                            dest_control: SqlDatabase, open_dest: Callable[[str], SqlDatabase], *,
                            vector_index: str, only: list[str] | None, note: Progress) -> MigrationReport:
    async def copy() -> None:
        await move_database(source_control, dest_control, where="control")

    report = MigrationReport("per-organization", await _control(source_control, dest_control, copy))
    routes = (await dest_control.execute("SELECT * FROM org_databases ORDER BY created_at")).rows
    for route in routes:
        org_id = route["organization_id"]
        if only is not None and org_id not in only:
            continue
        if route["backend"] == "worker":
            report.skipped.append(org_id)
            note(org_id, "already in the Worker")
            continue
        if route["backend"] != "d1":
            raise ConversionError(f"organization {org_id}: routed to backend {route['backend']!r}, not D1")
        if route.get("vector_index") and route["vector_index"] != vector_index:
            raise ConversionError(f"organization {org_id}: its vectors are in index {route['vector_index']!r}, the "
                                  f"Worker binds {vector_index!r} (bind that index, or reindex after migrating)")
        note(org_id, "copying")
        counts = await move_database(open_source(route["location"]), open_dest(location_of(org_id)), where=org_id)
        await dest_control.batch(_switch(dest_control, org_id, vector_index))
        report.moved[org_id] = counts
        note(org_id, f"moved {sum(counts.values())} rows")
    return report


async def _shared(legacy: SqlDatabase, dest_control: SqlDatabase, open_dest: Callable[[str], SqlDatabase],
                  open_scratch: Callable[[Path], SqlDatabase], *,
                  vector_index: str, only: list[str] | None, note: Progress) -> MigrationReport:
    with tempfile.TemporaryDirectory() as tmp:
        control_t, org_t = open_scratch(Path(tmp) / "control.sqlite3"), open_scratch(Path(tmp) / "org.sqlite3")
        try:
            await apply_pending(control_t, CONTROL_DIR)
            await apply_pending(org_t, ORG_DIR)
            plan = await make_plan(legacy, control_t, org_t)
        finally:
            await control_t.close()
            await org_t.close()

    async def copy() -> None:
        if any((await table_counts(dest_control, plan.control)).values()):
            await _empty(dest_control, plan.control)
        await copy_control(legacy, dest_control, plan)

    report = MigrationReport("shared", await _control(legacy, dest_control, copy))
    routed = {r["organization_id"] for r in (await dest_control.execute(
        "SELECT organization_id FROM org_databases")).rows}
    for org_id in plan.organizations:
        if only is not None and org_id not in only:
            continue
        if org_id in routed:
            report.skipped.append(org_id)
            note(org_id, "already in the Worker")
            continue
        note(org_id, "copying")
        dest = open_dest(location_of(org_id))  # migrated (a Durable Object migrates itself on first use)
        tables = await database_tables(dest, dest)
        if any((await table_counts(dest, tables)).values()):
            await _empty(dest, tables)
        counts = await copy_organization(legacy, dest, plan, org_id)
        await dest_control.batch(_switch(dest_control, org_id, vector_index))
        report.moved[org_id] = counts
        note(org_id, f"moved {sum(counts.values())} rows")
    return report
