"""D1 over REST: one SQLite file per database id, each request = one SQLite transaction."""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import threading
import time
import uuid as uuidlib
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

from .errors import D1_ACCOUNT_LIMIT, D1_BAD_REQUEST, D1_DUPLICATE_NAME, D1_NOT_FOUND, D1_SQL_ERROR, CFError

MAX_PARAMS = 100
MAX_STATEMENT_BYTES = 100_000
JS_SAFE_INT = 2**53
_PROBE = (None,) * 40_000  # more than SQLITE_MAX_VARIABLE_NUMBER: binding always fails -> tells the count
_PROBE_RE = re.compile(r"uses (\d+), and there are")
_DB_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TX_KEYWORDS = {"BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT", "RELEASE"}
_PRIMARY = {
    1: "ERROR", 2: "INTERNAL", 3: "PERM", 4: "ABORT", 5: "BUSY", 6: "LOCKED", 7: "NOMEM", 8: "READONLY",
    9: "INTERRUPT", 10: "IOERR", 11: "CORRUPT", 12: "NOTFOUND", 13: "FULL", 14: "CANTOPEN", 15: "PROTOCOL",
    16: "EMPTY", 17: "SCHEMA", 18: "TOOBIG", 19: "CONSTRAINT", 20: "MISMATCH", 21: "MISUSE", 22: "NOLFS",
    23: "AUTH", 24: "FORMAT", 25: "RANGE", 26: "NOTADB",
}
# sqlite3 authorizer action codes
_SQLITE_DROP_TABLE, _SQLITE_DELETE, _SQLITE_INSERT, _SQLITE_READ = 11, 9, 18, 20
_SQLITE_TRANSACTION, _SQLITE_UPDATE, _SQLITE_ATTACH, _SQLITE_DETACH, _SQLITE_SAVEPOINT = 22, 23, 24, 25, 32
_INTERNAL_TABLE = "_cf_KV"


class D1Error(Exception):
    """An error raised while running a request; becomes `D1_ERROR: ...` in errors[].message."""


# ---------------------------------------------------------------------------------------------------------
# SQL text helpers
# ---------------------------------------------------------------------------------------------------------

def _scan(sql: str):
    """Yield (index, char, in_code) for every char; in_code False inside strings/identifiers/comments."""
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'\"`":
            j = i + 1
            while j < n:
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:
                        j += 2
                        continue
                    break
                j += 1
            for k in range(i, min(j + 1, n)):
                yield k, sql[k], False
            i = j + 1
            continue
        if c == "[":
            j = sql.find("]", i + 1)
            j = n - 1 if j < 0 else j
            for k in range(i, j + 1):
                yield k, sql[k], False
            i = j + 1
            continue
        if c == "-" and sql.startswith("--", i):
            j = sql.find("\n", i)
            j = n - 1 if j < 0 else j
            for k in range(i, j + 1):
                yield k, " ", False
            i = j + 1
            continue
        if c == "/" and sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            j = n - 1 if j < 0 else j + 1
            for k in range(i, j + 1):
                yield k, " ", False
            i = j + 1
            continue
        yield i, c, True
        i += 1


def _without_comments(sql: str) -> str:
    return "".join(ch for _, ch, _ in _scan(sql))


def split_statements(sql: str) -> list[str]:
    """Split on top-level `;` (respecting quotes, comments and trigger bodies); drop empty statements."""
    out: list[str] = []
    start = 0
    for i, ch, in_code in _scan(sql):
        if in_code and ch == ";":
            chunk = sql[start:i + 1]
            if sqlite3.complete_statement(chunk):
                out.append(chunk)
                start = i + 1
    if start < len(sql):
        out.append(sql[start:])
    return [s for s in out if _without_comments(s).strip().strip(";").strip()]


def leading_keyword(stmt: str) -> str:
    text = _without_comments(stmt).lstrip()
    m = re.match(r"[A-Za-z_]+", text)
    return m.group(0).upper() if m else ""


# ---------------------------------------------------------------------------------------------------------
# JavaScript number semantics (results and params travel through JSON in a JS runtime on Cloudflare)
# ---------------------------------------------------------------------------------------------------------

def _js_number(x: float) -> float | int | None:
    """What JSON.stringify(Number) then a Python json.loads gives back."""
    if math.isnan(x) or math.isinf(x):
        return None  # JSON.stringify(NaN/Infinity) === "null"
    if x == int(x) and abs(x) < 1e21:
        return int(Decimal(repr(x)))  # JS prints integral numbers without ".0" (shortest round-trip digits)
    return x


