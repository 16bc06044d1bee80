"""The one module that chooses adapters from settings and hands out organization-bound services."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import httpx

from api.settings import Settings
from services.errors import InvalidInput
from services.migrate import apply_pending
from services.ports import Embedder, SqlDatabase, VectorIndex
from services.scoped import OrgSql, OrgVectors
from services.search import Search, hydrate_thoughts
from services.thoughts import ThoughtLimits, Thoughts
from services.worker import JobWorker, reconcile_org
from tenancy.auth import Authenticator
from tenancy.bindings import OrgBindings
from tenancy.keys import KeyManager, OrgKeys
from tenancy.models import AuthContext
from tenancy.orgs import OrgDirectory

__all__ = ["Backend", "Memex", "OrgServices", "build_backend"]

log = logging.getLogger("memex")


@dataclass
class Backend:
    db: SqlDatabase
    index: VectorIndex
    embedder: Embedder
    http: httpx.AsyncClient | None = None
    index_was_reset: bool = False

    async def close(self) -> None:
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
    cloud = "d1" in settings.sql or settings.vectors == "vectorize" or settings.embedder == "workers-ai"
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
    return Backend(db=db, index=index, embedder=embedder, http=http, index_was_reset=reset)


@dataclass
class OrgServices:
    """Everything one organization can do, bound to it."""

    ctx: AuthContext
    thoughts: Thoughts
    search: Search
    keys: OrgKeys
    bindings: OrgBindings
    extras: dict = field(default_factory=dict)


class Memex:
    """The running service: backend, tenancy and the job worker."""

    def __init__(self, settings: Settings, backend: Backend | None = None, *, access=None) -> None:
        self.settings = settings
        self.backend = backend or build_backend(settings)
        self.keys = KeyManager(self.backend.db, cache_seconds=settings.key_cache_seconds)
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
        self.auth = Authenticator(
            self.backend.db,
            self.keys,
            access=access,
            failures_per_minute=settings.auth_failures_per_minute,
            requests_per_minute=settings.key_rate_per_minute,
        )
        self.worker = JobWorker(self.backend.db, self.backend.index, self.backend.embedder, poll_seconds=settings.worker_poll_seconds)
        self.limits = ThoughtLimits(
            max_content_bytes=settings.max_content_bytes, max_metadata_bytes=settings.max_metadata_bytes
        )
        self.hydrators = {"thought": hydrate_thoughts}

    async def start(self, *, worker: bool | None = None) -> list[str]:
        applied = await apply_pending(self.backend.db)
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
        await self.backend.close()

    def for_org(self, ctx: AuthContext) -> OrgServices:
        sql = OrgSql(self.backend.db, ctx.org_id)
        vectors = OrgVectors(self.backend.index, ctx.org_id)
        emb = self.backend.embedder
        return OrgServices(
            ctx=ctx,
            thoughts=Thoughts(sql, vectors, emb, limits=self.limits, on_enqueue=self.worker.wake),
            search=Search(sql, vectors, emb, self.hydrators),
            keys=self.keys.for_org(ctx.org_id),
            bindings=OrgBindings(sql),
        )
