"""Write-time decisions (memory-layer-lessons): the similarity bands, the model's answer validated, the
fallbacks without a model, merge / replace ordering and history, contradiction links; in process, with a
scripted embedder (exact similarities) and a scripted LLM (a test double of the LLM port). Every capture here waits
for its decision (``wait=True``); the decisions the worker makes for captures that did not wait are
tests/test_deferred_decisions.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.thoughts.decisions import Decisions, Similar, validate_answer
from services.errors import BackendError
from services.enrichment.llm_budget import BudgetedLLM, LLMBudget
from services.ports import SqlDatabase, VectorIndex
from services.search.recent_vectors import RecentVectors
from services.search.indexing import EmbedStage
from services.storage.scoped import OrgSql, OrgVectors
from services.storage.stores import EmbeddedOrgStores, OrgStore
from services.thoughts.thoughts import Thoughts
from services.jobs.worker import JobWorker
from tests.decision_doubles import ScriptedEmbedder, ScriptedLLM, basis, near
from tests.stores import job_handlers, make_stores

OLD = "The team offsite is in Lisbon in the first week of May."
NEW = "The team offsite moved to Porto for the first week of May."


async def _noop(sql, vectors, embedder, job):
    return None


@dataclass
class Env:
    control: SqlDatabase
    stores: EmbeddedOrgStores
    org: dict[str, OrgStore]  # each organization's own database and vector index
    emb: ScriptedEmbedder
    recent: RecentVectors
    worker: JobWorker

    @property
    def db(self) -> SqlDatabase:
        """org_a's database (the organization most tests write to)."""
        return self.org["org_a"].db

    @property
    def index(self) -> VectorIndex:
        """org_a's vector index."""
        return self.org["org_a"].index

    def thoughts(self, org: str = "org_a", llm=None, *, recent: bool = True, decide: bool = True) -> Thoughts:
        sql, vec = self.org[org].sql, self.org[org].vectors
        dec = Decisions(sql, vec, self.emb, llm=llm, recent=self.recent if recent else None) if decide else None
        return Thoughts(sql, vec, self.emb, decisions=dec)

    async def drain(self) -> None:
        for org in self.org:
            self.worker.wake(org)
        await self.worker.drain()

    async def existing(self, t: Thoughts, text: str = OLD, vector=None) -> str:
        self.emb.set(text, basis(0) if vector is None else vector)
        res = await t.capture(text, wait=True)
        assert res.created and res.decision.action == "created"
        await self.drain()
        return res.id

    async def count(self, sql: str, *params) -> int:
        """The count over every organization's database (what the service stored anywhere)."""
        return sum([(await store.db.execute(sql, params)).rows[0]["n"] for store in self.org.values()])

    async def docs(self, org: str = "org_a") -> list[str]:
        rows = (await self.org[org].db.execute(
            "SELECT content FROM documents WHERE organization_id = ? ORDER BY created_at", (org,))).rows
        return [r["content"] for r in rows]


@pytest.fixture
async def env(tmp_path):
    emb = ScriptedEmbedder()
    control, stores = await make_stores(tmp_path, emb)
    org = {o: await stores.open(o) for o in ("org_a", "org_b")}
    recent = RecentVectors()
    worker = JobWorker(stores, emb, handlers={"enrich": _noop}, stages={"embed": EmbedStage(recent=recent)})
    yield Env(control, stores, org, emb, recent, worker)
    await stores.close()
    await control.close()


# -- the bands, with a model ------------------------------------------------------------------------

async def test_near_identical_is_blocked_without_asking_the_model(env):
    llm = ScriptedLLM()
    t = env.thoughts(llm=llm)
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.97))
    res = await t.capture(NEW, wait=True)
    assert (res.id, res.created) == (old, False)
    assert res.decision.action == "duplicate" and res.decision.related_id == old
    assert "similarity" in res.decision.reason and res.decision.similarity == pytest.approx(0.97, abs=1e-3)
    assert llm.calls == [] and await env.docs() == [OLD]  # nothing new stored


