"""``SqlDatabase`` through the data-plane Worker: ``db`` is ``"control"`` (the D1 control plane, bound to the Worker)
or ``"org:<org_id>"`` (that organization's SQLite Durable Object, created by the Worker on first use).

* ``execute`` is one ``sql.batch`` op of one statement, ``batch`` one ``sql.batch`` op (the Worker runs its statements
  in one transaction), ``executescript`` one ``sql.script`` op: each is one request, so each is atomic, as on D1.
* Statements are checked before sending with D1's rules (``d1_sql.check_statement``; a Durable Object's SQLite has
  the same limits: 100 bound parameters, 100 KB of SQL per statement; no BEGIN/COMMIT, the request is the
  transaction). Parameters are JSON values as for D1, except that bytes travel as ``{"$b64"}`` (a BLOB), and come
  back as bytes.
* SQL errors surface as the D1 adapter's sqlite3-style exceptions (``D1IntegrityError`` is a
  ``sqlite3.IntegrityError``, ...); a full database as ``InsufficientStorage``; the Worker unreachable as
  ``WorkerError`` (503). Retries follow the D1 adapter: a statement list is retried after it may have run only when
  idempotent (``d1_sql.is_idempotent``, or the caller says so).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from services.errors import BackendError, InvalidInput
from services.ports import SqlResult, SqlValue, Statement

from .d1 import _sql_error, _storage_full
from .d1_sql import _param, check_statement, is_idempotent, split_statements
from .worker_client import WorkerClient, WorkerOpError, decode_value, encode_value

__all__ = ["WorkerSqlDatabase", "valid_db"]

_DB = re.compile(r"^(control|org:[A-Za-z0-9_-]{1,64})$")
#: The op error code of SQLite's verdict on a statement; any other (storage_unavailable, migration_failed,
#: rolled_back, aborted, bad_value, internal_error) is the Worker or its storage failing: it stays a 503.
SQL_ERROR = "sql_error"


def valid_db(db: str) -> str:
    if not isinstance(db, str) or not _DB.match(db):
        raise InvalidInput(f"a Worker database is 'control' or 'org:<org id>', not {db!r}")
    return db


def _bind(params: Sequence[SqlValue], where: str) -> list[Any]:
    out = []
    for i, p in enumerate(params):
        if isinstance(p, (bytes, bytearray, memoryview)):
            out.append(encode_value(p))
        else:
            out.append(_param(p, f"{where}, parameter {i + 1}"))
    return out


def _map(err: WorkerOpError) -> Exception:
    """A failed SQL op as the exception the D1 adapter would raise."""
    if err.op_code != SQL_ERROR:
        return err
    full = _storage_full(err.op_message)
    if full is not None:
        return full
    low = err.op_message.lower()
    if "statement too long" in low or "sqlite_toobig" in low or "too many sql variables" in low:
        return InvalidInput(f"the Worker refused the statement: {err.op_message}", details={"sql_message": err.op_message})
    return _sql_error(err.op_message)


class WorkerSqlDatabase:
    """The ``SqlDatabase`` port over the Worker's ``sql.batch`` and ``sql.script`` ops."""

    def __init__(self, client: WorkerClient, db: str) -> None:
        self.client = client
        self.db = valid_db(db)

    def __repr__(self) -> str:
        return f"WorkerSqlDatabase({self.db!r})"

    async def _op(self, op: dict[str, Any], *, idempotent: bool) -> dict:
        try:
            return await self.client.run(op, idempotent=idempotent)
        except WorkerOpError as err:
            raise _map(err) from err

    @staticmethod
    def _result(item: Any, *, read: bool = False) -> SqlResult:
        if not isinstance(item, dict):
            raise BackendError("the Worker answered a malformed SQL result", details={"result": str(item)[:200]})
        cols = item.get("columns") or []
        rows = [dict(zip(cols, (decode_value(v) for v in r), strict=True)) for r in (item.get("rows") or [])]
        if read:
            return SqlResult(rows=rows)
        return SqlResult(rows=rows, changes=int(item.get("changes") or 0), last_row_id=int(item.get("last_row_id") or 0))

    async def execute(self, sql: str, params: Sequence[SqlValue] = (), *, idempotent: bool | None = None) -> SqlResult:
        """Run one statement (its own transaction): one request."""
        shape = check_statement(sql, params, "statement")
        if shape.statements > 1:
            raise InvalidInput("execute() runs one statement: use batch() or executescript()")
        op = {"op": "sql.batch", "db": self.db, "statements": [{"sql": sql, "params": _bind(params, "statement")}]}
        res = await self._op(op, idempotent=shape.idempotent if idempotent is None else idempotent)
        items = res.get("results")
        if not isinstance(items, list) or len(items) != 1:
            raise BackendError("the Worker answered a malformed sql.batch result")
        return self._result(items[0], read=shape.read)

    async def batch(self, statements: Sequence[Statement], *, idempotent: bool | None = None) -> list[SqlResult]:
        """Run statements in order in one transaction (one ``sql.batch`` op, one request)."""
        if not statements:
            return []
        body, idem = [], True
        for i, st in enumerate(statements):
            where = f"batch statement {i + 1}"
            shape = check_statement(st.sql, st.params, where)
            if shape.statements > 1:
                raise InvalidInput(f"{where}: one statement per batch item")
            idem = idem and shape.idempotent
            body.append({"sql": st.sql, "params": _bind(st.params, where)})
        res = await self._op({"op": "sql.batch", "db": self.db, "statements": body},
                             idempotent=idem if idempotent is None else idempotent)
        items = res.get("results")
        if not isinstance(items, list) or len(items) != len(statements):
            raise BackendError(f"the Worker answered {len(items) if isinstance(items, list) else 'no'} results for a "
                               f"batch of {len(statements)} statements")
        return [self._result(it) for it in items]

    async def executescript(self, sql: str, *, idempotent: bool | None = None) -> None:
        """Run a multi-statement script (a migration) as one ``sql.script`` op."""
        stmts = split_statements(sql)
        if not stmts:
            return
        for i, s in enumerate(stmts):
            check_statement(s, (), f"script statement {i + 1}")
        await self._op({"op": "sql.script", "db": self.db, "sql": sql},
                       idempotent=is_idempotent(sql) if idempotent is None else idempotent)

    async def checkpoint(self) -> None:
        """Nothing to do: the Worker's stores manage their own storage."""

    def free_bytes(self) -> int | None:
        """None: not on a local file system (a full store surfaces as ``InsufficientStorage``)."""
        return None

    async def close(self) -> None:
        """Nothing to release: the client belongs to the backend."""
