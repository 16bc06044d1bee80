"""The order of Vectorize's mutation ids as this process saw them (``MutationLog``), to answer "is this write
applied yet?" from ``processedUpToMutation`` (``services.adapters.cloudflare.vectorize``'s ``searchable``): ids this
process issued are ordered by their issue; UUIDv7 ids by their value; opaque ids by time, once the index has
visibly moved since the write and ``settle`` seconds have passed.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict

__all__ = ["MutationLog"]

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