async def test_identical_content_is_still_the_same_id_first(env):
    llm = ScriptedLLM()
    t = env.thoughts(llm=llm)
    old = await env.existing(t)
    res = await t.capture(OLD, wait=True)
    assert (res.id, res.created, res.decision.action, res.decision.reason) == (old, False, "duplicate", "identical content")
    assert llm.calls == [] and env.emb.embedded.count(OLD) == 1  # the hash answered: no embedding, no query


async def test_flag_band_contradiction_links_both(env):
    llm = ScriptedLLM({"action": "contradiction", "conflicting_id": "m1", "reason": "the city differs"})
    t = env.thoughts(llm=llm)
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.9))
    res = await t.capture(NEW, wait=True)
    assert res.created and res.decision.action == "contradiction" and res.decision.related_id == old
    assert res.decision.reason == "the city differs"
    # the combined prompt of the seed, with the candidate offered under a short id
    assert "Prioritise in this order" in llm.prompt and '[id: "m1"]' in llm.prompt and OLD in llm.prompt
    assert llm.calls[0]["schema"]["properties"]["action"]["enum"] == ["contradiction", "replace", "merge", "keep_both"]
    new_links = (await t.get(res.id)).links
    old_links = (await t.get(old)).links
    assert [(link.thought_id, link.kind, link.direction, link.reason) for link in new_links] == [
        (old, "contradicts", "outgoing", "the city differs")]
    assert [(link.thought_id, link.direction) for link in old_links] == [(res.id, "incoming")]
    # deleting either removes the link from the other
    await t.delete(res.id)
    assert (await t.get(old)).links == []


async def test_flag_band_replace_moves_the_old_one_to_history(env):
    llm = ScriptedLLM({"action": "replace", "target_id": "m1"})
    t = env.thoughts(llm=llm)
    old = await env.existing(t)
    old_chunks = [c.id for c in (await t.get(old)).chunks]
    assert await env.index.get_by_ids([f"org_a:{c}" for c in old_chunks])
    env.emb.set(NEW, near(0, 1, 0.9))
    res = await t.capture(NEW, wait=True)
    assert res.created and res.decision.action == "replaced" and res.decision.related_id == old
    assert await env.docs() == [NEW]
    assert await env.count("SELECT COUNT(*) AS n FROM chunks WHERE parent_id = ?", old) == 0
    assert await env.index.get_by_ids([f"org_a:{c}" for c in old_chunks]) == []  # old vectors gone
    detail = await t.get(res.id)
    assert [(h.original_id, h.action, h.content) for h in detail.history] == [(old, "replaced", OLD)]
    # the repeated capture of the replaced content answers with the replacement, not a second round
    again = await t.capture(OLD, wait=True)
    assert (again.id, again.created, again.decision.action) == (res.id, False, "duplicate")
    assert "replaced by" in again.decision.reason and len(llm.calls) == 1


async def test_flag_band_merge_keeps_both_originals_in_history_and_restores(env):
    llm = ScriptedLLM(lambda messages: {"action": "merge", "target_id": old_id[0],  # the real id is accepted too
                                        "merged_content": "The team offsite: Porto (was Lisbon), first week of May."})
    t = env.thoughts(llm=llm)
    old_id = [await env.existing(t)]
    env.emb.set(NEW, near(0, 1, 0.88))
    res = await t.capture(NEW, source="chat", metadata={"k": 1}, wait=True)
    assert res.created and res.decision.action == "merged" and res.decision.related_id == old_id[0]
    detail = await t.get(res.id)
    assert detail.content.startswith("The team offsite: Porto") and detail.source == "chat"
    assert await env.docs() == [detail.content]
    hist = await t.history.list(res.id)
    assert {(h.original_id, h.content) for h in hist.entries} == {(old_id[0], OLD), (None, NEW)}
    assert {h.action for h in hist.entries} == {"merged"}
    # the merged thought is embedded by the job (its content was never embedded at capture)
    await env.drain()
    assert (await t.get(res.id)).indexing.state == "indexed"
    # restore the incoming original: a new thought through the normal write path, gone from the history
    entry = next(h for h in hist.entries if h.original_id is None)
    restored = await t.history.restore(res.id, entry.id)
    assert restored.created and restored.decision.action == "created"
    assert (await t.get(restored.id)).content == NEW and (await t.get(restored.id)).metadata == {"k": 1}
    assert [h.original_id for h in (await t.history.list(res.id)).entries] == [old_id[0]]
    assert len(llm.calls) == 1  # a restore asks no model
    # purge: one entry, then all; a purged history is empty but the thought is still there
    await t.history.purge(res.id)
    assert (await t.history.list(res.id)).entries == []


