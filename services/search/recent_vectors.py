"""Vectors computed at capture, kept in process for a few minutes: reused by the embedding job and compared
by the write-time decisions while the index may not show them yet.

A capture embeds its thought's first chunk once (services.thoughts.decisions). The vector is remembered here under
(organization, SHA-256 of the chunk text):

* the embedding stage (services.search.indexing.EmbedStage) takes it instead of running the model again, so the
  model's work moves onto the capture path instead of being done twice;
* the decisions of the next captures compare against the organization's most recent entries as well as the
  index, which covers the window in which a just-captured thought has no searchable vector yet (the job has
  not run, or Vectorize has not applied the write);
* a search that scores keyword hits not indexed yet (services.search.unindexed) leaves its vectors here for their
  embedding job, and waits for the job's model call instead when that call, a small one, is already running
  (``expect`` / ``settle`` / ``in_flight``): a thought searched right after its capture is embedded once.

Entries are per organization (a cache hit must not tell one tenant what another captured), bounded in number
and age. Process-local: several instances do not see each other's entries (see services.thoughts.decisions).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


__all__ = ["RecentVectors", "text_key"]


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(slots=True)
class _Entry:
    vector: np.ndarray
    parent_id: str | None
    at: float


class RecentVectors:
    def __init__(
        self, *, max_entries: int = 8192, ttl_seconds: float = 900.0, scan: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.ttl = ttl_seconds
        self.scan = scan
        self.clock = clock
        self._all: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._by_org: dict[str, OrderedDict[str, _Entry]] = {}
        self.hits = 0
        self.misses = 0
        #: (organization, text key) -> the future of a model call in progress (``expect``), on the event loop.
        self._flight: dict[tuple[str, str], asyncio.Future] = {}

    def put(self, org_id: str, text: str, vector: np.ndarray, parent_id: str | None = None) -> None:
        key = (org_id, text_key(text))
        entry = _Entry(np.asarray(vector, dtype=np.float32), parent_id, self.clock())
        self._all[key] = entry
        self._all.move_to_end(key)
        org = self._by_org.setdefault(org_id, OrderedDict())
        org[key[1]] = entry
        org.move_to_end(key[1])
        while len(self._all) > self.max_entries:
            (old_org, old_key), _ = self._all.popitem(last=False)
            bucket = self._by_org.get(old_org)
            if bucket is not None:
                bucket.pop(old_key, None)
                if not bucket:
                    del self._by_org[old_org]

    def get(self, org_id: str, text: str) -> np.ndarray | None:
        entry = self._all.get((org_id, text_key(text)))
        if entry is None or self.clock() - entry.at > self.ttl:
            self.misses += 1
            return None
        self.hits += 1
        return entry.vector

    def expect(self, org_id: str, texts: list[str]) -> None:
        """A model call is about to embed ``texts`` of the organization (the job worker's): ``in_flight`` hands a
        search a future of each one's vector until ``settle``. Called on the event loop."""
        loop = asyncio.get_running_loop()
        for text in texts:
            self._flight.setdefault((org_id, text_key(text)), loop.create_future())

    def settle(self, org_id: str, texts: list[str], vectors: np.ndarray | None) -> None:
        """The call of ``expect`` ended: each future gets its text's vector (None: the call failed). The vectors are
        not kept here (the job stores them in the index)."""
        for i, text in enumerate(texts):
            future = self._flight.pop((org_id, text_key(text)), None)
            if future is not None and not future.done():
                future.set_result(None if vectors is None else np.asarray(vectors[i], dtype=np.float32))

    def in_flight(self, org_id: str, text: str) -> asyncio.Future | None:
        """The future of the organization's model call embedding ``text`` right now, if there is one."""
        return self._flight.get((org_id, text_key(text)))

    def similar(self, org_id: str, vector: np.ndarray) -> list[tuple[str, float]]:
        """(parent id, cosine) of the organization's most recent captured thoughts, at most ``scan`` of them."""
        bucket = self._by_org.get(org_id)
        if not bucket:
            return []
        now = self.clock()
        entries = []
        for entry in reversed(bucket.values()):
            if now - entry.at > self.ttl or len(entries) >= self.scan:
                break
            if entry.parent_id is not None:
                entries.append(entry)
        if not entries:
            return []
        scores = np.stack([e.vector for e in entries]) @ np.asarray(vector, dtype=np.float32)
        return [(e.parent_id, float(s)) for e, s in zip(entries, scores, strict=True)]
