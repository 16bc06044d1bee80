"""The D1 adapter: the ``SqlDatabase`` port over ``POST /accounts/{a}/d1/database/{db}/raw``.

* ``execute`` sends one statement (``{"sql", "params"}``); ``batch`` sends ``{"batch": [...]}`` and
  ``executescript`` the whole script as one ``sql`` string: each is one request, so each is atomic (D1 runs
  a request in one implicit transaction and rolls it back on any failure). BEGIN/COMMIT/SAVEPOINT are
  refused before sending (``InvalidInput``), like the embedded adapter.
* ``/raw`` (columns + rows arrays) is used rather than ``/query`` (an object per row): smaller, and rows are
  rebuilt into dicts here. ``endpoint="query"`` switches.
* Limits are checked before sending (``services.adapters.cloudflare.d1_sql``), with a clear ``InvalidInput``:
  at most 100 bound parameters per statement (also no ``?NNN`` above 100) and at most 100,000 bytes of SQL
  text per statement; a bound string over 2,000,000 bytes is ``PayloadTooLarge``. Long id lists belong in one
  bound JSON array read through ``json_each``.
* Parameters travel as JSON values: ``str`` and ``None`` as themselves, ``bool`` as 1/0, ``int``/``float``
  as JSON *numbers*. Cloudflare's API spec types ``params`` as strings, but a string would be compared as
  TEXT in ``LIMIT ?`` or against INTEGER columns without affinity; numbers keep SQLite semantics. (Verified
  against the local emulator only; see the README.) Integers outside +-2^53 are refused (``InvalidInput``):
  they would lose precision in JavaScript on the way in *and* out — store big ids as TEXT. NaN/Infinity are
  refused (not JSON). ``bytes`` are refused: D1's JSON API has no BLOB parameter type (none of our D1 tables
  use BLOBs; store hex/base64 text).
* SQL errors (``errors[].message`` holds SQLite's text) surface as the sqlite3 exceptions the embedded
  adapter raises: ``D1IntegrityError`` (a ``sqlite3.IntegrityError``) for constraint failures,
  ``D1ProgrammingError`` for wrong parameter counts and type errors, ``D1OperationalError`` otherwise; each
  also carries the failing batch position where D1 reports one. Transport, auth, availability and
  rate-limit failures are ``BackendError`` subclasses (503).

Retries: a request that provably did not run (connect error, 429, "overloaded") is retried whatever it
holds. A request that failed after reaching D1 (timeouts, 5xx, "Network connection lost", "transient issue
on remote node", "DB reset ...") is retried only when idempotent: every statement is a read (``SELECT``/
``WITH`` without a write, ``PRAGMA``), a ``DELETE``/``INSERT OR REPLACE``/``INSERT OR IGNORE``/``... ON CONFLICT
DO NOTHING`` without ``RETURNING``, or ``CREATE ... IF NOT EXISTS``/``DROP ... IF EXISTS``; or the caller passed
``idempotent=True``. ``UPDATE`` and plain ``INSERT`` are not retried after they may have run (the API client
sees a 503 and retries the whole operation, which our services make idempotent).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from services.errors import BackendError, InsufficientStorage, InvalidInput
from services.ports import SqlResult, SqlValue, Statement

from .client import (
    D1_NOT_RUN,
    D1_NOT_TRANSIENT,
    D1_TRANSIENT,
    CloudflareApi,
    CloudflareApiError,
    CloudflareAuthError,
    CloudflareNotFound,
    CloudflareRateLimited,
)
from .d1_sql import bind_params, check_statement, is_idempotent, split_statements

__all__ = [
    "D1Database",
    "D1Error",
    "D1IntegrityError",
    "D1OperationalError",
    "D1ProgrammingError",
]


# -- errors ----------------------------------------------------------------------------------------------


class D1Error(Exception):
    """Mixin of every SQL error D1 reported (the request reached D1 and SQLite refused it)."""

    d1_message: str = ""
    statement_index: int | None = None


class D1IntegrityError(D1Error, sqlite3.IntegrityError):
    """A constraint failed (UNIQUE, NOT NULL, CHECK, FOREIGN KEY): what sqlite3 raises locally."""


class D1OperationalError(D1Error, sqlite3.OperationalError):
    """Any other SQL error (syntax, no such table, ...)."""


class D1ProgrammingError(D1Error, sqlite3.ProgrammingError):
    """Wrong number of bindings, unsupported parameter type."""


def _storage_full(message: str) -> InsufficientStorage | None:
    """D1's answer when the database reached its size limit (SQLITE_FULL), as a 507."""
    low = message.lower()
    if "sqlite_full" in low or "database or disk is full" in low or "maximum db size" in low or "maximum database size" in low:
        return InsufficientStorage("insufficient storage: the D1 database is full; nothing was written",
                                   details={"reason": message[:500]})
    return None


def _sql_error(message: str, statement_index: int | None = None) -> D1Error:
    low = message.lower()
    if "constraint" in low:
        cls: type[D1Error] = D1IntegrityError
    elif "parameter bindings" in low or "d1_type_error" in low:
        cls = D1ProgrammingError
    else:
        cls = D1OperationalError
    exc = cls(message)
    exc.d1_message = message
    exc.statement_index = statement_index
    return exc


# -- the adapter -----------------------------------------------------------------------------------------


