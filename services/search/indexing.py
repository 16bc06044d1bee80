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

from services.ids import now_ms
from services.jobs.worker import Job
from services.ports import Embedder, Statement, VectorIndex
from services.storage.scoped import OrgSql, OrgVectors

__all__ = ["EMBED_JOB", "CHUNK_ROWS", "KNOWLEDGE_FIELDS", "enqueue_embed", "embed_parent", "embed_rows", "chunk_metadata",
           "drop_vanished", "reconcile_org"]

#: The job kind that embeds a parent's pending chunks.
EMBED_JOB = "embed"
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
    """Embed every pending chunk of one parent (thought or conversation) and index it."""
    while True:
        rows = await sql.rows(  # with the parent thought's tags, for the vector metadata
            CHUNK_ROWS + "WHERE c.organization_id = ?1 AND c.parent_id = ?2 AND c.indexed_at IS NULL "
            "ORDER BY c.ordinal LIMIT ?3",
            [job.target_id, EMBED_BATCH],
        )
        if not rows:
            return
        values = await embed_rows(sql, vectors, embedder, rows)
        if any(r["kind"] == "thought" and not r["tags"] for r in rows) and values is not None:
            await _late_tags(sql, vectors, rows, values)
        if len(rows) < EMBED_BATCH:
            return


async def embed_rows(sql: OrgSql, vectors: OrgVectors, embedder: Embedder, rows: list[dict]):
    """Embed ``rows`` (read with ``CHUNK_ROWS``) in one model call, upsert their vectors in one call and mark them
    indexed in one statement; a chunk deleted meanwhile has its fresh vector dropped again. Returns the vectors, or
    None when some chunks were gone."""
    values = await embedder.embed([r["content"] for r in rows])
    mutation = await vectors.upsert([(r["id"], values[i], chunk_metadata(r)) for i, r in enumerate(rows)])
    # An index that applies writes later (Vectorize) leaves the mutation to be confirmed by the worker.
    pending = mutation if vectors.index.applies_writes_later else None
    ids = [r["id"] for r in rows]
    res = await sql.execute(
        "UPDATE chunks SET indexed_at = ?2, vector_mutation = ?3 "
        "WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?4))",
        [now_ms(), pending, json.dumps(ids)],
    )
    if res.changes < len(ids):  # some chunks were deleted while we embedded: drop their vectors again
        await drop_vanished(sql, vectors, ids)
        return None
    return values


async def _late_tags(sql: OrgSql, vectors: OrgVectors, rows: list[dict], values) -> None:
    """The thought had no tags when we read its chunks: if its enrichment landed meanwhile (and so saw these
    chunks unindexed), write the vectors again with the tags (the values are in hand)."""
    doc = await sql.one("SELECT tags FROM documents WHERE organization_id = ?1 AND id = ?2", [rows[0]["parent_id"]])
    if doc and doc["tags"]:
        await vectors.upsert([(r["id"], values[i], chunk_metadata({**r, "tags": doc["tags"]})) for i, r in enumerate(rows)])
        await drop_vanished(sql, vectors, [r["id"] for r in rows])  # the thought may have been deleted meanwhile


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
