"""The SQL port on SQLite (D1's semantics), migrations as wrangler records them (the control, organization
and legacy streams), the org-bound handles on each organization's own database, and the job worker's
durability: jobs survive restarts, a lost vector index is rebuilt from SQL."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from services.adapters.hash_embedder import HashEmbedder
from services.adapters.local_vectors import LocalVectorIndex
from services.adapters.sqlite import SqliteDatabase
from services.errors import InvalidInput
from services.storage.migrate import CONTROL_DIR, LEGACY_DIR, ORG_DIR, apply_pending, discover
from services.ports import Statement
from services.storage.scoped import OrgVectors
from services.thoughts.thoughts import Thoughts
from services.jobs.worker import JobWorker
from services.search.indexing import reconcile_org
from tests.stores import job_handlers, make_stores


@pytest.fixture
async def env(tmp_path):
    """The control database and two organizations, each with its own database and vector file."""
    emb = HashEmbedder()
    control, stores = await make_stores(tmp_path, emb)
    yield control, stores, emb
    await stores.close()
    await control.close()


@pytest.mark.parametrize("directory", [CONTROL_DIR, ORG_DIR, LEGACY_DIR], ids=["control", "org", "legacy"])
async def test_migrations_are_recorded_like_wrangler_and_run_once(tmp_path, directory):
    d = SqliteDatabase(tmp_path / "w.sqlite3")
    applied = await apply_pending(d, directory)
    assert applied == [m.name for m in discover(directory)] and applied
    assert await apply_pending(d, directory) == []
    cols = {r["name"]: r for r in (await d.execute("PRAGMA table_info(d1_migrations)")).rows}
    assert set(cols) == {"id", "name", "applied_at"}
    names = [r["name"] for r in (await d.execute("SELECT name FROM d1_migrations ORDER BY id")).rows]
    assert names == applied
    await d.close()


async def test_the_default_stream_is_the_organizations_and_streams_do_not_mix(tmp_path):
    org = SqliteDatabase(tmp_path / "org.sqlite3")
    assert await apply_pending(org) == [m.name for m in discover(ORG_DIR)] == [m.name for m in discover()]
    control = SqliteDatabase(tmp_path / "control.sqlite3")
    await apply_pending(control, CONTROL_DIR)
    tables = {}
    for name, d in (("org", org), ("control", control)):
        tables[name] = {r["name"] for r in (await d.execute("SELECT name FROM sqlite_master WHERE type='table'")).rows}
    assert {"organizations", "api_keys", "llm_usage", "org_databases"} <= tables["control"]
    assert {"documents", "chunks", "jobs"} <= tables["org"]
    assert not {"organizations", "api_keys", "llm_usage", "org_databases"} & tables["org"]
    assert not {"documents", "chunks", "jobs"} & tables["control"]
    await org.close()
    await control.close()


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


async def test_batch_is_atomic(env):
    db = env[0]  # the control database
    with pytest.raises(sqlite3.IntegrityError):
        await db.batch([
            Statement("INSERT INTO organizations (id, slug, name, created_at) VALUES ('org_c', 'c', 'C', 1)"),
            Statement("INSERT INTO organizations (id, slug, name, created_at) VALUES ('org_d', 'c', 'D', 1)"),
        ])
    assert (await db.execute("SELECT COUNT(*) AS n FROM organizations WHERE id IN ('org_c', 'org_d')")).rows[0]["n"] == 0
    with pytest.raises(InvalidInput):
        await db.execute("BEGIN")


async def test_org_handle_reaches_only_its_own_database(env):
    # The per-organization database is the wall now: a statement without the tenant filter is no longer
    # refused, it simply cannot see another organization's rows. ?1 is still bound to the organization's id;
    # bare ? parameters and batch statements not bound to the organization are still refused.
    _, stores, emb = env
    a, b = await stores.open("org_a"), await stores.open("org_b")
    theirs = await Thoughts(b.sql, b.vectors, emb).capture("org b's private note about harbours")
    ours = await Thoughts(a.sql, a.vectors, emb).capture("org a's note about lighthouses")
    sql = a.sql
    assert await sql.rows("SELECT id, ?1 AS bound FROM documents") == [{"id": ours.id, "bound": "org_a"}]
    assert await sql.rows("SELECT id, ?1 FROM documents WHERE id = ?2", [theirs.id]) == []
    with pytest.raises(AssertionError):
        await sql.rows("SELECT * FROM documents WHERE organization_id = ?1 AND id = ?", ["x"])
    with pytest.raises(AssertionError):
        await sql.batch([Statement("DELETE FROM documents WHERE organization_id = ?1", ("org_b",))])
    await sql.execute("DELETE FROM documents WHERE ?1 IS NOT NULL")  # unfiltered: stays in org_a's database
    assert [r["id"] for r in await b.sql.rows("SELECT id FROM documents WHERE organization_id = ?1")] == [theirs.id]
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


async def _thoughts(stores, emb, org="org_a"):
    store = await stores.open(org)
    return Thoughts(store.sql, store.vectors, emb)


async def test_jobs_survive_a_restart_and_finish(env):
    _, stores, emb = env
    t = await _thoughts(stores, emb)
    res = await t.capture("durable note about lighthouses")
    assert res.indexing.state == "pending"
    # the service "crashes" before the worker ran: a new worker (new process) finds the job in the
    # organization's database and runs it
    worker = JobWorker(stores, emb, handlers=job_handlers())
    await worker.drain()
    assert (await t.get(res.id)).indexing.state == "indexed"
    for org in ("org_a", "org_b"):
        assert (await (await stores.open(org)).db.execute("SELECT COUNT(*) AS n FROM jobs")).rows[0]["n"] == 0


async def test_a_failing_embedder_is_retried_with_backoff(tmp_path):
    class Flaky(HashEmbedder):
        calls = 0

        async def embed(self, texts):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("model crashed")
            return await super().embed(texts)

    emb = Flaky()
    control, stores = await make_stores(tmp_path, emb)
    t = await _thoughts(stores, emb)
    res = await t.capture("note that needs two tries")
    db = (await stores.open("org_a")).db
    worker = JobWorker(stores, emb, handlers=job_handlers())
    await worker.scan()  # a new worker finds the queued job
    await worker.run_once()
    row = (await db.execute("SELECT state, attempts, last_error, run_after FROM jobs")).rows[0]
    assert row["state"] == "pending" and row["attempts"] == 1 and "crashed" in row["last_error"]
    assert await worker.run_once() == 0  # not before the backoff ends
    await db.execute("UPDATE jobs SET run_after = 0")  # skip the backoff wait
    worker.wake("org_a")
    await worker.run_once()
    assert (await t.get(res.id)).indexing.state == "indexed"
    await stores.close()
    await control.close()


async def test_a_failed_job_is_retried_when_its_backoff_ends_without_a_wake(tmp_path, monkeypatch):
    """The worker's own schedule brings a failed job back: whatever moment its rounds fall on, no round between the
    failure and the job's run_after may forget the organization (a job then waited for the next restart)."""
    import services.jobs.worker as worker_module

    class Flaky(HashEmbedder):
        calls = 0

        async def embed(self, texts):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("model crashed")
            return await super().embed(texts)

    clock, ticking = [1_800_000_000_000], [True]

    def now_ms() -> int:  # while the job fails, time moves on between any two readings, as on a busy machine
        clock[0] += 5 if ticking[0] else 0
        return clock[0]

    monkeypatch.setattr(worker_module, "now_ms", now_ms)
    emb = Flaky()
    control, stores = await make_stores(tmp_path, emb)
    t = await _thoughts(stores, emb)
    res = await t.capture("note that fails once")
    db = (await stores.open("org_a")).db
    worker = JobWorker(stores, emb, handlers=job_handlers())
    await worker.scan()
    await worker.run_once()
    ticking[0] = False
    run_after = (await db.execute("SELECT run_after FROM jobs")).rows[0]["run_after"]
    for moment in range(run_after - 40, run_after + 40):  # a round at every millisecond around the retry
        clock[0] = moment
        await worker.run_once()
    assert (await t.get(res.id)).indexing.state == "indexed"
    await stores.close()
    await control.close()


