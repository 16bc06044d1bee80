"""Hybrid search over an organization's chunks: BM25 (FTS5) and vectors, fused by a convex combination.

Candidate generation: each side fetches a fixed depth whatever ``top_k`` asks (``KEYWORD_DEPTH`` chunks by
BM25, ``VECTOR_DEPTH`` by cosine; 100 is Vectorize's topK limit), so the first results of a search do not
depend on how many were asked for. Chunks whose vectors are not in the index yet are still found by the
keyword side, which covers the moments between a capture and its embedding. For thoughts the keyword side
scores whole documents (``documents_fts``, migration 0006; the hit shows the thought's best chunk by the vector
side, else its first chunk); conversations keep chunk-level BM25 (``chunks_fts``).

Fusion (``fuse``): each list is first collapsed to its best chunk per parent (per chunk for kinds whose
hydrator sets ``collapse_per_parent = False``), so a document's keyword and vector evidence meet even when
different chunks carried them; each side's scores are divided by that side's best score (BM25 > 0; cosine
clipped at 0); a candidate one side did not return gets that side's floor (its lowest normalised score when
the list was cut at its depth, else 0: the list was exhaustive); and the fused score is
``(1 - VECTOR_WEIGHT) * keyword + VECTOR_WEIGHT * vector``, in [0, 1]. The figures behind these choices
(BEIR SciFact through the API, bench/bench_scifact.py) are next to the constants and in bench/README.md.

An optional second stage (``_rerank``), only when a reranker is configured, rescores the first
``RERANK_DEPTH`` fused hits; the ranking stage (services.search.ranking) caches it and applies the multipliers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from services.errors import InvalidInput
from services.ids import now_ms
from services.models import SearchHit, SearchResult
from services.ports import Embedder, Reranker
from services.search.ranking import Ranking
from services.storage.scoped import OrgSql, OrgVectors
from services.text.temporal import resolve_relative

__all__ = ["SearchOptions", "Search", "fts_query", "query_terms", "fuse", "KEYWORD_COVERAGE_FLOOR", "KINDS", "Candidate",
           "Hydrator", "ThoughtHydrator", "hydrate_thoughts", "MAX_TOP_K", "explain_candidate"]

log = logging.getLogger("services.search")  # its name before services/ was grouped by domain

KINDS = ("thought", "conversation")
#: Most results one search returns (Vectorize's own topK limit; enough for Recall@100 and client-side reranking).
MAX_TOP_K = 100
#: Chunks each side fetches, whatever top_k (x4 on the keyword side under a tag filter, applied on hydration).
#: SciFact test nDCG@10, convex fusion: 73.43 at 30 per side (what top_k=10 fetched before), 73.56 at 100;
#: search p50 cost of the deeper lists at top_k 10: ~2 ms (21.0 -> 22.8 ms, bench/README.md). Thoughts' keyword
#: side scores whole documents (BM25 over documents_fts) instead of their best chunk: 73.56 -> 74.34 test nDCG@10,
#: R@10 86.06 -> 86.50, R@100 94.93 -> 95.27 through the API (+0.48 +- 0.26 paired over train + test).
KEYWORD_DEPTH = 100
VECTOR_DEPTH = 100  # Vectorize's topK limit
#: Weight of the vector side in the convex fusion (the keyword side gets 1 - it). Tuned on SciFact's train
#: split (809 queries: 0.55 73.63, 0.60 73.64, 0.65 73.71 nDCG@10), checked on its test split (73.66 / 73.56 /
#: 72.81); 0.6 sits in the middle of the plateau. Reciprocal-rank fusion (k=60) of the same lists: 71.04 train,
#: 70.72 test; min-max normalisation 73.13 / 73.20; z-scores 73.38 / 73.09.
VECTOR_WEIGHT = 0.6
#: Fused hits handed to the hydrators (and to the ranking stage's multipliers) per result asked for.
OVERFETCH = 3
#: Hits the second stage (a configured reranker) rescores.
RERANK_DEPTH = 30
#: The relevance floor's keyword side: a hit whose vector evidence is weak (cosine below the embedder's
#: ``relevance_floor``) is kept only when its text holds at least this share of the query's content words.
KEYWORD_COVERAGE_FLOOR = 2 / 3
#: Document frequencies for the floor's IDF weights are counted up to this (a word in more documents is common).
DF_CAP = 1000
_TOKEN = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset(
    "a an and are as at be but by for from has have how i in is it its of on or that the this to was what when "
    "where which who why will with you your do does did can could should would".split()
)


def query_terms(text: str) -> list[str]:
    """The query's distinct words, lowercased, stop words dropped when others remain (at most 64)."""
    words = list(dict.fromkeys(w.lower() for w in _TOKEN.findall(text)))[:64]
    return [w for w in words if w not in _STOP] or words


