"""Running out of disk: 507 with the real cause, nothing half-written, the worker pauses, and every job completes
once space returns.

Two ways to fill a disk deterministically: SQLite's ``max_page_count`` (the store cannot grow past its pages:
SQLITE_FULL, the same error a full disk gives) for the adapter; a small tmpfs filled with a filler file (a real
ENOSPC) for the whole service, when the sandbox lets us mount one (root); skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from services.adapters.sqlite import SqliteDatabase
from services.errors import InsufficientStorage
from services.ports import Statement
from tests.conftest import assert_error, signup, start_live
from tests.test_delete_races import Instrumented

WAIT = 60.0


@pytest.mark.parametrize("message", ["D1_ERROR: database or disk is full: SQLITE_FULL", "D1_ERROR: Exceeded maximum DB size"])
async def test_a_full_d1_database_is_insufficient_storage(message):
    from services.adapters.cloudflare.d1 import D1Database
    from tests.test_cloudflare_adapters import Recorder, error, make_api

    rec = Recorder(error(400, message))
    api, _ = make_api(rec)
    with pytest.raises(InsufficientStorage) as caught:
        await D1Database(api, "db1").execute("INSERT INTO t (id) VALUES (?)", ["a"])
    assert caught.value.details["reason"] == message and len(rec.requests) == 1


async def test_a_full_store_refuses_the_whole_batch_with_its_cause(tmp_path):
    db = SqliteDatabase(tmp_path / "full.sqlite3")
    try:
        await db.executescript("CREATE TABLE t (v TEXT NOT NULL)")
        await db.execute("INSERT INTO t VALUES ('kept')")
        pages = db._writer.execute("PRAGMA page_count").fetchone()[0]
        db._writer.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(InsufficientStorage) as caught:
            await db.batch([Statement("INSERT INTO t VALUES ('small')"), Statement("INSERT INTO t VALUES (?)", ("x" * 200_000,))])
        assert caught.value.status == 507 and caught.value.code == "insufficient_storage"
        assert "full" in caught.value.details["reason"]  # SQLite's own message, not a ROLLBACK's
        assert not db._writer.in_transaction
        with pytest.raises(InsufficientStorage):
            await db.execute("INSERT INTO t VALUES (?)", ("y" * 200_000,))
        assert (await db.execute("SELECT v FROM t")).rows == [{"v": "kept"}]  # nothing half-written
        db._writer.execute("PRAGMA max_page_count = 1073741823")  # space returns
        await db.batch([Statement("INSERT INTO t VALUES (?)", ("x" * 200_000,))])
        assert (await db.execute("SELECT COUNT(*) AS n FROM t")).rows == [{"n": 2}]
    finally:
        await db.close()


async def test_the_worker_pauses_on_a_full_index_and_drains_when_space_returns(tmp_path):
    """The vector file cannot grow: the worker holds its jobs (no attempt counted, none failed), pauses, and
    indexes everything once the file may grow again."""
    import asyncio

    from services.adapters.hash_embedder import HashEmbedder
    from services.adapters.local_vectors import LocalVectorIndex
    from services.storage.migrate import CONTROL_DIR, apply_pending
    from services.storage.stores import EmbeddedOrgStores
    from services.thoughts.thoughts import Thoughts
    from services.jobs.worker import JobWorker
    from tests.stores import add_org, job_handlers

    emb = HashEmbedder()
    control = SqliteDatabase(tmp_path / "control.sqlite3")
    opened: dict[Path, LocalVectorIndex] = {}

    def open_index(path):  # the organization's vector file, kept at hand to cap its size
        opened[path] = LocalVectorIndex(path, dimensions=emb.dimensions, model=emb.model_id)
        return opened[path]

    stores = EmbeddedOrgStores(control, tmp_path, dimensions=emb.dimensions,
                               open_database=lambda path: SqliteDatabase(path, readers=2), open_index=open_index)
    worker = JobWorker(stores, emb, handlers=job_handlers(), poll_seconds=0.05)
    try:
        await apply_pending(control, CONTROL_DIR)
        await add_org(control, stores, "org_full")
        store = await stores.open("org_full")
        db = store.db  # the organization's own database: its jobs and chunks
        thoughts = Thoughts(store.sql, store.vectors, emb, on_enqueue=lambda: worker.wake("org_full"))
        for i in range(12):  # more vectors than the file's free pages hold
            await thoughts.capture(f"Note {i}: the disk of the build cache fills up every Friday. " * 60)
        await store.index.info()  # open the vector file
        index = opened[tmp_path / "orgs" / "org_full" / "vectors.sqlite3"]
        with index._write_lock:
            pages = index._db.execute("PRAGMA page_count").fetchone()[0]
            index._db.execute(f"PRAGMA max_page_count = {pages}")
        worker.start()
        for _ in range(2000):
            if worker.paused:
                break
            await asyncio.sleep(0.01)
        assert worker.paused and "full" in worker.paused
        jobs = (await db.execute("SELECT state, attempts FROM jobs WHERE kind = 'embed'")).rows
        assert jobs and all(j["state"] == "pending" and j["attempts"] <= 1 for j in jobs) and worker.failed == 0
        with index._write_lock:
            index._db.execute("PRAGMA max_page_count = 1073741823")  # space returns
        worker.wake()
        for _ in range(2000):
            left = (await db.execute("SELECT COUNT(*) AS n FROM chunks WHERE indexed_at IS NULL")).rows[0]["n"]
            if not left and not await worker.pending() and worker.paused is None:
                break
            await asyncio.sleep(0.01)
        assert worker.paused is None and await worker.pending() == 0 and left == 0
        assert (await db.execute("SELECT COUNT(*) AS n FROM jobs WHERE state = 'failed'")).rows == [{"n": 0}]
        assert (await db.execute("SELECT COUNT(*) AS n FROM jobs")).rows == [{"n": 0}]  # every job completed
        assert len(await index.ids_in_namespace("org_full")) > 0
    finally:
        await worker.stop()
        await stores.close()
        await control.close()


@pytest.fixture
def small_disk():
    """A 24 MiB tmpfs (root only); yields its path and unmounts it afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = Path(tempfile.mkdtemp(prefix="memex-full-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True).returncode:
        mnt.rmdir()
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def _fill(path: Path) -> None:
    """Write until the file system refuses (ENOSPC)."""
    with open(path, "wb", buffering=0) as f:
        block = b"\0" * 65536
        try:
            while True:
                f.write(block)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def _until(what: str, check, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _text(i: int) -> str:
    return f"Disk-full note {i}: the backup rotation of cluster {i} moves to Thursday night. " * 20


def test_a_full_disk_answers_507_pauses_the_worker_and_recovers(small_disk):
    live, ctx = start_live(small_disk / "data", embedder="hash")
    try:
        org = signup(live, "disk")
        with live.client() as http:
            ids = []
            with Instrumented(live, org.id) as ix:
                # the worker is held at its first upsert: the next captures' jobs stay pending
                for i in range(3):
                    r = http.post("/v1/thoughts", json={"content": _text(i)}, headers=org.headers)
                    assert r.status_code == 201, r.text
                    ids.append(r.json()["id"])
                    assert ix.upsert.reached.wait(WAIT)
                # the organization's own database holds its thoughts and jobs (data/orgs/<org>/memex.sqlite3)
                wal = small_disk / "data" / "orgs" / live.org_location(org.id) / "memex.sqlite3-wal"
                wal_before = wal.stat().st_size
                _fill(small_disk / "filler")
                health = http.get("/health").json()
                assert health["free_bytes"] is not None and health["free_bytes"] < 1 << 20

                err = assert_error(http.post("/v1/thoughts", json={"content": _text(99)}, headers=org.headers),
                                   507, "insufficient_storage")
                assert "full" in err["details"]["reason"]
                # nothing half-written: no row of the refused capture, the acknowledged ones all there
                assert live.sql("SELECT COUNT(*) FROM documents WHERE content = ?", (_text(99),)) == [(0,)]
                assert live.sql("SELECT COUNT(*) FROM documents WHERE organization_id = ?", (org.id,)) == [(3,)]
                ix.upsert.release.set()  # the worker's vector write now meets the full disk

            health = _until("the worker to pause", lambda: (h := http.get("/health").json())["worker_paused"] and h)
            assert health["status"] == "degraded" and health["pending_jobs"] > 0
            # paused, not failing: no job marked failed, no attempt burnt beyond the claims
            assert live.sql("SELECT COUNT(*) FROM jobs WHERE state = 'failed'") == [(0,)]
            attempts = live.sql("SELECT MAX(attempts) FROM jobs WHERE organization_id = ?", (org.id,))[0][0]
            assert attempts is None or attempts <= 1

            (small_disk / "filler").unlink()  # space returns
            r = http.post("/v1/thoughts", json={"content": _text(4)}, headers=org.headers)
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])

            def drained():
                h = http.get("/health").json()
                return h["status"] == "ok" and h["pending_jobs"] == 0 and not h["worker_paused"]

            _until("every pending job to complete", drained)
            # resuming checkpointed the write-ahead log into the database and truncated it
            assert wal.stat().st_size < wal_before
            for tid in ids:
                assert live.wait_indexed(org.headers, tid)["indexing"]["state"] == "indexed", tid
            assert live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ?", (org.id,)) == [(0,)]
            hit = http.post("/v1/search", json={"query": "backup rotation Thursday"}, headers=org.headers)
            assert hit.status_code == 200 and hit.json()["results"], hit.text
    finally:
        ctx.__exit__(None, None, None)
