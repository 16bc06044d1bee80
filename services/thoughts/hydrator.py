"""Thoughts as search hits: the ``thought`` hydrator the search runs on the winning thought candidates (their
documents and best chunks read back, deleted ones skipped, ``tags`` / ``from`` / ``to`` applied)."""

from __future__ import annotations

import json

from services.models import SearchHit
from services.search.fusion import Candidate, explain_candidate
from services.search.search import SearchOptions
from services.storage.scoped import OrgSql

__all__ = ["ThoughtHydrator", "hydrate_thoughts"]


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
