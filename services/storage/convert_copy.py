"""The copy of a conversion (``copy_control``, ``copy_organization``, ``left_behind``), as planned by
``services.storage.convert_plan``.

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

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from services.ports import SqlDatabase, SqlValue, Statement
from services.storage.convert_plan import ConversionError, Plan, Table, quote

__all__ = ["copy_control", "copy_organization", "left_behind", "ROWS_PER_BATCH", "MAX_PARAMS", "BATCH_BYTES"]

#: Rows read per page and written per batch.
ROWS_PER_BATCH = 200
#: Bound parameters per statement (D1's limit).
MAX_PARAMS = 100
#: A batch is cut once its values reach about this many bytes (one row larger than this is a batch alone).
BATCH_BYTES = 1_000_000
_ROWID = "__rowid__"


async def _pages(db: SqlDatabase, table: Table, org_id: str | None) -> AsyncIterator[list[dict[str, Any]]]:
    select = ([f"rowid AS {_ROWID}"] if table.has_rowid else []) + [quote(c) for c in table.columns]
    where: list[str] = []
    params: list[SqlValue] = []
    if org_id is not None:
        where.append('"organization_id" = ?')
        params.append(org_id)
    for column, parent, parent_column in table.parents:
        where.append(f"{quote(column)} IN (SELECT {quote(parent_column)} FROM {quote(parent)})")
    order = ["rowid" if k == "rowid" else quote(k) for k in table.order]
    last: list[SqlValue] | None = None
    while True:
        w, p = list(where), list(params)
        if last is not None:
            marks = ", ".join("?" * len(order))
            w.append(f"{order[0]} > ?" if len(order) == 1 else f"({', '.join(order)}) > ({marks})")
            p.extend(last)
        sql = f"SELECT {', '.join(select)} FROM {quote(table.name)}"
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
    columns = (["rowid"] if table.copy_rowid else []) + [quote(c) for c in table.columns]
    per_statement = max(1, MAX_PARAMS // len(columns))
    head = f"INSERT INTO {quote(table.name)} ({', '.join(columns)}) VALUES "
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
    select = ", ".join([f"rowid AS {_ROWID}"] + [quote(c) for c in table.columns])
    copied, last = 0, None
    while True:
        sql = f"SELECT {quote(key)} AS k FROM {quote(keys_table)}"
        rows = (await db.execute(sql + (f" WHERE {quote(key)} > ?" if last is not None else "")
                                 + f" ORDER BY {quote(key)} LIMIT {ROWS_PER_BATCH}", () if last is None else (last,))).rows
        if not rows:
            return copied
        ids = [r["k"] for r in rows]
        found = (await legacy.execute(
            f"SELECT {select} FROM {quote(table.name)} WHERE rowid IN (SELECT value FROM json_each(?)) "
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
        await db.batch([Statement(f"DROP TRIGGER {quote(r['name'])}") for r in rows])
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
        n = (await db.execute(f"SELECT COUNT(*) AS n FROM {quote(t.name)}")).rows[0]["n"]
        if n != counts[t.name]:
            raise ConversionError(f"{where}: {t.name} holds {n} rows after copying {counts[t.name]}")
        if t.fts5:
            await db.execute(f"INSERT INTO {quote(t.name)}({quote(t.name)}) VALUES ('integrity-check')")


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
        total = (await legacy.execute(f"SELECT COUNT(*) AS n FROM {quote(t.name)}")).rows[0]["n"]
        if total != copied.get(t.name, 0):
            out[t.name] = total - copied.get(t.name, 0)
    return out
