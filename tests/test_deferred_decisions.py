"""Write-time decisions made by the worker for captures that did not wait for theirs (services.thoughts.deferred):
the capture answers at once with decision "pending", and the embedding round decides, with the first chunk's vector
it has just computed. In process, on the real embedded stores, with the scripted embedder (exact similarities) and
the scripted language model of tests/decision_doubles.py."""

from __future__ import annotations

import asyncio

import pytest

import services.search.selective as selective
from services.errors import NotFound
from services.search.indexing import EmbedStage
from services.thoughts.decisions import Decisions
from services.thoughts.deferred import deferred_decisions
from services.thoughts.thoughts import Thoughts
from services.jobs.worker import JobWorker
from tests.decision_doubles import ScriptedEmbedder, ScriptedLLM, basis, near
from tests.stores import make_stores

OLD = "The team offsite is in Lisbon in the first week of May."
NEW = "The team offsite moved to Porto for the first week of May."


async def _noop(sql, vectors, embedder, job):
    return None


class Env:
    def __init__(self, stores, emb, llm=None, *, decisions: bool = True) -> None:
        self.stores, self.emb, self.llm = stores, emb, llm
        self.enabled = decisions

        def factory(sql, vectors):
            return Decisions(sql, vectors, emb, llm=self.llm, lexical_gate=True) if self.enabled else None

        self.worker = JobWorker(stores, emb, handlers={"enrich": _noop}, stages={
            "embed": EmbedStage(before_upsert=deferred_decisions(factory, lambda org_id: self.worker.wake(org_id)))})

    async def thoughts(self) -> Thoughts:
        store = await self.stores.open("org_a")
        return Thoughts(store.sql, store.vectors, self.emb,
                        decisions=Decisions(store.sql, store.vectors, self.emb, llm=self.llm, lexical_gate=True))

    async def drain(self) -> None:
        self.worker.wake("org_a")
        await self.worker.drain()

    async def vector_parents(self) -> set[str]:
        index = (await self.stores.open("org_a")).index
        return {i.split(":", 1)[1] for i in await index.ids_in_namespace("org_a")}


@pytest.fixture
async def make_env(tmp_path):
    made = []

    async def make(llm=None, *, decisions: bool = True) -> Env:
        emb = ScriptedEmbedder()
        control, stores = await make_stores(tmp_path / str(len(made)), emb, orgs=("org_a",))
        made.append((control, stores))
        return Env(stores, emb, llm, decisions=decisions)

    yield make
    for control, stores in made:
        await stores.close()
        await control.close()


async def chunk_ids(t: Thoughts, doc_id: str) -> set[str]:
    return {c.id for c in (await t.get(doc_id)).chunks}


async def test_a_capture_answers_pending_and_the_worker_records_its_decision(make_env):
    env = await make_env()
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    old = await t.capture(OLD)
    assert old.decision.action == "pending" and old.created
    await env.drain()
    assert (await t.get(old.id)).decision.action == "created"
    env.emb.set(NEW, near(0, 1, 0.90))  # 0.85-0.95 without a model: kept, flagged
    new = await t.capture(NEW)
    assert new.decision.action == "pending"
    assert (await t.get(new.id)).decision.action == "pending"  # until the worker has embedded it
    await env.drain()
    decided = (await t.get(new.id)).decision
    assert decided.action == "flagged" and decided.related_id == old.id and decided.similarity == pytest.approx(0.9, abs=1e-3)
    assert await chunk_ids(t, new.id) <= await env.vector_parents()  # its vectors are written


async def test_a_near_duplicate_goes_to_the_history_and_never_gets_vectors(make_env):
    env = await make_env()
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    old = (await t.capture(OLD)).id
    await env.drain()
    env.emb.set(NEW, near(0, 1, 0.97))
    new = await t.capture(NEW)
    new_chunks = await chunk_ids(t, new.id)
    await env.drain()
    with pytest.raises(NotFound):
        await t.get(new.id)
    entries = (await t.history.list(old)).entries
    assert [e.content for e in entries] == [NEW] and "duplicate" in (entries[0].reason or "")
    assert not new_chunks & await env.vector_parents()
    # the decision can be undone: restoring brings the thought back as it was captured
    restored = await t.history.restore(old, entries[0].id)
    assert (await t.get(restored.id)).content == NEW


async def test_captures_of_one_round_are_decided_in_the_order_they_came(make_env):
    """Two near-identical notes captured together are embedded in one round: the first stands, the second is its
    duplicate (it must not be the other way round, nor both)."""
    env = await make_env()
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    env.emb.set(NEW, near(0, 1, 0.97))
    first = await t.capture(OLD)
    second = await t.capture(NEW)
    await env.drain()
    assert (await t.get(first.id)).decision.action == "created"
    with pytest.raises(NotFound):
        await t.get(second.id)
    assert [e.content for e in (await t.history.list(first.id)).entries] == [NEW]