def _classify(err: CloudflareApiError) -> str | None:
    text = err.text.lower()
    if any(m in text for m in D1_NOT_TRANSIENT):
        return "fatal"
    if any(m in text for m in D1_NOT_RUN):
        return "not_run"
    if any(m in text for m in D1_TRANSIENT):
        return "transient"
    return None


class D1Database:
    """``SqlDatabase`` over Cloudflare D1's REST API (one request per call: atomic)."""

    #: Each call is an API request, counted against the account's limit: a caller that can send its statements
    #: together in one ``batch`` rather than one after another should (the search does: services.search.search).
    round_trips_are_requests = True

    def __init__(self, api: CloudflareApi, database_id: str, *, endpoint: str = "raw") -> None:
        if endpoint not in ("raw", "query"):
            raise ValueError("endpoint must be 'raw' or 'query'")
        if not database_id:
            raise InvalidInput("CLOUDFLARE_D1_DATABASE_ID is required for MEMEX_SQL=d1")
        self.api = api
        self.database_id = database_id
        self.endpoint = endpoint
        self._path = f"d1/database/{database_id}/{endpoint}"

    # -- plumbing ------------------------------------------------------------------------------------

    async def _send(self, body: dict[str, Any], *, idempotent: bool) -> list[dict[str, Any]]:
        try:
            result = await self.api.call("d1", "POST", self._path, json=body, idempotent=idempotent, classify=_classify)
        except CloudflareApiError as err:
            raise self._map(err) from err
        if not isinstance(result, list):
            raise BackendError("D1 answered without a result list", details={"result": str(result)[:200]})
        for i, item in enumerate(result):
            if isinstance(item, dict) and item.get("success") is False:
                message = str(item.get("error") or item.get("errors") or "D1 statement failed")
                raise _storage_full(message) or _sql_error(message, i)
        return result

    def _map(self, err: CloudflareApiError) -> Exception:
        """SQL errors become sqlite3-style exceptions; everything else stays a BackendError."""
        if isinstance(err, (CloudflareAuthError, CloudflareNotFound, CloudflareRateLimited)) or err.status is None:
            return err
        if _classify(err) in ("not_run", "transient"):
            return err  # D1 unavailable (after retries): 503
        text = err.text
        low = text.lower()
        full = _storage_full(text)
        if full is not None:
            return full
        if "statement too long" in low or "sqlite_toobig" in low or "too many sql variables" in low:
            return InvalidInput(f"D1 refused the statement: {text}", details={"d1_message": text})
        if 400 <= err.status < 500 or "d1_" in low or "sqlite_" in low:
            return _sql_error(text)
        return err

    def _result(self, item: Any) -> SqlResult:
        if not isinstance(item, dict):
            return SqlResult()
        meta = item.get("meta") or {}
        res = item.get("results")
        if isinstance(res, dict):  # /raw
            cols = res.get("columns") or []
            rows = [dict(zip(cols, r, strict=True)) for r in (res.get("rows") or [])]
        elif isinstance(res, list):  # /query
            rows = [dict(r) for r in res if isinstance(r, dict)]
        else:
            rows = []
        return SqlResult(
            rows=rows,
            changes=int(meta.get("changes") or 0),
            last_row_id=int(meta.get("last_row_id") or 0),
        )

    # -- the port ------------------------------------------------------------------------------------

    async def execute(self, sql: str, params: Sequence[SqlValue] = (), *, idempotent: bool | None = None) -> SqlResult:
        """Run one statement (its own implicit transaction)."""
        shape = check_statement(sql, params, "statement")
        if shape.statements > 1:
            raise InvalidInput("execute() runs one statement: use batch() or executescript()")
        body = {"sql": sql, "params": bind_params(params, "statement")}
        idem = shape.idempotent if idempotent is None else idempotent
        items = await self._send(body, idempotent=idem)
        out = self._result(items[-1] if items else None)
        if shape.read:
            out = SqlResult(rows=out.rows)
        return out

    async def batch(self, statements: Sequence[Statement], *, idempotent: bool | None = None) -> list[SqlResult]:
        """Run statements in order in one request: all take effect or none does."""
        if not statements:
            return []
        body_items = []
        idem = True
        for i, st in enumerate(statements):
            where = f"batch statement {i + 1}"
            shape = check_statement(st.sql, st.params, where)
            if shape.statements > 1:
                raise InvalidInput(f"{where}: one statement per batch item")
            idem = idem and shape.idempotent
            body_items.append({"sql": st.sql, "params": bind_params(st.params, where)})
        if idempotent is not None:
            idem = idempotent
        items = await self._send({"batch": body_items}, idempotent=idem)
        if len(items) != len(statements):
            raise BackendError(
                f"D1 answered {len(items)} results for a batch of {len(statements)} statements",
            )
        return [self._result(it) for it in items]

    async def executescript(self, sql: str, *, idempotent: bool | None = None) -> None:
        """Run a multi-statement script (a migration) as one request: atomic."""
        stmts = split_statements(sql)
        if not stmts:
            return
        for i, s in enumerate(stmts):
            check_statement(s, (), f"script statement {i + 1}")
        idem = is_idempotent(sql) if idempotent is None else idempotent
        await self._send({"sql": sql}, idempotent=idem)

    async def checkpoint(self) -> None:
        """Nothing to do: D1 manages its own storage (there is no local write-ahead log)."""

    def free_bytes(self) -> int | None:
        """None: D1's storage is not on a local file system (its limits surface as ``InsufficientStorage``)."""
        return None

    async def close(self) -> None:
        """Nothing to release: the shared HTTP client belongs to the backend."""
