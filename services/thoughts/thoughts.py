"""Thoughts: captured markdown notes (second-brain-design).

Write path: the content-hash check (the same content answers with the stored thought), the document row, its
chunks, their keyword rows (by trigger) and its jobs go in one atomic batch (on D1 one API request). The capture
is acknowledged then: durable and keyword-searchable at once; the job worker
embeds the chunks and upserts their vectors moments later. A capture may first be decided against what the
organization has (``services.thoughts.decisions``); a merge or a replace then supersedes the other thought
(``services.thoughts.supersede``).
"""

from __future__ import annotations

import hashlib
import json
import logging

import msgspec
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.enrichment.enrichment import enqueue_enrich
from services.errors import InvalidInput, MemexError, NotFound, PayloadTooLarge, answer_status
from services.ids import new_id, now_ms
from services.models import (
    BatchCaptureResult, BatchItem, CaptureResult, ChunkView, Decision, IndexingState, ItemError, Thought, ThoughtDetail,
    ThoughtPage, check_metadata,
)
from services.ports import Embedder, SqlResult, Statement
from services.search.indexing import enqueue_embed
from services.storage.scoped import OrgSql, OrgVectors
from services.text.chunking import chunk_text, default_chunk_params
from services.thoughts import supersede
from services.thoughts.decisions import Decisions, Plan
from services.thoughts.history import DETAIL_HISTORY, ThoughtHistoryService, history_of, links_of

__all__ = ["ThoughtLimits", "Thoughts", "thought_from_row", "PENDING", "decision_of"]

log = logging.getLogger("memex.thoughts")

#: Plan actions (services.thoughts.decisions) as the capture response's decision.action.
_ACTIONS = {"created": "created", "duplicate": "duplicate", "flagged": "flagged", "keep_both": "kept_both",
            "contradiction": "contradiction", "replace": "replaced", "merge": "merged"}


#: Most thoughts one batch capture takes, and how many are written per atomic batch (on D1 one request).
MAX_BATCH = 1000
BATCH_WRITE = 50
#: The decision of a capture acknowledged before it (the worker replaces it).
PENDING = '{"action":"pending"}'


#: A thought's indexing state (``_indexing_state`` reads it); continued with the thought's id (a parameter or a subquery).
_INDEXING = (
    "SELECT COUNT(*) AS total, COUNT(CASE WHEN indexed_at IS NOT NULL AND vector_mutation IS NULL THEN 1 END) AS done "
    "FROM chunks WHERE organization_id = ?1 AND kind = 'thought' AND parent_id = "
)
#: A live thought whose history holds the content ``?4`` (a merge or a replace moved it there).
_SUPERSEDED_BY = (
    "SELECT 1 FROM thought_history h JOIN documents d ON d.organization_id = ?1 AND d.id = h.thought_id "
    "WHERE h.organization_id = ?1 AND h.content_hash = ?4"
)


def _indexing_state(row: Mapping[str, Any]) -> IndexingState:
    total, done = row["total"], row["done"]
    return IndexingState(state="indexed" if done == total else "pending", chunks_total=total, chunks_indexed=done)


def _decision_json(plan: Plan) -> str:
    return msgspec.json.encode(decision_of(plan)).decode()


def _created(doc_id: str, digest: str, chunks: int, now: int) -> CaptureResult:
    return CaptureResult(id=doc_id, created=True, content_hash=digest, chunks=chunks,
                         indexing=IndexingState(state="pending", chunks_total=chunks, chunks_indexed=0),
                         created_at=now, updated_at=now)


def decision_of(plan: Plan) -> Decision:
    """A decision plan as the thought shows it."""
    if plan.action == "created":
        return Decision(action="created")
    return Decision(action=_ACTIONS[plan.action], related_id=plan.related_id, reason=plan.reason,
                    similarity=plan.similarity)


@dataclass(frozen=True, slots=True)
class ThoughtLimits:
    max_content_bytes: int = 256 * 1024
    max_metadata_bytes: int = 16 * 1024
    max_source_chars: int = 500


