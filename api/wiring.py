"""The one module that chooses adapters from settings and hands out organization-bound services."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from api.settings import Settings, SettingsError
from services.errors import InvalidInput
from services.ids import now_ms
from services.storage.migrate import CONTROL_DIR, apply_pending
from services.ports import LLM, Embedder, Reranker, SqlDatabase, VectorIndex, require
from services.storage.scoped import OrgSql, OrgVectors
from services.storage.d1_stores import D1OrgStores
from services.storage.stores import EmbeddedOrgStores, OrgStores
from services.conversations.search import ConversationHydrator
from services.conversations.conversations import ConversationLimits, Conversations, KeyedLocks
from services.enrichment.enrichment import ENRICH_JOB, Enricher, EnrichmentConfig, enrich_job_handler
from services.enrichment.llm_budget import BudgetedLLM, LLMBudget
from services.thoughts.decisions import Decisions
from services.search.ranking import Ranking, RankingConfig, UseRecorder, RerankCache
from services.search.recent_vectors import RecentVectors, cached_embed_handler
from services.search.search import Hydrator, Search, hydrate_thoughts
from services.thoughts.thoughts import ThoughtLimits, Thoughts
from services.jobs.worker import JobWorker
from services.search.indexing import EMBED_JOB, reconcile_org
from tenancy.addresses import ClientAddresses
from tenancy.auth import AuthLimits, Authenticator
from tenancy.bindings import OrgBindings
from tenancy.keys import KeyManager, OrgKeys
from tenancy.models import AuthContext
from tenancy.orgs import OrgDirectory
from tenancy.ratelimit import Limit, RateLimits

__all__ = ["Backend", "Memex", "OrgServices", "build_backend", "checked"]

log = logging.getLogger("memex")


@dataclass
class Backend:
    """Everything the settings chose: the control database, where organizations' databases live, the models."""

    control: SqlDatabase
    stores: OrgStores
    embedder: Embedder
    http: httpx.AsyncClient | None = None
    #: The language model (MEMEX_LLM); None = none configured: enrichment and decisions run deterministically.
    llm: LLM | None = None
    #: The second-stage reranker (MEMEX_RERANKER); None = none.
    reranker: Reranker | None = None
    #: Vectors written become searchable later (Vectorize): the worker confirms their mutations.
    async_index: bool = False

    def cloudflare_stats(self) -> dict | None:
        """Requests, retries and the request budget of the Cloudflare adapters (None on the embedded backend)."""
        if self.http is None:
            return None
        from services.adapters.cloudflare import cloudflare_stats

        return cloudflare_stats(self.http)

    async def close(self) -> None:
        for model in (self.llm, self.reranker):
            if model is not None:
                await model.aclose()
        await self.stores.close()
        await self.control.close()
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


_PAIRS = {("sqlite", "local"), ("d1", "vectorize")}

T = TypeVar("T")


def checked(adapter: T, port: type, setting: str) -> T:
    """``adapter`` when it implements every member of ``port``; else ``SettingsError`` naming the adapter, the
    setting that chose it and the missing members (services call port members directly, never probe)."""
    return require(adapter, port, f"{type(adapter).__name__} ({setting})", error=SettingsError)


