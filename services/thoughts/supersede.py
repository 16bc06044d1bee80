"""What a merge or a replace does to the thought it supersedes (write-time decisions, services.thoughts.decisions):
``merged`` works out what a merge stores (the model's merged text with both thoughts' source and metadata), and
``supersede``, once the new canonical thought is written, moves the old one to the history (with, for a merge,
the incoming content) and deletes its rows, then its vectors.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from services.errors import PayloadTooLarge
from services.ids import new_id
from services.models import check_metadata
from services.ports import Embedder
from services.search.indexing import EMBED_JOB
from services.storage.scoped import OrgSql, OrgVectors
from services.text.chunking import chunk_text, default_chunk_params
from services.thoughts.decisions import Plan

__all__ = ["Stored", "merged", "supersede"]

log = logging.getLogger("memex.thoughts")

#: What a capture stores: content, its SHA-256, source, metadata JSON and the chunks.
Stored = tuple[str, str, str | None, str, list[str]]


async def merged(sql: OrgSql, embedder: Embedder, plan: Plan, source: str | None, metadata: dict[str, Any] | None,
                 *, max_metadata_bytes: int) -> tuple[Stored | None, Plan]:
    """What a merge stores: the model's merged content, the request's source (else the target's) and the
    target's metadata updated with the request's. None (keep both) when that cannot be stored."""
    merged = plan.merged_content or ""
    m_digest = hashlib.sha256(merged.encode("utf-8")).hexdigest()
    target = await sql.one(
        "SELECT source, metadata, (SELECT id FROM documents WHERE organization_id = ?1 AND content_hash = ?3) AS clash "
        "FROM documents WHERE organization_id = ?1 AND id = ?2",
        [plan.related_id, m_digest],
    )
    if target is None:
        why = "not merged: the other thought was deleted meanwhile; kept both"
    elif target["clash"] is not None:
        why = f"not merged: the merged text is already stored as {target['clash']}; kept both"
    else:
        meta = {**json.loads(target["metadata"] or "{}"), **(metadata or {})}
        try:
            meta_json = check_metadata(meta, max_metadata_bytes)
        except PayloadTooLarge:
            meta_json = check_metadata(metadata, max_metadata_bytes)
        max_tokens, overlap = default_chunk_params(embedder)
        pieces = chunk_text(merged, count_tokens=embedder.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)
        return (merged, m_digest, source if source is not None else target["source"], meta_json, pieces), plan
    log.info("merge refused: %s", why)
    return None, Plan("keep_both", plan.related_id, why, plan.similarity, vector=plan.vector)


async def supersede(sql: OrgSql, vectors: OrgVectors, new_doc: str, plan: Plan, now: int,
                    incoming: tuple[str, str, str | None, str] | None, *, action: str | None = None) -> None:
    """After the new canonical thought is stored: move the old one to the history (with, for a merge, the
    incoming content that was never stored on its own), then delete its rows, then its vectors. ``action``: the
    history's word for it (default: ``merged`` with incoming content, else ``replaced``)."""
    old = plan.related_id
    action = action or ("merged" if incoming is not None else "replaced")
    chunk_ids = [
        r["id"]
        for r in await sql.rows(
            "SELECT id FROM chunks WHERE organization_id = ?1 AND kind = 'thought' AND parent_id = ?2", [old]
        )
    ]
    stmts = [
        # earlier originals of the old thought now belong to the new canonical one
        sql.stmt("UPDATE thought_history SET thought_id = ?2 WHERE organization_id = ?1 AND thought_id = ?3", new_doc, old),
        sql.stmt(
            "INSERT INTO thought_history (organization_id, id, thought_id, original_id, action, reason, content, "
            "content_hash, source, metadata, summary, tags, original_created_at, original_updated_at, created_at) "
            "SELECT ?1, ?2, ?3, id, ?4, ?5, content, content_hash, source, metadata, summary, tags, created_at, "
            "updated_at, ?6 FROM documents WHERE organization_id = ?1 AND id = ?7",
            new_id(), new_doc, action, plan.reason, now, old,
        ),
    ]
    if incoming is not None:
        content, digest, source, meta_json = incoming
        stmts.append(sql.stmt(
            "INSERT INTO thought_history (organization_id, id, thought_id, original_id, action, reason, content, "
            "content_hash, source, metadata, summary, tags, original_created_at, original_updated_at, created_at) "
            "VALUES (?1, ?2, ?3, NULL, 'merged', ?4, ?5, ?6, ?7, ?8, NULL, NULL, ?9, ?9, ?9)",
            new_id(), new_doc, plan.reason, content, digest, source, meta_json, now,
        ))
        # the merged thought carries the old one's contradictions (it still says what the old one said)
        stmts += [
            sql.stmt("UPDATE OR IGNORE thought_links SET from_id = ?2 WHERE organization_id = ?1 AND from_id = ?3", new_doc, old),
            sql.stmt("UPDATE OR IGNORE thought_links SET to_id = ?2 WHERE organization_id = ?1 AND to_id = ?3", new_doc, old),
        ]
    stmts += [
        sql.stmt("DELETE FROM jobs WHERE organization_id = ?1 AND kind = ?2 AND target_id = ?3", EMBED_JOB, old),
        sql.stmt("DELETE FROM documents WHERE organization_id = ?1 AND id = ?2", old),  # chunks, links by trigger
    ]
    await sql.batch(stmts)
    try:
        await vectors.delete_by_ids(chunk_ids)
    except Exception:  # the rows are gone: a stray vector is never shown (every read checks SQL)
        log.warning("could not delete the vectors of superseded thought %s", old, exc_info=True)
