"""The SQL port on SQLite (D1's semantics), migrations as wrangler records them, the org-bound handles,
and the job worker's durability: jobs survive restarts, a lost vector index is rebuilt from SQL."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from services.adapters.hash_embedder import HashEmbedder
from services.adapters.local_vectors import LocalVectorIndex
from services.adapters.sqlite import SqliteDatabase
from services.errors import InvalidInput
from services.migrate import apply_pending, discover
from services.ports import Statement
from services.scoped import OrgSql, OrgVectors
from services.thoughts import Thoughts
from services.worker import JobWorker, reconcile_org


@pytest.fixture
async def db(tmp_path):
    d = SqliteDatabase(tmp_path / "m.sqlite3")
    await apply_pending(d)
    await d.execute("INSERT INTO organizations (id, slug, name, status, created_at) VALUES ('org_a', 'a', 'A', 'active', 1)")
    await d.execute("INSERT INTO organizations (id, slug, name, status, created_at) VALUES ('org_b', 'b', 'B', 'active', 1)")
    yield d
    await d.close()


async def test_migrations_are_recorded_like_wrangler_and_run_once(tmp_path):
    d = SqliteDatabase(tmp_path / "w.sqlite3")
    applied = await apply_pending(d)
    assert applied == [m.name for m in discover()]
    assert await apply_pending(d) == []
    cols = {r["name"]: r for r in (await d.execute("PRAGMA table_info(d1_migrations)")).rows}
    assert set(cols) == {"id", "name", "applied_at"}
    names = [r["name"] for r in (await d.execute("SELECT name FROM d1_migrations ORDER BY id")).rows]
    assert names == applied
    await d.close()


async def test_a_failing_migration_rolls_back_whole(tmp_path):
    mig = tmp_path / "migs"
    mig.mkdir()
    (mig / "0001_ok.sql").write_text("CREATE TABLE t1 (x INTEGER);\n")
    (mig / "0002_bad.sql").write_text("CREATE TABLE t2 (x INTEGER);\nINSERT INTO nope VALUES (1);\n")
    d = SqliteDatabase(tmp_path / "f.sqlite3")
    with pytest.raises(sqlite3.OperationalError):
        await apply_pending(d, mig)
    tables = {r["name"] for r in (await d.execute("SELECT name FROM sqlite_master WHERE type='table'")).rows}
    assert "t1" in tables and "t2" not in tables
    assert [r["name"] for r in (await d.execute("SELECT name FROM d1_migrations")).rows] == ["0001_ok.sql"]
    await d.close()


async def test_batch_is_atomic(db):
    with pytest.raises(sqlite3.IntegrityError):
        await db.batch([
            Statement("INSERT INTO organizations (id, slug, name, created_at) VALUES ('org_c', 'c', 'C', 1)"),
            Statement("INSERT INTO organizations (id, slug, name, created_at) VALUES ('org_d', 'c', 'D', 1)"),
        ])
    assert (await db.execute("SELECT COUNT(*) AS n FROM organizations WHERE id IN ('org_c', 'org_d')")).rows[0]["n"] == 0
    with pytest.raises(InvalidInput):
        await db.execute("BEGIN")


async def test_org_handle_refuses_statements_without_the_tenant_filter(db):
    sql = OrgSql(db, "org_a")
    with pytest.raises(AssertionError):
        await sql.rows("SELECT * FROM documents")
    with pytest.raises(AssertionError):
        await sql.rows("SELECT * FROM documents WHERE organization_id = ?1 AND id = ?", ["x"])
    with pytest.raises(AssertionError):
        await sql.batch([Statement("DELETE FROM documents WHERE organization_id = ?1", ("org_b",))])
    assert await sql.rows("SELECT * FROM documents WHERE organization_id = ?1") == []


async def test_org_vectors_cannot_reach_another_orgs_vectors(tmp_path):
    index = LocalVectorIndex(None, dimensions=4, model="m")
    a, b = OrgVectors(index, "org_a"), OrgVectors(index, "org_b")
    v = np.array([1, 0, 0, 0], dtype=np.float32)
    await a.upsert([("c1", v, {"kind": "thought", "parent_id": "d1"})])
    assert [m.id for m in await a.query(v, top_k=5)] == ["c1"]
    assert await b.query(v, top_k=5) == []
    assert await b.get_by_ids(["c1"]) == []
    await b.delete_by_ids(["c1"])  # resolves to org_b:c1, which does not exist
    assert [x.id for x in await a.get_by_ids(["c1"])] == ["c1"]


async def _thoughts(db, index, emb, org="org_a"):
    return Thoughts(OrgSql(db, org), OrgVectors(index, org), emb)


async def test_jobs_survive_a_restart_and_finish(tmp_path, db):
    emb = HashEmbedder()
    index = LocalVectorIndex(tmp_path / "v.sqlite3", dimensions=emb.dimensions, model=emb.model_id)
    t = await _thoughts(db, index, emb)
    res = await t.capture("durable note about lighthouses")
    assert res.indexing.state == "pending"
    # the service "crashes" before the worker ran: a new worker (new process) picks the job up
    worker = JobWorker(db, index, emb)
    await worker.drain()
    assert (await t.get(res.id)).indexing.state == "indexed"
    assert (await db.execute("SELECT COUNT(*) AS n FROM jobs")).rows[0]["n"] == 0
    await index.close()


async def test_a_failing_embedder_is_retried_with_backoff(tmp_path, db):
    class Flaky(HashEmbedder):
        calls = 0

        async def embed(self, texts):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("model crashed")
            return await super().embed(texts)

    emb = Flaky()
    index = LocalVectorIndex(None, dimensions=emb.dimensions, model=emb.model_id)
    t = await _thoughts(db, index, emb)
    res = await t.capture("note that needs two tries")
    worker = JobWorker(db, index, emb)
    await worker.run_once()
    row = (await db.execute("SELECT state, attempts, last_error, run_after FROM jobs")).rows[0]
    assert row["state"] == "pending" and row["attempts"] == 1 and "crashed" in row["last_error"]
    await db.execute("UPDATE jobs SET run_after = 0")  # skip the backoff wait
    await worker.run_once()
    assert (await t.get(res.id)).indexing.state == "indexed"


async def test_lost_vector_index_is_rebuilt_from_sql(tmp_path, db):
    emb = HashEmbedder()
    path = tmp_path / "v.sqlite3"
    index = LocalVectorIndex(path, dimensions=emb.dimensions, model=emb.model_id)
    t = await _thoughts(db, index, emb)
    res = await t.capture("the lighthouse keeper logs the weather at dawn")
    await JobWorker(db, index, emb).drain()
    await index.close()
    path.unlink()
    fresh = LocalVectorIndex(path, dimensions=emb.dimensions, model=emb.model_id)
    sql, vec = OrgSql(db, "org_a"), OrgVectors(fresh, "org_a")
    assert await reconcile_org(sql, vec, fresh) == (1, 0)
    assert (await t.get(res.id)).indexing.state == "pending"
    await JobWorker(db, fresh, emb).drain()
    q = (await emb.embed(["lighthouse keeper weather"]))[0]
    assert [m.metadata["parent_id"] for m in await vec.query(q, top_k=1, return_metadata=True)] == [res.id]
    # a stray vector with no rows behind it is removed
    await vec.upsert([("ghost", q, {"kind": "thought", "parent_id": "gone"})])
    assert await reconcile_org(sql, vec, fresh) == (0, 1)
    assert await vec.get_by_ids(["ghost"]) == []
    await fresh.close()


async def test_a_chunk_deleted_while_embedding_leaves_no_vector(tmp_path, db):
    emb = HashEmbedder()
    index = LocalVectorIndex(None, dimensions=emb.dimensions, model=emb.model_id)
    t = await _thoughts(db, index, emb)

    class DeletingEmbedder(HashEmbedder):
        async def embed(self, texts):
            out = await super().embed(texts)
            await db.execute("DELETE FROM documents WHERE organization_id = 'org_a'")
            return out

    res = await t.capture("short lived note")
    await JobWorker(db, index, DeletingEmbedder()).drain()
    assert await OrgVectors(index, "org_a").query((await emb.embed(["short lived note"]))[0], top_k=5) == []
    assert res.id