async def test_candidate_band_asks_only_about_contradiction(env):
    llm = ScriptedLLM({"action": "contradiction", "conflicting_id": "m1", "reason": "dates conflict"})
    t = env.thoughts(llm=llm)
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.6))
    res = await t.capture(NEW, wait=True)
    assert res.decision.action == "contradiction" and res.decision.related_id == old
    assert "Prioritise" not in llm.prompt and "DIRECTLY CONFLICT" in llm.prompt
    assert llm.calls[0]["schema"]["properties"]["action"]["enum"] == ["contradiction", "keep_both"]
    # a merge is not an answer this band allows
    llm.then({"action": "merge", "target_id": "m1", "merged_content": "x"})
    third = "The offsite budget is per person."
    env.emb.set(third, near(0, 2, 0.5))
    res = await t.capture(third, wait=True)
    assert res.created and res.decision.action == "kept_both" and "not allowed" in res.decision.reason
    assert len(await env.docs()) == 3


async def test_below_the_candidate_band_no_model_is_asked(env):
    llm = ScriptedLLM()
    t = env.thoughts(llm=llm)
    await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.3))
    res = await t.capture(NEW, wait=True)
    assert res.created and res.decision.action == "created" and res.decision.related_id is None
    assert llm.calls == []


# -- invalid answers --------------------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    {"action": "delete", "target_id": "m1"},
    {"action": "replace", "target_id": "m9"},
    {"action": "replace", "target_id": "doc_not_a_candidate"},
    {"action": "contradiction"},
    {"action": "merge", "target_id": "m1"},
    {"action": "merge", "target_id": "m1", "merged_content": "   "},
    {"action": ["replace"], "target_id": "m1"},
    "not json at all",
    None,
    [{"action": "replace", "target_id": "m1"}],
    BackendError("model unreachable"),
    ValueError("garbage JSON"),
])
async def test_invalid_model_answers_keep_both(env, answer):
    llm = ScriptedLLM(answer)
    t = env.thoughts(llm=llm)
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.9))
    res = await t.capture(NEW, wait=True)
    assert res.created and res.decision.action == "kept_both" and res.decision.related_id == old
    assert res.decision.reason
    assert await env.docs() == [OLD, NEW] and (await t.get(old)).history == []
    assert await env.count("SELECT COUNT(*) AS n FROM thought_links") == 0


def test_replace_or_merge_needs_a_candidate_of_the_flag_band_and_whole_inputs():
    offered = {"m1": Similar("old", 0.9), "m2": Similar("weak", 0.5)}
    plan = validate_answer({"action": "replace", "target_id": "m2"}, offered, band="flag")
    assert plan.action == "keep_both" and "below" in plan.reason and plan.related_id == "old"
    plan = validate_answer({"action": "merge", "target_id": "m1", "merged_content": "x"}, offered, band="flag",
                           new_truncated=True)
    assert plan.action == "keep_both" and "too long" in plan.reason
    plan = validate_answer({"action": "merge", "target_id": "m1", "merged_content": "x" * 20}, offered, band="flag",
                           max_content_bytes=10)
    assert plan.action == "keep_both" and "size" in plan.reason
    assert validate_answer({"action": "replace", "target_id": "old"}, offered, band="flag").action == "replace"
    contradiction = validate_answer({"action": "contradiction", "conflicting_id": "m2", "reason": "x" * 500}, offered,
                                    band="candidate")
    assert contradiction.action == "contradiction" and contradiction.related_id == "weak"
    assert len(contradiction.reason) <= 200