def floor_terms(text: str, reference_time: int | None = None) -> list[str]:
    """The words the relevance floor looks for: the query's content words without a relative date it names
    ("last week", "in March": that is when, not what; services.text.temporal resolves it)."""
    terms = query_terms(text)
    dated = resolve_relative(text, reference_time if reference_time is not None else now_ms())
    if dated is None:
        return terms
    phrase = set(_TOKEN.findall(dated[2].lower()))
    return [t for t in terms if t not in phrase] or terms


def fts_query(text: str) -> str | None:
    """An FTS5 MATCH expression: every distinct word, quoted, ORed (stop words dropped when others remain)."""
    content = query_terms(text)
    if not content:
        return None
    return " OR ".join(f'"{w}"' for w in content)


@dataclass(frozen=True, slots=True)
class SearchOptions:
    query: str
    top_k: int = 10
    tags: Sequence[str] = ()
    kinds: Sequence[str] = ("thought",)
    parent_id: str | None = None
    include_content: bool = False
    explain: bool = False
    #: None: the relevance floor (``relevance_floor``) drops hits with weak evidence on both sides. A number
    #: (0 included) replaces it: hits whose final score is below it are dropped, nothing else.
    min_score: float | None = None
    #: Epoch ms bounds (inclusive) on when a conversation message was said (or a thought created); None: open.
    time_from: int | None = None
    time_to: int | None = None
    #: What relative dates in the query ("last week") are relative to (epoch ms); None: now.
    reference_time: int | None = None


@dataclass(slots=True)
class Candidate:
    chunk_id: str
    kind: str
    parent_id: str
    fused: float = 0.0
    keyword_rank: int | None = None
    vector_rank: int | None = None
    vector_score: float | None = None
    keyword_score: float | None = None
    #: Each side's normalised score (or its floor, for a side that did not return the candidate).
    keyword_part: float = 0.0
    vector_part: float = 0.0
    #: Share of the query's content words the candidate's text holds (FTS5, stemmed); None: not computed
    #: (its vector evidence was strong enough on its own).
    coverage: float | None = None
    #: What kept the candidate above the relevance floor: ``vector``, ``keyword``; None: no floor applied.
    evidence: str | None = None


KeywordRow = tuple[str, str, str, float]  # chunk id, kind, parent id, BM25 (higher is better)
VectorRow = tuple[str, str, str, float]  # chunk id, kind, parent id, cosine


