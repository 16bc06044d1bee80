"""Move one organization's database into another store of the same schema (``move_database``): what
``memex cloudflare migrate`` does per organization, from a D1 database reached over the REST API into the
organization's Durable Object behind the data-plane Worker.

Written against the ``SqlDatabase`` port only, so it runs the same between any two adapters. It reuses the
conversion's copier (``services.storage.convert_copy``): rows by keyset pages, rowids and INTEGER PRIMARY KEYs
kept, triggers dropped while rows are copied verbatim and re-created from their own SQL, AUTOINCREMENT counters
carried, FTS5 rows copied with their rowids and checked with ``integrity-check``, every table's count checked
against what was read.

Resuming: the destination is emptied first (a previous run may have stopped half way), so running again after a
crash converges on a complete copy. The caller switches the organization's routing row only after this returns:
a routing row that names the destination means "this organization is complete".
"""

from __future__ import annotations

from services.ports import SqlDatabase, Statement
from services.storage.convert_copy import _copy
from services.storage.convert_plan import ConversionError, Table, _order, _parents, _shapes, _topological, quote

__all__ = ["move_database", "database_tables", "table_counts"]

_FTS5_SHADOWS = ("data", "idx", "content", "docsize", "config")
#: Not rows of the organization: each store records its own migrations; SQLite's and D1's own tables.
_SKIPPED = {"d1_migrations", "sqlite_sequence"}


async def database_tables(source: SqlDatabase, dest: SqlDatabase) -> list[Table]:
    """Every data table of ``source`` with how it is copied into ``dest`` (migrated to the same or a later
    schema). Raises ``ConversionError`` when ``dest`` lacks a table or a column (nothing is dropped silently)."""
    old, new = await _shapes(source), await _shapes(dest)
    shadows = {f"{name}_{s}" for name, shape in old.items() if shape.fts5 for s in _FTS5_SHADOWS}
    problems: list[str] = []
    tables: list[Table] = []
    for name, shape in old.items():
        if name in _SKIPPED or name in shadows or name.startswith(("sqlite_", "_cf_")):
            continue
        target = new.get(name)
        if target is None:
            problems.append(f"table {name!r} is not in the destination's schema (migrate it first)")
            continue
        missing = [c for c in shape.names if c not in target.names]
        if missing:
            problems.append(f"table {name!r}: the destination has no column {', '.join(map(repr, missing))}")
            continue
        if shape.virtual and not shape.fts5:
            problems.append(f"table {name!r} is a virtual table of a module that cannot be copied")
            continue
        has_rowid = shape.fts5 or not shape.without_rowid
        # Foreign keys: parents are copied first (and only rows whose parent exists, as the keys demand).
        parents = () if shape.virtual else tuple(p for p in await _parents(source, name) if p[1] in old)
        tables.append(Table(name=name, columns=tuple(shape.names), fts5=shape.fts5, has_rowid=has_rowid,
                            copy_rowid=has_rowid and shape.rowid_alias is None, by_org=False,
                            order=_order(shape, False), parents=parents))
    if problems:
        raise ConversionError("the organization's database cannot be moved without losing data: " + "; ".join(problems))
    return _topological(tables)


async def table_counts(db: SqlDatabase, tables: list[Table]) -> dict[str, int]:
    """Rows per table, in one batch."""
    results = await db.batch([Statement(f"SELECT COUNT(*) AS n FROM {quote(t.name)}") for t in tables])
    return {t.name: int(r.rows[0]["n"]) for t, r in zip(tables, results, strict=True)}


async def _empty(dest: SqlDatabase, tables: list[Table]) -> None:
    """Remove what an interrupted run left (children first; a contentless or external-content FTS5 table through
    its delete-all command, which is the only way to empty one)."""
    sql = {r["name"]: " ".join((r["sql"] or "").lower().split()) for r in (await dest.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table'")).rows}
    statements = []
    for t in reversed(tables):
        if t.fts5 and "content=" in sql.get(t.name, "").replace(" =", "=").replace("= ", "="):
            statements.append(Statement(f"INSERT INTO {quote(t.name)}({quote(t.name)}) VALUES ('delete-all')"))
        else:
            statements.append(Statement(f"DELETE FROM {quote(t.name)}"))
    # A delete's triggers may write rows into a table emptied before it (a document's delete is logged in
    # keyword_changes): the plain tables are emptied once more, in the same transaction.
    statements += [Statement(f"DELETE FROM {quote(t.name)}") for t in reversed(tables) if not t.fts5]
    await dest.batch(statements)


async def move_database(source: SqlDatabase, dest: SqlDatabase, *, where: str = "organization") -> dict[str, int]:
    """Copy every row of ``source`` into ``dest`` (migrated; emptied first) and prove the counts: returns rows
    per table, equal on both sides (else ``ConversionError``). ``source`` is only read."""
    tables = await database_tables(source, dest)
    before = await table_counts(source, tables)
    if any((await table_counts(dest, tables)).values()):
        await _empty(dest, tables)
    sequences = {}
    if any(r["name"] == "sqlite_sequence" for r in (await source.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'sqlite_sequence'")).rows):
        sequences = {r["name"]: int(r["seq"]) for r in (await source.execute("SELECT name, seq FROM sqlite_sequence")).rows}
    copied = await _copy(source, dest, tables, None, sequences, where)
    after = await table_counts(source, tables)
    if after != before:
        changed = sorted(n for n in before if before[n] != after[n])
        raise ConversionError(f"{where}: the source changed while it was copied ({', '.join(changed)}); "
                              "stop writers and run again")
    if copied != before:
        raise ConversionError(f"{where}: copied {copied} but the source holds {before}")
    return copied
