"""Handles that open on first use and close when a bounded pool evicts them.

A deployment serves thousands of organizations, each with its own database (and, embedded, its own vector
file); keeping every one open would exhaust file handles and memory. ``HandlePool`` keeps at most
``max_open`` handles open and closes the least recently used idle one when another opens. A closed handle is
not dead: its next call opens it again. So services can hold a handle for as long as they like, and an
eviction never breaks a request in flight (a handle with calls in flight is never closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from services.ports import SqlDatabase, SqlResult, SqlValue, Statement, Vector, VectorIndex, VectorIndexInfo, VectorMatch

__all__ = ["HandlePool", "PooledDatabase", "PooledIndex"]

log = logging.getLogger("memex.storage")

T = TypeVar("T", SqlDatabase, VectorIndex)
R = TypeVar("R")


class HandlePool:
    """At most ``max_open`` pooled handles open at once (least recently used idle ones close first)."""

    def __init__(self, max_open: int) -> None:
        self.max_open = max(2, max_open)
        self._open: OrderedDict[int, _Pooled[Any]] = OrderedDict()
        self.evicted = 0

    @property
    def open_count(self) -> int:
        return len(self._open)

    def used(self, handle: "_Pooled[Any]") -> None:
        self._open.move_to_end(id(handle))

    async def added(self, handle: "_Pooled[Any]") -> None:
        self._open[id(handle)] = handle
        for key in list(self._open):
            if len(self._open) <= self.max_open:
                break
            victim = self._open[key]
            if victim is handle or victim.in_flight:
                continue
            del self._open[key]
            self.evicted += 1
            await victim.suspend()

    def forget(self, handle: "_Pooled[Any]") -> None:
        self._open.pop(id(handle), None)


class _Pooled(Generic[T]):
    def __init__(self, pool: HandlePool, opener: Callable[[], T]) -> None:
        self._pool = pool
        self._opener: Callable[[], T] = opener
        self._inner: T | None = None
        self._lock = asyncio.Lock()
        self.in_flight = 0
        self._closed = False

    async def _get(self) -> T:
        if self._closed:
            raise RuntimeError("handle closed")
        inner = self._inner
        if inner is None:
            async with self._lock:
                inner = self._inner
                if inner is None:
                    inner = await asyncio.to_thread(self._opener)
                    self._inner = inner
                    await self._pool.added(self)
        else:
            self._pool.used(self)
        return inner

    async def _call(self, call: Callable[[T], Awaitable[R]]) -> R:
        """``call`` on the open adapter (opened first if need be), counted in flight while it runs."""
        inner = await self._get()
        self.in_flight += 1
        try:
            return await call(inner)
        finally:
            self.in_flight -= 1

    @property
    def is_open(self) -> bool:
        return self._inner is not None

    async def _checkpoint(self) -> None:
        """Checkpoint the adapter if it is open. A closed handle is not opened for it: SQLite folds the
        write-ahead log when the last connection to a database closes."""
        if self._inner is not None:
            await self._call(lambda inner: inner.checkpoint())

    def _free_bytes(self) -> int | None:
        """The open adapter's free space; None while the handle is closed."""
        inner = self._inner
        return inner.free_bytes() if inner is not None else None

    async def suspend(self) -> None:
        """Close the underlying adapter (the next call opens it again)."""
        inner, self._inner = self._inner, None
        if inner is not None:
            try:
                await inner.close()
            except Exception:
                log.warning("closing an evicted handle failed", exc_info=True)

    async def close(self) -> None:
        self._closed = True
        self._pool.forget(self)
        await self.suspend()


class PooledDatabase(_Pooled[SqlDatabase]):
    """A ``SqlDatabase`` that opens on first use (see the module docstring)."""

    async def execute(self, sql: str, params: Sequence[SqlValue] = ()) -> SqlResult:
        return await self._call(lambda db: db.execute(sql, params))

    async def batch(self, statements: Sequence[Statement]) -> list[SqlResult]:
        return await self._call(lambda db: db.batch(statements))

    async def executescript(self, sql: str) -> None:
        await self._call(lambda db: db.executescript(sql))

    async def checkpoint(self) -> None:
        await self._checkpoint()

    def free_bytes(self) -> int | None:
        return self._free_bytes()

    def read_now(self, sql: str, params: Sequence[SqlValue] = ()) -> SqlResult | None:
        """The open adapter's ``read_now`` (embedded SQLite), else None: a handle not open yet is not opened on the
        event loop, and the caller runs the statement as usual."""
        inner = self._inner
        read = getattr(inner, "read_now", None) if inner is not None and not self._closed else None
        if read is None:
            return None
        self._pool.used(self)
        self.in_flight += 1
        try:
            result: SqlResult | None = read(sql, params)
            return result
        finally:
            self.in_flight -= 1

    async def keyword_search(self, org_id: str, words: list[str], limit: int,
                             then: Callable[[list[tuple[Any, float]]], Statement] | None = None,
                             *, chunk_kinds: list[str] | None = None) -> Any:
        """The adapter's keyword indexes (embedded SQLite), else None: the caller ranks with FTS5."""
        async def call(db: SqlDatabase) -> Any:
            search = getattr(db, "keyword_search", None)
            return (await search(org_id, words, limit, then, chunk_kinds=chunk_kinds)
                    if search is not None else None)
        return await self._call(call)

    async def keyword_sync(self, timeout: float = 120.0, *, chunks: bool = False) -> bool:
        async def call(db: SqlDatabase) -> bool:
            sync = getattr(db, "keyword_sync", None)
            return bool(await sync(timeout, chunks=chunks)) if sync is not None else False
        return await self._call(call)


class PooledIndex(_Pooled[VectorIndex]):
    """A ``VectorIndex`` that opens on first use (see the module docstring).

    ``applies_writes_later`` is the wrapped adapter's, given at construction (it must be known before the
    first open): False by default, the embedded vector files applying every write at once."""

    def __init__(self, pool: HandlePool, opener: Callable[[], VectorIndex], dimensions: int, *,
                 applies_writes_later: bool = False) -> None:
        super().__init__(pool, opener)
        self.dimensions = dimensions
        self.applies_writes_later = applies_writes_later

    async def upsert(self, vectors: Sequence[Vector]) -> str | None:
        return await self._call(lambda index: index.upsert(vectors))

    async def query(self, vector: np.ndarray | Sequence[float], *, top_k: int, namespace: str,
                    filter: Mapping[str, Any] | None = None, return_metadata: bool = False,
                    return_values: bool = False) -> list[VectorMatch]:
        return await self._call(lambda index: index.query(vector, top_k=top_k, namespace=namespace, filter=filter,
                                                        return_metadata=return_metadata, return_values=return_values))

    async def get_by_ids(self, ids: Sequence[str]) -> list[Vector]:
        return await self._call(lambda index: index.get_by_ids(ids))

    async def delete_by_ids(self, ids: Sequence[str]) -> str | None:
        return await self._call(lambda index: index.delete_by_ids(ids))

    async def info(self) -> VectorIndexInfo:
        return await self._call(lambda index: index.info())

    async def searchable(self, mutation_id: str | None, *, issued_at: float | None = None) -> bool:
        return await self._call(lambda index: index.searchable(mutation_id, issued_at=issued_at))

    async def ids_in_namespace(self, namespace: str) -> set[str] | None:
        return await self._call(lambda index: index.ids_in_namespace(namespace))

    async def checkpoint(self) -> None:
        await self._checkpoint()

    def free_bytes(self) -> int | None:
        return self._free_bytes()

