"""Hybrid search over an organization's chunks: BM25 (FTS5) and vectors, fused by a convex combination.

Candidate generation: each side fetches a fixed depth whatever ``top_k`` asks (``KEYWORD_DEPTH`` chunks by
BM25, ``VECTOR_DEPTH`` by cosine; 100 is Vectorize's topK limit), so the first results of a search do not
depend on how many were asked for. Chunks whose vectors are not in the index yet are still found by the
keyword side, which covers the moments between a capture and its embedding, and the best of them are scored by
their meaning at search time (``_unindexed``, services.search.unindexed). For thoughts the keyword side
scores whole documents (``documents_fts``, migration 0006; the hit shows the thought's best chunk by the vector
side, else its first chunk); conversations keep chunk-level BM25 (``chunks_fts``).

The lists are fused by ``services.search.fusion``, weak candidates dropped by the relevance floor
(``services.search.relevance``), and the winners of each kind turned into hits by that kind's hydrator
(thoughts: ``services.thoughts.hydrator``; conversations: ``services.conversations.search``).

An optional second stage (``_rerank``), only when a reranker is configured, rescores the first
``RERANK_DEPTH`` fused hits; the ranking stage (services.search.ranking) caches it and applies the multipliers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from services.errors import InvalidInput
from services.models import SearchHit, SearchResult
from services.ports import Embedder, Reranker, Statement
from services.search.fusion import (
    KEYWORD_DEPTH, VECTOR_DEPTH, Candidate, KeywordRow, VectorRow, floor_terms, fuse, query_terms,
)
from services.search.ranking import Ranking
from services.search.relevance import relevance_floor
from services.search.selective import Selective
from services.search.unindexed import PENDING_TEXT, embed_unindexed, hit_key, reachable
from services.storage.scoped import OrgSql, OrgVectors

__all__ = ["SearchOptions", "Search", "Hydrator", "KINDS", "MAX_TOP_K", "OVERFETCH", "RERANK_DEPTH"]

log = logging.getLogger("services.search")  # its name before services/ was grouped by domain

KINDS = ("thought", "conversation")
#: Most results one search returns (Vectorize's own topK limit; enough for Recall@100 and client-side reranking).
MAX_TOP_K = 100
#: Fused hits handed to the hydrators (and to the ranking stage's multipliers) per result asked for.
OVERFETCH = 3
#: Hits the second stage (a configured reranker) rescores.
RERANK_DEPTH = 30


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


@runtime_checkable
class Hydrator(Protocol):
    """Turns the winning candidates of one kind into hits (thoughts: ``services.thoughts.hydrator.ThoughtHydrator``;
    conversations: ``services.conversations.search.ConversationHydrator``)."""

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


def _wait_for_vector(pending: dict[str, dict[str, Any]], hit: KeywordRow, text: str) -> None:
    """Note a keyword hit whose chunk is not in the vector index yet (``text``: the chunk's), by what it stands for
    (``hit_key``): ``Search._unindexed`` gives it a vector score."""
    pending[hit_key(hit)] = {"id": hit[0], "kind": hit[1], "parent_id": hit[2], "content": text}


class Search:
    def __init__(
        self, sql: OrgSql, vectors: OrgVectors, embedder: Embedder, hydrators: dict[str, Hydrator],
        ranking: Ranking | None = None, reranker: Reranker | None = None, recent: Any = None,
    ) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.hydrators = hydrators
        #: RecentVectors (services.search.recent_vectors): a chunk ``_unindexed`` embeds is left there for its
        #: embedding job, which takes it instead of running the model again; None: nothing is shared.
        self.recent = recent
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
        window = (opts.time_from, opts.time_to)
        thoughts: Any = self.hydrators.get("thought") if "thought" in kinds else None
        prefetched: list[dict[str, Any]] | None = None

        def key(chunk_id: str, kind: str, parent_id: str) -> tuple[str, str]:
            per_parent = self.hydrators[kind_of[kind]].collapse_per_parent
            return (kind, parent_id if per_parent else chunk_id)

        # fused candidates the hydrators get (tag filters: all of them, filtered on hydration)
        cut = None if opts.tags else max(opts.top_k * OVERFETCH, RERANK_DEPTH if self._rerank is not None else 0)
        if thoughts is not None and hasattr(thoughts, "hydrate_statement") and \
                getattr(self.sql.db, "round_trips_are_requests", False):
            # Every statement is an API request (D1): the vector side first, then one request holding the keyword
            # side's statements (its thought hits read with what their hits need) and the reading of the vector
            # side's thoughts. The hydrator then reads nothing. The same round trips in sequence as the two sides
            # side by side and a hydration request after them, one request fewer (bench/README.md).
            vector, query_vector = await self._vector(query, list(kind_of), opts.parent_id, VECTOR_DEPTH)
            keyword, prefetched, pending = await self._keyword(query, list(kind_of), opts.parent_id, kw_depth, window,
                                                               prefetch=(thoughts, vector, opts.include_content))
        else:
            (keyword, _, pending), (vector, query_vector) = await asyncio.gather(
                self._keyword(query, list(kind_of), opts.parent_id, kw_depth, window),
                self._vector(query, list(kind_of), opts.parent_id, VECTOR_DEPTH),
            )
        unindexed = await self._unindexed(query_vector, keyword, vector, pending, key, kw_depth, cut)
        # A document-level keyword hit shows the thought's best chunk by the vector side (else its first chunk).
        best_chunk: dict[str, str] = {}
        for chunk_id, kind, parent, _ in sorted([*vector, *unindexed], key=lambda r: r[3], reverse=True):
            if kind == "thought":
                best_chunk.setdefault(parent, chunk_id)
        keyword = [(best_chunk.get(r[2], r[0]), *r[1:]) if r[1] == "thought" else r for r in keyword]
        ranked = fuse(keyword, vector, key=key, keyword_depth=kw_depth, vector_depth=VECTOR_DEPTH, unindexed=unindexed)
        if cut is not None:  # hydrate what the ranking stage and the reranker can use, not every candidate
            # (a hydrator that ranks parts of its candidates, conversation turns, asks for a deeper list)
            deep = {k for k in kinds if self.hydrators[k].depth > cut}
            ranked = [c for i, c in enumerate(ranked)
                      if i < cut or (kind_of[c.kind] in deep and i < self.hydrators[kind_of[c.kind]].depth)]
        if opts.min_score is None:
            # the vector side's cut-off bounds the cosine of a candidate it did not return (when it was cut)
            vector_cut = min((r[3] for r in vector), default=None) if len(vector) >= VECTOR_DEPTH else None
            ranked = await relevance_floor(self.sql, self.embedder.relevance_floor,
                                          floor_terms(query, opts.reference_time), ranked, vector_cut)

        hits: list[SearchHit] = []
        for kind in kinds:
            group = [c for c in ranked if kind_of[c.kind] == kind]
            if group:
                if kind == "thought" and prefetched is not None:
                    hits.extend(await thoughts(self.sql, group, opts, rows=prefetched))
                else:
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
        for h, s in zip(head, scores, strict=True):
            h.score = float(s)
        head.sort(key=lambda h: h.score, reverse=True)
        if tail:
            floor = max(min(h.score for h in head), 0.0)
            top = tail[0].score or 1.0
            for h in tail:  # keep the fused order, strictly below every reranked hit
                h.score = floor * 0.5 * (h.score / top)
        return head + tail

    async def _keyword(
        self, query: str, kinds: list[str], parent_id: str | None, width: int,
        window: tuple[int | None, int | None] = (None, None),
        prefetch: tuple[Any, list[VectorRow], bool] | None = None,
    ) -> tuple[list[KeywordRow], list[dict[str, Any]] | None, dict[str, dict[str, Any]]]:
        """BM25, best first: whole documents for thoughts (documents_fts; the row's chunk is the thought's first,
        see ``search``), chunks for the other kinds (chunks_fts). With both, the lists merge on score, cut at
        ``width``. Each side matches the query's selective words only (``Selective``).

        The third value: the hits whose chunk (a thought's first) is not in the vector index yet, read with them
        (a thought hit by its document id, another by its chunk id -> id, kind, parent_id, content: ``_unindexed``).

        ``prefetch``: (the thought hydrator, the vector side's rows, whether whole documents are asked for): the
        statements go in one batch (one D1 request) with the hydration of the vector side's thoughts, and the
        documents statement selects its hits' hydration too (``hydrate_columns``); the second value is then those
        rows (else None)."""
        words = query_terms(query)
        hydrator, vector, include_content = prefetch if prefetch is not None else (None, [], False)
        others = [k for k in kinds if k != "thought"]

        def statement(match: Selective) -> tuple[str, list[Any]]:
            if match.key[1] == "documents_fts":
                return self._keyword_documents(match, parent_id, width,
                                               hydrator.hydrate_columns(include_content) if hydrator is not None else None)
            return self._keyword_chunks(match, others, parent_id, width, window)

        # A large organization's thoughts: its tantivy index when current (embedded; every query word, ~0.4 ms at
        # 53,000 documents against FTS5's 8.5-31: bench/README.md), else FTS5 below.
        pending: dict[str, dict[str, Any]] = {}
        indexed = (await self._keyword_index(words, width, pending)
                   if words and "thought" in kinds and parent_id is None and hydrator is None else None)
        # A large organization's conversation chunks likewise (FTS5 ~13-16 ms at 134,000 chunks), unless the search
        # is within one conversation or a time window (FTS5 filters those in its statement).
        indexed_chunks = (await self._chunk_index(words, others, width, pending)
                          if words and others and parent_id is None and window == (None, None) and hydrator is None
                          else None)
        selective: list[Selective] = []
        if words and "thought" in kinds and indexed is None:
            selective.append(Selective(self.sql.org_id, "documents_fts", words))
        if words and others and indexed_chunks is None:
            selective.append(Selective(self.sql.org_id, "chunks_fts", words))
        for match in selective:
            await match.anchor(self.sql)
        statements = [statement(match) for match in selective]
        vector_rows: list[dict[str, Any]] = []
        if hydrator is None:
            results = [await self.sql.rows(sql, params) for sql, params in statements]
            rows_ahead = None
        else:
            pairs = list({r[2]: [r[2], r[0]] for r in reversed(vector) if r[1] == "thought"}.values())
            batch = [self.sql.stmt(sql, *params) for sql, params in statements]
            batch.append(hydrator.hydrate_statement(self.sql, pairs, include_content))
            done = await self.sql.batch(batch)
            results = [r.rows for r in done[:-1]]
            vector_rows = done[-1].rows
            rows_ahead = vector_rows + (results[0] if "thought" in kinds and words else [])
        for i, match in enumerate(selective):
            if match.anchored_in(results[i]) and len(results[i]) < width:  # too few hold the rarest word: all rank
                match.learn(results[i])
                match.unanchor()
                results[i] = await self.sql.rows(*statement(match))
                if rows_ahead is not None and match.key[1] == "documents_fts":  # hits came hydrated: take the new ones
                    rows_ahead = vector_rows + results[i]
        out: list[KeywordRow] = [*(indexed or ()), *(indexed_chunks or ())]
        for match, rows in zip(selective, results, strict=True):
            match.learn(rows)
            if match.key[1] == "documents_fts":
                # FTS5's bm25() is negated; a thought without chunks (mid-write) has nothing to show yet
                part = [(r["chunk_id"], "thought", r["document_id"], -float(r["bm25"])) for r in rows if r["chunk_id"]]
            else:
                part = [(r["id"], r["kind"], r["parent_id"], -float(r["bm25"])) for r in rows]
            for hit, r in zip(part, (r for r in rows if r.get("chunk_id", True)), strict=True):
                if r["pending"] is not None:
                    _wait_for_vector(pending, hit, r["pending"])
            part.sort(key=lambda r: r[3], reverse=True)  # FTS5's order (stable: ties as FTS5 gave them)
            out += part
        if "thought" in kinds and others:
            out.sort(key=lambda r: r[3], reverse=True)
            out = out[:width]
        return out, rows_ahead, pending

    async def _keyword_index(self, words: list[str], width: int,
                             pending: dict[str, dict[str, Any]]) -> list[KeywordRow] | None:
        """The thoughts' keyword side from the database's keyword index (``keyword_search``: embedded SQLite, an
        organization large enough), each hit on its thought's first chunk; None: no index or not current. A hit
        whose first chunk is not in the vector index yet goes into ``pending`` (as in ``_keyword``)."""
        search = getattr(self.sql.db, "keyword_search", None)

        def first_chunks(hits: list[tuple[str, float]]) -> Statement:  # read right after the hits, in their thread
            return self.sql.stmt(
                f"SELECT f.document_id, c.id AS chunk_id, {PENDING_TEXT} AS pending FROM (SELECT j.value AS "
                "document_id, (SELECT c.pk FROM chunks c WHERE c.organization_id = ?1 AND c.kind = 'thought' AND "
                "c.parent_id = j.value ORDER BY c.ordinal LIMIT 1) AS pk FROM json_each(?2) AS j) AS f "
                "LEFT JOIN chunks c ON c.pk = f.pk", json.dumps([d for d, _ in hits]))

        answer = await search(self.sql.org_id, words, width, then=first_chunks) if search is not None else None
        if answer is None:
            return None
        found, rows = answer
        if not found:
            return found
        first = {r["document_id"]: r["chunk_id"] for r in rows}
        for r in rows:
            if r["chunk_id"] and r["pending"] is not None:
                _wait_for_vector(pending, (r["chunk_id"], "thought", r["document_id"], 0.0), r["pending"])
        # a thought without chunks (mid-write) has nothing to show yet, as on FTS5's side
        return [(first[d], "thought", d, score) for d, score in found if first.get(d)]

    async def _chunk_index(self, words: list[str], kinds: list[str], width: int,
                           pending: dict[str, dict[str, Any]]) -> list[KeywordRow] | None:
        """The conversation chunks' keyword side from the database's chunk index (embedded SQLite, an organization
        large enough): the hits' rows read by pk in the index's thread, best first; None: no index or not current.
        A hit whose row is gone (deleted since the index answered) is left out; one not in the vector index yet
        goes into ``pending`` (as in ``_keyword``)."""
        search = getattr(self.sql.db, "keyword_search", None)

        def rows_of(hits: list[tuple[Any, float]]) -> Statement:
            return self.sql.stmt(
                f"SELECT j.key AS i, c.id, c.kind, c.parent_id, {PENDING_TEXT} AS pending FROM json_each(?2) AS j "
                "CROSS JOIN chunks c ON c.pk = j.value WHERE c.organization_id = ?1 "
                "AND c.kind IN (SELECT value FROM json_each(?3))", json.dumps([pk for pk, _ in hits]), json.dumps(kinds))

        answer = (await search(self.sql.org_id, words, width, then=rows_of, chunk_kinds=kinds)
                  if search is not None else None)
        if answer is None:
            return None
        found, rows = answer
        if not found:
            return []
        by_position = {r["i"]: r for r in rows}
        out: list[KeywordRow] = []
        for i, (_, score) in enumerate(found):
            r = by_position.get(i)
            if r is None:
                continue
            hit: KeywordRow = (r["id"], r["kind"], r["parent_id"], score)
            if r["pending"] is not None:
                _wait_for_vector(pending, hit, r["pending"])
            out.append(hit)
        return out

    @staticmethod
    def _keyword_documents(match: Selective, parent_id: str | None, width: int,
                           hydrate: str | None = None) -> tuple[str, list[Any]]:
        # ORDER BY rank is sorted inside FTS5, so the first-chunk subquery runs for the returned rows only; it finds
        # the chunk's row once, and the outer statement reads what it needs of it (its id, its text while it waits
        # for its vector), in the hits' order (the subquery with its LIMIT runs first, as a co-routine).
        sql = (
            f"SELECT document_id, bm25(documents_fts) AS bm25, {match.column} (SELECT c.pk FROM chunks c "
            "WHERE c.organization_id = ?1 AND c.kind = 'thought' AND c.parent_id = documents_fts.document_id "
            f"ORDER BY c.ordinal LIMIT 1) AS first_pk FROM documents_fts WHERE documents_fts MATCH {match.operand} "
            "AND documents_fts.organization_id = ?1"
        )
        params: list[Any] = [match.param, width]
        if parent_id is not None:
            sql += " AND documents_fts.document_id = ?4"
            params.append(parent_id)
        sql += " ORDER BY rank LIMIT ?3"
        if hydrate is None:  # a thought without chunks (mid-write) is still a row, with no chunk_id
            sql = (f"SELECT k.*, c.id AS chunk_id, {PENDING_TEXT} AS pending FROM ({sql}) AS k "
                   "LEFT JOIN chunks c ON c.organization_id = ?1 AND c.pk = k.first_pk")
        else:  # each hit's document and first chunk, read with it (``_keyword``'s prefetch)
            sql = (f"SELECT k.*, c.id AS chunk_id, {PENDING_TEXT} AS pending, {hydrate} FROM ({sql}) AS k "
                   "CROSS JOIN documents d ON d.organization_id = ?1 AND d.id = k.document_id "
                   "CROSS JOIN chunks c ON c.organization_id = ?1 AND c.pk = k.first_pk")
        return match.prefix + sql, params

    @staticmethod
    def _keyword_chunks(match: Selective, kinds: list[str], parent_id: str | None, width: int,
                        window: tuple[int | None, int | None] = (None, None)) -> tuple[str, list[Any]]:
        sql = (
            f"{match.prefix}SELECT c.id, c.kind, c.parent_id, {match.column} bm25(chunks_fts) AS bm25, "
            f"{PENDING_TEXT} AS pending FROM chunks_fts "
            f"JOIN chunks c ON c.pk = chunks_fts.rowid WHERE chunks_fts MATCH {match.operand} "
            "AND c.organization_id = ?1 AND c.kind IN (SELECT value FROM json_each(?3))"
        )  # the organization check is on the joined chunk row: on chunks_fts it reads every matched row's stored
        # columns (the database is the organization's own; at 134k chunks, 16.0 -> 12.1 ms: bench/README.md)
        params: list[Any] = [match.param, json.dumps(kinds)]
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
        return sql, params

    async def _vector(self, query: str, kinds: list[str], parent_id: str | None,
                      width: int) -> tuple[list[VectorRow], np.ndarray]:
        """The vector side, best first, and the query's vector."""
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
        return out, vec

    @staticmethod
    def _not_on_vector_side(keyword: list[KeywordRow], vector: list[VectorRow]) -> list[KeywordRow]:
        """Keyword hits the vector side did not return (a thought by its document, any other kind by its chunk)."""
        on_vector_side = {hit_key(r) for r in vector}
        return [r for r in keyword if hit_key(r) not in on_vector_side]

    async def _unindexed(self, query_vector: np.ndarray, keyword: list[KeywordRow], vector: list[VectorRow],
                         pending: dict[str, dict[str, Any]], key: Callable[[str, str, str], tuple[str, str]],
                         kw_depth: int, cut: int | None) -> list[VectorRow]:
        """Vector rows for the keyword hits whose chunks are not in the vector index yet (``services.search.unindexed``:
        without them what an agent has just remembered would not come back first): the ``pending`` chunk (read
        with the keyword side: ``_keyword``) of each hit the vector side did not return and that could reach the
        first ``cut`` fused candidates with the best vector score."""
        if not pending:
            return []
        wanted = [r for r in self._not_on_vector_side(keyword, vector) if hit_key(r) in pending]
        if not wanted:
            return []
        could = reachable(keyword, fuse(keyword, vector, key=key, keyword_depth=kw_depth, vector_depth=VECTOR_DEPTH), cut)
        chunks = [pending.pop(h) for r in wanted if (h := hit_key(r)) in pending and could(r[3])]
        return await embed_unindexed(self.embedder, self.recent, self.sql.org_id, query_vector, chunks)
