"""The embedded SQL adapter: one SQLite file, D1's semantics.

WAL, foreign keys on, a busy timeout. Every call runs in a worker thread so the event loop never waits on
disk. Writes go through one connection guarded by a lock (SQLite has one writer anyway); reads use a small
pool of read connections so searches don't queue behind writes.

Durability: ``synchronous=FULL``. In WAL mode NORMAL syncs only at checkpoints, so the last transactions
before a power cut (or a kernel crash) can be lost although they were acknowledged; FULL syncs the WAL at
every commit, which is what "an acknowledged write is kept" needs (its cost: README, "Durability").

A full disk (SQLITE_FULL, ENOSPC) raises ``InsufficientStorage`` with SQLite's own message; the transaction is
rolled back whole (a failing ROLLBACK, e.g. when SQLite already rolled back, never hides the cause).
``checkpoint()`` folds the WAL into the database and truncates it (the worker calls it when space returns).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import queue
import re
import shutil
import sqlite3
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.adapters.keyword_index import CHUNK_KINDS, ChunkKeywordIndex, KeywordIndex
from services.errors import BackendError, InsufficientStorage, InvalidInput
from services.ports import SqlResult, SqlValue, Statement

__all__ = ["SqliteDatabase", "free_bytes", "rollback_quietly", "storage_error"]

log = logging.getLogger("memex.sqlite")

#: The WAL is truncated back to this size after a checkpoint (it never keeps a disk-full episode's growth).
JOURNAL_SIZE_LIMIT = 16 * 1024 * 1024

_READ_ONLY = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)
_TXN = re.compile(r"^\s*(BEGIN|COMMIT|END|ROLLBACK|SAVEPOINT|RELEASE)\b", re.IGNORECASE)


def _reads_only(sql: str) -> bool:
    """A statement that only reads (a reader runs it): SELECT or WITH, without RETURNING."""
    return bool(_READ_ONLY.match(sql)) and "RETURNING" not in sql.upper()


def _connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    uri = path.startswith("file:")
    conn = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False, uri=uri)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA busy_timeout = 10000")
    if not readonly:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
    return conn


def storage_error(exc: BaseException) -> InsufficientStorage | None:
    """The ``InsufficientStorage`` a full disk raised as ``exc`` (SQLITE_FULL or ENOSPC), else None."""
    if isinstance(exc, InsufficientStorage):
        return exc
    full = False
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        full = (code is not None and code & 0xFF == sqlite3.SQLITE_FULL) or "database or disk is full" in str(exc)
    elif isinstance(exc, OSError):
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full:
        return None
    return InsufficientStorage(
        "insufficient storage: the disk is full; nothing was written, retry once space is freed",
        details={"reason": str(exc)},
    )


def rollback_quietly(conn: sqlite3.Connection) -> None:
    """Roll back if a transaction is still open. SQLite rolls back by itself on some errors (a full disk);
    a ROLLBACK that fails then must not replace the error that caused it."""
    if not conn.in_transaction:
        return
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error:
        log.warning("ROLLBACK failed after an error", exc_info=True)


def _rows(cur: sqlite3.Cursor) -> list[dict]:
    if cur.description is None:
        return []
    return [dict(r) for r in cur.fetchall()]


class SqliteDatabase:
    """SqlDatabase over a local SQLite file (``":memory:"`` is not supported: use a temp file)."""

    def __init__(self, path: str | Path, *, readers: int = 4, keyword_index_from: int | None = None) -> None:
        """``keyword_index_from``: an organization database whose thoughts get a tantivy index from that many
        documents up, and its conversation chunks from that many chunks up (services.adapters.keyword_index); None:
        none (the control database, tools)."""
        self.path = str(path)
        if not self.path.startswith("file:"):
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._writer = _connect(self.path)
        except sqlite3.Error as exc:  # opening (creating) the file on a full disk: InsufficientStorage, as writes are
            full = storage_error(exc)
            if full is not None:
                raise full from None
            raise
        self._closed = False
        self._write_lock = threading.Lock()
        self._readers: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._all_readers: list[sqlite3.Connection] = []
        for _ in range(readers):
            conn = _connect(self.path, readonly=True)
            self._readers.put(conn)
            self._all_readers.append(conn)
        # ``read_now``'s own reader (opened on first use): the pool's may all be in worker threads under load
        self._now_lock = threading.Lock()
        self._now_conn: sqlite3.Connection | None = None
        self._keywords: KeywordIndex | None = None
        self._chunk_keywords: ChunkKeywordIndex | None = None
        if keyword_index_from is not None and not self.path.startswith("file:"):
            def read(sql: str, params: tuple) -> list[dict[str, Any]]:
                return self._run_one(sql, params).rows

            def connect() -> sqlite3.Connection:
                return _connect(self.path, readonly=True)

            self._keywords = KeywordIndex(self.path, read, connect, build_from=keyword_index_from)
            self._chunk_keywords = ChunkKeywordIndex(self.path, read, connect, build_from=keyword_index_from)

    # -- sync cores (run in threads) -------------------------------------------------------------

    def _run_one(self, sql: str, params: Sequence[SqlValue]) -> SqlResult:
        if _TXN.match(sql):
            raise InvalidInput("transactions are not allowed: use batch()")
        if _reads_only(sql):
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
                rollback_quietly(conn)
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
                rollback_quietly(conn)
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

    def read_now(self, sql: str, params: Sequence[SqlValue] = ()) -> SqlResult | None:
        """A read statement run at once on the calling thread (the event loop), on a reader of its own; None when
        that reader is in use (another thread calling), or for a statement that writes: the caller then runs it as
        usual, in a worker thread.

        Only for a statement its caller bounds to a few dozen primary-key lookups (a search's hydration: ~0.3 ms).
        In a worker thread such a statement lets go of the GIL at each step and, on a busy server, waits to take it
        back each time while the loop runs Python: at 101,786 chunks with 8 clients, reading the hits' rows on the
        loop took the search's p95 from a median of 93.6 to 79.9 ms (bench/README.md)."""
        if not _reads_only(sql) or self._closed:
            return None
        if not self._now_lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                return None
            if self._now_conn is None:
                self._now_conn = _connect(self.path, readonly=True)
            return SqlResult(rows=_rows(self._now_conn.execute(sql, tuple(params))))
        except (sqlite3.Error, OSError) as exc:
            _translate(exc)
            raise
        finally:
            self._now_lock.release()

    async def keyword_search(self, org_id: str, words: list[str], limit: int,
                             then: Callable[[list[tuple[Any, float]]], Statement] | None = None,
                             *, chunk_kinds: list[str] | None = None) -> Any:
        """The thoughts' keyword side from the tantivy index: (document id, BM25) best first, or None when there is
        no index or it is behind (the caller ranks with FTS5). With ``chunk_kinds`` (of ``CHUNK_KINDS``), the
        conversation chunks' index instead: (chunk pk, BM25) of those kinds.

        ``then(hits)``: a read statement made from the hits (bound to the organization: ``OrgSql.stmt``), run in the
        same worker thread right after them; the answer is then (hits, its rows). One hand-over to a thread and back
        instead of two: on a busy server each one waits for the GIL."""
        kw: KeywordIndex | None = self._keywords if chunk_kinds is None else self._chunk_keywords
        if kw is None or not kw.wanted() or (chunk_kinds is not None and not set(chunk_kinds) <= set(CHUNK_KINDS)):
            return None  # (a kind the chunk index does not hold: knowledge)

        def run() -> Any:
            hits = kw.search(org_id, words, limit, chunk_kinds)
            if then is None or hits is None:
                return hits
            if not hits:
                return hits, []
            st = then(hits)
            return hits, self._run_one(st.sql, st.params).rows

        return await _off_loop(run)

    async def keyword_sync(self, timeout: float = 120.0, *, chunks: bool = False) -> bool:
        """Bring the keyword index (``chunks``: the conversation chunks') up to date now (builds it if the
        organization is large enough): True when it is current. For tests, benchmarks and tools; the service catches
        up on its own."""
        kw = self._chunk_keywords if chunks else self._keywords
        return kw is not None and await asyncio.to_thread(kw.sync, timeout)

    def _checkpoint(self) -> None:
        with self._write_lock:
            self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    async def checkpoint(self) -> None:
        """Fold the WAL into the database and truncate it."""
        await _off_loop(self._checkpoint)

    def free_bytes(self) -> int | None:
        """Free space on the file system holding the database (None when unknown)."""
        return free_bytes(self.path)

    def _close(self) -> None:
        for kw in (self._keywords, self._chunk_keywords):  # a catch-up reads with a connection of its own
            if kw is not None:
                kw.close()
        # Wait for statements in flight (a connection closed under a running statement crashes the process).
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            self._writer.close()
        with self._now_lock:
            if self._now_conn is not None:
                self._now_conn.close()
                self._now_conn = None
        for _ in self._all_readers:
            try:
                self._readers.get(timeout=30).close()
            except queue.Empty:  # a reader still busy after 30 s: leave it to the garbage collector
                log.warning("closing %s: a reader is still busy", self.path)

    async def close(self) -> None:
        await asyncio.to_thread(self._close)


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


def free_bytes(path: str) -> int | None:
    if path.startswith("file:"):
        return None
    try:
        return shutil.disk_usage(Path(path).parent).free
    except OSError:
        return None


async def _off_loop(fn, *args):
    try:
        return await asyncio.to_thread(fn, *args)
    except sqlite3.IntegrityError:
        raise
    except (sqlite3.Error, OSError) as exc:
        _translate(exc)
        raise


def _translate(exc: sqlite3.Error | OSError) -> None:
    """Raise what a caller should see for ``exc`` (a full disk, a busy database), if anything."""
    full = storage_error(exc)
    if full is not None:
        raise full from exc
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
        raise BackendError("database is busy, retry", details={"reason": str(exc)}) from exc
