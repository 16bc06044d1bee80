"""Search one knowledge base: the seed's two stages (§6), on our hybrid search.

1. **Candidates.** BM25 over the knowledge base's chunks (FTS5, the organization's own statistics) and the nearest
   vectors, each side fetching a fixed depth with the filters applied on its side: in SQL on the keyword side
   (content type and the types below it, group, release, status, any of the tags, a date range), in the vector query's
   metadata filter on the vector side (the same fields, Vectorize's indexed metadata; tags, a list, are applied to
   the vector side's candidates in SQL). The lists are fused per entry (services.search.fusion) and weak candidates
   dropped by the relevance floor (services.search.relevance), as for thoughts.
2. **Rerank**, when a reranker is configured (Workers AI bge-reranker-base): the first ``RERANK_DEPTH`` candidates
   are rescored on their title, description and best passage, cached per (organization, knowledge base, query,
   candidate set) for an hour (the seed's KV cache, in process). Without a reranker the fused order stands.
3. **Documents** for the top results, when asked for (``search_with_documents``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.errors import InvalidInput
from services.knowledge.entries import Filters, KnowledgeReader
from services.knowledge.models import KnowledgeHit, KnowledgeSearchResult
from services.ports import Embedder, Reranker
from services.search.fusion import KEYWORD_DEPTH, VECTOR_DEPTH, Candidate, floor_terms, fts_query, fuse, query_terms
from services.search.ranking import RerankCache
from services.search.relevance import relevance_floor
from services.search.unindexed import PENDING_TEXT, embed_unindexed, reachable
from services.storage.scoped import OrgVectors

__all__ = ["KnowledgeSearch", "MAX_LIMIT", "RERANK_DEPTH"]

log = logging.getLogger("memex.knowledge")

#: The seed's limit on search results (§8.2: 1-20).
MAX_LIMIT = 20
#: Candidates the reranker rescores (the seed's topK 20 first stage).
RERANK_DEPTH = 20
#: Characters of passage text handed to the reranker per candidate (the seed: a truncated content snippet).
RERANK_CHARS = 2000
#: Characters of the matching passage returned with each hit (around the first of the query's words it holds).
SNIPPET_CHARS = 1000


@dataclass(slots=True)
class _Ranked:
    """What the rerank cache keeps per candidate (its kind, chunk and score)."""

    kind: str
    chunk_id: str
    score: float
    hit: KnowledgeHit
    passage: str
    uid: str


class KnowledgeSearch:
    def __init__(self, reader: KnowledgeReader, vectors: OrgVectors, embedder: Embedder, *,
                 reranker: Reranker | None = None, rerank_cache: RerankCache | None = None, recent: Any = None) -> None:
        self.reader = reader
        self.sql = reader.sql
        self.vectors = vectors
        self.embedder = embedder
        self.reranker = reranker
        self.rerank_cache = rerank_cache
        self.recent = recent

    async def search(self, query: str, filters: Filters | None = None, *, limit: int = 5,
                     include_documents: bool = False) -> KnowledgeSearchResult:
        query = (query or "").strip()
        if not query:
            raise InvalidInput("q must be a non-empty string", details={"field": "q"})
        if len(query) > 1000:
            raise InvalidInput("q is longer than 1000 characters", details={"field": "q"})
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise InvalidInput(f"limit must be 1-{MAX_LIMIT}", details={"field": "limit"})
        filters = (filters or Filters()).check()
        keyword, waiting = await self._keyword(query, filters)
        vector, query_vector = await self._vector(query, filters)
        depth = max(limit, RERANK_DEPTH if self.reranker is not None else 0)

        def key(_chunk: str, kind: str, parent: str) -> tuple[str, str]:
            return (kind, parent)

        # entries synced moments ago (their chunks not embedded yet) are scored by their meaning too
        # (services.search.unindexed): each one's best keyword chunk, when it could reach the hydrated candidates
        on_vector_side = {r[2] for r in vector}
        firsts = {r[2]: r[0] for r in reversed(keyword)}
        fresh = [r for r in keyword if r[0] in waiting and firsts[r[2]] == r[0] and r[2] not in on_vector_side]
        unindexed = []
        if fresh:
            could = reachable(keyword, fuse(keyword, vector, key=key), depth + 5)
            unindexed = await embed_unindexed(self.embedder, self.recent, self.sql.org_id, query_vector,
                                              [waiting[r[0]] for r in fresh if could(r[3])])
        ranked = fuse(keyword, vector, key=key, unindexed=unindexed)
        # An entry the query's words found shows (and is judged by the relevance floor on) the passage holding them,
        # not a nearer passage by meaning that may hold none of them.
        worded: dict[str, str] = {}
        for chunk_id, _, parent, _ in keyword:
            worded.setdefault(parent, chunk_id)
        for c in ranked:
            c.chunk_id = worded.get(c.parent_id, c.chunk_id)
        vector_cut = min((r[3] for r in vector), default=None) if len(vector) >= VECTOR_DEPTH else None
        ranked = await relevance_floor(self.sql, self.embedder.relevance_floor, floor_terms(query), ranked, vector_cut)
        hits = await self._hydrate(ranked[: depth + 5], query_terms(query))
        if self.reranker is not None and hits:
            hits = await self._rerank(query, hits[:depth])
        top = hits[:limit]
        if include_documents and top:
            rows = await self.reader.rows_by_uid([c.uid for c in top])
            docs = {d.id: d for d in await self.reader.documents(list(rows.values()))}
            for c in top:
                c.hit.document = docs.get(c.hit.id)
        return KnowledgeSearchResult(query=query, results=[c.hit for c in top])

    async def _keyword(self, query: str, filters: Filters) -> tuple[list[tuple[str, str, str, float]],
                                                                    dict[str, dict[str, Any]]]:
        """The keyword side, best first, and its chunks whose vectors are not in the index yet (id -> id, kind,
        parent_id, content: ``services.search.unindexed``), read with it."""
        match = fts_query(query)
        if match is None:
            return [], {}
        where, params = filters.sql("e", 5)
        rows = await self.sql.rows(
            f"SELECT c.id, c.parent_id, bm25(chunks_fts) AS bm25, {PENDING_TEXT} AS waiting FROM chunks_fts "
            "JOIN chunks c ON c.pk = chunks_fts.rowid "
            "JOIN knowledge_entries e ON e.organization_id = c.organization_id AND e.uid = c.parent_id "
            "WHERE chunks_fts MATCH ?2 AND chunks_fts.organization_id = ?1 AND c.organization_id = ?1 "
            f"AND c.kind = 'knowledge' AND e.kb_id = ?3{where} ORDER BY rank LIMIT ?4",
            [match, self.reader.kb_id, KEYWORD_DEPTH, *params])
        waiting = {r["id"]: {"id": r["id"], "kind": "knowledge", "parent_id": r["parent_id"], "content": r["waiting"]}
                   for r in rows if r["waiting"] is not None}
        return [(r["id"], "knowledge", r["parent_id"], -float(r["bm25"])) for r in rows], waiting  # bm25() is negated

    async def _vector(self, query: str, filters: Filters) -> tuple[list[tuple[str, str, str, float]], Any]:
        """The vector side, best first, and the query's vector."""
        vec = await self.embedder.embed_query(query)
        matches = await self.vectors.query(vec, top_k=VECTOR_DEPTH, filter=filters.vector_filter(self.reader.kb_id),
                                           return_metadata=True)
        out = [(m.id, "knowledge", (m.metadata or {})["parent_id"], m.score) for m in matches
               if (m.metadata or {}).get("kind") == "knowledge" and "parent_id" in (m.metadata or {})]
        if filters.tags and out:  # tags are a list: applied here, in SQL, on the vector side's candidates
            where, params = filters.sql("e", 4)
            keep = {r["uid"] for r in await self.sql.rows(
                "SELECT e.uid FROM knowledge_entries e WHERE e.organization_id = ?1 AND e.kb_id = ?2 "
                f"AND e.uid IN (SELECT value FROM json_each(?3)){where}",
                [self.reader.kb_id, _json([p for _, _, p, _ in out]), *params])}
            out = [r for r in out if r[2] in keep]
        return out, vec

    async def _hydrate(self, ranked: Sequence[Candidate], terms: list[str]) -> list[_Ranked]:
        if not ranked:
            return []
        rows = await self.reader.rows_by_uid([c.parent_id for c in ranked])
        chunks = {r["id"]: r["content"] for r in await self.sql.rows(
            "SELECT id, content FROM chunks WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
            [_json([c.chunk_id for c in ranked])])}
        out = []
        for c in ranked:
            r, text = rows.get(c.parent_id), chunks.get(c.chunk_id)
            if r is None or text is None:
                continue  # deleted between the lookups and now
            hit = KnowledgeHit(id=r["id"], content_type=r["content_type"], title=r["title"], path=r["path"],
                               score=round(c.fused, 6), description=r["description"], group=r["group_name"],
                               release=r["release"], tags=_tags(r), snippet=snippet(text, terms))
            passage = "\n".join(p for p in (r["title"], r["description"], text) if p)[:RERANK_CHARS]
            out.append(_Ranked("knowledge", c.chunk_id, c.fused, hit, passage, r["uid"]))
        return out

    async def _rerank(self, query: str, cands: list[_Ranked]) -> list[_Ranked]:
        async def run(q: str, items: list[_Ranked]) -> list[_Ranked]:
            assert self.reranker is not None
            try:
                scores = await self.reranker.rerank(query, [c.passage for c in items])
            except Exception:  # the stage is optional: a search never fails because of it
                log.warning("reranker %s failed; keeping the fused order", self.reranker.model_id, exc_info=True)
                return items
            if len(scores) != len(items):
                return items
            for c, s in zip(items, scores, strict=True):
                c.score = float(s)
            return sorted(items, key=lambda c: c.score, reverse=True)

        key = f"kb:{self.reader.kb_id}\x00{query}"
        out = await (self.rerank_cache.run(self.sql.org_id, key, cands, run) if self.rerank_cache is not None
                     else run(key, cands))
        for c in out:
            c.hit.rerank_score = round(c.score, 6)
        return out


def snippet(text: str, terms: Sequence[str], size: int = SNIPPET_CHARS) -> str:
    """``size`` characters of a passage around the first of the query's words it holds (its start when none), cut at
    spaces, an ellipsis where it was cut."""
    if len(text) <= size:
        return text
    lower = text.lower()
    found = [i for i in (lower.find(t) for t in terms) if i >= 0]
    start = max(0, min(found) - size // 3) if found else 0
    start = min(start, len(text) - size)
    if start > 0:
        start = text.find(" ", start) + 1 or start
    end = min(len(text), start + size)
    if end < len(text):
        end = text.rfind(" ", start, end) if text.rfind(" ", start, end) > start else end
    return ("…" if start > 0 else "") + text[start:end].strip() + ("…" if end < len(text) else "")


def _tags(row: dict[str, Any]) -> list[str]:
    return json.loads(row["tags"] or "[]")


def _json(values: list[str]) -> str:
    return json.dumps(values)
