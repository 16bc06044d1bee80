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
        self.max_tokens, self.count_tokens = self.inner.max_tokens, self.inner.count_tokens

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

    bucket = _RunBudget(rate=0.0, burst=3, reserve=0.0, share=1.0)
    assert [bucket.take("a", [1, 1]), bucket.take("a", [1, 1]), bucket.take("a", [1])] == [
        [True, True], [True, False], [False]]
    # a cheaper run still fits where a full one does not
    bucket = _RunBudget(rate=0.0, burst=1, reserve=0.0, share=1.0)
    assert bucket.take("a", [0.75, 0.5, 0.2]) == [True, False, True]


def test_one_organizations_searches_cannot_spend_the_budget_anothers_search_needs():
    """An organization past its share of the budget may spend only what the process holds above a reserve; the
    reserve is there for another organization's next search (a tenant's search storm does not starve another's
    fresh captures). Alone, an organization still gets more than its share."""
    from services.search.unindexed import UNINDEXED_EMBEDS, _RunBudget

    t = [0.0]
    bucket = _RunBudget(rate=4.0, burst=8, clock=lambda: t[0])
    granted = bucket.take("storm", [1.0] * 10)
    assert sum(granted) == 6  # its share (4) and what lies above the reserve (2), in order
    assert granted == [True] * 6 + [False] * 4
    assert bucket.take("quiet", [1.0] * UNINDEXED_EMBEDS) == [True] * UNINDEXED_EMBEDS
    assert bucket.take("storm", [1.0]) == [False]
    t[0] = 1.0  # a second later: the process's rate (4) goes to the only organization asking
    assert sum(bucket.take("storm", [1.0] * 10)) == 2
    t[0] = 2.0
    assert sum(bucket.take("storm", [1.0] * 10)) == 4


def test_the_budget_remembers_a_bounded_number_of_organizations():
    """A share per organization must not grow with every organization that ever searched: a full bucket is
    forgotten (it is as good as a new one), and past the bound the oldest go."""
    from services.search.unindexed import _RunBudget

    t = [0.0]
    bucket = _RunBudget(rate=4.0, burst=8, clock=lambda: t[0], max_orgs=8)
    for i in range(100):
        t[0] += 0.01  # each spends a run, so none is full again yet
        bucket.take(f"org{i}", [0.1])
        assert len(bucket._orgs) <= 8
    t[0] += 60.0  # all full again: forgotten at the next newcomer's turn
    bucket.take("late", [0.1])
    assert list(bucket._orgs) == ["late"]


def test_a_run_costs_by_its_texts_length():
    """The budget is CPU: a run on an agent's short memory costs a fraction of one on a long note's full chunk."""
    from services.adapters.hash_embedder import HashEmbedder
    from services.search.unindexed import run_cost

    e = HashEmbedder()
    assert run_cost(e, " ".join(["word"] * 2000)) == pytest.approx(1.0)  # a chunk is at most max_tokens
    short = run_cost(e, " ".join(["word"] * 40))
    assert 0.15 < short < 0.25


TREES = "alder birch cedar dogwood elm fir ginkgo hazel larch maple oak poplar".split()


def _long_note(i: int) -> str:
    """A note longer than a chunk, found by the word "quarry" and by its own tree."""
    words = ("lantern orchard copper violet meadow signal river basalt harbour thistle granite saffron "
             "juniper pewter cobalt ember").split()
    return f"Quarry shuttle log of the {TREES[i]}. " + " ".join(words[(i + k) % len(words)] for k in range(400))


def test_short_memories_are_scored_where_a_long_notes_run_would_not_fit(no_worker, monkeypatch):
    """With what is left of the budget, a search scores an agent's short memory right after its capture, and
    leaves a long imported note (a full chunk) on the vector side's floor."""
    from services.search import unindexed

    live = no_worker
    org = signup(live, "weighed")
    recent = live.memex.recent_vectors
    monkeypatch.setattr(unindexed, "_BUDGET", unindexed._RunBudget(rate=0.0, burst=0.5, reserve=0.0, share=1.0))
    with live.client(headers=org.headers) as c:
        seeds = [_capture(c, t) for t in FERRIES]
        live.run(live.memex.worker.drain())
        assert {_state(c, s) for s in seeds} == {"indexed"}
        note = _capture(c, _long_note(1))
        stored = len(recent._all)
        hits = _search(c, "quarry shuttle log")
        assert hits[0]["document_id"] == note  # found by its words
        assert len(recent._all) == stored  # but not embedded: a full run does not fit
        target = _capture(c, TARGET)
        hits = _search(c, QUERY, explain=True)
        assert hits[0]["document_id"] == target
        assert hits[0]["explain"]["vector_score"] > 0.35, hits[0]["explain"]  # scored by its meaning
        assert len(recent._all) == stored + 1


def test_a_storm_of_searches_in_one_organization_leaves_anothers_fresh_capture_scored(no_worker, monkeypatch):
    """Cross-tenant: one organization's searches, each embedding long notes not indexed yet, spend all they may of
    the budget; another organization's search right after its capture is still scored by its meaning."""
    from services.search import unindexed

    live = no_worker
    storm, quiet = signup(live, "storm"), signup(live, "quiet")
    recent = live.memex.recent_vectors
    monkeypatch.setattr(unindexed, "_BUDGET", unindexed._RunBudget(rate=0.0, burst=8))
    with live.client(headers=storm.headers) as cs, live.client(headers=quiet.headers) as cq:
        seeds = [_capture(cq, t) for t in FERRIES]
        live.run(live.memex.worker.drain())
        assert {_state(cq, s) for s in seeds} == {"indexed"}
        r = cs.post("/v1/thoughts:batch", json={"items": [{"content": _long_note(i)} for i in range(12)]})
        assert r.status_code in (200, 201, 207), r.text
        notes = [it["result"]["id"] for it in r.json()["results"]]
        stored = len(recent._all)
        spent = []
        for k in range(6):  # 2 new notes a search: its share (4 runs), down to the reserve (2), then nothing
            _search(cs, f"quarry {TREES[2 * k]} {TREES[2 * k + 1]}")
            spent.append(len(recent._all) - stored - sum(spent))
        assert spent == [2, 2, 2, 0, 0, 0]
        target = _capture(cq, TARGET)
        hits = _search(cq, QUERY, explain=True)
        assert hits[0]["document_id"] == target
        assert hits[0]["explain"]["vector_score"] > 0.35, hits[0]["explain"]
        assert len(recent._all) == stored + 7
        # the other organization's pending notes never reach this one's results
        assert not {h["document_id"] for h in _search(cq, "quarry shuttle log")} & set(notes)