async def test_a_retry_survives_a_wake_that_comes_before_it(tmp_path, monkeypatch):
    """A capture (a wake) between a job's failure and its retry time: the round the wake causes runs the new job and
    must still keep the failed one's retry (it used to drop it, leaving the job to wait for the next restart)."""
    import services.jobs.worker as worker_module

    class FailsFirst(HashEmbedder):
        calls = 0

        async def embed(self, texts):
            FailsFirst.calls += 1
            if FailsFirst.calls == 1:
                raise RuntimeError("model crashed")
            return await super().embed(texts)

    clock = [1_800_000_000_000]
    monkeypatch.setattr(worker_module, "now_ms", lambda: clock[0])
    emb = FailsFirst()
    control, stores = await make_stores(tmp_path, emb)
    t = await _thoughts(stores, emb)
    first = await t.capture("the note whose embedding fails once")
    worker = JobWorker(stores, emb, handlers=job_handlers())
    await worker.scan()
    await worker.run_once()  # the embedding fails: retried after its backoff
    clock[0] += 10
    second = await t.capture("another note, captured before the retry is due")
    worker.wake("org_a")
    await worker.run_once()  # the wake's round: the new note's job runs, the failed one is not due yet
    assert (await t.get(second.id)).indexing.state == "indexed"
    assert (await t.get(first.id)).indexing.state == "pending"
    clock[0] += 600_000  # long after the backoff
    await worker.run_once()
    assert (await t.get(first.id)).indexing.state == "indexed"
    await stores.close()
    await control.close()


