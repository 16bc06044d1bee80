"""The bundle's records: one organization's data as versioned JSON Lines (docs/export-bundle.md).

A bundle is a header (``{"type": "memex.bundle", "version": 1, ...}``), then one record per line in sections:
the thoughts, their history entries and links, each conversation followed by its messages, knowledge bases
(reserved), the keys' metadata (never a hash or a secret), the Access bindings (memberships, service tokens),
and a trailer whose counts make a truncated bundle detectable. ``services.bundle.export`` writes them,
``services.bundle.importer`` reads them back.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from services.storage.migrate import ORG_DIR, discover
from services.text.temporal import MAX_MS

__all__ = [
    "BUNDLE_TYPE", "BUNDLE_VERSION", "MEDIA_TYPE", "RECORD_TYPES", "MAX_LINE_BYTES", "BundleCounts",
    "BundleOrganization", "Header", "Trailer", "ThoughtRecord", "HistoryRecord", "LinkRecord", "ConversationRecord",
    "MessageRecord", "KnowledgeBaseRecord", "KeyRecord", "MembershipRecord", "ServiceTokenRecord", "ImportResult",
    "latest_schema",
]

BUNDLE_TYPE = "memex.bundle"
BUNDLE_VERSION = 1
MEDIA_TYPE = "application/x-ndjson"
#: Record types in the order their sections appear (a conversation's messages follow it).
RECORD_TYPES = ("thought", "thought_history", "thought_link", "conversation", "message", "knowledge_base", "key",
                "membership", "service_token")
#: The longest line an import reads (a 256 KiB thought escaped as JSON fits many times over).
MAX_LINE_BYTES = 8 * 1024 * 1024
#: Each record type's section: sections come in this order (a conversation and its messages share one).
SECTION = {"thought": 1, "thought_history": 2, "thought_link": 3, "conversation": 4, "message": 4,
            "knowledge_base": 5, "key": 6, "membership": 7, "service_token": 8}

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Ms = Annotated[int, msgspec.Meta(ge=0, le=MAX_MS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
Tag = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
Scope = Literal["read", "write", "admin"]


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


#: A decoder per record type (the header's type is BUNDLE_TYPE).
DECODERS = {
    cls.__struct_config__.tag: msgspec.json.Decoder(cls)
    for cls in (Header, Trailer, ThoughtRecord, HistoryRecord, LinkRecord, ConversationRecord, MessageRecord,
                KnowledgeBaseRecord, KeyRecord, MembershipRecord, ServiceTokenRecord)
}


class _Peek(msgspec.Struct):
    type: Any = None
    version: Any = None


#: Reads a line's type (and version) before the whole record is decoded.
PEEK = msgspec.json.Decoder(_Peek)
ENCODER = msgspec.json.Encoder()


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
