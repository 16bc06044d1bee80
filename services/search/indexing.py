"""How chunks reach the vector index, and stay in line with their rows.

The embedding job (``EMBED_JOB``, queued by ``enqueue_embed`` in the batch that writes a thought's or a
conversation's chunks; run by ``embed_parent``) embeds a parent's pending chunks, upserts their vectors with
``chunk_metadata`` (kind and parent_id are indexed for filtering; a thought's tags ride along), then marks them
indexed. A chunk deleted meanwhile has its fresh vector deleted again, so no vector outlives its rows: see
``drop_vanished`` for the rule every vector writer and every deleter follows. ``reconcile_org`` brings an
index that can list a namespace back in line with the SQL store (after a lost or reset local index).
"""

from __future__ import annotations

import json

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.ids import now_ms
from services.jobs.worker import Collected, Job, settle_jobs
from services.ports import Embedder, Statement, VectorIndex
from services.storage.scoped import OrgSql, OrgVectors

__all__ = ["EMBED_JOB", "KB_EMBED_JOB", "EmbedStage", "BeforeUpsert", "Decided", "CHUNK_ROWS", "KNOWLEDGE_FIELDS",
           "enqueue_embed", "embed_parent", "chunk_metadata",
           "drop_vanished", "reconcile_org"]

#: The job kind that embeds a parent's pending chunks, and the one that embeds a knowledge base's.
EMBED_JOB = "embed"
KB_EMBED_JOB = "kb_embed"
#: Chunks embedded per model call (and per upsert).
EMBED_BATCH = 64
#: What every writer of a chunk's vector reads: the chunk, its thought's tags, and a knowledge entry's filterable
#: fields (services.knowledge), so ``chunk_metadata`` gives the same vector metadata whoever embeds the chunk (the
#: embedding jobs, a reconcile, ``memex reindex``). Continue it with ``WHERE``.
CHUNK_ROWS = (
    "SELECT c.pk, c.id, c.kind, c.parent_id, c.ordinal, c.content, c.start_sequence, c.end_sequence, d.tags AS tags, "
    "e.kb_id AS kb, e.content_type AS content_type, e.group_name AS group_name, e.release AS release, "
    "e.status AS status, e.tags AS entry_tags, e.date AS date "
    "FROM chunks c LEFT JOIN documents d ON c.kind = 'thought' AND d.organization_id = c.organization_id "
    "AND d.id = c.parent_id "
    "LEFT JOIN knowledge_entries e ON c.kind = 'knowledge' AND e.organization_id = c.organization_id "
    "AND e.uid = c.parent_id "
)
#: A knowledge chunk's filterable vector metadata (the seed's indexed fields, §4.3, plus its knowledge base) ->
#: the metadata index type each needs on Vectorize. ``tags`` rides along as the seed's comma-separated string but is
#: not filtered on the index (a list is not a scalar an index can hold): services.knowledge.search applies it in SQL.
KNOWLEDGE_FIELDS: dict[str, str] = {"kb": "string", "contentType": "string", "group": "string", "release": "string",
                                    "status": "string", "date": "number"}


def enqueue_embed(sql: OrgSql, parent_id: str, now: int, *, only_if_parent_in: str) -> Statement:
    """The statement that queues an embedding job for ``parent_id`` (only while the parent exists)."""
    return sql.stmt(
        "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) "
        f"SELECT ?1, ?2, ?3, ?4, ?4 WHERE EXISTS (SELECT 1 FROM {only_if_parent_in} "
        "WHERE organization_id = ?1 AND id = ?3)",
        EMBED_JOB,
        parent_id,
        now,
    )


async def embed_parent(sql: OrgSql, vectors: OrgVectors, embedder: Embedder, job: Job) -> None:
    """Embed every pending chunk of one parent (thought or conversation) and index it: the embedding stage on one
    job (a worker without stages, ``memex`` one-shots)."""
    stage = EmbedStage()
    while True:
        collected = await stage.collect(sql, [job], EMBED_BATCH)
        if not collected.state.rows:
            return
        values = await embedder.embed(collected.texts)
        # the worker settles the job itself once this returns
        await stage.finish(sql, vectors, Collected(collected.texts, [], [], collected.state), values)
        if not collected.later:
            return