# -- without a model --------------------------------------------------------------------------------

@pytest.mark.parametrize("cos, action", [(0.97, "duplicate"), (0.9, "flagged"), (0.6, "created"), (0.2, "created")])
async def test_without_a_model(env, cos, action):
    t = env.thoughts(llm=None)
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, cos))
    res = await t.capture(NEW, wait=True)
    assert res.decision.action == action
    assert res.created == (action != "duplicate")
    if action in ("duplicate", "flagged"):
        assert res.decision.related_id == old and "similarity" in res.decision.reason


async def test_over_budget_behaves_as_without_a_model(env):
    inner = ScriptedLLM({"action": "replace", "target_id": "m1"})
    sql = OrgSql(env.control, "org_a")  # usage is counted in the control database, as Memex.budgeted_llm does
    t = env.thoughts(llm=BudgetedLLM(inner, sql, LLMBudget(calls_per_day=0, tokens_per_day=0)))
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.9))
    res = await t.capture(NEW, wait=True)
    assert res.created and res.decision.action == "flagged" and res.decision.related_id == old
    assert "budget" in res.decision.reason and inner.calls == []
    env.emb.set("A third one.", near(0, 2, 0.6))
    assert (await t.capture("A third one.", wait=True)).decision.action == "created"


async def test_a_changed_number_is_never_blocked_as_a_duplicate(env):
    t = env.thoughts(llm=None)
    old = await env.existing(t, "The standup is at 9:30 every day.")
    env.emb.set("The standup is at 10:30 every day.", near(0, 1, 0.97))
    res = await t.capture("The standup is at 10:30 every day.", wait=True)
    assert res.created and res.decision.action == "flagged" and res.decision.related_id == old


async def test_a_long_thought_matching_on_its_first_chunk_is_not_blocked(env):
    t = env.thoughts(llm=None)
    first = "Intro paragraph of the design record. " * 5
    old = await env.existing(t, first.strip())
    long = first + "\n\n" + "Further details about the rollout and its many steps. " * 60
    from services.text.chunking import chunk_text, default_chunk_params

    mt, ov = default_chunk_params(env.emb)
    pieces = chunk_text(long, count_tokens=env.emb.count_tokens, max_tokens=mt, overlap_tokens=ov)
    assert len(pieces) > 1
    env.emb.set(pieces[0], near(0, 1, 0.99))
    res = await t.capture(long, wait=True)
    assert res.created and res.decision.action == "flagged" and res.decision.related_id == old


# -- ordering and failure ---------------------------------------------------------------------------

async def test_replace_writes_the_new_thought_before_removing_the_old(env):
    order = []

    class Spy:
        def __init__(self, index):
            self.index = index
            self.dimensions = index.dimensions

        def __getattr__(self, name):
            return getattr(self.index, name)

        async def delete_by_ids(self, ids):
            docs = await env.docs()
            order.append(("vectors deleted", docs))
            return await self.index.delete_by_ids(ids)

    sql = env.org["org_a"].sql
    vec = OrgVectors(Spy(env.index), "org_a")
    t = Thoughts(sql, vec, env.emb, decisions=Decisions(sql, vec, env.emb,
                                                        llm=ScriptedLLM({"action": "replace", "target_id": "m1"})))
    await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.9))
    await t.capture(NEW, wait=True)
    assert order == [("vectors deleted", [NEW])]  # rows of the old one gone, new one present, then vectors