async def test_unrelated_notes_are_created_without_a_vector_lookup(make_env, monkeypatch):
    env = await make_env()
    t = await env.thoughts()
    queried = []
    store = await env.stores.open("org_a")
    real_query = type(store.vectors).query

    async def counting(self, *args, **kwargs):
        queried.append(1)
        return await real_query(self, *args, **kwargs)

    monkeypatch.setattr(type(store.vectors), "query", counting)
    ids = [(await t.capture(text)).id for text in (
        "Sourdough starters need feeding twice daily with rye flour.",
        "The bicycle shed roof leaks over the north rack after heavy rain.",
        "Quarterly tax filings are due on the fifteenth of the month.")]
    await env.drain()
    assert [(await t.get(i)).decision.action for i in ids] == ["created"] * 3
    assert queried == []  # the lexical gate (one SQL batch for the round) found nothing close


async def test_when_every_probe_word_is_common_the_index_decides_without_the_keyword_gate(make_env, monkeypatch):
    """The lexical gate ranks every chunk its words match: in a large organization whose notes share their words, it
    read most of the organization for each thought (160 ms a thought at 100,000 chunks). Once the organization is
    known to hold all of a note's probe words in most rows, the round asks the index, and still finds the duplicate."""
    monkeypatch.setattr(selective, "COMMON_MIN_ROWS", 3)  # common: in 3 rows and 30% of them (defaults 2,000 and 5%)
    monkeypatch.setattr(selective, "COMMON_SHARE", 0.3)
    selective._COMMON.clear()
    env = await make_env()
    t = await env.thoughts()
    notes = [f"Fleet status report {i}: harbour crane maintenance finished on schedule." for i in range(6)]
    for i, note in enumerate(notes):
        env.emb.set(note, basis(i))
    ids = [(await t.capture(note)).id for note in notes]
    await env.drain()
    assert [(await t.get(i)).decision.action for i in ids] == ["created"] * 6
    store = await env.stores.open("org_a")
    sent: list[str] = []
    real_batch = type(store.sql).batch

    async def recording(self, statements, *args, **kwargs):
        sent.extend(st.sql for st in statements)
        return await real_batch(self, statements, *args, **kwargs)

    monkeypatch.setattr(type(store.sql), "batch", recording)
    again = "Fleet status report 0: harbour crane maintenance finished on schedule!"
    env.emb.set(again, near(0, 7, 0.97))
    dup = await t.capture(again)
    await env.drain()
    with pytest.raises(NotFound):
        await t.get(dup.id)
    assert [e.content for e in (await t.history.list(ids[0])).entries] == [again]
    assert sent and not [q for q in sent if "chunks_fts MATCH" in q]  # the gate was not asked
    selective._COMMON.clear()


@pytest.mark.parametrize("answer,outcome", [
    ({"action": "contradiction", "conflicting_id": "m1", "reason": "city changed"}, "contradiction"),
    ({"action": "replace", "target_id": "m1"}, "replaced"),
    ({"action": "merge", "target_id": "m1", "merged_content": "The team offsite is in Porto (was Lisbon), first week of May."},
     "merged"),
])
async def test_with_a_model_the_worker_carries_out_its_answer(make_env, answer, outcome):
    env = await make_env(ScriptedLLM(answer))
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    old = (await t.capture(OLD)).id
    await env.drain()
    env.emb.set(NEW, near(0, 1, 0.90))
    new = await t.capture(NEW)
    await env.drain()
    detail = await t.get(new.id)
    assert detail.decision.action == outcome and detail.decision.related_id == old
    if outcome == "contradiction":
        assert [(link.thought_id, link.kind) for link in detail.links] == [(old, "contradicts")]
        assert (await t.get(old)).content == OLD
        return
    with pytest.raises(NotFound):
        await t.get(old)  # superseded: in the new thought's history
    history = [(e.original_id, e.action) for e in (await t.history.list(new.id)).entries]
    assert (old, outcome) in history
    if outcome == "merged":
        assert detail.content == answer["merged_content"]
        assert NEW in [e.content for e in (await t.history.list(new.id)).entries]  # its own text kept
        assert detail.indexing.state == "indexed"  # the merged text's chunks embedded in a later round
        assert {c.content for c in detail.chunks} == {answer["merged_content"]}


async def test_decisions_turned_off_after_a_capture_leave_it_undecided_and_indexed(make_env):
    env = await make_env(decisions=False)
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    res = await t.capture(OLD)
    assert res.decision.action == "pending"
    await env.drain()
    detail = await t.get(res.id)
    assert detail.decision is None and detail.indexing.state == "indexed"


