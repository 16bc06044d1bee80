"""Isolation you can prove: nothing organization B does moves organization A's figures.

With every tenant in one database, BM25's document frequencies and average lengths were computed over all
tenants: A's keyword score for "falcon" changed when B wrote notes about falcons, which told A whether a word
occurred in B's notes. Each organization now has its own database (and vector file); this test has B write,
delete, search, converse and export heavily with A's own words (and a third organization import B's bundle), and
checks that A's search results and every figure
of their explain output (keyword score, cosine, coverage, rank, each multiplier) are exactly what they were,
that A's ids are unchanged, and that A's database file is byte-for-byte untouched (so nothing about A's
searches, their timing included, can depend on B's data; on the Worker backend, where A's database is a Durable
Object with no file to hash, every row of every table of it, read through the Worker)."""

from __future__ import annotations

import hashlib
import time

import pytest

from tests.conftest import Live, signup

A_NOTES = [
    "The peregrine falcon nests on the north tower of the cathedral every spring.",
    "Falcon telemetry shows the pair hunting pigeons over the river at dawn.",
    "Cathedral roof repairs are scheduled for late autumn, after the falcon chicks fledge.",
    "Budget review: the roof scaffolding quote came in at forty thousand euros.",
    "The ringing team will visit the falcon nest box in May to band the chicks.",
]
QUERIES = ["falcon", "falcon nest on the cathedral", "roof repairs budget", "ringing the chicks", "pigeons"]
# B writes A's words, lots of them: every term of A's queries, in many documents of varied length.
B_NOTES = [f"Falcon {i}: falcon falcon nest cathedral roof chicks pigeons budget " + "ringing " * (i % 7) for i in range(40)]


def _moving_parts(explain: dict) -> dict:
    """Age, recency and decayed use weights move with the clock between two searches (by less than 1e-6
    in a minute), whoever writes what; everything else in explain must not move at all."""
    out = {k: v for k, v in explain.items() if k not in ("age_days", "score")}
    for k in ("recency", "frequency", "uses_now"):
        if isinstance(out.get(k), float):
            out[k] = round(out[k], 4)
    return out


def _search(live: Live, org, query: str) -> list[tuple]:
    with live.client() as c:
        r = c.post("/v1/search", json={"query": query, "explain": True, "top_k": 10}, headers=org.headers)
        assert r.status_code == 200, r.text
    return [(h["document_id"], h["chunk_id"], _moving_parts(h["explain"])) for h in r.json()["results"]]


def _digest(live: Live, org_id: str) -> str:
    if live.backend == "worker":  # a Durable Object has no file to hash: every row of every table, read through it
        return live.content_digest(org_id)  # type: ignore[attr-defined]  # tests.worker_live.WorkerLive
    path = live.org_db_paths()[org_id]
    h = hashlib.sha256()
    for p in (path, path.with_name(path.name + "-wal")):
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()


def _ids(live: Live, org) -> list[str]:
    with live.client() as c:
        r = c.get("/v1/thoughts", params={"limit": 100}, headers=org.headers)
        assert r.status_code == 200, r.text
    return sorted(t["id"] for t in r.json()["thoughts"])


def _wait_idle(live: Live, org_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not live.sql("SELECT COUNT(*) FROM jobs WHERE organization_id = ?", (org_id,))[0][0] and not live.memex.worker.busy:
            return
        time.sleep(0.05)
    pytest.fail("the worker did not finish")


def test_nothing_b_does_moves_a_scores_explain_ids_or_files(live: Live):
    a, b = signup(live, "iso-a"), signup(live, "iso-b")
    if live.backend == "worker":  # one Durable Object each
        assert (live.org_location(a.id), live.org_location(b.id)) == (f"org:{a.id}", f"org:{b.id}")
    else:  # one database each: a file under orgs/, or a D1 database of its own
        paths = live.org_db_paths()
        assert paths[a.id] != paths[b.id] and paths[a.id].exists() and paths[b.id].exists()
    if live.backend == "cloudflare":
        import httpx

        with httpx.Client(headers=live.emulator.headers, timeout=30) as c:
            names = {d["name"] for d in c.get(f"{live.emulator.account_url}/d1/database",
                                              params={"per_page": 1000}).json()["result"]}
        assert {f"memex-{a.id}", f"memex-{b.id}"} <= names
    with live.client() as c:
        for note in A_NOTES:
            r = c.post("/v1/thoughts", json={"content": note}, headers=a.headers)
            assert r.status_code == 201, r.text
            live.wait_indexed(a.headers, r.json()["id"])
    _wait_idle(live, a.id)
    # waiting above fetched each note by id: one use each, written in the background; let them land first
    deadline = time.monotonic() + 10
    while live.sql("SELECT SUM(use_count) FROM documents WHERE organization_id = ?", (a.id,)) != [(len(A_NOTES),)]:
        assert time.monotonic() < deadline, "A's uses were not recorded"
        time.sleep(0.05)
    before = {q: _search(live, a, q) for q in QUERIES}
    assert before["falcon"] and all(hit[2].get("keyword_score") for hit in before["falcon"][:1]), before["falcon"]
    ids_before, file_before = _ids(live, a), _digest(live, a.id)

    with live.client() as c:
        made = []
        for note in B_NOTES:
            r = c.post("/v1/thoughts", json={"content": note}, headers=b.headers)
            assert r.status_code == 201, r.text
            made.append(r.json()["id"])
        for tid in made[::3]:
            assert c.delete(f"/v1/thoughts/{tid}", headers=b.headers).status_code == 204
        conv = c.post("/v1/conversations", json={"title": "falcons"}, headers=b.headers).json()["id"]
        r = c.post(f"/v1/conversations/{conv}/messages", headers=b.headers,
                   json={"messages": [{"role": "user", "content": n} for n in B_NOTES[:12]]})
        assert r.status_code in (200, 201), r.text
        for q in QUERIES:
            assert c.post("/v1/search", json={"query": q}, headers=b.headers).status_code == 200
        # and an import: B's notes, exported and imported into a third organization
        bundle = c.get("/v1/org/export", headers=b.headers)
        assert bundle.status_code == 200, bundle.text
        c3 = signup(live, "iso-c")
        r = c.post("/v1/org/import", content=bundle.content,
                   headers={**c3.headers, "content-type": "application/x-ndjson"})
        assert r.status_code == 200, r.text
    live.wait_indexed(b.headers, made[-2])  # made[-1] was deleted
    _wait_idle(live, b.id)
    _wait_idle(live, c3.id)

    after = {q: _search(live, a, q) for q in QUERIES}
    for q in QUERIES:  # same hits, same order, same keyword scores, cosines, coverage and factors
        assert [h[:2] for h in after[q]] == [h[:2] for h in before[q]], q
        for (_, _, was), (_, _, now) in zip(before[q], after[q], strict=True):
            moved = {k: (was.get(k), now.get(k)) for k in was.keys() | now.keys() if was.get(k) != now.get(k)}
            assert not moved, (q, moved)
    assert _ids(live, a) == ids_before
    assert _digest(live, a.id) == file_before  # A's database was not written by anything B did

    # and B, searching the same words, sees only its own notes
    with live.client() as c:
        hits = c.post("/v1/search", json={"query": "falcon", "top_k": 50}, headers=b.headers).json()["results"]
    assert hits and not {h["document_id"] for h in hits} & set(ids_before)
