"""Import (``BundleImport``): restore a bundle into an organization that has no thoughts, conversations or history
entries.

The body is read incrementally, line by line; records are validated as they come (in the order of their
sections, counted against the trailer) and written in batches (``services.bundle.rows`` makes each record's
statements). Refusal changes nothing: every id written is first noted in a journal (a temporary file, so a large
import does not hold its ids in memory), and any failure (a malformed or out-of-order line, a repeated id, a
missing or wrong trailer, a store error, a disconnect) deletes what the journal lists (rows first, then any
vector) before the error is raised. Embedding and enrichment jobs are queued only once the whole bundle has been
read and written, so nothing is embedded before the import is known to succeed; the caller then wakes the worker.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import anyio
import msgspec

from services.bundle.records import (
    BUNDLE_TYPE, BUNDLE_VERSION, DECODERS, ENCODER, MAX_LINE_BYTES, PEEK, RECORD_TYPES, SECTION, BundleCounts, Header,
    ImportResult, KeyRecord, KnowledgeBaseRecord, MembershipRecord, ServiceTokenRecord, Trailer,
)
from services.bundle.rows import Pending, Rows, refuse
from services.conversations.append import ConversationLimits
from services.enrichment.enrichment import ENRICH_JOB
from services.errors import Conflict, InvalidInput
from services.ids import now_ms
from services.ports import Embedder, Statement
from services.search.indexing import enqueue_embed
from services.storage.scoped import OrgSql, OrgVectors
from services.thoughts.thoughts import ThoughtLimits

__all__ = ["BundleImport", "BATCH_STATEMENTS", "BATCH_BYTES"]

log = logging.getLogger("memex.bundle")

#: A batch is written when it holds this many statements or this many bytes of content.
BATCH_STATEMENTS = 200
BATCH_BYTES = 1024 * 1024
_JOURNAL_PAGE = 200
#: The record types that are the organization's own data (``Rows``); the others go to the control database.
_ROWS = ("thought", "thought_history", "thought_link", "conversation", "message")
_EMAIL = re.compile(r"^[^@ \t\r\n]{1,64}@[^@ \t\r\n]{1,255}$")
_COMMON_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


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
                raise refuse(number, f"the line is longer than {limit} bytes", limit=limit)
            yield number, bytes(buf[start:end])
            start = end + 1
        del buf[:start]
        if len(buf) > limit:
            raise refuse(number + 1, f"the line is longer than {limit} bytes", limit=limit)
    if buf:
        yield number + 1, bytes(buf)


class _Journal:
    """What an import wrote, as (kind, id) lines in a temporary file: what a rollback deletes."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile(prefix="memex-import-")
        self.size = 0

    def add(self, kind: str, ident: str) -> None:
        self.file.write(ENCODER.encode([kind, ident]) + b"\n")
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
        self.rows = Rows(sql, embedder, thought_limits=thought_limits, conversation_limits=conversation_limits)
        self.header: Header | None = None
        self.trailer: Trailer | None = None
        self.section = 0
        self.read = dict.fromkeys(RECORD_TYPES, 0)
        self.written = dict.fromkeys(RECORD_TYPES, 0)
        self.skipped = dict.fromkeys(RECORD_TYPES, 0)
        self.org_batch = Pending()
        self.control_batch: list[tuple[int, str, MembershipRecord | ServiceTokenRecord]] = []
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
                    raise refuse(last, "the bundle ends without its trailer: it is truncated", truncated=True)
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
            raise refuse(number, "nothing may follow the trailer")
        try:
            peek = PEEK.decode(line)
        except msgspec.ValidationError:
            raise refuse(number, "each line must be a JSON object with a \"type\"") from None
        except msgspec.DecodeError as exc:
            raise refuse(number, f"not valid JSON ({str(exc)[:200]})") from None
        kind = peek.type
        if self.header is None:
            if kind != BUNDLE_TYPE:
                raise refuse(number, f'not a Memex bundle: the first line must be its header ({{"type": "{BUNDLE_TYPE}", '
                                      '"version": 1, ...})')
            if peek.version != BUNDLE_VERSION or isinstance(peek.version, bool):
                raise refuse(number, f"unsupported bundle version {str(peek.version)[:20]}; this service reads version "
                                      f"{BUNDLE_VERSION}", version=str(peek.version)[:20], supported=[BUNDLE_VERSION])
            self.header = self._decode(number, BUNDLE_TYPE, line)
            self.on_header(self.header)
            return
        if kind == BUNDLE_TYPE:
            raise refuse(number, "a second header")
        if kind == "trailer":
            self.rows.end_conversation()
            self.trailer = self._decode(number, "trailer", line)
            self._check_counts(number, self.trailer.counts)
            return
        if kind not in SECTION:
            raise refuse(number, f"unknown record type {str(kind)[:50]!r}", type=str(kind)[:50], known=list(RECORD_TYPES))
        section = SECTION[kind]
        if section < self.section:
            raise refuse(number, f"a {kind} record after the {self._section_name()} records: records come in the "
                                  "order " + ", ".join(RECORD_TYPES), type=kind)
        if section != 4:
            self.rows.end_conversation()
        self.section = section
        record = self._decode(number, kind, line)
        self.read[kind] += 1
        self.unread += 1
        if kind in _ROWS:  # the organization's own data
            await getattr(self.rows, kind)(self.org_batch, number, record)
        else:
            await getattr(self, f"_{kind}")(number, record)
        if len(self.org_batch.stmts) >= BATCH_STATEMENTS or self.org_batch.size >= BATCH_BYTES:
            await self._flush()
        if len(self.control_batch) >= BATCH_STATEMENTS:
            await self._flush_control()

    def _section_name(self) -> str:
        return next(t for t, s in SECTION.items() if s == self.section)

    def _decode(self, number: int, kind: str, line: bytes) -> Any:
        try:
            return DECODERS[kind].decode(line)
        except msgspec.ValidationError as exc:
            message, _, path = str(exc).partition(" - at `$")
            raise refuse(number, f"{kind}: {message[:300]}", type=kind,
                          field=path.rstrip("`").lstrip(".")[:200] or None) from None
        except msgspec.DecodeError as exc:
            raise refuse(number, f"not valid JSON ({str(exc)[:200]})") from None

    def _check_counts(self, number: int, counts: BundleCounts) -> None:
        claimed = msgspec.structs.asdict(counts)
        wrong = {k: {"trailer": claimed[k], "read": self.read[k]} for k in RECORD_TYPES if claimed[k] != self.read[k]}
        if wrong:
            raise refuse(number, "the trailer's counts do not match the records read: the bundle is incomplete or "
                                  "was edited", counts=wrong)

    # -- records -----------------------------------------------------------------------------------

    async def _knowledge_base(self, number: int, r: KnowledgeBaseRecord) -> None:
        raise refuse(number, "knowledge_base records are reserved: this service has no knowledge bases to restore "
                              "them into", type="knowledge_base")

    async def _key(self, number: int, r: KeyRecord) -> None:
        self.skipped["key"] += 1  # listed, never recreated: a key's secret cannot be exported

    async def _membership(self, number: int, r: MembershipRecord) -> None:
        if not _EMAIL.match(r.email) or r.email != r.email.strip().lower():
            raise refuse(number, "email must be a lower-case address", field="email")
        self.control_batch.append((number, "membership", r))

    async def _service_token(self, number: int, r: ServiceTokenRecord) -> None:
        if not _COMMON_NAME.match(r.common_name):
            raise refuse(number, "invalid common_name", field="common_name")
        self.control_batch.append((number, "service_token", r))

    # -- writing -----------------------------------------------------------------------------------

    async def _flush(self) -> None:
        b, self.org_batch = self.org_batch, Pending()
        if not b.stmts:
            return
        for kind, ident in b.journal:  # noted before the write: a rollback deletes whatever of it landed
            self.journal.add(kind, ident)
        results = await self.sql.batch(b.stmts)
        for index, number, kind, ident in b.checks:
            if results[index].changes == 0:
                what = {"thought": "id or content", "message": "id, sequence or client_id"}.get(kind, "id")
                raise refuse(number, f"this {kind} repeats an {what} already in the bundle ({ident})", type=kind,
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
        for res, (number, kind, ident) in zip(results, checks, strict=True):
            if res.changes == 0:
                raise refuse(number, f"this {kind} repeats one already in the bundle ({ident})", type=kind)
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
