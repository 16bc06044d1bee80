"""Hybrid search over an organization's chunks: BM25 (FTS5) and vectors, fused by reciprocal rank.

Both lists are fetched wider than asked (top_k x 3) and the best chunk per parent is kept, so one long
thought cannot crowd out the others. Chunks whose vectors are not in the index yet are still found by the
keyword side, which covers the moments between a capture and its embedding.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.errors import InvalidInput
from services.models import SearchHit, SearchResult
from services.ports import Embedder
from services.ranking import Ranking
from services.scoped import OrgSql, OrgVectors

__all__ = ["SearchOptions", "Search", "fts_query", "KINDS", "Candidate", "Hydrator"]

KINDS = ("thought", "conversation")
RRF_K = 60
OVERFETCH = 3
_TOKEN = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset(
    "a an and are as at be but by for from has have how i in is it its of on or that the this to was what when "
    "where which who why will with you your do does did can could should would".split()
)


def fts_query(text: str) -> str | None:
    """An FTS5 MATCH expression: every distinct word, quoted, ORed (stop words dropped when others remain)."""
    words = list(dict.fromkeys(w.lower() for w in _TOKEN.findall(text)))[:64]
    content = [w for w in words if w not in _STOP] or words
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


@dataclass(slots=True)
class Candidate:
    chunk_id: str
    kind: str
    parent_id: str
    fused: float = 0.0
    keyword_rank: int | None = None
    vector_rank: int | None = None
    vector_score: float | None = None


#: Turns the winning candidates of one kind into hits (thoughts here; conversations register their own).
Hydrator = Callable[[OrgSql, list[Candidate], SearchOptions], Awaitable[list[SearchHit]]]


class Search:
    def __init__(
        self, sql: OrgSql, vectors: OrgVectors, embedder: Embedder, hydrators: dict[str, Hydrator],
        ranking: Ranking | None = None,
    ) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.hydrators = hydrators
        #: recency x frequency x importance x penalty after fusion (services.ranking); None: fused order.
        self.ranking = ranking

    async def search(self, opts: SearchOptions) -> SearchResult:
        query = (opts.query or "").strip()
        if not query:
            raise InvalidInput("query must be a non-empty string", details={"field": "query"})
        if len(query) > 4000:
            raise InvalidInput("query is longer than 4000 characters", details={"field": "query"})
        if not 1 <= opts.top_k <= 50:
            raise InvalidInput("top_k must be 1-50", details={"field": "top_k"})
        kinds = list(dict.fromkeys(opts.kinds)) or ["thought"]
        for k in kinds:
            if k not in self.hydrators:
                raise InvalidInput(f"unknown kind {k!r}", details={"field": "kinds", "allowed": sorted(self.hydrators)})
        if opts.parent_id is not None:  # a hydrator may refuse a parent that is not the caller's (404)
            for k in kinds:
                check = getattr(self.hydrators[k], "check_parent", None)
                if check is not None:
                    await check(self.sql, opts.parent_id)
        # Tag filters are applied on hydration, so fetch wider when they narrow the set.
        width = min(100, opts.top_k * OVERFETCH * (4 if opts.tags else 1))

        keyword, vector = await asyncio.gather(
            self._keyword(query, kinds, opts.parent_id, width), self._vector(query, kinds, opts.parent_id, width)
        )
        fused: dict[str, Candidate] = {}
        for rank, (cid, kind, parent) in enumerate(keyword, start=1):
            c = fused.setdefault(cid, Candidate(cid, kind, parent))
            c.keyword_rank = rank
            c.fused += 1.0 / (RRF_K + rank)
        for rank, (cid, kind, parent, score) in enumerate(vector, start=1):
            c = fused.setdefault(cid, Candidate(cid, kind, parent))
            c.vector_rank, c.vector_score = rank, score
            c.fused += 1.0 / (RRF_K + rank)

        best: dict[tuple[str, str], Candidate] = {}
        for c in sorted(fused.values(), key=lambda c: c.fused, reverse=True):
            per_parent = getattr(self.hydrators[c.kind], "collapse_per_parent", True)
            best.setdefault((c.kind, c.parent_id if per_parent else c.chunk_id), c)
        ranked = list(best.values())

        hits: list[SearchHit] = []
        for kind in kinds:
            group = [c for c in ranked if c.kind == kind]
            if group:
                hits.extend(await self.hydrators[kind](self.sql, group, opts))
        if self.ranking is not None:  # the reranker (when there is one, cached) and the multipliers
            hits = await self.ranking.apply(self.sql, query, hits, explain=opts.explain,
                                            rerank=getattr(self, "_rerank", None))
        else:
            hits.sort(key=lambda h: h.score, reverse=True)
        results = hits[: opts.top_k]
        if self.ranking is not None:
            self.ranking.returned(self.sql.org_id, results)  # recall counts, written in the background
        return SearchResult(query=query, results=results)

    async def _keyword(self, query: str, kinds: list[str], parent_id: str | None, width: int) -> list[tuple[str, str, str]]:
        match = fts_query(query)
        if match is None:
            return []
        sql = (
            "SELECT c.id, c.kind, c.parent_id FROM chunks_fts JOIN chunks c ON c.pk = chunks_fts.rowid "
            "WHERE chunks_fts MATCH ?2 AND chunks_fts.organization_id = ?1 AND c.organization_id = ?1 "
            "AND c.kind IN (SELECT value FROM json_each(?3))"
        )
        params: list[Any] = [match, json.dumps(kinds)]
        if parent_id is not None:
            sql += " AND c.parent_id = ?5"
        sql += " ORDER BY bm25(chunks_fts) LIMIT ?4"
        params.append(width)
        if parent_id is not None:
            params.append(parent_id)
        rows = await self.sql.rows(sql, params)
        return [(r["id"], r["kind"], r["parent_id"]) for r in rows]

    async def _vector(self, query: str, kinds: list[str], parent_id: str | None, width: int) -> list[tuple[str, str, str, float]]:
        embed_query = getattr(self.embedder, "embed_query", None)
        vec = await embed_query(query) if embed_query else (await self.embedder.embed([query]))[0]
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


async def hydrate_thoughts(sql: OrgSql, group: list[Candidate], opts: SearchOptions) -> list[SearchHit]:
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
                explain=_explain(c) if opts.explain else None,
            )
        )
    return hits


def _explain(c: Candidate) -> dict[str, Any]:
    return {
        "keyword_rank": c.keyword_rank,
        "vector_rank": c.vector_rank,
        "vector_score": c.vector_score,
        "fusion": "rrf",
        "rrf_k": RRF_K,
        "score": round(c.fused, 6),
    }
