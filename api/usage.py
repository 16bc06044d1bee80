"""``GET /v1/usage``: what the caller's organization holds and spends, and the limits that apply to it (the console's
"usage and limits" page). Cheap on purpose: one statement of counts over the organization's own database (the
keyword index is never scanned), one row of the control database's ``llm_usage``, and the sizes of the
organization's files where the backend keeps them on this machine."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from litestar import Request, get

from api.errors import error_responses
from api.limits import MAX_ARCHIVE_BYTES, MAX_BATCH_BODY_BYTES, MAX_BODY_BYTES, MAX_IMPORT_BYTES
from api.routes import AUTH_ERRORS, READ
from api.schemas import CaptureBatchIn
from api.wiring import Memex
from services.conversations.models import MAX_MESSAGES_PER_APPEND
from services.enrichment.llm_budget import utc_day
from services.storage.scoped import OrgSql
from services.storage.stores import EmbeddedOrgStores
from tenancy.models import AuthContext

__all__ = ["usage_handlers", "UsageOut"]


class UsageCounts(msgspec.Struct):
    thoughts: int
    #: Indexed passages of thoughts, conversations and knowledge entries together.
    chunks: int
    conversations: int
    messages: int
    knowledge_bases: int
    knowledge_entries: int
    #: Background jobs (embedding, enrichment, knowledge syncs) waiting to run.
    pending_jobs: int


class UsageStorage(msgspec.Struct):
    #: Bytes of the organization's database files (with its write-ahead log); null where the backend does not
    #: say (D1).
    database_bytes: int | None
    #: Bytes of the organization's vector file; null where the backend does not say (Vectorize).
    vector_bytes: int | None


class LlmUsage(msgspec.Struct):
    #: Whether a language model is configured (MEMEX_LLM); with none, nothing is ever spent.
    configured: bool
    #: The UTC day these counters are for (budgets reset at midnight UTC).
    day: str
    calls: int
    tokens: int
    #: Calls refused today because the budget was spent.
    refused: int
    calls_per_day: int
    tokens_per_day: int


class UsageLimits(msgspec.Struct):
    #: Largest request body, in bytes (most routes).
    max_request_body_bytes: int
    #: Largest body of POST /v1/thoughts:batch.
    max_batch_body_bytes: int
    #: Largest organization bundle for POST /v1/org/import.
    max_import_bytes: int
    #: Largest knowledge base archive for POST /v1/knowledge-bases/{kb}/import.
    max_archive_bytes: int
    #: Largest thought, in bytes of UTF-8.
    max_content_bytes: int
    #: Largest metadata object, in bytes of its JSON.
    max_metadata_bytes: int
    #: Most thoughts in one batch capture.
    max_batch_items: int
    #: Most messages in one conversation append.
    max_messages_per_append: int
    #: Requests one credential (this API key, an Access user or service token) may make per minute.
    credential_requests_per_minute: int
    #: Requests the whole organization may make per minute, all its credentials together.
    organization_requests_per_minute: int


class UsageOut(msgspec.Struct):
    organization_id: str
    counts: UsageCounts
    storage: UsageStorage
    llm: LlmUsage
    limits: UsageLimits


_COUNTS = (
    "SELECT (SELECT COUNT(*) FROM documents WHERE organization_id = ?1) AS thoughts, "
    "(SELECT COUNT(*) FROM chunks WHERE organization_id = ?1) AS chunks, "
    "(SELECT COUNT(*) FROM conversations WHERE organization_id = ?1) AS conversations, "
    "(SELECT COALESCE(SUM(message_count), 0) FROM conversations WHERE organization_id = ?1) AS messages, "
    "(SELECT COUNT(*) FROM knowledge_bases WHERE organization_id = ?1) AS knowledge_bases, "
    "(SELECT COUNT(*) FROM knowledge_entries WHERE organization_id = ?1) AS knowledge_entries, "
    "(SELECT COUNT(*) FROM jobs WHERE organization_id = ?1 AND state = 'pending') AS pending_jobs"
)


#: Most items of a batch capture, as CaptureBatchIn declares it.
_BATCH_ITEMS: int = next(f.type.max_length for f in msgspec.inspect.type_info(CaptureBatchIn).fields  # type: ignore[attr-defined]
                         if f.name == "items")


def _size(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


async def _storage(memex: Memex, org_id: str) -> UsageStorage:
    stores = memex.stores
    if not isinstance(stores, EmbeddedOrgStores):
        return UsageStorage(None, None)
    route = await stores.routing.get(org_id)
    if route is None:
        return UsageStorage(None, None)
    d = stores.root / route["location"]
    db = _size(d / "memex.sqlite3", d / "memex.sqlite3-wal")
    vectors = _size(d / "vectors.sqlite3", d / "vectors.sqlite3-wal") if memex.settings.vectors == "local" else None
    return UsageStorage(db, vectors)


async def _llm(memex: Memex, org_id: str) -> LlmUsage:
    day = utc_day(time.time())
    row = await OrgSql(memex.control, org_id).one(
        "SELECT calls, tokens, refused FROM llm_usage WHERE organization_id = ?1 AND day = ?2", [day]) or {}
    budget = memex.llm_budget
    return LlmUsage(configured=memex.backend.llm is not None, day=day, calls=row.get("calls") or 0,
                    tokens=row.get("tokens") or 0, refused=row.get("refused") or 0,
                    calls_per_day=budget.calls_per_day, tokens_per_day=budget.tokens_per_day)


def _limits(memex: Memex) -> UsageLimits:
    s = memex.settings
    return UsageLimits(
        max_request_body_bytes=MAX_BODY_BYTES, max_batch_body_bytes=MAX_BATCH_BODY_BYTES,
        max_import_bytes=MAX_IMPORT_BYTES, max_archive_bytes=MAX_ARCHIVE_BYTES,
        max_content_bytes=s.max_content_bytes, max_metadata_bytes=s.max_metadata_bytes,
        max_batch_items=_BATCH_ITEMS, max_messages_per_append=MAX_MESSAGES_PER_APPEND,
        credential_requests_per_minute=s.key_rate_per_minute, organization_requests_per_minute=s.org_rate_per_minute,
    )


@get("/v1/usage", operation_id="getUsage", tags=["usage"], guards=[READ], responses=error_responses(*AUTH_ERRORS),
     summary="The organization's usage and the limits that apply to it",
     description="Counts of what the caller's organization stores (thoughts, their indexed chunks, conversations and "
                 "messages, knowledge bases and entries) and its pending background jobs; the bytes its database "
                 "and vector files take where this deployment keeps them on disk (null on Cloudflare D1 and "
                 "Vectorize); today's language-model calls and tokens against the daily budget; and the limits "
                 "that apply: request body sizes, content and metadata sizes, batch sizes, and requests per minute "
                 "per credential and per organization. Needs the read scope.")
async def usage(request: Request) -> UsageOut:
    memex: Memex = request.app.state.memex
    ctx: AuthContext = request.user
    store = await memex.stores.open(ctx.org_id)
    counts = await store.sql.one(_COUNTS) or {}
    return UsageOut(
        organization_id=ctx.org_id,
        counts=UsageCounts(**{f: int(counts.get(f) or 0) for f in UsageCounts.__struct_fields__}),
        storage=await _storage(memex, ctx.org_id),
        llm=await _llm(memex, ctx.org_id),
        limits=_limits(memex),
    )


usage_handlers = [usage]
