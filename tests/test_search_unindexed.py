"""What an agent has just remembered comes back first, before its vector is in the index.

A capture is acknowledged once it is durable and keyword-searchable; its chunks are embedded by the job worker
afterwards (at once when idle, minutes later behind an import). Until then the keyword side finds the thought but
the vector side cannot, and fusion used to give it the vector side's floor: any thought close in meaning to the
query outranked it (a sequential capture-then-search of a unique word found the new thought in the top 5 for 8 of
100 captures with MiniLM). The search now embeds those hits' chunks itself and scores them exactly.

These tests run the service without its worker, so "not embedded yet" is a state, not a race: the seeds are
embedded by draining the worker on the app's own loop, the new capture is not.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest

from tests.conftest import backend_live, signup
from tests.kb_vault import GitVault, frontmatter

FERRIES = [
    "The ferry to the islands runs hourly in summer and every two hours in winter.",
    "Ferry tickets are cheaper when bought online the day before travel.",
    "The harbour ferry was cancelled twice last week because of the storm.",
    "Our team takes the early ferry to the conference and the late one back.",
    "The car ferry needs a booking for vehicles longer than five metres.",
    "Seasickness tablets help on the long ferry crossing in rough weather.",
    "The ferry terminal has a cafe and lockers for luggage.",
    "Bikes travel free on the ferry if they are stowed on the lower deck.",
]
TARGET = "The Tresco ferry leaves from pier three at 07:40 on weekdays."
QUERY = "Tresco ferry pier"


@pytest.fixture(scope="module", params=["embedded", "cloudflare"])
def no_worker(request):
    """The service with the product's defaults (MiniLM) but no job worker running on its own: embedded, then D1 +
    Vectorize on the Cloudflare emulator (where a search reads its keyword hits' chunks with their hydration)."""
    with tempfile.TemporaryDirectory() as tmp:
        vaults = Path(tmp) / "vaults"
        vaults.mkdir()
        with backend_live(request.param, Path(tmp), embedder="local", run_worker=False,
                          kb_local_roots=[str(vaults)]) as live:
            live.vaults = vaults
            yield live


def _capture(c, text: str) -> str:
    r = c.post("/v1/thoughts", json={"content": text})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _state(c, thought_id: str) -> str:
    r = c.get(f"/v1/thoughts/{thought_id}")
    assert r.status_code == 200, r.text
    return r.json()["indexing"]["state"]


def _search(c, query: str, **extra) -> list[dict]:
    r = c.post("/v1/search", json={"query": query, "top_k": 5, **extra})
    assert r.status_code == 200, r.text
    return r.json()["results"]


def test_a_thought_not_embedded_yet_is_ranked_by_its_meaning(no_worker):
    live = no_worker
    org = signup(live, "fresh")
    with live.client(headers=org.headers) as c:
        seeds = [_capture(c, t) for t in FERRIES]
        live.run(live.memex.worker.drain())
        assert {_state(c, s) for s in seeds} == {"indexed"}
        target = _capture(c, TARGET)
        assert _state(c, target) == "pending"  # only the keyword side can see it

        hits = _search(c, QUERY, explain=True)
        assert hits[0]["document_id"] == target, [h["chunk_content"] for h in hits]
        # scored by its meaning (an exact cosine), not given the vector side's floor
        assert hits[0]["explain"]["vector_score"] > 0.35, hits[0]["explain"]
        assert _state(c, target) == "pending"  # the search indexes nothing itself

        # The search left the chunk's vector for its embedding job: the job takes it instead of running the
        # model again, and the thought is then found through the index, ranked the same.
        recent = live.memex.recent_vectors
        before = recent.hits
        live.run(live.memex.worker.drain())
        assert _state(c, target) == "indexed"
        assert recent.hits == before + 1
        again = _search(c, QUERY, explain=True)
        assert again[0]["document_id"] == target
        assert again[0]["explain"]["vector_score"] == pytest.approx(hits[0]["explain"]["vector_score"], abs=1e-5)


def test_another_organizations_unembedded_thoughts_stay_its_own(no_worker):
    live = no_worker
    a, b = signup(live, "fresh-a"), signup(live, "fresh-b")
    with live.client(headers=a.headers) as ca, live.client(headers=b.headers) as cb:
        for t in FERRIES[:4]:
            _capture(ca, t)
            _capture(cb, t)
        live.run(live.memex.worker.drain())
        mine = _capture(ca, TARGET)
        theirs = _capture(cb, TARGET + " Bring the blue pass.")
        assert _state(ca, mine) == _state(cb, theirs) == "pending"

        a_hits = _search(ca, QUERY + " blue pass")
        assert a_hits[0]["document_id"] == mine
        assert theirs not in {h["document_id"] for h in a_hits}
        b_hits = _search(cb, QUERY)
        assert b_hits[0]["document_id"] == theirs
        assert mine not in {h["document_id"] for h in b_hits}
        # another organization's id: not found, and nothing changed for its owner
        assert ca.get(f"/v1/thoughts/{theirs}").status_code == 404
        assert ca.delete(f"/v1/thoughts/{theirs}").status_code == 404
        assert _state(cb, theirs) == "pending"
        assert _search(cb, QUERY)[0]["document_id"] == theirs


def test_many_unembedded_hits_are_embedded_a_bounded_number_at_a_time(no_worker):
    """Behind an import, many keyword hits may wait for their vectors: a search embeds at most
    UNINDEXED_EMBEDS chunks of them, best keyword hits first, and still answers with every hit it found."""
    from services.search.unindexed import UNINDEXED_EMBEDS

    live = no_worker
    org = signup(live, "backlog")
    with live.client(headers=org.headers) as c:
        items = [{"content": f"Backlog note {i}: the quarry shuttle timetable changes on holiday {i}."}
                 for i in range(3 * UNINDEXED_EMBEDS)]
        r = c.post("/v1/thoughts:batch", json={"items": items})
        assert r.status_code in (200, 201, 207), r.text
        recent = live.memex.recent_vectors
        stored = len(recent._all)
        hits = c.post("/v1/search", json={"query": "quarry shuttle timetable", "top_k": 100}).json()["results"]
        assert len(hits) == len(items)  # the keyword side found them all
        assert len(recent._all) - stored == UNINDEXED_EMBEDS  # and the search embedded its bound, no more
        live.run(live.memex.worker.drain())
        assert len(c.post("/v1/search", json={"query": "quarry shuttle timetable", "top_k": 100})
                   .json()["results"]) == len(items)


def test_a_conversation_turn_not_embedded_yet_is_ranked_by_its_meaning(no_worker):
    """The same for conversations: a turn just appended is found by its meaning before its window is embedded."""
    live = no_worker
    org = signup(live, "fresh-conv")
    with live.client(headers=org.headers) as c:
        def conversation(text: str) -> str:
            r = c.post("/v1/conversations", json={})
            assert r.status_code == 201, r.text
            cid = r.json()["id"]
            r = c.post(f"/v1/conversations/{cid}/messages", json={"messages": [{"role": "user", "content": text}]})
            assert r.status_code in (200, 201), r.text
            return cid

        for t in FERRIES:
            conversation(t)
        live.run(live.memex.worker.drain())
        target = conversation(TARGET)
        r = c.post("/v1/search", json={"query": QUERY, "top_k": 5, "kinds": ["conversation"], "explain": True})
        assert r.status_code == 200, r.text
        hits = r.json()["results"]
        assert hits[0]["conversation_id"] == target, [h["chunk_content"] for h in hits]
        assert hits[0]["explain"]["vector_score"] > 0.35, hits[0]["explain"]


def test_a_knowledge_entry_synced_but_not_embedded_yet_is_ranked_by_its_meaning(no_worker):
    """The same for a knowledge base: an entry the last sync added is found by its meaning while its chunks wait for
    their embedding job (here the worker runs the sync's round only)."""
    live = no_worker
    org = signup(live, "fresh-kb")
    vault = GitVault(live.vaults / uuid.uuid4().hex[:8])
    page = frontmatter({"title": "Ferry notes", "publish": True, "date": "2024-05-05"})
    vault.write({f"data/resources/practices/ferry-{i}.md": page + "\n" + t + "\n" for i, t in enumerate(FERRIES)})
    vault.commit("first")
    worker = live.memex.worker
    with live.client(headers=org.headers) as c:
        r = c.post("/v1/knowledge-bases", json={"slug": "isles", "visibility": "open", "document_tier": "open",
                                                 "source": {"type": "git", "url": str(vault.path)}})
        assert r.status_code == 201, r.text
        live.run(worker.drain())
        view = c.get("/v1/knowledge-bases/isles").json()
        assert view["chunks"] == view["chunks_searchable"] == len(FERRIES)

        vault.write({"data/resources/practices/tresco.md": page + "\n" + TARGET + "\n"})
        vault.commit("the Tresco ferry")
        assert c.post("/v1/knowledge-bases/isles/sync").status_code == 202
        live.run(worker.scan_once())
        live.run(worker.run_once())  # the sync; its embedding job would run in the next round
        view = c.get("/v1/knowledge-bases/isles").json()
        assert view["last_sync"]["state"] == "succeeded", view
        assert (view["chunks"], view["chunks_searchable"]) == (len(FERRIES) + 1, len(FERRIES))

        r = c.get(f"/kb/{org.slug}/isles/api/v1/search", params={"q": QUERY})
        assert r.status_code == 200, r.text
        hits = r.json()["results"]
        assert hits[0]["id"] == "tresco", [h["id"] for h in hits]


class _Counting:
    """The hash embedder, recording what it is asked to embed (the model port, not our code)."""

    def __init__(self) -> None:
        from services.adapters.hash_embedder import HashEmbedder

        self.inner, self.calls = HashEmbedder(), []

    async def embed(self, texts):
        self.calls.append(list(texts))
        return await self.inner.embed(texts)


def test_a_search_waits_for_the_workers_call_on_the_same_chunk_instead_of_embedding_it_again():
    """Searched right after its capture, a thought's chunk is usually in the job worker's model call already: the
    search waits for that call's vector (the worker announces its small calls) and runs the model on nothing. Another
    organization's call on the same text is not this one's; a failed call leaves the search to embed it itself."""
    import asyncio

    import numpy as np

    from services.search.recent_vectors import RecentVectors
    from services.search.unindexed import embed_unindexed

    async def run() -> None:
        emb, recent = _Counting(), RecentVectors()
        q = (await emb.inner.embed([QUERY]))[0]
        chunk = {"id": "c1", "kind": "thought", "parent_id": "d1", "content": TARGET}
        vector = (await emb.inner.embed([TARGET]))[0]

        recent.expect("org_a", [TARGET])
        search = asyncio.create_task(embed_unindexed(emb, recent, "org_a", q, [chunk]))
        await asyncio.sleep(0.05)
        assert not search.done()  # waiting for the worker's call
        recent.settle("org_a", [TARGET], vector[None, :])
        rows = await search
        assert emb.calls == [] and rows == [("c1", "thought", "d1", pytest.approx(float(np.dot(vector, q))))]
        assert recent.in_flight("org_a", TARGET) is None

        recent.expect("org_b", [TARGET])  # another organization's call: not waited for
        assert (await embed_unindexed(emb, recent, "org_a", q, [chunk]))[0][3] == pytest.approx(rows[0][3])
        assert emb.calls == [[TARGET]] and not recent.in_flight("org_b", TARGET).done()

        emb.calls.clear()
        recent._all.clear()
        recent.expect("org_a", [TARGET])
        search = asyncio.create_task(embed_unindexed(emb, recent, "org_a", q, [chunk]))
        await asyncio.sleep(0.05)
        recent.settle("org_a", [TARGET], None)  # the call failed: the search embeds the chunk itself
        assert (await search)[0][3] == pytest.approx(rows[0][3]) and emb.calls == [[TARGET]]

    asyncio.run(run())


def test_the_keyword_index_reads_which_hits_wait_for_their_vectors_too():
    """A large organization's thoughts are ranked by its tantivy index (here from one thought on): its hits are read
    with whether their first chunk is in the vector index, as FTS5's are."""
    with tempfile.TemporaryDirectory() as tmp, \
            backend_live("embedded", Path(tmp), embedder="local", run_worker=False, keyword_index_from=1) as live:
        org = signup(live, "fresh-tantivy")
        with live.client(headers=org.headers) as c:
            seeds = [_capture(c, t) for t in FERRIES]
            live.run(live.memex.worker.drain())
            target = _capture(c, TARGET)

            async def index_current() -> bool:
                return await (await live.memex.stores.open(org.id)).db.keyword_sync(timeout=30)

            _search(c, QUERY)  # the organization's first search starts its index
            assert live.run(index_current())
            assert _state(c, target) == "pending" and {_state(c, s) for s in seeds} == {"indexed"}
            hits = _search(c, QUERY, explain=True)
            assert hits[0]["document_id"] == target, [h["chunk_content"] for h in hits]
            assert hits[0]["explain"]["vector_score"] > 0.35, hits[0]["explain"]


def test_searches_share_a_budget_of_model_runs_for_unindexed_hits():
    """Under a steady mix of captures and searches every search would embed hits and take the CPU the worker needs:
    the process's searches share a bucket of model runs, and past it a hit keeps the vector side's floor."""
    from services.search.unindexed import _RunBudget

    bucket = _RunBudget(rate=0.0, burst=3)
    assert [bucket.take(2), bucket.take(2), bucket.take(1)] == [2, 1, 0]