async def test_a_failed_new_write_leaves_the_old_thought_intact(env):
    class FailingDb:
        def __init__(self, db):
            self.db = db
            self.fail = False

        def __getattr__(self, name):
            return getattr(self.db, name)

        async def batch(self, statements):
            if self.fail and statements[0].sql.startswith("INSERT INTO documents"):
                raise BackendError("the store failed")
            return await self.db.batch(statements)

    fdb = FailingDb(env.db)
    sql, vec = OrgSql(fdb, "org_a"), OrgVectors(env.index, "org_a")
    t = Thoughts(sql, vec, env.emb, decisions=Decisions(sql, vec, env.emb,
                                                        llm=ScriptedLLM({"action": "replace", "target_id": "m1"})))
    old = await env.existing(t)
    chunks = [c.id for c in (await t.get(old)).chunks]
    env.emb.set(NEW, near(0, 1, 0.9))
    fdb.fail = True
    with pytest.raises(BackendError):
        await t.capture(NEW, wait=True)
    assert await env.docs() == [OLD]
    assert (await t.get(old)).indexing.state == "indexed"
    assert len(await env.index.get_by_ids([f"org_a:{c}" for c in chunks])) == len(chunks)
    assert await env.count("SELECT COUNT(*) AS n FROM thought_history") == 0


# -- tenancy, index lag, the reused embedding -------------------------------------------------------

async def test_candidates_never_come_from_another_organization(env):
    llm = ScriptedLLM({"action": "replace", "target_id": "m1"})
    b = env.thoughts("org_b", llm=llm)
    theirs = await env.existing(b)
    a = env.thoughts("org_a", llm=llm)
    env.emb.set(NEW, near(0, 1, 0.97))
    res = await a.capture(NEW, wait=True)
    assert res.created and res.decision.action == "created" and llm.calls == []
    env.emb.set("Lisbon again.", near(0, 1, 0.9))
    assert (await a.capture("Lisbon again.", wait=True)).decision.related_id == res.id  # its own, not org_b's
    assert await env.docs("org_b") == [OLD] and (await b.get(theirs)).history == []


async def test_a_thought_not_yet_in_the_index_is_still_a_candidate(env):
    t = env.thoughts(llm=None)
    env.emb.set(OLD, basis(0))
    first = await t.capture(OLD, wait=True)  # not drained: no vector in the index yet
    env.emb.set(NEW, near(0, 1, 0.97))
    res = await t.capture(NEW, wait=True)
    assert res.decision.action == "duplicate" and res.id == first.id
    # without the recent vectors the gap shows: the index alone cannot see it yet
    blind = env.thoughts(llm=None, recent=False)
    env.emb.set("Same again.", near(0, 2, 0.97))
    assert (await blind.capture("Same again.", wait=True)).decision.action == "created"


async def test_the_capture_embedding_is_reused_by_the_job(env):
    t = env.thoughts(llm=None)
    env.emb.set(OLD, basis(0))
    res = await t.capture(OLD, wait=True)
    assert env.emb.embedded == [OLD]
    await env.drain()
    assert env.emb.embedded == [OLD]  # the job took the vector computed at capture
    assert (await t.get(res.id)).indexing.state == "indexed"
    stored = await env.index.get_by_ids([f"org_a:{(await t.get(res.id)).chunks[0].id}"])
    assert float(stored[0].values @ basis(0)) == pytest.approx(1.0, abs=1e-5)


async def test_plain_write_without_decisions(env):
    t = env.thoughts(decide=False)
    await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.99))
    res = await t.capture(NEW, wait=True)
    assert res.created and res.decision.action == "created"


