"""Conversion of a single-database data directory into one database per organization, nothing lost.

Releases before one database per organization kept every organization in one SQLite file (``memex.sqlite3``,
the schema of migrations/legacy/0001..0010) and every vector in one local index (``vectors.sqlite3``, one
namespace per organization, ids ``<org id>:<chunk id>``). ``convert_on_start`` (called by ``Memex.start``, so
by ``memex serve`` before it serves and by ``memex migrate``) turns such a data directory into the current
layout:

1. The legacy database is brought up to the last legacy migration (a directory from an older release may be
   behind): the copy below reads the schema 0010 left.
2. The new layout is built in ``<data dir>/.converting/``: ``control.sqlite3`` (the control stream) with every
   row of the control tables plus one ``org_databases`` routing row per organization (backend ``sqlite``,
   location = the organization id), and ``orgs/<org id>/memex.sqlite3`` (the org stream) with the organization's
   rows of every organization table, beside ``orgs/<org id>/vectors.sqlite3`` with its vectors (a
   LocalVectorIndex with the legacy index's model and dimensions; ids, values and metadata copied as they are,
   through the index's API).
3. Moved into place: ``.converting/orgs`` becomes ``orgs``, then ``.converting/control.sqlite3`` becomes
   ``control.sqlite3`` LAST: a control database with its schema in it means "converted". The old files are then
   renamed ``memex.sqlite3.pre-per-org`` and ``vectors.sqlite3.pre-per-org``. **They are the operator's backup**:
   the service never reads them again; delete them once the converted service has been checked.

Restartable: until the control file lands, the legacy files are untouched (beyond step 1's migrations) and the
next start deletes ``.converting/`` (and an ``orgs/`` left by a crash between the two renames) and starts over.
After it lands, a start that finds ``.converting/`` and the legacy files finishes the backup renames. A lock
file (``.converting.lock``) keeps two processes from converting the same directory at once, and the legacy files
are held write-locked while they are copied: a process still writing to them (an older server) makes the
conversion stop with a message rather than lose what it writes. The service's own handle on ``control.sqlite3``
(opened, blank, before ``start``) is closed during the conversion and pointed at the converted file afterwards.

What is copied, and how:

* Every row of every table, by column name. The new tables have the columns legacy 0010 left them; a legacy
  column the new table lacks stops the conversion with a message naming it (nothing is dropped silently), and
  so does a legacy table that neither new schema has.
* Implicit rowids are kept (``documents``' and the other rowid tables', and the FTS rowids), as are INTEGER
  PRIMARY KEYs: ``chunks.pk`` is ``chunks_fts``' rowid and ``documents_fts_keys.pk`` is ``documents_fts``' rowid
  (services/search/search.py joins on them).
* Triggers: the new schemas keep derived rows by triggers (``documents`` inserts write ``documents_fts_keys``,
  ``documents_fts`` and ``tag_counts``; ``chunks`` inserts write ``chunks_fts``). Copying through them would
  renumber ``documents_fts_keys.pk`` and recount ``tag_counts``; so each new database's triggers are dropped
  while its rows are copied verbatim (``tag_counts`` and ``documents_fts_keys`` included) and re-created,
  from their own SQL, before the database is used. The FTS5 tables are copied row by row with their rowids
  (an organization's keyword rows are looked up by the keys of its copied ``chunks`` / ``documents_fts_keys``
  rows, see ``FTS_KEYS``, not by scanning the index), then checked with FTS5's ``integrity-check``; every
  table's row count is checked against what was read.
* AUTOINCREMENT counters (``sqlite_sequence``): ``jobs`` and ``key_revocations`` continue from the legacy
  counter (every organization database's ``jobs`` counter starts at the deployment-wide one), so no id is ever
  handed out twice, as AUTOINCREMENT promises.
* Not copied: ``d1_migrations`` (each new database records its own stream; the legacy history stays in the
  backup), ``sqlite_sequence`` itself (carried as counters), FTS5's shadow tables (FTS5 writes them), D1's
  internal ``_cf_*`` tables.
* Rows that belong to no organization (leftovers of deleted organizations in tables without a foreign key to
  ``organizations``: chunks, jobs, keyword rows, ...; vectors in a namespace that is no organization) are not
  carried over: no organization could ever read them. They are counted in the log and the report and stay in
  the ``.pre-per-org`` backup. Control tables without such a foreign key (``llm_usage``, ``key_revocations``,
  whose rows name deleted organizations on purpose) are copied whole.

The copying (``make_plan``, ``copy_control``, ``copy_organization``) is written against the ``SqlDatabase`` port
only: it reads pages of at most ``ROWS_PER_BATCH`` rows by keyset (an index that leads with
``organization_id``, else the rowid) and writes them in batches of multi-row INSERTs of at most ``MAX_PARAMS``
bound parameters each (D1's limit) and about ``BATCH_BYTES`` of values, so the same code can read a legacy D1
database and write D1 databases. Only the embedded case is wired (``convert_data_dir``).

Converting a single-D1 deployment (not built): stop writers first (the legacy D1 database must not change
during the copy), then

* create a control D1 database, apply the control stream, ``copy_control(legacy D1, control D1, plan)``;
* per organization: create a D1 database (the D1 admin API, as ``D1OrgStores.provision`` does), apply the org
  stream, ``copy_organization(legacy D1, org D1, plan, org_id)``, then write its routing row (backend ``d1``,
  location = the new database's uuid, account, vector_index = the existing Vectorize index) into the new
  control database last: a routing row means "this organization is complete";
* vectors do not move: the shared Vectorize index already keeps one namespace per organization with ids
  ``<org id>:<chunk id>``, which is what the new layout reads;
* switch ``CLOUDFLARE_D1_DATABASE_ID`` to the new control database (the atomic step) and keep the legacy
  database as the backup. An interrupted run is resumed by deleting the organization databases that have no
  routing row (or the whole new control database) and running again. Unverified on D1: that ``sqlite_sequence``
  may be written (if refused, advance a counter by inserting and deleting a row with the legacy value as id),
  and the PRAGMAs read here (table_info, index_list, index_info, foreign_key_list).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.errors import NotFound
from services.storage.migrate import CONTROL_DIR, LEGACY_DIR, ORG_DIR, apply_pending
from services.ports import SqlDatabase, SqlValue, Statement, VectorIndex
from services.storage.stores import RoutingTable, valid_org_id

__all__ = ["ConversionError", "ConversionReport", "Plan", "Table", "convert_on_start", "convert_data_dir",
           "make_plan", "copy_control", "copy_organization", "after_organization", "BACKUP_SUFFIX", "STAGING_NAME"]

log = logging.getLogger("memex.convert")

LEGACY_DB = "memex.sqlite3"
LEGACY_VECTORS = "vectors.sqlite3"
CONTROL_DB = "control.sqlite3"
ORG_DB = "memex.sqlite3"
ORG_VECTORS = "vectors.sqlite3"
#: Appended to the legacy files once converted: they stay as the operator's backup.
BACKUP_SUFFIX = ".pre-per-org"
#: The staging folder inside the data directory.
STAGING_NAME = ".converting"
LOCK_NAME = ".converting.lock"
#: How long the conversion waits for another writer of the legacy files before giving up.
LEGACY_LOCK_WAIT = 10.0

#: ``open_database(path)``: an embedded SqlDatabase on a file (the composition root passes SqliteDatabase).
OpenDatabase = Callable[[Path], SqlDatabase]
#: ``open_index(path, dimensions=, model=)``: a local vector index on a file that never resets a mismatching one
#: (the composition root passes LocalVectorIndex; it also needs ``ids_in_namespace``).
OpenIndex = Callable[..., VectorIndex]

#: Rows read per page and written per batch.
ROWS_PER_BATCH = 200
#: Bound parameters per statement (D1's limit).
MAX_PARAMS = 100
#: A batch is cut once its values reach about this many bytes (one row larger than this is a batch alone).
BATCH_BYTES = 1_000_000
VECTORS_PER_BATCH = 200

#: Each FTS5 table's rowids are the keys of an ordinary table's rows (what the triggers write): an
#: organization's keyword rows are read by those keys. An FTS5 table missing here is read by scanning it.
FTS_KEYS: dict[str, tuple[str, str]] = {"chunks_fts": ("chunks", "pk"), "documents_fts": ("documents_fts_keys", "pk")}

#: Legacy tables deliberately not copied as rows (see the module docstring).
_NOT_COPIED = {"d1_migrations"}
_FTS5_SHADOWS = ("data", "idx", "content", "docsize", "config")
_ROWID = "__rowid__"


class ConversionError(RuntimeError):
    """The legacy data cannot be converted without losing something; nothing was moved."""


def after_organization(org_id: str, done: int, total: int) -> None:
    """Called after each organization is converted, before the next (a seam: tests raise here to simulate a
    crash mid-conversion)."""


@dataclass(frozen=True)
class Table:
    """How one legacy table is copied."""

    name: str
    #: The legacy columns, copied by name.
    columns: tuple[str, ...]
    fts5: bool = False
    #: A rowid table (or FTS5): pages carry the rowid.
    has_rowid: bool = True
    #: The rowid is not an INTEGER PRIMARY KEY column: it is written explicitly.
    copy_rowid: bool = False
    #: Split by organization (an organization-database table) or copied whole (control).
    by_org: bool = False
    #: The keyset pages are read in (``rowid`` or column names), after the organization_id equality.
    order: tuple[str, ...] = ("rowid",)
    #: (column, parent table, parent column): only rows whose parent exists are copied (control tables' foreign keys).
    parents: tuple[tuple[str, str, str], ...] = ()
    #: FTS5 tables: the ordinary table and column whose values are this table's rowids.
    keys: tuple[str, str] | None = None


@dataclass
class Plan:
    control: list[Table]
    org: list[Table]
    organizations: list[str]
    #: Legacy AUTOINCREMENT counters (sqlite_sequence), d1_migrations' left out.
    sequences: dict[str, int]
    #: Legacy tables not copied as rows, each with the reason.
    ignored: dict[str, str]


@dataclass
class ConversionReport:
    organizations: list[str] = field(default_factory=list)
    #: Legacy migrations applied before converting.
    legacy_migrations: list[str] = field(default_factory=list)
    #: Rows copied per table (control and all organizations together).
    rows: dict[str, int] = field(default_factory=dict)
    #: Rows per table that belong to no organization: not carried over, kept in the backup.
    left_behind: dict[str, int] = field(default_factory=dict)
    vectors: int = 0
    vectors_left_behind: int = 0
    ignored: dict[str, str] = field(default_factory=dict)
    backups: list[Path] = field(default_factory=list)


# -- schema ----------------------------------------------------------------------------------------


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@dataclass
class _Shape:
    name: str
    sql: str
    columns: list[dict[str, Any]]
    indexes: list[list[str]]  # unique, non-partial indexes' columns (None for an expression)

    @property
    def names(self) -> list[str]:
        return [c["name"] for c in self.columns]

    @property
    def virtual(self) -> bool:
        return self.sql.lstrip().upper().startswith("CREATE VIRTUAL TABLE")

    @property
    def fts5(self) -> bool:
        return self.virtual and "USING FTS5" in " ".join(self.sql.upper().split())

    @property
    def without_rowid(self) -> bool:
        return "WITHOUT ROWID" in " ".join(self.sql.upper().split())

    @property
    def rowid_alias(self) -> str | None:
        pks = [c for c in self.columns if c["pk"]]
        if len(pks) == 1 and (pks[0]["type"] or "").upper() == "INTEGER" and not self.without_rowid:
            return pks[0]["name"]
        return None

    def notnull(self, column: str) -> bool:
        return any(c["name"] == column and (c["notnull"] or c["name"] == self.rowid_alias) for c in self.columns)


async def _shapes(db: SqlDatabase) -> dict[str, _Shape]:
    out = {}
    for r in (await db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' ORDER BY name")).rows:
        name, sql = r["name"], r["sql"] or ""
        columns = (await db.execute(f"PRAGMA table_info({_q(name)})")).rows
        indexes = []
        if not sql.lstrip().upper().startswith("CREATE VIRTUAL TABLE") and not name.startswith("sqlite_"):
            for ix in (await db.execute(f"PRAGMA index_list({_q(name)})")).rows:
                if ix["unique"] and not ix.get("partial"):
                    info = (await db.execute(f"PRAGMA index_info({_q(ix['name'])})")).rows
                    indexes.append([i["name"] for i in sorted(info, key=lambda i: i["seqno"])])
        out[name] = _Shape(name, sql, columns, indexes)
    return out


async def _parents(db: SqlDatabase, table: str) -> list[tuple[str, str, str]]:
    rows = (await db.execute(f"PRAGMA foreign_key_list({_q(table)})")).rows
    return [(r["from"], r["table"], r["to"]) for r in rows if r["to"]]


def _order(shape: _Shape, by_org: bool) -> tuple[str, ...]:
    """Keyset columns: a unique index leading with organization_id (its other columns) when splitting by
    organization, else the rowid, else (WITHOUT ROWID) the primary key."""
    if by_org:
        fits = [ix for ix in shape.indexes
                if ix and None not in ix and ix[0] == "organization_id" and all(shape.notnull(c) for c in ix[1:])]
        if fits:
            return tuple(min(fits, key=len)[1:])
    if shape.fts5 or not shape.without_rowid:
        return ("rowid",)
    return tuple(c["name"] for c in sorted((c for c in shape.columns if c["pk"]), key=lambda c: c["pk"]))


def _topological(tables: list[Table]) -> list[Table]:
    """Parents before children (foreign keys are enforced while copying)."""
    by_name = {t.name: t for t in tables}
    done: list[Table] = []
    seen: set[str] = set()

    def visit(t: Table) -> None:
        if t.name in seen:
            return
        seen.add(t.name)
        for _, parent, _ in t.parents:
            if parent in by_name and parent != t.name:
                visit(by_name[parent])
        done.append(t)

    for t in tables:
        visit(t)
    return done


async def make_plan(legacy: SqlDatabase, control: SqlDatabase, org_template: SqlDatabase) -> Plan:
    """Match every legacy table with its new home: ``control`` (migrated with the control stream) or an
    organization database (``org_template``, migrated with the org stream). Raises ``ConversionError`` when a
    table has no home or a column would be dropped."""
    old, new_control, new_org = await _shapes(legacy), await _shapes(control), await _shapes(org_template)
    shadows = {f"{name}_{s}" for name, shape in old.items() if shape.fts5 for s in _FTS5_SHADOWS}
    ignored: dict[str, str] = {}
    problems: list[str] = []
    control_tables: list[Table] = []
    org_tables: list[Table] = []
    for name, shape in old.items():
        if name == "sqlite_sequence":
            ignored[name] = "AUTOINCREMENT counters: carried over as counters"
            continue
        if name.startswith("sqlite_") or name.startswith("_cf_"):
            ignored[name] = "SQLite's / D1's own table"
            continue
        if name in _NOT_COPIED:
            ignored[name] = "each new database records its own migrations; the legacy history stays in the backup"
            continue
        if name in shadows:
            ignored[name] = "FTS5 shadow table, written by FTS5 itself"
            continue
        homes = [s for s in (new_control.get(name), new_org.get(name)) if s is not None]
        if not homes:
            problems.append(f"table {name!r} exists in the legacy database but in neither the control nor the "
                            "organization schema (the service never used it: move or drop it, then start again)")
            continue
        if len(homes) == 2:
            problems.append(f"table {name!r} is in both the control and the organization schema")
            continue
        target = homes[0]
        by_org = target is new_org.get(name)
        if shape.virtual and not shape.fts5:
            problems.append(f"table {name!r} is a virtual table of a module the converter does not copy")
            continue
        if shape.fts5 != target.fts5:
            problems.append(f"table {name!r}: FTS5 in one schema and not in the other")
            continue
        dropped = [c for c in shape.names if c not in target.names]
        if dropped:
            problems.append(f"table {name!r}: the new schema has no column {', '.join(map(repr, dropped))}; "
                            "converting would drop it")
        for c in target.columns:
            new_only = c["name"] not in shape.names and c["name"] != target.rowid_alias
            if new_only and c["notnull"] and c["dflt_value"] is None:
                problems.append(f"table {name!r}: new column {c['name']!r} is NOT NULL without a default")
        if by_org and "organization_id" not in shape.names:
            problems.append(f"table {name!r} belongs in each organization's database but has no organization_id: "
                            "its rows cannot be split by organization")
            continue
        has_rowid = shape.fts5 or not shape.without_rowid
        table = Table(
            name=name, columns=tuple(shape.names), fts5=shape.fts5, has_rowid=has_rowid,
            copy_rowid=has_rowid and shape.rowid_alias is None, by_org=by_org, order=_order(shape, by_org),
            parents=() if by_org else tuple(p for p in await _parents(control, name) if p[1] in old),
            keys=FTS_KEYS.get(name) if shape.fts5 and by_org else None,
        )
        (org_tables if by_org else control_tables).append(table)
    for t in org_tables:
        if t.keys and t.keys[0] not in {o.name for o in org_tables}:
            problems.append(f"table {t.name!r}: its keys table {t.keys[0]!r} is not copied")
    if problems:
        raise ConversionError("the single-database layout cannot be converted without losing data: "
                              + "; ".join(problems))
    organizations = [r["id"] for r in (await legacy.execute(
        "SELECT id FROM organizations ORDER BY created_at, id")).rows]
    for org_id in organizations:
        try:
            valid_org_id(org_id)
        except NotFound:
            raise ConversionError(f"organization id {org_id!r} cannot name a database (expected org_ + lower-case "
                                  "letters, digits or _)") from None
    sequences = {}
    if "sqlite_sequence" in old:
        sequences = {r["name"]: r["seq"] for r in (await legacy.execute("SELECT name, seq FROM sqlite_sequence")).rows
                     if r["name"] not in _NOT_COPIED}
    # ordinary tables first: an FTS5 table is read by its keys table's copied rows
    org_tables.sort(key=lambda t: (t.fts5, t.name))
    return Plan(_topological(control_tables), org_tables, organizations, sequences, ignored)


# -- copying (the SqlDatabase port only) -------------------------------------------------------------


async def _pages(db: SqlDatabase, table: Table, org_id: str | None) -> AsyncIterator[list[dict[str, Any]]]:
    select = ([f"rowid AS {_ROWID}"] if table.has_rowid else []) + [_q(c) for c in table.columns]
    where: list[str] = []
    params: list[SqlValue] = []
    if org_id is not None:
        where.append('"organization_id" = ?')
        params.append(org_id)
    for column, parent, parent_column in table.parents:
        where.append(f"{_q(column)} IN (SELECT {_q(parent_column)} FROM {_q(parent)})")
    order = ["rowid" if k == "rowid" else _q(k) for k in table.order]
    last: list[SqlValue] | None = None
    while True:
        w, p = list(where), list(params)
        if last is not None:
            marks = ", ".join("?" * len(order))
            w.append(f"{order[0]} > ?" if len(order) == 1 else f"({', '.join(order)}) > ({marks})")
            p.extend(last)
        sql = f"SELECT {', '.join(select)} FROM {_q(table.name)}"
        if w:
            sql += " WHERE " + " AND ".join(w)
        if order:
            sql += " ORDER BY " + ", ".join(order)
        rows = (await db.execute(sql + f" LIMIT {ROWS_PER_BATCH}", p)).rows
        if rows:
            yield rows
        if len(rows) < ROWS_PER_BATCH or not order:
            return
        last = [rows[-1][_ROWID] if k == "rowid" else rows[-1][k] for k in table.order]


def _size(values: Sequence[SqlValue]) -> int:
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in values)


async def _write(db: SqlDatabase, table: Table, rows: list[dict[str, Any]]) -> None:
    columns = (["rowid"] if table.copy_rowid else []) + [_q(c) for c in table.columns]
    per_statement = max(1, MAX_PARAMS // len(columns))
    head = f"INSERT INTO {_q(table.name)} ({', '.join(columns)}) VALUES "
    marks = "(" + ", ".join("?" * len(columns)) + ")"
    batch: list[Statement] = []
    size = 0
    for i in range(0, len(rows), per_statement):
        part = rows[i:i + per_statement]
        params: list[SqlValue] = []
        for r in part:
            if table.copy_rowid:
                params.append(r[_ROWID])
            params.extend(r[c] for c in table.columns)
        batch.append(Statement(head + ", ".join([marks] * len(part)), tuple(params)))
        size += _size(params)
        if size >= BATCH_BYTES:
            await db.batch(batch)
            batch, size = [], 0
    if batch:
        await db.batch(batch)


async def _copy_fts(legacy: SqlDatabase, db: SqlDatabase, table: Table, org_id: str) -> int:
    """An organization's rows of an FTS5 table: those whose rowid is a key of its copied keys table."""
    keys_table, key = table.keys  # type: ignore[misc]
    select = ", ".join([f"rowid AS {_ROWID}"] + [_q(c) for c in table.columns])
    copied, last = 0, None
    while True:
        sql = f"SELECT {_q(key)} AS k FROM {_q(keys_table)}"
        rows = (await db.execute(sql + (f" WHERE {_q(key)} > ?" if last is not None else "")
                                 + f" ORDER BY {_q(key)} LIMIT {ROWS_PER_BATCH}", () if last is None else (last,))).rows
        if not rows:
            return copied
        ids = [r["k"] for r in rows]
        found = (await legacy.execute(
            f"SELECT {select} FROM {_q(table.name)} WHERE rowid IN (SELECT value FROM json_each(?)) "
            "AND organization_id = ? ORDER BY rowid", (json.dumps(ids), org_id))).rows
        if found:
            await _write(db, table, found)
        copied += len(found)
        if len(rows) < ROWS_PER_BATCH:
            return copied
        last = ids[-1]