def _record_sql(db) -> list[str]:
    """Every request the organization's database gets from now on (a batch is one), as its statements' text."""
    seen: list[str] = []
    execute, batch = db.execute, db.batch

    async def counting_execute(sql, params=()):
        seen.append(sql)
        return await execute(sql, params)

    async def counting_batch(statements):
        seen.append(" ;; ".join(st.sql for st in statements))
        return await batch(statements)

    db.execute, db.batch = counting_execute, counting_batch
    return seen


@pytest.mark.parametrize("n", [2, 6])
async def test_a_rounds_decisions_cost_the_same_round_trips_however_many_thoughts(make_env, n):
    """On D1 every round trip is an API request: the round reads its pending thoughts and asks the gate in one batch,
    reads the candidates of all its thoughts at once, and records the decisions in the batch that marks the chunks
    indexed. (Each thought still has its own vector query.)"""
    env = await make_env()
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    old = (await t.capture(OLD)).id
    await env.drain()
    texts = [f"{NEW} Item {i}." for i in range(n)]
    for i, text in enumerate(texts):
        env.emb.set(text, near(0, 2 + i, 0.6))  # near the old one (a candidate), not near each other
    ids = [(await t.capture(text)).id for text in texts]
    seen = _record_sql((await env.stores.open("org_a")).sql.db)
    await env.drain()
    decided = [(await t.get(i)).decision for i in ids]
    assert [d.action for d in decided] == ["created"] * n  # 0.6 without a model: created
    about_decisions = [s for s in seen if "decision" in s or "chunks_fts" in s or "substr(content" in s]
    assert len(about_decisions) == 3, about_decisions  # pending thoughts + gate; candidates; records + indexed
    assert "substr(content" in about_decisions[1] and "SET indexed_at" in about_decisions[2]
    assert (await t.get(old)).decision.action == "created"


async def test_a_thought_decided_again_after_a_failed_round_is_not_its_own_duplicate(make_env):
    """The round's records go in its last batch, after the vectors are written: when that batch fails, the job runs
    again and finds the thought's own vector in the index, which must not make it a duplicate of itself."""
    env = await make_env()
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    old = (await t.capture(OLD)).id
    await env.drain()
    env.emb.set(NEW, near(0, 1, 0.6))
    new = (await t.capture(NEW)).id
    db = (await env.stores.open("org_a")).sql.db
    batch = db.batch
    failed = []

    async def failing_once(statements):
        if not failed and "SET indexed_at" in statements[0].sql:
            failed.append(1)
            raise RuntimeError("the request was lost")
        return await batch(statements)

    db.batch = failing_once
    await env.drain()
    assert failed and await chunk_ids(t, new) <= await env.vector_parents()  # its vectors were written
    assert (await t.get(new)).decision.action == "pending"  # but its round's last batch failed
    await asyncio.sleep(1.1)  # the retry's backoff
    await env.drain()
    detail = await t.get(new)  # still there: not moved to its own history
    assert detail.decision.action == "created" and detail.indexing.state == "indexed"
    assert (await t.get(old)).decision.action == "created"


class _WorkerCommitsAfterFirstRead:
    """The organization's real SQL, with the worker's round committing right after the first read a request makes:
    the moment a request reading a thought in more than one statement would see two different states."""

    def __init__(self, sql, commit) -> None:
        self._sql, self._commit, self._fired = sql, commit, False

    def __getattr__(self, name):
        return getattr(self._sql, name)

    async def _then_commit(self, result):
        if not self._fired:
            self._fired = True
            await self._commit()
        return result

    async def one(self, *args, **kwargs):
        return await self._then_commit(await self._sql.one(*args, **kwargs))

    async def rows(self, *args, **kwargs):
        return await self._then_commit(await self._sql.rows(*args, **kwargs))


async def test_a_thought_read_as_indexed_always_shows_its_decision(make_env):
    """The worker marks a thought's chunks indexed in the transaction that records its decision. A read of the
    thought that the worker's commit lands in the middle of must still show one state: pending and not indexed, or
    decided and indexed, never indexed with its decision pending (a client waiting for "indexed" then reads no
    decision)."""
    env = await make_env()
    t = await env.thoughts()
    env.emb.set(OLD, basis(0))
    captured = await t.capture(OLD)
    store = await env.stores.open("org_a")
    racing = Thoughts(_WorkerCommitsAfterFirstRead(store.sql, env.drain), store.vectors, env.emb)
    seen = await racing.get(captured.id)
    assert (seen.indexing.state, seen.decision.action) in {("pending", "pending"), ("indexed", "created")}
    after = await t.get(captured.id)  # the round did commit
    assert (after.indexing.state, after.decision.action) == ("indexed", "created")
