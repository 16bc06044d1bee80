"""Organization stores: one database per organization, a bounded number open, evicted handles that come back.

A deployment serves many more organizations than it can keep open: the pool closes the least recently used
idle ones, and a handle a service still holds opens again on its next call. These tests go through the real
embedded adapters (SQLite files, local vector files)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from services.adapters.hash_embedder import HashEmbedder
from services.errors import NotFound
from services.storage.migrate import ORG_DIR, applied, discover
from tests.stores import add_org, job_handlers, make_stores


def _open_files(tmp_path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
                n += 1
        except OSError:
            pass
    return n


async def test_many_organizations_keep_open_files_bounded_and_every_one_readable(tmp_path):
    emb = HashEmbedder()
    control, stores = await make_stores(tmp_path, emb, orgs=(), max_open=8)
    orgs = [f"org_{i:03d}" for i in range(40)]
    for org in orgs:
        await add_org(control, stores, org)
    handles = []
    for i, org in enumerate(orgs):
        store = await stores.open(org)
        await store.sql.execute(
            "INSERT INTO documents (organization_id, id, content, content_hash, created_at, updated_at) "
            "VALUES (?1, ?2, ?3, ?4, 1, 1)", [f"d{i}", f"note of {org}", f"h{i}"])
        await store.vectors.upsert([(f"c{i}", np.ones(emb.dimensions, dtype=np.float32) / np.sqrt(emb.dimensions), {})])
        handles.append(store)
        assert stores.pool.open_count <= 16  # 8 organizations, two handles each
    assert stores.pool.evicted > 0
    files = _open_files(tmp_path)
    # 8 organizations open: a database (writer + 2 readers, each with its -wal: 6 files) and a vector file (2),
    # plus the control database
    assert 0 < files <= 8 * 8 + 24, files
    # every handle a caller kept still works: an evicted one opens again, its data intact
    for i, (org, store) in enumerate(zip(orgs, handles, strict=True)):
        row = await store.sql.one("SELECT content FROM documents WHERE organization_id = ?1 AND id = ?2", [f"d{i}"])
        assert row == {"content": f"note of {org}"}
        got = await store.vectors.get_by_ids([f"c{i}"])
        assert [v.id for v in got] == [f"c{i}"]
        # and it reaches only its own organization's rows
        assert (await store.sql.one("SELECT COUNT(*) AS n FROM documents WHERE organization_id = ?1", []))["n"] == 1
        assert (await store.db.execute("SELECT COUNT(*) AS n FROM documents")).rows[0]["n"] == 1
    assert stores.pool.open_count <= 16
    await stores.close()
    await control.close()


async def test_a_handle_in_use_is_never_closed_under_a_running_statement(tmp_path):
    emb = HashEmbedder()
    control, stores = await make_stores(tmp_path, emb, orgs=("org_busy",), max_open=2)
    busy = await stores.open("org_busy")
    others = [f"org_x{i}" for i in range(6)]
    for org in others:
        await add_org(control, stores, org)

    async def long_reads():
        for _ in range(30):
            await busy.sql.rows("WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 20000) "
                                "SELECT COUNT(*) AS c, ?1 AS o FROM n")

    async def churn():
        for _ in range(5):
            for org in others:
                await (await stores.open(org)).sql.rows("SELECT COUNT(*) AS n FROM documents WHERE organization_id = ?1")

    await asyncio.gather(long_reads(), churn())  # crashes the process if a connection closes mid-statement
    assert stores.pool.open_count <= 5
    await stores.close()
    await control.close()


async def test_an_organization_database_is_migrated_when_made_and_unknown_ids_are_not_found(tmp_path):
    emb = HashEmbedder()
    control, stores = await make_stores(tmp_path, emb, orgs=("org_m",))
    store = await stores.open("org_m")
    assert await applied(store.db) >= {m.name for m in discover(ORG_DIR)}
    assert (tmp_path / "orgs" / "org_m" / "memex.sqlite3").exists()
    for bad in ("org_unknown", "../etc", "org_M", "", "org_a/../b"):
        with pytest.raises(NotFound):
            await stores.open(bad)
    assert sorted(p.name for p in (tmp_path / "orgs").iterdir()) == ["org_m"]  # opening never creates one
    await stores.drop("org_m")
    assert not (tmp_path / "orgs" / "org_m").exists()
    with pytest.raises(NotFound):
        await stores.open("org_m")
    await stores.close()
    await control.close()


async def _indexed(sql, tid: str, timeout: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        row = await sql.one("SELECT COUNT(*) AS n FROM chunks WHERE organization_id = ?1 AND parent_id = ?2 "
                            "AND indexed_at IS NULL", [tid])
        done = await sql.one("SELECT COUNT(*) AS n FROM chunks WHERE organization_id = ?1 AND parent_id = ?2", [tid])
        if done["n"] and not row["n"]:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_one_full_organization_does_not_stop_the_others_jobs(tmp_path):
    from services.errors import InsufficientStorage
    from services.thoughts.thoughts import Thoughts
    from services.jobs.worker import JobWorker

    emb = HashEmbedder()
    control, stores = await make_stores(tmp_path, emb)
    full, ok = await stores.open("org_a"), await stores.open("org_b")
    tid_a = (await Thoughts(full.sql, full.vectors, emb).capture("a note in a full database")).id
    tid_b = (await Thoughts(ok.sql, ok.vectors, emb).capture("a note in a database with room")).id
    real_execute = full.db.execute
    space = {"left": False}

    async def execute(sql, params=()):
        if not space["left"] and sql.lstrip().startswith("UPDATE jobs"):
            raise InsufficientStorage("insufficient storage", details={"reason": "database or disk is full"})
        return await real_execute(sql, params)

    full.db.execute = execute  # org_a's database refuses writes to its job table, as a full one would
    worker = JobWorker(stores, emb, handlers=job_handlers(), poll_seconds=0.05)
    worker.start()
    try:
        assert await _indexed(ok.sql, tid_b)  # org_b's job ran although org_a's cannot
        assert worker.paused and "full" in worker.paused
        assert not await _indexed(full.sql, tid_a, timeout=0.3)
        space["left"] = True
        worker.wake()
        assert await _indexed(full.sql, tid_a)  # space is back: org_a resumes, nothing failed
        assert worker.paused is None and worker.failed == 0
    finally:
        await worker.stop()
        await stores.close()
        await control.close()


async def test_jobs_queued_by_another_process_are_found_through_the_work_hints(tmp_path):
    from api.settings import Settings
    from api.wiring import Memex
    from tenancy.models import AuthContext

    settings = Settings(data_dir=tmp_path, embedder="hash", worker_poll_seconds=0.05)
    server = Memex(settings)
    await server.start(worker=True)
    cli = Memex(settings.with_(run_worker=False))  # e.g. `memex org import` while the service runs
    await cli.start(worker=False)
    try:
        org, _ = await server.orgs.create(name="Hint", slug="hint-co")
        await asyncio.sleep(0.2)  # the server's worker has scanned and is idle
        ctx = AuthContext(org_id=org.id, org_slug=org.slug, principal="cli", scopes=frozenset({"admin"}))
        tid = (await (await cli.for_org(ctx)).thoughts.capture("queued from another process")).id
        await cli.stop()
        cli = None
        sql = (await server.stores.open(org.id)).sql
        assert await _indexed(sql, tid)  # the server's worker ran the other process's job
    finally:
        if cli is not None:
            await cli.stop()
        await server.stop()
