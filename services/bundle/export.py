"""Export (``BundleExport``): an organization's bundle, read from its database page by page (keyset pagination,
never the whole organization in memory), a record per line: a header, the thoughts, their history entries and
links, each conversation followed by its messages (decompressed), the keys' metadata (never a hash or a
secret), the Access bindings, and a trailer whose counts make a truncated download detectable.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio.to_thread

from services.bundle.records import (
    BUNDLE_VERSION, ENCODER, RECORD_TYPES, BundleCounts, BundleOrganization, ConversationRecord, Header,
    HistoryRecord, KeyRecord, LinkRecord, MembershipRecord, MessageRecord, ServiceTokenRecord, ThoughtRecord,
    Trailer, latest_schema,
)
from services.conversations.messages import message_from_row
from services.ids import now_ms
from services.storage.scoped import OrgSql

__all__ = ["BundleExport", "EXPORT_PAGE"]

#: Rows read per page (a page of thoughts is at most this many times the largest thought).
EXPORT_PAGE = 100


def _loads(text: str | None, default: Any) -> Any:
    return json.loads(text) if text else default


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
        yield ENCODER.encode(header) + b"\n"
        for source in (self._thoughts, self._history, self._links, self._conversations, self._keys, self._members,
                       self._tokens):
            async for records in source():
                for r in records:
                    self.counts[r.__struct_config__.tag] += 1
                self.progress(len(records))
                yield b"".join(ENCODER.encode(r) + b"\n" for r in records)
        yield ENCODER.encode(Trailer(counts=BundleCounts(**self.counts))) + b"\n"

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