def fuse(
    keyword: Sequence[KeywordRow],
    vector: Sequence[VectorRow],
    *,
    key: Callable[[str, str, str], tuple[str, str]],
    keyword_depth: int = KEYWORD_DEPTH,
    vector_depth: int = VECTOR_DEPTH,
    vector_weight: float = VECTOR_WEIGHT,
) -> list[Candidate]:
    """Convex combination of max-normalised BM25 and cosine scores, per ``key`` (see the module docstring).

    ``key(chunk_id, kind, parent_id)`` names what one result stands for (the parent, or the chunk itself).
    Each list must be best first. Returns the candidates best first (ties: the vector side's order, then the
    keyword side's). The candidate's chunk is the one of the side contributing more to its score.
    """
    def collapse(rows):
        best: dict[tuple[str, str], tuple[int, tuple]] = {}
        for row in rows:
            k = key(row[0], row[1], row[2])
            if k not in best:
                best[k] = (len(best) + 1, row)
        return best

    kw, vec = collapse(keyword), collapse(vector)
    kw_max = max((r[3] for _, r in kw.values()), default=0.0)
    vec_max = max((max(r[3], 0.0) for _, r in vec.values()), default=0.0)
    kw_norm = {k: (r[3] / kw_max if kw_max > 0 else 0.0) for k, (_, r) in kw.items()}
    vec_norm = {k: (max(r[3], 0.0) / vec_max if vec_max > 0 else 0.0) for k, (_, r) in vec.items()}
    # A side cut at its depth may hold a missed candidate just below its last one; an exhaustive side does not.
    kw_floor = min(kw_norm.values()) if kw_norm and len(keyword) >= keyword_depth else 0.0
    vec_floor = min(vec_norm.values()) if vec_norm and len(vector) >= vector_depth else 0.0
    out: list[Candidate] = []
    for k in list(vec) + [k for k in kw if k not in vec]:
        v_rank, v_row = vec.get(k, (None, None))
        k_rank, k_row = kw.get(k, (None, None))
        kp = kw_norm.get(k, kw_floor)
        vp = vec_norm.get(k, vec_floor)
        vector_side = v_row is not None and (k_row is None or vector_weight * vp >= (1 - vector_weight) * kp)
        row = v_row if vector_side else k_row
        out.append(Candidate(
            chunk_id=row[0], kind=row[1], parent_id=row[2],
            fused=(1 - vector_weight) * kp + vector_weight * vp,
            keyword_rank=k_rank, vector_rank=v_rank,
            vector_score=v_row[3] if v_row is not None else None,
            keyword_score=k_row[3] if k_row is not None else None,
            keyword_part=kp, vector_part=vp,
        ))
    out.sort(key=lambda c: c.fused, reverse=True)  # stable: ties keep the vector side's order
    return out


@runtime_checkable
class Hydrator(Protocol):
    """Turns the winning candidates of one kind into hits (``ThoughtHydrator`` here; conversations register
    ``services.conversations.search.ConversationHydrator``)."""

    #: The chunk kinds it stands for (conversations: windows and single turns).
    chunk_kinds: tuple[str, ...]
    #: True: fusion collapses its candidates to the best chunk per parent; False: every chunk competes.
    collapse_per_parent: bool
    #: Fused candidates it wants whatever ``top_k`` (it ranks parts of them); 0: the search's own cut.
    depth: int

    async def check_parent(self, sql: OrgSql, parent_id: str) -> None:
        """Refuse (raise ``NotFound``) a search scoped to a parent that is not the caller's; else nothing."""
        ...

    async def __call__(self, sql: OrgSql, group: list[Candidate], opts: SearchOptions) -> list[SearchHit]:
        """Hits for ``group`` (the kind's winning candidates, best first); deleted ones are skipped."""
        ...


