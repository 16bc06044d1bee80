"""Cloudflare REST requests per captured thought and per search (issue 13, item 5): the account's 1,200 requests per
5 minutes are the Cloudflare deployment's throughput, so what a capture and a search cost is what users get.

The whole service on a loopback port, on D1 + Vectorize + Workers AI served by tests/cloudflare_emulator (the
emulator's bge is a hash embedder: the counts are real), with the product defaults (write-time decisions on).
Requests are counted by the emulator; the queue is drained by reading the emulator's D1 files directly (a poll
through the service would itself cost requests). bench/bench_cloudflare.py measures the same at a larger scale.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.cloudflare_emulator import running_emulator
from tests.conftest import Live, provision_emulator, signup, start_live

#: The model id the service records for Workers AI's bge-base (model:pooling) and its dimensions.
MODEL, DIMS = "@cf/baai/bge-base-en-v1.5:mean", 768


def _notes(n: int, seed: int) -> list[str]:
    """Notes sharing most of their words (the lexical gate lets them through, so each costs its decision a vector
    query: the expensive case), each one distinct."""
    rng = random.Random(seed)
    teams = ["platform", "billing", "search", "mobile", "data", "growth"]
    things = ["quarterly roadmap", "incident review", "hiring plan", "budget sheet", "launch checklist"]
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
    names = ["Ana", "Bruno", "Chen", "Dara", "Emil", "Fatou", "Goran", "Hiro"]
    return [f"Note {i}: the {rng.choice(teams)} team agreed to move the {rng.choice(things)} to {rng.choice(days)} "
            f"after the offsite; {rng.choice(names)} owns it and will share the notes with {rng.choice(names)}."
            for i in range(n)]


@pytest.fixture(scope="module")
def cf_live():
    """The service with its worker, on the emulator, with Workers AI embeddings."""
    with tempfile.TemporaryDirectory() as tmp, \
            running_emulator(data_dir=Path(tmp) / "emulator", vector_lag_ms=0, rate_limit=1_000_000) as emu:
        server, ctx = start_live(Path(tmp) / "service", embedder="workers-ai",
                                 **provision_emulator(emu, dimensions=DIMS, model=MODEL))
        server.backend, server.emulator = "cloudflare", emu
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)


def _drain(live: Live, org_id: str, timeout: float = 120.0) -> None:
    """Until the organization has no pending job, no chunk waiting for its vector and no unconfirmed vector write
    (twice in a row), read from the emulator's files."""
    deadline = time.monotonic() + timeout
    calm = 0
    while calm < 2:
        assert time.monotonic() < deadline, "the job queue did not drain"
        jobs = live.sql("SELECT COUNT(*) FROM jobs WHERE state = 'pending'", org=org_id)[0][0]
        waiting = live.sql("SELECT COUNT(*) FROM chunks WHERE indexed_at IS NULL OR vector_mutation IS NOT NULL",
                           org=org_id)[0][0]
        calm = calm + 1 if jobs == 0 and waiting == 0 else 0
        time.sleep(0.05)
    time.sleep(0.3)  # the worker's last round settles