async def _without_triggers(db: SqlDatabase) -> list[str]:
    """Drop ``db``'s triggers (rows are copied verbatim, derived rows included); returns their SQL."""
    rows = (await db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' ORDER BY rowid")).rows
    if rows:
        await db.batch([Statement(f"DROP TRIGGER {_q(r['name'])}") for r in rows])
    return [r["sql"] for r in rows]


async def _set_sequences(db: SqlDatabase, sequences: dict[str, int], tables: Sequence[Table]) -> None:
    names = {t.name for t in tables}
    statements = []
    for name, seq in sequences.items():
        if name in names:
            statements += [
                Statement("UPDATE sqlite_sequence SET seq = ? WHERE name = ? AND seq < ?", (seq, name, seq)),
                Statement("INSERT INTO sqlite_sequence (name, seq) SELECT ?, ? "
                          "WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = ?)", (name, seq, name)),
            ]
    if statements:
        await db.batch(statements)


async def _check(db: SqlDatabase, tables: Sequence[Table], counts: dict[str, int], where: str) -> None:
    for t in tables:
        n = (await db.execute(f"SELECT COUNT(*) AS n FROM {_q(t.name)}")).rows[0]["n"]
        if n != counts[t.name]:
            raise ConversionError(f"{where}: {t.name} holds {n} rows after copying {counts[t.name]}")
        if t.fts5:
            await db.execute(f"INSERT INTO {_q(t.name)}({_q(t.name)}) VALUES ('integrity-check')")


async def _copy(legacy: SqlDatabase, db: SqlDatabase, tables: Sequence[Table], org_id: str | None,
                sequences: dict[str, int], where: str) -> dict[str, int]:
    triggers = await _without_triggers(db)
    counts: dict[str, int] = {}
    for t in tables:
        if t.keys is not None and org_id is not None:
            counts[t.name] = await _copy_fts(legacy, db, t, org_id)
            continue
        n = 0
        async for rows in _pages(legacy, t, org_id):
            await _write(db, t, rows)
            n += len(rows)
        counts[t.name] = n
    await _set_sequences(db, sequences, tables)
    if triggers:
        await db.batch([Statement(sql) for sql in triggers])
    await _check(db, tables, counts, where)
    return counts


async def copy_control(legacy: SqlDatabase, control: SqlDatabase, plan: Plan) -> dict[str, int]:
    """Every row of the control tables into ``control`` (migrated, empty); rows per table."""
    return await _copy(legacy, control, plan.control, None, plan.sequences, "control")


async def copy_organization(legacy: SqlDatabase, db: SqlDatabase, plan: Plan, org_id: str) -> dict[str, int]:
    """The organization's rows of every organization table into ``db`` (migrated, empty); rows per table."""
    return await _copy(legacy, db, plan.org, org_id, plan.sequences, f"organization {org_id}")


async def left_behind(legacy: SqlDatabase, plan: Plan, copied: dict[str, int]) -> dict[str, int]:
    """Rows per table that were not copied (they belong to no organization)."""
    out = {}
    for t in [*plan.control, *plan.org]:
        total = (await legacy.execute(f"SELECT COUNT(*) AS n FROM {_q(t.name)}")).rows[0]["n"]
        if total != copied.get(t.name, 0):
            out[t.name] = total - copied.get(t.name, 0)
    return out


# -- the embedded data directory -----------------------------------------------------------------------


def _sidecars(path: Path) -> list[Path]:
    return [path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal")]


def _single_file(path: Path) -> None:
    """Fold a SQLite file's WAL into it and leave it in rollback-journal mode: one self-contained file that can be
    renamed alone (the service turns WAL back on when it opens it)."""
    conn = sqlite3.connect(path, timeout=30.0)
    try:
        conn.execute("PRAGMA journal_mode = DELETE").fetchone()
    finally:
        conn.close()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _blank(path: Path) -> bool:
    """Does the control database at ``path`` hold nothing (absent, or only the empty file the service's own
    handle created, maybe with an empty d1_migrations)?"""
    if not path.exists():
        return True
    conn = sqlite3.connect(path, timeout=30.0)
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        if names - {"d1_migrations", "sqlite_sequence"}:
            return False
        return "d1_migrations" not in names or conn.execute("SELECT COUNT(*) FROM d1_migrations").fetchone()[0] == 0
    finally:
        conn.close()


def _keep_backups(data_dir: Path) -> list[Path]:
    """Rename the legacy files (and any sidecar) to ``<name>.pre-per-org``, never over an existing file."""
    kept = []
    for name in (LEGACY_DB, LEGACY_VECTORS):
        src = data_dir / name
        if not src.exists():
            continue
        try:
            _single_file(src)
        except sqlite3.Error as exc:  # someone holds it: its WAL and shared memory move with it instead
            log.warning("could not fold %s's WAL into it (%s): renaming its -wal/-shm with it", src, exc)
        dst = data_dir / (name + BACKUP_SUFFIX)
        n = 1
        while dst.exists():
            dst = data_dir / f"{name}{BACKUP_SUFFIX}.{n}"
            n += 1
        for side_src, side_dst in zip(_sidecars(src), _sidecars(dst)):
            if side_src.exists():
                os.replace(side_src, side_dst)
        os.replace(src, dst)
        kept.append(dst)
    _fsync_dir(data_dir)
    if kept:
        log.warning("the single-database files are kept as %s: a backup the service no longer reads; delete them "
                    "once the converted data has been checked", " and ".join(str(p) for p in kept))
    return kept


class _WriteGuard:
    """Holds a write lock (``BEGIN IMMEDIATE``, readers still read) on the legacy files while they are copied, so
    nothing (an old server still running, an operator's shell) can write to them unseen; such a writer waits,
    then fails with "database is locked"."""

    def __init__(self) -> None:
        self.conns: list[sqlite3.Connection] = []

    def hold(self, path: Path) -> None:
        conn = sqlite3.connect(path, timeout=LEGACY_LOCK_WAIT, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            conn.close()
            raise ConversionError(f"{path} is being written by another process ({exc}): stop every process using "
                                  "this data directory (an older server?) and start again") from None
        self.conns.append(conn)

    def release(self) -> None:
        while self.conns:
            conn = self.conns.pop()
            try:
                conn.execute("ROLLBACK")
            finally:
                conn.close()


def _read_vector_meta(path: Path) -> tuple[str, int] | None:
    """The legacy vector index's model and dimensions (None: no index, or one without usable meta)."""
    if not path.exists():
        return None
    conn = sqlite3.connect(path, timeout=30.0)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        model, dims = meta.get("model"), meta.get("dimensions")
        if not model or not str(dims).isdigit() or int(dims) < 1:
            return None
        return model, int(dims)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


async def _copy_vectors(source: Any, open_index: OpenIndex, path: Path, org_id: str, model: str) -> int:
    """The organization's namespace of the legacy index into a new index at ``path`` (same model and dimensions):
    ids, values and metadata as they are."""
    ids = sorted(await source.ids_in_namespace(org_id))
    target = await asyncio.to_thread(open_index, path, dimensions=source.dimensions, model=model)
    try:
        for i in range(0, len(ids), VECTORS_PER_BATCH):
            await target.upsert(await source.get_by_ids(ids[i:i + VECTORS_PER_BATCH]))
        count = (await target.info()).vector_count
        if count != len(ids):
            raise ConversionError(f"organization {org_id}: {count} vectors written of {len(ids)}")
    finally:
        await target.close()
    return len(ids)


def _clear_staging(data_dir: Path) -> None:
    staging = data_dir / STAGING_NAME
    if staging.exists():
        log.info("removing %s left by an interrupted conversion", staging)
        shutil.rmtree(staging)
    orgs = data_dir / "orgs"
    if orgs.exists():  # only a crash between the two renames leaves one beside an unconverted layout
        log.warning("removing %s left by an interrupted conversion (the control database never landed)", orgs)
        shutil.rmtree(orgs)


async def convert_data_dir(data_dir: Path, *, open_database: OpenDatabase, open_index: OpenIndex,
                           model: str | None = None, dimensions: int | None = None) -> ConversionReport:
    """Convert ``data_dir`` (``memex.sqlite3`` and ``vectors.sqlite3`` of the single-database layout) into the
    control database plus one database and vector file per organization, building it in ``.converting/`` and
    moving it into place, the control database last.

    The legacy files are then renamed ``memex.sqlite3.pre-per-org`` and ``vectors.sqlite3.pre-per-org`` and kept
    as the operator's backup (the service never reads them again; delete them once satisfied). They also keep the
    rows that belong to no organization, which are not carried over (counted in the report and the log).

    ``model`` and ``dimensions`` are the service's embedder's, only to warn when the copied vectors were made by
    another model (the service then discards and re-embeds them on first open, as before). The caller holds no
    handle on ``control.sqlite3``. Restartable: see the module docstring. ``open_database`` and ``open_index`` make
    the adapters (services never choose them)."""
    data_dir = Path(data_dir)
    staging = data_dir / STAGING_NAME
    _clear_staging(data_dir)
    (staging / "orgs").mkdir(parents=True)
    report = ConversionReport()
    handles: list[Any] = []
    guard = _WriteGuard()

    async def close_all() -> None:
        while handles:
            await handles.pop().close()

    try:
        legacy = open_database(data_dir / LEGACY_DB)
        handles.append(legacy)
        report.legacy_migrations = await apply_pending(legacy, LEGACY_DIR)
        if report.legacy_migrations:
            log.info("legacy database brought up to date first: %s", ", ".join(report.legacy_migrations))
        control = open_database(staging / CONTROL_DB)
        handles.append(control)
        await apply_pending(control, CONTROL_DIR)
        guard.hold(data_dir / LEGACY_DB)  # after its migrations: from here on only read
        template = open_database(staging / "template.sqlite3")
        try:
            await apply_pending(template, ORG_DIR)
            plan = await make_plan(legacy, control, template)
        finally:
            await template.close()
        for p in [staging / "template.sqlite3", *_sidecars(staging / "template.sqlite3")]:
            p.unlink(missing_ok=True)
        report.ignored = plan.ignored
        log.info("not copied as rows: %s", "; ".join(f"{name} ({why})" for name, why in sorted(plan.ignored.items())))
        total = len(plan.organizations)
        log.info("converting the single-database layout in %s: %d organizations", data_dir, total)

        report.rows.update(await copy_control(legacy, control, plan))

        source = None
        meta = _read_vector_meta(data_dir / LEGACY_VECTORS)
        legacy_model = meta[0] if meta is not None else ""
        if meta is not None:
            source = await asyncio.to_thread(open_index, data_dir / LEGACY_VECTORS, model=meta[0],
                                             dimensions=meta[1])
            handles.append(source)
            guard.hold(data_dir / LEGACY_VECTORS)  # after the index's own open (it writes its meta there)
            if model is not None and (meta[0], meta[1]) != (model, dimensions):
                log.warning("the legacy vectors were made by %s (%d dims) and the service embeds with %s (%s dims): "
                            "they are copied as they are, and re-embedded when each organization is first opened",
                            meta[0], meta[1], model, dimensions)
        elif (data_dir / LEGACY_VECTORS).exists():
            log.warning("%s has no usable model record: its vectors are not copied (they stay in the backup; the "
                        "service re-embeds every chunk)", data_dir / LEGACY_VECTORS)
        else:
            log.info("no legacy vector index: the service re-embeds every chunk")

        routing = RoutingTable(control)
        for done, org_id in enumerate(plan.organizations, 1):
            directory = staging / "orgs" / org_id
            db = open_database(directory / ORG_DB)
            try:
                await apply_pending(db, ORG_DIR)
                counts = await copy_organization(legacy, db, plan, org_id)
            finally:
                await db.close()
            vectors = 0
            if source is not None:
                vectors = await _copy_vectors(source, open_index, directory / ORG_VECTORS, org_id, legacy_model)
            await control.batch([routing.insert(org_id, "sqlite", org_id)])
            for name, n in counts.items():
                report.rows[name] = report.rows.get(name, 0) + n
            report.vectors += vectors
            report.organizations.append(org_id)
            log.info("organizations converted: %d/%d (%s: %d rows, %d vectors)", done, total, org_id,
                     sum(counts.values()), vectors)
            after_organization(org_id, done, total)

        report.left_behind = await left_behind(legacy, plan, report.rows)
        for name, n in sorted(report.left_behind.items()):
            log.warning("%d rows of %s belong to no organization (leftovers of deleted organizations, or keyword "
                        "rows without their row): not carried over; they stay in %s%s", n, name, LEGACY_DB,
                        BACKUP_SUFFIX)
        if source is not None:
            report.vectors_left_behind = (await source.info()).vector_count - report.vectors
            if report.vectors_left_behind:
                log.warning("%d vectors are in no organization's namespace: not carried over; they stay in %s%s",
                            report.vectors_left_behind, LEGACY_VECTORS, BACKUP_SUFFIX)
    finally:
        guard.release()
        await close_all()

    # Into place: orgs/ first, the control database last (its arrival means "converted").
    _single_file(staging / CONTROL_DB)
    os.replace(staging / "orgs", data_dir / "orgs")
    _fsync_dir(data_dir)
    for side in _sidecars(data_dir / CONTROL_DB):
        side.unlink(missing_ok=True)  # the blank control file's, never to be paired with the converted one
    os.replace(staging / CONTROL_DB, data_dir / CONTROL_DB)
    _fsync_dir(data_dir)
    report.backups = _keep_backups(data_dir)
    shutil.rmtree(staging, ignore_errors=True)
    log.info("converted %d organizations (%d rows, %d vectors) into %s", len(report.organizations),
             sum(report.rows.values()), report.vectors, data_dir)
    return report


class _Lock:
    """An exclusive lock on ``<data dir>/.converting.lock`` (POSIX; elsewhere a no-op)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None


async def convert_on_start(settings: Any, control: SqlDatabase, embedder: Any = None, *,
                           open_database: OpenDatabase, open_index: OpenIndex) -> ConversionReport | None:
    """At start-up (``Memex.start``), before anything reads the control database: convert a single-database data
    directory (embedded backend) if there is one and it is not converted yet; finish an interrupted conversion's
    last renames. Returns the report when it converted, else None.

    ``control`` is the service's handle on ``settings.control_path`` (held by the key manager, the organization
    directory, the routing table...). The file it opened stays blank until the conversion puts the converted one
    in its place, so the handle is closed first and afterwards pointed at the new file (``_reopen``).
    """
    if getattr(settings, "sql", "sqlite") != "sqlite":
        return None  # a single-D1 deployment is converted by an operator (module docstring)
    data_dir = Path(settings.data_dir)
    legacy = data_dir / LEGACY_DB
    staging = data_dir / STAGING_NAME
    control_path = Path(settings.control_path)
    if not legacy.exists():
        if staging.exists() and not _blank(control_path):
            shutil.rmtree(staging, ignore_errors=True)  # a crash after the backup renames
        return None
    if not _blank(control_path):
        # converted; the legacy files are still there when a crash came after the control database landed
        lock = _Lock(data_dir / LOCK_NAME)
        try:
            await asyncio.to_thread(lock.acquire)
            if legacy.exists() and staging.exists():
                log.warning("finishing an interrupted conversion of %s", data_dir)
                _keep_backups(data_dir)
                shutil.rmtree(staging, ignore_errors=True)
            elif legacy.exists():
                log.warning("%s is ignored: %s already holds the converted layout (rename or remove the old file)",
                            legacy, control_path)
        finally:
            lock.release()
        return None
    path = getattr(control, "path", None)
    if path is None or Path(path).resolve() != control_path.resolve():
        raise ConversionError(f"{legacy} must be converted, but the control database handle is not the embedded "
                              f"database at {control_path}")
    await control.close()
    lock = _Lock(data_dir / LOCK_NAME)
    try:
        await asyncio.to_thread(lock.acquire)
        if not legacy.exists() or not _blank(control_path):
            return None  # another process converted it while this one waited: the handle is reopened below
        return await convert_data_dir(data_dir, open_database=open_database, open_index=open_index,
                                      model=getattr(embedder, "model_id", None),
                                      dimensions=getattr(embedder, "dimensions", None))
    finally:
        lock.release()
        _reopen(control, open_database(control_path))


def _reopen(handle: Any, fresh: Any) -> None:
    """Move a freshly opened handle's state into the service's closed one, so every holder of ``handle`` now
    reaches the converted file (the adapters have no reopen of their own)."""
    if type(fresh) is not type(handle):
        raise ConversionError(f"cannot reopen the control database: {type(handle).__name__} is not "
                              f"{type(fresh).__name__}")
    state = vars(handle)
    state.clear()
    state.update(vars(fresh))