async def test_history_is_kept_after_the_canonical_thought_is_deleted_until_purged(env):
    from services.errors import NotFound

    t = env.thoughts(llm=ScriptedLLM({"action": "replace", "target_id": "m1"}))
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.9))
    res = await t.capture(NEW, wait=True)
    await t.delete(res.id)
    hist = await t.history.list(res.id)
    assert [h.original_id for h in hist.entries] == [old]
    restored = await t.history.restore(res.id, hist.entries[0].id)
    assert (await t.get(restored.id)).content == OLD
    with pytest.raises(NotFound):
        await t.history.list(res.id)  # no thought, no entries: unknown
    with pytest.raises(NotFound):
        await t.history.purge(res.id)


async def test_chained_supersessions_keep_every_original_under_the_newest(env):
    llm = ScriptedLLM({"action": "replace", "target_id": "m1"}, {"action": "replace", "target_id": "m1"})
    t = env.thoughts(llm=llm)
    await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.9))
    second = await t.capture(NEW, wait=True)
    third_text = "The team offsite is cancelled this year."
    env.emb.set(third_text, 0.9 * near(0, 1, 0.9) + 0.43589 * basis(2))  # 0.9 from the second
    third = await t.capture(third_text, wait=True)
    assert third.decision.action == "replaced" and third.decision.related_id == second.id
    contents = [h.content for h in (await t.history.list(third.id)).entries]
    assert sorted(contents) == sorted([OLD, NEW])


@pytest.mark.parametrize("action", ["replace", "merge"])
async def test_a_failed_move_to_history_keeps_everything(env, action):
    class FailingDb:
        def __init__(self, db):
            self.db = db

        def __getattr__(self, name):
            return getattr(self.db, name)

        async def batch(self, statements):
            if any("INSERT INTO thought_history" in st.sql for st in statements):
                raise BackendError("the store failed")
            return await self.db.batch(statements)

    answer = {"action": action, "target_id": "m1", "merged_content": "Offsite: Porto, not Lisbon, first week of May."}
    fdb = FailingDb(env.db)
    sql, vec = OrgSql(fdb, "org_a"), OrgVectors(env.index, "org_a")
    t = Thoughts(sql, vec, env.emb, decisions=Decisions(sql, vec, env.emb, llm=ScriptedLLM(answer)))
    old = await env.existing(t)
    env.emb.set(NEW, near(0, 1, 0.9))
    res = await t.capture(NEW, wait=True)
    assert res.created and res.decision.action == "kept_both" and "failed" in res.decision.reason
    assert (await t.get(old)).content == OLD
    assert NEW in await env.docs() and OLD in await env.docs()


async def test_lexical_gate_skips_the_model_only_when_nothing_could_be_close(tmp_path):
    """Without a language model only >= 0.85 similarity changes the outcome; the gate embeds a capture only
    when an existing thought shares enough of its words, and still blocks near-duplicates."""
    from services.adapters.hash_embedder import HashEmbedder
    from services.thoughts.decisions import Decisions
    from services.thoughts.thoughts import Thoughts
    from services.jobs.worker import JobWorker

    class CountingEmbedder(HashEmbedder):
        calls = 0

        async def embed(self, texts):
            CountingEmbedder.calls += 1
            return await super().embed(texts)

    emb = CountingEmbedder()
    control, stores = await make_stores(tmp_path, emb, orgs=("org_g",))
    store = await stores.open("org_g")
    sql, vec = store.sql, store.vectors
    t = Thoughts(sql, vec, emb, decisions=Decisions(sql, vec, emb, lexical_gate=True))
    first = await t.capture("The quarterly planning offsite moves to the Lisbon office in March.", wait=True)
    await JobWorker(stores, emb, handlers=job_handlers()).drain()
    before = CountingEmbedder.calls
    novel = await t.capture("Sourdough starters need feeding twice daily with rye flour.", wait=True)
    assert novel.decision.action == "created" and CountingEmbedder.calls == before  # no model run on the request path
    near = await t.capture("The quarterly planning offsite moves to the Lisbon office in March!", wait=True)
    assert CountingEmbedder.calls > before
    assert near.decision.action in ("duplicate", "flagged") and near.decision.related_id == first.id
    await stores.close()
    await control.close()
