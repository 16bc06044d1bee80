"""The order of Vectorize's mutation ids as this process saw them (``MutationLog``), to answer "is this write
applied yet?" from ``processedUpToMutation``: ids this process issued are ordered by their issue; UUIDv7 ids by
their value; opaque ids by time, once the index has visibly moved since the write and ``settle`` seconds have passed.

``AsyncWrites`` is that answer for an index adapter (over the REST API, ``vectorize``, or through the Worker,
``worker_vectors``): the mutations it issued, ``info()`` cached for ``info_max_age`` seconds and shared by concurrent
callers, ``searchable`` and ``wait_for``.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from services.ports import VectorIndexInfo, wait_searchable

__all__ = ["MutationLog", "AsyncWrites"]

_UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class MutationLog:
    """The order of the mutation ids this process received, and how far /info has been seen to reach."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._seq = 0
        self._ids: OrderedDict[str, tuple[int, float, str | None]] = OrderedDict()  # id -> (seq, wall, processed then)
        self.done_seq = 0  # every mutation with seq <= done_seq is processed
        self.last_processed: str | None = None

    def record(self, mutation_id: str) -> None:
        if mutation_id in self._ids:
            return
        self._seq += 1
        self._ids[mutation_id] = (self._seq, time.time(), self.last_processed)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def seq(self, mutation_id: str) -> int | None:
        hit = self._ids.get(mutation_id)
        return hit[0] if hit else None

    def observe(self, processed: str | None) -> None:
        if processed is None:
            return
        self.last_processed = processed
        s = self.seq(processed)
        if s is not None and s > self.done_seq:
            self.done_seq = s

    def passed(self, mutation_id: str, processed: str | None, *, issued_at: float | None, settle: float) -> bool:
        if not mutation_id:
            return True
        mine = self._ids.get(mutation_id)
        if mine is not None and mine[0] <= self.done_seq:
            return True
        if processed is None:
            return False
        if processed == mutation_id:
            return True
        theirs = self.seq(processed)
        if mine is not None and theirs is not None:
            return theirs >= mine[0]
        a, b = mutation_id.lower(), processed.lower()
        if _UUID7.match(a) and _UUID7.match(b):
            return b >= a
        # opaque ids we cannot order: trust time, once the index has visibly moved since the write
        when = mine[1] if mine is not None else issued_at
        seen_then = mine[2] if mine is not None else None
        if when is None:
            return False
        return processed != seen_then and time.time() - when >= settle


class AsyncWrites:
    """Asynchronously applied writes, for an index adapter that defines ``info()`` (which must call
    ``self._fresh(info)`` with what it read) and calls ``_record`` with every mutation id it is given."""

    info_max_age: float
    settle_seconds: float
    #: the adapter's own ``/info`` read (a method of the class that mixes this in)
    info: Callable[[], Awaitable[VectorIndexInfo]]

    def _init_writes(self, *, info_max_age: float, settle_seconds: float) -> None:
        self.info_max_age = info_max_age
        self.settle_seconds = settle_seconds
        self.mutations = MutationLog()
        self.last_mutation: str | None = None
        self._info_lock = asyncio.Lock()
        self._info_cache: tuple[float, VectorIndexInfo] | None = None

    def _record(self, mutation_id: str | None) -> None:
        if mutation_id:
            self.mutations.record(mutation_id)
            self.last_mutation = mutation_id
            self._info_cache = None

    def _fresh(self, info: VectorIndexInfo) -> VectorIndexInfo:
        """Remember what ``info()`` just read (and how far the index has been seen to reach)."""
        self.mutations.observe(info.processed_up_to_mutation)
        self._info_cache = (time.monotonic(), info)
        return info

    async def _fresh_info(self) -> VectorIndexInfo:
        cached = self._info_cache
        if cached is not None and time.monotonic() - cached[0] <= self.info_max_age:
            return cached[1]
        async with self._info_lock:  # concurrent callers share one request
            cached = self._info_cache
            if cached is not None and time.monotonic() - cached[0] <= self.info_max_age:
                return cached[1]
            return await self.info()

    async def searchable(self, mutation_id: str | None, *, issued_at: float | None = None) -> bool:
        """Whether the index has applied ``mutation_id`` (and so every earlier write of this process)."""
        if not mutation_id:
            return True
        seq = self.mutations.seq(mutation_id)
        if seq is not None and seq <= self.mutations.done_seq:
            return True
        info = await self._fresh_info()
        return self.mutations.passed(mutation_id, info.processed_up_to_mutation, issued_at=issued_at,
                                     settle=self.settle_seconds)

    async def wait_for(self, mutation_id: str | None, timeout: float = 30.0, *, issued_at: float | None = None) -> bool:
        """Poll ``info()`` until ``mutation_id`` is applied; False when ``timeout`` seconds pass first."""
        return await wait_searchable(self, mutation_id, timeout, issued_at=issued_at)  # type: ignore[arg-type]