def build_backend(settings: Settings) -> Backend:
    if (settings.sql, settings.vectors) not in _PAIRS:
        raise SettingsError(
            f"MEMEX_SQL={settings.sql} with MEMEX_VECTORS={settings.vectors} is not a backend: each organization's "
            "database and vectors live together (sqlite with local, d1 with vectorize)",
            details={"setting": "MEMEX_VECTORS"},
        )
    cloud = ("d1" in settings.sql or settings.vectors == "vectorize" or settings.embedder == "workers-ai"
             or settings.llm == "workers-ai" or settings.reranker == "workers-ai")
    http = None
    if cloud:
        from services.adapters.cloudflare import shared_client

        http = shared_client(settings)
    embedder = checked(_embedder(settings, http), Embedder, f"MEMEX_EMBEDDER={settings.embedder}")
    stores: OrgStores
    if settings.sql == "sqlite":
        from services.adapters.sqlite import SqliteDatabase

        from services.adapters.local_vectors import LocalVectorIndex

        control: SqlDatabase = checked(SqliteDatabase(settings.control_path), SqlDatabase, "MEMEX_SQL=sqlite")
        dims, model = embedder.dimensions, embedder.model_id
        stores = EmbeddedOrgStores(
            control, settings.data_dir, dimensions=dims, max_open=settings.max_open_orgs,
            # two readers per organization (searches don't queue behind writes) keep the file handles bounded
            open_database=lambda path: checked(SqliteDatabase(path, readers=2), SqlDatabase, "MEMEX_SQL=sqlite"),
            open_index=lambda path: checked(
                LocalVectorIndex(path, dimensions=dims, model=model, reset_on_mismatch=True), VectorIndex,
                "MEMEX_VECTORS=local"),
        )
    else:
        from services.adapters.cloudflare import D1Database, VectorizeIndex, api_for, d1_admin, d1_database

        if not settings.cloudflare_vectorize_index:
            raise SettingsError("CLOUDFLARE_VECTORIZE_INDEX must be set for MEMEX_VECTORS=vectorize",
                                details={"setting": "CLOUDFLARE_VECTORIZE_INDEX"})
        control = checked(d1_database(settings, http), SqlDatabase, "MEMEX_SQL=d1")
        api = api_for(settings, http)
        stores = D1OrgStores(
            control, admin=d1_admin(settings, http), index_name=settings.cloudflare_vectorize_index,
            account=settings.cloudflare_account_id,
            open_database=lambda uuid: checked(D1Database(api, uuid), SqlDatabase, "MEMEX_SQL=d1"),
            open_index=lambda name: checked(
                VectorizeIndex(api, name, dimensions=embedder.dimensions, model=embedder.model_id), VectorIndex,
                "MEMEX_VECTORS=vectorize"),
        )
    from services.adapters.llm import build_llm, build_reranker

    llm = build_llm(settings, http)
    if llm is not None:
        llm = checked(llm, LLM, f"MEMEX_LLM={settings.llm}")
    reranker = build_reranker(settings, http)
    if reranker is not None:
        reranker = checked(reranker, Reranker, f"MEMEX_RERANKER={settings.reranker}")
    return Backend(control=control, stores=stores, embedder=embedder, http=http, llm=llm, reranker=reranker,
                   async_index=settings.vectors == "vectorize")


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
        self.control = self.backend.control
        self.stores = self.backend.stores
        self.keys = KeyManager(self.control, cache_seconds=settings.key_cache_seconds,
                               revocation_check_seconds=settings.key_revocation_check_seconds)
        self.orgs = OrgDirectory(self.control, self.keys, self.stores)
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
            self.control,
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
        # Write-time decisions embed a capture's first chunk; the embed job takes that vector from here.
        self.recent_vectors = RecentVectors()
        self.worker = JobWorker(self.stores, self.backend.embedder, poll_seconds=settings.worker_poll_seconds,
                                handlers={EMBED_JOB: cached_embed_handler(self.recent_vectors),
                                          ENRICH_JOB: enrich_job_handler(self.enricher)},
                                async_index=self.backend.async_index)
        self.limits = ThoughtLimits(
            max_content_bytes=settings.max_content_bytes, max_metadata_bytes=settings.max_metadata_bytes
        )
        self.hydrators: dict[str, Hydrator] = {"thought": hydrate_thoughts}
        self.conversation_locks = KeyedLocks()  # appends to one conversation queue here, per process
        self.conversation_limits = ConversationLimits(max_metadata_bytes=settings.max_metadata_bytes)
        self.hydrators["conversation"] = ConversationHydrator()
        self._hinted: dict[str, float] = {}
        self._hint_tasks: set[asyncio.Task] = set()
        self.ranking = Ranking(config=ranking_config(settings), uses=UseRecorder(self.org_sql),
                               rerank_cache=RerankCache(ttl=settings.rerank_cache_seconds))

    async def start(self, *, worker: bool | None = None) -> list[str]:
        from services.adapters.local_vectors import LocalVectorIndex
        from services.adapters.sqlite import SqliteDatabase
        from services.storage.convert import convert_on_start

        # A single-database data directory (the previous release) becomes one database per organization first.
        await convert_on_start(self.settings, self.control, self.backend.embedder, open_database=SqliteDatabase,
                               open_index=LocalVectorIndex)
        applied = await apply_pending(self.control, CONTROL_DIR)
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
            if self.backend.async_index:
                return  # Vectorize cannot list a namespace: nothing to compare
            for org_id in await self.stores.org_ids():
                store = await self.stores.open(org_id)
                requeued, stray = await reconcile_org(store.sql, store.vectors, store.index)
                if requeued or stray:
                    log.info("reconciled %s: %s chunks re-queued, %s stray vectors removed", org_id, requeued, stray)
                    self.worker.wake(org_id)
        except Exception:
            log.exception("reconcile failed")

    async def stop(self) -> None:
        if self._hint_tasks:
            await asyncio.gather(*self._hint_tasks, return_exceptions=True)
        await self.worker.stop()
        await self.keys.drain()
        await self.ranking.uses.close()  # uses still pending
        await self.backend.close()

    def wake(self, org_id: str) -> None:
        """Jobs were queued for ``org_id``: wake this process's worker, and where another process's worker may be
        the one to run them (no worker here, e.g. the CLI; or D1, where instances share the databases) leave
        a work hint in the control database, at most once a second per organization, off the request path."""
        self.worker.wake(org_id)
        if self.settings.run_worker and self.settings.sql == "sqlite":
            return
        now = time.monotonic()
        if now - self._hinted.get(org_id, 0.0) < 1.0:
            return
        self._hinted[org_id] = now
        task = asyncio.get_running_loop().create_task(self._hint(org_id))
        self._hint_tasks.add(task)
        task.add_done_callback(self._hint_tasks.discard)

    async def _hint(self, org_id: str) -> None:
        try:
            await self.control.execute(
                "UPDATE org_databases SET work_at = MAX(work_at, ?) WHERE organization_id = ?", (now_ms(), org_id))
        except Exception:  # the worker's own wake and the start-up scan still find the jobs
            log.warning("work hint for %s not written", org_id, exc_info=True)

    async def org_sql(self, org_id: str) -> OrgSql:
        """The organization's own database, bound to it."""
        return (await self.stores.open(org_id)).sql

    def budgeted_llm(self, sql: OrgSql) -> BudgetedLLM | None:
        """The model under the organization's daily budget (None when no model is configured). Usage is
        counted in the control database (llm_usage), beside the organization."""
        llm = self.backend.llm
        return BudgetedLLM(llm, OrgSql(self.control, sql.org_id), self.llm_budget) if llm is not None else None

    def enricher(self, sql: OrgSql, vectors: OrgVectors) -> Enricher:
        return Enricher(sql, vectors, self.budgeted_llm(sql), self.enrichment_config)

    def decisions(self, sql: OrgSql, vectors: OrgVectors) -> Decisions | None:
        """Write-time decisions of one organization's captures (None when MEMEX_DECISIONS=off)."""
        if not self.settings.decisions:
            return None
        return Decisions(sql, vectors, self.backend.embedder, llm=self.budgeted_llm(sql), recent=self.recent_vectors,
                         max_content_bytes=self.settings.max_content_bytes, lexical_gate=not self.settings.decisions_full)

    async def for_org(self, ctx: AuthContext) -> OrgServices:
        store = await self.stores.open(ctx.org_id)
        sql, vectors = store.sql, store.vectors
        emb = self.backend.embedder
        wake = lambda org_id=ctx.org_id: self.wake(org_id)  # noqa: E731
        return OrgServices(
            ctx=ctx,
            thoughts=Thoughts(sql, vectors, emb, limits=self.limits, on_enqueue=wake,
                              decisions=self.decisions(sql, vectors),
                              on_use=lambda ids, fetched=False, org_id=ctx.org_id: self.ranking.used(org_id, ids, fetched=fetched)),
            search=Search(sql, vectors, emb, self.hydrators, ranking=self.ranking, reranker=self.backend.reranker),
            keys=self.keys.for_org(ctx.org_id),
            bindings=OrgBindings(OrgSql(self.control, ctx.org_id)),
            conversations=Conversations(sql, vectors, emb, locks=self.conversation_locks,
                                        limits=self.conversation_limits, on_enqueue=wake),
            llm=self.budgeted_llm(sql),
            enrichment=self.enricher(sql, vectors),
        )