async def test_a_deferred_job_waits_uncounted_and_runs_later(tmp_path, monkeypatch):
    """A handler that cannot run its job yet (another process holds what it needs) defers it: the job waits its delay,
    the attempt is not counted against it, and the worker runs it once the delay has passed, with no wake."""
    import services.jobs.worker as worker_module
    from services.jobs.worker import JobDeferred

    clock = [1_800_000_000_000]
    monkeypatch.setattr(worker_module, "now_ms", lambda: clock[0])
    emb = HashEmbedder()
    control, stores = await make_stores(tmp_path, emb)
    sql = (await stores.open("org_a")).sql
    await sql.execute("INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) VALUES (?1, 'x', 't', 0, 0)")
    ran: list[int] = []

    async def busy_then_free(sql, vectors, embedder, job):
        ran.append(job.attempts)
        if len(ran) < 4:
            raise JobDeferred("held elsewhere", delay_ms=1000)

    worker = JobWorker(stores, emb, handlers={"x": busy_then_free})
    await worker.scan()
    for _ in range(4):
        await worker.run_once()
        assert await worker.run_once() == 0  # not before its delay
        clock[0] += 1000
    assert ran == [1, 1, 1, 1]  # never counted: a deferral is not a failure
    assert (await sql.rows("SELECT COUNT(*) AS n FROM jobs WHERE organization_id = ?1"))[0]["n"] == 0
    await stores.close()
    await control.close()


