"""Ranking after fusion (memory-layer-lessons): recency, frequency, importance and penalties move scores in
the stated direction within their bounds, never lift a weak match over a clearly better one, explain's parts
multiply up to the score exactly, only deliberate use counts (never a search), the reranker's results are
cached."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.adapters.hash_embedder import HashEmbedder
from services.models import SearchHit
from services.errors import NotFound
from services.search.ranking import (
    DAY_MS, USE_HALF_LIFE_DAYS, Ranking, RankingConfig, RerankCache, UseRecorder, decay_class, feature_columns,
    frequency, importance, is_rollup, penalty, recency, use_weight, uses_now,
)
from services.search.search import Search, SearchOptions
from services.thoughts.hydrator import hydrate_statement, hydrate_thoughts
from services.thoughts.thoughts import Thoughts
from services.jobs.worker import JobWorker
from tests.stores import job_handlers, make_stores

PARTS = ("relevance", "recency", "frequency", "importance", "penalty")


def product(explain: dict) -> float:
    score = explain["relevance"]
    for part in PARTS[1:]:
        score = score * explain[part]
    return score


# -- the multipliers --------------------------------------------------------------------------------

def test_recency_is_bounded_and_halves_its_span_at_the_half_life():
    assert recency(0, 7) == 1.0
    assert recency(7 * DAY_MS, 7) == pytest.approx(0.96, rel=1e-12)
    assert recency(14 * DAY_MS, 7) == pytest.approx(0.94, rel=1e-12)
    assert 0.92 <= recency(36500 * DAY_MS, 7) < 0.9201  # a century old: never below 0.92
    assert recency(-DAY_MS, 7) == 1.0  # a clock skew never boosts
    week = 7 * DAY_MS
    assert recency(week, 7) < recency(week, 90) < recency(week, 180) < 1.0


def test_frequency_grows_with_uses_slows_down_and_is_capped():
    assert frequency(0) == frequency(None) == 1.0
    values = [frequency(n) for n in (0, 1, 2, 10, 100, 1e9)]
    assert values == sorted(values) and len(set(values[:4])) == 4
    assert values[1] == pytest.approx(1 + 0.05 * (1 - 0.5 ** 0.5))
    assert values[1] - values[0] > (values[3] - values[2]) / 8  # each use adds less
    assert values[-1] <= 1.05  # the cap, however often a note is used


def test_uses_decay_with_their_half_life():
    t = 1_800_000_000_000
    assert uses_now(use_weight(t), t) == pytest.approx(1.0)
    assert uses_now(use_weight(t), t + int(USE_HALF_LIFE_DAYS * DAY_MS)) == pytest.approx(0.5)
    assert uses_now(use_weight(t) + use_weight(t + DAY_MS), t + DAY_MS) == pytest.approx(1 + 0.5 ** (1 / 30))
    assert uses_now(0, t) == uses_now(None, t) == 0.0


def test_importance_maps_one_to_five_onto_097_103():
    assert importance(1) == pytest.approx(0.97)
    assert importance(3) == pytest.approx(1.0)
    assert importance(5) == pytest.approx(1.03)
    assert importance(None) == importance(0) == 1.0
    assert importance(9) == importance(5) and importance(-2) == importance(1)


def test_decay_classes_from_tags_and_metadata():
    cfg = RankingConfig()
    assert decay_class(["todo", "billing"], {}, cfg) == "task"
    assert decay_class(["preference"], {}, cfg) == "context"
    assert decay_class(["todo", "preference"], {}, cfg) == "task"
    assert decay_class(["billing"], {}, cfg) == "work"
    assert decay_class([], {"type": "Task"}, cfg) == "task"
    assert decay_class(["task-backlog"], {}, cfg) == "task"
    assert cfg.half_life_days("task") == 7 and cfg.half_life_days("work") == 90 and cfg.half_life_days("context") == 180
    custom = RankingConfig(task_tags=frozenset({"chore-x"}), task_half_life_days=2)
    assert decay_class(["chore-x"], {}, custom) == "task" and custom.half_life_days("task") == 2


def test_penalties_for_short_and_rolled_up_entries():
    cfg = RankingConfig()
    assert penalty(20, False, cfg) == (1.0, [])
    assert penalty(None, False, cfg) == (1.0, [])
    assert penalty(2, False, cfg) == (0.85, ["short"])
    assert penalty(20, True, cfg) == (0.8, ["rollup"])
    assert penalty(1, True, cfg)[0] == pytest.approx(0.68)
    assert is_rollup([], {"rollup": True}) and is_rollup(["weekly", "digest"], {}) and is_rollup([], {"type": "rollup"})
    assert not is_rollup(["weekly"], {"rollup": "yes"})


# -- through the search -----------------------------------------------------------------------------

class Env:
    def __init__(self, stores, store, emb, ranking):
        self.stores, self.emb, self.ranking = stores, emb, ranking
        self.db, self.index = store.db, store.index  # org_a's own database and vector index
        self.sql = store.sql
        self.vectors = store.vectors
        self.thoughts = Thoughts(self.sql, self.vectors, emb,
                                 on_use=lambda ids, fetched=False: ranking.used("org_a", ids, fetched=fetched))
        self.search = Search(self.sql, self.vectors, emb, {"thought": hydrate_thoughts}, ranking=ranking)

    async def run(self, query: str, **kw) -> list[SearchHit]:
        return (await self.search.search(SearchOptions(query=query, explain=True, **kw))).results

    async def set(self, doc_id: str, **cols) -> None:
        for col, value in cols.items():
            await self.sql.execute(f"UPDATE documents SET {col} = ?3 WHERE organization_id = ?1 AND id = ?2", [doc_id, value])


async def _noop(*_):
    return None


@pytest.fixture
async def env(tmp_path):
    emb = HashEmbedder()
    control, stores = await make_stores(tmp_path, emb, orgs=("org_a",))

    async def sql_for(org_id):  # what api/wiring.py passes (Memex.org_sql)
        return (await stores.open(org_id)).sql

    e = Env(stores, await stores.open("org_a"), emb, Ranking(uses=UseRecorder(sql_for, delay=3600), rerank_cache=RerankCache()))
    e.ids = {}
    for name, text in {
        "harbour": "The harbour ferry timetable changes in winter: boats leave every forty minutes from pier two.",
        "ferry": "Ferry tickets for the harbour crossing are cheaper when bought as a book of ten.",
        "bakery": "The bakery on the corner sells rye bread on Saturdays only.",
    }.items():
        e.ids[name] = (await e.thoughts.capture(text)).id
    await JobWorker(stores, emb, handlers=job_handlers(enrich=_noop)).drain()
    yield e
    await stores.close()
    await control.close()


def _by_doc(hits):
    return {h.document_id: h for h in hits}


async def test_explain_parts_multiply_up_to_the_score_exactly(env):
    now = int(time.time() * 1000)
    await env.set(env.ids["ferry"], importance=5, use_weight=use_weight(now) * 3, use_count=3, updated_at=now - 40 * DAY_MS)
    hits = await env.run("harbour ferry")
    assert len(hits) >= 2
    for h in hits:
        e = h.explain
        assert set(PARTS) | {"fused", "rerank", "score", "keyword_rank", "vector_rank", "vector_score"} <= set(e)
        assert product(e) == h.score == e["score"]  # exact, not approximate
        assert e["relevance"] == e["fused"] and e["rerank"] is None
    ferry = _by_doc(hits)[env.ids["ferry"]].explain
    assert ferry["importance"] == pytest.approx(1.03) and ferry["frequency"] == pytest.approx(frequency(3), rel=1e-4)
    assert ferry["uses"] == 3 and ferry["uses_now"] == pytest.approx(3, rel=1e-4)
    assert ferry["recency"] == pytest.approx(recency(40 * DAY_MS, 90), rel=1e-3) and ferry["recency_class"] == "work"
    assert hits == sorted(hits, key=lambda h: h.score, reverse=True)


async def test_recency_frequency_and_importance_move_scores_as_stated(env):
    base = _by_doc(await env.run("harbour ferry"))
    doc = env.ids["harbour"]
    now = int(time.time() * 1000)

    await env.set(doc, updated_at=now - 200 * DAY_MS)
    older = _by_doc(await env.run("harbour ferry"))[doc]
    assert older.score < base[doc].score and 0.92 < older.explain["recency"] < 0.94

    await env.set(doc, updated_at=now, use_weight=use_weight(now) * 5, use_count=5)
    used = _by_doc(await env.run("harbour ferry"))[doc]
    assert used.score > base[doc].score and 1.03 < used.explain["frequency"] <= 1.05

    await env.set(doc, use_weight=0, use_count=0, importance=1)
    low = _by_doc(await env.run("harbour ferry"))[doc]
    await env.set(doc, importance=5)
    high = _by_doc(await env.run("harbour ferry"))[doc]
    assert low.score < base[doc].score < high.score

    await env.set(doc, importance=None, tags='["todo"]', updated_at=now - 7 * DAY_MS)
    task = _by_doc(await env.run("harbour ferry"))[doc]
    assert task.explain["recency_class"] == "task" and task.explain["recency"] == pytest.approx(0.96, rel=1e-3)


async def test_multipliers_never_lift_a_weak_match_over_a_clearly_better_one(env):
    """The weakest relevant hit gets every boost (fresh, used a lot, importance 5 by a model); the best gets
    every drag (ten years old, importance 1): the best still ranks first when its relevance is > 1.21x."""
    hits = [h for h in await env.run("harbour ferry timetable winter", min_score=0) if h.explain["relevance"] > 0]
    best, weak = hits[0], hits[-1]
    assert best.explain["relevance"] > 1.22 * weak.explain["relevance"] and weak.document_id == env.ids["ferry"]
    now = int(time.time() * 1000)
    await env.set(weak.document_id, updated_at=now, importance=5, enrichment_state="llm",
                  use_weight=use_weight(now) * 1000, use_count=1000)
    await env.set(best.document_id, updated_at=now - 3650 * DAY_MS, importance=1, enrichment_state="llm")
    again = await env.run("harbour ferry timetable winter", min_score=0)
    assert again[0].document_id == best.document_id
    assert _by_doc(again)[weak.document_id].score > weak.score  # the boosts did apply


async def test_recency_reorders_near_ties(env):
    a = (await env.thoughts.capture("The harbour ferry leaves pier two at nine.")).id
    b = (await env.thoughts.capture("The harbour ferry leaves pier two at nine!")).id
    await JobWorker(env.stores, env.emb, handlers=job_handlers(enrich=_noop)).drain()
    await env.set(a, updated_at=int(time.time() * 1000) - 365 * DAY_MS)
    order = [h.document_id for h in await env.run("harbour ferry leaves pier two at nine")]
    assert order.index(b) < order.index(a)
    await env.set(a, updated_at=int(time.time() * 1000))
    await env.set(b, updated_at=int(time.time() * 1000) - 365 * DAY_MS)
    order = [h.document_id for h in await env.run("harbour ferry leaves pier two at nine")]
    assert order.index(a) < order.index(b)


async def test_short_and_rolled_up_entries_are_penalised(env):
    short = (await env.thoughts.capture("harbour ferry")).id
    rollup = (await env.thoughts.capture("Weekly digest: harbour ferry timetable, ferry tickets, bakery rye bread.",
                                         metadata={"rollup": True})).id
    await JobWorker(env.stores, env.emb, handlers=job_handlers(enrich=_noop)).drain()
    hits = _by_doc(await env.run("harbour ferry"))
    assert hits[short].explain["penalty"] == pytest.approx(0.85) and hits[short].explain["penalties"] == ["short"]
    assert hits[rollup].explain["penalty"] == pytest.approx(0.8) and hits[rollup].explain["penalties"] == ["rollup"]
    assert hits[env.ids["harbour"]].explain["penalty"] == 1.0


async def _uses(env) -> dict[str, tuple]:
    rows = await env.sql.rows("SELECT id, use_count, use_weight, last_used_at FROM documents WHERE organization_id = ?1")
    return {r["id"]: (r["use_count"], r["use_weight"], r["last_used_at"]) for r in rows}


async def test_searches_never_count_as_use_nor_change_later_scores(env):
    now = int(time.time() * 1000)
    env.ranking.clock = lambda: now  # recency moves with the clock, not with searches
    before = [(h.document_id, h.score) for h in await env.run("harbour ferry")]
    for query in ["harbour ferry", "bakery rye bread", "tickets", "winter boats"] * 25:
        await env.run(query)
    await env.ranking.uses.flush()
    assert {v[0] for v in (await _uses(env)).values()} == {0}
    assert [(h.document_id, h.score) for h in await env.run("harbour ferry")] == before


async def test_fetching_by_id_and_marking_used_count_as_uses_off_the_hot_path(env):
    for _ in range(5):  # fetched five times in a row (a client polling): one use
        await env.thoughts.get(env.ids["bakery"])
    await env.thoughts.mark_used([env.ids["bakery"], env.ids["ferry"]])
    assert {v[0] for v in (await _uses(env)).values()} == {0}  # nothing written during the request
    await env.ranking.uses.flush()
    uses = await _uses(env)
    assert uses[env.ids["bakery"]][0] == 2 and uses[env.ids["ferry"]][0] == 1 and uses[env.ids["harbour"]][0] == 0
    assert uses[env.ids["bakery"]][2] is not None
    e = _by_doc(await env.run("bakery rye bread"))[env.ids["bakery"]].explain
    assert e["uses"] == 2 and e["frequency"] == pytest.approx(frequency(2), rel=1e-3)


async def test_marking_an_unknown_thought_used_is_not_found_and_records_nothing(env):
    with pytest.raises(NotFound):
        await env.thoughts.mark_used([env.ids["bakery"], "th_missing"])
    await env.ranking.uses.flush()
    assert {v[0] for v in (await _uses(env)).values()} == {0}


async def test_uses_added_while_a_flush_is_writing_are_written_too(env):
    recorder = env.ranking.uses
    recorder.delay = 0.01
    writing, release = asyncio.Event(), asyncio.Event()
    execute = env.db.execute

    async def slow_execute(sql, params=()):  # the real statement, held while the second use arrives
        if sql.startswith("UPDATE documents SET use_weight"):
            writing.set()
            await release.wait()
        return await execute(sql, params)

    env.db.execute = slow_execute
    try:
        await env.thoughts.mark_used([env.ids["bakery"]])
        await asyncio.wait_for(writing.wait(), 10)
        await env.thoughts.mark_used([env.ids["ferry"]])  # arrives during the flush
        release.set()
        for _ in range(500):
            uses = await _uses(env)
            if uses[env.ids["ferry"]][0] == 1:
                break
            await asyncio.sleep(0.02)
        assert uses[env.ids["bakery"]][0] == 1 and uses[env.ids["ferry"]][0] == 1
    finally:
        env.db.execute = execute


async def test_the_use_recorder_flushes_by_itself(env):
    env.ranking.uses.delay = 0.01
    await env.thoughts.mark_used([env.ids["bakery"]])
    for _ in range(500):
        await asyncio.sleep(0.02)
        if (await _uses(env))[env.ids["bakery"]][0] == 1:
            break
    assert (await _uses(env))[env.ids["bakery"]][0] == 1


async def test_conversation_hits_get_recency_only():
    now = int(time.time() * 1000)
    hit = SearchHit(kind="conversation", document_id="c1", chunk_id="k1", chunk_content="x", score=0.5,
                    tags=["todo"], created_at=now - 400 * DAY_MS,
                    messages=[{"created_at": now - 400 * DAY_MS}, {"created_at": now - 180 * DAY_MS}])
    (out,) = await Ranking().apply(None, "q", [hit], explain=True)
    e = out.explain
    assert (e["frequency"], e["importance"], e["penalty"]) == (1.0, 1.0, 1.0)
    assert e["recency_class"] == "context" and e["recency"] == pytest.approx(0.96, rel=1e-3)  # the newest message
    assert product(e) == out.score


async def test_the_reranker_runs_once_per_query_and_candidate_set(env):
    calls = []

    async def rerank(query, hits):
        calls.append(query)
        for i, h in enumerate(reversed(hits)):  # the reranker prefers the fused order reversed
            h.score = 0.9 - i * 0.1
        return list(reversed(hits))

    env.search._rerank = rerank
    first = await env.run("harbour ferry")
    second = await env.run("harbour ferry")
    assert calls == ["harbour ferry"] and env.ranking.rerank_cache.hits == 1
    assert [h.document_id for h in first] == [h.document_id for h in second]
    for h in second:
        assert h.explain["rerank"] == h.explain["relevance"] != h.explain["fused"]
        assert product(h.explain) == h.score
    await env.run("bakery bread")
    assert calls == ["harbour ferry", "bakery bread"]
    # a new candidate changes the set: computed again
    await env.thoughts.capture("A harbour ferry strike is planned for Monday.")
    await env.run("harbour ferry")
    assert calls[-1] == "harbour ferry" and len(calls) == 3


def test_the_rerank_cache_expires_after_its_ttl():
    clock = [0.0]
    cache = RerankCache(ttl=3600, clock=lambda: clock[0])
    calls = []

    async def rerank(query, hits):
        calls.append(1)
        return hits

    hits = [SearchHit(kind="thought", document_id="d", chunk_id="c", chunk_content="x", score=1.0)]
    asyncio.run(cache.run("org", "q", hits, rerank))
    clock[0] = 3599
    asyncio.run(cache.run("org", "q", hits, rerank))
    assert len(calls) == 1
    asyncio.run(cache.run("other-org", "q", hits, rerank))
    assert len(calls) == 2  # per organization
    clock[0] = 3601
    asyncio.run(cache.run("org", "q", hits, rerank))
    assert len(calls) == 3


async def test_a_heuristic_importance_does_not_reorder_relevance(env):
    doc = env.ids["harbour"]
    await env.set(doc, importance=5, enrichment_state="extractive")
    e = _by_doc(await env.run("harbour ferry"))[doc].explain
    assert e["importance"] == 1.0 and e["importance_level"] == 5 and e["importance_source"] == "extractive"
    await env.set(doc, enrichment_state="llm")
    e = _by_doc(await env.run("harbour ferry"))[doc].explain
    assert e["importance"] == pytest.approx(1.03) and e["importance_source"] == "llm"


async def test_a_hit_reads_the_same_length_feature_whichever_of_its_thoughts_chunks_it_is(env):
    """``chars`` (the short-thought penalty's input) is the length of a thought's only chunk, else NULL. A search's
    hydration reads it from the hit's own chunk and the chunk index; the ranking stage's own read (hits hydrated
    without it) from the thought's first two chunks. Both give the same value for every chunk of every thought."""
    short = (await env.thoughts.capture("harbour ferry")).id
    filler = " ".join(f"The bakery sells rye bread, sourdough loaves and seeded rolls on day {i}." for i in range(60))
    long_id = (await env.thoughts.capture(filler + "\n\nharbour ferry")).id
    await JobWorker(env.stores, env.emb, handlers=job_handlers(enrich=_noop)).drain()
    chunks = await env.sql.rows("SELECT id, parent_id FROM chunks WHERE organization_id = ?1 AND kind = 'thought'")
    assert sum(c["parent_id"] == long_id for c in chunks) >= 2
    (hydrated,) = await env.sql.batch([hydrate_statement(env.sql, [[c["parent_id"], c["id"]] for c in chunks])])
    stage = {r["id"]: r["chars"] for r in await env.sql.rows(
        "SELECT " + feature_columns() + " FROM documents WHERE organization_id = ?1")}
    assert len(hydrated.rows) == len(chunks)
    assert [r["chars"] for r in hydrated.rows] == [stage[r["id"]] for r in hydrated.rows]
    assert stage[short] == len("harbour ferry") and stage[long_id] is None
    hits = _by_doc(await env.run("harbour ferry"))
    assert hits[short].explain["penalties"] == ["short"] and hits[long_id].explain["penalties"] == []