async def _late_tags(sql: OrgSql, vectors: OrgVectors, rows: list[dict], values) -> None:
    """The thoughts had no tags when we read their chunks: those whose enrichment landed meanwhile (and so saw these
    chunks unindexed) get their vectors written again with the tags (the values are in hand)."""
    parents = sorted({r["parent_id"] for r in rows})
    tags = {d["id"]: d["tags"] for d in await sql.rows(
        "SELECT id, tags FROM documents WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2)) "
        "AND tags IS NOT NULL", [json.dumps(parents)])}
    redo = [(i, r) for i, r in enumerate(rows) if tags.get(r["parent_id"])]
    if redo:
        await vectors.upsert([(r["id"], values[i], chunk_metadata({**r, "tags": tags[r["parent_id"]]})) for i, r in redo])
        await drop_vanished(sql, vectors, [r["id"] for _, r in redo])  # the thought may have been deleted meanwhile


async def drop_vanished(sql: OrgSql, vectors: OrgVectors, ids: list[str]) -> int:
    """After writing vectors of ``ids``: delete the vectors of those whose chunk rows are gone.

    The rule that keeps deleted content out of the index, whatever runs concurrently: a writer upserts
    first and checks the rows after (this); a deleter deletes the rows first and the vectors after. Index
    writes apply in the order they are issued, so either the writer's check sees the rows gone and deletes
    its vectors, or the check ran before the rows were deleted, hence the upsert too, and the deleter's
    vector delete (issued later) removes them. Returns how many vectors were dropped."""
    if not ids:
        return 0
    alive = {
        r["id"]
        for r in await sql.rows(
            "SELECT id FROM chunks WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
            [json.dumps(list(ids))],
        )
    }
    gone = [i for i in ids if i not in alive]
    if gone:
        await vectors.delete_by_ids(gone)
    return len(gone)


def chunk_metadata(row: dict) -> dict:
    """The metadata stored with a chunk's vector (kind and parent_id are indexed for filtering)."""
    md = {"kind": row["kind"], "parent_id": row["parent_id"], "ordinal": row["ordinal"]}
    if row.get("start_sequence") is not None:
        md["start_sequence"] = row["start_sequence"]
        md["end_sequence"] = row["end_sequence"]
    if row.get("tags"):  # the parent thought's tags (JSON text from the documents row), for filtering
        md["tags"] = json.loads(row["tags"]) if isinstance(row["tags"], str) else list(row["tags"])
    if row["kind"] == "knowledge" and row.get("kb"):
        md["kb"] = row["kb"]
        md["contentType"] = row["content_type"]
        for key, col in (("group", "group_name"), ("release", "release"), ("status", "status"), ("date", "date")):
            if row.get(col) is not None:
                md[key] = row[col]
        tags = json.loads(row["entry_tags"]) if row.get("entry_tags") else []
        if tags:
            md["tags"] = ",".join(tags)
    return md


async def reconcile_org(sql: OrgSql, vectors: OrgVectors, index: VectorIndex) -> tuple[int, int]:
    """Make the vector index agree with the SQL store for one organization (for indexes that can list a
    namespace; nothing for the others). Returns (chunks re-queued, stray vectors deleted)."""
    listed = await index.ids_in_namespace(sql.org_id)
    if listed is None:
        return (0, 0)
    in_index = {i.split(":", 1)[1] for i in listed if i.startswith(sql.org_id + ":")}
    rows = await sql.rows("SELECT id, parent_id, indexed_at FROM chunks WHERE organization_id = ?1")
    known = {r["id"] for r in rows}
    missing = [r for r in rows if r["indexed_at"] is not None and r["id"] not in in_index]
    stray = [i for i in in_index if i not in known]
    if stray:
        await vectors.delete_by_ids(stray)
    if missing:
        parents = sorted({r["parent_id"] for r in missing})
        now = now_ms()
        stmts = [
            sql.stmt(
                "UPDATE chunks SET indexed_at = NULL WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
                json.dumps([r["id"] for r in missing]),
            )
        ]
        stmts += [
            sql.stmt(
                "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) VALUES (?1, 'embed', ?2, ?3, ?3)",
                p, now,
            )
            for p in parents
        ]
        await sql.batch(stmts)
    return (len(missing), len(stray))


@dataclass
class Decided:
    """What a ``BeforeUpsert`` hook decided: the ids of chunks not to write (their thought went to the history as a
    duplicate), and statements to run in the batch that marks the chunks indexed (decisions that only record)."""

    skip: set[str] = field(default_factory=set)
    statements: list[Statement] = field(default_factory=list)


#: Called by the stage with one organization's embedded chunks before their vectors are written (the write-time
#: decisions of captures that did not wait for theirs).
BeforeUpsert = Callable[[OrgSql, OrgVectors, list[dict], np.ndarray], Awaitable[Decided]]


