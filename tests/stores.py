"""Real organization stores for tests below the HTTP layer: the control database and one database (and vector
file) per organization, built with the adapters the composition root uses for the embedded backend."""

from __future__ import annotations

from pathlib import Path

from services.adapters.local_vectors import LocalVectorIndex
from services.adapters.sqlite import SqliteDatabase
from services.storage.migrate import CONTROL_DIR, apply_pending
from services.ports import Embedder, SqlDatabase
from services.enrichment.enrichment import Enricher, enrich_job_handler
from services.jobs.worker import Handler
from services.search.indexing import embed_parent
from services.storage.stores import EmbeddedOrgStores


async def make_stores(data_dir: Path, embedder: Embedder, orgs: tuple[str, ...] = ("org_a", "org_b"),
                      *, max_open: int = 64) -> tuple[SqlDatabase, EmbeddedOrgStores]:
    """A migrated control database and ``orgs`` provisioned (organization rows and routing written)."""
    control = SqliteDatabase(Path(data_dir) / "control.sqlite3")
    await apply_pending(control, CONTROL_DIR)
    dims, model = embedder.dimensions, embedder.model_id
    stores = EmbeddedOrgStores(
        control, Path(data_dir), dimensions=dims, max_open=max_open,
        open_database=lambda path: SqliteDatabase(path, readers=2),
        open_index=lambda path: LocalVectorIndex(path, dimensions=dims, model=model, reset_on_mismatch=True),
    )
    for org in orgs:
        await add_org(control, stores, org)
    return control, stores


async def add_org(control: SqlDatabase, stores: EmbeddedOrgStores, org: str) -> None:
    from services.ports import Statement

    route = await stores.provision(org)
    await control.batch([
        Statement("INSERT INTO organizations (id, slug, name, status, created_at) VALUES (?, ?, ?, 'active', 1)",
                  (org, org.replace("_", "-"), org)),
        route,
    ])


def job_handlers(**overrides: Handler) -> dict[str, Handler]:
    """The job handlers a worker in these tests runs: the embedding job and the enrichment without a model
    (the composition root registers the same two kinds)."""
    return {"embed": embed_parent, "enrich": enrich_job_handler(lambda sql, vectors: Enricher(sql, vectors, None)),
            **overrides}
