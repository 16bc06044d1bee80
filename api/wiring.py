"""The one module that chooses adapters from settings and hands out organization-bound services."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import httpx

from api.settings import Settings
from services.errors import InvalidInput
from services.migrate import apply_pending
from services.ports import LLM, Embedder, Reranker, SqlDatabase, VectorIndex
from services.scoped import OrgSql, OrgVectors
from services.conversation_search import ConversationHydrator
from services.conversations import ConversationLimits, Conversations, KeyedLocks
from services.enrichment import ENRICH_JOB, Enricher, EnrichmentConfig, enrich_job_handler
from services.llm_budget import BudgetedLLM, LLMBudget
from services.decisions import Decisions
from services.ranking import Ranking, RankingConfig, UseRecorder, RerankCache
from services.recent_vectors import RecentVectors, cached_embed_handler
from services.search import Search, hydrate_thoughts
from services.thoughts import ThoughtLimits, Thoughts
from services.worker import JobWorker, reconcile_org
from tenancy.addresses import ClientAddresses
from tenancy.auth import AuthLimits, Authenticator
from tenancy.bindings import OrgBindings
from tenancy.keys import KeyManager, OrgKeys
from tenancy.models import AuthContext
from tenancy.orgs import OrgDirectory
from tenancy.ratelimit import Limit, RateLimits

__all__ = ["Backend", "Memex", "OrgServices", "build_backend"]

log = logging.getLogger("memex")


@dataclass
class Backend:
    db: SqlDatabase
    index: VectorIndex
    embedder: Embedder
    http: httpx.AsyncClient | None = None
    index_was_reset: bool = False
    #: The language model (MEMEX_LLM); None = none configured: enrichment and decisions run deterministically.
    llm: LLM | None = None
    #: The second-stage reranker (MEMEX_RERANKER); None = none.
    reranker: Reranker | None = None

    def cloudflare_stats(self) -> dict | None:
        """Requests, retries and the request budget of the Cloudflare adapters (None on the embedded backend)."""
        if self.http is None:
            return None
        from services.adapters.cloudflare import cloudflare_stats

        return cloudflare_stats(self.http)

    async def close(self) -> None:
        for model in (self.llm, self.reranker):
            aclose = getattr(model, "aclose", None)
            if aclose is not None:
                await aclose()
        await self.index.close()
        await self.db.close()
        if self.http is not None:
            await self.http.aclose()


def _embedder(settings: Settings, http: httpx.AsyncClient | None) -> Embedder:
    if settings.embedder == "local":
        from services.adapters.onnx_embedder import OnnxMiniLMEmbedder

        return OnnxMiniLMEmbedder()
    if settings.embedder == "hash":
        from services.adapters.hash_embedder import HashEmbedder

        return HashEmbedder()
    if settings.embedder == "workers-ai":
        from services.adapters.cloudflare import workers_ai_embedder

        return workers_ai_embedder(settings, http)
    raise InvalidInput(f"unknown MEMEX_EMBEDDER {settings.embedder!r}")


def build_backend(settings: Settings) -> Backend:
    cloud = ("d1" in settings.sql or settings.vectors == "vectorize" or settings.embedder == "workers-ai"
             or settings.llm == "workers-ai" or settings.reranker == "workers-ai")
    http = None
    if cloud:
        from services.adapters.cloudflare import shared_client

        http = shared_client(settings)
    embedder = _embedder(settings, http)
    if settings.sql == "sqlite":
        from services.adapters.sqlite import SqliteDatabase

        db: SqlDatabase = SqliteDatabase(settings.sqlite_path)
    elif settings.sql == "d1":
        from services.adapters.cloudflare import d1_database

        db = d1_database(settings, http)
    else:
        raise InvalidInput(f"unknown MEMEX_SQL {settings.sql!r}")
    reset = False
    if settings.vectors == "local":
        from services.adapters.local_vectors import LocalVectorIndex

        index: VectorIndex = LocalVectorIndex(
            settings.vectors_path, dimensions=embedder.dimensions, model=embedder.model_id, reset_on_mismatch=True
        )
        reset = index.was_reset
    elif settings.vectors == "vectorize":
        from services.adapters.cloudflare import vectorize_index

        index = vectorize_index(settings, http, embedder)
    else:
        raise InvalidInput(f"unknown MEMEX_VECTORS {settings.vectors!r}")
    from services.adapters.llm import build_llm, build_reranker

    return Backend(db=db, index=index, embedder=embedder, http=http, index_was_reset=reset,
                   llm=build_llm(settings, http), reranker=build_reranker(settings, http))


def ranking_config(settings: Settings) -> RankingConfig:
    base = RankingConfig()
    return RankingConfig(
        task_half_life_days=settings.rank_task_half_life_days,
        work_half_life_days=settings.rank_work_half_life_days,
        context_half_life_days=settings.rank_context_half_life_days,
        task_tags=frozenset(t.lower() for t in settings.rank_task_tags) or base.task_tags,
        context_tags=frozenset(t.lower() for t in settings.rank_context_tags) or base.context_tags,
        rerank_cache_seconds=settings.rerank_cache_seconds,
    )


@dataclass
class OrgServices:
    """Everything one organization can do, bound to it."""

    ctx: AuthContext
    thoughts: Thoughts
    search: Search
    keys: OrgKeys
    bindings: OrgBindings
    conversations: Conversations
    #: The language model under this organization's daily budget; None when no model is configured.
    llm: BudgetedLLM | None = None
    #: Summary, tags and importance (the enrich job, the two-pass backfill).
    enrichment: Enricher | None = None
    extras: dict = field(default_factory=dict)


class Memex:
    """The running service: backend, tenancy and the job worker."""

    def __init__(self, settings: Settings, backend: Backend | None = None, *, access=None) -> None:
        self.settings = settings
        self.backend = backend or build_backend(settings)
        self.keys = KeyManager(self.backend.db, cache_seconds=settings.key_cache_seconds,
                               revocation_check_seconds=settings.key_revocation_check_seconds)
        self.orgs = OrgDirectory(self.backend.db, self.keys)
        if access is None and settings.access_enabled:
            from tenancy.access import AccessConfig, AccessVerifier

            access = AccessVerifier(
                AccessConfig(
                    team_domain=settings.access_team_domain,
                    audience=settings.access_audience,
                    jwks_url=settings.access_jwks_url,
                )
            )
        self.rate_limits = RateLimits(settings.rate_limit_storage)
        self.client_addresses = ClientAddresses(settings.trusted_proxies, settings.client_ip_header)
        self.auth = Authenticator(
            self.backend.db,
            self.keys,
            access=access,
            limits=AuthLimits(key_per_minute=settings.key_rate_per_minute, org_per_minute=settings.org_rate_per_minute,
                              failures_per_minute=settings.auth_failures_per_minute,
                              address_failures_per_minute=settings.auth_address_failures_per_minute),
            rate_limits=self.rate_limits,
        )
        self.signup_limit = Limit("signup", settings.signup_rate_per_hour, 3600)
        self.llm_budget = LLMBudget(calls_per_day=settings.llm_calls_per_day, tokens_per_day=settings.llm_tokens_per_day)
        self.enrichment_config = EnrichmentConfig(vocabulary_size=settings.enrich_vocabulary_size)
        self.worker = JobWorker(self.backend.db, self.backend.index, self.backend.embedder, poll_seconds=settings.worker_poll_seconds,
                                handlers={ENRICH_JOB: enrich_job_handler(self.enricher)})
        self.limits = ThoughtLimits(
            max_content_bytes=settings.max_content_bytes, max_metadata_bytes=settings.max_metadata_bytes
        )
        self.hydrators = {"thought": hydrate_thoughts}
        self.conversation_locks = KeyedLocks()  # appends to one conversation queue here, per process
        self.conversation_limits = ConversationLimits(max_metadata_bytes=settings.max_metadata_bytes)
        self.hydrators["conversation"] = ConversationHydrator()
        # Write-time decisions embed a capture's first chunk; the embed job takes that vector from here.
        self.recent_vectors = RecentVectors()
        self.worker.handlers["embed"] = cached_embed_handler(self.recent_vectors)
        self.ranking = Ranking(config=ranking_config(settings), uses=UseRecorder(self.backend.db),
                               rerank_cache=RerankCache(ttl=settings.rerank_cache_seconds))

    async def start(self, *, worker: bool | None = None) -> list[str]:
        applied = await apply_pending(self.backend.db)
        if self.settings.sql != "sqlite" and self.settings.rate_limit_storage.startswith(("memory://", "async+memory://")):
            log.warning("rate limits count per process (MEMEX_RATE_LIMIT_STORAGE=memory://): with several instances "
                        "serving, name a shared storage (redis://...) or every limit is multiplied by the instances")
        if worker if worker is not None else self.settings.run_worker:
            self.worker.start()
            import asyncio

            asyncio.get_running_loop().create_task(self.reconcile())
        return applied

    async def reconcile(self) -> None:
        """Bring the vector index in line with the SQL store (after a lost or reset local index)."""
        try:
            for org in await self.orgs.all():
                requeued, stray = await reconcile_org(
                    OrgSql(self.backend.db, org.id), OrgVectors(self.backend.index, org.id), self.backend.index
                )
                if requeued or stray:
                    log.info("reconciled %s: %s chunks re-queued, %s stray vectors removed", org.slug, requeued, stray)
            self.worker.wake()
        except Exception:
            log.exception("reconcile failed")

    async def stop(self) -> None:
        await self.worker.stop()
        await self.keys.drain()
        await self.ranking.uses.close()  # uses still pending
        await self.backend.close()

    def budgeted_llm(self, sql: OrgSql) -> BudgetedLLM | None:
        """The model under the organization's daily budget (None when no model is configured)."""
        llm = self.backend.llm
        return BudgetedLLM(llm, sql, self.llm_budget) if llm is not None else None

    def enricher(self, sql: OrgSql, vectors: OrgVectors) -> Enricher:
        return Enricher(sql, vectors, self.budgeted_llm(sql), self.enrichment_config)

    def decisions(self, sql: OrgSql, vectors: OrgVectors) -> Decisions | None:
        """Write-time decisions of one organization's captures (None when MEMEX_DECISIONS=off)."""
        if not self.settings.decisions:
            return None
        return Decisions(sql, vectors, self.backend.embedder, llm=self.budgeted_llm(sql), recent=self.recent_vectors,
                         max_content_bytes=self.settings.max_content_bytes, lexical_gate=not self.settings.decisions_full)

    def for_org(self, ctx: AuthContext) -> OrgServices:
        sql = OrgSql(self.backend.db, ctx.org_id)
        vectors = OrgVectors(self.backend.index, ctx.org_id)
        emb = self.backend.embedder
        return OrgServices(
            ctx=ctx,
            thoughts=Thoughts(sql, vectors, emb, limits=self.limits, on_enqueue=self.worker.wake,
                              decisions=self.decisions(sql, vectors),
                              on_use=lambda ids, fetched=False, org_id=ctx.org_id: self.ranking.used(org_id, ids, fetched=fetched)),
            search=Search(sql, vectors, emb, self.hydrators, ranking=self.ranking, reranker=self.backend.reranker),
            keys=self.keys.for_org(ctx.org_id),
            bindings=OrgBindings(sql),
            conversations=Conversations(sql, vectors, emb, locks=self.conversation_locks,
                                        limits=self.conversation_limits, on_enqueue=self.worker.wake),
            llm=self.budgeted_llm(sql),
            enrichment=self.enricher(sql, vectors),
        )
