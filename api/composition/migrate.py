"""``memex cloudflare migrate``'s adapters: the REST-backed deployment it reads (D1 over Cloudflare's REST API:
the control database ``CLOUDFLARE_D1_DATABASE_ID`` and, per organization, the database its routing row names) and the
Worker it writes (``MEMEX_WORKER_URL`` / ``MEMEX_WORKER_SECRET``: the control database on the Worker's D1 binding,
each organization's Durable Object). The moving itself is ``services.storage.worker_migrate``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.composition import cloudflare, worker
from services.adapters.cloudflare import D1Database
from services.adapters.cloudflare.worker_client import worker_http_client
from services.adapters.cloudflare.worker_sql import WorkerSqlDatabase
from services.adapters.sqlite import SqliteDatabase
from services.storage.worker_migrate import MigrationReport, migrate_to_worker

__all__ = ["migrate_deployment"]


async def migrate_deployment(settings: Any, *, only: list[str] | None = None,
                             progress: Callable[[str, str], None] | None = None) -> MigrationReport:
    """Move the REST deployment named by ``settings`` into the Worker it also names (resumable; see
    ``services.storage.worker_migrate``)."""
    worker.require_settings(settings)
    rest_http = cloudflare.shared_client(settings)
    worker_http = worker_http_client()
    try:
        api = cloudflare.api_for(settings, rest_http)
        api.budget.max_wait = max(api.budget.max_wait, api.budget.window + 5)  # a long batch job: wait for the budget
        source_control = cloudflare.d1_database(settings, rest_http)
        client = worker.client_for(settings, worker_http)
        return await migrate_to_worker(
            source_control, lambda uuid: D1Database(api, uuid), worker.control(client),
            lambda location: WorkerSqlDatabase(client, location),
            vector_index=worker.index_name(settings), open_scratch=SqliteDatabase, only=only, progress=progress)
    finally:
        await rest_http.aclose()
        await worker_http.aclose()
