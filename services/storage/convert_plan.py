"""The plan of a conversion: every legacy table matched with its new home, the control database or each
organization's (``make_plan``), read from the schemas alone through the ``SqlDatabase`` port.

What is copied, and how:

* Every row of every table, by column name. The new tables have the columns legacy 0010 left them; a legacy
  column the new table lacks stops the conversion with a message naming it (nothing is dropped silently), and
  so does a legacy table that neither new schema has.
* Implicit rowids are kept (``documents``' and the other rowid tables', and the FTS rowids), as are INTEGER
  PRIMARY KEYs: ``chunks.pk`` is ``chunks_fts``' rowid and ``documents_fts_keys.pk`` is ``documents_fts``' rowid
  (services/search/ joins on them).
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

``services.storage.convert_copy`` copies what the plan says; ``services.storage.convert`` runs both on an embedded
data directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.errors import NotFound
from services.ports import SqlDatabase
from services.storage.stores import valid_org_id

__all__ = ["ConversionError", "Plan", "Table", "make_plan", "FTS_KEYS", "quote"]

#: Each FTS5 table's rowids are the keys of an ordinary table's rows (what the triggers write): an
#: organization's keyword rows are read by those keys. An FTS5 table missing here is read by scanning it.
FTS_KEYS: dict[str, tuple[str, str]] = {"chunks_fts": ("chunks", "pk"), "documents_fts": ("documents_fts_keys", "pk")}

#: Legacy tables deliberately not copied as rows (see the module docstring).
_NOT_COPIED = {"d1_migrations"}
_FTS5_SHADOWS = ("data", "idx", "content", "docsize", "config")


class ConversionError(RuntimeError):
    """The legacy data cannot be converted without losing something; nothing was moved."""


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


def quote(name: str) -> str:
    """``name`` as an SQL identifier."""
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
            return str(pks[0]["name"])
        return None

    def notnull(self, column: str) -> bool:
        return any(c["name"] == column and (c["notnull"] or c["name"] == self.rowid_alias) for c in self.columns)


async def _shapes(db: SqlDatabase) -> dict[str, _Shape]:
    out = {}
    for r in (await db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table' ORDER BY name")).rows:
        name, sql = r["name"], r["sql"] or ""
        if name.startswith("_cf_"):  # Cloudflare's own (D1, Durable Objects): not ours, and not readable by PRAGMA
            continue
        columns = (await db.execute(f"PRAGMA table_info({quote(name)})")).rows
        indexes = []
        if not sql.lstrip().upper().startswith("CREATE VIRTUAL TABLE") and not name.startswith("sqlite_"):
            for ix in (await db.execute(f"PRAGMA index_list({quote(name)})")).rows:
                if ix["unique"] and not ix.get("partial"):
                    info = (await db.execute(f"PRAGMA index_info({quote(ix['name'])})")).rows
                    indexes.append([i["name"] for i in sorted(info, key=lambda i: i["seqno"])])
        out[name] = _Shape(name, sql, columns, indexes)
    return out


async def _parents(db: SqlDatabase, table: str) -> list[tuple[str, str, str]]:
    rows = (await db.execute(f"PRAGMA foreign_key_list({quote(table)})")).rows
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
