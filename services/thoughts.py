"""Thoughts: captured markdown notes (second-brain-design).

Write path: the document row, its chunks, their keyword rows (by trigger) and an embedding job go in one
atomic batch. The capture is acknowledged then: durable and keyword-searchable at once; the job worker
embeds the chunks and upserts their vectors moments later.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.chunking import chunk_text, default_chunk_params
from services.errors import InvalidInput, NotFound, PayloadTooLarge
from services.models import CaptureResult, ChunkView, IndexingState, Thought, ThoughtDetail, ThoughtPage
from services.ports import Embedder
from services.scoped import OrgSql, OrgVectors
from services.ids import new_id, now_ms

__all__ = ["ThoughtLimits", "Thoughts", "EMBED_JOB", "enqueue_embed", "thought_from_row"]

EMBED_JOB = "embed"


@dataclass(frozen=True, slots=True)
class ThoughtLimits:
    max_content_bytes: int = 256 * 1024
    max_metadata_bytes: int = 16 * 1024
    max_source_chars: int = 500


def enqueue_embed(sql: OrgSql, parent_id: str, now: int, *, only_if_parent_in: str):
    """The statement that queues an embedding job for ``parent_id`` (only while the parent exists)."""
    return sql.stmt(
        "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) "
        f"SELECT ?1, ?2, ?3, ?4, ?4 WHERE EXISTS (SELECT 1 FROM {only_if_parent_in} "
        "WHERE organization_id = ?1 AND id = ?3)",
        EMBED_JOB,
        parent_id,
        now,
    )


def thought_from_row(r: dict[str, Any]) -> Thought:
    return Thought(
        id=r["id"],
        content=r["content"],
        content_hash=r["content_hash"],
        source=r["source"],
        metadata=json.loads(r["metadata"] or "{}"),
        summary=r["summary"],
        tags=json.loads(r["tags"]) if r["tags"] else [],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
    )


def check_metadata(metadata: Any, limit: int) -> str:
    if metadata is None:
        return "{}"
    if not isinstance(metadata, dict):
        raise InvalidInput("metadata must be a JSON object", details={"field": "metadata"})
    encoded = json.dumps(metadata, ensure_ascii=False, separators=(",", ":"))
    if len(encoded.encode()) > limit:
        raise PayloadTooLarge(f"metadata is larger than {limit} bytes", details={"field": "metadata", "limit": limit})
    return encoded


class Thoughts:
    def __init__(
        self,
        sql: OrgSql,
        vectors: OrgVectors,
        embedder: Embedder,
        *,
        limits: ThoughtLimits = ThoughtLimits(),
        on_enqueue: Callable[[], None] | None = None,
    ) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.limits = limits
        self.on_enqueue = on_enqueue or (lambda: None)

    # -- capture ---------------------------------------------------------------------------------

    async def capture(
        self, content: str, *, source: str | None = None, metadata: dict[str, Any] | None = None
    ) -> CaptureResult:
        if not isinstance(content, str) or not content.strip():
            raise InvalidInput("content must be a non-empty string", details={"field": "content"})
        size = len(content.encode("utf-8"))
        if size > self.limits.max_content_bytes:
            raise PayloadTooLarge(
                f"content is {size} bytes; the limit is {self.limits.max_content_bytes}",
                details={"field": "content", "limit": self.limits.max_content_bytes},
            )
        if source is not None and len(source) > self.limits.max_source_chars:
            raise InvalidInput(f"source is longer than {self.limits.max_source_chars} characters", details={"field": "source"})
        meta_json = check_metadata(metadata, self.limits.max_metadata_bytes)
        digest = hashlib.sha256(content.encode("utf-8")).hexdigest()
        now = now_ms()

        existing = await self._touch(digest, now)
        if existing is not None:
            return existing

        max_tokens, overlap = default_chunk_params(self.embedder)
        pieces = chunk_text(content, count_tokens=self.embedder.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)
        doc_id = new_id()
        stmts = [
            self.sql.stmt(
                "INSERT INTO documents (organization_id, id, content, content_hash, source, metadata, created_at, updated_at) "
                "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7) ON CONFLICT(organization_id, content_hash) DO NOTHING",
                doc_id, content, digest, source, meta_json, now,
            )
        ]
        for ordinal, piece in enumerate(pieces):
            stmts.append(
                self.sql.stmt(
                    "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
                    "SELECT ?1, ?2, 'thought', ?3, ?4, ?5, ?6 "
                    "WHERE EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?3)",
                    new_id(), doc_id, ordinal, piece, self.embedder.count_tokens(piece),
                )
            )
        stmts.append(enqueue_embed(self.sql, doc_id, now, only_if_parent_in="documents"))
        results = await self.sql.batch(stmts)
        if results[0].changes == 0:  # a concurrent capture of the same content won the race
            existing = await self._touch(digest, now)
            if existing is None:
                raise NotFound("thought vanished during capture; retry")
            return existing
        self.on_enqueue()
        return CaptureResult(
            id=doc_id,
            created=True,
            content_hash=digest,
            chunks=len(pieces),
            indexing=IndexingState(state="pending", chunks_total=len(pieces), chunks_indexed=0),
            created_at=now,
            updated_at=now,
        )

    async def _touch(self, digest: str, now: int) -> CaptureResult | None:
        row = await self.sql.one(
            "UPDATE documents SET updated_at = ?3 WHERE organization_id = ?1 AND content_hash = ?2 "
            "RETURNING id, created_at, updated_at",
            [digest, now],
        )
        if row is None:
            return None
        state = await self._indexing(row["id"])
        return CaptureResult(
            id=row["id"], created=False, content_hash=digest, chunks=state.chunks_total, indexing=state,
            created_at=row["created_at"], updated_at=row["updated_at"],
        )

    async def _indexing(self, doc_id: str) -> IndexingState:
        row = await self.sql.one(
            "SELECT COUNT(*) AS total, COUNT(CASE WHEN indexed_at IS NOT NULL AND vector_mutation IS NULL THEN 1 END) AS done "
            "FROM chunks "
            "WHERE organization_id = ?1 AND kind = 'thought' AND parent_id = ?2",
            [doc_id],
        )
        total, done = row["total"], row["done"]
        return IndexingState(state="indexed" if done == total else "pending", chunks_total=total, chunks_indexed=done)

    # -- reads -----------------------------------------------------------------------------------

    async def _row(self, doc_id: str) -> dict[str, Any]:
        row = await self.sql.one("SELECT * FROM documents WHERE organization_id = ?1 AND id = ?2", [doc_id])
        if row is None:
            raise NotFound("thought not found", details={"id": doc_id})
        return row

    async def get(self, doc_id: str) -> ThoughtDetail:
        row = await self._row(doc_id)
        chunk_rows = await self.sql.rows(
            "SELECT id, ordinal, content, token_count, indexed_at, vector_mutation FROM chunks "
            "WHERE organization_id = ?1 AND kind = 'thought' AND parent_id = ?2 ORDER BY ordinal",
            [doc_id],
        )
        chunks = [
            ChunkView(id=c["id"], ordinal=c["ordinal"], content=c["content"], token_count=c["token_count"],
                      indexed=c["indexed_at"] is not None and c["vector_mutation"] is None)
            for c in chunk_rows
        ]
        done = sum(c.indexed for c in chunks)
        base = thought_from_row(row)
        return ThoughtDetail(
            **{f: getattr(base, f) for f in base.__struct_fields__},
            chunks=chunks,
            indexing=IndexingState(
                state="indexed" if done == len(chunks) else "pending", chunks_total=len(chunks), chunks_indexed=done
            ),
        )

    async def list_recent(self, *, limit: int = 20, before: int | None = None, before_id: str | None = None) -> ThoughtPage:
        if not 1 <= limit <= 100:
            raise InvalidInput("limit must be 1-100", details={"field": "limit"})
        if before is None:
            rows = await self.sql.rows(
                "SELECT * FROM documents WHERE organization_id = ?1 ORDER BY created_at DESC, id DESC LIMIT ?2", [limit]
            )
        elif before_id is None:
            rows = await self.sql.rows(
                "SELECT * FROM documents WHERE organization_id = ?1 AND created_at < ?2 "
                "ORDER BY created_at DESC, id DESC LIMIT ?3",
                [before, limit],
            )
        else:
            rows = await self.sql.rows(
                "SELECT * FROM documents WHERE organization_id = ?1 AND (created_at < ?2 OR (created_at = ?2 AND id < ?3)) "
                "ORDER BY created_at DESC, id DESC LIMIT ?4",
                [before, before_id, limit],
            )
        thoughts = [thought_from_row(r) for r in rows]
        last = thoughts[-1] if len(thoughts) == limit else None
        return ThoughtPage(
            thoughts=thoughts,
            next_before=last.created_at if last else None,
            next_before_id=last.id if last else None,
        )

    # -- delete ----------------------------------------------------------------------------------

    async def delete(self, doc_id: str) -> None:
        """Vectors first, then rows: a failure leaves the thought whole (and retryable), never an orphan."""
        await self._row(doc_id)
        chunk_ids = [
            r["id"]
            for r in await self.sql.rows(
                "SELECT id FROM chunks WHERE organization_id = ?1 AND kind = 'thought' AND parent_id = ?2", [doc_id]
            )
        ]
        await self.vectors.delete_by_ids(chunk_ids)
        await self.sql.batch(
            [
                self.sql.stmt("DELETE FROM jobs WHERE organization_id = ?1 AND kind = ?2 AND target_id = ?3", EMBED_JOB, doc_id),
                self.sql.stmt("DELETE FROM documents WHERE organization_id = ?1 AND id = ?2", doc_id),
            ]
        )
