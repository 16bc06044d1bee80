"""Conversations (engram-architecture): verbatim messages in order, compressed at rest, chunked into sliding
windows of 5 messages with stride 3 that the hybrid search covers like every other chunk.

Append is one atomic batch. D1 has no interactive transactions, so the batch opens with a claim::

    UPDATE conversations SET last_sequence = last_sequence + n, append_token = <fresh token>, ...
     WHERE organization_id = ?1 AND id = ?2 AND last_sequence = <the value we read>
       AND none of the request's client ids is stored AND its Idempotency-Key is not recorded

and every other statement of the batch (the messages, the re-chunked windows, the idempotency record, the
embedding job) runs only ``WHERE EXISTS (... append_token = <that token>)``. A claim that lost a race changes
nothing at all; the append reads again and retries. Sequences are therefore contiguous from 1 and never
collide, across any number of service instances. Within one instance appends to a conversation also queue
on an asyncio lock, so the optimistic retry is only ever needed between instances.

Re-chunking touches the tail only: windows start at sequences 1, 4, 7, ... and window ``s`` covers
``s .. min(s + 4, last)`` (the seed's ``chunkMessages``). A window that already held 5 messages never changes;
the (at most two) short windows at the tail are replaced by their grown versions, with fresh chunk ids, and
new windows are added, in the append batch. The vectors of the replaced windows are deleted right after the
batch commits (their rows are gone, so search already ignores them; if that delete fails the startup
reconcile removes them). The embedding job then embeds every pending window of the conversation.
A window whose text exceeds the embedder's ``max_tokens`` is embedded truncated by the model (its keyword
row holds the whole text).

Every message is also one chunk of kind ``turn`` (migration 0008: ``[role]: content``, ordinal and sequence range
= its sequence), inserted in the same append batch by one statement and embedded by the same job, so search can
score single messages by keywords and by meaning, not only windows (``services.conversations.search``). Turns
never change, so re-chunking leaves them alone. A message keeps its own time: ``created_at`` (or ``ts``) given on
append (epoch ms or ISO-8601, ``services.text.temporal.parse_time``), else the append's default, else now; and an
optional ``session`` label.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import msgspec

from services.conversations.compression import decode_content, encode_content
from services.conversations.models import (
    AppendedMessage, AppendResult, BackfillResult, Conversation, ConversationDetail, ConversationPage, Message,
    MessageIn, MessagePage, ROLES,
)
from services.errors import BackendError, Conflict, InvalidInput, NotFound, PayloadTooLarge
from services.ids import new_id, now_ms
from services.models import IndexingState, check_metadata
from services.ports import Embedder, Statement
from services.storage.scoped import OrgSql, OrgVectors
from services.text.temporal import parse_time
from services.search.indexing import EMBED_JOB

__all__ = [
    "WINDOW", "STRIDE", "ConversationLimits", "KeyedLocks", "Conversations", "window_starts", "chunk_windows",
    "format_line", "message_from_row",
]

log = logging.getLogger("memex.conversations")

WINDOW = 5
STRIDE = 3
MAX_CLAIM_ATTEMPTS = 12
_OFF_LOOP_BYTES = 256 * 1024  # compress a request this large in a worker thread


@dataclass(frozen=True, slots=True)
class ConversationLimits:
    max_messages_per_append: int = 100
    max_message_bytes: int = 64 * 1024
    max_metadata_bytes: int = 16 * 1024
    max_title_chars: int = 500
    max_page: int = 1000
    #: How long an Idempotency-Key's response is kept for replay.
    idempotency_ttl_ms: int = 24 * 3600 * 1000


class KeyedLocks:
    """One asyncio.Lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[Any, list] = {}

    @asynccontextmanager
    async def hold(self, key: Any) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                self._locks.pop(key, None)

    def __len__(self) -> int:
        return len(self._locks)


# -- windows ----------------------------------------------------------------------------------------


def format_line(role: str, content: str) -> str:
    return f"[{role}]: {content}"


