"""The order of Vectorize's mutation ids as this process saw them (``MutationLog``), to answer "is this write
applied yet?" from ``processedUpToMutation``: a write of this process whose response came back before another was
sent is applied before it; other ids (writes in flight at once, another instance's) order by their value when they
are UUIDv7s, else by time, once the index has visibly moved since the write and ``settle`` seconds have passed.

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
from typing import Any, TypeVar

from services.ports import VectorIndexInfo, wait_searchable

__all__ = ["MutationLog", "AsyncWrites"]

T = TypeVar("T")
_UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


class MutationLog:
    """What this process knows of the order in which the index applies mutations.

    The index applies writes in the order it accepted them. A write whose response this process had received
    before it sent another write was accepted first, so once the later one is applied, so is the earlier. Two
    writes in flight at once (a job's upsert beside an append's delete, two organizations' rounds) may have
    been accepted in either order, whatever order their responses came back in: for those the ids decide when
    they are UUIDv7s, else time (``passed``). Each write is stamped with a tick of one clock when it is sent
    (``sending``) and when its id comes back (``record``)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._clock = 0
        #: id -> [tick sent, tick received, wall time received, what /info said was processed then, seen processed]
        self._ids: OrderedDict[str, list[Any]] = OrderedDict()
        self.done_tick = 0  # every mutation received before this tick is processed
        self.last_processed: str | None = None

    def sending(self) -> int:
        """The tick of a write about to be sent (pass it to ``record`` with the id its response carries)."""
        self._clock += 1
        return self._clock

    def record(self, mutation_id: str, sent: int) -> None:
        if mutation_id in self._ids:
            return
        self._clock += 1
        self._ids[mutation_id] = [sent, self._clock, time.time(), self.last_processed, False]
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def applied(self, mutation_id: str) -> bool:
        """Known to be applied from what /info has already said (no request)."""
        mine = self._ids.get(mutation_id)
        return mine is not None and (mine[4] or mine[1] < self.done_tick)

    def observe(self, processed: str | None) -> None:
        if processed is None:
            return
        self.last_processed = processed
        theirs = self._ids.get(processed)
        if theirs is not None:
            theirs[4] = True
            self.done_tick = max(self.done_tick, theirs[0])

    def passed(self, mutation_id: str, processed: str | None, *, issued_at: float | None, settle: float) -> bool:
        if not mutation_id or self.applied(mutation_id):
            return True
        if processed is None:
            return False
        if processed == mutation_id:
            return True
        mine, theirs = self._ids.get(mutation_id), self._ids.get(processed)
        if mine is not None and theirs is not None:
            if mine[1] < theirs[0]:  # ours came back before theirs was sent: accepted, so applied, first
                return True
            if theirs[1] < mine[0]:  # theirs was accepted before ours was sent
                return False
        a, b = mutation_id.lower(), processed.lower()
        if _UUID7.match(a) and _UUID7.match(b):
            return b >= a
        # opaque ids we cannot order (another instance's, or two writes in flight at once): trust time, once
        # the index has visibly moved since the write
        when = mine[2] if mine is not None else issued_at
        seen_then = mine[3] if mine is not None else None
        if when is None:
            return False
        return processed != seen_then and time.time() - when >= settle


class AsyncWrites:
    """Asynchronously applied writes, for an index adapter that defines ``info()`` (which must call
    ``self._fresh(info)`` with what it read) and sends every write through ``_write``."""

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

    async def _write(self, request: Awaitable[T], mutation_ids: Callable[[T], list[str | None]]) -> str | None:
        """Send one write request (``request``: a coroutine not yet awaited, so the tick is taken before it is
        sent) and record the mutation ids ``mutation_ids`` reads from its response; the last of them."""
        sent = self.mutations.sending()
        last: str | None = None
        for mutation_id in mutation_ids(await request):
            if mutation_id:
                self.mutations.record(mutation_id, sent)
                self.last_mutation = last = mutation_id
                self._info_cache = None
        return last

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
        if self.mutations.applied(mutation_id):
            return True
        info = await self._fresh_info()
        return self.mutations.passed(mutation_id, info.processed_up_to_mutation, issued_at=issued_at,
                                     settle=self.settle_seconds)

    async def wait_for(self, mutation_id: str | None, timeout: float = 30.0, *, issued_at: float | None = None) -> bool:
        """Poll ``info()`` until ``mutation_id`` is applied; False when ``timeout`` seconds pass first."""
        return await wait_searchable(self, mutation_id, timeout, issued_at=issued_at)  # type: ignore[arg-type]
