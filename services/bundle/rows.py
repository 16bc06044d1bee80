"""What each organization record of a bundle becomes in the organization's database (``Rows``).

Records are validated against the limits a capture or an append enforces (content and metadata sizes, the
content hash, a message's place in its conversation) and re-chunked with the capture's chunker and the append's
windows, keeping their ids (each organization has its own database, so ids cannot collide). Each record adds
its statements to the batch being built (``Pending``); ``services.bundle.importer`` writes the batches, checks
what each statement changed, and rolls everything back on a refusal.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread

from services.bundle.records import ConversationRecord, HistoryRecord, LinkRecord, MessageRecord, ThoughtRecord
from services.conversations.compression import encode_content
from services.conversations.append import ConversationLimits
from services.conversations.messages import STRIDE, WINDOW, format_line, window_starts
from services.errors import InvalidInput, PayloadTooLarge
from services.ids import new_id
from services.models import check_metadata
from services.ports import Embedder, Statement
from services.storage.scoped import OrgSql
from services.text.chunking import chunk_text, default_chunk_params
from services.thoughts.thoughts import ThoughtLimits

__all__ = ["Rows", "Pending", "OpenConversation", "refuse"]


def refuse(line: int, message: str, **details: Any) -> InvalidInput:
    return InvalidInput(f"line {line}: {message}", details={"line": line, **details})


@dataclass
class Pending:
    """A batch being built: statements in order, with what each record's statement must change."""

    stmts: list[Statement] = field(default_factory=list)
    #: (index of the record's statement, line, type, id): a statement that changed nothing repeats an id.
    checks: list[tuple[int, int, str, str]] = field(default_factory=list)
    #: (index, type) of statements whose 0 changes are a skip, not an error (links).
    skips: list[tuple[int, str]] = field(default_factory=list)
    journal: list[tuple[str, str]] = field(default_factory=list)
    size: int = 0


@dataclass
class OpenConversation:
    """The conversation whose messages are being read: how many it announced, how many came, its last window."""

    id: str
    line: int
    expected: int
    seen: int = 0
    tail: deque = field(default_factory=lambda: deque(maxlen=WINDOW))


