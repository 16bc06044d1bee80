"""A delete leaves no vector behind whatever the job worker is doing at that moment, on both backends.

The interleavings are forced, not hoped for: the real vector index of the running service is instrumented
so that one chosen call waits on a ``threading.Event`` (off the event loop, so the service keeps serving)
until the test releases it. No sleeps, no timing: every wait is for a condition.

* the worker has embedded a parent's chunks and is about to upsert; the delete runs to completion; then the
  upsert goes through (the worker must notice the rows are gone and delete its vectors again);
* the worker is about to upsert; the delete has deleted the vectors but not yet the rows; the worker
  upserts and marks its chunks indexed (the rows are still there); then the delete deletes the rows (it must
  delete the vectors again after the rows: the worker's upsert came after its first vector delete).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import signup
from tests.test_conversations import _create, _append, _footprint, _msgs, _vectors, _wait_no_jobs

WAIT = 30.0


class Hold:
    """Holds the first matching call of a real index method until released."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.armed = True

    async def hold(self) -> None:
        self.armed = False
        self.reached.set()
        await asyncio.to_thread(self.release.wait, WAIT)  # the event loop keeps serving meanwhile


def org_index(live, org_id: str):
    """The vector index the running service uses for the organization (its own vector file embedded, the
    shared Vectorize index on Cloudflare): the organization's store, opened on the server's event loop."""
    loop = live.memex.worker._task.get_loop()
    return asyncio.run_coroutine_threadsafe(live.memex.stores.open(org_id), loop).result(WAIT).index


class Instrumented:
    """The organization's vector index with two holds: before the worker's upsert of an organization's
    vectors, and after the first delete of that organization's vectors once ``delete.armed`` is set."""

    def __init__(self, live, org_id: str) -> None:
        self.index = org_index(live, org_id)
        self.prefix = f"{org_id}:"
        self.upsert, self.delete = Hold(), Hold()
        self.delete.armed = False
        self._upsert, self._delete = self.index.upsert, self.index.delete_by_ids

    def ours(self, ids) -> bool:
        return any(i.startswith(self.prefix) for i in ids)

    async def _held_upsert(self, vectors):
        if self.upsert.armed and self.ours(v.id for v in vectors):
            await self.upsert.hold()
        return await self._upsert(vectors)

    async def _held_delete(self, ids):
        out = await self._delete(ids)
        if self.delete.armed and self.ours(ids):
            await self.delete.hold()
        return out

    def __enter__(self):
        self.index.upsert, self.index.delete_by_ids = self._held_upsert, self._held_delete
        return self

    def __exit__(self, *exc):
        self.upsert.release.set()
        self.delete.release.set()
        del self.index.upsert, self.index.delete_by_ids  # the class's methods again


def _write(http, org, kind: str) -> str:
    if kind == "conversation":
        cid = _create(http, org)
        assert _append(http, org, cid, _msgs(20)).status_code in (200, 201)
        return cid
    r = http.post("/v1/thoughts", json={"content": "The staging database moved to the eu-west cluster. " * 8},
                  headers=org.headers)
    assert r.status_code in (200, 201), r.text
    return r.json()["id"]


def _delete(http, org, kind: str, pid: str) -> int:
    path = f"/v1/conversations/{pid}" if kind == "conversation" else f"/v1/thoughts/{pid}"
    return http.delete(path, headers=org.headers).status_code


def _left(live, org, pid) -> list[str]:
    return [v for v, (_, md) in _vectors(live, org.id).items() if md.get("parent_id") == pid]


@pytest.mark.parametrize("kind", ["conversation", "thought"])
def test_delete_while_the_worker_holds_embedded_vectors(hlive, kind):
    """The delete completes between the worker's embedding and its upsert."""
    org = signup(hlive, "race-a")
    with hlive.client() as http, Instrumented(hlive, org.id) as ix:
        pid = _write(http, org, kind)
        assert ix.upsert.reached.wait(WAIT), "the worker never reached its upsert"
        assert _delete(http, org, kind, pid) == 204  # served while the worker is held
        ix.upsert.release.set()
        _wait_no_jobs(hlive, org)
    assert _left(hlive, org, pid) == []
    if kind == "conversation":
        assert _footprint(hlive, org.id, pid)["chunks"] == 0


@pytest.mark.parametrize("kind", ["conversation", "thought"])
def test_worker_upserts_between_the_deletes_vector_and_row_writes(hlive, kind):
    """The worker upserts (and marks its chunks indexed) after the delete removed the vectors but before it
    removed the rows."""
    org = signup(hlive, "race-b")
    with hlive.client() as http, Instrumented(hlive, org.id) as ix, ThreadPoolExecutor(1) as pool:
        pid = _write(http, org, kind)
        assert ix.upsert.reached.wait(WAIT), "the worker never reached its upsert"
        ix.delete.armed = True
        deleting = pool.submit(_delete, http, org, kind, pid)
        assert ix.delete.reached.wait(WAIT), "the delete never deleted the vectors"
        ix.upsert.release.set()
        # the worker finishes its jobs while the delete is held: its chunks are marked indexed
        _wait_worker_done(hlive, org, kind, pid)
        ix.delete.release.set()
        assert deleting.result(WAIT) == 204
        _wait_no_jobs(hlive, org)
    assert _left(hlive, org, pid) == []


