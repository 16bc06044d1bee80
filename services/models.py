"""Domain values the services return (msgspec Structs, also used as the API's read models), and the rule for the
free-form ``metadata`` object a thought, a conversation or a message carries (``check_metadata``)."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from services.errors import InvalidInput, PayloadTooLarge

__all__ = [
    "ChunkView",
    "IndexingState",
    "Thought",
    "ThoughtDetail",
    "CaptureResult",
    "ItemError",
    "BatchItem",
    "BatchCaptureResult",
    "ThoughtPage",
    "SearchHit",
    "SearchResult",
    "Decision",
    "DecisionAction",
    "HistoryEntry",
    "ThoughtHistory",
    "ThoughtLink",
    "check_metadata",
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
    #: 1 (trivial) - 5 (critical), from enrichment; null until enriched (or when enrichment failed).
    importance: int | None = None
    #: How summary, tags and importance were made: ``llm``, ``extractive`` (no model configured), ``failed``
    #: or ``skipped_budget`` (fields empty; the backfill retries), or null while the enrichment is pending.
    enrichment: str | None = None
    #: Deliberate uses (fetched by id, marked used; never search results), and when the last one was (epoch ms).
    #: Recorded in the background: a use shows here within about a second.
    uses: int = 0
    last_used_at: int | None = None
    #: The write-time decision about this thought (``pending`` until the worker has made it); null when none was made.
    decision: "Decision | None" = None


class ThoughtLink(msgspec.Struct, kw_only=True):
    """A relation recorded at write time, shown on both thoughts."""

    #: The other thought.
    thought_id: str
    kind: Literal["contradicts"]
    #: ``outgoing``: this thought (the newer one) contradicts the other; ``incoming``: the other contradicts it.
    direction: Literal["outgoing", "incoming"]
    reason: str | None
    created_at: int


class HistoryEntry(msgspec.Struct, kw_only=True):
    """An original superseded by a merge or a replace: kept, restorable, until purged."""

    id: str
    #: The canonical thought that superseded it (it may have been deleted since).
    thought_id: str
    #: The original thought's id; null for a merge's incoming content, which was never stored on its own.
    original_id: str | None
    action: Literal["merged", "replaced"]
    reason: str | None
    content: str
    content_hash: str
    source: str | None
    metadata: dict[str, Any]
    summary: str | None
    tags: list[str]
    original_created_at: int
    original_updated_at: int
    #: When it moved to the history.
    created_at: int


class ThoughtHistory(msgspec.Struct, kw_only=True):
    thought_id: str
    #: Newest first.
    entries: list[HistoryEntry]


class ThoughtDetail(Thought, kw_only=True):
    chunks: list[ChunkView]
    indexing: IndexingState
    #: Contradiction links to and from this thought.
    links: list[ThoughtLink] = []
    #: The originals this thought superseded (merged or replaced), newest first; see /history.
    history: list[HistoryEntry] = []


#: ``pending``: the capture was acknowledged before its decision, which the job worker makes when it embeds the thought
#: (the thought's ``decision`` shows the outcome then).
DecisionAction = Literal["pending", "created", "duplicate", "flagged", "merged", "replaced", "contradiction", "kept_both"]


class Decision(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the write-time decision did with a capture (memory-layer-lessons' similarity bands)."""

    action: DecisionAction
    #: The existing thought the decision concerns (the duplicate, the flagged candidate, the contradicted,
    #: replaced or merged one).
    related_id: str | None = None
    reason: str | None = None
    #: Cosine similarity of the new content to ``related_id`` (or to the best candidate).
    similarity: float | None = None


class CaptureResult(msgspec.Struct, kw_only=True):
    id: str
    #: True when this call stored new content; False when the same content was already there.
    created: bool
    content_hash: str
    chunks: int
    indexing: IndexingState
    created_at: int
    updated_at: int
    decision: Decision = msgspec.field(default_factory=lambda: Decision(action="created"))


class ItemError(msgspec.Struct):
    code: str
    message: str
    details: dict[str, Any]


class BatchItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item of a batch capture: its place in the request, the status a single capture would have answered
    (201 stored, 200 already there, 4xx refused), and the capture's result or the error."""

    index: int
    status: int
    result: CaptureResult | None = None
    error: ItemError | None = None


class BatchCaptureResult(msgspec.Struct, kw_only=True):
    results: list[BatchItem]
    created: int
    existing: int
    failed: int


class ThoughtPage(msgspec.Struct, kw_only=True):
    thoughts: list[Thought]
    #: Pass as ``before`` (and ``before_id``) to get the next page; null on the last page.
    next_before: int | None
    next_before_id: str | None


class SearchHit(msgspec.Struct, kw_only=True, omit_defaults=True, dict=True):
    """A search result. ``dict=True``: a hit may carry undeclared private attributes that are never encoded (the
    thought hydrator hands the ranking stage the features it read with the hit, ``RANKING_FEATURES``)."""

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
    #: The id of the message at best_sequence (the message this hit is about).
    message_id: str | None = None
    messages: list[dict[str, Any]] | None = None
    explain: dict[str, Any] | None = None


class SearchResult(msgspec.Struct, kw_only=True):
    query: str
    results: list[SearchHit]


def check_metadata(metadata: Any, limit: int) -> str:
    """``metadata`` as the JSON text stored (``{}`` for None); refused unless it is an object of at most ``limit``
    bytes."""
    if metadata is None:
        return "{}"
    if not isinstance(metadata, dict):
        raise InvalidInput("metadata must be a JSON object", details={"field": "metadata"})
    encoded = json.dumps(metadata, ensure_ascii=False, separators=(",", ":"))
    if len(encoded.encode()) > limit:
        raise PayloadTooLarge(f"metadata is larger than {limit} bytes", details={"field": "metadata", "limit": limit})
    return encoded
