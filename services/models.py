"""Domain values the services return (msgspec Structs, also used as the API's read models)."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "ChunkView",
    "IndexingState",
    "Thought",
    "ThoughtDetail",
    "CaptureResult",
    "ThoughtPage",
    "SearchHit",
    "SearchResult",
]


class ChunkView(msgspec.Struct, kw_only=True):
    id: str
    ordinal: int
    content: str
    token_count: int
    indexed: bool


class IndexingState(msgspec.Struct, kw_only=True):
    #: ``indexed`` when every chunk's vector is searchable; ``pending`` while the worker has some to embed.
    state: str
    chunks_total: int
    chunks_indexed: int


class Thought(msgspec.Struct, kw_only=True):
    id: str
    content: str
    content_hash: str
    source: str | None
    metadata: dict[str, Any]
    summary: str | None
    tags: list[str]
    created_at: int
    updated_at: int


class ThoughtDetail(Thought, kw_only=True):
    chunks: list[ChunkView]
    indexing: IndexingState


class CaptureResult(msgspec.Struct, kw_only=True):
    id: str
    #: True when this call stored new content; False when the same content was already there.
    created: bool
    content_hash: str
    chunks: int
    indexing: IndexingState
    created_at: int
    updated_at: int


class ThoughtPage(msgspec.Struct, kw_only=True):
    thoughts: list[Thought]
    #: Pass as ``before`` (and ``before_id``) to get the next page; null on the last page.
    next_before: int | None
    next_before_id: str | None


class SearchHit(msgspec.Struct, kw_only=True, omit_defaults=True):
    kind: str
    document_id: str
    chunk_id: str
    chunk_content: str
    score: float
    summary: str | None = None
    tags: list[str] = []
    source: str | None = None
    metadata: dict[str, Any] = {}
    created_at: int = 0
    document_content: str | None = None
    # conversation hits
    conversation_id: str | None = None
    start_sequence: int | None = None
    end_sequence: int | None = None
    best_sequence: int | None = None
    messages: list[dict[str, Any]] | None = None
    explain: dict[str, Any] | None = None


class SearchResult(msgspec.Struct, kw_only=True):
    query: str
    results: list[SearchHit]
