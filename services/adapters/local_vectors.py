"""The embedded vector adapter: exact cosine search with numpy, Vectorize's semantics.

Durability: one SQLite file of its own (``vectors(id, namespace, "values" float32 BLOB, metadata JSON)`` plus a
``meta`` table recording the embedding model, the dimensions and the mutation counter), WAL, ``synchronous=FULL``.
Every write runs in a worker thread and is committed before the call returns. The SQL store is the source of
truth for memories; this file is a rebuildable cache of their vectors (``was_created``/``was_reset`` tell the
service when a rebuild is due).

Search: per-namespace contiguous float32 matrices of unit rows (namespace == organization), loaded lazily on a
namespace's first query, with ids and metadata alongside (``services.adapters.vector_matrix``). A query scans
only its namespace's matrix with one matrix-vector product, so organizations never see each other's vectors and
cost follows the organization's size, not the deployment's. Upserts append (capacity doubling) or replace in
place; deletes swap-remove. Filters are Vectorize's, compiled to predicates (``services.adapters.vector_filters``).

Differences from Vectorize, on purpose: writes are visible immediately (the mutation id is a monotonic counter
and ``info().processed_up_to_mutation`` is always the latest); every metadata property is filterable (there are
no metadata indexes to create); scores are always exact. Vectorize's size limits (id and namespace <= 64 bytes,
metadata <= 10 KiB, filter JSON < 2048 bytes, topK <= 100) are enforced so what works here works there.

Thread-safety: one lock serialises writers and namespace loads (and guards the SQLite connection); each loaded
namespace has its own lock, held for the short in-memory mutations and for the duration of a query's scan, so
a query on one organization never waits for another's. Small namespaces are searched on the event-loop thread
(tens of microseconds); big ones in a worker thread.

One process per file: the in-memory matrices do not see writes made by another process to the same file.

A full disk raises ``InsufficientStorage`` (SQLite's message kept; the write rolled back whole, memory untouched);
the WAL is truncated after checkpoints (``journal_size_limit``) and ``checkpoint()`` folds and truncates it on
demand (the worker calls it when space returns).
"""

from __future__ import annotations

import asyncio
import json
import logging
import numbers
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from services.adapters.sqlite import JOURNAL_SIZE_LIMIT, free_bytes, rollback_quietly, storage_error
from services.adapters.vector_filters import compile_filter
from services.adapters.vector_matrix import MIN_CAPACITY, Namespace, search_locked, unit_query, unit_rows
from services.errors import BackendError, EmbeddingModelMismatch, InvalidInput
from services.ports import Vector, VectorIndexInfo, VectorMatch

T = TypeVar("T")
log = logging.getLogger("memex.vectors")

__all__ = ["LocalVectorIndex"]

MAX_TOP_K = 100
MAX_ID_BYTES = 64
MAX_NAMESPACE_BYTES = 64
MAX_METADATA_BYTES = 10 * 1024

#: Namespaces with at most this many floats (rows x dimensions) are searched on the event loop (~1 ms of work).
INLINE_QUERY_MAX_FLOATS = 1_000_000
#: Up to this many floats (~167,000 rows of 384: ~3.5 ms of work) a namespace is searched on the event loop too when
#: the search is predictable: its filter's verdicts are kept (else its first search judges rows in Python) and no
#: writer holds the namespace (the loop never waits on its lock). A search in a worker thread lets go of the GIL at
#: each numpy or SimSIMD call and, on a busy server, waits to take it back each time, up to the 5 ms switch interval
#: while the loop runs Python: beside a thread running Python one search took 32.6 ms. At 101,786 rows over HTTP,
#: one client: p50 0.6 ms lower, first time and repeated (bench/README.md). Larger namespaces (1M rows: ~20 ms) are
#: searched in a thread.
INLINE_PREDICTABLE_MAX_FLOATS = 64_000_000

