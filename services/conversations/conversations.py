"""Conversations (engram-architecture): verbatim messages in order, compressed at rest, chunked into sliding
windows of 5 messages with stride 3 that the hybrid search covers like every other chunk.

Appending (the claim that makes one batch safe across instances, the windows and turns it re-chunks):
``services.conversations.append``. Messages as stored and their chunks: ``services.conversations.messages``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from services.conversations.append import Appender, ConversationLimits, KeyedLocks
from services.conversations.compression import encode_content
from services.conversations.messages import CHUNK_KINDS, decode_rows
from services.conversations.models import (
    AppendResult, BackfillResult, Conversation, ConversationDetail, ConversationPage, MessageIn, MessagePage,
)
from services.errors import InvalidInput, NotFound
from services.ids import new_id, now_ms
from services.models import IndexingState, check_metadata
from services.ports import Embedder
from services.storage.scoped import OrgSql, OrgVectors

__all__ = ["Conversations"]


def _conversation_from_row(r: dict[str, Any]) -> Conversation:
    return Conversation(
        id=r["id"], title=r["title"], metadata=json.loads(r["metadata"] or "{}"), message_count=r["message_count"],
        created_at=r["created_at"], updated_at=r["updated_at"],
    )


_MESSAGE_COLUMNS = (
    "id, conversation_id, sequence, role, content, content_encoding, metadata, client_id, created_at, session"
)
_CONVERSATION_COLUMNS = "id, title, metadata, message_count, created_at, updated_at"


class Conversations:
    """One organization's conversations (handles bound to it; no method takes an organization id)."""

    def __init__(
        self,
        sql: OrgSql,
        vectors: OrgVectors,
        embedder: Embedder,
        *,
        locks: KeyedLocks,
        limits: ConversationLimits = ConversationLimits(),
        on_enqueue: Callable[[], None] | None = None,
    ) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.locks = locks
        self.limits = limits
        self.on_enqueue = on_enqueue or (lambda: None)
        self._appender = Appender(sql, vectors, embedder, locks=locks, limits=limits, on_enqueue=self.on_enqueue)

    # -- create / read -----------------------------------------------------------------------------

    async def create(self, *, title: str | None = None, metadata: dict[str, Any] | None = None) -> Conversation:
        if title is not None and (not isinstance(title, str) or len(title) > self.limits.max_title_chars):
            raise InvalidInput(f"title must be a string of at most {self.limits.max_title_chars} characters",
                               details={"field": "title"})
        meta_json = check_metadata(metadata, self.limits.max_metadata_bytes)
        cid, now = new_id(), now_ms()
        await self.sql.execute(
            "INSERT INTO conversations (organization_id, id, title, metadata, created_at, updated_at) "
            "VALUES (?1, ?2, ?3, ?4, ?5, ?5)",
            [cid, title, meta_json, now],
        )
        return Conversation(id=cid, title=title, metadata=json.loads(meta_json), message_count=0, created_at=now, updated_at=now)

    async def _row(self, conversation_id: str) -> dict[str, Any]:
        row = await self.sql.one(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE organization_id = ?1 AND id = ?2", [conversation_id]
        )
        if row is None:
            raise NotFound("conversation not found", details={"id": conversation_id})
        return row

    async def exists(self, conversation_id: str) -> None:
        """NotFound unless the conversation is this organization's."""
        await self._row(conversation_id)

    async def get(self, conversation_id: str, *, from_sequence: int = 1, limit: int = 100) -> ConversationDetail:
        row = await self._row(conversation_id)
        page = await self._page(conversation_id, from_sequence, None, limit)
        counts = await self.sql.one(
            "SELECT COUNT(*) AS total, COUNT(CASE WHEN indexed_at IS NOT NULL AND vector_mutation IS NULL THEN 1 END) "
            f"AS done FROM chunks WHERE organization_id = ?1 AND kind IN {CHUNK_KINDS} AND parent_id = ?2",
            [conversation_id],
        )
        total, done = counts["total"], counts["done"]
        base = _conversation_from_row(row)
        return ConversationDetail(
            **{f: getattr(base, f) for f in base.__struct_fields__},
            messages=page.messages,
            next_from=page.next_from,
            indexing=IndexingState(state="indexed" if done == total else "pending", chunks_total=total, chunks_indexed=done),
        )

    async def messages(
        self, conversation_id: str, *, from_sequence: int = 1, to_sequence: int | None = None, limit: int = 100
    ) -> MessagePage:
        await self._row(conversation_id)
        return await self._page(conversation_id, from_sequence, to_sequence, limit)

    async def _page(self, conversation_id: str, start: int, end: int | None, limit: int) -> MessagePage:
        if not 1 <= limit <= self.limits.max_page:
            raise InvalidInput(f"limit must be 1-{self.limits.max_page}", details={"field": "limit"})
        if start < 1:
            raise InvalidInput("from must be at least 1", details={"field": "from"})
        if end is not None and end < start:  # an empty range
            return MessagePage(conversation_id=conversation_id, messages=[], next_from=None)
        upto = "" if end is None else " AND sequence <= ?5"
        rows = await self.sql.rows(
            f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE organization_id = ?1 AND conversation_id = ?2 "
            f"AND sequence >= ?3{upto} ORDER BY sequence LIMIT ?4",
            [conversation_id, start, limit + 1, *([] if end is None else [end])],
        )
        more = len(rows) > limit
        rows = rows[:limit]
        msgs = await decode_rows(rows)
        return MessagePage(conversation_id=conversation_id, messages=msgs,
                           next_from=msgs[-1].sequence + 1 if more and msgs else None)

    async def list_recent(self, *, limit: int = 20, before: str | None = None) -> ConversationPage:
        """Most recently active first (``updated_at`` moves on every append); ``before`` is a cursor."""
        if not 1 <= limit <= 100:
            raise InvalidInput("limit must be 1-100", details={"field": "limit"})
        if before is None:
            rows = await self.sql.rows(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE organization_id = ?1 "
                "ORDER BY updated_at DESC, id DESC LIMIT ?2",
                [limit],
            )
        else:
            at, _, cid = before.partition(":")
            if not at.isdigit() or len(at) > 15 or not cid or len(before) > 100:
                raise InvalidInput("before must be a cursor from next_before", details={"field": "before"})
            rows = await self.sql.rows(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE organization_id = ?1 "
                "AND (updated_at < ?2 OR (updated_at = ?2 AND id < ?3)) ORDER BY updated_at DESC, id DESC LIMIT ?4",
                [int(at), cid, limit],
            )
        convs = [_conversation_from_row(r) for r in rows]
        last = convs[-1] if len(convs) == limit else None
        return ConversationPage(conversations=convs, next_before=f"{last.updated_at}:{last.id}" if last else None)

    # -- delete ------------------------------------------------------------------------------------

    async def delete(self, conversation_id: str) -> None:
        """Vectors first, then rows (messages, chunks, keyword rows, jobs, idempotency records by trigger);
        then the vectors of every chunk deleted, again: the job worker may have upserted some between the
        first vector delete and the rows' (services.search.indexing.drop_vanished). Nothing is left behind."""
        async with self.locks.hold((self.sql.org_id, conversation_id)):
            await self._row(conversation_id)
            ids = await self._chunk_ids(conversation_id)
            await self.vectors.delete_by_ids(ids)
            res = await self.sql.batch([
                self.sql.stmt(
                    f"DELETE FROM chunks WHERE organization_id = ?1 AND kind IN {CHUNK_KINDS} AND parent_id = ?2 RETURNING id",
                    conversation_id,
                ),
                self.sql.stmt("DELETE FROM conversations WHERE organization_id = ?1 AND id = ?2", conversation_id),
            ])
            await self.vectors.delete_by_ids([r["id"] for r in res[0].rows])
            if res[1].changes == 0:
                raise NotFound("conversation not found", details={"id": conversation_id})

    async def _chunk_ids(self, conversation_id: str) -> list[str]:
        rows = await self.sql.rows(
            f"SELECT id FROM chunks WHERE organization_id = ?1 AND kind IN {CHUNK_KINDS} AND parent_id = ?2", [conversation_id]
        )
        return [r["id"] for r in rows]

    # -- append ------------------------------------------------------------------------------------

    async def append(
        self, conversation_id: str, messages: Sequence[MessageIn], *, idempotency_key: str | None = None,
        created_at: int | str | None = None, session: str | None = None,
    ) -> tuple[AppendResult, bool]:
        """Append 1-100 messages (``services.conversations.append``). Returns ``(result, replayed)``: ``replayed`` is
        True when nothing new was written: the Idempotency-Key was seen before (``result`` is the original response,
        with ``replayed`` = ``appended``), or every message's client_id was already stored. ``created_at`` and
        ``session`` are the defaults of the messages that carry none (a session's date and label)."""
        return await self._appender.append(conversation_id, messages, idempotency_key=idempotency_key,
                                           created_at=created_at, session=session)

    # -- compression backfill ----------------------------------------------------------------------

    async def uncompressed_count(self) -> int:
        """Legacy (NULL-encoded) messages of this organization: what the backfill has left to do."""
        row = await self.sql.one("SELECT COUNT(*) AS n FROM messages WHERE organization_id = ?1 AND content_encoding IS NULL")
        return row["n"]

    async def backfill_compress(self, *, batch_size: int = 200, cursor: str | None = None) -> BackfillResult:
        """Compress one batch of this organization's legacy (NULL-encoded) messages, in id order from
        ``cursor``. Safe to run concurrently and to stop at any point; resume with ``next_cursor``."""
        if not 1 <= batch_size <= 1000:
            raise InvalidInput("batch_size must be 1-1000", details={"field": "batch_size"})
        if cursor is not None and (not isinstance(cursor, str) or len(cursor) > 64):
            raise InvalidInput("cursor must be a value from next_cursor", details={"field": "cursor"})
        rows = await self.sql.rows(
            "SELECT id, content FROM messages WHERE organization_id = ?1 AND content_encoding IS NULL AND id > ?2 "
            "ORDER BY id LIMIT ?3",
            [cursor or "", batch_size],
        )
        encoded = [(r["id"], r["content"], *encode_content(r["content"])) for r in rows]
        if encoded:
            await self.sql.batch([
                self.sql.stmt(
                    "UPDATE messages SET content = ?3, content_encoding = ?4 "
                    "WHERE organization_id = ?1 AND id = ?2 AND content_encoding IS NULL",
                    mid, stored, encoding,
                )
                for mid, _, stored, encoding in encoded
            ])
        remaining = await self.uncompressed_count()
        more = len(rows) == batch_size
        return BackfillResult(
            processed=len(rows),
            compressed=sum(1 for e in encoded if e[3] != "raw"),
            raw=sum(1 for e in encoded if e[3] == "raw"),
            bytes_before=sum(len(c.encode("utf-8")) for _, c, _, _ in encoded),
            bytes_after=sum(len(s.encode("utf-8")) for _, _, s, _ in encoded),
            remaining=remaining,
            next_cursor=rows[-1]["id"] if more else None,
            done=not more,
        )