def js_value(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        if -JS_SAFE_INT <= v <= JS_SAFE_INT:
            return v
        return _js_number(float(v))  # > 2^53: precision lost, like JSON through JavaScript
    if isinstance(v, float):
        return _js_number(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return list(bytes(v))  # BLOBs come back as arrays of byte values
    return v


def bind_value(v: Any, where: str) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bool):
        return 1 if v else 0
    if isinstance(v, int):
        if -JS_SAFE_INT <= v <= JS_SAFE_INT:
            return v
        return float(v)  # a JS number: integers past 2^53 are doubles
    if isinstance(v, float):
        if v == int(v) and abs(v) <= JS_SAFE_INT:
            return int(v)  # 1.0 and 1 are the same JS number
        return v
    raise D1Error(f"D1_TYPE_ERROR: Type '{'object' if isinstance(v, (dict, list)) else type(v).__name__}'"
                  f" not supported for value '{json.dumps(v)}' {where}")


def _sqlite_message(e: Exception) -> str:
    code = getattr(e, "sqlite_errorcode", None)
    if code is None:
        if isinstance(e, sqlite3.ProgrammingError) and "bindings" in str(e):
            return "D1_ERROR: Wrong number of parameter bindings for SQL query."
        return f"D1_ERROR: {e}"
    return f"D1_ERROR: {e}: SQLITE_{_PRIMARY.get(code & 0xFF, 'ERROR')}"


# ---------------------------------------------------------------------------------------------------------
# Databases
# ---------------------------------------------------------------------------------------------------------

class D1Database:
    def __init__(self, path: Path, uuid: str, name: str, created_at: str, *, region: str = "WEUR",
                 jurisdiction: str | None = None):
        self.path = path
        self.uuid = uuid
        self.name = name
        self.created_at = created_at
        self.region = region
        self.jurisdiction = jurisdiction
        self.lock = threading.Lock()
        self.closed = False  # deleted: a request that got this object just before the delete answers 7404
        self._user_mode = False
        self.conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.conn.set_authorizer(self._authorize)
        self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {_INTERNAL_TABLE} (key TEXT PRIMARY KEY, value BLOB) WITHOUT ROWID")

    def _authorize(self, action: int, arg1: Any, arg2: Any, dbname: Any, source: Any) -> int:
        if not self._user_mode:
            return sqlite3.SQLITE_OK
        if action in (_SQLITE_TRANSACTION, _SQLITE_SAVEPOINT, _SQLITE_ATTACH, _SQLITE_DETACH):
            return sqlite3.SQLITE_DENY
        if action in (_SQLITE_READ, _SQLITE_INSERT, _SQLITE_UPDATE, _SQLITE_DELETE, _SQLITE_DROP_TABLE) \
                and arg1 == _INTERNAL_TABLE and source is None:
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.conn.close()

    def _check_open(self) -> None:
        if self.closed:
            raise CFError(404, D1_NOT_FOUND, f"The database {self.uuid} could not be found")

    def info(self) -> dict:
        with self.lock:
            self._check_open()
            n = self.conn.execute(
                "SELECT count(*) FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'"
            ).fetchone()[0]
        size = self.path.stat().st_size if self.path.exists() else 0
        return {
            "uuid": self.uuid,
            "name": self.name,
            "created_at": self.created_at,
            "version": "production",
            "num_tables": n,
            "file_size": size,
            "running_in_region": self.region,
            "jurisdiction": self.jurisdiction,
        }

    # -- the request ------------------------------------------------------------------------------------
    def execute(self, items: list[tuple[str, list]], raw: bool) -> list[dict]:
        """Run all statements of one request in one transaction; all-or-nothing."""
        statements: list[tuple[str, list[Any] | None, bool]] = []  # (sql, params-of-item, last-of-item)
        for sql, params in items:
            stmts = split_statements(sql)
            if not stmts:
                raise D1Error("D1_ERROR: No SQL statements detected.")
            for k, s in enumerate(stmts):
                statements.append((s, params if k == 0 else None, k == len(stmts) - 1))
        for s, _, _ in statements:
            if len(s.strip().encode("utf-8")) > MAX_STATEMENT_BYTES:
                raise D1Error("D1_ERROR: Statement too long: SQLITE_TOOBIG")
            if leading_keyword(s) in _TX_KEYWORDS:
                raise D1Error("D1_ERROR: cannot start a transaction within a transaction: SQLITE_ERROR")

        with self.lock:
            self._check_open()
            conn = self.conn
            # PRAGMAs last one request: reset the ones a request may have changed.
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA case_sensitive_like = OFF")
            conn.execute("PRAGMA recursive_triggers = OFF")
            conn.execute("PRAGMA ignore_check_constraints = OFF")
            conn.execute("BEGIN IMMEDIATE")
            results: list[dict] = []
            try:
                remaining: list[Any] = []
                cur = conn.cursor()
                for s, item_params, last_of_item in statements:
                    if item_params is not None:
                        remaining = [bind_value(p, f"at index {i}") for i, p in enumerate(item_params)]
                    results.append(self._run_one(conn, cur, s, remaining, raw))
                    if last_of_item and remaining:
                        raise D1Error("D1_ERROR: Wrong number of parameter bindings for SQL query.")
                self._user_mode = False
                conn.execute("COMMIT")  # deferred FK violations fail here
            except BaseException as e:
                self._user_mode = False
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(e, D1Error):
                    raise
                if isinstance(e, (sqlite3.Error, OverflowError)):
                    raise D1Error(_sqlite_message(e)) from e
                raise
            return results

    def _run_one(self, conn: sqlite3.Connection, cur: sqlite3.Cursor, sql: str, remaining: list[Any],
                 raw: bool) -> dict:
        self._user_mode = True
        try:
            try:
                cur.execute(sql, _PROBE)
                raise D1Error("D1_ERROR: internal emulator error (parameter probe)")
            except sqlite3.ProgrammingError as e:
                m = _PROBE_RE.search(str(e))
                if not m:
                    raise
                needed = int(m.group(1))
            if needed > MAX_PARAMS:
                raise D1Error("D1_ERROR: too many SQL variables: SQLITE_ERROR")
            if needed > len(remaining):
                raise D1Error("D1_ERROR: Wrong number of parameter bindings for SQL query.")
            params = remaining[:needed]
            del remaining[:needed]
            before = conn.total_changes
            t0 = time.perf_counter()
            cur.execute(sql, params)
            rows = cur.fetchall()
            elapsed = (time.perf_counter() - t0) * 1000.0
        finally:
            self._user_mode = False
        changes = conn.total_changes - before
        columns = [d[0] for d in cur.description] if cur.description else []
        rows = [[js_value(v) for v in row] for row in rows]
        page_count = conn.execute("PRAGMA page_count").fetchone()[0]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        meta = {
            "served_by": "cloudflare-emulator",
            "served_by_region": "WEUR",
            "served_by_primary": True,
            "timings": {"sql_duration_ms": round(elapsed, 4)},
            "duration": round(elapsed, 4),
            "changes": changes,
            "last_row_id": cur.lastrowid or 0,
            "changed_db": changes > 0,
            "size_after": page_count * page_size,
            "rows_read": len(rows),
            "rows_written": changes,
        }
        if raw:
            res: Any = {"columns": columns, "rows": rows}
        else:
            res = [dict(zip(columns, r, strict=True)) for r in rows]
        return {"success": True, "results": res, "meta": meta}


_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
LOCATION_HINTS = ("wnam", "enam", "weur", "eeur", "apac", "oc")
JURISDICTIONS = ("eu", "fedramp", "us")
DEFAULT_MAX_DATABASES = 50_000   # doc: databases per account on Workers Paid (Free: 10)
DEFAULT_PER_PAGE = 1000          # emulator's choice: the docs give min 10 / max 10,000 but no default
MIN_PER_PAGE, MAX_PER_PAGE = 10, 10_000


class D1Store:
    """D1 databases per account, each its own SQLite file ``root/d1/<account>/<id>.sqlite3``.

    An id exists when it was created through ``POST d1/database`` (a UUID), or is one of the preconfigured
    ``databases``, or — with ``auto_create`` on, the default when no ``databases`` list is given — is any other
    well-formed id that is *not UUID-shaped*, on first use (the stand-in for a database made out of band,
    such as the control database the tests name ``memex-test-db``). UUID-shaped ids, the form the create
    endpoint hands out, are never auto-created, and a deleted id stays deleted (a tombstone in the catalog)
    whatever the mode. Everything else answers 404 / 7404.

    ``max_databases`` caps the live databases per account (creating one more answers 400 / 7406); preset and
    auto-created databases count towards it but are not refused by it.
    """

    def __init__(self, root: Path, databases: list[str] | None = None, *, auto_create: bool | None = None,
                 max_databases: int = DEFAULT_MAX_DATABASES):
        self.root = root
        self.fixed = None if databases is None else set(databases)
        self.auto_create = (databases is None) if auto_create is None else bool(auto_create)
        self.max_databases = int(max_databases)
        self._lock = threading.RLock()
        self._dbs: dict[tuple[str, str], D1Database] = {}
        self._catalogs: dict[str, dict[str, dict]] = {}

    # -- the catalog: {id: {"name", "created_at", ["deleted_at"], ...}} per account, cached, saved on change --
    def _catalog_path(self, account: str) -> Path:
        return self.root / "d1" / account / "_catalog.json"

    def _db_path(self, account: str, db_id: str) -> Path:
        return self.root / "d1" / account / f"{db_id}.sqlite3"

    def _catalog(self, account: str) -> dict[str, dict]:
        cat = self._catalogs.get(account)
        if cat is None:
            p = self._catalog_path(account)
            cat = json.loads(p.read_text()) if p.exists() else {}
            missing = [i for i in sorted(self.fixed or ()) if i not in cat]
            for db_id in missing:  # preset databases exist from the start
                cat[db_id] = {"name": db_id, "created_at": _now_iso()}
            self._catalogs[account] = cat
            if missing:
                self._save_catalog(account)
        return cat

    def _save_catalog(self, account: str) -> None:
        p = self._catalog_path(account)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._catalogs[account]))
        os.replace(tmp, p)

    @staticmethod
    def _live(cat: dict[str, dict]) -> dict[str, dict]:
        return {i: e for i, e in cat.items() if not e.get("deleted_at")}

    def _entry(self, account: str, db_id: str) -> dict | None:
        """The live catalog entry of ``db_id`` (auto-creating it when allowed), or None. Lock held."""
        cat = self._catalog(account)
        entry = cat.get(db_id)
        if entry is not None:
            return None if entry.get("deleted_at") else entry
        if not _DB_ID_RE.match(db_id) or not self.auto_create or _UUID_RE.match(db_id):
            return None
        entry = {"name": db_id, "created_at": _now_iso()}
        cat[db_id] = entry
        self._save_catalog(account)
        return entry

    @staticmethod
    def _not_found(db_id: str) -> CFError:
        return CFError(404, D1_NOT_FOUND, f"The database {db_id} could not be found")

    # -- operations ---------------------------------------------------------------------------------------
    def get(self, account: str, db_id: str) -> D1Database:
        with self._lock:
            db = self._dbs.get((account, db_id))
            if db is not None:
                return db
            entry = self._entry(account, db_id)
            if entry is None:
                raise self._not_found(db_id)
            path = self._db_path(account, db_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            db = D1Database(path, db_id, entry["name"], entry["created_at"],
                            region=entry.get("created_in_region", "WEUR"), jurisdiction=entry.get("jurisdiction"))
            self._dbs[(account, db_id)] = db
            return db

    def count(self, account: str) -> int:
        with self._lock:
            return len(self._live(self._catalog(account)))

    def create(self, account: str, body: Any) -> dict:
        """``{"name", "primary_location_hint"?, "jurisdiction"?}`` -> the new database's info."""
        if not isinstance(body, dict):
            raise CFError(400, D1_BAD_REQUEST, "Request body must be a JSON object with 'name'")
        name = body.get("name")
        if not isinstance(name, str) or not name.strip():
            raise CFError(400, D1_BAD_REQUEST, "A database name is required")
        hint = body.get("primary_location_hint")
        if hint is not None and (not isinstance(hint, str) or hint.lower() not in LOCATION_HINTS):
            raise CFError(400, D1_BAD_REQUEST, f"primary_location_hint must be one of {', '.join(LOCATION_HINTS)}")
        jurisdiction = body.get("jurisdiction")
        if jurisdiction is not None and jurisdiction not in JURISDICTIONS:
            raise CFError(400, D1_BAD_REQUEST, f"jurisdiction must be one of {', '.join(JURISDICTIONS)}")
        with self._lock:
            cat = self._catalog(account)
            live = self._live(cat)
            # The name is checked before the limit, so a retried create that already succeeded gets the
            # duplicate answer (the real API's order is not documented).
            if any(e.get("name") == name for e in live.values()):
                raise CFError(400, D1_DUPLICATE_NAME, "A database with that name already exists")
            if len(live) >= self.max_databases:
                raise CFError(400, D1_ACCOUNT_LIMIT,
                              f"System limit reached: databases per account ({self.max_databases})")
            db_id = str(uuidlib.uuid4())
            entry: dict[str, Any] = {"name": name, "created_at": _now_iso(),
                                     "created_in_region": (hint or "weur").upper()}
            if hint is not None:
                entry["primary_location_hint"] = hint.lower()
            if jurisdiction is not None:
                entry["jurisdiction"] = jurisdiction
            cat[db_id] = entry
            self._save_catalog(account)
            info = self.get(account, db_id).info()  # opens (and so creates) its SQLite file
        info["created_in_region"] = entry["created_in_region"]
        return info

    def list(self, account: str, name: str | None = None, page: Any = None,
             per_page: Any = None) -> tuple[list[dict], dict]:
        """One page of ``GET d1/database`` -> (items, result_info). ``name`` = case-insensitive substring."""
        page_n = _int_arg("page", page, 1, 1, None)
        size = _int_arg("per_page", per_page, DEFAULT_PER_PAGE, MIN_PER_PAGE, MAX_PER_PAGE)
        with self._lock:
            live = self._live(self._catalog(account))
            rows = sorted(live.items(), key=lambda kv: (kv[1]["created_at"], kv[0]))
        if name:
            needle = name.lower()
            rows = [(i, e) for i, e in rows if needle in e["name"].lower()]
        chunk = rows[(page_n - 1) * size: page_n * size]
        items = [{"uuid": i, "name": e["name"], "created_at": e["created_at"], "version": "production",
                  "jurisdiction": e.get("jurisdiction")} for i, e in chunk]
        info = {"page": page_n, "per_page": size, "count": len(items), "total_count": len(rows)}
        return items, info

    def delete(self, account: str, db_id: str) -> None:
        with self._lock:
            if self._entry(account, db_id) is None:
                raise self._not_found(db_id)
            db = self._dbs.pop((account, db_id), None)
            if db is not None:
                db.close()
            path = self._db_path(account, db_id)
            for suffix in ("", "-journal", "-wal", "-shm"):
                p = Path(str(path) + suffix)
                if p.exists():
                    p.unlink()
            self._catalog(account)[db_id]["deleted_at"] = _now_iso()
            self._save_catalog(account)

    def close(self) -> None:
        with self._lock:
            for db in self._dbs.values():
                try:
                    db.close()
                except Exception:
                    pass
            self._dbs.clear()


def _int_arg(what: str, raw: Any, default: int, lo: int, hi: int | None) -> int:
    if raw is None or raw == "":
        return default
    try:
        n = int(str(raw))
    except ValueError:
        raise CFError(400, D1_BAD_REQUEST, f"{what} must be an integer") from None
    if n < lo or (hi is not None and n > hi):
        raise CFError(400, D1_BAD_REQUEST, f"{what} must be between {lo} and {hi}" if hi else f"{what} must be >= {lo}")
    return n


def _now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_body(body: Any) -> list[tuple[str, list]]:
    """`{"sql", "params"}` or `{"batch": [{"sql", "params"}, ...]}` -> [(sql, params)]."""
    if not isinstance(body, dict):
        raise CFError(400, D1_BAD_REQUEST, "Request body must be a JSON object with 'sql' or 'batch'")
    if "batch" in body:
        batch = body["batch"]
        if not isinstance(batch, list) or not batch:
            raise CFError(400, D1_BAD_REQUEST, "'batch' must be a non-empty array of {sql, params}")
        items = batch
    else:
        items = [body]
    out = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get("sql"), str):
            raise CFError(400, D1_BAD_REQUEST, "Each query needs a string 'sql'")
        params = it.get("params")
        if params is None:
            params = []
        if not isinstance(params, list):
            raise CFError(400, D1_BAD_REQUEST, "'params' must be an array")
        out.append((it["sql"], params))
    return out


def error(message: str) -> CFError:
    return CFError(400, D1_SQL_ERROR, message)