_SCHEMA_VERSION = "1"
_SQL_CHUNK = 500  # ids per IN (...) lookup

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS vectors (
    id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    "values" BLOB NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS vectors_namespace ON vectors(namespace);
"""


# -- validation ------------------------------------------------------------------------------------




def _check_name(kind: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"vector {kind} must be a non-empty string")
    if len(value.encode()) > limit:
        raise InvalidInput(f"vector {kind} is longer than {limit} bytes", details={kind: value[:80]})
    return value


def _meta_json(meta: Mapping[str, Any] | None, vid: str) -> str:
    if meta is None:
        return "{}"
    if not isinstance(meta, Mapping):
        raise InvalidInput("vector metadata must be an object", details={"id": vid})
    try:
        text = json.dumps(meta, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"vector metadata is not JSON: {exc}", details={"id": vid}) from exc
    if len(text.encode()) > MAX_METADATA_BYTES:
        raise InvalidInput(f"vector metadata is over {MAX_METADATA_BYTES} bytes", details={"id": vid})
    return text


def _chunks(seq: Sequence[str], size: int = _SQL_CHUNK):
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


# -- the adapter -----------------------------------------------------------------------------------


class LocalVectorIndex:
    """VectorIndex with exact cosine search over per-namespace numpy matrices, persisted in SQLite.

    ``path=None`` keeps everything in memory (tests). ``was_created`` is true when the store was new (no meta,
    no vectors) and ``was_reset`` when it held another model's (or dimension's) vectors and ``reset_on_mismatch``
    wiped it: either way the caller should rebuild the vectors from the SQL store. Without ``reset_on_mismatch`` a
    mismatch raises ``EmbeddingModelMismatch`` and leaves the file untouched.

    Writes apply synchronously (``applies_writes_later`` False, ``searchable`` always True); the index lists
    a namespace (``ids_in_namespace``, reconciliation). Beyond the port: ``delete_namespace`` (organization
    removal), ``preload`` (warm a namespace before its first query).
    """

    #: Every write is durable and visible when the call returns.
    applies_writes_later = False

    def __init__(
        self,
        path: str | Path | None,
        *,
        dimensions: int,
        model: str,
        reset_on_mismatch: bool = False,
    ) -> None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError("dimensions must be a positive integer")
        self.dimensions = dimensions
        self.model = model
        self.path = None if path is None else str(path)
        self.was_reset = False
        self.was_created = False
        self._closed = False
        self._write_lock = threading.RLock()  # writers, namespace loads, and every use of the connection
        self._ns_lock = threading.Lock()  # the namespace registry
        self._spaces: dict[str, Namespace] = {}
        try:
            self._connect()
        except sqlite3.Error as exc:  # creating the file on a full disk: InsufficientStorage (the worker pauses)
            full = storage_error(exc)
            if full is not None:
                raise full from None
            raise
        try:
            self._open(reset_on_mismatch)
        except BaseException as exc:
            self._db.close()
            full = storage_error(exc)
            if full is not None:
                raise full from None
            raise

    def _connect(self) -> None:
        if self.path is None:
            self._db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            return
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
        try:
            # 16 KiB pages fit ~10 rows of 384 floats (4 KiB pages waste a quarter on 1.6 KiB rows): a ~20% smaller
            # file and ~2x faster namespace loads. Only takes effect when the file is created.
            self._db.execute("PRAGMA page_size = 16384")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            self._db.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
            self._db.execute("PRAGMA busy_timeout = 10000")
        except BaseException:
            self._db.close()
            raise

    def _open(self, reset_on_mismatch: bool) -> None:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for stmt in _SCHEMA.split(";"):  # not executescript: it would COMMIT our transaction
                if stmt.strip():
                    db.execute(stmt)
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            if not meta:
                self.was_created = db.execute("SELECT 1 FROM vectors LIMIT 1").fetchone() is None
                if not self.was_created:  # vectors without meta: unknown provenance, treat as a mismatch
                    meta = {"model": "?", "dimensions": "?"}
            if meta:
                stored_model, stored_dims = meta.get("model"), meta.get("dimensions")
                if stored_model != self.model or stored_dims != str(self.dimensions):
                    if not reset_on_mismatch:
                        raise EmbeddingModelMismatch(
                            f"vector store {self.path or ':memory:'} holds {stored_model} ({stored_dims} dims), "
                            f"expected {self.model} ({self.dimensions} dims)",
                            details={
                                "stored_model": stored_model,
                                "stored_dimensions": stored_dims,
                                "model": self.model,
                                "dimensions": self.dimensions,
                            },
                        )
                    db.execute("DELETE FROM vectors")
                    self.was_reset = True
            self._mutation = int(meta.get("mutation", "0")) if meta.get("mutation", "0").isdigit() else 0
            db.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                [
                    ("schema_version", _SCHEMA_VERSION),
                    ("model", self.model),
                    ("dimensions", str(self.dimensions)),
                    ("mutation", str(self._mutation)),
                ],
            )
            db.execute("COMMIT")
        except BaseException:
            rollback_quietly(db)
            raise
        if self.was_reset and self.path is not None:
            db.execute("VACUUM")

    # -- sync cores (worker threads) -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("vector index is closed")

    def _next_mutation(self) -> str:
        self._mutation += 1
        self._db.execute("UPDATE meta SET value = ? WHERE key = 'mutation'", (str(self._mutation),))
        return str(self._mutation)

    def _mutate(self, write: Callable[[sqlite3.Connection], T]) -> tuple[T, str]:
        """Run ``write`` and advance the mutation counter in one transaction (the caller holds _write_lock);
        on failure both roll back. Returns what ``write`` returned and the new mutation id."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            result = write(db)
            mid = self._next_mutation()
            db.execute("COMMIT")
        except BaseException:
            rollback_quietly(db)
            try:
                self._mutation = int(db.execute("SELECT value FROM meta WHERE key = 'mutation'").fetchone()[0])
            except sqlite3.Error:  # the write's own error is the one to report
                log.warning("could not re-read the mutation counter", exc_info=True)
            raise
        return result, mid

    def _namespaces_of(self, ids: Sequence[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for chunk in _chunks(ids):
            marks = ",".join("?" * len(chunk))
            found.update(self._db.execute(f"SELECT id, namespace FROM vectors WHERE id IN ({marks})", chunk).fetchall())
        return found

    def _upsert_sync(self, vectors: Sequence[Vector]) -> str:
        # validate everything before writing anything; a repeated id keeps its last occurrence (one upsert)
        last: dict[str, int] = {}
        for i, v in enumerate(vectors):
            _check_name("id", v.id, MAX_ID_BYTES)
            _check_name("namespace", v.namespace, MAX_NAMESPACE_BYTES)
            last[v.id] = i
        keep = sorted(last.values())
        vectors = [vectors[i] for i in keep]
        rows = []
        for v in vectors:
            vals = v.values
            if isinstance(vals, np.ndarray) and vals.ndim != 1:
                raise InvalidInput(f"vector {v.id!r}: values must be one-dimensional")
            try:
                got = len(vals)
            except TypeError:
                raise InvalidInput(f"vector {v.id!r}: values must be a sequence of numbers") from None
            if got != self.dimensions:
                raise InvalidInput(
                    f"vector {v.id!r}: expected {self.dimensions} dimensions, got {got}",
                    details={"id": v.id, "dimensions": self.dimensions, "got": got},
                )
            rows.append(vals)
        unit = unit_rows(rows, self.dimensions, "upsert")
        metas = [_meta_json(v.metadata, v.id) for v in vectors]
        ids = [v.id for v in vectors]
        blobs = [unit[i].astype("<f4").tobytes() for i in range(len(vectors))]
        with self._write_lock:
            self._check_open()

            def write(db: sqlite3.Connection) -> dict[str, str]:
                old = self._namespaces_of(ids)
                db.executemany(
                    'INSERT INTO vectors (id, namespace, "values", metadata) VALUES (?, ?, ?, ?) '
                    'ON CONFLICT(id) DO UPDATE SET namespace = excluded.namespace, "values" = excluded."values", '
                    "metadata = excluded.metadata",
                    [(ids[i], vectors[i].namespace, blobs[i], metas[i]) for i in range(len(vectors))],
                )
                return old

            old, mid = self._mutate(write)
            # mirror into the loaded namespaces (unloaded ones read SQLite when first queried)
            touched = {v.namespace for v in vectors} | set(old.values())
            with self._ns_lock:
                spaces = {ns: self._spaces[ns] for ns in touched if ns in self._spaces}
            for i, v in enumerate(vectors):
                prev = old.get(v.id)
                if prev is not None and prev != v.namespace and prev in spaces:
                    with spaces[prev].lock:
                        spaces[prev].remove(v.id)
                space = spaces.get(v.namespace)
                if space is not None:
                    with space.lock:
                        space.put(v.id, unit[i], json.loads(metas[i]))
            return mid

    def _delete_sync(self, ids: Sequence[str]) -> str:
        ids = list(dict.fromkeys(i for i in ids if isinstance(i, str)))
        with self._write_lock:
            self._check_open()

            def write(db: sqlite3.Connection) -> dict[str, str]:
                old = self._namespaces_of(ids)
                for chunk in _chunks(ids):
                    db.execute(f"DELETE FROM vectors WHERE id IN ({','.join('?' * len(chunk))})", chunk)
                return old

            old, mid = self._mutate(write)
            with self._ns_lock:
                spaces = {ns: self._spaces[ns] for ns in set(old.values()) if ns in self._spaces}
            for vid, ns in old.items():
                space = spaces.get(ns)
                if space is not None:
                    with space.lock:
                        space.remove(vid)
            return mid

    def _delete_namespace_sync(self, namespace: str) -> str:
        with self._write_lock:
            self._check_open()
            _, mid = self._mutate(lambda db: db.execute("DELETE FROM vectors WHERE namespace = ?", (namespace,)))
            with self._ns_lock:
                space = self._spaces.pop(namespace, None)
            if space is not None:
                with space.lock:  # a query holding the old object sees it empty
                    space.clear()
            return mid

    def _load_sync(self, namespace: str) -> Namespace:
        with self._write_lock:  # no write can commit between our read and the install
            self._check_open()
            with self._ns_lock:
                space = self._spaces.get(namespace)
            if space is not None:
                return space
            d = self.dimensions
            width = 4 * d
            (count,) = self._db.execute("SELECT COUNT(*) FROM vectors WHERE namespace = ?", (namespace,)).fetchone()
            mat = np.empty((max(MIN_CAPACITY, count + count // 4), d), dtype=np.float32)
            raw = memoryview(mat).cast("B")  # rows are copied straight into the matrix, no intermediate
            ids: list[str] = []
            metas: list[Any] = []
            n = 0
            cur = self._db.execute('SELECT id, "values", metadata FROM vectors WHERE namespace = ?', (namespace,))
            for vid, blob, meta in cur:
                if len(blob) != width or n >= count:  # a foreign row (or a count race, impossible under the lock)
                    continue
                raw[n * width : (n + 1) * width] = blob
                ids.append(vid)
                metas.append(meta)  # JSON text, parsed on first use
                n += 1
            raw.release()
            space = Namespace(namespace, d, mat, ids, metas)
            with self._ns_lock:
                self._spaces[namespace] = space
            return space

    def _get_sync(self, ids: list[str]) -> list[Vector]:
        with self._write_lock:
            self._check_open()
            found: dict[str, tuple] = {}
            for chunk in _chunks(ids):
                marks = ",".join("?" * len(chunk))
                for row in self._db.execute(
                    f'SELECT id, namespace, "values", metadata FROM vectors WHERE id IN ({marks})', chunk
                ):
                    found[row[0]] = row
        out = []
        for vid in ids:
            row = found.get(vid)
            if row is not None:
                values = np.frombuffer(row[2], dtype="<f4").astype(np.float32)
                out.append(Vector(id=row[0], values=values, namespace=row[1], metadata=json.loads(row[3])))
        return out

    def _ids_sync(self, namespace: str) -> set[str]:
        with self._write_lock:
            self._check_open()
            with self._ns_lock:
                space = self._spaces.get(namespace)
            if space is not None:
                with space.lock:
                    return set(space.ids)
            return {r[0] for r in self._db.execute("SELECT id FROM vectors WHERE namespace = ?", (namespace,))}

    def _info_sync(self) -> VectorIndexInfo:
        with self._write_lock:
            self._check_open()
            count = self._db.execute("SELECT COUNT(*) FROM vectors").fetchone()[0]
            mutation = str(self._mutation) if self._mutation else None
        return VectorIndexInfo(
            dimensions=self.dimensions, vector_count=count, model=self.model, processed_up_to_mutation=mutation
        )

    # -- the port --------------------------------------------------------------------------------

    async def upsert(self, vectors: Sequence[Vector]) -> str | None:
        """Insert or replace whole vectors (values, metadata and namespace); durable and visible on return."""
        if not vectors:
            return str(self._mutation) if self._mutation else None
        return await _writing(self._upsert_sync, list(vectors))

    async def query(
        self,
        vector: np.ndarray | Sequence[float],
        *,
        top_k: int,
        namespace: str,
        filter: Mapping[str, Any] | None = None,
        return_metadata: bool = False,
        return_values: bool = False,
    ) -> list[VectorMatch]:
        """The ``top_k`` nearest vectors of ``namespace`` by exact cosine similarity, best first, after ``filter``."""
        self._check_open()
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 1 <= top_k <= MAX_TOP_K:
            raise InvalidInput(f"top_k must be an integer from 1 to {MAX_TOP_K}", details={"top_k": str(top_k)})
        top_k = int(top_k)
        if not isinstance(namespace, str) or not namespace:
            raise InvalidInput("query namespace must be a non-empty string")
        q = unit_query(vector, self.dimensions)
        predicate = compile_filter(filter)
        with self._ns_lock:
            space = self._spaces.get(namespace)
        if space is None:
            space = await asyncio.to_thread(self._load_sync, namespace)
        # the filter's canonical JSON names its mask (services.adapters.vector_matrix keeps the recent ones)
        key = json.dumps(filter, sort_keys=True, separators=(",", ":")) if predicate is not None else None
        args = (q, top_k, predicate, bool(return_metadata), bool(return_values), key)
        floats = space.n * self.dimensions
        if floats <= INLINE_QUERY_MAX_FLOATS:
            return search_locked(space, args)
        if floats <= INLINE_PREDICTABLE_MAX_FLOATS and (key is None or key in space.masks) and \
                space.lock.acquire(blocking=False):
            try:
                return space.search(*args)
            finally:
                space.lock.release()
        return await asyncio.to_thread(search_locked, space, args)

    async def get_by_ids(self, ids: Sequence[str]) -> list[Vector]:
        """Stored vectors (unit length), in the order asked, unknown ids omitted."""
        ids = list(dict.fromkeys(i for i in ids if isinstance(i, str)))
        if not ids:
            return []
        return await asyncio.to_thread(self._get_sync, ids)

    async def delete_by_ids(self, ids: Sequence[str]) -> str | None:
        """Delete by (index-global) id; unknown ids are ignored. Durable and visible on return."""
        return await _writing(self._delete_sync, list(ids))

    async def info(self) -> VectorIndexInfo:
        return await asyncio.to_thread(self._info_sync)

    async def searchable(self, mutation_id: str | None, *, issued_at: float | None = None) -> bool:
        """Always True: writes are durable and visible when ``upsert``/``delete_by_ids`` return."""
        return True

    async def ids_in_namespace(self, namespace: str) -> set[str]:
        """Every vector id stored in ``namespace`` (for reconciling the SQL store against the index)."""
        return await asyncio.to_thread(self._ids_sync, namespace)

    async def preload(self, namespace: str) -> int:
        """Load ``namespace`` into memory now (else its first query does: ~0.5-1 s at 100k vectors); its size."""
        with self._ns_lock:
            space = self._spaces.get(namespace)
        if space is None:
            space = await asyncio.to_thread(self._load_sync, namespace)
        return space.n

    async def delete_namespace(self, namespace: str) -> str:
        """Delete every vector of ``namespace`` (an organization being removed); returns a mutation id."""
        return await _writing(self._delete_namespace_sync, namespace)

    def _checkpoint_sync(self) -> None:
        with self._write_lock:
            self._check_open()
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()

    async def checkpoint(self) -> None:
        """Fold the WAL into the file and truncate it (nothing to do in memory)."""
        if self.path is None:
            return
        await _writing(self._checkpoint_sync)

    def free_bytes(self) -> int | None:
        """Free space on the file system holding the index (None in memory)."""
        return None if self.path is None else free_bytes(self.path)

    async def close(self) -> None:
        def _close() -> None:
            with self._write_lock:
                if self._closed:
                    return
                self._closed = True
                with self._ns_lock:
                    self._spaces.clear()
                self._db.close()

        await asyncio.to_thread(_close)


async def _writing(fn: Callable[..., T], *args: Any) -> T:
    """Run a write off the loop; a full disk leaves as ``InsufficientStorage``."""
    try:
        return await asyncio.to_thread(fn, *args)
    except (sqlite3.Error, OSError) as exc:
        full = storage_error(exc)
        if full is not None:
            raise full from exc
        raise
