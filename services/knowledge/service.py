"""One organization's knowledge bases, bound to it: management (``bases``), reading and searching one of them, the
sync and embedding jobs, and deletion with everything it owns (rows, vectors, the git mirror).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.jobs.worker import Job
from services.knowledge.bases import KnowledgeBases, SourcePolicy
from services.knowledge.entries import KnowledgeReader
from services.knowledge.search import KnowledgeSearch
from services.knowledge.sync import Syncer, cache_dir_for, flush_vector_gc
from services.ports import Embedder, Reranker
from services.search.ranking import RerankCache
from services.storage.scoped import OrgSql, OrgVectors

__all__ = ["Knowledge", "KnowledgeConfig", "sync_job_handler"]


@dataclass(frozen=True)
class KnowledgeConfig:
    """What a deployment decides for every organization's knowledge bases."""

    #: Where git sources are mirrored (a cache; ``<data dir>/kb-cache`` by default).
    cache_root: Path
    #: Which git sources tenants may name (MEMEX_KB_LOCAL_ROOTS, MEMEX_KB_ALLOW_HTTP).
    policy: SourcePolicy = field(default_factory=SourcePolicy)


@dataclass
class Knowledge:
    sql: OrgSql
    vectors: OrgVectors
    embedder: Embedder
    #: The control database bound to the organization (webhook routes, the organization's slug).
    control: OrgSql
    config: KnowledgeConfig
    reranker: Reranker | None = None
    rerank_cache: RerankCache | None = None
    #: RecentVectors: what a search embeds of entries not indexed yet, left for their embedding job.
    recent: Any = None
    on_enqueue: Callable[[], None] = lambda: None

    @property
    def bases(self) -> KnowledgeBases:
        return KnowledgeBases(self.sql, self.control, policy=self.config.policy, on_enqueue=self.on_enqueue)

    async def reader(self, ref: str) -> KnowledgeReader:
        return KnowledgeReader(self.sql, await self.bases.row(ref))

    def search(self, reader: KnowledgeReader) -> KnowledgeSearch:
        return KnowledgeSearch(reader, self.vectors, self.embedder, reranker=self.reranker,
                               rerank_cache=self.rerank_cache, recent=self.recent)

    async def delete(self, ref: str) -> str:
        """Delete a knowledge base: rows, then vectors (nothing left behind), then its git mirror."""
        kb_id = await self.bases.delete(ref)
        await flush_vector_gc(self.sql, self.vectors)
        await asyncio.to_thread(shutil.rmtree, cache_dir_for(self.config.cache_root, self.sql.org_id, kb_id), True)
        return kb_id


def sync_job_handler(config: KnowledgeConfig, wake: Callable[[str], None]):
    """The ``kb_sync`` job handler (registered with the job worker by the composition root)."""

    async def handler(sql: OrgSql, vectors: OrgVectors, embedder: Embedder, job: Job) -> None:
        await Syncer(sql, vectors, embedder, cache_root=config.cache_root,
                     on_enqueue=lambda: wake(sql.org_id)).run(job)

    return handler