def window_starts(old_last: int, new_last: int) -> list[int]:
    """Start sequences of the windows that an append taking the last sequence from ``old_last`` to
    ``new_last`` creates or changes: every window that was short (``s + 4 > old_last``) and exists now."""
    lo = max(1, old_last - WINDOW + 2)
    k = -(-(lo - 1) // STRIDE)
    return list(range(1 + STRIDE * k, new_last + 1, STRIDE))


def chunk_windows(lines: Sequence[tuple[int, str, str]]) -> list[tuple[int, int, str]]:
    """The seed's chunkMessages over ``(sequence, role, content)``: ``(start, end, text)`` per window."""
    ordered = sorted(lines)
    out = []
    for i in range(0, len(ordered), STRIDE):
        window = ordered[i : i + WINDOW]
        out.append((window[0][0], window[-1][0], "\n".join(format_line(r, c) for _, r, c in window)))
    return out


def message_from_row(r: dict[str, Any]) -> Message:
    return Message(
        id=r["id"],
        conversation_id=r["conversation_id"],
        sequence=r["sequence"],
        role=r["role"],
        content=decode_content(r["content"], r["content_encoding"]),
        metadata=json.loads(r["metadata"] or "{}"),
        client_id=r["client_id"],
        created_at=r["created_at"],
        session=r.get("session"),
    )


def _conversation_from_row(r: dict[str, Any]) -> Conversation:
    return Conversation(
        id=r["id"], title=r["title"], metadata=json.loads(r["metadata"] or "{}"), message_count=r["message_count"],
        created_at=r["created_at"], updated_at=r["updated_at"],
    )


_MESSAGE_COLUMNS = (
    "id, conversation_id, sequence, role, content, content_encoding, metadata, client_id, created_at, session"
)
#: Chunk kinds of a conversation: its windows and its single turns (migration 0008).
CHUNK_KINDS = "('conversation', 'turn')"
_CONVERSATION_COLUMNS = "id, title, metadata, message_count, created_at, updated_at"
_GATE = "EXISTS (SELECT 1 FROM conversations WHERE organization_id = ?1 AND id = ?2 AND append_token = ?3)"


@dataclass(frozen=True, slots=True)
class _Prepared:
    role: str
    content: str
    stored: str
    encoding: str
    metadata: str
    client_id: str | None
    created_at: int | None = None
    session: str | None = None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    last_sequence: int
    existing: dict[str, dict[str, Any]]
    recorded: dict[str, Any] | None
    tail: dict[int, tuple[str, str]]
    old_chunk_ids: list[str]


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
        msgs = await _decode_rows(rows)
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
        """Append 1-100 messages. Returns ``(result, replayed)``: ``replayed`` is True when nothing new was
        written: the Idempotency-Key was seen before (``result`` is the original response, with ``replayed`` =
        ``appended``), or every message's client_id was already stored. ``created_at`` and ``session``
        are the defaults of the messages that carry none (a session's date and label)."""
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise InvalidInput("Idempotency-Key must be 1-255 characters", details={"field": "Idempotency-Key"})
        default_at = parse_time(created_at, "created_at")
        if session is not None and (not isinstance(session, str) or not 1 <= len(session) <= 200):
            raise InvalidInput("session must be 1-200 characters", details={"field": "session"})
        messages = [m if (m.created_at is not None or m.ts is not None or default_at is None)
                    and (m.session is not None or session is None)
                    else msgspec.structs.replace(m, created_at=m.created_at if m.created_at is not None or m.ts is not None
                                                 else default_at, session=m.session or session)
                    for m in messages] if isinstance(messages, (list, tuple)) else messages
        items = await self._prepare(messages)
        request_hash = _request_hash(conversation_id, messages)
        async with self.locks.hold((self.sql.org_id, conversation_id)):
            for attempt in range(MAX_CLAIM_ATTEMPTS):
                done = await self._try_append(conversation_id, items, idempotency_key, request_hash)
                if done is not None:
                    return done
                # Another instance appended between our read and our claim: read again and retry.
                await asyncio.sleep(random.uniform(0, min(0.1, 0.002 * 2**attempt)))
        raise BackendError("the conversation is too busy to append to; retry", details={"id": conversation_id})

    async def _prepare(self, messages: Sequence[MessageIn]) -> list[_Prepared]:
        lim = self.limits
        if not isinstance(messages, (list, tuple)) or not 1 <= len(messages) <= lim.max_messages_per_append:
            raise InvalidInput(f"messages must hold 1-{lim.max_messages_per_append} messages", details={"field": "messages"})
        seen: set[str] = set()
        checked: list[tuple[MessageIn, bytes, str]] = []
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise InvalidInput(f"role must be one of {', '.join(ROLES)}", details={"field": f"messages[{i}].role"})
            if not isinstance(m.content, str):
                raise InvalidInput("content must be a string", details={"field": f"messages[{i}].content"})
            try:
                data = m.content.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidInput("content is not valid Unicode", details={"field": f"messages[{i}].content"}) from exc
            if len(data) > lim.max_message_bytes:
                raise PayloadTooLarge(
                    f"message {i} is {len(data)} bytes; the limit is {lim.max_message_bytes}",
                    details={"field": f"messages[{i}].content", "limit": lim.max_message_bytes},
                )
            if m.client_id is not None:
                if not isinstance(m.client_id, str) or not 1 <= len(m.client_id) <= 128:
                    raise InvalidInput("client_id must be 1-128 characters", details={"field": f"messages[{i}].client_id"})
                if m.client_id in seen:
                    raise InvalidInput("client_id repeats within the request", details={"field": f"messages[{i}].client_id"})
                seen.add(m.client_id)
            try:
                meta = check_metadata(m.metadata, lim.max_metadata_bytes)
            except (InvalidInput, PayloadTooLarge) as exc:
                exc.details["field"] = f"messages[{i}].metadata"
                raise
            at = parse_time(m.created_at, f"messages[{i}].created_at")
            ts = parse_time(m.ts, f"messages[{i}].ts")
            # both given: created_at wins (ts is its alias for clients that name it so)
            if m.session is not None and (not isinstance(m.session, str) or not 1 <= len(m.session) <= 200):
                raise InvalidInput("session must be 1-200 characters", details={"field": f"messages[{i}].session"})
            checked.append((m, data, meta, at if at is not None else ts))

        def encode_all() -> list[_Prepared]:
            out = []
            for m, _, meta, at in checked:
                stored, encoding = encode_content(m.content)
                out.append(_Prepared(m.role, m.content, stored, encoding, meta, m.client_id, at, m.session))
            return out

        if sum(len(d) for _, d, _, _ in checked) > _OFF_LOOP_BYTES:
            return await anyio.to_thread.run_sync(encode_all)
        return encode_all()

    async def _snapshot(self, cid: str, client_ids: list[str], key: str | None, now: int) -> _Snapshot:
        """One read batch (one round trip on D1, one consistent snapshot)."""
        tail_from = "(SELECT last_sequence FROM conversations WHERE organization_id = ?1 AND id = ?2) - 4"
        stmts = [
            self.sql.stmt("SELECT last_sequence FROM conversations WHERE organization_id = ?1 AND id = ?2", cid),
            self.sql.stmt(
                f"SELECT sequence, role, content, content_encoding FROM messages WHERE organization_id = ?1 "
                f"AND conversation_id = ?2 AND sequence > {tail_from} ORDER BY sequence",
                cid,
            ),
            self.sql.stmt(
                "SELECT id FROM chunks WHERE organization_id = ?1 AND kind = 'conversation' AND parent_id = ?2 "
                f"AND start_sequence > {tail_from}",
                cid,
            ),
        ]
        if client_ids:
            stmts.append(self.sql.stmt(
                "SELECT id, sequence, client_id FROM messages WHERE organization_id = ?1 AND conversation_id = ?2 "
                "AND client_id IN (SELECT value FROM json_each(?3))",
                cid, json.dumps(client_ids),
            ))
        if key is not None:
            stmts.append(self.sql.stmt(
                "SELECT request_hash, response FROM conversation_idempotency WHERE organization_id = ?1 AND key = ?2 "
                "AND created_at >= ?3",
                key, now - self.limits.idempotency_ttl_ms,
            ))
        res = await self.sql.batch(stmts)
        if not res[0].rows:
            raise NotFound("conversation not found", details={"id": cid})
        last = res[0].rows[0]["last_sequence"]
        tail = {
            r["sequence"]: (r["role"], decode_content(r["content"], r["content_encoding"]))
            for r in res[1].rows if r["sequence"] <= last
        }
        existing = {r["client_id"]: r for r in res[3].rows} if client_ids else {}
        recorded = res[-1].rows[0] if key is not None and res[-1].rows else None
        return _Snapshot(last, existing, recorded, tail, [r["id"] for r in res[2].rows])

    async def _try_append(
        self, cid: str, items: list[_Prepared], key: str | None, request_hash: str
    ) -> tuple[AppendResult, bool] | None:
        now = now_ms()
        client_ids = [i.client_id for i in items if i.client_id is not None]
        snap = await self._snapshot(cid, client_ids, key, now)
        if snap.recorded is not None:
            if snap.recorded["request_hash"] != request_hash:
                raise Conflict("this Idempotency-Key was used with a different request", details={"field": "Idempotency-Key"})
            original = msgspec.json.decode(snap.recorded["response"], type=AppendResult)
            return msgspec.structs.replace(original, replayed=original.appended), True  # all of it, this time

        fresh = [i for i in items if i.client_id is None or i.client_id not in snap.existing]
        last, n = snap.last_sequence, len(fresh)
        if n == 0:  # every message was stored by an earlier call: a retry; nothing to write
            out = [AppendedMessage(id=snap.existing[i.client_id]["id"], sequence=snap.existing[i.client_id]["sequence"],
                                   client_id=i.client_id) for i in items]
            return AppendResult(conversation_id=cid, appended=len(items), replayed=len(items), messages=out,
                                message_count=last), True

        token = new_id()
        assigned: dict[int, tuple[str, int]] = {}  # index in items -> (id, sequence)
        lines = dict(snap.tail)
        stmts: list[Statement] = [
            self.sql.stmt(
                "UPDATE conversations SET last_sequence = last_sequence + ?4, message_count = message_count + ?4, "
                "updated_at = ?5, append_token = ?6 WHERE organization_id = ?1 AND id = ?2 AND last_sequence = ?3 "
                "AND NOT EXISTS (SELECT 1 FROM messages WHERE organization_id = ?1 AND conversation_id = ?2 "
                "AND client_id IN (SELECT value FROM json_each(?7))) "
                "AND NOT EXISTS (SELECT 1 FROM conversation_idempotency WHERE organization_id = ?1 AND key = ?8 "
                "AND created_at >= ?9)",
                cid, last, n, now, token, json.dumps([i.client_id for i in fresh if i.client_id]), key,
                now - self.limits.idempotency_ttl_ms,
            )
        ]
        seq = last
        turns: list[list[Any]] = []
        for index, item in enumerate(items):
            if item.client_id is not None and item.client_id in snap.existing:
                continue
            seq += 1
            mid = new_id()
            assigned[index] = (mid, seq)
            lines[seq] = (item.role, item.content)
            stmts.append(self.sql.stmt(
                "INSERT INTO messages (organization_id, id, conversation_id, sequence, role, content, content_encoding, "
                f"metadata, client_id, created_at, session) SELECT ?1, ?4, ?2, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12 "
                f"WHERE {_GATE}",
                cid, token, mid, seq, item.role, item.stored, item.encoding, item.metadata, item.client_id,
                item.created_at if item.created_at is not None else now, item.session,
            ))
            text = format_line(item.role, item.content)
            turns.append([new_id(), seq, text, self.embedder.count_tokens(text)])
        new_last = seq
        # One turn chunk per new message, in one statement (the keyword rows follow by chunks' trigger).
        stmts.append(self.sql.stmt(
            "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count, start_sequence, "
            "end_sequence) SELECT ?1, json_extract(t.value, '$[0]'), 'turn', ?2, json_extract(t.value, '$[1]'), "
            "json_extract(t.value, '$[2]'), json_extract(t.value, '$[3]'), json_extract(t.value, '$[1]'), "
            f"json_extract(t.value, '$[1]') FROM json_each(?4) AS t WHERE {_GATE}",
            cid, token, json.dumps(turns, ensure_ascii=False),
        ))
        if snap.old_chunk_ids:
            stmts.append(self.sql.stmt(
                f"DELETE FROM chunks WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?4)) AND {_GATE}",
                cid, token, json.dumps(snap.old_chunk_ids),
            ))
        windows = 0
        for start in window_starts(last, new_last):
            end = min(start + WINDOW - 1, new_last)
            missing = [s for s in range(start, end + 1) if s not in lines]
            if missing:  # cannot happen while the snapshot is consistent
                raise BackendError("conversation messages are missing", details={"id": cid, "sequences": missing[:10]})
            text = "\n".join(format_line(*lines[s]) for s in range(start, end + 1))
            stmts.append(self.sql.stmt(
                "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count, start_sequence, "
                f"end_sequence) SELECT ?1, ?4, 'conversation', ?2, ?5, ?6, ?7, ?8, ?9 WHERE {_GATE}",
                cid, token, new_id(), (start - 1) // STRIDE, text, self.embedder.count_tokens(text), start, end,
            ))
            windows += 1

        out = []
        for index, item in enumerate(items):
            if index in assigned:
                mid, s = assigned[index]
            else:
                mid, s = snap.existing[item.client_id]["id"], snap.existing[item.client_id]["sequence"]
            out.append(AppendedMessage(id=mid, sequence=s, client_id=item.client_id))
        result = AppendResult(conversation_id=cid, appended=len(items), replayed=len(items) - n, messages=out,
                              message_count=new_last)
        if key is not None:
            stmts.append(self.sql.stmt(
                f"DELETE FROM conversation_idempotency WHERE organization_id = ?1 AND created_at < ?4 AND {_GATE}",
                cid, token, now - self.limits.idempotency_ttl_ms,
            ))
            stmts.append(self.sql.stmt(
                "INSERT INTO conversation_idempotency (organization_id, key, conversation_id, request_hash, response, "
                f"created_at) SELECT ?1, ?4, ?2, ?5, ?6, ?7 WHERE {_GATE}",
                cid, token, key, request_hash, msgspec.json.encode(result).decode(), now,
            ))
        if windows or turns:
            stmts.append(self.sql.stmt(
                "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) "
                f"SELECT ?1, ?4, ?2, ?5, ?5 WHERE {_GATE} AND NOT EXISTS (SELECT 1 FROM jobs WHERE organization_id = ?1 "
                "AND kind = ?4 AND target_id = ?2 AND state = 'pending' AND locked_until IS NULL)",
                cid, token, EMBED_JOB, now,
            ))
        res = await self.sql.batch(stmts)
        if res[0].changes != 1:
            return None
        if snap.old_chunk_ids:
            try:
                await self.vectors.delete_by_ids(snap.old_chunk_ids)
            except Exception:  # the rows are gone (search ignores the vectors); reconcile removes them later
                log.warning("could not delete the vectors of replaced windows of %s", cid, exc_info=True)
        self.on_enqueue()
        return result, False

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


def _request_hash(conversation_id: str, messages: Sequence[MessageIn]) -> str:
    body = [[m.role, m.content, m.metadata, m.client_id,
             *([[m.created_at, m.ts, m.session]] if (m.created_at, m.ts, m.session) != (None, None, None) else [])]
            for m in messages]
    raw = json.dumps([conversation_id, body], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


async def _decode_rows(rows: list[dict[str, Any]]) -> list[Message]:
    if sum(len(r["content"]) for r in rows) > _OFF_LOOP_BYTES:
        return await anyio.to_thread.run_sync(lambda: [message_from_row(r) for r in rows])
    return [message_from_row(r) for r in rows]