def _capture_all(live: Live, headers: dict, texts: list[str], clients: int) -> list[str]:
    ids: list[str] = []
    errors: list[str] = []

    def work(w: int) -> None:
        with live.client(headers=headers) as c:
            for text in texts[w::clients]:
                r = c.post("/v1/thoughts", json={"content": text, "source": "test"})
                if r.status_code != 201:
                    errors.append(r.text)
                else:
                    ids.append(r.json()["id"])

    threads = [threading.Thread(target=work, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    return ids


def test_a_bulk_import_costs_at_most_three_requests_per_thought(cf_live):
    org = signup(cf_live, "bulk")
    emu = cf_live.emulator
    seed = _notes(5, seed=1)  # an organization that has thoughts already (its decisions have something to compare)
    _capture_all(cf_live, org.headers, seed, 1)
    _drain(cf_live, org.id)
    n = 90
    emu.reset_counters()
    ids = _capture_all(cf_live, org.headers, _notes(n, seed=2), clients=3)
    _drain(cf_live, org.id)
    counts = emu.counters_snapshot()
    assert counts["by_status"].keys() == {"200"}, counts
    assert counts["total"] <= 3 * n, counts
    assert counts["ai"] <= n / 5, counts  # embeddings go in batches (a call per round, one more for the gate)
    assert counts["by_op"].get("vectorize.upsert", 0) <= n / 10, counts  # one NDJSON upsert per round
    # what the batching must not change: every thought stored, decided (none left pending) and searchable
    assert len(set(ids)) == n
    pending = cf_live.sql("SELECT COUNT(*) FROM documents WHERE decision = '{\"action\":\"pending\"}'", org=org.id)[0][0]
    assert pending == 0
    with cf_live.client(headers=org.headers) as c:
        body = c.get(f"/v1/thoughts/{ids[-1]}").json()
        assert body["indexing"]["state"] == "indexed" and body["decision"]["action"] != "pending"


def test_a_batch_import_costs_at_most_two_requests_per_thought(cf_live):
    org = signup(cf_live, "batch")
    emu = cf_live.emulator
    n = 100
    emu.reset_counters()
    with cf_live.client(headers=org.headers) as c:
        r = c.post("/v1/thoughts:batch", json={"items": [{"content": t} for t in _notes(n, seed=3)]})
        assert r.status_code == 200, r.text
        assert r.json()["created"] == n
    _drain(cf_live, org.id)
    counts = emu.counters_snapshot()
    # the write: one request per 50 thoughts (plus the content-hash lookup); the worker: a few per round, and one
    # vector query for each thought the lexical gate lets through (these notes share most of their words, so
    # nearly all of them: the expensive case)
    assert counts["total"] <= 2 * n, counts
    assert counts["d1"] <= n / 2, counts
    assert counts["ai"] <= n / 5, counts  # the round's texts in one call, and the gate's close ones in one more


def test_a_search_costs_one_embedding_one_vector_query_and_one_d1_request(cf_live):
    org = signup(cf_live, "search")
    emu = cf_live.emulator
    _capture_all(cf_live, org.headers, _notes(30, seed=4), 2)
    _drain(cf_live, org.id)
    queries = ["who owns the billing roadmap", "incident review moved to Friday", "hiring plan after the offsite",
               "launch checklist for the mobile team", "budget sheet owner", "data team quarterly roadmap"]
    with cf_live.client(headers=org.headers) as c:
        c.post("/v1/search", json={"query": "warm up", "top_k": 10}).raise_for_status()
        emu.reset_counters()
        for q in queries:
            r = c.post("/v1/search", json={"query": q, "top_k": 10})
            assert r.status_code == 200 and r.json()["results"], r.text
        counts = emu.counters_snapshot()
        s = len(queries)
        assert counts["ai"] == s and counts["vectorize"] == s, counts  # the query's embedding, one vector query
        # D1: one request, a batch of the keyword side's statement (which reads its hits' documents, chunks and
        # ranking features with them) and the same reading of the vector side's thoughts; at most one more over all
        # of them (the key-revocation check, at most every half second)
        assert counts["d1"] <= s + 1, counts
        assert counts["total"] <= 3 * s + 1, counts  # issue 13's aim: at most 3 REST requests per search
        emu.reset_counters()
        c.post("/v1/search", json={"query": queries[0], "top_k": 10}).raise_for_status()
        assert emu.counters_snapshot()["ai"] == 0  # a repeated query's embedding is cached


@pytest.fixture(scope="module")
def cf_no_worker():
    """The service without a worker (what the request path costs, alone), on its own emulator."""
    with tempfile.TemporaryDirectory() as tmp, \
            running_emulator(data_dir=Path(tmp) / "emulator", vector_lag_ms=0, rate_limit=1_000_000) as emu:
        server, ctx = start_live(Path(tmp) / "service", embedder="workers-ai", run_worker=False,
                                 **provision_emulator(emu, dimensions=DIMS, model=MODEL))
        server.backend, server.emulator = "cloudflare", emu
        try:
            yield server
        finally:
            ctx.__exit__(None, None, None)


def test_a_capture_is_acknowledged_after_one_request(cf_no_worker):
    live, emu = cf_no_worker, cf_no_worker.emulator
    org = signup(live, "ack")
    location = live.org_location(org.id)  # the organization's own D1 database
    with live.client(headers=org.headers) as c:
        assert c.post("/v1/thoughts", json={"content": "warm-up: the key is verified and cached"}).status_code == 201
        time.sleep(0.3)
        emu.reset_counters()
        r = c.post("/v1/thoughts", json={"content": "The staging database password rotates every Friday."})
        assert r.status_code == 201 and r.json()["decision"]["action"] == "pending"
        time.sleep(0.3)
        counts = emu.counters_snapshot()
        # the content-hash check and the write (document, chunks, jobs) in one request to the organization's
        # database; nothing else of the organization's, no vector, no model. (The control database may see the work
        # hint for other instances' workers, at most one a second per organization, written after the response,
        # and the key-revocation check, at most one every half second.)
        assert counts["by_database"].get(location) == 1 and counts["vectorize"] == 0 and counts["ai"] == 0, counts
        assert counts["d1"] <= 3, counts
        emu.reset_counters()
        again = c.post("/v1/thoughts", json={"content": "The staging database password rotates every Friday."})
        assert again.status_code == 200 and again.json()["id"] == r.json()["id"]
        assert again.json()["decision"]["action"] == "duplicate"
        assert again.json()["indexing"] == {"state": "pending", "chunks_total": 1, "chunks_indexed": 0}
        time.sleep(0.3)
        counts = emu.counters_snapshot()
        assert counts["by_database"].get(location) == 1 and counts["total"] <= 2, counts  # one request answers it
