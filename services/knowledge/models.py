"""Read models of knowledge bases: the knowledge base, its syncs, its entries and search hits (msgspec Structs,
shared by REST and MCP)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "Visibility", "Tier", "SourceOut", "KnowledgeBase", "KnowledgeBaseCreated", "SyncCounts", "FileError",
    "FileWarning", "UnresolvedLink", "Sync", "SyncPage", "EntrySummary", "EntryPage", "EntryLink", "Document",
    "KnowledgeHit", "KnowledgeSearchResult", "Term", "GroupInfo", "ReleaseInfo", "KnowledgeBaseList",
]

Visibility = Literal["private", "open", "public", "members"]
Tier = Literal["open", "public", "members"]


class SourceOut(msgspec.Struct, omit_defaults=True):
    type: Literal["git", "upload"]
    url: str | None = None
    branch: str | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    #: Whether a token is stored (the token itself is write-only).
    has_token: bool = False


class SyncCounts(msgspec.Struct):
    added: int = 0
    updated: int = 0
    deleted: int = 0
    unchanged: int = 0
    skipped: int = 0
    failed: int = 0


class FileError(msgspec.Struct):
    path: str
    reason: str


class FileWarning(msgspec.Struct):
    path: str
    field: str
    reason: str


class UnresolvedLink(msgspec.Struct):
    path: str
    target: str


class Sync(msgspec.Struct):
    id: str
    knowledge_base_id: str
    state: Literal["queued", "running", "succeeded", "failed"]
    trigger: str
    mode: str | None
    commit: str | None
    base_commit: str | None
    counts: SyncCounts
    files_total: int | None
    files_done: int
    created_at: int
    started_at: int | None
    finished_at: int | None
    #: Why the whole sync failed (the source could not be fetched...); per-file errors never fail a sync.
    error: str | None = None
    errors: list[FileError] = []
    #: Fields dropped by validation from entries that were kept.
    warnings: list[FileWarning] = []
    unresolved_links: list[UnresolvedLink] = []
    #: Files skipped as unpublished or draft, with why.
    skipped: list[FileError] = []


class SyncPage(msgspec.Struct):
    syncs: list[Sync]


class KnowledgeBase(msgspec.Struct):
    id: str
    slug: str
    name: str
    visibility: Visibility
    document_tier: Tier
    source: SourceOut
    ontology: dict[str, Any]
    #: Entries, their chunks, and the chunks searchable by meaning (embedded and visible in the vector index; every
    #: chunk is keyword-searchable as soon as its sync batch commits).
    entries: int
    chunks: int
    chunks_searchable: int
    last_commit: str | None
    last_synced_at: int | None
    #: The most recent sync (queued, running or finished).
    last_sync: Sync | None
    created_at: int
    updated_at: int
    #: Where GitHub posts pushes (relative to the service's URL), and the public surfaces.
    webhook_path: str
    mcp_path: str
    api_path: str


class KnowledgeBaseCreated(KnowledgeBase):
    #: The webhook secret, shown once (at creation and on rotation).
    webhook_secret: str = ""
    #: The first sync, queued at creation for a git source.
    sync: Sync | None = None


class KnowledgeBaseList(msgspec.Struct):
    knowledge_bases: list[KnowledgeBase]


class EntrySummary(msgspec.Struct, rename="camel"):
    id: str
    content_type: str
    title: str
    path: str
    description: str | None = None
    group: str | None = None
    release: str | None = None
    status: str | None = None
    tags: list[str] = []
    date: int | None = None
    synced_at: int = 0


class EntryPage(msgspec.Struct):
    entries: list[EntrySummary]
    total: int
    limit: int
    offset: int


class EntryLink(msgspec.Struct, rename="camel"):
    id: str
    label: str | None = None
    resolved: bool = True
    content_type: str | None = None
    title: str | None = None


class Document(msgspec.Struct, rename="camel"):
    """A full entry: the seed's R2Document (id, contentType, path, metadata, content, syncedAt, commitSha) plus
    the link graph."""

    id: str
    content_type: str
    path: str
    title: str
    metadata: dict[str, Any]
    content: str
    synced_at: int
    commit_sha: str | None
    links: list[EntryLink] = []
    backlinks: list[EntryLink] = []
    issues: list[list[str]] = []


class KnowledgeHit(msgspec.Struct, rename="camel", omit_defaults=True):
    id: str
    content_type: str
    title: str
    path: str
    score: float
    description: str | None = None
    group: str | None = None
    release: str | None = None
    tags: list[str] = []
    #: The passage that matched (a chunk of the entry).
    snippet: str = ""
    #: The reranker's score, when a reranker is configured.
    rerank_score: float | None = None
    document: Document | None = None


class KnowledgeSearchResult(msgspec.Struct):
    query: str
    results: list[KnowledgeHit]


class Term(msgspec.Struct):
    id: str
    title: str
    definition: str
    aliases: list[str] = []
    related_terms: list[str] = []


class GroupInfo(msgspec.Struct, omit_defaults=True):
    group: str
    entries: int
    id: str | None = None
    title: str | None = None
    description: str | None = None


class ReleaseInfo(msgspec.Struct, omit_defaults=True):
    id: str
    path: str
    title: str
    entries: int
    description: str | None = None
    date: int | None = None
    parent: str | None = None