class Search:
    def __init__(
        self, sql: OrgSql, vectors: OrgVectors, embedder: Embedder, hydrators: dict[str, Hydrator],
        ranking: Ranking | None = None, reranker: Reranker | None = None,
    ) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.hydrators = hydrators
        #: recency x frequency x importance x penalty after fusion (services.search.ranking); None: fused order.
        self.ranking = ranking
        self.reranker = reranker
        #: The optional second stage, None without a reranker (the fused order stands). The ranking stage runs
        #: it through its cache; tests may set their own.
        self._rerank: Callable[[str, list[SearchHit]], Awaitable[list[SearchHit]]] | None = (
            self._rerank_hits if reranker is not None else None
        )

    async def search(self, opts: SearchOptions) -> SearchResult:
        query = (opts.query or "").strip()
        if not query:
            raise InvalidInput("query must be a non-empty string", details={"field": "query"})
        if len(query) > 4000:
            raise InvalidInput("query is longer than 4000 characters", details={"field": "query"})
        if not 1 <= opts.top_k <= MAX_TOP_K:
            raise InvalidInput(f"top_k must be 1-{MAX_TOP_K}", details={"field": "top_k"})
        kinds = list(dict.fromkeys(opts.kinds)) or ["thought"]
        for k in kinds:
            if k not in self.hydrators:
                raise InvalidInput(f"unknown kind {k!r}", details={"field": "kinds", "allowed": sorted(self.hydrators)})
        if opts.parent_id is not None:  # a hydrator may refuse a parent that is not the caller's (404)
            for k in kinds:
                await self.hydrators[k].check_parent(self.sql, opts.parent_id)
        # Tag filters are applied on hydration: the keyword side digs deeper when they narrow the set.
        kw_depth = KEYWORD_DEPTH * (4 if opts.tags else 1)
        # A hydrator may stand for several chunk kinds (conversations: windows and single turns).
        kind_of = {ck: k for k in kinds for ck in self.hydrators[k].chunk_kinds}
        keyword, vector = await asyncio.gather(
            self._keyword(query, list(kind_of), opts.parent_id, kw_depth, (opts.time_from, opts.time_to)),
            self._vector(query, list(kind_of), opts.parent_id, VECTOR_DEPTH),
        )
        # A document-level keyword hit shows the thought's best chunk by the vector side (else its first chunk).
        best_chunk: dict[str, str] = {}
        for chunk_id, kind, parent, _ in vector:
            if kind == "thought":
                best_chunk.setdefault(parent, chunk_id)
        keyword = [(best_chunk.get(r[2], r[0]), *r[1:]) if r[1] == "thought" else r for r in keyword]

        def key(chunk_id: str, kind: str, parent_id: str) -> tuple[str, str]:
            per_parent = self.hydrators[kind_of[kind]].collapse_per_parent
            return (kind, parent_id if per_parent else chunk_id)

        ranked = fuse(keyword, vector, key=key, keyword_depth=kw_depth, vector_depth=VECTOR_DEPTH)
        if not opts.tags:  # hydrate what the ranking stage and the reranker can use, not every candidate
            # (a hydrator that ranks parts of its candidates, conversation turns, asks for a deeper list)
            cut = max(opts.top_k * OVERFETCH, RERANK_DEPTH if self._rerank is not None else 0)
            deep = {k for k in kinds if self.hydrators[k].depth > cut}
            ranked = [c for i, c in enumerate(ranked)
                      if i < cut or (kind_of[c.kind] in deep and i < self.hydrators[kind_of[c.kind]].depth)]
        if opts.min_score is None:
            # the vector side's cut-off bounds the cosine of a candidate it did not return (when it was cut)
            vector_cut = min((r[3] for r in vector), default=None) if len(vector) >= VECTOR_DEPTH else None
            ranked = await self._relevance_floor(floor_terms(query, opts.reference_time), ranked, vector_cut)

        hits: list[SearchHit] = []
        for kind in kinds:
            group = [c for c in ranked if kind_of[c.kind] == kind]
            if group:
                hits.extend(await self.hydrators[kind](self.sql, group, opts))
        if self.ranking is not None:  # the reranker (when there is one, cached) and the multipliers
            hits = await self.ranking.apply(self.sql, query, hits, explain=opts.explain,
                                            rerank=self._rerank)
        else:
            if self._rerank is not None:
                hits = await self._rerank(query, hits)
            hits.sort(key=lambda h: h.score, reverse=True)
        if opts.min_score is not None:
            hits = [h for h in hits if h.score >= opts.min_score]
        return SearchResult(query=query, results=hits[: opts.top_k])

    async def _relevance_floor(self, terms: list[str], ranked: list[Candidate], vector_cut: float | None) -> list[Candidate]:
        """Drop candidates whose evidence is weak on both sides. A cosine at the embedder's ``relevance_floor``
        keeps a candidate on its own, and so does ``KEYWORD_COVERAGE_FLOOR`` of the query's content words (IDF
        weighted) in its text; below both, the two add up in proportion: ``cosine / floor + coverage /
        KEYWORD_COVERAGE_FLOOR >= 1``. A candidate the vector side did not return has a cosine of at most
        ``vector_cut`` (the lowest it returned, when it was cut at its depth), counted as its cosine; without a
        bound (an exhaustive vector list: it is not indexed yet) only its keywords count. Fusion normalises each side by
        its best score, so without a floor the best of nothing looks like a perfect match. An embedder without
        a calibrated floor (``relevance_floor`` None) keeps everything."""
        floor = self.embedder.relevance_floor
        if floor is None:
            return ranked
        for c in ranked:
            cosine = c.vector_score if c.vector_score is not None else vector_cut
            c.evidence = "vector" if cosine is not None and cosine >= floor else None
        weak = [c for c in ranked if c.evidence is None]
        if not weak:
            return ranked
        coverage = await self._coverage(terms, weak)
        for c in weak:
            c.coverage = coverage.get((c.kind, c.parent_id if c.kind == "thought" else c.chunk_id), 0.0)
            cosine = c.vector_score if c.vector_score is not None else (vector_cut or 0.0)
            # each side counts in proportion: a fair cosine needs fewer of the query's words, and none at all
            # needs KEYWORD_COVERAGE_FLOOR of them
            if max(cosine, 0.0) / floor + c.coverage / KEYWORD_COVERAGE_FLOOR >= 1.0:
                c.evidence = "vector+keyword" if cosine > 0 and c.coverage > 0 else "keyword"
        return [c for c in ranked if c.evidence is not None]

    async def _coverage(self, terms: list[str], candidates: list[Candidate]) -> dict[tuple[str, str], float]:
        """IDF-weighted share of ``terms`` each candidate's text holds, by FTS5 itself (same tokenizer and
        stemming as the keyword side): whole documents for thoughts, the chunk for other kinds. A word the
        organization rarely writes weighs more than a common one, and a word it never wrote most: a query's
        unknown words ("Lisbon flights") are missing evidence, its common ones ("how", "set", "up") are noise.
        idf = ln(1 + (N - df + 0.5) / (df + 0.5)), df counted up to DF_CAP. Two statements per table."""
        if not terms:
            return {}
        quoted = json.dumps([f'"{t}"' for t in terms])
        out: dict[tuple[str, str], float] = {}
        docs = [c.parent_id for c in candidates if c.kind == "thought"]
        if docs:
            shares = await self._weighted_coverage(
                quoted, docs, "documents_fts", "SELECT COUNT(*) AS n FROM documents WHERE organization_id = ?1",
                "SELECT j.key AS term, k.document_id AS id FROM json_each(?2) AS j "
                "JOIN documents_fts ON documents_fts MATCH j.value "
                "JOIN documents_fts_keys AS k ON k.pk = documents_fts.rowid "
                "WHERE documents_fts.organization_id = ?1 AND k.organization_id = ?1 "
                "AND k.document_id IN (SELECT value FROM json_each(?3))",
            )
            out.update({("thought", d): share for d, share in shares.items()})
        chunks = {c.chunk_id: c.kind for c in candidates if c.kind != "thought"}
        if chunks:
            shares = await self._weighted_coverage(
                quoted, list(chunks), "chunks_fts", "SELECT COUNT(*) AS n FROM chunks WHERE organization_id = ?1",
                "SELECT j.key AS term, c.id AS id FROM json_each(?2) AS j "
                "JOIN chunks_fts ON chunks_fts MATCH j.value JOIN chunks AS c ON c.pk = chunks_fts.rowid "
                "WHERE chunks_fts.organization_id = ?1 AND c.organization_id = ?1 "
                "AND c.id IN (SELECT value FROM json_each(?3))",
            )
            out.update({(chunks[c], c): share for c, share in shares.items()})
        return out

    async def _weighted_coverage(
        self, quoted: str, ids: list[str], table: str, count_sql: str, match_sql: str,
    ) -> dict[str, float]:
        """For each of ``ids``, the IDF-weighted share of the quoted terms ``match_sql`` finds in its text."""
        idf = await self._idf(quoted, table, count_sql)
        matched: dict[str, set[int]] = {}
        for r in await self.sql.rows(match_sql, [quoted, json.dumps(ids)]):
            matched.setdefault(r["id"], set()).add(r["term"])
        total = sum(idf) or 1.0
        return {i: sum(idf[t] for t in found) / total for i, found in matched.items()}

    async def _idf(self, quoted: str, table: str, count_sql: str) -> list[float]:
        """Each term's inverse document frequency in this organization's ``table`` (documents_fts or chunks_fts)."""
        n = (await self.sql.one(count_sql, []))["n"]
        rows = await self.sql.rows(
            f"SELECT j.key AS term, (SELECT COUNT(*) FROM (SELECT 1 FROM {table} WHERE {table} MATCH j.value "
            f"AND {table}.organization_id = ?1 LIMIT {DF_CAP})) AS df FROM json_each(?2) AS j",
            [quoted],
        )
        df = {r["term"]: r["df"] for r in rows}
        return [math.log(1 + (n - df.get(i, 0) + 0.5) / (df.get(i, 0) + 0.5)) for i in range(len(json.loads(quoted)))]

    async def _rerank_hits(self, query: str, hits: list[SearchHit]) -> list[SearchHit]:
        """The second stage: the configured reranker rescores the first ``RERANK_DEPTH`` hits (best fused first)
        on their chunk text; the rest follow in fused order, scored below the lowest reranked hit. A reranker
        failure keeps the fused order (the stage is optional; a search never fails because of it)."""
        if self.reranker is None or not hits:
            return hits
        hits = sorted(hits, key=lambda h: h.score, reverse=True)
        head, tail = hits[:RERANK_DEPTH], hits[RERANK_DEPTH:]
        try:
            scores = await self.reranker.rerank(query, [h.chunk_content for h in head])
        except Exception:
            log.warning("reranker %s failed; keeping the fused order", self.reranker.model_id, exc_info=True)
            return hits
        if len(scores) != len(head):
            log.warning("reranker returned %d scores for %d passages; keeping the fused order", len(scores), len(head))
            return hits
        for h, s in zip(head, scores):
            h.score = float(s)
        head.sort(key=lambda h: h.score, reverse=True)
        if tail:
            floor = max(min(h.score for h in head), 0.0)
            top = tail[0].score or 1.0
            for h in tail:  # keep the fused order, strictly below every reranked hit
                h.score = floor * 0.5 * (h.score / top)
        return head + tail

    async def _keyword(self, query: str, kinds: list[str], parent_id: str | None, width: int,
                       window: tuple[int | None, int | None] = (None, None)) -> list[KeywordRow]:
        """BM25, best first: whole documents for thoughts (documents_fts; the row's chunk is the thought's first,
        see ``search``), chunks for the other kinds (chunks_fts). With both, the lists merge on score, cut at
        ``width``."""
        match = fts_query(query)
        if match is None:
            return []
        out: list[KeywordRow] = []
        if "thought" in kinds:
            out += await self._keyword_documents(match, parent_id, width)
        others = [k for k in kinds if k != "thought"]
        if others:
            out += await self._keyword_chunks(match, others, parent_id, width, window)
        if "thought" in kinds and others:
            out.sort(key=lambda r: r[3], reverse=True)
            out = out[:width]
        return out

    async def _keyword_documents(self, match: str, parent_id: str | None, width: int) -> list[KeywordRow]:
        # ORDER BY rank is sorted inside FTS5, so the chunk subquery runs for the returned rows only.
        sql = (
            "SELECT document_id, bm25(documents_fts) AS bm25, (SELECT c.id FROM chunks c WHERE c.organization_id = ?1 "
            "AND c.kind = 'thought' AND c.parent_id = documents_fts.document_id ORDER BY c.ordinal LIMIT 1) AS chunk_id "
            "FROM documents_fts WHERE documents_fts MATCH ?2 AND documents_fts.organization_id = ?1"
        )
        params: list[Any] = [match, width]
        if parent_id is not None:
            sql += " AND documents_fts.document_id = ?4"
            params.append(parent_id)
        sql += " ORDER BY rank LIMIT ?3"
        rows = await self.sql.rows(sql, params)
        # FTS5's bm25() is negated; a thought without chunks (mid-write) has nothing to show yet
        return [(r["chunk_id"], "thought", r["document_id"], -float(r["bm25"])) for r in rows if r["chunk_id"]]

    async def _keyword_chunks(self, match: str, kinds: list[str], parent_id: str | None, width: int,
                              window: tuple[int | None, int | None] = (None, None)) -> list[KeywordRow]:
        sql = (
            "SELECT c.id, c.kind, c.parent_id, bm25(chunks_fts) AS bm25 FROM chunks_fts JOIN chunks c ON c.pk = chunks_fts.rowid "
            "WHERE chunks_fts MATCH ?2 AND chunks_fts.organization_id = ?1 AND c.organization_id = ?1 "
            "AND c.kind IN (SELECT value FROM json_each(?3))"
        )
        params: list[Any] = [match, json.dumps(kinds)]
        if window != (None, None):  # from / to: conversation chunks holding a message said within the bounds
            sql += (
                " AND (c.start_sequence IS NULL OR EXISTS (SELECT 1 FROM messages m WHERE m.organization_id = ?1 "
                "AND m.conversation_id = c.parent_id AND m.sequence BETWEEN c.start_sequence AND c.end_sequence "
                f"AND m.created_at BETWEEN {int(window[0] or 0)} AND {int(window[1] or 2**62)}))"
            )
        if parent_id is not None:
            sql += " AND c.parent_id = ?5"
        # ORDER BY rank (FTS5's own bm25 ordering) lets FTS5 sort before the join: same order, ~3x faster at 10k
        sql += " ORDER BY rank LIMIT ?4"
        params.append(width)
        if parent_id is not None:
            params.append(parent_id)
        rows = await self.sql.rows(sql, params)
        return [(r["id"], r["kind"], r["parent_id"], -float(r["bm25"])) for r in rows]  # FTS5's bm25() is negated

    async def _vector(self, query: str, kinds: list[str], parent_id: str | None, width: int) -> list[VectorRow]:
        vec = await self.embedder.embed_query(query)
        flt: dict[str, Any] = {"kind": {"$in": kinds}}
        if parent_id is not None:
            flt["parent_id"] = {"$eq": parent_id}
        matches = await self.vectors.query(vec, top_k=width, filter=flt, return_metadata=True)
        out = []
        for m in matches:
            md = m.metadata or {}
            if md.get("kind") in kinds and "parent_id" in md:
                out.append((m.id, md["kind"], md["parent_id"], m.score))
        return out


