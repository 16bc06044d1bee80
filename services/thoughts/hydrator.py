"""Thoughts as search hits: the ``thought`` hydrator the search runs on the winning thought candidates (their
documents and best chunks read back, deleted ones skipped, ``tags`` / ``from`` / ``to`` applied)."""

from __future__ import annotations

import json
from typing import Any

from services.models import SearchHit
from services.ports import Statement
from services.search.fusion import Candidate, explain_candidate
from services.search.ranking import FEATURE_NAMES, RANKING_FEATURES, feature_columns
from services.search.search import SearchOptions
from services.storage.scoped import OrgSql

__all__ = ["ThoughtHydrator", "hydrate_thoughts"]


def hydrate_columns(include_content: bool = False) -> str:
    """What a hit needs of its document ``d`` (its fields and the ranking stage's, ``FEATURE_NAMES``) and of its
    chunk ``c`` (its text, and its id as ``hydrated_chunk_id``). A search on D1 selects them in its keyword statement
    too (``services.search.search``: one request for the keyword side and the hits). The whole document
    (``content``) only when the search asks for it (``include_content``; else NULL): a thought may be 256 KiB, and
    30 of them cost more than the rest of a search (bench/README.md, bench_long_docs.py)."""
    content = "d.content" if include_content else "NULL AS content"
    return (f"c.id AS hydrated_chunk_id, c.content AS chunk_content, {content}, d.source, d.metadata, d.summary, "
            "d.tags, d.created_at, " + feature_columns("d", chunk="c"))


#: Candidates as a JSON array of [document id, chunk id] pairs -> a row per candidate still there. CROSS JOIN keeps
#: SQLite's planner on the candidate list first (each row a primary-key lookup), not on every document of the
#: organization.
def _hydrate_sql(include_content: bool) -> str:
    return ("SELECT " + hydrate_columns(include_content) + " FROM json_each(?2) AS j "
            "CROSS JOIN documents d ON d.organization_id = ?1 AND d.id = json_extract(j.value, '$[0]') "
            "CROSS JOIN chunks c ON c.organization_id = ?1 AND c.id = json_extract(j.value, '$[1]')")


_HYDRATE = {include: _hydrate_sql(include) for include in (False, True)}
#: Candidates up to which a hydration is read on the event loop (``OrgSql.rows_now``): a default search hydrates 30.
HYDRATE_NOW_MAX = 64


def hydrate_statement(sql: OrgSql, pairs: list[list[str]], include_content: bool = False) -> Statement:
    """The hydration of ``[document id, chunk id]`` pairs as a statement (for a batch)."""
    return sql.stmt(_HYDRATE[include_content], json.dumps(pairs))


class ThoughtHydrator:
    """The ``thought`` hydrator (stateless; ``hydrate_thoughts`` is the one the service uses)."""

    chunk_kinds: tuple[str, ...] = ("thought",)
    #: A thought is one hit, whichever of its chunks matched.
    collapse_per_parent = True
    #: No deeper list than the search's own cut.
    depth = 0

    async def check_parent(self, sql: OrgSql, parent_id: str) -> None:
        """Nothing: a search scoped to another organization's (or no) thought finds nothing of it."""

    #: The columns ``rows`` must hold (``hydrate_columns``) and the statement that reads them for candidate pairs.
    @staticmethod
    def hydrate_columns(include_content: bool = False) -> str:
        return hydrate_columns(include_content)

    @staticmethod
    def hydrate_statement(sql: OrgSql, pairs: list[list[str]], include_content: bool = False) -> Statement:
        return hydrate_statement(sql, pairs, include_content)

    async def __call__(self, sql: OrgSql, group: list[Candidate], opts: SearchOptions,
                       rows: list[dict[str, Any]] | None = None) -> list[SearchHit]:
        """Hits for ``group``; ``rows``: hydration rows the search read ahead (D1), else one statement reads them."""
        return await _hydrate_thoughts(sql, group, opts, rows)


async def _hydrate_thoughts(sql: OrgSql, group: list[Candidate], opts: SearchOptions,
                            rows: list[dict[str, Any]] | None = None) -> list[SearchHit]:
    # One statement (on D1 one request; embedded, a plain read): each candidate's document, with what the ranking
    # stage reads of it, and its chunk. A candidate whose document or chunk is gone has no row. ``rows``: what the
    # search already read (``hydrate_columns``); only candidates it lacks are read here.
    found = {(r["id"], r["hydrated_chunk_id"]): r for r in rows or ()}
    missing = [[c.parent_id, c.chunk_id] for c in group if (c.parent_id, c.chunk_id) not in found]
    if missing:
        # A search's few dozen candidates without their whole documents: primary-key lookups, read on the event loop
        # where the database can (``rows_now``; in a worker thread each row's step waits for the GIL on a busy server)
        params = [json.dumps(missing)]
        now = (sql.rows_now(_HYDRATE[False], params)
               if not opts.include_content and len(missing) <= HYDRATE_NOW_MAX else None)
        for r in now if now is not None else await sql.rows(_HYDRATE[opts.include_content], params):
            found[(r["id"], r["hydrated_chunk_id"])] = r
    wanted = set(opts.tags)
    hits = []
    for c in group:
        doc = found.get((c.parent_id, c.chunk_id))
        if doc is None:
            continue  # deleted between the index lookup and now
        text = doc["chunk_content"]
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
        setattr(hits[-1], RANKING_FEATURES, {k: doc[k] for k in FEATURE_NAMES})
    return hits


#: The ``thought`` hydrator the service registers.
hydrate_thoughts = ThoughtHydrator()
