"""The running service: the backend the composition root built (api.composition), tenancy, the job worker, and
organization-bound services handed out per request (``Memex.for_org``)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field

from api.composition.backend import Backend, build_backend, convert_legacy_layout
from api.settings import Settings
from services.conversations.append import ConversationLimits, KeyedLocks
from services.conversations.conversations import Conversations
from services.conversations.search import ConversationHydrator
from services.enrichment.enrichment import ENRICH_JOB, EnrichStage, Enricher, EnrichmentConfig
from services.enrichment.llm_budget import BudgetedLLM, LLMBudget
from services.ids import now_ms
from services.jobs.worker import JobWorker
from services.knowledge.bases import SYNC_JOB, SourcePolicy
from services.knowledge.service import Knowledge, KnowledgeConfig, sync_job_handler
from services.search.indexing import EMBED_JOB, KB_EMBED_JOB, EmbedStage, reconcile_org
from services.search.ranking import Ranking, RankingConfig, UseRecorder, RerankCache
from services.search.recent_vectors import RecentVectors
from services.search.search import Hydrator, Search
from services.storage.migrate import CONTROL_DIR, apply_pending
from services.storage.scoped import OrgSql, OrgVectors
from services.thoughts.decisions import Decisions
from services.thoughts.deferred import deferred_decisions
from services.thoughts.hydrator import hydrate_thoughts
from services.thoughts.thoughts import ThoughtLimits, Thoughts
from tenancy.addresses import ClientAddresses
from tenancy.auth import AuthLimits, Authenticator
from tenancy.bindings import OrgBindings
from tenancy.keys import KeyManager, OrgKeys
from tenancy.models import AuthContext
from tenancy.orgs import OrgDirectory
from tenancy.ratelimit import Limit, RateLimits

__all__ = ["Memex", "OrgServices", "ranking_config"]

log = logging.getLogger("memex")


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
    #: Knowledge bases (git-synced markdown vaults).
    knowledge: Knowledge | None = None
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
        self.knowledge_config = KnowledgeConfig(
            cache_root=settings.kb_cache_root,
            policy=SourcePolicy(local_roots=tuple(settings.kb_local_roots), allow_http=settings.kb_allow_http))
        # One model call per round for every organization's chunks (vectors computed at capture reused).
        embedding = EmbedStage(recent=self.recent_vectors,
                               before_upsert=deferred_decisions(lambda sql, vectors: self.decisions(sql, vectors),
                                                                self.wake))
        self.worker = JobWorker(self.stores, self.backend.embedder, poll_seconds=settings.worker_poll_seconds,
                                handlers={SYNC_JOB: sync_job_handler(self.knowledge_config, self.wake)},
                                # in this order in a round: a thought's tags are in hand when its vectors are written
                                stages={ENRICH_JOB: EnrichStage(self.enricher), EMBED_JOB: embedding,
                                        KB_EMBED_JOB: embedding},
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
        # A single-database data directory (the previous release) becomes one database per organization first.
        await convert_legacy_layout(self.settings, self.backend)
        applied = await apply_pending(self.control, CONTROL_DIR)
        if self.settings.sql != "sqlite" and self.settings.rate_limit_storage.startswith(("memory://", "async+memory://")):
            log.warning("rate limits count per process (MEMEX_RATE_LIMIT_STORAGE=memory://): with several instances "
                        "serving, name a shared storage (redis://...) or every limit is multiplied by the instances")
        if worker if worker is not None else self.settings.run_worker:
            self.worker.start()
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
        at = now_ms()
        self.worker.own_hint(org_id, at)
        try:
            await self.control.execute(
                "UPDATE org_databases SET work_at = MAX(work_at, ?) WHERE organization_id = ?", (at, org_id))
        except Exception:  # the worker's own wake and the start-up scan still find the jobs
            log.warning("work hint for %s not written", org_id, exc_info=True)

    async def delete_org(self, org_id: str) -> None:
        """Delete an organization (tenancy.orgs) and what this deployment caches of it (its git mirrors)."""
        await self.orgs.delete(org_id)
        await asyncio.to_thread(shutil.rmtree, self.knowledge_config.cache_root / org_id, True)

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
                              on_use=lambda ids, fetched=False, org_id=ctx.org_id:
                                  self.ranking.used(org_id, ids, fetched=fetched)),
            search=Search(sql, vectors, emb, self.hydrators, ranking=self.ranking, reranker=self.backend.reranker,
                          recent=self.recent_vectors),
            keys=self.keys.for_org(ctx.org_id),
            bindings=OrgBindings(OrgSql(self.control, ctx.org_id)),
            conversations=Conversations(sql, vectors, emb, locks=self.conversation_locks,
                                        limits=self.conversation_limits, on_enqueue=wake),
            llm=self.budgeted_llm(sql),
            enrichment=self.enricher(sql, vectors),
            knowledge=self.knowledge(ctx.org_id, sql, vectors),
        )

    def knowledge(self, org_id: str, sql: OrgSql, vectors: OrgVectors, *, policy: SourcePolicy | None = None) -> Knowledge:
        """The organization's knowledge bases (``policy``: the sources it may name; the deployment's by default)."""
        config = self.knowledge_config if policy is None else KnowledgeConfig(self.knowledge_config.cache_root, policy)
        return Knowledge(sql, vectors, self.backend.embedder, OrgSql(self.control, org_id), config,
                         reranker=self.backend.reranker, rerank_cache=self.ranking.rerank_cache,
                         recent=self.recent_vectors, on_enqueue=lambda: self.wake(org_id))
