"""Keyword hits whose chunks are not in the vector index yet, scored by their meaning at search time.

A capture (a thought, a conversation's new turns, a knowledge base's synced entries) is keyword-searchable when it is
acknowledged; its chunks are embedded by the job worker afterwards: at once when the worker is idle, minutes later
behind an import, seconds later on Vectorize, which applies writes asynchronously. Meanwhile the keyword side finds
the hit and the vector side cannot, and fusion gives it the vector side's floor, so anything close in meaning to
the query outranks it: what an agent has just remembered would not come back first (before this, a capture searched
at once by its own unique word was in the top 5 for 8 of 100 captures with MiniLM; the relevance floor could drop
it altogether).

So a search embeds those hits' first chunks itself, scores them against the query exactly, as the index would,
and fuses them as vector-side rows (``fuse(unindexed=...)``): the hits that could reach the candidates the search
hydrates with the best vector score (``reachable``; behind an import most keyword hits cannot), best keyword hit
first, at most ``UNINDEXED_EMBEDS`` of them, within a budget of model runs the process's searches share
(``RUNS_PER_SECOND``). Each is a model run on the request: behind an import of long notes, 3 of them took a search's
p50 from ~40 to ~160 ms, 1 to ~80 (bench/README.md). No run is done twice: a vector the
search computes is left in ``RecentVectors`` (services.search.recent_vectors) and the chunk's embedding job takes it
instead of running the model again; and when the job's model call, a small one, is already embedding the chunk (a
thought searched right after its capture), the search waits for that call's vector instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from services.ports import Embedder
from services.search.fusion import VECTOR_WEIGHT, Candidate, KeywordRow, VectorRow

__all__ = ["UNINDEXED_EMBEDS", "PENDING_TEXT", "embed_unindexed", "hit_key", "reachable"]

log = logging.getLogger("services.search")

#: A keyword statement's chunk ``c`` when its vector is not in the index yet (its text), else NULL: the keyword
#: statements select it, so no statement of its own finds the hits that wait. On Vectorize a vector written but not
#: yet confirmed searchable (``vector_mutation``) counts as not in it.
PENDING_TEXT = "CASE WHEN c.indexed_at IS NULL OR c.vector_mutation IS NOT NULL THEN c.content END"
#: Chunks not indexed yet that one search embeds, at most. Behind an import many keyword hits may be waiting; the
#: best of them are the ones that can reach the first results, and each costs the search one model run.
UNINDEXED_EMBEDS = 2
#: Model runs all searches of the process may spend on chunks not indexed yet: ``RUNS_PER_SECOND`` on average, up to
#: ``RUNS_BURST`` at once. Without it, under a steady mix of captures and searches (bench_soak.py: 8 clients, 20
#: organizations, the worker 1,000-2,000 jobs behind) every search embedded hits and took the CPU the worker needed:
#: 156 -> 100 requests/s, search p95 110 -> 355 ms. Past the budget a hit keeps the vector side's floor, as before.
RUNS_PER_SECOND = 4.0
RUNS_BURST = 8
#: Longest a search waits for the job worker's model call already embedding a chunk it wants (a small call, a few
#: model runs: ``services.jobs.worker.SHARED_CALL_TEXTS``); after it, the search embeds the chunk itself.
FLIGHT_WAIT_SECONDS = 0.25


def hit_key(row: KeywordRow | VectorRow) -> str:
    """What a hit stands for: a thought its document (any of its chunks), any other kind its own chunk."""
    return row[2] if row[1] == "thought" else row[0]


class _RunBudget:
    """A token bucket of model runs (``RUNS_PER_SECOND``, ``RUNS_BURST``), shared by the process's searches."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self, n: int) -> int:
        """How many of ``n`` runs may go now (taken from the bucket)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        granted = min(n, int(self.tokens))
        self.tokens -= granted
        return granted


_BUDGET = _RunBudget(RUNS_PER_SECOND, RUNS_BURST)


def reachable(keyword: Sequence[KeywordRow], ranked: Sequence[Candidate], cut: int | None,
              vector_weight: float = VECTOR_WEIGHT) -> Callable[[float], bool]:
    """Whether a keyword hit of BM25 score ``s`` could be among the first ``cut`` of ``ranked`` (the fusion without
    the unindexed rows) with a perfect vector score: ``(1 - w) * s / best + w`` above the ``cut``-th fused score.
    None: every hit could (a search that hydrates all its candidates)."""
    best = max((r[3] for r in keyword), default=0.0)
    bar = ranked[cut - 1].fused if cut is not None and len(ranked) >= cut else -1.0
    return lambda s: (1 - vector_weight) * (s / best if best > 0 else 0.0) + vector_weight > bar


async def embed_unindexed(embedder: Embedder, recent: Any, org_id: str, query_vector: np.ndarray,
                          chunks: list[dict[str, Any]]) -> list[VectorRow]:
    """The first ``UNINDEXED_EMBEDS`` of ``chunks`` (dicts with id, kind, parent_id, content; best keyword hit
    first) as vector rows, best first: each chunk's vector (from ``recent``, the organization's own entries, else
    embedded now and left there) and its cosine with the query. An embedder failure returns none: those hits keep
    the vector side's floor, and the search answers as before."""
    picked = chunks[:UNINDEXED_EMBEDS]
    if not picked:
        return []
    cached = [recent.get(org_id, r["content"]) if recent is not None else None for r in picked]
    if recent is not None:  # the job worker's model call is embedding some of them now (a small one): wait for it
        flights = {i: f for i, r in enumerate(picked)
                   if cached[i] is None and (f := recent.in_flight(org_id, r["content"])) is not None}
        if flights:
            await asyncio.wait(list(flights.values()), timeout=FLIGHT_WAIT_SECONDS)  # never cancels them
            for i, f in flights.items():
                if f.done() and not f.cancelled():
                    cached[i] = f.result()  # None (the call failed): embedded below
    to_run = [i for i, v in enumerate(cached) if v is None]
    over = set(to_run[_BUDGET.take(len(to_run)):])  # past the process's budget: those keep the vector side's floor
    picked = [r for i, r in enumerate(picked) if i not in over]
    cached = [v for i, v in enumerate(cached) if i not in over]
    missing = [r["content"] for r, v in zip(picked, cached, strict=True) if v is None]
    try:
        fresh = iter(await embedder.embed(missing) if missing else ())
    except Exception:  # noqa: BLE001 - the model is optional here; the index will have these chunks soon
        log.warning("embedding %d chunks not indexed yet failed; their hits keep the vector floor",
                    len(missing), exc_info=True)
        return []
    q = np.asarray(query_vector, dtype=np.float32)
    out: list[VectorRow] = []
    for r, v in zip(picked, cached, strict=True):
        if v is None:
            v = next(fresh)
            if recent is not None:  # for the chunk's embedding job
                recent.put(org_id, r["content"], v)
        out.append((r["id"], r["kind"], r["parent_id"], float(np.dot(v, q))))
    out.sort(key=lambda r: r[3], reverse=True)
    return out
