"""Appending to a conversation: one atomic batch, safe across any number of service instances.

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
from services.conversations.messages import OFF_LOOP_BYTES, STRIDE, WINDOW, format_line, window_starts
from services.conversations.models import ROLES, AppendedMessage, AppendResult, MessageIn
from services.errors import BackendError, Conflict, InvalidInput, NotFound, PayloadTooLarge
from services.ids import new_id, now_ms
from services.models import check_metadata
from services.ports import Embedder, Statement
from services.search.indexing import EMBED_JOB
from services.storage.scoped import OrgSql, OrgVectors
from services.text.temporal import parse_time

__all__ = ["ConversationLimits", "KeyedLocks", "Appender", "MAX_CLAIM_ATTEMPTS"]

log = logging.getLogger("memex.conversations")

MAX_CLAIM_ATTEMPTS = 12
_GATE = "EXISTS (SELECT 1 FROM conversations WHERE organization_id = ?1 AND id = ?2 AND append_token = ?3)"


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


@dataclass(frozen=True, slots=True)
class Prepared:
    role: str
    content: str
    stored: str
    encoding: str
    metadata: str
    client_id: str | None
    created_at: int | None = None
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    last_sequence: int
    existing: dict[str, dict[str, Any]]
    recorded: dict[str, Any] | None
    tail: dict[int, tuple[str, str]]
    old_chunk_ids: list[str]


class Appender:
    """One organization's appends (handles bound to it): validation, the claim and its batch, the retries."""

    def __init__(self, sql: OrgSql, vectors: OrgVectors, embedder: Embedder, *, locks: KeyedLocks,
                 limits: ConversationLimits, on_enqueue: Callable[[], None]) -> None:
        self.sql = sql
        self.vectors = vectors
        self.embedder = embedder
        self.locks = locks
        self.limits = limits
        self.on_enqueue = on_enqueue

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

    async def _prepare(self, messages: Sequence[MessageIn]) -> list[Prepared]:
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

        def encode_all() -> list[Prepared]:
            out = []
            for m, _, meta, at in checked:
                stored, encoding = encode_content(m.content)
                out.append(Prepared(m.role, m.content, stored, encoding, meta, m.client_id, at, m.session))
            return out

        if sum(len(d) for _, d, _, _ in checked) > OFF_LOOP_BYTES:
            return await anyio.to_thread.run_sync(encode_all)
        return encode_all()

    async def _snapshot(self, cid: str, client_ids: list[str], key: str | None, now: int) -> Snapshot:
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
        return Snapshot(last, existing, recorded, tail, [r["id"] for r in res[2].rows])

    async def _try_append(
        self, cid: str, items: list[Prepared], key: str | None, request_hash: str
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


def _request_hash(conversation_id: str, messages: Sequence[MessageIn]) -> str:
    body = [[m.role, m.content, m.metadata, m.client_id,
             *([[m.created_at, m.ts, m.session]] if (m.created_at, m.ts, m.session) != (None, None, None) else [])]
            for m in messages]
    raw = json.dumps([conversation_id, body], ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
