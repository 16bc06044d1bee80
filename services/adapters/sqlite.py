"""The embedded SQL adapter: one SQLite file, D1's semantics.

WAL, foreign keys on, a busy timeout. Every call runs in a worker thread so the event loop never waits on
disk. Writes go through one connection guarded by a lock (SQLite has one writer anyway); reads use a small
pool of read connections so searches don't queue behind writes.
"""

from __future__ import annotations

import asyncio
import queue
import re
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from services.errors import BackendError, InvalidInput
from services.ports import SqlResult, SqlValue, Statement

__all__ = ["SqliteDatabase"]

_READ_ONLY = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)
_TXN = re.compile(r"^\s*(BEGIN|COMMIT|END|ROLLBACK|SAVEPOINT|RELEASE)\b", re.IGNORECASE)


def _connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    uri = path.startswith("file:")
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False, uri=uri)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA busy_timeout = 10000")
    if not readonly:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def _rows(cur: sqlite3.Cursor) -> list[dict]:
    if cur.description is None:
        return []
    return [dict(r) for r in cur.fetchall()]


class SqliteDatabase:
    """SqlDatabase over a local SQLite file (``":memory:"`` is not supported: use a temp file)."""

    def __init__(self, path: str | Path, *, readers: int = 4) -> None:
        self.path = str(path)
        if not self.path.startswith("file:"):
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._writer = _connect(self.path)
        self._write_lock = threading.Lock()
        self._readers: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._all_readers: list[sqlite3.Connection] = []
        for _ in range(readers):
            conn = _connect(self.path, readonly=True)
            self._readers.put(conn)
            self._all_readers.append(conn)

    # -- sync cores (run in threads) -------------------------------------------------------------

    def _run_one(self, sql: str, params: Sequence[SqlValue]) -> SqlResult:
        if _TXN.match(sql):
            raise InvalidInput("transactions are not allowed: use batch()")
        if _READ_ONLY.match(sql) and "RETURNING" not in sql.upper():
            conn = self._readers.get()
            try:
                cur = conn.execute(sql, tuple(params))
                return SqlResult(rows=_rows(cur))
            finally:
                self._readers.put(conn)
        with self._write_lock:
            before = self._writer.total_changes
            cur = self._writer.execute(sql, tuple(params))
            rows = _rows(cur)
            return SqlResult(rows=rows, changes=self._writer.total_changes - before, last_row_id=cur.lastrowid or 0)

    def _run_batch(self, statements: Sequence[Statement]) -> list[SqlResult]:
        for st in statements:
            if _TXN.match(st.sql):
                raise InvalidInput("transactions are not allowed inside a batch")
        with self._write_lock:
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = []
                for st in statements:
                    before = conn.total_changes
                    cur = conn.execute(st.sql, tuple(st.params))
                    out.append(
                        SqlResult(rows=_rows(cur), changes=conn.total_changes - before, last_row_id=cur.lastrowid or 0)
                    )
                conn.execute("COMMIT")
                return out
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def _run_script(self, sql: str) -> None:
        with self._write_lock:
            conn = self._writer
            conn.execute("BEGIN IMMEDIATE")
            try:
                # executescript would COMMIT first; split on the statement boundaries sqlite itself finds
                for stmt in _split_script(sql):
                    conn.execute(stmt)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    # -- the port --------------------------------------------------------------------------------

    async def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> SqlResult:
        return await _off_loop(self._run_one, sql, params)

    async def batch(self, statements: Sequence[Statement]) -> list[SqlResult]:
        if not statements:
            return []
        return await _off_loop(self._run_batch, statements)

    async def executescript(self, sql: str) -> None:
        await _off_loop(self._run_script, sql)

    async def close(self) -> None:
        self._writer.close()
        for conn in self._all_readers:
            conn.close()


def _split_script(sql: str) -> list[str]:
    """Split a SQL script into complete statements (triggers with inner ';' stay whole)."""
    out, buf = [], ""
    for line in sql.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                out.append(buf.strip())
            buf = ""
    if buf.strip() and not buf.strip().startswith("--"):
        if sqlite3.complete_statement(buf + ";"):
            out.append(buf.strip())
    return out


async def _off_loop(fn, *args):
    try:
        return await asyncio.to_thread(fn, *args)
    except sqlite3.IntegrityError:
        raise
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            raise BackendError("database is busy, retry", details={"reason": str(exc)}) from exc
        raise
