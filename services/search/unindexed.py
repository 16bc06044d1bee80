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
(``RUNS_PER_SECOND``), weighed by length (a short memory costs a fraction of a long note's chunk) and with a share
per organization (one organization's searches cannot spend what another's need). Each is a model run on the
request: behind an import of long notes, 3 of them took a search's p50 from ~40 to ~160 ms, 1 to ~80
(bench/README.md). No run is done twice: a vector the search computes is left in ``RecentVectors``
(services.search.recent_vectors) and the chunk's embedding job takes it instead of running the model again; and when
the job's model call, a small one, is already embedding the chunk (a thought searched right after its capture), the
search waits for that call's vector instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from services.ports import Embedder, model_input_tokens
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
#: ``RUNS_BURST`` at once, counted in runs over a chunk of the model's full length. Without it, under a steady mix of
#: captures and searches (bench_soak.py: 8 clients, 20 organizations, the worker 1,000-2,000 jobs behind) every
#: search embedded hits and took the CPU the worker needed: 156 -> 100 requests/s, search p95 110 -> 355 ms. Past
#: the budget a hit keeps the vector side's floor, as before.
RUNS_PER_SECOND = 4.0
RUNS_BURST = 8
#: A run's fixed cost, in tokens: one MiniLM run on one text took ~1.7 ms + ~0.16 ms a token on these cores (3.3 ms at
#: 10 tokens, 7.9 at 40, 43 at 250), so a run costs ``(tokens + RUN_OVERHEAD_TOKENS) / (max_tokens +
#: RUN_OVERHEAD_TOKENS)`` of a full one: an agent's short memory (40 words, ~50 tokens) about a quarter of an
#: imported note's first chunk.
RUN_OVERHEAD_TOKENS = 10
#: An organization's share of the budget (a bucket of its own, this fraction of the rate and the burst). Past its
#: share it may still spend what the process's bucket holds above a reserve of ``RESERVE`` of the burst (2 runs: what
#: one search embeds at most), kept for the organizations within theirs: one organization's searches alone get the
#: whole rate, and they cannot take what another's next search needs.
ORG_SHARE = 0.5
RESERVE = 0.25
#: Longest a search waits for the job worker's model call already embedding a chunk it wants (a small call, a few
#: model runs: ``services.jobs.worker.SHARED_CALL_TOKENS``); after it, the search embeds the chunk itself.
FLIGHT_WAIT_SECONDS = 0.25


def hit_key(row: KeywordRow | VectorRow) -> str:
    """What a hit stands for: a thought its document (any of its chunks), any other kind its own chunk."""
    return row[2] if row[1] == "thought" else row[0]


class _Bucket:
    __slots__ = ("rate", "burst", "tokens", "at")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now

    def refill(self, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return self.tokens


class _RunBudget:
    """The token buckets of model runs spent by the process's searches (``RUNS_PER_SECOND``, ``RUNS_BURST``): one
    for the process, one per organization (``ORG_SHARE`` of it). Runs are weighed by their texts' length
    (``run_cost``)."""

    def __init__(self, rate: float, burst: float, *, share: float = ORG_SHARE, reserve: float = RESERVE,
                 clock: Callable[[], float] = time.monotonic, max_orgs: int = 4096) -> None:
        self.clock, self.share, self.max_orgs = clock, share, max_orgs
        self.reserve = reserve * burst
        self.process = _Bucket(rate, float(burst), clock())
        self._orgs: dict[str, _Bucket] = {}

    def take(self, org_id: str, costs: Sequence[float]) -> list[bool]:
        """Which of the runs of ``costs`` (in runs, best hit first) may go now; the granted ones are taken."""
        now = self.clock()
        total = self.process.refill(now)
        org = self._orgs.get(org_id)
        if org is None:
            if len(self._orgs) >= self.max_orgs:  # a full bucket is as good as none: forget those, else the oldest
                kept = {k: b for k, b in self._orgs.items() if b.refill(now) < b.burst}
                self._orgs = kept if len(kept) < self.max_orgs // 2 else dict(list(kept.items())[-self.max_orgs // 2:])
            org = self._orgs[org_id] = _Bucket(self.process.rate * self.share, self.process.burst * self.share, now)
        own = org.refill(now)
        out = []
        for cost in costs:
            # within the organization's share, or past it from what the process holds above the reserve
            ok = total >= cost and (own >= cost or total - cost >= self.reserve)
            if ok:
                total -= cost
                own = max(0.0, own - cost)
            out.append(ok)
        self.process.tokens, org.tokens = total, own
        return out


def run_cost(embedder: Embedder, text: str) -> float:
    """A model run on ``text``, in runs on a chunk of the model's full length (``RUN_OVERHEAD_TOKENS``)."""
    full = embedder.max_tokens + RUN_OVERHEAD_TOKENS
    return (model_input_tokens(embedder, text) + RUN_OVERHEAD_TOKENS) / full


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
    granted = _BUDGET.take(org_id, [run_cost(embedder, picked[i]["content"]) for i in to_run]) if to_run else []
    over = {i for i, ok in zip(to_run, granted, strict=True) if not ok}  # past the budget: they keep the floor
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