class Rows:
    """The statements of each organization record (thoughts, their history and links, conversations and their
    messages), validated as a capture or an append would be."""

    def __init__(self, sql: OrgSql, embedder: Embedder, *, thought_limits: ThoughtLimits,
                 conversation_limits: ConversationLimits) -> None:
        self.sql = sql
        self.embedder = embedder
        self.thought_limits = thought_limits
        self.conversation_limits = conversation_limits
        self.max_tokens, self.overlap = default_chunk_params(embedder)
        #: The conversation whose messages are being read, if any.
        self.open: OpenConversation | None = None

    # -- checks ------------------------------------------------------------------------------------

    def _text(self, number: int, value: str, what: str, limit: int | None = None) -> bytes:
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:
            raise refuse(number, f"{what} is not valid Unicode", field=what) from None
        if limit is not None and len(data) > limit:
            raise PayloadTooLarge(f"line {number}: {what} is {len(data)} bytes; the limit is {limit}",
                                  details={"line": number, "field": what, "limit": limit})
        return data

    def _metadata(self, number: int, metadata: dict, limit: int) -> str:
        try:
            return check_metadata(metadata, limit)
        except (InvalidInput, PayloadTooLarge) as exc:
            exc.message = f"line {number}: {exc.message}"
            exc.args = (exc.message,)
            exc.details["line"] = number
            raise

    def _hash(self, number: int, content: bytes, given: str | None) -> str:
        digest = hashlib.sha256(content).hexdigest()
        if given is not None and given != digest:
            raise refuse(number, "content_hash is not the SHA-256 of content", field="content_hash")
        return digest

    def _source(self, number: int, source: str | None) -> None:
        if source is not None:
            self._text(number, source, "source")
            if len(source) > self.thought_limits.max_source_chars:
                raise refuse(number, f"source is longer than {self.thought_limits.max_source_chars} characters",
                              field="source")

    @staticmethod
    def _tags(tags: list[str] | None) -> str | None:
        return None if tags is None else json.dumps(tags, ensure_ascii=False)

    # -- records -----------------------------------------------------------------------------------

    async def thought(self, b: Pending, number: int, r: ThoughtRecord) -> None:
        if not r.content.strip():
            raise refuse(number, "content must be a non-empty string", field="content")
        data = self._text(number, r.content, "content", self.thought_limits.max_content_bytes)
        digest = self._hash(number, data, r.content_hash)
        self._source(number, r.source)
        meta = self._metadata(number, r.metadata, self.thought_limits.max_metadata_bytes)

        def pieces() -> list[list]:
            texts = chunk_text(r.content, count_tokens=self.embedder.count_tokens, max_tokens=self.max_tokens,
                               overlap_tokens=self.overlap)
            return [[new_id(), i, p, self.embedder.count_tokens(p)] for i, p in enumerate(texts)]

        chunks = await anyio.to_thread.run_sync(pieces) if len(data) > 16 * 1024 else pieces()
        b.journal.append(("thought", r.id))
        b.checks.append((len(b.stmts), number, "thought", r.id))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO documents (organization_id, id, content, content_hash, source, metadata, summary, tags, "
            "importance, enrichment_state, enriched_at, recall_count, use_weight, use_count, last_used_at, created_at, "
            "updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17) "
            "ON CONFLICT DO NOTHING",
            r.id, r.content, digest, r.source, meta, r.summary, self._tags(r.tags), r.importance, r.enrichment_state,
            r.enriched_at, r.recall_count, r.use_weight, r.use_count, r.last_used_at, r.created_at, r.updated_at,
        ))
        # The capture's chunks (services.thoughts.thoughts), in one statement; their keyword rows follow by trigger.
        b.stmts.append(self.sql.stmt(
            "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count) "
            "SELECT ?1, json_extract(c.value, '$[0]'), 'thought', ?2, json_extract(c.value, '$[1]'), "
            "json_extract(c.value, '$[2]'), json_extract(c.value, '$[3]') FROM json_each(?3) AS c",
            r.id, json.dumps(chunks, ensure_ascii=False),
        ))
        b.size += 2 * len(data)

    async def thought_history(self, b: Pending, number: int, r: HistoryRecord) -> None:
        data = self._text(number, r.content, "content", self.thought_limits.max_content_bytes)
        digest = self._hash(number, data, r.content_hash)
        self._source(number, r.source)
        meta = self._metadata(number, r.metadata, self.thought_limits.max_metadata_bytes)
        b.journal.append(("thought_history", r.id))
        b.checks.append((len(b.stmts), number, "thought_history", r.id))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO thought_history (organization_id, id, thought_id, original_id, action, reason, content, "
            "content_hash, source, metadata, summary, tags, original_created_at, original_updated_at, created_at) "
            "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15) ON CONFLICT DO NOTHING",
            r.id, r.thought_id, r.original_id, r.action, r.reason, r.content, digest, r.source, meta, r.summary,
            self._tags(r.tags), r.original_created_at, r.original_updated_at, r.created_at,
        ))
        b.size += len(data)

    async def thought_link(self, b: Pending, number: int, r: LinkRecord) -> None:
        b.skips.append((len(b.stmts), "thought_link"))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO thought_links (organization_id, from_id, to_id, kind, reason, created_at) "
            "SELECT ?1, ?2, ?3, ?4, ?5, ?6 WHERE EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?2) "
            "AND EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?3) ON CONFLICT DO NOTHING",
            r.from_id, r.to_id, r.kind, r.reason, r.created_at,
        ))

    async def conversation(self, b: Pending, number: int, r: ConversationRecord) -> None:
        self.end_conversation()
        if r.title is not None:
            self._text(number, r.title, "title")
            if len(r.title) > self.conversation_limits.max_title_chars:
                raise refuse(number, f"title is longer than {self.conversation_limits.max_title_chars} characters",
                              field="title")
        meta = self._metadata(number, r.metadata, self.conversation_limits.max_metadata_bytes)
        self.open = OpenConversation(r.id, number, r.message_count)
        b.journal.append(("conversation", r.id))
        b.checks.append((len(b.stmts), number, "conversation", r.id))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO conversations (organization_id, id, title, metadata, message_count, last_sequence, created_at, "
            "updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?5, ?6, ?7) ON CONFLICT DO NOTHING",
            r.id, r.title, meta, r.message_count, r.created_at, r.updated_at,
        ))

    async def message(self, b: Pending, number: int, r: MessageRecord) -> None:
        conv = self.open
        if conv is None or r.conversation_id != conv.id:
            raise refuse(number, "a message must follow its conversation record (and that conversation's earlier "
                                  "messages)", field="conversation_id")
        if r.sequence != conv.seen + 1:
            raise refuse(number, f"sequence {r.sequence} where {conv.seen + 1} was expected: a conversation's messages "
                                  "come in order, contiguous from 1", field="sequence")
        if r.sequence > conv.expected:
            raise refuse(number, f"more messages than the conversation's message_count ({conv.expected})",
                          field="sequence")
        data = self._text(number, r.content, "content", self.conversation_limits.max_message_bytes)
        meta = self._metadata(number, r.metadata, self.conversation_limits.max_metadata_bytes)
        conv.seen = r.sequence
        conv.tail.append((r.sequence, r.role, r.content))
        # Windows of WINDOW messages with stride STRIDE (services.conversations.messages): each written once, final.
        windows = []
        start = r.sequence - WINDOW + 1
        if start >= 1 and (start - 1) % STRIDE == 0:
            windows.append(start)
        if r.sequence == conv.expected:
            windows += window_starts(r.sequence, r.sequence)  # the short windows at the end
        lines = {s: (role, content) for s, role, content in conv.tail}
        chunks = []
        for s in windows:
            end = min(s + WINDOW - 1, r.sequence)
            text = "\n".join(format_line(*lines[q]) for q in range(s, end + 1))
            chunks.append(("conversation", (s - 1) // STRIDE, text, s, end))
        chunks.append(("turn", r.sequence, format_line(r.role, r.content), r.sequence, r.sequence))

        def prepare():
            stored, encoding = encode_content(r.content)
            return stored, encoding, [[new_id(), k, o, t, self.embedder.count_tokens(t), a, e] for k, o, t, a, e in chunks]

        stored, encoding, rows = (await anyio.to_thread.run_sync(prepare)) if len(data) > 16 * 1024 else prepare()
        b.checks.append((len(b.stmts), number, "message", r.id))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO messages (organization_id, id, conversation_id, sequence, role, content, content_encoding, "
            "metadata, client_id, created_at, session) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11) "
            "ON CONFLICT DO NOTHING",
            r.id, conv.id, r.sequence, r.role, stored, encoding, meta, r.client_id, r.created_at, r.session,
        ))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO chunks (organization_id, id, kind, parent_id, ordinal, content, token_count, start_sequence, "
            "end_sequence) SELECT ?1, json_extract(c.value, '$[0]'), json_extract(c.value, '$[1]'), ?2, "
            "json_extract(c.value, '$[2]'), json_extract(c.value, '$[3]'), json_extract(c.value, '$[4]'), "
            "json_extract(c.value, '$[5]'), json_extract(c.value, '$[6]') FROM json_each(?3) AS c",
            conv.id, json.dumps(rows, ensure_ascii=False),
        ))
        b.size += len(stored) + sum(len(c[2]) for c in chunks)

    def end_conversation(self) -> None:
        """The conversation being read is complete: its message_count must match the messages that followed."""
        conv, self.open = self.open, None
        if conv is not None and conv.seen != conv.expected:
            raise refuse(conv.line, f"the conversation has message_count {conv.expected} but {conv.seen} messages "
                                     "follow it", field="message_count", id=conv.id)