def _wait_worker_done(live, org, kind, pid) -> None:
    """Until every chunk of the parent is marked indexed, its jobs are done, and the worker is idle."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        pending = live.sql("SELECT COUNT(*) FROM chunks WHERE organization_id = ? AND parent_id = ? AND indexed_at IS NULL",
                           (org.id, pid))[0][0]
        indexed = live.sql("SELECT COUNT(*) FROM chunks WHERE organization_id = ? AND parent_id = ? AND indexed_at IS NOT NULL",
                           (org.id, pid))[0][0]
        jobs = live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ?", (org.id,))[0][0]
        if not pending and indexed and not jobs and not live.memex.worker.busy:
            return
        time.sleep(0.02)
    raise AssertionError(f"the worker did not finish the jobs of {kind} {pid}")


# -- queued and running jobs of a deleted parent -----------------------------------------------------------


def _jobs_of(live, org, pid) -> set[str]:
    return {k for (k,) in live.sql("SELECT kind FROM jobs WHERE organization_id = ? AND target_id = ?", (org.id, pid))}


@pytest.mark.parametrize("kind", ["conversation", "thought"])
def test_delete_cancels_every_queued_job_of_its_parent(hlive, kind):
    """Embed and enrich jobs alike: none is left queued for a deleted thought or conversation."""
    org = signup(hlive, "race-jobs")
    with hlive.client() as http, Instrumented(hlive, org.id) as ix:
        r = http.post("/v1/thoughts", json={"content": "The worker is held on this note's vectors. " * 8}, headers=org.headers)
        assert r.status_code == 201, r.text  # the worker takes this one's jobs and is held at its upsert
        assert ix.upsert.reached.wait(WAIT), "the worker never reached its upsert"
        # every later upsert of the organization is held too: on the Worker backend the worker may run the next
        # thought's round beside the held one, and would otherwise finish all of its jobs before they are looked at
        ix.upsert.armed = True
        pid = _write(http, org, kind)  # its jobs queue behind the held batch
        queued = _jobs_of(hlive, org, pid)
        if hlive.backend == "worker" and kind == "thought":
            # the Worker backend runs a round's stages side by side: the enrichment may already be done, the
            # embedding (held behind the first thought's upsert) may not
            assert "embed" in queued and queued <= {"embed", "enrich"}, queued
        else:
            assert queued == ({"embed", "enrich"} if kind == "thought" else {"embed"})
        assert _delete(http, org, kind, pid) == 204
        assert _jobs_of(hlive, org, pid) == set()
        ix.upsert.release.set()
        _wait_no_jobs(hlive, org)
    assert _left(hlive, org, pid) == []


class HeldFetch(Instrumented):
    """Also holds the first read of the organization's vectors by id (the enrichment, about to re-tag them):
    before the read, or after it (the vectors in hand)."""

    def __init__(self, live, org_id: str, *, after: bool) -> None:
        super().__init__(live, org_id)
        self.upsert.armed = False
        self.fetch = Hold()
        self.fetch.armed = False
        self.after = after
        self._get = self.index.get_by_ids

    async def _held_get(self, ids):
        held = self.fetch.armed and self.ours(ids)
        if held and not self.after:
            await self.fetch.hold()
        out = await self._get(ids)
        if held and self.after:
            await self.fetch.hold()
        return out

    def __enter__(self):
        super().__enter__()
        self.index.get_by_ids = self._held_get
        return self

    def __exit__(self, *exc):
        self.fetch.release.set()
        super().__exit__(*exc)
        del self.index.get_by_ids


@pytest.mark.parametrize("when", ["before", "after"])
def test_delete_while_an_enrich_job_is_mid_way(hlive, when):
    """An enrich job of an indexed thought has stored its tags and is about to re-tag its chunks' vectors
    (before reading them, or with them in hand) when the thought is deleted: no vector of it is left and no
    job is queued for it afterwards."""
    org = signup(hlive, "race-enrich")
    with hlive.client() as http, HeldFetch(hlive, org.id, after=when == "after") as ix:
        pid = _write(http, org, "thought")
        assert hlive.wait_indexed(org.headers, pid)["indexing"]["state"] == "indexed"
        _wait_no_jobs(hlive, org)
        # enrich it again, later than its embedding (as a model-backed enrichment retried after a failure is)
        hlive.sql("UPDATE documents SET enrichment_state = NULL WHERE id = ?", (pid,))
        hlive.sql("INSERT INTO jobs (organization_id, kind, target_id, run_after, created_at) VALUES (?, 'enrich', ?, 0, 0)",
                  (org.id, pid))
        ix.fetch.armed = True
        woke = http.post("/v1/thoughts", json={"content": "A note that wakes the worker up."}, headers=org.headers)
        assert woke.status_code == 201, woke.text
        assert ix.fetch.reached.wait(WAIT), "the enrichment never read the vectors"
        assert _delete(http, org, "thought", pid) == 204
        last_job = _last_job_id(hlive, org)
        ix.fetch.release.set()
        _wait_no_jobs(hlive, org)
        assert _last_job_id(hlive, org) == last_job  # no job was queued for it after its deletion
    assert _left(hlive, org, pid) == []


def _last_job_id(live, org) -> int:
    """The last job id handed out in the organization's own database (its jobs live there)."""
    return live.sql("SELECT COALESCE(MAX(seq), 0) FROM sqlite_sequence WHERE name = 'jobs'", org=org.id)[0][0]