class ThoughtHydrator:
    """The ``thought`` hydrator (stateless; ``hydrate_thoughts`` is the one the service uses)."""

    chunk_kinds: tuple[str, ...] = ("thought",)
    #: A thought is one hit, whichever of its chunks matched.
    collapse_per_parent = True
    #: No deeper list than the search's own cut.
    depth = 0

    async def check_parent(self, sql: OrgSql, parent_id: str) -> None:
        """Nothing: a search scoped to another organization's (or no) thought finds nothing of it."""

    async def __call__(self, sql: OrgSql, group: list[Candidate], opts: SearchOptions) -> list[SearchHit]:
        return await _hydrate_thoughts(sql, group, opts)


async def _hydrate_thoughts(sql: OrgSql, group: list[Candidate], opts: SearchOptions) -> list[SearchHit]:
    ids = json.dumps([c.parent_id for c in group])
    docs = {
        r["id"]: r
        for r in await sql.rows(
            "SELECT id, content, source, metadata, summary, tags, created_at FROM documents "
            "WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
            [ids],
        )
    }
    chunks = {
        r["id"]: r["content"]
        for r in await sql.rows(
            "SELECT id, content FROM chunks WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
            [json.dumps([c.chunk_id for c in group])],
        )
    }
    wanted = set(opts.tags)
    hits = []
    for c in group:
        doc = docs.get(c.parent_id)
        text = chunks.get(c.chunk_id)
        if doc is None or text is None:
            continue  # deleted between the index lookup and now
        if (opts.time_from is not None and doc["created_at"] < opts.time_from) or (
            opts.time_to is not None and doc["created_at"] > opts.time_to
        ):
            continue  # from / to: when the thought was captured
        tags = json.loads(doc["tags"]) if doc["tags"] else []
        if wanted and not wanted.intersection(tags):
            continue
        hits.append(
            SearchHit(
                kind="thought",
                document_id=doc["id"],
                chunk_id=c.chunk_id,
                chunk_content=text,
                score=round(c.fused, 6),
                summary=doc["summary"],
                tags=tags,
                source=doc["source"],
                metadata=json.loads(doc["metadata"] or "{}"),
                created_at=doc["created_at"],
                document_content=doc["content"] if opts.include_content else None,
                explain=explain_candidate(c) if opts.explain else None,
            )
        )
    return hits


#: The ``thought`` hydrator the service registers.
hydrate_thoughts = ThoughtHydrator()


def explain_candidate(c: Candidate) -> dict[str, Any]:
    """Why the candidate fused where it did: fused = keyword_weight * keyword_part + vector_weight * vector_part."""
    return {
        "keyword_rank": c.keyword_rank,
        "keyword_score": c.keyword_score,
        "vector_rank": c.vector_rank,
        "vector_score": c.vector_score,
        "fusion": "convex",
        "keyword_part": round(c.keyword_part, 6),
        "vector_part": round(c.vector_part, 6),
        "keyword_weight": round(1 - VECTOR_WEIGHT, 6),
        "vector_weight": VECTOR_WEIGHT,
        "score": round(c.fused, 6),
        "evidence": c.evidence,
        "keyword_coverage": None if c.coverage is None else round(c.coverage, 6),
    }