@dataclass
class _Share:
    rows: list[dict] = field(default_factory=list)
    #: row index -> a vector already in hand (computed at capture), else the next of the embedded texts
    cached: dict[int, np.ndarray] = field(default_factory=dict)


class EmbedStage:
    """The worker's embedding stage (services.jobs.worker.Stage) for ``embed`` jobs (a thought's or a conversation's
    pending chunks) and ``kb_embed`` jobs (a knowledge base's, shortest first). A round embeds every organization's
    chunks in one model call; each organization's share is then written with one vector upsert and one SQL batch
    that marks its chunks indexed and settles its jobs. A job whose chunks do not all fit the round's room is
    released with what did fit done, and the next round goes on."""

    def __init__(self, recent: Any = None, before_upsert: BeforeUpsert | None = None) -> None:
        #: RecentVectors (services.search.recent_vectors): vectors computed at capture, not computed again.
        self.recent = recent
        self.before_upsert = before_upsert

    async def collect(self, sql: OrgSql, jobs: list[Job], capacity: int) -> Collected:
        share, done, later = _Share(), [], []
        room = capacity
        parents = [j for j in jobs if j.kind == EMBED_JOB]
        by_parent: dict[str, list[dict]] = {}
        if parents and room > 0:
            for r in await sql.rows(
                    CHUNK_ROWS + "WHERE c.organization_id = ?1 AND c.parent_id IN (SELECT value FROM json_each(?2)) "
                    "AND c.indexed_at IS NULL ORDER BY c.parent_id, c.ordinal",
                    [json.dumps([j.target_id for j in parents])]):
                by_parent.setdefault(r["parent_id"], []).append(r)
        for job in jobs:
            if job.kind == EMBED_JOB:
                pending = by_parent.get(job.target_id, [])
                take = pending[:max(0, room)]
                share.rows += take
                room -= len(take)
                (done if len(take) == len(pending) else later).append(job)
            elif room <= 0:
                later.append(job)
            else:  # kb_embed: the knowledge base's pending chunks, shortest first (little padding per model call)
                rows = await sql.rows(
                    CHUNK_ROWS + "WHERE c.organization_id = ?1 AND c.kind = 'knowledge' AND c.indexed_at IS NULL "
                    "AND e.kb_id = ?2 ORDER BY c.token_count, c.pk LIMIT ?3", [job.target_id, room + 1])
                share.rows += rows[:room]
                (done if len(rows) <= room else later).append(job)
                room -= min(len(rows), room)
        texts = []
        for i, r in enumerate(share.rows):
            vector = self.recent.get(sql.org_id, r["content"]) if self.recent is not None else None
            if vector is None:
                texts.append(r["content"])
            else:
                share.cached[i] = vector
        return Collected(texts=texts, done=done, later=later, state=share)

    async def finish(self, sql: OrgSql, vectors: OrgVectors, collected: Collected, values: np.ndarray) -> None:
        share: _Share = collected.state
        rows = share.rows
        matrix = np.empty((len(rows), vectors.dimensions), dtype=np.float32)
        fresh = iter(values)
        for i in range(len(rows)):
            matrix[i] = share.cached[i] if i in share.cached else next(fresh)
        decided = await self.before_upsert(sql, vectors, rows, matrix) if self.before_upsert is not None and rows \
            else Decided()
        keep = [i for i, r in enumerate(rows) if r["id"] not in decided.skip]
        mutation = await vectors.upsert([(rows[i]["id"], matrix[i], chunk_metadata(rows[i])) for i in keep])
        pending = mutation if vectors.index.applies_writes_later else None  # Vectorize: confirmed by the worker
        ids = [rows[i]["id"] for i in keep]
        stmts = decided.statements + settle_jobs(sql, collected)
        if ids:
            stmts.insert(0, sql.stmt(
                "UPDATE chunks SET indexed_at = ?2, vector_mutation = ?3 "
                "WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?4))", now_ms(), pending, json.dumps(ids)))
        results = await sql.batch(stmts) if stmts else []
        if ids and results[0].changes < len(ids):  # some chunks were deleted while we embedded: drop their vectors
            await drop_vanished(sql, vectors, ids)
        elif ids:
            untagged = [i for i in keep if rows[i]["kind"] == "thought" and not rows[i]["tags"]]
            if untagged:
                await _late_tags(sql, vectors, [rows[i] for i in untagged], matrix[untagged])
