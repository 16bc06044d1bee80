"""Whole-organization bundles: one organization's data as versioned JSON Lines (docs/export-bundle.md).

Export (``BundleExport``) reads the organization's database page by page (keyset pagination, never the whole
organization in memory) and yields one record per line: a header, the thoughts, their history entries and
links, each conversation followed by its messages (decompressed), the keys' metadata (never a hash or a
secret), the Access bindings, and a trailer whose counts make a truncated download detectable.

Import (``BundleImport``) restores a bundle into an organization that has no thoughts, conversations or
history entries. The body is read incrementally, line by line; records are validated as they come and
written in batches, keeping their ids (each organization has its own database, so ids cannot collide) and
re-chunking with the capture and append code's chunkers. Refusal changes nothing: every id written is first
noted in a journal (a temporary file, so a large import does not hold its ids in memory), and any failure (a
malformed or out-of-order line, a repeated id, a missing or wrong trailer, a store error, a disconnect)
deletes what the journal lists (rows first, then any vector) before the error is raised. Embedding and
enrichment jobs are queued only once the whole bundle has been read and written, so nothing is embedded
before the import is known to succeed; the caller then wakes the worker.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tempfile
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
import msgspec

from services.text.chunking import chunk_text, default_chunk_params
from services.conversations.compression import encode_content
from services.conversations.conversations import STRIDE, WINDOW, ConversationLimits, format_line, message_from_row, window_starts
from services.enrichment.enrichment import ENRICH_JOB
from services.errors import Conflict, InvalidInput, PayloadTooLarge
from services.ids import new_id, now_ms
from services.models import check_metadata
from services.storage.migrate import ORG_DIR, discover
from services.ports import Embedder, Statement
from services.storage.scoped import OrgSql, OrgVectors
from services.text.temporal import MAX_MS
from services.search.indexing import enqueue_embed
from services.thoughts.thoughts import ThoughtLimits

__all__ = [
    "BUNDLE_TYPE", "BUNDLE_VERSION", "MEDIA_TYPE", "RECORD_TYPES", "MAX_LINE_BYTES", "BundleCounts",
    "BundleOrganization", "Header", "Trailer", "ImportResult", "BundleExport", "BundleImport", "latest_schema",
]

log = logging.getLogger("memex.bundle")

BUNDLE_TYPE = "memex.bundle"
BUNDLE_VERSION = 1
MEDIA_TYPE = "application/x-ndjson"
#: Record types in the order their sections appear (a conversation's messages follow it).
RECORD_TYPES = ("thought", "thought_history", "thought_link", "conversation", "message", "knowledge_base", "key",
                "membership", "service_token")
#: The longest line an import reads (a 256 KiB thought escaped as JSON fits many times over).
MAX_LINE_BYTES = 8 * 1024 * 1024
_SECTION = {"thought": 1, "thought_history": 2, "thought_link": 3, "conversation": 4, "message": 4,
            "knowledge_base": 5, "key": 6, "membership": 7, "service_token": 8}

#: Rows read per page on export (a page of thoughts is at most this many times the largest thought).
EXPORT_PAGE = 100
#: An import batch is written when it holds this many statements or this many bytes of content.
BATCH_STATEMENTS = 200
BATCH_BYTES = 1024 * 1024
_JOURNAL_PAGE = 200

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Ms = Annotated[int, msgspec.Meta(ge=0, le=MAX_MS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Tag = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
Scope = Literal["read", "write", "admin"]
_EMAIL = re.compile(r"^[^@ \t\r\n]{1,64}@[^@ \t\r\n]{1,255}$")
_COMMON_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def latest_schema() -> str | None:
    """The newest organization migration this service knows (the header's ``schema``)."""
    found = discover(ORG_DIR)
    return found[-1].name if found else None


# -- records -------------------------------------------------------------------------------------------


class BundleCounts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Records per type."""

    thought: Count = 0
    thought_history: Count = 0
    thought_link: Count = 0
    conversation: Count = 0
    message: Count = 0
    knowledge_base: Count = 0
    key: Count = 0
    membership: Count = 0
    service_token: Count = 0


class BundleOrganization(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, msgspec.Meta(max_length=100)]
    slug: Annotated[str, msgspec.Meta(max_length=100)]
    name: Annotated[str, msgspec.Meta(max_length=200)]
    created_at: Ms


class _Record(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    pass


class Header(_Record, tag=BUNDLE_TYPE, kw_only=True):
    version: int
    exported_at: Ms
    organization: BundleOrganization
    #: The newest organization migration of the exporting service (informational).
    schema: Annotated[str, msgspec.Meta(max_length=200)] | None
    #: Records per type when the export began (a live organization may change while it streams: the trailer's
    #: counts are the ones that hold).
    counts: BundleCounts


class Trailer(_Record, tag="trailer", kw_only=True):
    counts: BundleCounts


class ThoughtRecord(_Record, tag="thought", kw_only=True):
    id: Id
    content: str
    content_hash: Sha256 | None = None
    source: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    summary: Annotated[str, msgspec.Meta(max_length=2000)] | None = None
    tags: Annotated[list[Tag], msgspec.Meta(max_length=100)] | None = None
    importance: Annotated[int, msgspec.Meta(ge=1, le=5)] | None = None
    enrichment_state: Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[a-z_]+$")] | None = None
    enriched_at: Ms | None = None
    use_count: Count = 0
    use_weight: Annotated[float, msgspec.Meta(ge=0, le=1e300)] = 0.0
    last_used_at: Ms | None = None
    recall_count: Count = 0
    created_at: Ms
    updated_at: Ms


class HistoryRecord(_Record, tag="thought_history", kw_only=True):
    id: Id
    thought_id: Id
    original_id: Id | None = None
    action: Literal["merged", "replaced"]
    reason: Annotated[str, msgspec.Meta(max_length=10_000)] | None = None
    content: str
    content_hash: Sha256 | None = None
    source: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    summary: Annotated[str, msgspec.Meta(max_length=2000)] | None = None
    tags: Annotated[list[Tag], msgspec.Meta(max_length=100)] | None = None
    original_created_at: Ms
    original_updated_at: Ms
    created_at: Ms


class LinkRecord(_Record, tag="thought_link", kw_only=True):
    from_id: Id
    to_id: Id
    kind: Literal["contradicts"]
    reason: Annotated[str, msgspec.Meta(max_length=10_000)] | None = None
    created_at: Ms


class ConversationRecord(_Record, tag="conversation", kw_only=True):
    id: Id
    title: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    #: How many message records follow (sequences 1..message_count).
    message_count: Count
    created_at: Ms
    updated_at: Ms


class MessageRecord(_Record, tag="message", kw_only=True):
    id: Id
    conversation_id: Id
    sequence: Annotated[int, msgspec.Meta(ge=1, le=2**53 - 1)]
    role: Literal["user", "assistant", "system", "tool"]
    #: Plain text (stored compressed, exported decompressed).
    content: str
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    client_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    created_at: Ms
    session: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None


class KnowledgeBaseRecord(_Record, tag="knowledge_base", forbid_unknown_fields=False, kw_only=True):
    """Reserved: knowledge bases' configuration (none exist yet; an import refuses this record)."""

    id: str | None = None


class KeyRecord(_Record, tag="key", kw_only=True):
    """An API key's metadata. Never its hash or secret; an import lists keys and does not recreate them."""

    id: Annotated[str, msgspec.Meta(max_length=64)]
    name: Annotated[str, msgspec.Meta(max_length=100)]
    prefix: Annotated[str, msgspec.Meta(max_length=64)]
    scopes: Annotated[list[Scope], msgspec.Meta(max_length=3)]
    created_at: Ms
    expires_at: Ms | None = None
    revoked_at: Ms | None = None
    last_used_at: Ms | None = None


class MembershipRecord(_Record, tag="membership", kw_only=True):
    email: Annotated[str, msgspec.Meta(max_length=320)]
    role: Literal["owner", "admin", "member", "viewer"]
    created_at: Ms


class ServiceTokenRecord(_Record, tag="service_token", kw_only=True):
    common_name: Annotated[str, msgspec.Meta(max_length=200)]
    name: Annotated[str, msgspec.Meta(max_length=100)]
    scopes: Annotated[list[Scope], msgspec.Meta(min_length=1, max_length=3)]
    created_at: Ms


_DECODERS = {
    cls.__struct_config__.tag: msgspec.json.Decoder(cls)
    for cls in (Header, Trailer, ThoughtRecord, HistoryRecord, LinkRecord, ConversationRecord, MessageRecord,
                KnowledgeBaseRecord, KeyRecord, MembershipRecord, ServiceTokenRecord)
}


class _Peek(msgspec.Struct):
    type: Any = None
    version: Any = None


_PEEK = msgspec.json.Decoder(_Peek)
_ENCODER = msgspec.json.Encoder()


class ImportResult(msgspec.Struct, kw_only=True):
    """What an import did."""

    #: Records written, per type.
    imported: BundleCounts
    #: Records read but not written: keys (a secret cannot be exported, so keys are never recreated), bindings
    #: the organization already had, links whose thoughts are not both in the bundle.
    not_imported: BundleCounts
    #: Chunks queued for embedding: the imported thoughts and conversations are keyword-searchable now and
    #: semantically searchable once the worker has embedded them.
    chunks_pending: int
    indexing: Literal["pending", "indexed"]
    note: str


def _loads(text: str | None, default: Any) -> Any:
    return json.loads(text) if text else default


# -- export --------------------------------------------------------------------------------------------


class BundleExport:
    """One organization's bundle. ``prepare()`` reads the counts (errors surface before any byte is sent);
    ``lines()`` then yields the bundle, a page of records at a time."""

    def __init__(self, sql: OrgSql, control: OrgSql, organization: BundleOrganization, *,
                 page: int = EXPORT_PAGE, progress: Callable[[int], None] | None = None) -> None:
        self.sql = sql
        self.control = control
        self.organization = organization
        self.page = page
        self.progress = progress or (lambda n: None)
        self.header: Header | None = None
        self.counts: dict[str, int] = dict.fromkeys(RECORD_TYPES, 0)

    async def prepare(self) -> Header:
        org = await self.sql.batch([self.sql.stmt(f"SELECT COUNT(*) AS n FROM {t} WHERE organization_id = ?1") for t in
                                    ("documents", "thought_history", "thought_links", "conversations", "messages")])
        ctl = await self.control.batch([self.control.stmt(f"SELECT COUNT(*) AS n FROM {t} WHERE organization_id = ?1")
                                        for t in ("api_keys", "memberships", "service_tokens")])
        n = [r.rows[0]["n"] for r in (*org, *ctl)]
        counts = BundleCounts(thought=n[0], thought_history=n[1], thought_link=n[2], conversation=n[3], message=n[4],
                              key=n[5], membership=n[6], service_token=n[7])
        self.header = Header(version=BUNDLE_VERSION, exported_at=now_ms(), organization=self.organization,
                             schema=latest_schema(), counts=counts)
        return self.header

    async def lines(self) -> AsyncIterator[bytes]:
        header = self.header or await self.prepare()
        yield _ENCODER.encode(header) + b"\n"
        for source in (self._thoughts, self._history, self._links, self._conversations, self._keys, self._members,
                       self._tokens):
            async for records in source():
                for r in records:
                    self.counts[r.__struct_config__.tag] += 1
                self.progress(len(records))
                yield b"".join(_ENCODER.encode(r) + b"\n" for r in records)
        yield _ENCODER.encode(Trailer(counts=BundleCounts(**self.counts))) + b"\n"

    async def _pages(self, db: OrgSql, first: str, after: str, key: Callable[[dict], list]) -> AsyncIterator[list[dict]]:
        """Keyset pages: ``first`` takes (limit), ``after`` takes (*key of the last row, limit)."""
        rows = await db.rows(first, [self.page])
        while rows:
            yield rows
            if len(rows) < self.page:
                return
            rows = await db.rows(after, [*key(rows[-1]), self.page])

    def _by_id(self, db: OrgSql, table: str, columns: str = "*", id_col: str = "id"):
        base = f"SELECT {columns} FROM {table} WHERE organization_id = ?1"
        return self._pages(db, f"{base} ORDER BY {id_col} LIMIT ?2", f"{base} AND {id_col} > ?2 ORDER BY {id_col} LIMIT ?3",
                           lambda r: [r[id_col]])

    async def _thoughts(self):
        async for rows in self._by_id(self.sql, "documents"):
            yield [ThoughtRecord(
                id=r["id"], content=r["content"], content_hash=r["content_hash"], source=r["source"],
                metadata=_loads(r["metadata"], {}), summary=r["summary"], tags=_loads(r["tags"], None),
                importance=r["importance"], enrichment_state=r["enrichment_state"], enriched_at=r["enriched_at"],
                use_count=r["use_count"] or 0, use_weight=float(r["use_weight"] or 0), last_used_at=r["last_used_at"],
                recall_count=r["recall_count"] or 0, created_at=r["created_at"], updated_at=r["updated_at"],
            ) for r in rows]

    async def _history(self):
        async for rows in self._by_id(self.sql, "thought_history"):
            yield [HistoryRecord(
                id=r["id"], thought_id=r["thought_id"], original_id=r["original_id"], action=r["action"],
                reason=r["reason"], content=r["content"], content_hash=r["content_hash"], source=r["source"],
                metadata=_loads(r["metadata"], {}), summary=r["summary"], tags=_loads(r["tags"], None),
                original_created_at=r["original_created_at"], original_updated_at=r["original_updated_at"],
                created_at=r["created_at"],
            ) for r in rows]

    async def _links(self):
        base = "SELECT from_id, to_id, kind, reason, created_at FROM thought_links WHERE organization_id = ?1"
        order = " ORDER BY from_id, to_id, kind LIMIT ?"
        async for rows in self._pages(self.sql, base + order + "2", base + " AND (from_id, to_id, kind) > (?2, ?3, ?4)"
                                      + order + "5", lambda r: [r["from_id"], r["to_id"], r["kind"]]):
            yield [LinkRecord(**r) for r in rows]

    async def _conversations(self):
        async for rows in self._by_id(self.sql, "conversations", "id, title, metadata, last_sequence, created_at, updated_at"):
            for r in rows:
                # Messages up to the last sequence read here: an append that lands meanwhile is left out whole,
                # so the conversation's message_count always matches the messages that follow it.
                last = r["last_sequence"]
                yield [ConversationRecord(id=r["id"], title=r["title"], metadata=_loads(r["metadata"], {}),
                                          message_count=last, created_at=r["created_at"], updated_at=r["updated_at"])]
                seq = 0
                while seq < last:
                    page = await self.sql.rows(
                        "SELECT id, conversation_id, sequence, role, content, content_encoding, metadata, client_id, "
                        "created_at, session FROM messages WHERE organization_id = ?1 AND conversation_id = ?2 "
                        "AND sequence > ?3 AND sequence <= ?4 ORDER BY sequence LIMIT ?5",
                        [r["id"], seq, last, self.page * 2],
                    )
                    if not page:
                        break
                    seq = page[-1]["sequence"]
                    decoded = await anyio.to_thread.run_sync(lambda p=page: [message_from_row(m) for m in p])
                    yield [MessageRecord(id=m.id, conversation_id=m.conversation_id, sequence=m.sequence, role=m.role,
                                         content=m.content, metadata=m.metadata, client_id=m.client_id,
                                         created_at=m.created_at, session=m.session) for m in decoded]

    async def _keys(self):
        columns = "id, name, prefix, scopes, created_at, expires_at, revoked_at, last_used_at"  # never key_hash
        async for rows in self._by_id(self.control, "api_keys", columns):
            yield [KeyRecord(**{**r, "scopes": _loads(r["scopes"], [])}) for r in rows]

    async def _members(self):
        async for rows in self._by_id(self.control, "memberships", "email, role, created_at", "email"):
            yield [MembershipRecord(**r) for r in rows]

    async def _tokens(self):
        async for rows in self._by_id(self.control, "service_tokens", "common_name, name, scopes, created_at",
                                      "common_name"):
            yield [ServiceTokenRecord(**{**r, "scopes": _loads(r["scopes"], [])}) for r in rows]


# -- import --------------------------------------------------------------------------------------------


def _refuse(line: int, message: str, **details: Any) -> InvalidInput:
    return InvalidInput(f"line {line}: {message}", details={"line": line, **details})


async def _lines(chunks: AsyncIterable[bytes], limit: int) -> AsyncIterator[tuple[int, bytes]]:
    """Numbered lines of a byte stream (1-based; ``\\r\\n`` allowed), each at most ``limit`` bytes."""
    buf = bytearray()
    number = 0
    async for chunk in chunks:
        if not chunk:
            continue
        buf += chunk
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            number += 1
            if end - start > limit:
                raise _refuse(number, f"the line is longer than {limit} bytes", limit=limit)
            yield number, bytes(buf[start:end])
            start = end + 1
        del buf[:start]
        if len(buf) > limit:
            raise _refuse(number + 1, f"the line is longer than {limit} bytes", limit=limit)
    if buf:
        yield number + 1, bytes(buf)


class _Journal:
    """What an import wrote, as (kind, id) lines in a temporary file: what a rollback deletes."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(prefix="memex-import-")
        self.size = 0

    def add(self, kind: str, ident: str) -> None:
        self.file.write(_ENCODER.encode([kind, ident]) + b"\n")
        self.size += 1

    def pages(self, size: int = _JOURNAL_PAGE):
        """``(kind, [ids])`` in the order written, at most ``size`` ids each."""
        self.file.flush()
        self.file.seek(0)
        kind, ids = None, []
        for raw in self.file:
            k, ident = msgspec.json.decode(raw)
            if (k != kind or len(ids) >= size) and ids:
                yield kind, ids
                ids = []
            kind = k
            ids.append(ident)
        if ids:
            yield kind, ids
        self.file.seek(0, 2)

    def close(self) -> None:
        self.file.close()


@dataclass
class _Pending:
    """A batch being built: statements in order, with what each record's statement must change."""

    stmts: list[Statement] = field(default_factory=list)
    #: (index of the record's statement, line, type, id): a statement that changed nothing repeats an id.
    checks: list[tuple[int, int, str, str]] = field(default_factory=list)
    #: (index, type) of statements whose 0 changes are a skip, not an error (links).
    skips: list[tuple[int, str]] = field(default_factory=list)
    journal: list[tuple[str, str]] = field(default_factory=list)
    size: int = 0


@dataclass
class _Conversation:
    id: str
    line: int
    expected: int
    seen: int = 0
    tail: deque = field(default_factory=lambda: deque(maxlen=WINDOW))


_ALREADY = "an import into this organization is already running"
_importing: set[str] = set()


class BundleImport:
    """Restore a bundle into one empty organization. ``run(chunks)`` reads the body (an async iterable of
    bytes), validates and writes as it goes, and rolls everything back on any failure."""

    def __init__(self, sql: OrgSql, control: OrgSql, vectors: OrgVectors, embedder: Embedder, *,
                 thought_limits: ThoughtLimits = ThoughtLimits(),
                 conversation_limits: ConversationLimits = ConversationLimits(),
                 on_header: Callable[[Header], None] | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.sql = sql
        self.control = control
        self.vectors = vectors
        self.embedder = embedder
        self.thought_limits = thought_limits
        self.conversation_limits = conversation_limits
        self.on_header = on_header or (lambda h: None)
        self.progress = progress or (lambda n: None)
        self.max_tokens, self.overlap = default_chunk_params(embedder)
        self.header: Header | None = None
        self.trailer: Trailer | None = None
        self.section = 0
        self.read = dict.fromkeys(RECORD_TYPES, 0)
        self.written = dict.fromkeys(RECORD_TYPES, 0)
        self.skipped = dict.fromkeys(RECORD_TYPES, 0)
        self.conversation: _Conversation | None = None
        self.org_batch = _Pending()
        self.control_batch: list[tuple[int, str, _Record]] = []
        self.journal = _Journal()
        self.unread = 0  # records read since the last progress report

    async def run(self, chunks: AsyncIterable[bytes]) -> ImportResult:
        org_id = self.sql.org_id
        if org_id in _importing:
            raise Conflict(_ALREADY)
        _importing.add(org_id)
        try:
            await self._check_empty()
            try:
                last = 0
                async for last, line in _lines(chunks, MAX_LINE_BYTES):
                    if line.strip():
                        await self._line(last, line)
                if self.header is None:
                    raise InvalidInput("the body is empty: send a bundle (application/x-ndjson) from GET /v1/org/export",
                                       details={"line": 0})
                if self.trailer is None:
                    raise _refuse(last, "the bundle ends without its trailer: it is truncated", truncated=True)
                await self._flush()
                await self._flush_control()
                await self._enqueue_jobs()
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._rollback()
                raise
        finally:
            _importing.discard(org_id)
            self.journal.close()
        self.progress(self.unread)
        pending = (await self.sql.one(
            "SELECT COUNT(*) AS n FROM chunks WHERE organization_id = ?1 AND indexed_at IS NULL"))["n"]
        return ImportResult(
            imported=BundleCounts(**self.written), not_imported=BundleCounts(**self.skipped), chunks_pending=pending,
            indexing="pending" if pending else "indexed",
            note="Imported thoughts and conversations are keyword-searchable now and become semantically searchable "
                 "once the worker has embedded their chunks (GET /v1/thoughts/{id} shows indexing). Keys are listed in "
                 "a bundle but never recreated: create new ones with POST /v1/keys.",
        )

    async def _check_empty(self) -> None:
        row = await self.sql.one(
            "SELECT EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1) AS thoughts, "
            "EXISTS (SELECT 1 FROM conversations WHERE organization_id = ?1) AS conversations, "
            "EXISTS (SELECT 1 FROM thought_history WHERE organization_id = ?1) AS history"
        )
        held = [k for k in ("thoughts", "conversations", "history") if row[k]]
        if held:
            raise Conflict("a bundle is imported into an empty organization only; this one already has "
                           + " and ".join(held), details={"holds": held})

    # -- one line ----------------------------------------------------------------------------------

    async def _line(self, number: int, line: bytes) -> None:
        if self.trailer is not None:
            raise _refuse(number, "nothing may follow the trailer")
        try:
            peek = _PEEK.decode(line)
        except msgspec.ValidationError:
            raise _refuse(number, "each line must be a JSON object with a \"type\"") from None
        except msgspec.DecodeError as exc:
            raise _refuse(number, f"not valid JSON ({str(exc)[:200]})") from None
        kind = peek.type
        if self.header is None:
            if kind != BUNDLE_TYPE:
                raise _refuse(number, f'not a Memex bundle: the first line must be its header ({{"type": "{BUNDLE_TYPE}", '
                                      '"version": 1, ...})')
            if peek.version != BUNDLE_VERSION or isinstance(peek.version, bool):
                raise _refuse(number, f"unsupported bundle version {str(peek.version)[:20]}; this service reads version "
                                      f"{BUNDLE_VERSION}", version=str(peek.version)[:20], supported=[BUNDLE_VERSION])
            self.header = self._decode(number, BUNDLE_TYPE, line)
            self.on_header(self.header)
            return
        if kind == BUNDLE_TYPE:
            raise _refuse(number, "a second header")
        if kind == "trailer":
            self._end_conversation()
            self.trailer = self._decode(number, "trailer", line)
            self._check_counts(number, self.trailer.counts)
            return
        if kind not in _SECTION:
            raise _refuse(number, f"unknown record type {str(kind)[:50]!r}", type=str(kind)[:50], known=list(RECORD_TYPES))
        section = _SECTION[kind]
        if section < self.section:
            raise _refuse(number, f"a {kind} record after the {self._section_name()} records: records come in the "
                                  "order " + ", ".join(RECORD_TYPES), type=kind)
        if section != 4:
            self._end_conversation()
        self.section = section
        record = self._decode(number, kind, line)
        self.read[kind] += 1
        self.unread += 1
        await getattr(self, f"_{kind}")(number, record)
        if len(self.org_batch.stmts) >= BATCH_STATEMENTS or self.org_batch.size >= BATCH_BYTES:
            await self._flush()
        if len(self.control_batch) >= BATCH_STATEMENTS:
            await self._flush_control()

    def _section_name(self) -> str:
        return next(t for t, s in _SECTION.items() if s == self.section)

    def _decode(self, number: int, kind: str, line: bytes) -> Any:
        try:
            return _DECODERS[kind].decode(line)
        except msgspec.ValidationError as exc:
            message, _, path = str(exc).partition(" - at `$")
            raise _refuse(number, f"{kind}: {message[:300]}", type=kind,
                          field=path.rstrip("`").lstrip(".")[:200] or None) from None
        except msgspec.DecodeError as exc:
            raise _refuse(number, f"not valid JSON ({str(exc)[:200]})") from None

    def _check_counts(self, number: int, counts: BundleCounts) -> None:
        claimed = msgspec.structs.asdict(counts)
        wrong = {k: {"trailer": claimed[k], "read": self.read[k]} for k in RECORD_TYPES if claimed[k] != self.read[k]}
        if wrong:
            raise _refuse(number, "the trailer's counts do not match the records read: the bundle is incomplete or "
                                  "was edited", counts=wrong)

    def _text(self, number: int, value: str, what: str, limit: int | None = None) -> bytes:
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:
            raise _refuse(number, f"{what} is not valid Unicode", field=what) from None
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
            raise _refuse(number, "content_hash is not the SHA-256 of content", field="content_hash")
        return digest

    def _source(self, number: int, source: str | None) -> None:
        if source is not None:
            self._text(number, source, "source")
            if len(source) > self.thought_limits.max_source_chars:
                raise _refuse(number, f"source is longer than {self.thought_limits.max_source_chars} characters",
                              field="source")

    @staticmethod
    def _tags(tags: list[str] | None) -> str | None:
        return None if tags is None else json.dumps(tags, ensure_ascii=False)

    # -- records -----------------------------------------------------------------------------------

    async def _thought(self, number: int, r: ThoughtRecord) -> None:
        if not r.content.strip():
            raise _refuse(number, "content must be a non-empty string", field="content")
        data = self._text(number, r.content, "content", self.thought_limits.max_content_bytes)
        digest = self._hash(number, data, r.content_hash)
        self._source(number, r.source)
        meta = self._metadata(number, r.metadata, self.thought_limits.max_metadata_bytes)

        def pieces() -> list[list]:
            texts = chunk_text(r.content, count_tokens=self.embedder.count_tokens, max_tokens=self.max_tokens,
                               overlap_tokens=self.overlap)
            return [[new_id(), i, p, self.embedder.count_tokens(p)] for i, p in enumerate(texts)]

        chunks = await anyio.to_thread.run_sync(pieces) if len(data) > 16 * 1024 else pieces()
        b = self.org_batch
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

    async def _thought_history(self, number: int, r: HistoryRecord) -> None:
        data = self._text(number, r.content, "content", self.thought_limits.max_content_bytes)
        digest = self._hash(number, data, r.content_hash)
        self._source(number, r.source)
        meta = self._metadata(number, r.metadata, self.thought_limits.max_metadata_bytes)
        b = self.org_batch
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

    async def _thought_link(self, number: int, r: LinkRecord) -> None:
        b = self.org_batch
        b.skips.append((len(b.stmts), "thought_link"))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO thought_links (organization_id, from_id, to_id, kind, reason, created_at) "
            "SELECT ?1, ?2, ?3, ?4, ?5, ?6 WHERE EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?2) "
            "AND EXISTS (SELECT 1 FROM documents WHERE organization_id = ?1 AND id = ?3) ON CONFLICT DO NOTHING",
            r.from_id, r.to_id, r.kind, r.reason, r.created_at,
        ))

    async def _conversation(self, number: int, r: ConversationRecord) -> None:
        self._end_conversation()
        if r.title is not None:
            self._text(number, r.title, "title")
            if len(r.title) > self.conversation_limits.max_title_chars:
                raise _refuse(number, f"title is longer than {self.conversation_limits.max_title_chars} characters",
                              field="title")
        meta = self._metadata(number, r.metadata, self.conversation_limits.max_metadata_bytes)
        self.conversation = _Conversation(r.id, number, r.message_count)
        b = self.org_batch
        b.journal.append(("conversation", r.id))
        b.checks.append((len(b.stmts), number, "conversation", r.id))
        b.stmts.append(self.sql.stmt(
            "INSERT INTO conversations (organization_id, id, title, metadata, message_count, last_sequence, created_at, "
            "updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?5, ?6, ?7) ON CONFLICT DO NOTHING",
            r.id, r.title, meta, r.message_count, r.created_at, r.updated_at,
        ))

    async def _message(self, number: int, r: MessageRecord) -> None:
        conv = self.conversation
        if conv is None or r.conversation_id != conv.id:
            raise _refuse(number, "a message must follow its conversation record (and that conversation's earlier "
                                  "messages)", field="conversation_id")
        if r.sequence != conv.seen + 1:
            raise _refuse(number, f"sequence {r.sequence} where {conv.seen + 1} was expected: a conversation's messages "
                                  "come in order, contiguous from 1", field="sequence")
        if r.sequence > conv.expected:
            raise _refuse(number, f"more messages than the conversation's message_count ({conv.expected})",
                          field="sequence")
        data = self._text(number, r.content, "content", self.conversation_limits.max_message_bytes)
        meta = self._metadata(number, r.metadata, self.conversation_limits.max_metadata_bytes)
        conv.seen = r.sequence
        conv.tail.append((r.sequence, r.role, r.content))
        # Windows of WINDOW messages with stride STRIDE (services.conversations.conversations): each written once, final.
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
        b = self.org_batch
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

    def _end_conversation(self) -> None:
        conv, self.conversation = self.conversation, None
        if conv is not None and conv.seen != conv.expected:
            raise _refuse(conv.line, f"the conversation has message_count {conv.expected} but {conv.seen} messages "
                                     "follow it", field="message_count", id=conv.id)

    async def _knowledge_base(self, number: int, r: KnowledgeBaseRecord) -> None:
        raise _refuse(number, "knowledge_base records are reserved: this service has no knowledge bases to restore "
                              "them into", type="knowledge_base")

    async def _key(self, number: int, r: KeyRecord) -> None:
        self.skipped["key"] += 1  # listed, never recreated: a key's secret cannot be exported

    async def _membership(self, number: int, r: MembershipRecord) -> None:
        if not _EMAIL.match(r.email) or r.email != r.email.strip().lower():
            raise _refuse(number, "email must be a lower-case address", field="email")
        self.control_batch.append((number, "membership", r))

    async def _service_token(self, number: int, r: ServiceTokenRecord) -> None:
        if not _COMMON_NAME.match(r.common_name):
            raise _refuse(number, "invalid common_name", field="common_name")
        self.control_batch.append((number, "service_token", r))

    # -- writing -----------------------------------------------------------------------------------

    async def _flush(self) -> None:
        b, self.org_batch = self.org_batch, _Pending()
        if not b.stmts:
            return
        for kind, ident in b.journal:  # noted before the write: a rollback deletes whatever of it landed
            self.journal.add(kind, ident)
        results = await self.sql.batch(b.stmts)
        for index, number, kind, ident in b.checks:
            if results[index].changes == 0:
                what = {"thought": "id or content", "message": "id, sequence or client_id"}.get(kind, "id")
                raise _refuse(number, f"this {kind} repeats an {what} already in the bundle ({ident})", type=kind,
                              id=ident)
            self.written[kind] += 1
        for index, kind in b.skips:
            if results[index].changes:
                self.written[kind] += 1
            else:  # a link whose thoughts are not both in the bundle (or a repeated link)
                self.skipped[kind] += 1
        self.progress(self.unread)
        self.unread = 0

    async def _flush_control(self) -> None:
        batch, self.control_batch = self.control_batch, []
        if not batch:
            return
        emails = [r.email for _, k, r in batch if k == "membership"]
        names = [r.common_name for _, k, r in batch if k == "service_token"]
        held = await self.control.batch([
            self.control.stmt("SELECT email AS k FROM memberships WHERE organization_id = ?1 AND email IN "
                              "(SELECT value FROM json_each(?2))", json.dumps(emails)),
            self.control.stmt("SELECT common_name AS k FROM service_tokens WHERE organization_id = ?1 AND common_name IN "
                              "(SELECT value FROM json_each(?2))", json.dumps(names)),
        ])
        existing = {("membership", r["k"]) for r in held[0].rows} | {("service_token", r["k"]) for r in held[1].rows}
        stmts, checks = [], []
        for number, kind, r in batch:
            ident = r.email if kind == "membership" else r.common_name
            if (kind, ident) in existing:
                self.skipped[kind] += 1  # the organization's own binding stays as it is
                continue
            self.journal.add(kind, ident)
            checks.append((number, kind, ident))
            if kind == "membership":
                stmts.append(self.control.stmt(
                    "INSERT INTO memberships (organization_id, email, role, created_at) VALUES (?1, ?2, ?3, ?4) "
                    "ON CONFLICT DO NOTHING", r.email, r.role, r.created_at))
            else:
                stmts.append(self.control.stmt(
                    "INSERT INTO service_tokens (organization_id, common_name, name, scopes, created_at) "
                    "VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
                    r.common_name, r.name, json.dumps(sorted(set(r.scopes))), r.created_at))
            existing.add((kind, ident))
        if not stmts:
            return
        results = await self.control.batch(stmts)
        for res, (number, kind, ident) in zip(results, checks):
            if res.changes == 0:
                raise _refuse(number, f"this {kind} repeats one already in the bundle ({ident})", type=kind)
            self.written[kind] += 1

    async def _enqueue_jobs(self) -> None:
        """The jobs a capture and an append queue, for every parent written: enrich (thoughts not enriched yet,
        first, so their tags go into the vectors' metadata), then embed."""
        now = now_ms()
        stmts: list[Statement] = []
        for kind, ids in self.journal.pages():
            if kind == "thought":
                stmts.append(self.sql.stmt(
                    "INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) SELECT ?1, ?2, id, ?3, ?3 "
                    "FROM documents WHERE organization_id = ?1 AND id IN (SELECT value FROM json_each(?4)) "
                    "AND enrichment_state IS NULL ORDER BY id", ENRICH_JOB, now, json.dumps(ids)))
            if kind in ("thought", "conversation"):
                parents = "documents" if kind == "thought" else "conversations"
                stmts += [enqueue_embed(self.sql, ident, now, only_if_parent_in=parents) for ident in ids]
            if len(stmts) >= BATCH_STATEMENTS:
                await self.sql.batch(stmts)
                stmts = []
        if stmts:
            await self.sql.batch(stmts)

    async def _rollback(self) -> None:
        """Delete what the journal lists: rows first (chunks, messages, keyword rows, links, jobs and tag counts
        follow by trigger), then the vectors of the chunks deleted (services.search.indexing.drop_vanished's rule)."""
        if not self.journal.size:
            return
        log.info("import into %s refused: rolling back the %d records it wrote", self.sql.org_id, self.journal.size)
        try:
            for kind, ids in self.journal.pages():
                arg = json.dumps(ids)
                if kind in ("thought", "conversation"):
                    table, kinds = ("documents", "('thought')") if kind == "thought" else ("conversations",
                                                                                          "('conversation', 'turn')")
                    res = await self.sql.batch([
                        self.sql.stmt(f"DELETE FROM chunks WHERE organization_id = ?1 AND kind IN {kinds} AND parent_id IN "
                                      "(SELECT value FROM json_each(?2)) RETURNING id", arg),
                        self.sql.stmt(f"DELETE FROM {table} WHERE organization_id = ?1 AND id IN "
                                      "(SELECT value FROM json_each(?2))", arg),
                    ])
                    await self.vectors.delete_by_ids([r["id"] for r in res[0].rows])
                elif kind == "thought_history":
                    await self.sql.execute("DELETE FROM thought_history WHERE organization_id = ?1 AND id IN "
                                           "(SELECT value FROM json_each(?2))", [arg])
                elif kind == "membership":
                    await self.control.execute("DELETE FROM memberships WHERE organization_id = ?1 AND email IN "
                                               "(SELECT value FROM json_each(?2))", [arg])
                elif kind == "service_token":
                    await self.control.execute("DELETE FROM service_tokens WHERE organization_id = ?1 AND common_name IN "
                                               "(SELECT value FROM json_each(?2))", [arg])
        except Exception:
            log.exception("rolling back the import into %s failed; delete the organization's imported rows by hand "
                          "or run the import again into a fresh organization", self.sql.org_id)