async def test_lost_vector_index_is_rebuilt_from_sql(tmp_path, env):
    _, stores, emb = env
    t = await _thoughts(stores, emb)
    res = await t.capture("the lighthouse keeper logs the weather at dawn")
    await JobWorker(stores, emb, handlers=job_handlers()).drain()
    await stores.close()  # the service stops; the organization's vector file is lost
    path = tmp_path / "orgs" / "org_a" / "vectors.sqlite3"
    assert path.exists()
    path.unlink()
    store = await stores.open("org_a")  # the service starts again: a fresh, empty vector file
    t = Thoughts(store.sql, store.vectors, emb)
    sql, vec = store.sql, store.vectors
    assert await reconcile_org(sql, vec, store.index) == (1, 0)
    assert (await t.get(res.id)).indexing.state == "pending"
    await JobWorker(stores, emb, handlers=job_handlers()).drain()
    q = (await emb.embed(["lighthouse keeper weather"]))[0]
    assert [m.metadata["parent_id"] for m in await vec.query(q, top_k=1, return_metadata=True)] == [res.id]
    # a stray vector with no rows behind it is removed
    await vec.upsert([("ghost", q, {"kind": "thought", "parent_id": "gone"})])
    assert await reconcile_org(sql, vec, store.index) == (0, 1)
    assert await vec.get_by_ids(["ghost"]) == []


async def test_a_chunk_deleted_while_embedding_leaves_no_vector(env):
    _, stores, emb = env
    t = await _thoughts(stores, emb)
    store = await stores.open("org_a")

    class DeletingEmbedder(HashEmbedder):
        async def embed(self, texts):
            out = await super().embed(texts)
            await store.db.execute("DELETE FROM documents WHERE organization_id = 'org_a'")
            return out

    res = await t.capture("short lived note")
    await JobWorker(stores, DeletingEmbedder(), handlers=job_handlers()).drain()
    assert await store.vectors.query((await emb.embed(["short lived note"]))[0], top_k=5) == []
    assert await store.index.ids_in_namespace("org_a") == set() and res.id  # no vector at all in its file


async def test_read_now_reads_on_the_calling_thread_and_steps_aside_when_it_cannot(tmp_path):
    """``read_now`` (a search's hydration, on the event loop): the rows ``execute`` gives; None for a statement that
    writes (nothing written), while its reader is in another thread's hands, on a closed database, and through a
    pooled handle not open yet (which it does not open); the caller then reads as usual."""
    import threading

    from services.storage.pool import HandlePool, PooledDatabase
    from services.storage.scoped import OrgSql

    db = SqliteDatabase(tmp_path / "now.sqlite3")
    await db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, org TEXT, v TEXT)")
    await db.execute("INSERT INTO t VALUES (1, 'o1', 'a'), (2, 'o1', 'b'), (3, 'o2', 'c')")
    sql = "SELECT id, v FROM t WHERE org = ?1 ORDER BY id"
    now = db.read_now(sql, ["o1"])
    assert now is not None and now.rows == (await db.execute(sql, ["o1"])).rows == [{"id": 1, "v": "a"},
                                                                                       {"id": 2, "v": "b"}]
    assert OrgSql(db, "o2").rows_now(sql) == [{"id": 3, "v": "c"}]  # bound to its organization like ``rows``
    assert db.read_now("INSERT INTO t VALUES (4, 'o1', 'd')") is None
    assert db.read_now("UPDATE t SET v = 'x' RETURNING id") is None
    assert (await db.execute("SELECT count(*) AS n FROM t WHERE v IN ('d', 'x')")).rows == [{"n": 0}]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with db._now_lock:  # another thread in the middle of a read_now
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        assert db.read_now(sql, ["o1"]) is None
    finally:
        release.set()
        t.join()
    assert db.read_now(sql, ["o1"]) is not None
    await db.close()
    assert db.read_now(sql, ["o1"]) is None

    pooled = PooledDatabase(HandlePool(4), lambda: SqliteDatabase(tmp_path / "now.sqlite3"))
    assert pooled.read_now(sql, ["o1"]) is None and not pooled.is_open
    await pooled.execute("SELECT 1")
    assert pooled.read_now(sql, ["o1"]).rows == now.rows
    await pooled.close()
    assert pooled.read_now(sql, ["o1"]) is None