def thought_from_row(r: dict[str, Any]) -> Thought:
    return Thought(
        id=r["id"],
        content=r["content"],
        content_hash=r["content_hash"],
        source=r["source"],
        metadata=json.loads(r["metadata"] or "{}"),
        summary=r["summary"],
        tags=json.loads(r["tags"]) if r["tags"] else [],
        importance=r.get("importance"),
        enrichment=r.get("enrichment_state"),
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        uses=r.get("use_count") or 0,
        last_used_at=r.get("last_used_at"),
        decision=msgspec.json.decode(r["decision"], type=Decision) if r.get("decision") else None,
    )


class Thoughts:
    def __init__(
        self,
        sql: OrgSql,
        vectors: OrgVectors,
        embedder: Embedder,
        *,
        limits: ThoughtLimits = ThoughtLimits(),
        on_enqueue: Callable[[], None] | None = None,
        decisions: Decisions | None = None,
        on_use: Callable[..., None] | None = None,
    ) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.limits = limits
        self.on_enqueue = on_enqueue or (lambda: None)
        #: Write-time decisions (None: every new content is simply created).
        self.decisions = decisions
        #: Records deliberate uses: ``on_use(ids, fetched=bool)`` (services.search.ranking, bound to the organization).
        self.on_use = on_use or (lambda ids, fetched=False: None)

    # -- capture ---------------------------------------------------------------------------------

    async def capture(
        self, content: str, *, source: str | None = None, metadata: dict[str, Any] | None = None,
        decide: bool = True, wait: bool = False,
    ) -> CaptureResult:
        """Store a thought. Idempotent on the content's SHA-256 first; then, with ``decide`` and a
        ``Decisions``, the write-time decision (services.thoughts.decisions) may block a near-duplicate, flag it, link a
        contradiction, or replace / merge an existing thought (the new one written first, the old one moved to
        the history after). ``decide=False`` is the plain write (a restore from the history)."""
        digest, meta_json = self._check(content, source, metadata)
        now = now_ms()
        deciding = decide and self.decisions is not None

        max_tokens, overlap = default_chunk_params(self.embedder)
        if not deciding or not wait:
            # The content-hash check and the write in one atomic batch (on D1 one request); the worker decides
            # when it embeds the thought (services.thoughts.deferred).
            pieces = chunk_text(content, count_tokens=self.embedder.count_tokens, max_tokens=max_tokens,
                                overlap_tokens=overlap)
            result = await self._touch_or_write(content, digest, source, meta_json, pieces, now, superseded=deciding,
                                                decision=PENDING if deciding else None)
            if deciding and result.created:
                result.decision = Decision(action="pending")
            return result

        existing = await self._touch(digest, now, superseded=deciding)
        if existing is not None:
            return existing
        pieces = chunk_text(content, count_tokens=self.embedder.count_tokens, max_tokens=max_tokens, overlap_tokens=overlap)

        plan = await self.decisions.decide(content, pieces[0], multi_chunk=len(pieces) > 1)
        if plan.action == "duplicate":
            found = await self._result_of(plan.related_id)
            if found is not None:
                found.decision = decision_of(plan)
                return found
            plan = Plan("created", vector=plan.vector)  # deleted meanwhile: nothing to be a duplicate of
        stored = (content, digest, source, meta_json, pieces)
        if plan.action == "merge":
            merged, plan = await supersede.merged(self.sql, self.embedder, plan, source, metadata,
                                                  max_metadata_bytes=self.limits.max_metadata_bytes)
            stored = merged or stored
        doc_id = new_id()
        extra = []
        if plan.action == "contradiction":
            extra.append(self.sql.stmt(
                "INSERT INTO thought_links (organization_id, from_id, to_id, kind, reason, created_at) "
                "SELECT ?1, ?2, ?3, 'contradicts', ?4, ?5 WHERE EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 "
                "AND id = ?2) AND EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?3) "
                "ON CONFLICT DO NOTHING",
                doc_id, plan.related_id, plan.reason, now,
            ))
        recent = self.decisions.recent
        if recent is not None and plan.vector is not None and stored[0] is content:
            recent.put(self.sql.org_id, pieces[0], plan.vector, doc_id)  # the embedding job takes it from here
        result = await self._write(*stored, now, doc_id=doc_id, extra=extra, decision=_decision_json(plan))
        if not result.created:  # the same content was captured concurrently: that one stands
            return result
        if plan.action in ("replace", "merge"):
            incoming = (content, digest, source, meta_json) if plan.action == "merge" else None
            try:
                await supersede.supersede(self.sql, self.vectors, doc_id, plan, now, incoming)
            except Exception:  # the new thought is stored; the old one stays as it was: both kept
                log.warning("could not supersede %s by %s", plan.related_id, doc_id, exc_info=True)
                if incoming is not None:  # the merged text is stored, the incoming one is not: store it too
                    await self._write(content, digest, source, meta_json, pieces, now)
                plan = Plan("keep_both", plan.related_id, f"{plan.action} failed; kept both", plan.similarity)
        result.decision = decision_of(plan)
        if plan.action == "keep_both":  # a failed merge or replace: the decision recorded says so
            await self.sql.execute("UPDATE documents SET decision = ?3 WHERE organization_id = ?1 AND id = ?2",
                                   [doc_id, _decision_json(plan)])
        return result

    def _check(self, content: Any, source: Any, metadata: Any) -> tuple[str, str]:
        """A capture's input checked against the limits: (SHA-256 of the content, metadata JSON)."""
        if not isinstance(content, str) or not content.strip():
            raise InvalidInput("content must be a non-empty string", details={"field": "content"})
        size = len(content.encode("utf-8"))
        if size > self.limits.max_content_bytes:
            raise PayloadTooLarge(
                f"content is {size} bytes; the limit is {self.limits.max_content_bytes}",
                details={"field": "content", "limit": self.limits.max_content_bytes},
            )
        if source is not None and (not isinstance(source, str) or len(source) > self.limits.max_source_chars):
            raise InvalidInput(f"source is longer than {self.limits.max_source_chars} characters", details={"field": "source"})
        return hashlib.sha256(content.encode("utf-8")).hexdigest(), check_metadata(metadata, self.limits.max_metadata_bytes)

    async def capture_many(self, items: Sequence[Mapping[str, Any]]) -> BatchCaptureResult:
        """Capture up to ``MAX_BATCH`` thoughts (each ``{content, source?, metadata?}``) in a few round trips: each
        item answers what a single capture would (201 stored, 200 already there: idempotent per item, 4xx refused
        alone); new ones are written ``BATCH_WRITE`` per atomic batch, their decisions made by the worker."""
        if not 1 <= len(items) <= MAX_BATCH:
            raise InvalidInput(f"items must hold 1-{MAX_BATCH} thoughts", details={"field": "items"})
        now = now_ms()
        out: dict[int, BatchItem] = {}
        ready: dict[int, tuple[str, str, str | None, str]] = {}
        for i, item in enumerate(items):
            try:
                if item.get("wait"):
                    raise InvalidInput("wait is not available in a batch: decisions are made by the worker",
                                       details={"field": "wait"})
                digest, meta_json = self._check(item.get("content"), item.get("source"), item.get("metadata"))
                ready[i] = (item["content"], digest, item.get("source"), meta_json)
            except MemexError as exc:
                out[i] = BatchItem(index=i, status=answer_status(exc), error=ItemError(exc.code, exc.message, exc.details))
        deciding = self.decisions is not None
        known = await self._known_digests({d for _, d, _, _ in ready.values()}, history=deciding)
        first: dict[str, int] = {}
        later: list[int] = []
        writes: list[tuple[int, str, list[str]]] = []
        max_tokens, overlap = default_chunk_params(self.embedder)
        for i, (content, digest, _, _) in ready.items():
            if digest in known or digest in first:
                later.append(i)
                continue
            first[digest] = i
            pieces = chunk_text(content, count_tokens=self.embedder.count_tokens, max_tokens=max_tokens,
                                overlap_tokens=overlap)
            writes.append((i, new_id(), pieces))
        for start in range(0, len(writes), BATCH_WRITE):
            group = writes[start:start + BATCH_WRITE]
            stmts, heads = [], []
            for i, doc_id, pieces in group:
                content, digest, source, meta_json = ready[i]
                heads.append(len(stmts))
                stmts += self._write_stmts(doc_id, content, digest, source, meta_json, pieces, now,
                                           PENDING if deciding else None)
            results = await self.sql.batch(stmts)
            for (i, doc_id, pieces), head in zip(group, heads, strict=True):
                if results[head].changes:
                    out[i] = BatchItem(index=i, status=201, result=_created(doc_id, ready[i][1], len(pieces), now))
                    if deciding:
                        out[i].result.decision = Decision(action="pending")
                else:  # the same content stored concurrently
                    later.append(i)
        for i in later:
            existing = await self._touch(ready[i][1], now, superseded=deciding)
            out[i] = (BatchItem(index=i, status=200, result=existing) if existing is not None else BatchItem(
                index=i, status=404, error=ItemError("not_found", "thought vanished during capture; retry", {})))
        if writes:
            self.on_enqueue()
        results_list = [out[i] for i in range(len(items))]
        return BatchCaptureResult(results=results_list, created=sum(r.status == 201 for r in results_list),
                                  existing=sum(r.status == 200 for r in results_list),
                                  failed=sum(r.status >= 400 for r in results_list))

    async def _known_digests(self, digests: set[str], *, history: bool) -> set[str]:
        """Which of ``digests`` are stored (or, with ``history``, were merged or replaced into a thought)."""
        if not digests:
            return set()
        found = await self.sql.rows("SELECT content_hash FROM documents WHERE organization_id = ?1 "
                                    "AND content_hash IN (SELECT value FROM json_each(?2))", [json.dumps(sorted(digests))])
        out = {r["content_hash"] for r in found}
        if history:
            moved = await self.sql.rows("SELECT content_hash FROM thought_history WHERE organization_id = ?1 "
                                        "AND content_hash IN (SELECT value FROM json_each(?2))", [json.dumps(sorted(digests))])
            out |= {r["content_hash"] for r in moved}
        return out

    def _write_stmts(self, doc_id: str, content: str, digest: str, source: str | None, meta_json: str,
                     pieces: list[str], now: int, decision: str | None, *,
                     unless_superseded: bool = False) -> list[Statement]:
        """The statements that store one thought: its row (nothing when its content is already stored, nor, with
        ``unless_superseded``, when a merge or a replace moved this content to a live thought's history), its chunks
        and its jobs (enrichment first: its tags go in the vectors)."""
        guard = "NOT EXISTS (" + _SUPERSEDED_BY + ")" if unless_superseded else "true"
        stmts = [self.sql.stmt(
            "INSERT INTO documents (organization_id, id, content, content_hash, source, metadata, created_at, "
            "updated_at, decision) SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8 WHERE " + guard
            + " ON CONFLICT(organization_id, content_hash) DO NOTHING",
            doc_id, content, digest, source, meta_json, now, decision)]
        stmts += [self.sql.stmt(
            "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
            "SELECT ?1, ?2, 'thought', ?3, ?4, ?5, ?6 WHERE EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 "
            "AND id = ?3)", new_id(), doc_id, ordinal, piece, self.embedder.count_tokens(piece))
            for ordinal, piece in enumerate(pieces)]
        stmts.append(enqueue_enrich(self.sql, doc_id, now))
        stmts.append(enqueue_embed(self.sql, doc_id, now, only_if_parent_in="documents"))
        return stmts

    async def _write(
        self, content: str, digest: str, source: str | None, meta_json: str, pieces: list[str], now: int,
        *, doc_id: str | None = None, extra: list | None = None, decision: str | None = None,
    ) -> CaptureResult:
        doc_id = doc_id or new_id()
        stmts = self._write_stmts(doc_id, content, digest, source, meta_json, pieces, now, decision)
        stmts.extend(extra or ())
        results = await self.sql.batch(stmts)
        if results[0].changes == 0:  # a concurrent capture of the same content won the race
            existing = await self._touch(digest, now)
            if existing is None:
                raise NotFound("thought vanished during capture; retry")
            return existing
        self.on_enqueue()
        return _created(doc_id, digest, len(pieces), now)

    async def _result_of(self, doc_id: str | None) -> CaptureResult | None:
        row = await self.sql.one(
            "SELECT id, content_hash, created_at, updated_at FROM documents WHERE organization_id = ?1 AND id = ?2", [doc_id]
        )
        if row is None:
            return None
        state = await self._indexing(row["id"])
        return CaptureResult(
            id=row["id"], created=False, content_hash=row["content_hash"], chunks=state.chunks_total, indexing=state,
            created_at=row["created_at"], updated_at=row["updated_at"],
        )

    async def _touch_or_write(
        self, content: str, digest: str, source: str | None, meta_json: str, pieces: list[str], now: int, *,
        superseded: bool, decision: str | None,
    ) -> CaptureResult:
        """``_touch`` and ``_write`` in one atomic batch (on D1 one request): the thought with this content (bumped),
        or, when there is none, the new one written."""
        doc_id = new_id()
        head = self._touch_stmts(digest, now, superseded=superseded)
        results = await self.sql.batch(
            head + self._write_stmts(doc_id, content, digest, source, meta_json, pieces, now, decision,
                                     unless_superseded=superseded))
        existing = await self._touched(digest, results[:len(head)], superseded=superseded)
        if existing is not None:
            return existing
        if results[len(head)].changes:
            self.on_enqueue()
            return _created(doc_id, digest, len(pieces), now)
        # not written and nothing to answer with: the thought whose history holds this content went meanwhile
        return await self._write(content, digest, source, meta_json, pieces, now, decision=decision)

    def _touch_stmts(self, digest: str, now: int, *, superseded: bool) -> list[Statement]:
        """The statements ``_touch`` runs (and ``_touched`` reads): the bump, the touched thought's indexing state and,
        with ``superseded``, the live thought whose history holds this content."""
        stmts = [
            self.sql.stmt("UPDATE documents SET updated_at = ?3 WHERE organization_id = ?1 AND content_hash = ?2 "
                          "RETURNING id, created_at, updated_at", digest, now),
            self.sql.stmt(_INDEXING + "(SELECT id FROM documents WHERE organization_id = ?1 AND content_hash = ?2)",
                          digest),
        ]
        if superseded:
            stmts.append(self.sql.stmt(
                "SELECT h.thought_id, h.action FROM thought_history h JOIN documents d ON d.organization_id = ?1 "
                "AND d.id = h.thought_id WHERE h.organization_id = ?1 AND h.content_hash = ?2 "
                "ORDER BY h.created_at DESC LIMIT 1",
                digest,
            ))
        return stmts

    async def _touch(self, digest: str, now: int, *, superseded: bool = False) -> CaptureResult | None:
        """The thought with this content (updated_at bumped), or None. With ``superseded``, content that a merge
        or a replace moved to the history answers with the canonical thought that superseded it. One round trip."""
        results = await self.sql.batch(self._touch_stmts(digest, now, superseded=superseded))
        return await self._touched(digest, results, superseded=superseded)

    async def _touched(self, digest: str, results: list[SqlResult], *, superseded: bool) -> CaptureResult | None:
        rows = results[0].rows
        history = results[2].rows if superseded else []
        if rows:
            row = rows[0]
            state = _indexing_state(results[1].rows[0])
            return CaptureResult(
                id=row["id"], created=False, content_hash=digest, chunks=state.chunks_total, indexing=state,
                created_at=row["created_at"], updated_at=row["updated_at"],
                decision=Decision(action="duplicate", related_id=row["id"], reason="identical content", similarity=1.0),
            )
        if history:
            canonical = await self._result_of(history[0]["thought_id"])
            if canonical is not None:
                how = "merged into" if history[0]["action"] == "merged" else "replaced by"
                canonical.decision = Decision(action="duplicate", related_id=canonical.id,
                                              reason=f"this content was {how} {canonical.id}", similarity=1.0)
                return canonical
        return None

    async def _indexing(self, doc_id: str) -> IndexingState:
        return _indexing_state(await self.sql.one(_INDEXING + "?2", [doc_id]))

    # -- reads -----------------------------------------------------------------------------------

    async def _row(self, doc_id: str) -> dict[str, Any]:
        row = await self.sql.one("SELECT * FROM documents WHERE organization_id = ?1 AND id = ?2", [doc_id])
        if row is None:
            raise NotFound("thought not found", details={"id": doc_id})
        return row

    async def get(self, doc_id: str) -> ThoughtDetail:
        """One thought with its chunks. Fetching a thought by id is a deliberate use of it (ranking).

        The thought and its chunks come from one statement, so one snapshot: the worker marks a thought's chunks
        indexed in the transaction that records its decision, and a thought read as indexed always shows its
        decision (two reads could see the chunks after that transaction and the row before it)."""
        row = await self.sql.one(
            "SELECT d.*, (SELECT json_group_array(json_array(c.id, c.ordinal, c.content, c.token_count, "
            "c.indexed_at IS NOT NULL AND c.vector_mutation IS NULL)) FROM (SELECT * FROM chunks "
            "WHERE organization_id = ?1 AND kind = 'thought' AND parent_id = ?2 ORDER BY ordinal) c) AS chunk_rows "
            "FROM documents d WHERE d.organization_id = ?1 AND d.id = ?2", [doc_id])
        if row is None:
            raise NotFound("thought not found", details={"id": doc_id})
        self.on_use([doc_id], fetched=True)
        chunks = [ChunkView(id=c_id, ordinal=ordinal, content=content, token_count=tokens, indexed=bool(indexed))
                  for c_id, ordinal, content, tokens, indexed in json.loads(row["chunk_rows"])]
        done = sum(c.indexed for c in chunks)
        base = thought_from_row(row)
        return ThoughtDetail(
            **{f: getattr(base, f) for f in base.__struct_fields__},
            chunks=chunks,
            indexing=IndexingState(
                state="indexed" if done == len(chunks) else "pending", chunks_total=len(chunks), chunks_indexed=done
            ),
            links=await links_of(self.sql, doc_id),
            history=await history_of(self.sql, doc_id, limit=DETAIL_HISTORY),
        )

    async def mark_used(self, doc_ids: list[str]) -> list[str]:
        """Record that these thoughts were used (an agent acted on them). Unknown ids: NotFound, nothing recorded."""
        ids = list(dict.fromkeys(doc_ids))
        if not 1 <= len(ids) <= 100:
            raise InvalidInput("ids must hold 1-100 thought ids", details={"field": "ids"})
        found = {
            r["id"] for r in await self.sql.rows(
                "SELECT id FROM documents WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?2))",
                [json.dumps(ids)],
            )
        }
        missing = [i for i in ids if i not in found]
        if missing:
            raise NotFound("thought not found", details={"ids": missing})
        self.on_use(ids)
        return ids

    @property
    def history(self) -> ThoughtHistoryService:
        """History (merged / replaced originals) of this organization's thoughts: list, restore, purge."""
        return ThoughtHistoryService(self.sql, self)

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
        """Vectors first, then rows: a failure leaves the thought whole (and retryable), never an orphan.
        Then the vectors again: the job worker or the enrichment may have written some between the first
        vector delete and the rows' (services.search.indexing.drop_vanished)."""
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
                # every job queued for it (embed, enrich, ...); the documents trigger does the same for any path
                self.sql.stmt("DELETE FROM jobs WHERE organization_id = ?1 AND target_id = ?2", doc_id),
                self.sql.stmt("DELETE FROM documents WHERE organization_id = ?1 AND id = ?2", doc_id),
            ]
        )
        try:
            await self.vectors.delete_by_ids(chunk_ids)
        except Exception:  # the rows are gone: a stray vector is never shown (every read checks SQL)
            log.warning("could not delete the late vectors of deleted thought %s", doc_id, exc_info=True)
